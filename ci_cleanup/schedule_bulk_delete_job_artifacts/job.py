"""``Ci::ScheduleBulkDeleteJobArtifactCronWorker`` on Dagster.

``schedule_bulk_delete_job_artifacts``: schedule_buckets (flags, stale and missing buckets) -> run_bucket_workers
(GitLab's ``perform_with_capacity``, :mod:`ci_cleanup.gitlab.limited_capacity`) -> report_destroyed_job_artifacts.
The workers are threads of one op in the run's process: they wait on PostgreSQL, not on Python, and a process each
would pay Dagster's start-up again.

GitLab's workers take any free bucket (SPOP). Here worker i asks for bucket i: a worker with nothing to do may be
done before the next one starts, and one taking "any" would often re-take the bucket just released and leave others
unprocessed. A bucket another process holds is not processed by this run, as in GitLab. Free members at or above
max_buckets (a scale-down) or not written as GitLab writes them ("007") are retired by schedule_buckets, so a run
never has more than max_buckets workers.

The stored files of the artifacts it deletes are removed by ``delete_expired_artifact_files`` (:mod:`.files_job`).
"""

import datetime as dt
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Literal

from dagster import OpExecutionContext, op
from pydantic import Field

from ..batch import RunMode, Start, batch_job, find_process_report, finish, paced, skipped, start
from ..gitlab import artifact_buckets, feature_flags, limited_capacity
from ..gitlab.loop_helpers import Hooks
from ..gitlab.schema import utc_now
from ..resources import GitLabDatabase, GitLabRedis, RunOptions
from ..runs import MAX_IDS_REPORTED, ROWS_CHANGED, BatchObserver, table
from ..settings import BoundedConfig
from . import service
from .uses import USES

ARTIFACTS = ("gitlab", "ci_job_artifacts")
DELETED_OBJECTS = ("gitlab", "ci_deleted_objects")
# The per-bucket table of run_bucket_workers: the seed's per-worker log fields, and how each worker ended.
WORKER_COLUMNS = [
    "mod_bucket", "claimed", "destroyed_job_artifacts_count", "artifacts_empty", "terminated_early_due_to_scale_down",
    "stopped_by_feature_flag", "batches", "size",
]


class BulkDeleteJobArtifactsConfig(BoundedConfig):
    batch_size: int = Field(default=service.BATCH_SIZE, ge=1, le=1000, description="Artifacts per batch (GitLab's 100)")
    max_batches: int = Field(
        default=service.MAX_BATCHES, ge=1, le=10_000, description="Batches per bucket worker run (GitLab's 500)"
    )
    max_runtime_seconds: int = Field(
        default=int(service.MAX_RUNTIME.total_seconds()), ge=1, le=3600,
        description="A bucket worker stops starting batches after this long (GitLab's 5 minutes)",
    )
    feature_flag: Literal["env", "as_gitlab", "on"] = Field(
        default="env",
        description=f"as_gitlab: {service.FEATURE_FLAG} as GitLab decides it; on: on for ci_cleanup alone; "
        f"env: on if env {feature_flags.FLAGS_ON_ENV} lists it, else as_gitlab",
    )


def flag_rule(config: BulkDeleteJobArtifactsConfig, release_like: list[str]) -> tuple[service.FlagRule, dict]:
    """The flags' defaults and the operator's override, and what the run's metadata says of them. A definition file
    that cannot be used fails the run here, naming it, before anything is changed."""
    rails = feature_flags.rails_dir()
    default = feature_flags.default_enabled(service.FEATURE_FLAG, release_like, rails)
    concurrency = feature_flags.default_enabled(service.HIGH_CONCURRENCY_FLAG, release_like, rails)
    forced = config.feature_flag == "on" or (
        config.feature_flag == "env" and feature_flags.on_for_ci_cleanup(service.FEATURE_FLAG))
    return service.FlagRule(forced, default.enabled, concurrency.enabled), {
        "flag_default_enabled": default.enabled, "flag_default_from": default.source,
        **({"flag_definition": default.definition} if default.definition else {}), "flag_on_for_ci_cleanup": forced}


