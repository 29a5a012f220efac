"""What every job's Dagster layer shares: the run's lease, dry runs, error tracking and reporting.

A run's lease value is its Dagster run id (a uuid, as GitLab's leases hold), so any step of the
run, and the failure hook, can release exactly the lease the run took, and nothing else.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence

from dagster import (
    AssetKey,
    AssetObservation,
    HookContext,
    MetadataValue,
    OpExecutionContext,
    TableColumn,
    TableRecord,
    TableSchema,
    failure_hook,
)

from .gitlab.exclusive_lease import ExclusiveLease
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

log = logging.getLogger("ci_cleanup")


def run_lease(context: OpExecutionContext | HookContext, client, key: str, ttl_seconds: int) -> ExclusiveLease:
    return ExclusiveLease(client, key, ttl_seconds, uuid=context.run_id)


def release_lease_on_failure(key: str, ttl_seconds: int):
    """A job hook: a failed step gives back the run's lease at once instead of holding it for its TTL."""

    @failure_hook(name=f"release_{key.replace('/', '_').replace(':', '_')}_on_failure", required_resource_keys={"gitlab_redis"})
    def _release(context: HookContext) -> None:
        if run_lease(context, context.resources.gitlab_redis.shared_state, key, ttl_seconds).cancel():
            context.log.info(f"Released lease {key} after the failure")

    return _release


def skip_for_held_lease(context: OpExecutionContext, lease: ExclusiveLease) -> dict:
    """GitLab's answer to a held lease: skip the run. Tagged, so that a lease that never expires (no TTL,
    e.g. set by hand) or a job skipped run after run is alerted (sensors.lease_held_alert), not silent."""
    ttl = lease.client.ttl(lease.redis_key)  # -1: the key has no expiry; -2: it went away meanwhile
    tags = {SKIPPED_TAG: "lease held"}
    if ttl == -1:
        tags[LEASE_WITHOUT_TTL_TAG] = lease.redis_key
        context.log.warning(f"Lease {lease.redis_key} has no TTL: it is never released by expiry, so every run skips")
    context.instance.add_run_tags(context.run_id, tags)
    context.log.info(f"Lease {lease.key} is held by another process; skipping as the seed does")
    return {"lease_ttl_seconds": ttl}


def mark_dry_run(context: OpExecutionContext) -> None:
    context.instance.add_run_tags(context.run_id, {DRY_RUN_TAG: "true"})
    context.log.info("Dry run: finding what would change, writing nothing")


def report_run(context: OpExecutionContext, metadata: Mapping[str, object], tags: Mapping[str, str] | None = None) -> None:
    """The run's totals: output metadata of the last op, and the headline number as a run tag."""
    context.add_output_metadata(dict(metadata))
    tags = {ROWS_CHANGED_TAG: str(metadata[ROWS_CHANGED]), **(tags or {})}
    if metadata.get(ROWS_WITH_ERRORS):
        tags[ROWS_WITH_ERRORS_TAG] = str(metadata[ROWS_WITH_ERRORS])
    context.instance.add_run_tags(context.run_id, tags)
    counters = {k: v for k, v in metadata.items() if isinstance(v, int) and not isinstance(v, bool)}
    push_run_metrics(context.job_name, counters)


def track_exception(context: OpExecutionContext, error: BaseException, **details) -> None:
    """The seeds' ``Gitlab::ErrorTracking``: log it on the run and send it to Sentry when SENTRY_DSN is set."""
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
MAX_ROWS_OBSERVED = 100  # rows of the seed's per-batch log kept in one observation's table
MAX_BATCHES_LISTED = 1000  # per-batch counts kept in one observation


class BatchObserver:
    """A run's per-batch numbers, observed on a GitLab table at a bounded rate instead of once per batch.

    Writing an observation costs about 15 ms (an event in the instance's PostgreSQL), as much as a batch's
    SQL: so batches are gathered and observed every ``every`` seconds, and once more at the end. Each
    observation carries the sums since the last one (what the UI plots across runs), ``batches``,
    ``per_batch`` (each batch's counts, in order) and the first ``MAX_ROWS_OBSERVED`` rows of the
    seed's per-batch log (ids, statuses) as a table; the run's last op lists the first 1000 ids too.
    """

    def __init__(self, context: OpExecutionContext, asset: Sequence[str], columns: Sequence[str] = (),
                 log_name: str = "rows", every: float | None = None, clock=time.monotonic):
        self.context, self.asset, self.columns, self.log_name = context, asset, list(columns), log_name
        self.every, self.clock = OBSERVE_EVERY_SECONDS if every is None else every, clock
        self.last = clock()
        self.per_batch: list[dict[str, int]] = []
        self.rows: list[Mapping[str, object]] = []

    def add(self, counts: Mapping[str, int], rows: Sequence[Mapping[str, object]] = ()) -> None:
        self.per_batch.append(dict(counts))
        self.rows += rows[: max(0, MAX_ROWS_OBSERVED - len(self.rows))]
        if self.clock() - self.last >= self.every:
            self.flush()

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
        observe(self.context, self.asset, metadata)
        self.per_batch, self.rows, self.last = [], [], self.clock()

    def __enter__(self) -> "BatchObserver":
        return self

    def __exit__(self, *exc) -> None:
        self.flush()  # what was done before a failure is observed too
