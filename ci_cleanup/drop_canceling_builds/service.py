"""Seed 000, ``Ci::StuckBuilds::DropCancelingService``: fail builds stuck in ``canceling`` for over an hour.

The rule, without Dagster: find outdated canceling builds in the seed's order, 100 at a time, and
drop each with optimistic locking (GitLab retries a lock conflict 3 times). A build that changed
meanwhile is left as it is; a build that cannot be dropped is doomed.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import BigInteger, ColumnElement, Integer, Select, and_, any_, bindparam, delete, func, literal, select, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection, Engine, Row
from sqlalchemy.exc import DBAPIError

from ..gitlab.schema import DATA_INTEGRITY_FAILURE, STUCK_OR_TIMEOUT_FAILURE, TIMESTAMP, GitLabSchema, naive_utc, utc_now

TIMEOUT = dt.timedelta(hours=1)
BATCH_SIZE = 100
LOCK_RETRIES = 3  # GitLab's Ci::Build.retry_lock on ActiveRecord::StaleObjectError


@dataclass
class BatchOutcome:
    """One batch, as the seed logs it ("Dropping outdated build": build_id, runner_id, status, failure_reason)."""

    dropped: list[Row] = field(default_factory=list)
    doomed: list[tuple[int, str]] = field(default_factory=list)  # (build id, the error that doomed it)
    changed_concurrently: list[int] = field(default_factory=list)
    left: list[int] = field(default_factory=list)  # still canceling: lock conflicts past the retries, failed dooms
    errors: list[tuple[int, str]] = field(default_factory=list)


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


def outdated_canceling(schema: GitLabSchema, cutoff: dt.datetime) -> ColumnElement[bool]:
    """``Ci::Build.canceling.created_at_before(1.hour.ago).updated_at_before(1.hour.ago)``, both strict."""
    b = schema.ci_builds
    if isinstance(cutoff, dt.datetime):
        cutoff = naive_utc(cutoff)
    return and_(
        b.c.type == "Ci::Build",
        b.c.status == "canceling",
        b.c.created_at < cutoff,
        b.c.updated_at < cutoff,
    )


def find_batch_query(schema: GitLabSchema, cutoff: dt.datetime, limit: int, exclude: set[int]) -> Select:
    """The next ``limit`` candidates, ``ORDER BY created_at, project_id`` as the seed says."""
    b = schema.ci_builds
    query = select(b.c.id, b.c.runner_id, b.c.status, func.coalesce(b.c.lock_version, 0).label("lock_version")).where(
        outdated_canceling(schema, cutoff)
    )
    if exclude:
        query = query.where(b.c.id.not_in(exclude))
    return query.order_by(b.c.created_at, b.c.project_id, b.c.id).limit(limit)


def find_batch(conn: Connection, schema: GitLabSchema, cutoff: dt.datetime, limit: int, exclude: set[int]):
    return conn.execute(find_batch_query(schema, cutoff, limit, exclude)).all()


def count_candidates(conn: Connection, schema: GitLabSchema, cutoff: dt.datetime) -> int:
    return conn.scalar(select(func.count()).select_from(schema.ci_builds).where(outdated_canceling(schema, cutoff)))


def _delete_from_queues(conn: Connection, schema: GitLabSchema, build_ids: list[int]) -> None:
    # A build leaving `canceling` for `failed` leaves GitLab's pending and running queues too.
    conn.execute(delete(schema.ci_pending_builds).where(schema.ci_pending_builds.c.build_id.in_(build_ids)))
    conn.execute(delete(schema.ci_running_builds).where(schema.ci_running_builds.c.build_id.in_(build_ids)))


def drop_statement(schema: GitLabSchema, expected: dict[int, int], cutoff: dt.datetime, now: dt.datetime) -> Select:
    """Drop the builds whose lock_version is still the one we read and that are still outdated and canceling.

    One statement: the UPDATE and the two queue DELETEs of what it dropped are data-modifying CTEs,
    so a batch costs one round trip, as plain SQL would. ``id IN`` keeps it on the primary key.
    """
    b = schema.ci_builds
    now = naive_utc(now)
    # The (id, lock_version) pairs read, as two array parameters: a literal list of 100 pairs would be
    # an OR of 100 branches that PostgreSQL takes longer to plan than to run.
    read = func.unnest(
        bindparam("ids", list(expected), type_=ARRAY(BigInteger)), bindparam("lock_versions", list(expected.values()), type_=ARRAY(Integer))
    ).table_valued("id", "lock_version").render_derived(name="read")
    dropped, left_queues = _dropped(
        schema, now, [b.c.id == read.c.id, func.coalesce(b.c.lock_version, 0) == read.c.lock_version, outdated_canceling(schema, cutoff)],
    )
    return select(dropped.c.id, dropped.c.runner_id).add_cte(*left_queues)


def _dropped(schema: GitLabSchema, now, where: list):
    """The ``dropped`` CTE (``UPDATE … SET status = 'failed' … WHERE <where> RETURNING``) and the queue DELETEs it implies."""
    b, pending, running = schema.ci_builds, schema.ci_pending_builds, schema.ci_running_builds
    dropped = (
        update(b)
        .where(*where)
        .values(
            status="failed",
            failure_reason=STUCK_OR_TIMEOUT_FAILURE,
            finished_at=func.coalesce(b.c.finished_at, now),
            updated_at=now,
            lock_version=func.coalesce(b.c.lock_version, 0) + 1,
        )
        .returning(b.c.id, b.c.runner_id, b.c.created_at, b.c.project_id)
        .cte("dropped")
    )
    # A build leaving `canceling` for `failed` leaves GitLab's pending and running queues too.
    left_pending = delete(pending).where(pending.c.build_id.in_(select(dropped.c.id))).cte("left_pending")
    left_running = delete(running).where(running.c.build_id.in_(select(dropped.c.id))).cte("left_running")
    return dropped, (left_pending, left_running)


@functools.lru_cache(maxsize=8)
def find_and_drop_statement(schema: GitLabSchema) -> Select:
    """A whole batch in one statement: pick the next ``:limit`` candidates in the seed's order and drop them.

    ``UPDATE … WHERE id = ANY(ARRAY(next candidates)) AND <still outdated and canceling>``: a build
    changed by someone else after the statement's snapshot is re-checked by PostgreSQL when its row
    is locked (EvalPlanQual), so one that stopped being a candidate is never overwritten, and one
    still a candidate is dropped in its new version (GitLab's lock retry). The queue DELETEs are
    data-modifying CTEs. Built once, with ``:cutoff``, ``:now`` and ``:limit`` bound per batch.
    """
    b = schema.ci_builds
    cutoff, now = bindparam("cutoff", type_=TIMESTAMP), bindparam("now", type_=TIMESTAMP)
    candidate = outdated_canceling(schema, cutoff)
    picked = (
        select(b.c.id).where(candidate).order_by(b.c.created_at, b.c.project_id, b.c.id)
        .limit(bindparam("limit", type_=Integer)).scalar_subquery()
    )
    dropped, left_queues = _dropped(schema, now, [b.c.id == any_(func.array(picked)), candidate])
    # The seed logs the status the build was read in: a dropped build was canceling.
    return (
        select(dropped.c.id, dropped.c.runner_id, literal("canceling").label("status"))
        .add_cte(*left_queues)
        .order_by(dropped.c.created_at, dropped.c.project_id, dropped.c.id)
    )


def _drop(conn: Connection, schema: GitLabSchema, expected: dict[int, int], cutoff: dt.datetime, now: dt.datetime):
    return conn.execute(drop_statement(schema, expected, cutoff, now)).all()


def doom(engine: Engine, schema: GitLabSchema, build_id: int, now: dt.datetime) -> bool:
    """GitLab's ``doom!``: failed with data_integrity_failure and out of the queues, if still canceling."""
    b = schema.ci_builds
    now = naive_utc(now)
    with engine.begin() as conn:
        doomed = conn.execute(
            update(b)
            .where(b.c.id == build_id, b.c.status == "canceling")
            .values(
                status="failed",
                failure_reason=DATA_INTEGRITY_FAILURE,
                finished_at=func.coalesce(b.c.finished_at, now),
                updated_at=now,
                lock_version=func.coalesce(b.c.lock_version, 0) + 1,
            )
            .returning(b.c.id)
        ).first()
        if doomed:
            _delete_from_queues(conn, schema, [build_id])
    return doomed is not None


def drop_builds(engine: Engine, schema: GitLabSchema, builds: list[Row], cutoff: dt.datetime, now: dt.datetime) -> BatchOutcome:
    """Drop one batch in one statement per attempt; a conflicting build is re-read and retried."""
    outcome = BatchOutcome()
    expected = {row.id: row.lock_version for row in builds}
    read = {row.id: row for row in builds}
    for attempt in range(LOCK_RETRIES + 1):
        with engine.begin() as conn:
            dropped = _drop(conn, schema, expected, cutoff, now)
            outcome.dropped += [read[row.id] for row in dropped]
            for row in dropped:
                del expected[row.id]
            if not expected:
                break
            b = schema.ci_builds
            still_outdated = dict(
                conn.execute(
                    select(b.c.id, func.coalesce(b.c.lock_version, 0)).where(
                        b.c.id.in_(list(expected)), outdated_canceling(schema, cutoff)
                    )
                ).all()
            )
        outcome.changed_concurrently += [build_id for build_id in expected if build_id not in still_outdated]
        expected = still_outdated
        if not expected:
            break
    outcome.left += list(expected)
    return outcome


def drop_builds_one_by_one(
    engine: Engine, schema: GitLabSchema, builds: list[Row], cutoff: dt.datetime, now: dt.datetime,
    report_error: Callable[[int, BaseException], None],
) -> BatchOutcome:
    """The seed's per-record path, taken when a batch statement fails: each build dropped or doomed alone."""
    outcome = BatchOutcome()
    for build in builds:
        try:
            single = drop_builds(engine, schema, [build], cutoff, now)
        except DBAPIError as e:
            if e.connection_invalidated:
                raise
            report_error(build.id, e)
            reason = str(getattr(e, "orig", e)).strip().splitlines()[0]
            try:
                doomed = doom(engine, schema, build.id, now)
            except DBAPIError as doom_error:
                if doom_error.connection_invalidated:
                    raise
                report_error(build.id, doom_error)
                outcome.errors.append((build.id, reason))
                outcome.left.append(build.id)
                continue
            if doomed:
                outcome.doomed.append((build.id, reason))
            else:
                outcome.changed_concurrently.append(build.id)
            outcome.errors.append((build.id, reason))
            continue
        outcome.dropped += single.dropped
        outcome.changed_concurrently += single.changed_concurrently
        outcome.left += single.left
    return outcome


def drop_canceling_builds(
    engine: Engine,
    schema: GitLabSchema,
    *,
    cutoff: dt.datetime,
    batch_size: int = BATCH_SIZE,
    on_batch: Callable[[BatchOutcome], None] = lambda batch: None,
    report_error: Callable[[int, BaseException], None] = lambda build_id, error: None,
    now: Callable[[], dt.datetime] = utc_now,
) -> DropResult:
    """Drop every outdated canceling build, batch after batch, until none is left."""
    result = DropResult()
    left: set[int] = set()  # builds that stay canceling after their turn are not picked again this run
    fast = True  # one statement per batch until a batch fails or finds nothing; then read, then write
    with engine.connect() as conn:  # one connection for the run, one transaction per batch
        while True:
            if fast:
                try:
                    with conn.begin():
                        dropped = conn.execute(
                            find_and_drop_statement(schema), {"cutoff": naive_utc(cutoff), "now": naive_utc(now()), "limit": batch_size}
                        ).all()
                except DBAPIError as e:
                    if e.connection_invalidated:
                        raise
                    fast = False  # a build that cannot be dropped: this batch build by build, doomed if need be
                else:
                    if dropped:
                        batch = BatchOutcome(dropped=dropped)
                        result.add(batch)
                        on_batch(batch)
                        continue
                    # Nothing dropped: done, unless every candidate picked changed meanwhile; the read path confirms.
                    fast = False
            with conn.begin():
                builds = find_batch(conn, schema, cutoff, batch_size, left)
            if not builds:
                return result
            try:
                batch = drop_builds(engine, schema, builds, cutoff, now())
            except DBAPIError as e:
                if e.connection_invalidated:
                    raise
                batch = drop_builds_one_by_one(engine, schema, builds, cutoff, now(), report_error)
            left.update(batch.left)
            # Back to one statement per batch, unless a build stays canceling (the statement cannot skip it).
            fast = not left
            result.add(batch)
            on_batch(batch)
