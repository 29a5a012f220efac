"""``Environments::AutoStopCronWorker`` (and the ``AutoStopWorker`` it enqueues) on Dagster, as a job.

find (schema check, lease, count) -> stop in batches -> report (the run's totals, lease released).
"""

import datetime as dt
from dataclasses import dataclass

from dagster import Failure, OpExecutionContext, op
from pydantic import Field

from ..batch import RunMode, Start, batch_job, find_process_report, finish, paced, start
from ..gitlab.loop_helpers import Hooks
from ..gitlab.schema import missing_unique_index, utc_now
from ..lease import Lease
from ..resources import GitLabDatabase, GitLabRedis, RunOptions
from ..runs import MAX_IDS_REPORTED, ROWS_CHANGED, ROWS_WITH_ERRORS, BatchObserver, track_exception
from ..settings import BoundedConfig
from . import service
from .uses import BUILD_TAGS, TAGGINGS, USES

LEASE_KEY = "environments:auto_stop:lock"  # AutoStopService::EXCLUSIVE_LOCK_KEY
LEASE_TTL_SECONDS = 50 * 60  # AutoStopService::LOCK_TIMEOUT
ASSET = ("gitlab", "environments")


class EnvironmentsAutoStopConfig(BoundedConfig):
    batch_size: int = Field(
        default=service.BATCH_SIZE, ge=1, le=1000, description="Environments per batch (GitLab's 100)"
    )
    max_loops: int = Field(
        default=service.LOOP_LIMIT, ge=1, le=10_000, description="Batches per run at most (GitLab's 1000)"
    )
    max_runtime_minutes: int = Field(
        default=int(service.LOOP_TIMEOUT.total_seconds() // 60), ge=1, le=LEASE_TTL_SECONDS // 60 - 1,
        description="No new batch after this long (GitLab's 45 minutes; must stay under the 50-minute lease)",
    )


@dataclass(frozen=True)
class AutoStopPlan:
    start: Start
    limits: service.Limits
    candidates: int
    missing_index: str | None = None  # GitLab's index that playing stop actions needs, when the database lacks it
    preview: service.AutoStopResult | None = None  # dry run: what a run would do


@op
def find_auto_stoppable_environments(
    context: OpExecutionContext, config: EnvironmentsAutoStopConfig,
    gitlab_db: GitLabDatabase, gitlab_redis: GitLabRedis, run_options: RunOptions,
) -> AutoStopPlan:
    """Check the schema, take the lease (skip if held, as GitLab does) and count the environments past
    auto_stop_at.

    Without GitLab's unique index on ci_pending_builds (build_id) no stop action can be queued, but environments
    without stop actions need no queue: they are still stopped, and the run fails at its end naming the index
    (rather than every batch failing and every environment reported as an error).
    """
    schema = gitlab_db.schema
    tags = BUILD_TAGS if gitlab_db.release.features["build_tags"] else TAGGINGS  # the release's
    gitlab_tables = gitlab_db.require({**USES, **tags})
    with gitlab_db.engine_for(schema.ci_pending_builds).connect() as conn:
        missing_index = missing_unique_index(conn, schema.ci_pending_builds, "build_id", service.PENDING_BUILDS_INDEX)
    with gitlab_db.engine_for(schema.environments).connect() as conn:
        candidates = service.count_auto_stoppable(conn, schema, utc_now())
    found = {"candidates": candidates, **gitlab_tables}
    if missing_index:
        found["missing_index"] = missing_index
        context.log.error(f"The database lacks GitLab's {missing_index}: stop actions will not be played")
    begun = start(context, run_options, gitlab_redis)
    limits = service.Limits(config.batch_size, config.max_loops, dt.timedelta(minutes=config.max_runtime_minutes),
                            play_stop_actions=missing_index is None, max_ids=MAX_IDS_REPORTED)
    preview = None
    if begun.mode is RunMode.DRY_RUN:  # each environment's outcome decided as a run would, nothing written
        preview = service.find_auto_stoppable(
            gitlab_db.engine_for(schema.environments), gitlab_db.engine_for(schema.ci_builds), schema, limits)
    context.add_output_metadata({**found, **begun.metadata})
    return AutoStopPlan(begun, limits, candidates, missing_index, preview)


@dataclass(frozen=True)
class StoppedEnvironments:
    """What the batches did, with the plan they followed: the report op's input."""

    plan: AutoStopPlan
    result: service.AutoStopResult


@op
def stop_environments_in_batches(
    context: OpExecutionContext, plan: AutoStopPlan, gitlab_db: GitLabDatabase
) -> StoppedEnvironments:
    """Stop the environments batch by batch, each batch observed on the environments table."""
    if not plan.start.runs:
        return StoppedEnvironments(plan, plan.preview or service.AutoStopResult())
    observer = BatchObserver(context, ASSET, ["environment_id", "outcome"], log_name="environments",
                             keys=["stopped", "stopping", "left_untouched", "failed", "stop_actions_started"],
                             brake=plan.start.brake)

    def on_batch(batch: service.BatchOutcome) -> None:
        observer.add(
            {
                "stopped": batch.count(service.STOPPED),
                "stopping": batch.count(service.STOPPING),
                "left_untouched": batch.count(service.LEFT_UNTOUCHED) + batch.count(service.CHANGED_CONCURRENTLY),
                "failed": batch.count(service.FAILED),
                "stop_actions_started": len(batch.stop_actions_started),
            },
            ({"environment_id": env_id, "outcome": outcome} for outcome, ids in batch.ids.items() for env_id in ids),
        )

    def report_error(environment_id: int, error: BaseException) -> None:
        track_exception(context, error, environment_id=environment_id)

    schema = gitlab_db.schema
    with observer, paced(context, plan.start, gitlab_db, schema.environments):
        result = service.auto_stop_environments(
            gitlab_db.engine_for(schema.environments), gitlab_db.engine_for(schema.ci_builds), schema, plan.limits,
            Hooks(on_batch, report_error, plan.start.brake),
        )
    return StoppedEnvironments(plan, result)


@op
def report_stopped_environments(context: OpExecutionContext, stopped: StoppedEnvironments) -> None:
    """Give the lease back and put the run's totals on it; fail the run if the database lacks GitLab's index."""
    plan, result = stopped.plan, stopped.result
    ran = plan.start.runs
    counts = result.counts if ran else {o: 0 for o in result.counts}
    totals = {
        ROWS_CHANGED: result.rows_changed if ran else 0,
        "stopped_count": counts[service.STOPPED],
        "stopping_count": counts[service.STOPPING],
        # with_action environments without stop actions, and those restarted or stopped meanwhile
        "left_untouched_count": counts[service.LEFT_UNTOUCHED] + counts[service.CHANGED_CONCURRENTLY],
        "changed_concurrently_count": counts[service.CHANGED_CONCURRENTLY],
        "failed_count": counts[service.FAILED],
        ROWS_WITH_ERRORS: counts[service.FAILED],
        "not_played_count": counts[service.NOT_PLAYED],
        "not_played_ids": result.ids.get(service.NOT_PLAYED, []) if ran else [],
        "stop_actions_started": result.stop_actions_started if ran else 0,
        "loops": result.loops,
        "limit_reached": result.limit_reached,
        "stopped_ids": result.ids.get(service.STOPPED, []) if ran else [],
        "stopping_ids": result.ids.get(service.STOPPING, []) if ran else [],
        "failed_ids": result.ids.get(service.FAILED, []),
        "errors": [f"environment {env_id}: {error}" for env_id, error in result.errors],
    }
    finish(
        context, plan.start, totals,
        would={
            "would_stop_count": result.counts[service.STOPPED],
            "would_set_stopping_count": result.counts[service.STOPPING],
            "would_start_stop_actions_count": result.stop_actions_started,
            "would_leave_untouched_count": result.counts[service.LEFT_UNTOUCHED],
            "would_stop_ids": result.ids.get(service.STOPPED, []),
            "would_set_stopping_ids": result.ids.get(service.STOPPING, []),
            "would_start_stop_action_ids": result.stop_action_ids,
            "would_leave_untouched_ids": result.ids.get(service.LEFT_UNTOUCHED, []),
        },
    )
    if plan.missing_index and plan.start.mode is not RunMode.SKIPPED:
        raise Failure(
            description=f"The database lacks GitLab's {plan.missing_index}, which queueing a played stop action "
            f"needs; environments with stop actions left available, their stop actions not played: "
            f"{result.counts[service.NOT_PLAYED]}; the others were processed. Restore the index (GitLab's "
            "db/structure.sql) and run again.",
            metadata=totals,
        )


environments_auto_stop, environments_auto_stop_schedule = batch_job(
    "environments_auto_stop",
    find_process_report(find_auto_stoppable_environments, stop_environments_in_batches, report_stopped_environments),
    description="Stop environments whose auto-stop time has passed (Environments::AutoStopCronWorker)",
    # A run longer than the lease's TTL is failed by run monitoring (GitLab's 50-minute alert).
    seed="003", max_runtime_seconds=LEASE_TTL_SECONDS,
    lease=Lease(LEASE_KEY, LEASE_TTL_SECONDS, retries=1),  # in_lock(..., retries: 1)
    cron="24 * * * *",  # Environments::AutoStopCronWorker's cron, away from the other hourly ones
)
