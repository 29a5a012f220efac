"""How every batch talks to GitLab's database, written once: one autocommit connection a run, and the
per-row fallback after a failed batch (GitLab's services rescue each record, e.g. ``DropHelpers#drop_build``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

T = TypeVar("T")
K = TypeVar("K")


@contextmanager
def autocommit(engine: Engine) -> Iterator[Connection]:
    """One connection for a run's batches, in autocommit: a batch is one statement, its own transaction (all or
    nothing), so a BEGIN and COMMIT around it would only add round trips. ``conn.begin()`` still opens one."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        yield conn


def database_error(error: DBAPIError) -> str:
    """The database's own message, first line: what a row's failure is reported as (without the statement)."""
    return str(getattr(error, "orig", None) or error).strip().splitlines()[0]


def row_by_row_on_failure(
    batch: Callable[[], T], rows: Callable[[], Iterable[K]], one: Callable[[K], T],
    failed: Callable[[K, DBAPIError], None],
) -> list[T]:
    """``[batch()]``; if the batch fails on a row, ``one(row)`` for each of ``rows()`` instead, so that one bad row
    is reported (``failed``) and the others are still done. A lost connection is no row's fault: it is raised."""
    try:
        return [batch()]
    except DBAPIError as error:
        if error.connection_invalidated:
            raise
    done = []
    for row in rows():
        try:
            done.append(one(row))
        except DBAPIError as error:
            if error.connection_invalidated:
                raise
            failed(row, error)
    return done
