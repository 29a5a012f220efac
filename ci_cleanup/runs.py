"""What every job's ops use to report: run tags, totals, error tracking and per-batch observations.

The run's shape (lease, dry run, status, job and schedule) is :mod:`ci_cleanup.batch`.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterable, Mapping, Sequence

from dagster import (
    AssetKey,
    AssetObservation,
    MetadataValue,
    OpExecutionContext,
    TableColumn,
    TableRecord,
    TableSchema,
)

from .metrics import push_run_metrics

DRY_RUN_TAG = "ci_cleanup/dry_run"
ROWS_CHANGED = "rows_changed"  # every job reports how many rows it changed under this key
ROWS_CHANGED_TAG = "ci_cleanup/rows_changed"  # the headline number, visible in the runs list
# Rows a run reported and stepped over (an error on the row, a refused path): the run stays green, so
# the count is tagged and alerted (sensors.rows_with_errors_alert) rather than left in the metadata alone.
ROWS_WITH_ERRORS = "rows_with_errors"
ROWS_WITH_ERRORS_TAG = "ci_cleanup/rows_with_errors"
MAX_DELETIONS_TAG = "ci_cleanup/max_deletions_reached"
SKIPPED_TAG = "ci_cleanup/skipped"  # why a run did nothing, e.g. "lease held"
LEASE_WITHOUT_TTL_TAG = "ci_cleanup/lease_without_ttl"  # the lease key that made it skip and will never expire
MAX_IDS_REPORTED = 1000  # ids listed in metadata; counts are always exact


def report_run(
    context: OpExecutionContext, metadata: Mapping[str, object], tags: Mapping[str, str] | None = None
) -> None:
    """The run's totals: output metadata of the last op, and the headline number as a run tag."""
    context.add_output_metadata(dict(metadata))
    tags = {ROWS_CHANGED_TAG: str(metadata[ROWS_CHANGED]), **(tags or {})}
    if metadata.get(ROWS_WITH_ERRORS):
        tags[ROWS_WITH_ERRORS_TAG] = str(metadata[ROWS_WITH_ERRORS])
    context.instance.add_run_tags(context.run_id, tags)
    counters = {k: v for k, v in metadata.items() if isinstance(v, int) and not isinstance(v, bool)}
    push_run_metrics(context.job_name, counters)


def track_exception(context: OpExecutionContext, error: BaseException, **details) -> None:
    """GitLab's ``Gitlab::ErrorTracking``: log it on the run and send it to Sentry when SENTRY_DSN is set."""
    context.log.error(f"{type(error).__name__}: {str(error).strip()} {details}")
    if os.environ.get("SENTRY_DSN"):
        import sentry_sdk

        if not sentry_sdk.get_client().is_active():
            sentry_sdk.init(dsn=os.environ["SENTRY_DSN"])
        with sentry_sdk.new_scope() as scope:
            scope.set_tag("dagster_run_id", context.run_id)
            for name, value in details.items():
                scope.set_extra(name, value)
            sentry_sdk.capture_exception(error)


def table(records: Sequence[Mapping[str, object]], columns: Sequence[str]) -> MetadataValue:
    return MetadataValue.table(
        records=[TableRecord({c: r[c] for c in columns}) for r in records],
        schema=TableSchema(columns=[TableColumn(c) for c in columns]),
    )


def observe(context: OpExecutionContext, asset: Sequence[str], metadata: Mapping[str, object]) -> None:
    """One observation per batch on a GitLab table's asset key, so the UI plots the numbers across runs."""
    context.log_event(AssetObservation(asset_key=AssetKey(list(asset)), metadata=dict(metadata)))


OBSERVE_EVERY_SECONDS = 5.0  # at most one observation per table this often while a run works
MAX_ROWS_OBSERVED = 100  # rows of the service's per-batch log kept in one observation's table
MAX_BATCHES_LISTED = 1000  # per-batch counts kept in one observation


class BatchObserver:
    """A run's per-batch numbers, observed on a GitLab table at a bounded rate instead of once per batch.

    Writing an observation is an event in the instance's PostgreSQL, as costly as a batch's SQL
    (docs/performance.md): so batches are gathered and observed every ``every`` seconds, and once more at the end. Each
    observation carries the sums since the last one (what the UI plots across runs), ``batches``,
    ``per_batch`` (each batch's counts, in order) and the first ``MAX_ROWS_OBSERVED`` rows of the
    service's per-batch log (ids, statuses) as a table; the run's last op lists the first 1000 ids too.

    A run with no batch at all (nothing to do) is observed too, each of ``keys`` 0: else the plot would skip it,
    and a line through idle runs would read as if they had never happened.

    ``brake``: the run's; each observation then carries its pacing since the last (``pacing_paused_seconds``,
    ``pacing_batch_size_share``, ``pacing_slowed_batches``), plotted across runs beside the counts.
    """

    def __init__(self, context: OpExecutionContext, asset: Sequence[str], columns: Sequence[str] = (),
                 log_name: str = "rows", every: float | None = None, clock=time.monotonic, keys: Sequence[str] = (),
                 brake=None):
        self.context, self.asset, self.columns, self.log_name = context, asset, list(columns), log_name
        self.every, self.clock, self.keys = OBSERVE_EVERY_SECONDS if every is None else every, clock, list(keys)
        self.brake = brake
        self.observed = False
        self.last = clock()
        self.per_batch: list[dict[str, int]] = []
        self.rows: list[Mapping[str, object]] = []

    def add(self, counts: Mapping[str, int], rows: Iterable[Mapping[str, object]] = ()) -> None:
        """A batch's counts and its log rows; ``rows`` may be lazy: only those the observation keeps are made."""
        self.per_batch.append(dict(counts))
        self.rows += itertools.islice(rows, max(0, MAX_ROWS_OBSERVED - len(self.rows)))
        if self.clock() - self.last >= self.every:
            self.flush()

    @property
    def wants_rows(self) -> bool:
        """Whether a batch's log rows would be kept now (this observation's table is not full yet): a service may
        then leave the rest of its batches' rows unread, even unreturned by its statement."""
        return bool(self.columns) and len(self.rows) < MAX_ROWS_OBSERVED

    def flush(self) -> None:
        if not self.per_batch:
            return
        keys = list(self.per_batch[0])
        metadata: dict[str, object] = {k: sum(b.get(k, 0) for b in self.per_batch) for k in keys}
        metadata["batches"] = len(self.per_batch)
        metadata["per_batch"] = MetadataValue.json(
            {k: [b.get(k, 0) for b in self.per_batch[:MAX_BATCHES_LISTED]] for k in keys}
        )
        if self.columns:
            metadata[self.log_name] = table(self.rows, self.columns)
        if self.brake is not None:
            metadata.update(self.brake.window())
        observe(self.context, self.asset, metadata)
        self.per_batch, self.rows, self.last, self.observed = [], [], self.clock(), True

    def __enter__(self) -> BatchObserver:
        return self

    def __exit__(self, *exc) -> None:
        if not (self.observed or self.per_batch) and self.keys:
            observe(self.context, self.asset, {**dict.fromkeys(self.keys, 0), "batches": 0})
            return
        self.flush()  # what was done before a failure is observed too
