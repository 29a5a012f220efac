"""``Ci::ScheduleBulkDeleteJobArtifactCronWorker`` on Dagster: the bucket scheduler, its bucket workers as parallel
steps, and the stored files' removal.

``schedule_bulk_delete_job_artifacts``: schedule_buckets (flags, stale and missing buckets) fans out one
mapped step per bucket (GitLab's ``perform_with_capacity``: max_buckets workers); each claims its
bucket and deletes the bucket's expired artifacts; report_bulk_delete collects them. The multiprocess
executor runs the workers side by side, ``max_concurrent`` bounding them.

GitLab's workers take any free bucket (SPOP). Here worker i asks for bucket i: steps may run one
after another (the in-process executor), and a worker taking "any" would often re-take the bucket
the previous one just released and leave others unprocessed. A bucket another process holds is
simply not processed by this run, as in GitLab. Free members at or above max_buckets (left by a
scale-down) or not written as GitLab writes them ("007") are retired by schedule_buckets in one step,
so a run never has more than max_buckets workers.

``delete_expired_artifact_files``: drains ``ci_deleted_objects`` (GitLab's ``Ci::DeleteObjectsWorker``).
"""

import datetime as dt
import os
from dataclasses import dataclass, field
from pathlib import Path

from dagster import (
    Config,
    DynamicOut,
    DynamicOutput,
    OpExecutionContext,
    Out,
    Output,
    multiprocess_executor,
    op,
)
from pydantic import Field

from ..batch import RunMode, Start, batch_job, finish, linear, skipped, start
from ..gitlab import artifact_buckets
from ..gitlab.schema import require_columns, utc_now
from ..resources import GitLabDatabase, GitLabRedis, RunOptions
from ..runs import MAX_IDS_REPORTED, ROWS_CHANGED, ROWS_WITH_ERRORS, BatchObserver, table, track_exception
from . import files, service

ARTIFACTS = ("gitlab", "ci_job_artifacts")
DELETED_OBJECTS = ("gitlab", "ci_deleted_objects")
MAX_PARALLEL_WORKERS = service.MAX_BUCKETS_HIGH_CONCURRENCY  # parallelism = max buckets, bounded here
# Each step is a process. Spawned, each imports dagster, ci_cleanup and the instance's storage again (about
# 1.5 s of CPU a worker: 13.6 s for a run with nothing to do); forked from one server that imported them
# once, a worker starts in a fraction of that.
WORKERS_EXECUTOR = multiprocess_executor.configured(
    {
        "max_concurrent": MAX_PARALLEL_WORKERS,
        "start_method": {"forkserver": {"preload_modules": ["ci_cleanup", "dagster_postgres"]}},
    }
)


class BulkDeleteJobArtifactsConfig(Config):
    batch_size: int = Field(default=service.BATCH_SIZE, ge=1, le=1000, description="Artifacts per batch (GitLab's 100)")
    max_batches: int = Field(
        default=service.MAX_BATCHES, ge=1, le=10_000, description="Batches per bucket worker run (GitLab's 500)"
    )
    max_runtime_seconds: int = Field(
        default=int(service.MAX_RUNTIME.total_seconds()), ge=1, le=3600,
        description="A bucket worker stops starting batches after this long (GitLab's 5 minutes)",
    )


@dataclass(frozen=True)
class BulkDeletePlan:
    start: Start
    batch_size: int = service.BATCH_SIZE
    max_batches: int = service.MAX_BATCHES
    max_runtime_seconds: int = int(service.MAX_RUNTIME.total_seconds())
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