def _flag_metadata(rule: dict, flags: service.Flags) -> dict:
    """Which decided bulk_delete_job_artifacts, as Feature.enabled? reads it (gate / definition / release_default /
    ci_cleanup), and the flags found."""
    default = feature_flags.FlagDefault(rule["flag_default_enabled"], rule["flag_default_from"])
    decided = feature_flags.decided_by(rule["flag_on_for_ci_cleanup"], default, flags.persisted, flags.gated)
    return {"flag_enabled": flags.enabled, "flag_decided_by": decided, **rule}


@dataclass(frozen=True)
class BulkDeletePlan:
    start: Start
    limits: service.Limits = service.Limits()
    buckets: artifact_buckets.ScheduledBuckets | None = None
    # dry run only: bucket -> (expired deletable artifacts, their first ids)
    would_delete: dict[int, tuple[int, list[int]]] = field(default_factory=dict)


def _bucket_metadata(buckets: artifact_buckets.ScheduledBuckets | None) -> dict:
    if buckets is None:
        return {}
    return {
        "max_buckets": buckets.max_buckets,
        "available_count": buckets.available_count,
        "occupied_count": buckets.occupied_count,
        "stale_count": buckets.stale_count,
        "missing_count": buckets.missing_count,
        "stray_count": buckets.stray_count,
        "strays": list(buckets.strays),
    }


