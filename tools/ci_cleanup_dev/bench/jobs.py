"""The registered batches three ways, for the benchmark: the job's own service, a raw SQL loop with the same
batch size (the floor), and a per-row read-then-write loop in the style of GitLab's ``drop!`` with
optimistic locking (what running the Rails workers does today). Each batch's three are in its workshop module
(``ci_cleanup_dev/batches/<batch>.py``, ``RUNNERS``); here, what they share.

Each runner takes ``(engine, redis_client, on_batch)`` and returns the rows it processed;
``on_batch`` is called after every batch, so the caller can time batches. The job's own (the service) also takes
``hooks``: a caller's brake, stop and batch callback (:class:`~ci_cleanup.gitlab.loop_helpers.Hooks`), as a run's
process op passes them (``bench --traffic``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import redis
from sqlalchemy import text
from sqlalchemy.engine import Engine

from ci_cleanup.gitlab.loop_helpers import Hooks
from ci_cleanup.gitlab.schema import gitlab_schema

S = gitlab_schema()
UNLIMITED = 10**9
Runner = Callable[[Engine, redis.Redis, Callable[[], None]], int]


@dataclass(frozen=True)
class BenchJob:
    name: str
    table: str  # where its candidates live (see seed.INSERTS): the registry's table of the batch
    job: Runner
    raw: Runner
    per_row: Runner


def with_callback(hooks: Hooks, on_batch: Callable[[], None]) -> Hooks:
    """``hooks`` with the runner's ``on_batch()`` called after each batch too, after the hooks' own callback."""
    return replace(hooks, on_batch=lambda *batch: (hooks.on_batch(*batch), on_batch()))


def loop(engine: Engine, on_batch, batch: Callable[..., int]) -> int:
    """Run ``batch(conn)`` in its own transaction until it processes nothing."""
    total = 0
    while True:
        with engine.begin() as conn:
            n = batch(conn)
        if not n:
            return total
        total += n
        on_batch()


def per_row(engine: Engine, page_sql: str, params: dict, handle: Callable) -> int:
    """Read a page of candidate ids (100, as ``each_batch`` would), then read and write each row in a transaction."""
    total, after = 0, 0
    while True:
        with engine.connect() as conn:
            ids = list(conn.execute(text(page_sql), {**params, "after": after}).scalars())
        if not ids:
            return total
        for row_id in ids:
            with engine.begin() as conn:
                total += handle(conn, row_id)
        after = ids[-1]


def max_id(conn, table: str) -> int:
    return conn.execute(text("SELECT coalesce(max(id), 0) FROM " + table)).scalar()  # table: a SCOPED constant
