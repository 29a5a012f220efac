"""Housekeeping of our own: ``prune_dagster_history`` keeps the Dagster instance's runs and events bounded.

find_old_runs (limits, lease, what is old) -> prune_runs (daily totals, then batches of runs) ->
report_pruned_runs (the run's totals, lease released). Dagster's open-source release has no retention for runs or
event logs; its ``retention:`` setting (dagster.yaml) covers schedule and sensor ticks only.
"""

import contextlib
import datetime as dt
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from dagster import DagsterInstance, OpExecutionContext, op
from pydantic import Field

from ..batch import RunMode, Start, batch_job, find_process_report, finish, paced, start
from ..gitlab.loop_helpers import Hooks
from ..gitlab.schema import utc_now
from ..lease import Lease
from ..resources import GitLabRedis, RunOptions
from ..runs import MAX_IDS_REPORTED, ROWS_CHANGED, observe
from ..settings import BoundedConfig
from . import service

# Two prune runs at once would write a day's totals twice: a lease, on the same Redis as the others' leases.
LEASE_KEY = "ci_cleanup:prune_dagster_history"
LEASE_TTL_SECONDS = 60 * 60
MAX_RUNTIME_MINUTES = int(service.MAX_RUNTIME.total_seconds() // 60)
STATEMENT_TIMEOUT_MS = 60_000  # one statement deletes one run's events; a run of 100 k events fits
ASSET = ("dagster", "runs")
# The keep times for every run, scheduled or launched by hand, where the code location runs; run config overrides.
KEEP_DAYS_ENV = "CI_CLEANUP_PRUNE_KEEP_DAYS"
KEEP_FAILED_DAYS_ENV = "CI_CLEANUP_PRUNE_KEEP_FAILED_DAYS"
MAX_KEEP_DAYS = 3650


class PruneDagsterHistoryConfig(BoundedConfig):
    keep_days: int | None = Field(
        default=None, ge=1, le=MAX_KEEP_DAYS,
        description="Successful and canceled runs of the last keep_days whole UTC days are kept, with their events. "
        f"Default: env {KEEP_DAYS_ENV}, else {service.KEEP_DAYS}",
    )
    keep_failed_days: int | None = Field(
        default=None, ge=1, le=MAX_KEEP_DAYS,
        description=f"Failed runs are kept this long (at least keep_days). Default: env {KEEP_FAILED_DAYS_ENV}, "
        f"else {service.KEEP_FAILED_DAYS}",
    )
    batch_size: int = Field(default=service.BATCH_SIZE, ge=1, le=1000, description="Runs deleted per batch")
    max_runtime_minutes: int = Field(
        default=MAX_RUNTIME_MINUTES, ge=1, le=LEASE_TTL_SECONDS // 60 - 5,
        description="No new batch after this long (the rest waits for the next day); under the 60-minute lease",
    )


def keep_times(config: PruneDagsterHistoryConfig) -> tuple[int, int]:
    """(keep_days, keep_failed_days): run config, else the environment, else 30 and 90; checked together."""

    def days(value: int | None, env: str, default: int) -> int:
        if value is not None:
            return value
        raw = os.environ.get(env, "").strip()
        if not raw:
            return default
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_KEEP_DAYS:
            raise ValueError(f"{env} must be a whole number of days from 1 to {MAX_KEEP_DAYS}, not {raw!r}")
        return int(raw)

    keep_days = days(config.keep_days, KEEP_DAYS_ENV, service.KEEP_DAYS)
    keep_failed_days = days(config.keep_failed_days, KEEP_FAILED_DAYS_ENV, service.KEEP_FAILED_DAYS)
    if keep_failed_days < keep_days:
        raise ValueError(f"keep_failed_days ({keep_failed_days}) must be at least keep_days ({keep_days})")
    return keep_days, keep_failed_days


@dataclass(frozen=True)
class PrunePlan:
    start: Start
    limits: service.Limits
    keep_days: int
    keep_failed_days: int
    old_runs: dict[str, int] = field(default_factory=dict)  # by status, at the start
    would: dict = field(default_factory=dict)  # dry run: the runs that would go, the days that would be summarised


@contextlib.contextmanager
def pooled(instance: DagsterInstance) -> Iterator[DagsterInstance]:
    """The same instance with pooled connections and a statement timeout, for the deletions.

    dagster-postgres opens a new connection per call (NullPool), which costs more than a deleted run's
    statements (docs/performance.md). ``optimize_for_webserver`` is how the webserver gets a pool; it is
    applied to a copy so the run's own event writes are left as they are.
    """
    if instance.is_ephemeral:
        yield instance
        return
    copy = DagsterInstance.from_ref(instance.get_ref())
    try:
        copy.optimize_for_webserver(statement_timeout=STATEMENT_TIMEOUT_MS, pool_recycle=3600, max_overflow=1)
        yield copy
    finally:
        copy.dispose()


@op
def find_old_runs(
    context: OpExecutionContext, config: PruneDagsterHistoryConfig, gitlab_redis: GitLabRedis, run_options: RunOptions
) -> PrunePlan:
    """Count the runs past their keep time, and take the lease (skip if another prune holds it)."""
    now = utc_now()
    keep_days, keep_failed_days = keep_times(config)
    cutoffs = service.Cutoffs.at(now, keep_days, keep_failed_days)
    old_runs = service.count_old_runs(context.instance, cutoffs)
    begun = start(context, run_options, gitlab_redis)
    would = {}
    if begun.mode is RunMode.DRY_RUN:
        days = service.days_to_summarise(context.instance, cutoffs)
        would = {
            "would_delete_count": sum(old_runs.values()),
            "would_delete_run_ids": service.old_run_ids(context.instance, cutoffs, MAX_IDS_REPORTED),
            "would_summarise_days": [d.isoformat() for d in days][:MAX_IDS_REPORTED],
        }
    context.add_output_metadata(
        {**begun.metadata, "old_runs": sum(old_runs.values()), "old_runs_by_status": old_runs,
         "cutoff_finished": cutoffs.finished.isoformat(), "cutoff_failed": cutoffs.failed.isoformat()}
    )
    limits = service.Limits(cutoffs, config.batch_size, dt.timedelta(minutes=config.max_runtime_minutes))
    return PrunePlan(begun, limits, keep_days, keep_failed_days, old_runs, would)


@dataclass(frozen=True)
class Pruned:
    plan: PrunePlan
    result: service.PruneResult


@op
def prune_runs(context: OpExecutionContext, plan: PrunePlan) -> Pruned:
    """Write the daily totals, then delete old runs batch by batch, each batch one observation on dagster/runs."""
    if not plan.start.runs:
        return Pruned(plan, service.PruneResult())

    def on_batch(run_ids: list[str], events: int) -> None:
        observe(context, ASSET, {"runs_deleted": len(run_ids), "events_deleted": events})

    with pooled(context.instance) as instance, paced(context, plan.start):  # its batches' time alone
        result = service.prune_history(instance, plan.limits, Hooks(on_batch, brake=plan.start.brake))
    if result.resumed_run_ids:
        resumed = len(result.resumed_run_ids)
        context.log.warning(f"Finished deleting {resumed} runs whose deletion an interrupted prune run had started")
    return Pruned(plan, result)


@op
def report_pruned_runs(context: OpExecutionContext, pruned: Pruned) -> None:
    """The run's totals, and the lease given back (a dry run's: the runs that would go)."""
    plan, result = pruned.plan, pruned.result
    if result.time_limit_reached:
        minutes = int(plan.limits.max_runtime.total_seconds() // 60)
        context.log.warning(f"Stopped after {minutes} minutes; the rest goes in the next run")
    kept = service.oldest_kept(context.instance, context.run_id)
    finish(
        context, plan.start,
        {
            ROWS_CHANGED: result.runs_deleted,
            "runs_deleted": result.runs_deleted,
            "events_deleted": result.events_deleted,
            "oldest_kept": kept.isoformat() if kept else "none (no run but this one)",
            "days_summarised": result.days_summarised,
            "batch_counts": result.batch_counts,
            "resumed_run_ids": result.resumed_run_ids,
            "time_limit_reached": result.time_limit_reached,
            "keep_days": plan.keep_days,
            "keep_failed_days": plan.keep_failed_days,
        },
        would=plan.would,
    )


prune_dagster_history, prune_dagster_history_schedule = batch_job(
    "prune_dagster_history", find_process_report(find_old_runs, prune_runs, report_pruned_runs),
    description="Delete the Dagster instance's finished runs and their event logs after 30 days (failed: 90), "
    "keeping each job's daily totals",
    lease=Lease(LEASE_KEY, LEASE_TTL_SECONDS),
    max_runtime_seconds=LEASE_TTL_SECONDS,  # run monitoring fails a run that outlives its lease
    # Daily at 04:13 UTC: a minute no other schedule uses (:24, :30, :36, :45, */7, */10), at night in Europe.
    cron="13 4 * * *",
)
