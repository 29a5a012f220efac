"""Seed 000 on Dagster: ``Ci::StuckBuilds::DropCancelingWorker`` as a job and its hourly schedule.

find (schema check, lease, count) -> drop (the batches) -> report (metadata, lease released).
"""

import datetime as dt
from dataclasses import dataclass

from dagster import Config, OpExecutionContext, ScheduleDefinition, job, op
from pydantic import Field

from ..gitlab.schema import naive_utc, require_columns, utc_now
from ..resources import GitLabDatabase, GitLabRedis, RunOptions
from ..runs import (
    MAX_IDS_REPORTED, ROWS_CHANGED, ROWS_WITH_ERRORS, BatchObserver, mark_dry_run, release_lease_on_failure, report_run,
    run_lease, skip_for_held_lease, track_exception,
)
from . import service

LEASE_KEY = "ci/stuck_builds/drop_canceling_worker"
LEASE_TTL_SECONDS = 30 * 60
ASSET = ("gitlab", "ci_builds")


class DropCancelingBuildsConfig(Config):
    timeout_minutes: int = Field(
        default=int(service.TIMEOUT.total_seconds() // 60), ge=1, le=30 * 24 * 60,
        description="A build canceling and untouched this long is dropped (the seed's TIMEOUT, 1 hour)",
    )
    batch_size: int = Field(default=service.BATCH_SIZE, ge=1, le=1000, description="Builds per batch (the seed's 100)")


@dataclass(frozen=True)
class DropPlan:
    cutoff: dt.datetime
    batch_size: int
    candidates: int
    status: str  # "run", "dry run" or "skipped: lease held"


@op
def find_canceling_builds(
    context: OpExecutionContext, config: DropCancelingBuildsConfig,
    gitlab_db: GitLabDatabase, gitlab_redis: GitLabRedis, run_options: RunOptions,
) -> DropPlan:
    """Check the schema, take the lease (skip if held, as the seed does) and count the outdated canceling builds."""
    schema = gitlab_db.schema
    cutoff = utc_now() - dt.timedelta(minutes=config.timeout_minutes)
    with gitlab_db.engine.connect() as conn:
        gitlab_tables = require_columns(conn, [schema.ci_builds, schema.ci_pending_builds, schema.ci_running_builds])
        candidates = service.count_candidates(conn, schema, cutoff)
    lease = run_lease(context, gitlab_redis.shared_state, LEASE_KEY, LEASE_TTL_SECONDS)
    skipped = {}
    if run_options.dry_run:
        mark_dry_run(context)
        status = "dry run"
    elif lease.try_obtain():
        status = "run"
    else:
        status = "skipped: lease held"
        skipped = skip_for_held_lease(context, lease)
    context.log.info("Cleaning canceling, timed-out builds")
    context.add_output_metadata(
        {
            "candidates": candidates, "cutoff": naive_utc(cutoff).isoformat(), "status": status,
            "gitlab_tables": gitlab_tables, **skipped,
        }
    )
    return DropPlan(cutoff=cutoff, batch_size=config.batch_size, candidates=candidates, status=status)


@op
def drop_outdated_builds(
    context: OpExecutionContext, plan: DropPlan, gitlab_db: GitLabDatabase, gitlab_redis: GitLabRedis
) -> service.DropResult:
    """Drop the candidates 100 at a time; each batch is one observation with the seed's log fields."""
    if plan.status == "dry run":
        with gitlab_db.engine.connect() as conn:
            would_drop = service.find_batch(conn, gitlab_db.schema, plan.cutoff, MAX_IDS_REPORTED, set())
        context.add_output_metadata(
            {"would_drop_count": plan.candidates, "would_drop_ids": [row.id for row in would_drop]}
        )
        return service.DropResult()
    if plan.status != "run":
        return service.DropResult()

    lease = run_lease(context, gitlab_redis.shared_state, LEASE_KEY, LEASE_TTL_SECONDS)
    # The seed's per-build log line ("Dropping outdated build"), as the observations' table.
    observer = BatchObserver(
        context, ASSET, ["build_id", "runner_id", "status", "failure_reason"], log_name="dropping_outdated_builds"
    )

    def on_batch(batch: service.BatchOutcome) -> None:
        if not lease.renew():
            raise RuntimeError(f"Lost lease {LEASE_KEY} mid-run; stopping so two runs never drop at once")
        observer.add(
            {"dropped": len(batch.dropped), "doomed": len(batch.doomed),
             "changed_concurrently": len(batch.changed_concurrently)},
            [{"build_id": row.id, "runner_id": row.runner_id, "status": row.status,
              "failure_reason": "stuck_or_timeout_failure"} for row in batch.dropped],
        )

    def report_error(build_id: int, error: BaseException) -> None:
        track_exception(context, error, build_id=build_id)

    with observer:
        return service.drop_canceling_builds(
            gitlab_db.engine, gitlab_db.schema, cutoff=plan.cutoff, batch_size=plan.batch_size,
            on_batch=on_batch, report_error=report_error,
        )


@op
def report_dropped_builds(
    context: OpExecutionContext, plan: DropPlan, result: service.DropResult, gitlab_redis: GitLabRedis
) -> None:
    """Give the lease back and put the run's totals on it."""
    if plan.status == "run":
        run_lease(context, gitlab_redis.shared_state, LEASE_KEY, LEASE_TTL_SECONDS).cancel()
    report_run(
        context,
        {
            "status": "success" if plan.status == "run" else plan.status,
            ROWS_CHANGED: result.dropped + result.doomed,
            "dropped_count": result.dropped,
            "doomed_count": result.doomed,
            "changed_concurrently_count": result.changed_concurrently,
            "left_count": result.left,
            "batches": result.batches,
            ROWS_WITH_ERRORS: len(result.errors),
            "errors": [f"build {build_id}: {error}" for build_id, error in result.errors[:MAX_IDS_REPORTED]],
        }
    )


@job(
    description="Seed 000: fail builds stuck in canceling for over an hour (Ci::StuckBuilds::DropCancelingWorker)",
    hooks={release_lease_on_failure(LEASE_KEY, LEASE_TTL_SECONDS)},
    # A run longer than the lease's TTL is failed by run monitoring (the seed's 30-minute alert).
    tags={"ci_cleanup/job": "drop_canceling_builds", "ci_cleanup/seed": "000", "dagster/max_runtime": str(LEASE_TTL_SECONDS)},
)
def drop_canceling_builds():
    plan = find_canceling_builds()
    report_dropped_builds(plan, drop_outdated_builds(plan))


# GitLab's StuckCiJobsWorker runs at :00 and starts this worker 45 minutes later.
drop_canceling_builds_schedule = ScheduleDefinition(
    name="drop_canceling_builds_schedule",
    job=drop_canceling_builds,
    cron_schedule="45 * * * *",
    execution_timezone="UTC",
)
