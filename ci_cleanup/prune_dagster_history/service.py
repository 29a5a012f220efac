"""Keep the Dagster instance's own history bounded: delete old finished runs with their event logs.

The rule, on a ``DagsterInstance`` and without ops: a run that finished (success, canceled) before
the last ``keep_days`` whole UTC days is deleted, a failed one after ``keep_failed_days``; a run that
is queued, starting, started or canceling is never touched. Before a day's runs go, each job's
totals of that day are written once as a runless observation on ``ci_cleanup_history/<job>``
(stamped with that day), so the plots across months outlive the runs.

Deletion goes through ``DagsterInstance.delete_run``, Dagster's public API. On PostgreSQL it is not
one transaction (the run row, then its events, each autocommitted), so the ids of a batch are
written to the instance's key-value store before the batch and cleared after it: a prune killed
midway leaves at most that batch half-deleted (rows gone, events left; never a run without its
events), and the next prune deletes those runs again (``delete_run`` is idempotent) before anything else.
"""

from __future__ import annotations

import datetime as dt
import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from dagster import (
    AssetKey,
    AssetObservation,
    DagsterEvent,
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    RunRecord,
    RunsFilter,
)

# Private: a runless observation stamped on its day (record_day) has no public API; the public
# report_runless_asset_event takes no timestamp.
from dagster._core.events import AssetObservationData
from dagster._core.instance.utils import RUNLESS_JOB_NAME, RUNLESS_RUN_ID
from sqlalchemy import func, select

from ..gitlab.loop_helpers import NO_HOOKS, Hooks, LoopEnd, loop_until
from ..runs import ROWS_CHANGED_TAG  # every job's headline number, summed per day

KEEP_DAYS = 30
KEEP_FAILED_DAYS = 90  # failures are what an operator looks back at
BATCH_SIZE = 100
MAX_RUNTIME = dt.timedelta(minutes=30)  # well inside the lease's hour: run monitoring fails one that outlives it

S, F = DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE
DELETED_AFTER_KEEP_DAYS = (S, DagsterRunStatus.CANCELED)
DELETED_AFTER_KEEP_FAILED_DAYS = (F,)
FINISHED = (*DELETED_AFTER_KEEP_DAYS, *DELETED_AFTER_KEEP_FAILED_DAYS)
HISTORY_PREFIX = "ci_cleanup_history"  # asset key prefix of the daily totals, one key per job

# The instance's key-value store (Dagster's daemon cursors table): what survives a kill.
DELETING_KEY = "ci_cleanup/prune_dagster_history/deleting"  # JSON list of the run ids of the batch under way
SUMMARISED_KEY = "ci_cleanup/prune_dagster_history/summarised_through"  # last UTC day whose totals are written

_ONE_DAY = dt.timedelta(days=1)
_JUST_BEFORE = dt.timedelta(microseconds=1)  # RunsFilter.updated_after is strict: ">=" is "> just before"


def history_asset_key(job_name: str) -> AssetKey:
    return AssetKey([HISTORY_PREFIX, job_name])


def midnight(moment: dt.datetime) -> dt.datetime:
    """The UTC midnight starting ``moment``'s day."""
    if moment.tzinfo is None:
        raise ValueError("moment must be timezone-aware")
    utc = moment.astimezone(dt.UTC)
    return dt.datetime(utc.year, utc.month, utc.day, tzinfo=dt.UTC)


@dataclass(frozen=True)
class Cutoffs:
    """Runs whose last update is before these go: the last ``keep_days`` whole UTC days are kept."""

    finished: dt.datetime  # success, canceled
    failed: dt.datetime

    @classmethod
    def at(cls, now: dt.datetime, keep_days: int = KEEP_DAYS, keep_failed_days: int = KEEP_FAILED_DAYS) -> Cutoffs:
        if keep_days < 1 or keep_failed_days < keep_days:
            raise ValueError("keep_days must be at least 1 and keep_failed_days at least keep_days")
        today = midnight(now)
        return cls(finished=today - keep_days * _ONE_DAY, failed=today - keep_failed_days * _ONE_DAY)


@dataclass(frozen=True)
class DayTotals:
    """One job's runs of one UTC day, as its daily observation records them."""

    day: dt.date
    runs: int = 0
    succeeded: int = 0
    failed: int = 0
    canceled: int = 0
    rows_changed: int = 0

    def metadata(self) -> dict:
        return {
            "day": self.day.isoformat(), "runs": self.runs, "succeeded": self.succeeded, "failed": self.failed,
            "canceled": self.canceled, "rows_changed": self.rows_changed,
        }


@dataclass
class PruneResult:
    runs_deleted: int = 0
    events_deleted: int = 0
    batch_counts: list[int] = field(default_factory=list)
    days_summarised: int = 0  # UTC days whose totals were written by this run
    resumed_run_ids: list[str] = field(default_factory=list)  # an interrupted batch, finished first
    time_limit_reached: bool = False


# --- what goes --------------------------------------------------------------------------------------------