@op(out={"plan": Out(BulkDeletePlan), "buckets": DynamicOut(int)})
def schedule_buckets(
    context: OpExecutionContext, config: BulkDeleteJobArtifactsConfig,
    gitlab_db: GitLabDatabase, gitlab_redis: GitLabRedis, run_options: RunOptions,
):
    """The cron worker: flag gate, stale buckets recovered, missing buckets added, one worker per bucket."""
    schema = gitlab_db.schema
    now = utc_now()
    begun = start(context, run_options)
    with gitlab_db.engine.connect() as conn:
        tables = [schema.ci_job_artifacts, schema.ci_deleted_objects, schema.feature_gates]
        gitlab_tables = require_columns(conn, tables)
        flags = service.read_flags(conn, schema)
        if begun.mode is RunMode.DRY_RUN and flags.enabled:
            per_bucket_ids = max(1, MAX_IDS_REPORTED // flags.max_buckets)
            would_delete = service.count_expired_by_bucket(conn, schema, now, flags.max_buckets, per_bucket_ids)
    limits = dict(
        batch_size=config.batch_size, max_batches=config.max_batches, max_runtime_seconds=config.max_runtime_seconds
    )
    if not flags.enabled:
        # GitLab's cron worker: flag off -> return at once; not even the buckets are touched.
        context.log.info(f"Feature flag {service.FEATURE_FLAG} is disabled; nothing to do")
        off = skipped(f"{service.FEATURE_FLAG} disabled")
        yield Output(BulkDeletePlan(off, **limits), "plan", metadata={"gitlab_tables": gitlab_tables, **off.metadata})
        return
    if begun.mode is RunMode.DRY_RUN:
        buckets = artifact_buckets.preview_schedule(gitlab_redis.shared_state, flags.max_buckets, now)
        yield Output(
            BulkDeletePlan(begun, buckets=buckets, would_delete=would_delete, **limits), "plan",
            metadata={**_bucket_metadata(buckets), "gitlab_tables": gitlab_tables, **begun.metadata},
        )
        return
    buckets = artifact_buckets.schedule(gitlab_redis.shared_state, flags.max_buckets, now)
    if buckets.stray_count:
        context.log.warning(
            f"Retired {buckets.stray_count} stray members of {artifact_buckets.AVAILABLE_KEY} (not a bucket below "
            f"{flags.max_buckets} as GitLab writes it): {list(buckets.strays)}"
        )
    context.log.info(f"Scheduled buckets: {_bucket_metadata(buckets)}")
    yield Output(
        BulkDeletePlan(begun, buckets=buckets, **limits), "plan",
        metadata={**_bucket_metadata(buckets), "gitlab_tables": gitlab_tables, **begun.metadata},
    )
    for bucket in range(flags.max_buckets):
        yield DynamicOutput(bucket, mapping_key=f"bucket_{bucket}", output_name="buckets")


@op
def delete_expired_artifacts_in_bucket(
    context: OpExecutionContext, plan: BulkDeletePlan, bucket: int, gitlab_db: GitLabDatabase, gitlab_redis: GitLabRedis
) -> service.WorkerResult:
    """One ``BulkDeleteExpiredJobArtifactsWorker``: claim a bucket, delete its expired artifacts, release it."""

    observer = BatchObserver(context, ARTIFACTS, ["mod_bucket", "artifact_id"], log_name="destroyed_job_artifacts")

    def on_batch(claimed: int, batch: service.DeletedBatch) -> None:
        observer.add(
            {"destroyed_job_artifacts_count": len(batch.ids), "size": batch.size,
             "deleted_objects": batch.deleted_objects},
            [{"mod_bucket": claimed, "artifact_id": i} for i in batch.ids],
        )

    with observer:
        result = service.run_bucket_worker(
            gitlab_db.engine, gitlab_redis.shared_state, gitlab_db.schema,
            bucket=bucket, batch_size=plan.batch_size, max_batches=plan.max_batches,
            max_runtime=dt.timedelta(seconds=plan.max_runtime_seconds), on_batch=on_batch,
        )
    if result.mod_bucket is None:
        context.log.info(f"Bucket {bucket} is not available (occupied by another worker); nothing to do")
    context.add_output_metadata(
        {
            "status": "bucket not available" if result.mod_bucket is None else "success",
            "mod_bucket": bucket,
            "claimed": result.mod_bucket is not None,
            "destroyed_job_artifacts_count": result.destroyed_job_artifacts_count,
            "artifacts_empty": result.artifacts_empty,
            "terminated_early_due_to_scale_down": result.terminated_early_due_to_scale_down,
            "stopped_by_feature_flag": result.stopped_by_feature_flag,
            "batches": result.batches,
            "size": result.size,
        }
    )
    return result


@op
def report_bulk_delete(context: OpExecutionContext, plan: BulkDeletePlan, results: list[service.WorkerResult]) -> None:
    """The cron worker's end-of-run log line, and the run's totals."""
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


def _bucket_workers() -> None:
    plan, buckets = schedule_buckets()
    results = buckets.map(lambda bucket: delete_expired_artifacts_in_bucket(plan, bucket))
    report_bulk_delete(plan, results.collect())


schedule_bulk_delete_job_artifacts, schedule_bulk_delete_job_artifacts_schedule = batch_job(
    "schedule_bulk_delete_job_artifacts", _bucket_workers,
    description="Delete expired job artifacts in parallel buckets "
    "(Ci::ScheduleBulkDeleteJobArtifactCronWorker and its BulkDeleteExpiredJobArtifactsWorkers)",
    seed="004",
    executor_def=WORKERS_EXECUTOR,
    # GitLab alerts when the scheduler runs over 60 s; here the run also holds its workers, which
    # stop themselves after MAX_RUNTIME, so run monitoring fails a run past both.
    max_runtime_seconds=60 + int(service.MAX_RUNTIME.total_seconds()),
    cron="*/7 * * * *",
)


ARTIFACTS_ROOT_ENV = "CI_CLEANUP_ARTIFACTS_ROOT"
# The files job runs every 10 minutes: a run still going when the next is due is failed (and alerted) by
# run monitoring rather than left to hold the run queue.
FILES_MAX_RUNTIME_SECONDS = 10 * 60


class DeleteExpiredArtifactFilesConfig(Config):
    artifacts_root: str | None = Field(
        default=None,
        description=f"Local artifacts storage (GitLab's artifacts path); default env {ARTIFACTS_ROOT_ENV}. "
        "Unset: local files are reported and left",
    )
    batch_size: int = Field(default=files.BATCH_SIZE, ge=1, le=1000, description="Rows per batch (GitLab's 100)")
    max_batches: int = Field(default=files.MAX_BATCHES, ge=1, le=10_000, description="Batches per run")


@dataclass(frozen=True)
class FilesPlan:
    start: Start
    root: str | None
    batch_size: int
    max_batches: int
    due_by_store: dict[int, int]
    would: dict = field(default_factory=dict)  # dry run: what a run would remove, leave and refuse


@op
def plan_artifact_file_removal(
    context: OpExecutionContext, config: DeleteExpiredArtifactFilesConfig, gitlab_db: GitLabDatabase,
    run_options: RunOptions,
) -> FilesPlan:
    """Check the schema and the artifacts root, and count the due rows by storage."""
    schema = gitlab_db.schema
    root = config.artifacts_root or os.environ.get(ARTIFACTS_ROOT_ENV) or None
    if root is not None and not (os.path.isabs(root) and os.path.isdir(root)):
        # A wrong root would make every file look "already gone" and drop its row: refuse to start.
        raise ValueError(f"artifacts_root {root!r} is not an absolute path to an existing directory")
    begun = start(context, run_options)
    would = {}
    with gitlab_db.engine.connect() as conn:
        gitlab_tables = require_columns(conn, [schema.ci_deleted_objects])
        due_by_store = files.count_due(conn, schema, utc_now())
        if begun.mode is RunMode.DRY_RUN:
            preview = files.preview(conn, schema, Path(root) if root else None, utc_now(), MAX_IDS_REPORTED)
            would = {
                **{f"would_{k}": v for k, v in _files_counts(preview).items()},
                "would_delete_row_ids": (preview.removed + preview.missing)[:MAX_IDS_REPORTED],
                "object_storage_ids": preview.object_storage[:MAX_IDS_REPORTED],
                "refused": [f"row {i}: {why}" for i, why in preview.refused[:MAX_IDS_REPORTED]],
            }
    if root is None:
        context.log.warning(f"No artifacts root ({ARTIFACTS_ROOT_ENV} or artifacts_root): local files are left")
    context.add_output_metadata(
        {"due_count": sum(due_by_store.values()), "artifacts_root": root, "gitlab_tables": gitlab_tables,
         **begun.metadata}
    )
    return FilesPlan(begun, root, config.batch_size, config.max_batches, due_by_store, would)


def _files_counts(batch: files.FilesBatch) -> dict:
    return {
        "removed": len(batch.removed), "missing": len(batch.missing), "object_storage": len(batch.object_storage),
        "no_root": len(batch.no_root), "refused": len(batch.refused),
    }


@op
def remove_expired_artifact_files(
    context: OpExecutionContext, plan: FilesPlan, gitlab_db: GitLabDatabase
) -> files.FilesResult:
    """Remove the due local files and their rows, 100 at a time."""
    if not plan.start.runs:
        return files.FilesResult()
    root = Path(plan.root) if plan.root else None

    def report_error(row_id: int, error: BaseException) -> None:
        track_exception(context, error, ci_deleted_object_id=row_id)

    with BatchObserver(context, DELETED_OBJECTS) as observer:
        return files.delete_expired_artifact_files(
            gitlab_db.engine, gitlab_db.schema, root, batch_size=plan.batch_size, max_batches=plan.max_batches,
            on_batch=lambda batch: observer.add(_files_counts(batch)), report_error=report_error,
        )


@op
def report_removed_artifact_files(context: OpExecutionContext, plan: FilesPlan, result: files.FilesResult) -> None:
    finish(
        context, plan.start,
        {
            ROWS_CHANGED: result.rows_deleted,
            "files_removed": result.removed,
            "files_missing": result.missing,
            "object_storage_left": result.object_storage,
            "local_left_without_root": result.no_root,
            "refused_count": len(result.refused),
            ROWS_WITH_ERRORS: len(result.refused),
            "refused": [f"row {i}: {why}" for i, why in result.refused[:MAX_IDS_REPORTED]],
            "batches": result.batches,
            "due_count": sum(plan.due_by_store.values()),
            "due_object_storage": plan.due_by_store.get(2, 0),
        },
        would=plan.would,
    )


delete_expired_artifact_files, delete_expired_artifact_files_schedule = batch_job(
    "delete_expired_artifact_files",
    linear(plan_artifact_file_removal, remove_expired_artifact_files, report_removed_artifact_files),
    description="Remove the stored files of deleted artifacts (ci_deleted_objects, GitLab's Ci::DeleteObjectsWorker)",
    seed="004", max_runtime_seconds=FILES_MAX_RUNTIME_SECONDS, cron="*/10 * * * *",
)
