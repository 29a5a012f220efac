"""``Ci::Runners::StaleManagersCleanupService``: delete runner machines that stopped contacting.

The rule, without Dagster: delete stale ``ci_runner_machines`` rows in sub-batches of 100, each its
own transaction, until a pass deletes nothing or 1000 are gone. There is no lease: GitLab relies on
idempotence, and the count of each ``DELETE … RETURNING`` is what this run itself removed, so two
runs at once delete every row once and their counts add up.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import ColumnElement, Integer, Select, and_, any_, bindparam, delete, func, or_, select, union_all
from sqlalchemy.engine import Connection, Dialect, Engine

from ..gitlab.schema import TIMESTAMPTZ, GitLabSchema, driver_sql, one_row

STALE_TIMEOUT = dt.timedelta(days=7)  # Ci::RunnerManager::STALE_TIMEOUT
SUB_BATCH_LIMIT = 100
MAX_DELETIONS = 1000


@dataclass
class CleanupResult:
    """What the service returns and its cron worker logs: ``total_deleted`` and ``batch_counts``."""

    max_deletions: int
    total_deleted: int = 0
    batch_counts: list[int] = field(default_factory=list)
    # Stale rows left for the next run: counted when the cap stopped the run; else 0, as its last pass found.
    left: int = 0

    @property
    def max_deletions_reached(self) -> bool:
        # Worth an alert when reached run after run: the backlog outgrows the cap.
        return self.total_deleted >= self.max_deletions


def stale_deadline(now: dt.datetime, stale_after: dt.timedelta = STALE_TIMEOUT) -> dt.datetime:
    """``Ci::RunnerManager.stale_deadline``; the columns are timestamptz, so an aware UTC moment."""
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware (ci_runner_machines uses timestamptz)")
    return now.astimezone(dt.UTC) - stale_after


def stale(schema: GitLabSchema, deadline: dt.datetime) -> ColumnElement[bool]:
    """``Ci::RunnerManager.stale``: created and last contacted (if ever) at or before the deadline."""
    m = schema.ci_runner_machines
    return and_(m.c.created_at <= deadline, or_(m.c.contacted_at.is_(None), m.c.contacted_at <= deadline))


def count_stale(conn: Connection, schema: GitLabSchema, deadline: dt.datetime, limit: int | None = None) -> int:
    """The stale rows, or as many up to ``limit``: what a dry run would delete, or what a run stopped by its cap
    leaves.

    GitLab's service counts nothing, nor does a run its cap did not stop: its last sub-batch found none. With nothing
    to delete, a count would read again what that sub-batch read: the never-contacted machines, found by the
    contacted_at index, their ``created_at`` only in the table (the bench's 1,000,000 machines, 50,000 of them
    registered this week and never contacted: 12-15 ms of count beside the sub-batch's 5 ms, both cached).
    """
    m = schema.ci_runner_machines
    found = select(m.c.id).where(stale(schema, deadline)).limit(limit).subquery()
    return conn.scalar(select(func.count()).select_from(found))


def find_stale_ids(conn: Connection, schema: GitLabSchema, deadline: dt.datetime, limit: int) -> list[int]:
    """Stale ids in id order, for a dry run's report."""
    m = schema.ci_runner_machines
    return list(conn.scalars(select(m.c.id).where(stale(schema, deadline)).order_by(m.c.id).limit(limit)))


def delete_sub_batch(engine: Engine | Connection, schema: GitLabSchema, deadline: dt.datetime, limit: int) -> list[int]:
    """``id_in(stale.limit(n)).delete_all`` in its own transaction; returns the ids this statement deleted.

    A row another run deleted first is skipped by PostgreSQL's recheck, so it is never counted twice.
    The sub-batch is one statement: on an autocommit connection (as the run's loop and an Engine get) it is
    its own transaction in one round trip, without a BEGIN and a COMMIT around it.
    """
    if isinstance(engine, Engine):
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            return delete_sub_batch(conn, schema, deadline, limit)
    statement, fixed = _compiled_sub_batch_statement(schema, engine.dialect)
    with engine.begin():
        return one_row(engine, statement, {**fixed, "deadline": deadline, "limit": limit})[0] or []


@functools.lru_cache(maxsize=8)
def _compiled_sub_batch_statement(schema: GitLabSchema, dialect: Dialect) -> tuple[str, dict]:
    """The sub-batch DELETE compiled once, with the deadline and limit as parameters, run as driver SQL
    (:func:`~ci_cleanup.gitlab.schema.driver_sql`); its ids come back as one array, which costs the client less than
    a row per id."""
    deleted = delete_sub_batch_statement(
        schema, bindparam("deadline", type_=TIMESTAMPTZ), bindparam("limit", type_=Integer)
    ).cte("deleted")
    return driver_sql(select(func.array_agg(deleted.c.id)), dialect)


def stale_ids_query(schema: GitLabSchema, deadline: dt.datetime, limit: int) -> Select:
    """``stale.limit(n)`` as two ordered scans of GitLab's contacted_at index, so a sub-batch reads what it deletes.

    Last contacted at or before the deadline, then never contacted (those registered within the
    week are the only rows read and skipped). A plain ``LIMIT`` over the ``OR`` is a sequential scan
    that re-reads the rows earlier sub-batches left dead: its cost grows with the table.
    """
    m = schema.ci_runner_machines
    order = (m.c.contacted_at.desc(), m.c.id.desc())  # index_ci_runner_machines_on_contacted_at_desc_and_id_desc
    contacted = (
        select(m.c.id).where(m.c.contacted_at <= deadline, m.c.created_at <= deadline).order_by(*order).limit(limit)
    )
    never = select(m.c.id).where(m.c.contacted_at.is_(None), m.c.created_at <= deadline).order_by(*order).limit(limit)
    both = union_all(contacted, never).subquery()
    return select(both.c.id).limit(limit)


def delete_sub_batch_statement(schema: GitLabSchema, deadline: dt.datetime, limit: int):
    """``DELETE … WHERE id = ANY(ARRAY(stale ids)) AND stale RETURNING id``: the ids are found first, then deleted
    by primary key.

    The stale condition is repeated on the DELETE itself: a runner that checks in (``contacted_at``
    moves to now) after the ids were read is re-checked by PostgreSQL when its row is locked, and kept.
    The ids alone would be re-checked against the array read before, and the live runner deleted.
    """
    m = schema.ci_runner_machines
    stale_ids = func.array(stale_ids_query(schema, deadline, limit).scalar_subquery())
    return delete(m).where(m.c.id == any_(stale_ids), stale(schema, deadline)).returning(m.c.id)


def delete_stale_runner_managers(
    engine: Engine,
    schema: GitLabSchema,
    *,
    now: dt.datetime,
    stale_after: dt.timedelta = STALE_TIMEOUT,
    sub_batch_limit: int = SUB_BATCH_LIMIT,
    max_deletions: int = MAX_DELETIONS,
    on_sub_batch: Callable[[list[int]], None] = lambda deleted_ids: None,
) -> CleanupResult:
    """GitLab's loop: stop when a pass deletes 0 or ``max_deletions`` are gone (then no trailing 0, and the stale
    rows left are counted)."""
    if sub_batch_limit < 1 or max_deletions < 1:
        raise ValueError("sub_batch_limit and max_deletions must be at least 1")
    deadline = stale_deadline(now, stale_after)
    result = CleanupResult(max_deletions=max_deletions)
    # One connection for the run, in autocommit: each sub-batch's statement is its own transaction.
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        while True:
            # The last pass never overshoots the cap.
            limit = min(sub_batch_limit, max_deletions - result.total_deleted)
            deleted = delete_sub_batch(conn, schema, deadline, limit)
            result.batch_counts.append(len(deleted))
            result.total_deleted += len(deleted)
            on_sub_batch(deleted)
            if not deleted:
                return result
            if result.max_deletions_reached:
                result.left = count_stale(conn, schema, deadline)
                return result
