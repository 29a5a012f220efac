"""``Ci::StuckBuilds::DropCancelingWorker`` on Dagster: ``Ci::StuckBuilds::DropCancelingService`` as a job.

find (schema check, lease, count) -> drop in batches -> report (the run's totals, lease released).
"""

import datetime as dt
from dataclasses import dataclass, field
from typing import Literal

from dagster import OpExecutionContext, op
from pydantic import Field

from ..batch import RunMode, Start, batch_job, find_process_report, finish, paced, start
from ..gitlab.loop_helpers import Hooks
from ..gitlab.schema import naive_utc, utc_now
from ..lease import Lease
from ..resources import GitLabDatabase, GitLabRedis, RunOptions
from ..runs import MAX_IDS_REPORTED, ROWS_CHANGED, ROWS_WITH_ERRORS, BatchObserver, track_exception
from ..settings import BoundedConfig
from . import service
from .uses import USES

LEASE_KEY = "ci/stuck_builds/drop_canceling_worker"
LEASE_TTL_SECONDS = 30 * 60
ASSET = ("gitlab", "ci_builds")


class DropCancelingBuildsConfig(BoundedConfig):
    timeout_minutes: int = Field(
        default=int(service.TIMEOUT.total_seconds() // 60), ge=1, le=30 * 24 * 60,
        description="A build canceling and untouched this long is dropped (GitLab's TIMEOUT, 1 hour)",
    )
    batch_size: int = Field(default=service.BATCH_SIZE, ge=1, le=1000, description="Builds per batch (GitLab's 100)")
    failure_reason: Literal["stuck_or_timeout_failure", "no_updates_canceling"] = Field(
        default="stuck_or_timeout_failure",
        description="The failure reason a dropped build gets: the seed's, or GitLab 19.1+'s no_updates_canceling",
    )


@dataclass(frozen=True)
class DropPlan:
    start: Start
    limits: service.Limits
    candidates: int
    failure_reason: str = "stuck_or_timeout_failure"  # a key of service.FAILURE_REASONS
    would: dict = field(default_factory=dict)  # dry run: what a run would drop


@op
def find_canceling_builds(
    context: OpExecutionContext, config: DropCancelingBuildsConfig,
    gitlab_db: GitLabDatabase, gitlab_redis: GitLabRedis, run_options: RunOptions,
) -> DropPlan:
    """Check the schema, take the lease (skip if held, as GitLab does) and count the outdated canceling builds."""
    schema = gitlab_db.schema
    cutoff = utc_now() - dt.timedelta(minutes=config.timeout_minutes)
    gitlab_tables = gitlab_db.require(USES)
    with gitlab_db.engine_for(schema.ci_builds).connect() as conn:
        candidates = service.count_candidates(conn, schema, cutoff)
        begun = start(context, run_options, gitlab_redis)
        would = {}
        if begun.mode is RunMode.DRY_RUN:
            would = {"would_drop_count": candidates,
                     "would_drop_ids": service.find_batch(conn, schema, cutoff, MAX_IDS_REPORTED)}
    context.log.info("Cleaning canceling, timed-out builds")
    context.add_output_metadata(
        {"candidates": candidates, "cutoff": naive_utc(cutoff).isoformat(), "failure_reason": config.failure_reason,
         **gitlab_tables, **begun.metadata}
    )
    limits = service.Limits(cutoff, config.batch_size, service.FAILURE_REASONS[config.failure_reason])
    return DropPlan(begun, limits, candidates, config.failure_reason, would)


@dataclass(frozen=True)
class DropDone:
    """What the batches did, for the report op."""

    plan: DropPlan
    result: service.DropResult


@op
def drop_canceling_builds_in_batches(
    context: OpExecutionContext, plan: DropPlan, gitlab_db: GitLabDatabase
) -> DropDone:
    """Drop the candidates 100 at a time, each batch one observation with GitLab's log fields."""
    if not plan.start.runs:
        return DropDone(plan, service.DropResult())
    # The service's per-build log line ("Dropping outdated build"), as the observations' table.
    observer = BatchObserver(
        context, ASSET, ["build_id", "runner_id", "status", "failure_reason"], log_name="dropping_outdated_builds",
        keys=["dropped", "doomed", "changed_concurrently"], brake=plan.start.brake,
    )

    def on_batch(batch: service.BatchOutcome) -> None:
        observer.add(
            {"dropped": len(batch.dropped), "doomed": len(batch.doomed),
             "changed_concurrently": len(batch.changed_concurrently)},
            ({"build_id": row.id, "runner_id": row.runner_id, "status": row.status,
              "failure_reason": plan.failure_reason} for row in batch.dropped),
        )

    def report_error(build_id: int, error: BaseException) -> None:
        track_exception(context, error, build_id=build_id)

    with observer, paced(context, plan.start, gitlab_db, gitlab_db.schema.ci_builds):
        result = service.drop_canceling_builds(
            gitlab_db.engine_for(gitlab_db.schema.ci_builds), gitlab_db.schema,
            plan.limits, Hooks(on_batch, report_error, plan.start.brake),
        )
    return DropDone(plan, result)


@op
def report_dropped_builds(context: OpExecutionContext, done: DropDone) -> None:
    """Give the lease back and put the run's totals on the run (a dry run's would_drop_… too)."""
    result = done.result
    finish(
        context, done.plan.start,
        {
            ROWS_CHANGED: result.dropped + result.doomed,
            "dropped_count": result.dropped,
            "doomed_count": result.doomed,
            "changed_concurrently_count": result.changed_concurrently,
            "left_count": result.left,
            "batches": result.batches,
            ROWS_WITH_ERRORS: len(result.errors),
            "errors": [f"build {build_id}: {error}" for build_id, error in result.errors[:MAX_IDS_REPORTED]],
        },
        would=done.plan.would,
    )


drop_canceling_builds, drop_canceling_builds_schedule = batch_job(
    "drop_canceling_builds",
    find_process_report(find_canceling_builds, drop_canceling_builds_in_batches, report_dropped_builds),
    description="Fail builds stuck in canceling for over an hour (Ci::StuckBuilds::DropCancelingWorker)",
    # A run longer than the lease's TTL is failed by run monitoring (GitLab's 30-minute alert).
    seed="000", lease=Lease(LEASE_KEY, LEASE_TTL_SECONDS), max_runtime_seconds=LEASE_TTL_SECONDS,
    cron="45 * * * *",  # GitLab's StuckCiJobsWorker runs at :00 and starts this worker 45 minutes later
)