@op
def schedule_buckets(
    context: OpExecutionContext, config: BulkDeleteJobArtifactsConfig,
    gitlab_db: GitLabDatabase, gitlab_redis: GitLabRedis, run_options: RunOptions,
) -> BulkDeletePlan:
    """The cron worker: flag gate, stale buckets recovered, missing buckets added, max_buckets workers planned."""
    schema = gitlab_db.schema
    now = utc_now()
    begun = start(context, run_options)
    gitlab_tables = gitlab_db.require(USES)
    rule, rule_metadata = flag_rule(config, gitlab_tables["gitlab_release_like"])
    with gitlab_db.engine_for(schema.feature_gates).connect() as conn:
        flags = service.read_flags(conn, schema, rule)
    gitlab_tables = {**gitlab_tables, **_flag_metadata(rule_metadata, flags)}
    if begun.mode is RunMode.DRY_RUN and flags.enabled:
        with gitlab_db.engine_for(schema.ci_job_artifacts).connect() as conn:
            per_bucket_ids = max(1, MAX_IDS_REPORTED // flags.max_buckets)
            would_delete = service.count_expired_by_bucket(conn, schema, now, flags.max_buckets, per_bucket_ids)
    limits = service.Limits(config.batch_size, config.max_batches, dt.timedelta(seconds=config.max_runtime_seconds),
                            rule)
    if not flags.enabled:
        # GitLab's cron worker: flag off -> return at once; not even the buckets are touched.
        context.log.info(f"Feature flag {service.FEATURE_FLAG} is disabled; nothing to do")
        off = skipped(f"{service.FEATURE_FLAG} disabled")
        context.add_output_metadata({**gitlab_tables, **off.metadata})
        return BulkDeletePlan(off, limits)
    if begun.mode is RunMode.DRY_RUN:
        buckets = artifact_buckets.preview_schedule(gitlab_redis.artifact_buckets, flags.max_buckets, now)
        context.add_output_metadata({**_bucket_metadata(buckets), **gitlab_tables, **begun.metadata,
                                     **gitlab_redis.store_used("artifact_buckets")})
        return BulkDeletePlan(begun, limits, buckets, would_delete)
    buckets = artifact_buckets.schedule(gitlab_redis.artifact_buckets, flags.max_buckets, now)
    if buckets.stray_count:
        context.log.warning(
            f"Retired {buckets.stray_count} stray members of {artifact_buckets.AVAILABLE_KEY} (not a bucket below "
            f"{flags.max_buckets} as GitLab writes it): {list(buckets.strays)}"
        )
    if buckets.missing_count:
        context.log.info(
            f"Added {buckets.missing_count} buckets to {artifact_buckets.AVAILABLE_KEY} (missing_count): "
            + ("none existed yet, a first run" if not (buckets.available_count or buckets.occupied_count)
               else "lost, or max_buckets raised")
        )
    context.log.info(f"Scheduled buckets: {_bucket_metadata(buckets)}")
    context.add_output_metadata({**_bucket_metadata(buckets), **gitlab_tables, **begun.metadata,
                                 **gitlab_redis.store_used("artifact_buckets")})
    return BulkDeletePlan(begun, limits, buckets)


STOPPING = "Run interrupted, stopping the bucket workers"


class BucketWorkerFailed(limited_capacity.WorkersFailed):
    """A bucket worker raised; its bucket stays occupied until stale recovery (the other workers finished)."""

    what = "bucket worker"
    note = " (a claimed bucket stays occupied until stale recovery, 10 minutes)"


@dataclass(frozen=True)
class BucketWorkersDone:
    plan: BulkDeletePlan
    results: list[service.WorkerResult]  # by bucket; none when the run had no workers to run


@op
def run_bucket_workers(
    context: OpExecutionContext, plan: BulkDeletePlan, gitlab_db: GitLabDatabase, gitlab_redis: GitLabRedis
) -> BucketWorkersDone:
    """``BulkDeleteExpiredJobArtifactsWorker.perform_with_capacity``: max_buckets workers at once, worker i on bucket
    i, each a thread with its own connection; the batches observed on ci_job_artifacts as they go."""
    if not plan.start.runs:
        return BucketWorkersDone(plan, [])
    workers, schema = plan.buckets.max_buckets, gitlab_db.schema
    observer = BatchObserver(context, ARTIFACTS, ["mod_bucket", "artifact_id"], log_name="destroyed_job_artifacts",
                             keys=["destroyed_job_artifacts_count", "size", "deleted_objects"], brake=plan.start.brake)
    # Each worker holds a connection for its whole run: an engine of exactly that many for this op. It reads GitLab's
    # flags in main and deletes in ci: a connection to each when decomposed; on one database, each batch reads them.
    artifacts = gitlab_db.dedicated_engine(schema.ci_job_artifacts, workers)
    flags = gitlab_db.dedicated_engine(schema.feature_gates, workers) if gitlab_db.decomposed else nullcontext()
    paced_run = paced(context, plan.start, gitlab_db, schema.ci_job_artifacts)
    with observer, artifacts as engine, flags as flags_engine, paced_run:

        def perform_work(bucket: int, hand_over, stop) -> service.WorkerResult:
            return service.run_bucket_worker(
                engine, gitlab_redis.artifact_buckets, schema, plan.limits,
                Hooks(on_batch=lambda claimed, batch: hand_over(batch), brake=plan.start.brake, stop=stop),
                bucket=bucket, flags_engine=flags_engine,
            )

        results = limited_capacity.perform_with_capacity(workers, perform_work, limited_capacity.Hooks(
            on_progress=lambda bucket, batch: _observe(observer, bucket, batch),
            on_ended=lambda ended: _log_workers(context, ended),
            on_stopping=lambda: context.log.warning(f"{STOPPING}: each ends the batch it is in and starts no other"),
        ), BucketWorkerFailed)
    rows = [_worker_row(bucket, result) for bucket, result in enumerate(results)]
    context.add_output_metadata({"bucket_workers": table(rows, WORKER_COLUMNS)})
    return BucketWorkersDone(plan, results)


def _observe(observer: BatchObserver, bucket: int, batch: service.DeletedBatch) -> None:
    if batch.count:  # a worker's last, empty batch is how it learns its bucket is empty: nothing to observe
        observer.add(
            {"destroyed_job_artifacts_count": batch.count, "size": batch.size,
             "deleted_objects": batch.deleted_objects},
            ({"mod_bucket": bucket, "artifact_id": i} for i in batch.ids),
        )


def _worker_row(bucket: int, result: service.WorkerResult) -> dict:
    return {
        "mod_bucket": bucket, "claimed": result.mod_bucket is not None,
        "destroyed_job_artifacts_count": result.destroyed_job_artifacts_count,
        "artifacts_empty": result.artifacts_empty,
        "terminated_early_due_to_scale_down": result.terminated_early_due_to_scale_down,
        "stopped_by_feature_flag": result.stopped_by_feature_flag, "batches": result.batches, "size": result.size,
    }


def _log_workers(context: OpExecutionContext, ended: dict[int, service.WorkerResult | BaseException]) -> None:
    """The seed's log line of each worker (``log_extra_metadata_on_done``): the lines of those that ended together
    in one event (each event is a write to the instance); a failure in an event of its own, at error level."""
    lines = []
    for bucket, result in sorted(ended.items()):
        if isinstance(result, BaseException):
            context.log.error(f"Bucket worker {bucket} failed: {limited_capacity.cause(result)}")
        elif result.mod_bucket is None:
            lines.append(f"Bucket {bucket} is not available (occupied by another worker); nothing to do")
        else:
            lines.append(
                f"Bucket worker {bucket} done: mod_bucket={result.mod_bucket}, "
                f"destroyed_job_artifacts_count={result.destroyed_job_artifacts_count}, "
                f"artifacts_empty={result.artifacts_empty}, "
                f"terminated_early_due_to_scale_down={result.terminated_early_due_to_scale_down}"
                + (", stopped: the run was terminated" if result.stopped else "")
            )
    if lines:
        context.log.info("\n".join(lines))


@op
def report_destroyed_job_artifacts(context: OpExecutionContext, done: BucketWorkersDone) -> None:
    """The cron worker's end-of-run log line, and the run's totals (a dry run's: what each bucket would lose)."""
    plan, results = done.plan, done.results
    destroyed = sum(r.destroyed_job_artifacts_count for r in results)
    would = plan.would_delete
    metadata = {
        ROWS_CHANGED: destroyed,
        "destroyed_job_artifacts_count": destroyed,
        "size": sum(r.size for r in results),
        "deleted_objects_created": sum(r.deleted_objects for r in results),
        "workers": len(results),
        "buckets_processed": sorted(r.mod_bucket for r in results if r.mod_bucket is not None),
        **_bucket_metadata(plan.buckets),
    }
    by_bucket = [
        {"mod_bucket": b, "count": count, "ids": ", ".join(map(str, ids))} for b, (count, ids) in sorted(would.items())
    ]
    finish(context, plan.start, metadata, would={
        "would_delete_count": sum(count for count, _ in would.values()),
        "would_delete_by_bucket": table(by_bucket, ["mod_bucket", "count", "ids"]),
        "would_delete_ids": {str(b): ids for b, (_, ids) in sorted(would.items())},
    })


schedule_bulk_delete_job_artifacts, schedule_bulk_delete_job_artifacts_schedule = batch_job(
    "schedule_bulk_delete_job_artifacts",
    find_process_report(schedule_buckets, run_bucket_workers, report_destroyed_job_artifacts),
    description="Delete expired job artifacts in parallel buckets "
    "(Ci::ScheduleBulkDeleteJobArtifactCronWorker and its BulkDeleteExpiredJobArtifactsWorkers)",
    seed="004",
    # GitLab alerts when the scheduler runs over 60 s; here the run also holds its workers, which
    # stop themselves after MAX_RUNTIME, so run monitoring fails a run past both.
    max_runtime_seconds=60 + int(service.MAX_RUNTIME.total_seconds()),
    cron="*/7 * * * *",
)
