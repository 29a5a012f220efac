"""``Ci::Runners::StaleMachinesCleanupCronWorker`` on Dagster: ``Ci::Runners::StaleManagersCleanupService`` as a job.

find (schema check; a dry run's count) -> delete in sub-batches (and the stale rows left when the cap stopped
them) -> report (the service's status, total_deleted and batch_counts). No lease, as in GitLab: the worker is
idempotent.
"""

import datetime as dt
import math
from dataclasses import dataclass, field

from dagster import OpExecutionContext, op
from pydantic import Field, model_validator

from ..batch import RunMode, Start, batch_job, find_process_report, finish, paced, start
from ..gitlab.loop_helpers import Hooks
from ..gitlab.schema import utc_now
from ..resources import GitLabDatabase, RunOptions
from ..runs import MAX_DELETIONS_TAG, MAX_IDS_REPORTED, ROWS_CHANGED, BatchObserver
from ..settings import BoundedConfig
from . import service
from .uses import USES

ASSET = ("gitlab", "ci_runner_machines")
# No lease bounds this hourly job: run monitoring fails a run still going at half the hour, which alerts
# and frees the run queue for the next one.
MAX_RUNTIME_SECONDS = 30 * 60
MAX_SUB_BATCHES = 1000  # keeps batch_counts and the per-sub-batch observations of one run bounded


class StaleRunnerMachinesCleanupConfig(BoundedConfig):
    stale_after_days: int = Field(
        default=service.STALE_TIMEOUT.days, ge=1, le=3650,
        description="A machine created and last contacted this long ago is stale (GitLab's STALE_TIMEOUT, 7 days)",
    )
    sub_batch_size: int = Field(
        default=service.SUB_BATCH_LIMIT, ge=1, le=10_000, description="Rows per DELETE (GitLab's SUB_BATCH_LIMIT, 100)"
    )
    max_deletions: int = Field(
        default=service.MAX_DELETIONS, ge=1, le=100_000,
        description="Rows deleted per run at most (GitLab's MAX_DELETIONS, 1000)",
    )

    @model_validator(mode="after")
    def _bounded_sub_batches(self):
        if math.ceil(self.max_deletions / self.sub_batch_size) > MAX_SUB_BATCHES:
            raise ValueError(
                f"max_deletions / sub_batch_size allows more than {MAX_SUB_BATCHES} sub-batches in one run; "
                "raise sub_batch_size"
            )
        return self


@dataclass(frozen=True)
class CleanupPlan:
    start: Start
    limits: service.Limits
    would: dict = field(default_factory=dict)  # dry run: what a run would delete


@op
def find_stale_runner_machines(
    context: OpExecutionContext, config: StaleRunnerMachinesCleanupConfig, gitlab_db: GitLabDatabase,
    run_options: RunOptions,
) -> CleanupPlan:
    """Check the schema; a dry run counts the stale runner machines a run would delete."""
    schema = gitlab_db.schema
    now = utc_now()
    gitlab_tables = gitlab_db.require(USES)
    begun = start(context, run_options)
    deadline = service.stale_deadline(now, dt.timedelta(days=config.stale_after_days))
    limits = service.Limits(deadline, config.sub_batch_size, config.max_deletions)
    would = {}
    if begun.mode is RunMode.DRY_RUN:
        with gitlab_db.engine_for(schema.ci_runner_machines).connect() as conn:
            would_delete = service.count_stale(conn, schema, deadline, config.max_deletions)  # capped, as a run is
            ids = service.find_stale_ids(conn, schema, deadline, min(would_delete, MAX_IDS_REPORTED))
            would = {"would_delete_count": would_delete, "would_delete_ids": ids}
    context.add_output_metadata({"stale_deadline": deadline.isoformat(), **gitlab_tables, **begun.metadata})
    return CleanupPlan(begun, limits, would)


@dataclass(frozen=True)
class CleanupDone:
    """What the sub-batches did, for the report op."""

    plan: CleanupPlan
    result: service.CleanupResult


@op
def delete_stale_runner_machines_in_sub_batches(
    context: OpExecutionContext, plan: CleanupPlan, gitlab_db: GitLabDatabase
) -> CleanupDone:
    """Delete sub-batch after sub-batch, each its own transaction and one observation on the table."""
    if not plan.start.runs:
        return CleanupDone(plan, service.CleanupResult(max_deletions=plan.limits.max_deletions))
    observer = BatchObserver(context, ASSET, ["runner_machine_id"], log_name="deleted_runner_machines",
                             keys=["deleted"], brake=plan.start.brake)

    def on_sub_batch(deleted_ids: list[int]) -> None:
        observer.add({"deleted": len(deleted_ids)}, ({"runner_machine_id": i} for i in deleted_ids))

    with observer, paced(context, plan.start, gitlab_db, gitlab_db.schema.ci_runner_machines):
        result = service.delete_stale_runner_managers(
            gitlab_db.engine_for(gitlab_db.schema.ci_runner_machines), gitlab_db.schema, plan.limits,
            Hooks(on_sub_batch, brake=plan.start.brake),
        )
    return CleanupDone(plan, result)


@op
def report_deleted_runner_machines(context: OpExecutionContext, done: CleanupDone) -> None:
    """The service's done log: status, total_deleted, batch_counts; and whether the cap stopped the run."""
    plan, result = done.plan, done.result
    if result.max_deletions_reached:
        context.log.warning(
            f"MAX_DELETIONS ({plan.limits.max_deletions}) reached: {result.left} stale runner machines left for the "
            "next run; reached run after run, the backlog is growing"
        )
    finish(
        context, plan.start,
        {
            ROWS_CHANGED: result.total_deleted,
            "total_deleted": result.total_deleted,
            "batch_counts": result.batch_counts,
            "max_deletions_reached": result.max_deletions_reached,
            "stale_runner_machines_left": result.left,
        },
        would=plan.would,
        tags={MAX_DELETIONS_TAG: str(result.max_deletions_reached).lower()},  # read by max_deletions_backlog_alert
    )


stale_runner_machines_cleanup, stale_runner_machines_cleanup_schedule = batch_job(
    "stale_runner_machines_cleanup",
    find_process_report(
        find_stale_runner_machines, delete_stale_runner_machines_in_sub_batches, report_deleted_runner_machines),
    description="Delete runner machines not contacted for 7 days (Ci::Runners::StaleMachinesCleanupCronWorker)",
    seed="001", max_runtime_seconds=MAX_RUNTIME_SECONDS, cron="36 * * * *",  # GitLab's cron: every hour at :36
)