def _filters(cutoffs: Cutoffs, until: dt.datetime | None = None) -> list[RunsFilter]:
    """The two rules as run filters; ``until`` bounds both to days whose totals are written."""
    return [
        RunsFilter(statuses=list(statuses), updated_before=min(cut, until) if until else cut)
        for statuses, cut in (
            (DELETED_AFTER_KEEP_DAYS, cutoffs.finished), (DELETED_AFTER_KEEP_FAILED_DAYS, cutoffs.failed)
        )
    ]


def count_old_runs(instance: DagsterInstance, cutoffs: Cutoffs) -> dict[str, int]:
    """Runs that would go, by status."""
    counts = {}
    for runs_filter in _filters(cutoffs):
        for status in runs_filter.statuses:
            one_status = RunsFilter(statuses=[status], updated_before=runs_filter.updated_before)
            counts[status.value] = instance.get_runs_count(one_status)
    return counts


def old_run_ids(instance: DagsterInstance, cutoffs: Cutoffs, limit: int) -> list[str]:
    """The first ``limit`` runs that would go, oldest first: what a dry run lists."""
    ids = []
    for runs_filter in _filters(cutoffs):
        records = oldest_first(instance, runs_filter, limit - len(ids))
        ids += [r.dagster_run.run_id for r in records]
        if len(ids) >= limit:
            break
    return ids


def oldest_first(instance: DagsterInstance, runs_filter: RunsFilter | None, limit: int) -> list[RunRecord]:
    """Runs by last update, oldest first (Dagster's ``idx_run_range`` index: status, update_timestamp)."""
    return list(instance.get_run_records(runs_filter, limit=limit, order_by="update_timestamp", ascending=True))


def oldest_kept(instance: DagsterInstance, this_run: str | None = None) -> dt.datetime | None:
    """When the oldest run left, other than ``this_run`` (the pruning run, updated now), was last updated (None: no
    other run left)."""
    records = [r for r in oldest_first(instance, None, 2) if r.dagster_run.run_id != this_run]
    return records[0].update_timestamp if records else None


# --- daily totals -----------------------------------------------------------------------------------------


def summarised_through(instance: DagsterInstance) -> dt.date | None:
    value = instance.daemon_cursor_storage.get_cursor_values({SUMMARISED_KEY}).get(SUMMARISED_KEY)
    return dt.date.fromisoformat(value) if value else None


def days_to_summarise(instance: DagsterInstance, cutoffs: Cutoffs) -> list[dt.date]:
    """UTC days not summarised yet whose runs may go: from the oldest finished run (or the day after
    the last summarised one) up to the day before the finished-runs cut-off."""
    last = summarised_through(instance)
    if last is not None:
        first = last + _ONE_DAY
    else:
        oldest = oldest_first(instance, RunsFilter(statuses=list(FINISHED)), 1)
        if not oldest:
            return []
        first = oldest[0].update_timestamp.astimezone(dt.UTC).date()
    end = cutoffs.finished.date()
    return [first + i * _ONE_DAY for i in range(max(0, (end - first).days))]


def day_totals(instance: DagsterInstance, day: dt.date) -> dict[str, DayTotals]:
    """Each job's finished runs last updated on ``day`` (UTC), and the rows they changed."""
    start = dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC)
    records = instance.get_run_records(
        RunsFilter(statuses=list(FINISHED), updated_after=start - _JUST_BEFORE, updated_before=start + _ONE_DAY)
    )
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for record in records:
        run = record.dagster_run
        job = counts[run.job_name]
        job["runs"] += 1
        job[{S: "succeeded", F: "failed"}.get(run.status, "canceled")] += 1
        rows = run.tags.get(ROWS_CHANGED_TAG, "0")
        job["rows_changed"] += int(rows) if rows.isdigit() else 0
    return {name: DayTotals(day=day, **totals) for name, totals in counts.items()}


def _last_summary_day(instance: DagsterInstance, job_name: str) -> dt.date | None:
    records = instance.fetch_observations(history_asset_key(job_name), limit=1).records
    if not records:
        return None
    day = records[0].asset_observation.metadata.get("day") if records[0].asset_observation else None
    return dt.date.fromisoformat(day.value) if day is not None else None


def record_day(instance: DagsterInstance, day: dt.date, totals: dict[str, DayTotals]) -> None:
    """Write each job's totals of ``day``, then mark the day done.

    A job whose key already holds this day (a run killed between the two) is not written again.
    The observation is stamped at the day's last second, so the UI plots it on its day; that is
    ``report_runless_asset_event`` with a timestamp, which the public method does not take.
    """
    stamp = (dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC) + _ONE_DAY).timestamp() - 1
    for job_name, job_totals in sorted(totals.items()):
        last = _last_summary_day(instance, job_name)
        if last is not None and last >= day:
            continue
        observation = AssetObservation(asset_key=history_asset_key(job_name), metadata=job_totals.metadata())
        instance.report_dagster_event(
            DagsterEvent(
                event_type_value=DagsterEventType.ASSET_OBSERVATION.value,
                event_specific_data=AssetObservationData(observation),
                job_name=RUNLESS_JOB_NAME,
            ),
            run_id=RUNLESS_RUN_ID,
            timestamp=stamp,
        )
    instance.daemon_cursor_storage.set_cursor_values({SUMMARISED_KEY: day.isoformat()})


