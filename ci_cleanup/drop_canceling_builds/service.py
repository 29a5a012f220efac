"""``Ci::StuckBuilds::DropCancelingService``: fail builds stuck in ``canceling`` for over an hour.

The rule is SQL, in this package: ``drop_canceling_builds.sql`` picks the next outdated canceling builds in the
service's order, 100 at a time, and drops them (``failed``, the run's failure reason: the seed's
``stuck_or_timeout_failure`` or GitLab 19.1+'s ``no_updates_canceling``) with their queue rows.
When a batch fails on a bad row, each of its builds is dropped alone (``drop_builds.sql``), and one that still
cannot be dropped is doomed (GitLab's ``doom!``, ``data_integrity_failure``) by the same statement.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from sqlalchemy.engine import Connection, Engine, Row
from sqlalchemy.exc import DBAPIError

from ..gitlab.batching import autocommit, database_error, row_by_row_on_failure
from ..gitlab.loop_helpers import NO_HOOKS, Hooks, loop_until
from ..gitlab.schema import (
    DATA_INTEGRITY_FAILURE,
    NO_UPDATES_CANCELING,
    STUCK_OR_TIMEOUT_FAILURE,
    GitLabSchema,
    naive_utc,
)
from ..gitlab.sql_files import SqlFile

TIMEOUT = dt.timedelta(hours=1)  # DropCancelingService::TIMEOUT
BATCH_SIZE = 100  # DropHelpers#fetch: 100 builds at a time
# The failure reasons a run may write: the seed's, and GitLab 19.1+'s (its DropCancelingService, 30 minutes).
FAILURE_REASONS = {"stuck_or_timeout_failure": STUCK_OR_TIMEOUT_FAILURE, "no_updates_canceling": NO_UPDATES_CANCELING}

NEXT_BATCH = SqlFile(__package__, "drop_canceling_builds.sql")
THESE_BUILDS = SqlFile(__package__, "drop_builds.sql")
CANDIDATES = SqlFile(__package__, "find_canceling_builds.sql")
COUNT = SqlFile(__package__, "count_canceling_builds.sql")


@dataclass(frozen=True)
class Dropped:
    """A build dropped, as the service logs it: its id, its runner and the status it was read in."""

    id: int
    runner_id: int | None
    status: str = "canceling"


@dataclass
class BatchOutcome:
    """One batch, as the service logs it ("Dropping outdated build": build_id, runner_id, status, failure_reason)."""

    dropped: list[Dropped] = field(default_factory=list)
    doomed: list[tuple[int, str]] = field(default_factory=list)  # (build id, the error that doomed it)
    changed_concurrently: list[int] = field(default_factory=list)
    left: list[int] = field(default_factory=list)  # still canceling: neither dropped nor doomed
    errors: list[tuple[int, str]] = field(default_factory=list)

    @classmethod
    def of(cls, parts: Iterable[BatchOutcome]) -> BatchOutcome:
        whole = cls()
        for part in parts:
            whole.dropped += part.dropped
            whole.doomed += part.doomed
            whole.changed_concurrently += part.changed_concurrently
            whole.left += part.left
            whole.errors += part.errors
        return whole

    @property
    def picked_none(self) -> bool:
        return not (self.dropped or self.doomed or self.changed_concurrently or self.left)


@dataclass
class DropResult:
    batches: int = 0
    dropped: int = 0
    doomed: int = 0
    changed_concurrently: int = 0
    left: int = 0
    errors: list[tuple[int, str]] = field(default_factory=list)

    def add(self, batch: BatchOutcome) -> None:
        self.batches += 1
        self.dropped += len(batch.dropped)
        self.doomed += len(batch.doomed)
        self.changed_concurrently += len(batch.changed_concurrently)
        self.left += len(batch.left)
        self.errors += batch.errors


@dataclass(frozen=True)
class Limits:
    cutoff: dt.datetime  # a build canceling and untouched since before it is outdated
    batch_size: int = BATCH_SIZE
    failure_reason: int = STUCK_OR_TIMEOUT_FAILURE  # a value of FAILURE_REASONS


def count_candidates(conn: Connection, schema: GitLabSchema, cutoff: dt.datetime) -> int:
    return conn.scalar(COUNT.on(schema, conn.dialect), {"cutoff": naive_utc(cutoff)})


def find_batch(
    conn: Connection, schema: GitLabSchema, cutoff: dt.datetime, limit: int, passed_over: Sequence[int] = ()
) -> list[int]:
    """The ids of the next ``limit`` candidates, in the service's order. Only ids: a BC ``created_at`` cannot be a
    Python datetime, and the builds are only ever acted on by id."""
    params = {"cutoff": naive_utc(cutoff), "batch_size": limit, "passed_over": list(passed_over)}
    return list(conn.scalars(CANDIDATES.on(schema, conn.dialect), params))


def _outcome(rows: Iterable[Row]) -> BatchOutcome:
    """A drop statement's rows (each build picked: dropped, or passed over) as the batch's outcome."""
    outcome = BatchOutcome()
    for build in rows:
        if build.dropped:
            outcome.dropped.append(Dropped(build.id, build.runner_id))
        else:
            outcome.changed_concurrently.append(build.id)
    return outcome


def drop_next_batch(
    conn: Connection, schema: GitLabSchema, limits: Limits, now: dt.datetime, passed_over: Sequence[int] = ()
) -> BatchOutcome:
    """The next batch picked and dropped, in one statement (its own transaction on an autocommit connection)."""
    params = {"cutoff": naive_utc(limits.cutoff), "now": naive_utc(now), "batch_size": limits.batch_size,
              "passed_over": list(passed_over), "failure_reason": limits.failure_reason}
    return _outcome(conn.execute(NEXT_BATCH.on(schema, conn.dialect), params))


def drop_builds(
    conn: Connection, schema: GitLabSchema, ids: Sequence[int], cutoff: dt.datetime, now: dt.datetime,
    failure_reason: int = STUCK_OR_TIMEOUT_FAILURE,
) -> BatchOutcome:
    """These builds, read earlier, dropped in one statement; one no longer outdated and canceling changed
    concurrently and is left as it is."""
    params = {"ids": list(ids), "cutoff": naive_utc(cutoff), "now": naive_utc(now), "failure_reason": failure_reason}
    return _outcome(conn.execute(THESE_BUILDS.on(schema, conn.dialect), params))


def doom(
    conn: Connection, schema: GitLabSchema, build_id: int, cutoff: dt.datetime, now: dt.datetime, error: DBAPIError,
    report_error: Callable[[int, BaseException], None],
) -> BatchOutcome:
    """``DropHelpers#drop_build``'s rescue: the error tracked, the build doomed (``data_integrity_failure``); a
    build even that fails on is left canceling."""
    report_error(build_id, error)
    reason = database_error(error)
    try:
        doomed = drop_builds(conn, schema, [build_id], cutoff, now, DATA_INTEGRITY_FAILURE)
    except DBAPIError as doom_error:
        if doom_error.connection_invalidated:
            raise
        report_error(build_id, doom_error)
        return BatchOutcome(left=[build_id], errors=[(build_id, reason)])
    return BatchOutcome(doomed=[(build.id, reason) for build in doomed.dropped],
                        changed_concurrently=doomed.changed_concurrently, errors=[(build_id, reason)])


def drop_batch(
    conn: Connection, schema: GitLabSchema, limits: Limits, hooks: Hooks, passed_over: Sequence[int]
) -> BatchOutcome:
    """The next batch; if it fails on a bad row, each of its builds alone, a build that fails doomed."""
    now, rescued = hooks.now(), []
    parts = row_by_row_on_failure(
        lambda: drop_next_batch(conn, schema, limits, now, passed_over),
        lambda: find_batch(conn, schema, limits.cutoff, limits.batch_size, passed_over),
        lambda build_id: drop_builds(conn, schema, [build_id], limits.cutoff, now, limits.failure_reason),
        lambda build_id, error: rescued.append(
            doom(conn, schema, build_id, limits.cutoff, now, error, hooks.report_error)),
    )
    return BatchOutcome.of([*parts, *rescued])


def drop_canceling_builds(engine: Engine, schema: GitLabSchema, limits: Limits, hooks: Hooks = NO_HOOKS) -> DropResult:
    """Drop every outdated canceling build, batch after batch, until a batch picks none: GitLab's loop has no
    other limit (the lease's TTL and run monitoring bound the run)."""
    result = DropResult()
    # Builds picked and not dropped are not picked again this run: one left canceling (a failed doom,
    # a trigger that skips its row) would otherwise come back in every batch.
    passed_over: list[int] = []
    with autocommit(engine) as conn:

        def next_batch() -> bool:
            sized = replace(limits, batch_size=hooks.batch_size(limits.batch_size))
            batch = drop_batch(conn, schema, sized, hooks, passed_over)
            if batch.picked_none:
                return False
            passed_over.extend(batch.changed_concurrently + batch.left)
            result.add(batch)
            hooks.on_batch(batch)
            return True

        loop_until(next_batch, brake=hooks.brake)
    return result
