"""Seed 003 on Dagster: ``Environments::AutoStopCronWorker`` (and the ``AutoStopWorker`` it enqueues) as a job.

find (schema check, lease, count) -> stop (the batches) -> report (metadata, lease released).
"""

import datetime as dt
import time
from dataclasses import dataclass

from dagster import Config, OpExecutionContext, ScheduleDefinition, job, op
from pydantic import Field

from ..gitlab.schema import require_columns, utc_now
from ..resources import GitLabDatabase, GitLabRedis, RunOptions
from ..runs import (
    MAX_IDS_REPORTED, ROWS_CHANGED, ROWS_WITH_ERRORS, BatchObserver, mark_dry_run, release_lease_on_failure, report_run,
    run_lease, skip_for_held_lease, track_exception,
)
from . import service

LEASE_KEY = "environments:auto_stop:lock"  # AutoStopService::EXCLUSIVE_LOCK_KEY
LEASE_TTL_SECONDS = 50 * 60  # AutoStopService::LOCK_TIMEOUT
LEASE_RETRIES = 1  # in_lock(..., retries: 1)
LEASE_RETRY_SLEEP_SECONDS = 1.0  # ExclusiveLeaseHelpers sleeps between tries
ASSET = ("gitlab", "environments")


class EnvironmentsAutoStopConfig(Config):
    batch_size: int = Field(default=service.BATCH_SIZE, ge=1, le=1000, description="Environments per batch (the seed's 100)")
    max_loops: int = Field(default=service.LOOP_LIMIT, ge=1, le=10_000, description="Batches per run at most (the seed's 1000)")
    max_runtime_minutes: int = Field(
        default=int(service.LOOP_TIMEOUT.total_seconds() // 60), ge=1, le=LEASE_TTL_SECONDS // 60 - 1,
        description="No new batch after this long (the seed's 45 minutes; must stay under the 50-minute lease)",
    )


@dataclass(frozen=True)
class AutoStopPlan:
    batch_size: int
    max_loops: int
    max_runtime_minutes: int
    candidates: int
    status: str  # "run", "dry run" or "skipped: lease held"


def _obtain(lease) -> bool:
    for attempt in range(LEASE_RETRIES + 1):
        if lease.try_obtain():
            return True
        if attempt < LEASE_RETRIES:
            time.sleep(LEASE_RETRY_SLEEP_SECONDS)
    return False


@op
def find_auto_stoppable_environments(
    context: OpExecutionContext, config: EnvironmentsAutoStopConfig,
    gitlab_db: GitLabDatabase, gitlab_redis: GitLabRedis, run_options: RunOptions,
) -> AutoStopPlan:
    """Check the schema, take the lease (skip if held, as the seed does) and count the environments past auto_stop_at."""
    schema = gitlab_db.schema
    with gitlab_db.engine.connect() as conn:
        gitlab_tables = require_columns(conn, [schema.environments, schema.deployments, schema.ci_builds, schema.ci_pending_builds])
        candidates = service.count_auto_stoppable(conn, schema, utc_now())
    lease = run_lease(context, gitlab_redis.shared_state, LEASE_KEY, LEASE_TTL_SECONDS)
    skipped = {}
    if run_options.dry_run:
        mark_dry_run(context)
        status = "dry run"
    elif _obtain(lease):
        status = "run"
    else:
        status = "skipped: lease held"
        skipped = skip_for_held_lease(context, lease)
    context.add_output_metadata({"candidates": candidates, "status": status, "gitlab_tables": gitlab_tables, **skipped})
    return AutoStopPlan(
        batch_size=config.batch_size, max_loops=config.max_loops, max_runtime_minutes=config.max_runtime_minutes,
        candidates=candidates, status=status,
    )


@op
def stop_environments(
    context: OpExecutionContext, plan: AutoStopPlan, gitlab_db: GitLabDatabase, gitlab_redis: GitLabRedis
) -> service.AutoStopResult:
    """Stop the environments batch by batch; the batches are observed on the environments table."""
    if plan.status not in ("run", "dry run"):
        return service.AutoStopResult()
    dry_run = plan.status == "dry run"
    lease = run_lease(context, gitlab_redis.shared_state, LEASE_KEY, LEASE_TTL_SECONDS)
    observer = BatchObserver(context, ASSET, ["environment_id", "outcome"], log_name="environments")

    def on_batch(batch: service.BatchOutcome) -> None:
        if dry_run:
            return
        if not lease.renew():
            raise RuntimeError(f"Lost lease {LEASE_KEY} mid-run; stopping so two runs never stop environments at once")
        observer.add(
            {
                "stopped": batch.count(service.STOPPED),
                "stopping": batch.count(service.STOPPING),
                "left_untouched": batch.count(service.LEFT_UNTOUCHED) + batch.count(service.CHANGED_CONCURRENTLY),
                "failed": batch.count(service.FAILED),
                "stop_actions_started": len(batch.stop_actions_started),
            },
            [{"environment_id": env_id, "outcome": outcome} for outcome, ids in batch.ids.items() for env_id in ids],
        )

    def report_error(environment_id: int, error: BaseException) -> None:
        track_exception(context, error, environment_id=environment_id)

    with observer:
        result = service.auto_stop_environments(
            gitlab_db.engine, gitlab_db.schema, batch_size=plan.batch_size, max_loops=plan.max_loops,
            max_runtime=dt.timedelta(minutes=plan.max_runtime_minutes), dry_run=dry_run, max_ids=MAX_IDS_REPORTED,
            on_batch=on_batch, report_error=report_error,
        )
    if dry_run:
        context.add_output_metadata(
            {
                **_would(result),
                "would_stop_ids": result.ids.get(service.STOPPED, []),
                "would_set_stopping_ids": result.ids.get(service.STOPPING, []),
                "would_start_stop_action_ids": result.stop_action_ids,
                "would_leave_untouched_ids": result.ids.get(service.LEFT_UNTOUCHED, []),
            }
        )
    return result


def _would(result: service.AutoStopResult) -> dict:
    return {
        "would_stop_count": result.counts[service.STOPPED],
        "would_set_stopping_count": result.counts[service.STOPPING],
        "would_start_stop_actions_count": result.stop_actions_started,
        "would_leave_untouched_count": result.counts[service.LEFT_UNTOUCHED],
    }


@op
def report_auto_stop(
    context: OpExecutionContext, plan: AutoStopPlan, result: service.AutoStopResult, gitlab_redis: GitLabRedis
) -> None:
    """Give the lease back and put the run's totals on it."""
    if plan.status == "run":
        run_lease(context, gitlab_redis.shared_state, LEASE_KEY, LEASE_TTL_SECONDS).cancel()
    ran = plan.status == "run"
    counts = result.counts if ran else {o: 0 for o in result.counts}
    report_run(
        context,
        {
            "status": "success" if ran else plan.status,
            ROWS_CHANGED: result.rows_changed if ran else 0,
            "stopped_count": counts[service.STOPPED],
            "stopping_count": counts[service.STOPPING],
            # with_action environments without stop actions, and those restarted or stopped meanwhile
            "left_untouched_count": counts[service.LEFT_UNTOUCHED] + counts[service.CHANGED_CONCURRENTLY],
            "changed_concurrently_count": counts[service.CHANGED_CONCURRENTLY],
            "failed_count": counts[service.FAILED],
            ROWS_WITH_ERRORS: counts[service.FAILED],
            "stop_actions_started": result.stop_actions_started if ran else 0,
            "loops": result.loops,
            "limit_reached": result.limit_reached,
            "stopped_ids": result.ids.get(service.STOPPED, []) if ran else [],
            "stopping_ids": result.ids.get(service.STOPPING, []) if ran else [],
            "failed_ids": result.ids.get(service.FAILED, []),
            "errors": [f"environment {env_id}: {error}" for env_id, error in result.errors],
            **(_would(result) if plan.status == "dry run" else {}),
        }
    )


@job(
    description="Seed 003: stop environments whose auto-stop time has passed (Environments::AutoStopCronWorker)",
    hooks={release_lease_on_failure(LEASE_KEY, LEASE_TTL_SECONDS)},
    # A run longer than the lease's TTL is failed by run monitoring (the seed's 50-minute alert).
    tags={"ci_cleanup/job": "environments_auto_stop", "ci_cleanup/seed": "003", "dagster/max_runtime": str(LEASE_TTL_SECONDS)},
)
def environments_auto_stop():
    plan = find_auto_stoppable_environments()
    report_auto_stop(plan, stop_environments(plan))


# Environments::AutoStopCronWorker: `24 * * * *`, away from the other hourly cron jobs.
environments_auto_stop_schedule = ScheduleDefinition(
    name="environments_auto_stop_schedule",
    job=environments_auto_stop,
    cron_schedule="24 * * * *",
    execution_timezone="UTC",
)