# --- deletion ---------------------------------------------------------------------------------------------


def resume_interrupted_batch(instance: DagsterInstance) -> list[str]:
    """Delete again the runs of a batch a killed run left half-done; returns their ids."""
    value = instance.daemon_cursor_storage.get_cursor_values({DELETING_KEY}).get(DELETING_KEY)
    try:
        run_ids = json.loads(value) if value else []
    except ValueError:
        run_ids = None
    if not isinstance(run_ids, list) or not all(isinstance(run_id, str) for run_id in run_ids):
        raise ValueError(f"The instance's key {DELETING_KEY!r} does not hold a JSON list of run ids: {value[:200]!r}")
    for run_id in run_ids:
        instance.delete_run(run_id)
    if run_ids:
        instance.daemon_cursor_storage.set_cursor_values({DELETING_KEY: "[]"})
    return run_ids


def count_events(instance: DagsterInstance, run_ids: list[str]) -> int:
    """The runs' events: one count where the event log is one table (PostgreSQL, in memory).

    Reading the records to count them (the public API) deserializes every event, a large part of a
    batch. Dagster's sqlite storage keeps a file per run, so there they are read.
    """
    # Imported here: the event log storage modules are slow to import, which every run of every job
    # (and the code server) would pay at start-up for this one function (docs/performance.md). Private: no public
    # API counts a run's events without reading them.
    from dagster._core.storage.event_log import SqlEventLogStorage, SqlEventLogStorageTable, SqliteEventLogStorage

    storage = instance.event_log_storage
    if isinstance(storage, SqlEventLogStorage) and not isinstance(storage, SqliteEventLogStorage):
        events = SqlEventLogStorageTable
        with storage.index_connection() as conn:
            return conn.execute(select(func.count()).where(events.c.run_id.in_(run_ids))).scalar_one()
    return sum(len(instance.get_records_for_run(run_id, limit=None).records) for run_id in run_ids)


def delete_batch(instance: DagsterInstance, run_ids: list[str]) -> int:
    """Delete the runs and their event logs; returns the events deleted."""
    events = count_events(instance, run_ids)
    instance.daemon_cursor_storage.set_cursor_values({DELETING_KEY: json.dumps(run_ids)})
    for run_id in run_ids:
        instance.delete_run(run_id)
    instance.daemon_cursor_storage.set_cursor_values({DELETING_KEY: "[]"})
    return events


@dataclass(frozen=True)
class Limits:
    cutoffs: Cutoffs
    batch_size: int = BATCH_SIZE
    max_runtime: dt.timedelta = MAX_RUNTIME

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError("batch_size must be at least 1")


def prune_history(instance: DagsterInstance, limits: Limits, hooks: Hooks = NO_HOOKS) -> PruneResult:
    """Finish an interrupted batch, write the daily totals, then delete old runs batch by batch, oldest first.

    Each day's totals and each batch is one step of GitLab's ``loop_until``: no step starts once ``max_runtime``
    has passed since ``hooks.clock()`` was first read; runs of a day whose totals are not written yet are never
    deleted. ``hooks.on_batch`` gets each batch's run ids and its events deleted.
    """
    result = PruneResult(resumed_run_ids=resume_interrupted_batch(instance))
    steps = _steps(instance, limits.cutoffs, lambda: hooks.batch_size(limits.batch_size), result, hooks.on_batch)
    end = loop_until(lambda: next(steps, False), timeout=limits.max_runtime.total_seconds(), brake=hooks.brake,
                     clock=hooks.clock)
    result.time_limit_reached = end is LoopEnd.TIMEOUT
    return result


def _steps(
    instance: DagsterInstance, cutoffs: Cutoffs, batch_size: Callable[[], int], result: PruneResult,
    on_batch: Callable[[list[str], int], None],
) -> Iterator[bool]:
    """The prune's work, one step per ``next``: each day's totals written, then each batch of old runs deleted."""
    for day in days_to_summarise(instance, cutoffs):
        record_day(instance, day, day_totals(instance, day))
        result.days_summarised += 1
        yield True
    last = summarised_through(instance)
    if last is None:
        return  # no finished run older than the cut-off
    until = dt.datetime(last.year, last.month, last.day, tzinfo=dt.UTC) + _ONE_DAY
    for runs_filter in _filters(cutoffs, until):
        while records := oldest_first(instance, runs_filter, batch_size()):
            run_ids = [r.dagster_run.run_id for r in records]
            events = delete_batch(instance, run_ids)
            result.runs_deleted += len(run_ids)
            result.events_deleted += events
            result.batch_counts.append(len(run_ids))
            on_batch(run_ids, events)
            yield True
