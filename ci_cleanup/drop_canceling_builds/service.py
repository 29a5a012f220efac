"""``Ci::StuckBuilds::DropCancelingService``: fail builds stuck in ``canceling`` for over an hour.

The rule, without Dagster, in one statement (:func:`drop_statement`): pick the next outdated
canceling builds in the service's order, 100 at a time, and drop them (``failed``,
``stuck_or_timeout_failure``). A build that changed meanwhile is left as it is. When a batch fails
on a bad row, the same statement runs for each of its builds alone, and a build that still cannot
be dropped is doomed (GitLab's ``doom!``, ``data_integrity_failure``) by that statement too.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Integer,
    Select,
    Text,
    all_,
    and_,
    any_,
    bindparam,
    cast,
    delete,
    func,
    null,
    select,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import aggregate_order_by
from sqlalchemy.engine import Connection, Dialect, Engine, Row
from sqlalchemy.exc import DBAPIError

from ..gitlab.schema import (
    DATA_INTEGRITY_FAILURE,
    STUCK_OR_TIMEOUT_FAILURE,
    TIMESTAMP,
    GitLabSchema,
    array_literal,
    array_param,
    driver_sql,
    int_array,
    naive_utc,
    one_row,
    utc_now,
)

TIMEOUT = dt.timedelta(hours=1)
BATCH_SIZE = 100


class Dropped(NamedTuple):
    """A build dropped, as the service logs it: its id, its runner and the status it was read in."""

    id: int
    runner_id: int | None
    status: str = "canceling"


class DroppedBuilds(Sequence[Dropped]):
    """The builds a statement dropped, as it returned them: their number, and their ids and runners as array text,
    made rows only when read. A run reads few of them (an observation keeps its first 100 rows), and a row each,
    made for every batch, cost the client more than SQLAlchemy's whole execution of the statement (250,000
    instructions a 100-build batch, callgrind); reading the two arrays, 140,000 more."""

    def __init__(self, count: int = 0, ids: str | None = None, runner_ids: str | None = None, *,
                 with_rows: bool = True) -> None:
        self.count, self.ids_text, self.runner_ids_text, self.with_rows = count, ids, runner_ids, with_rows

    @functools.cached_property
    def rows(self) -> list[Dropped]:
        if not self.with_rows:
            raise LookupError("this batch was dropped without its rows (the caller's with_rows said so)")
        return list(map(Dropped, int_array(self.ids_text), int_array(self.runner_ids_text)))

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index):
        return self.rows[index]


@dataclass
class BatchOutcome:
    """One batch, as the service logs it ("Dropping outdated build": build_id, runner_id, status, failure_reason)."""

    dropped: Sequence[Dropped] = field(default_factory=list)
    doomed: list[tuple[int, str]] = field(default_factory=list)  # (build id, the error that doomed it)
    changed_concurrently: list[int] = field(default_factory=list)
    left: list[int] = field(default_factory=list)  # still canceling: neither dropped nor doomed
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


def outdated_canceling(schema: GitLabSchema, cutoff: dt.datetime | ColumnElement) -> ColumnElement[bool]:
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


def find_batch_query(schema: GitLabSchema, cutoff, limit, exclude=()) -> Select:
    """The next ``limit`` candidates, ``ORDER BY created_at, project_id`` as the service's ``each_batch`` reads them.

    ``exclude``: builds picked earlier in the run and not dropped, not picked again (an array
    parameter, ``:exclude``, so that :func:`drop_statement` is built once); None: no such clause. A run's batches
    have none to exclude until a build is left: ``id != ALL('{}')`` cost PostgreSQL 0.025 ms a 100-build batch.
    """
    b = schema.ci_builds
    query = select(b.c.id, b.c.created_at, b.c.project_id).where(outdated_canceling(schema, cutoff))
    if exclude is not None:
        query = query.where(b.c.id != all_(array_param("exclude", BigInteger, exclude)))
    return query.order_by(b.c.created_at, b.c.project_id, b.c.id).limit(limit)


def find_batch(conn: Connection, schema: GitLabSchema, cutoff: dt.datetime, limit: int, exclude) -> list[Row]:
    """The next batch's ids, in its order. Its timestamps stay in the database: a BC ``created_at`` cannot be a
    Python datetime, and the rows are only ever acted on by id."""
    query = find_batch_query(schema, cutoff, limit, exclude)
    return conn.execute(query.with_only_columns(query.selected_columns.id)).all()


def count_candidates(conn: Connection, schema: GitLabSchema, cutoff: dt.datetime) -> int:
    return conn.scalar(select(func.count()).select_from(schema.ci_builds).where(outdated_canceling(schema, cutoff)))


@functools.lru_cache(maxsize=8)
def drop_statement(
    schema: GitLabSchema, *, of_ids: bool = False, failure_reason: int = STUCK_OR_TIMEOUT_FAILURE,
    excluding: bool = True, rows: bool = True,
) -> Select:
    """Pick builds and drop them, in one statement; one row: the number of builds dropped (``dropped``), their ids
    and runners as array text (``dropped_ids``, ``runner_ids``, in the service's order; read by
    :class:`DroppedBuilds`) and the ids of those picked as array text (``picked_ids``, read by :func:`_drop` only when
    fewer were dropped than picked); the arrays NULL when none.

    ``WITH picked AS (<the next :limit candidates>), dropped AS (UPDATE … SET status = 'failed',
    failure_reason = …, finished_at = coalesce(finished_at, :now), updated_at = :now, lock_version + 1
    WHERE id = ANY(ARRAY(picked ids)) AND <still outdated and canceling> RETURNING …), left_pending AS
    (DELETE FROM ci_pending_builds …), left_running AS (…) SELECT (the count and the arrays, each from its CTE)``.
    Arrays, not a row per build: 100 rows cost SQLAlchemy a Row each (the client's CPU per 100-row batch, 0.2 ms
    more; environments_auto_stop measured the same).

    A build changed by someone else after the statement's snapshot is re-checked by PostgreSQL when
    its row is locked (EvalPlanQual): one that stopped being a candidate is never overwritten, one
    still a candidate is dropped in its new version (what GitLab's ``retry_lock`` achieves).
    ``of_ids``: the builds ``:ids`` instead of the next batch (the per-build fallback);
    ``failure_reason``: ``DATA_INTEGRITY_FAILURE`` dooms them; ``excluding``: with the ``:exclude`` clause (the
    builds a run left, see :func:`find_batch_query`); without ``rows``, ``dropped_ids`` in no order and
    ``runner_ids`` NULL: the service's per-build log is read for a few batches of a run (an observation keeps 100
    rows), and the ordered arrays and the columns returned for them cost PostgreSQL about 0.1 ms a 100-build batch.
    Built once; bound per batch: ``:cutoff``, ``:now``, ``:limit`` and ``:exclude`` (or ``:ids``).
    """
    b, pending, running = schema.ci_builds, schema.ci_pending_builds, schema.ci_running_builds
    cutoff, now = bindparam("cutoff", type_=TIMESTAMP), bindparam("now", type_=TIMESTAMP)
    candidate = outdated_canceling(schema, cutoff)
    if of_ids:
        picked = (
            select(b.c.id, b.c.created_at, b.c.project_id)
            .where(b.c.id == any_(array_param("ids", BigInteger)), candidate)
        )
    else:
        picked = find_batch_query(schema, cutoff, bindparam("limit", type_=Integer), () if excluding else None)
    picked = picked.cte("picked")
    dropped = (
        update(b)
        .where(b.c.id == any_(func.array(select(picked.c.id).scalar_subquery())), candidate)
        .values(
            status="failed",
            failure_reason=failure_reason,
            finished_at=func.coalesce(b.c.finished_at, now),
            updated_at=now,
            lock_version=func.coalesce(b.c.lock_version, 0) + 1,
        )
        .returning(b.c.id, b.c.partition_id, *((b.c.runner_id, b.c.created_at, b.c.project_id) if rows else ()))
        .cte("dropped")
    )
    # A build leaving `canceling` for `failed` leaves GitLab's pending and running queues too. Its queue row is looked
    # up for each dropped build by (partition_id, build_id), the key of GitLab's foreign key to its build (LATERAL,
    # LIMIT 1: a lookup per build, never folded into a join), then deleted by id: the plan no longer follows the
    # queue's statistics. As a semi-join (`build_id IN (SELECT …)`) it did: with the statistics autovacuum leaves on a
    # queue it saw drained, the queue was taken for one row and a nested loop read all of it for every batch (1.8-1.9
    # s for a batch of 7-12 ms with 100,000 builds queued, planned so after 2 of 37 benchmark resets);
    # `build_id = ANY(…)` read the whole (partition_id, build_id) index there.
    def of_dropped(queue):
        row = queue.alias()
        found = (
            select(row.c.id).where(row.c.partition_id == dropped.c.partition_id, row.c.build_id == dropped.c.id)
            .limit(1).lateral()
        )
        looked_up = select(found.c.id).select_from(dropped).join(found, true())
        return queue.c.id == any_(func.array(looked_up.scalar_subquery()))

    left_pending = delete(pending).where(of_dropped(pending)).cte("left_pending")
    left_running = delete(running).where(of_dropped(running)).cte("left_running")

    def in_order(column):  # the service's order, as text (DroppedBuilds); over the whole CTE, not correlated
        if rows:
            column = aggregate_order_by(column, dropped.c.created_at, dropped.c.project_id, dropped.c.id)
        return select(cast(func.array_agg(column), Text)).correlate(None).scalar_subquery()

    # The ids picked, not those left: an anti-join of the picked and the dropped in every batch cost PostgreSQL 0.025
    # ms a 100-build batch more (planned for every statement) for a list that is nearly always empty.
    picked_ids = select(cast(func.array_agg(picked.c.id), Text))
    return select(
        select(func.count()).select_from(dropped).correlate(None).scalar_subquery().label("dropped"),
        in_order(dropped.c.id).label("dropped_ids"),
        (in_order(dropped.c.runner_id) if rows else null()).label("runner_ids"),
        picked_ids.correlate(None).scalar_subquery().label("picked_ids"),
    ).add_cte(left_pending, left_running)


@functools.lru_cache(maxsize=8)
def compiled_drop_statement(
    schema: GitLabSchema, dialect: Dialect, *, of_ids: bool = False, failure_reason: int = STUCK_OR_TIMEOUT_FAILURE,
    excluding: bool = True, rows: bool = True,
) -> tuple[str, dict]:
    """:func:`drop_statement` compiled once for ``dialect``, run as driver SQL (:func:`driver_sql`)."""
    return driver_sql(
        drop_statement(schema, of_ids=of_ids, failure_reason=failure_reason, excluding=excluding, rows=rows), dialect)


def _drop(conn: Connection, schema: GitLabSchema, params: dict, **variant) -> tuple[DroppedBuilds, list[int]]:
    """Run a drop statement (``variant``: :func:`drop_statement`'s), its own transaction on an autocommit
    connection: the builds it dropped, and the ids of those it picked and left."""
    statement, fixed = compiled_drop_statement(schema, conn.dialect, **variant)
    count, dropped_ids, runner_ids, picked_ids = one_row(conn, statement, {**fixed, **params})
    dropped = DroppedBuilds(count, dropped_ids, runner_ids, with_rows=variant.get("rows", True))
    if not picked_ids or picked_ids.count(",") + 1 == count:  # all of them dropped: nothing to read
        return dropped, []
    done = set(int_array(dropped_ids))
    return dropped, [build_id for build_id in int_array(picked_ids) if build_id not in done]


def drop_builds(
    conn: Engine | Connection, schema: GitLabSchema, builds: list[Row], cutoff: dt.datetime, now: dt.datetime,
    failure_reason: int = STUCK_OR_TIMEOUT_FAILURE,
) -> BatchOutcome:
    """These builds, read earlier, dropped by :func:`drop_statement` for their ids, in one transaction.

    A build no longer outdated and canceling changed concurrently and is left as it is.
    """
    if isinstance(conn, Engine):
        with conn.connect() as connection, connection.begin():
            return drop_builds(connection, schema, builds, cutoff, now, failure_reason)
    ids = [build.id for build in builds]
    params = {"cutoff": naive_utc(cutoff), "now": naive_utc(now), "ids": array_literal(ids)}
    dropped, _ = _drop(conn, schema, params, of_ids=True, failure_reason=failure_reason)
    done = {r.id for r in dropped}
    return BatchOutcome(dropped=dropped, changed_concurrently=[build_id for build_id in ids if build_id not in done])


def drop_one_by_one(
    conn: Connection, schema: GitLabSchema, builds: list[Row], cutoff: dt.datetime, now: dt.datetime,
    report_error: Callable[[int, BaseException], None],
) -> BatchOutcome:
    """The service's per-build path, taken when a batch fails: each build dropped alone, doomed if that fails."""
    outcome = BatchOutcome()
    for build in builds:
        try:
            single = drop_builds(conn, schema, [build], cutoff, now)
        except DBAPIError as e:
            if e.connection_invalidated:
                raise
            report_error(build.id, e)
            reason = str(getattr(e, "orig", e)).strip().splitlines()[0]
            outcome.errors.append((build.id, reason))
            try:
                doomed = drop_builds(conn, schema, [build], cutoff, now, DATA_INTEGRITY_FAILURE)
            except DBAPIError as doom_error:
                if doom_error.connection_invalidated:
                    raise
                report_error(build.id, doom_error)
                outcome.left.append(build.id)
                continue
            outcome.doomed += [(row.id, reason) for row in doomed.dropped]
            outcome.changed_concurrently += doomed.changed_concurrently
            continue
        outcome.dropped += single.dropped
        outcome.changed_concurrently += single.changed_concurrently
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
    with_rows: Callable[[], bool] = lambda: True,
) -> DropResult:
    """Drop every outdated canceling build, batch after batch, until a batch picks none. ``with_rows``, asked before
    each batch: whether its builds are wanted as rows (``BatchOutcome.dropped``), or only their number."""
    result = DropResult()
    # Builds picked and not dropped are not picked again this run: one left canceling (a failed doom,
    # a trigger that skips its row) would otherwise come back in every batch.
    passed_over: list[int] = []
    # One connection for the run, in autocommit: every write here (a batch, a build, a doom) is one statement, its
    # own transaction, all or nothing; BEGIN and COMMIT around it would be two more round trips per batch (through
    # PgBouncer, more than the statement's own time at 100-row batches).
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        while True:
            batch_time = now()
            params = {"cutoff": naive_utc(cutoff), "now": naive_utc(batch_time), "limit": batch_size}
            if passed_over:
                params["exclude"] = array_literal(passed_over)
            try:
                dropped, changed = _drop(conn, schema, params, excluding=bool(passed_over), rows=with_rows())
                batch = BatchOutcome(dropped=dropped, changed_concurrently=changed)
            except DBAPIError as e:
                if e.connection_invalidated:
                    raise
                with conn.begin():
                    builds = find_batch(conn, schema, cutoff, batch_size, passed_over)
                batch = drop_one_by_one(conn, schema, builds, cutoff, batch_time, report_error)
            if not (batch.dropped or batch.changed_concurrently or batch.doomed or batch.left):
                return result
            passed_over += batch.changed_concurrently + batch.left
            result.add(batch)
            on_batch(batch)
