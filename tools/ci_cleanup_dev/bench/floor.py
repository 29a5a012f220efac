"""The true floor of each job, for the benchmark: plain psycopg2, one database round trip per batch
(autocommit: the statement is the batch's transaction), its statement text sent each batch as GitLab sends its
own behind PgBouncer in transaction pooling (``prepared_statements: false``: no session-level PREPARE, which
a pooled server connection would not keep), doing exactly the job's work: the same rows changed, the same
guards re-checked in the writing statement, the same side rows (queue deletes, queued stop actions,
``ci_deleted_objects``).

Each batch's floor is in its workshop module (``ci_cleanup_dev/batches/<batch>.py``, ``FLOOR``); here, what they
share. The SQL is written out by hand from the services (``ci_cleanup/*/service.py``); the benchmark checks
that a floor and its job leave identical tables (:mod:`ci_cleanup_dev.bench.launched`). Each floor takes a
database URL and a Redis client, opens its own connections (one, or one per bucket worker) and returns
``(rows changed, batches)``. Work per run that is not per batch is left out where it is cheap and writes no table
(the jobs' Redis leases).
"""

from __future__ import annotations

import contextlib
import functools

import psycopg2
import psycopg2.extensions
import redis
from sqlalchemy.engine import make_url

# The class of every floor's cursors: bench.statements records a floor's statements through its own.
CURSOR = psycopg2.extensions.cursor


def connect(url: str):
    """A psycopg2 connection for a ``postgresql+psycopg2://`` URL (parsed only; no SQLAlchemy on the path)."""
    parsed = make_url(url)
    args = parsed.translate_connect_args(username="user", database="dbname")
    conn = psycopg2.connect(**args, **{k: v for k, v in parsed.query.items() if isinstance(v, str)},
                            cursor_factory=CURSOR)
    conn.autocommit = True  # each statement is its own transaction: one round trip, no BEGIN / COMMIT
    return conn


def on_a_connection(floor):
    """A floor of one loop, on a connection of its own that it opens and closes, as each launched job's process does."""

    @functools.wraps(floor)
    def run(url: str, client: redis.Redis) -> tuple[int, int]:
        with contextlib.closing(connect(url)) as conn:
            return floor(conn, client)

    return run
