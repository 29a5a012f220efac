"""A small, realistic GitLab dataset for the dev stack: some rows each batch must change, more it must not.

Each batch's workshop module (``batches/<batch>.py``) seeds its own rows; :func:`seed` runs them all, in the
registry's order. Rows are inserted relative to ``now`` so a demo run always finds the same work, on GitLab's own
schema: builds and artifacts spread over partitions 100, 101 and 102, and names, iids, job ids, machine and
Sidekiq ids unique as GitLab's indexes require, so a second demo on the data of the first adds rows
beside them.
"""

from __future__ import annotations

import random

import redis
from sqlalchemy.engine import Connection, Engine

from ci_cleanup.gitlab.schema import CI_DATABASE, database_of, detect_tables, utc_now

from .batches import SEEDERS


def seed(engine: Engine, redis_client: redis.Redis, *, random_seed: int = 0, ci_engine: Engine | None = None) -> None:
    """The demo's rows; with ``ci_engine`` (a decomposed GitLab), each table's rows in its own database."""
    rng, now = random.Random(random_seed), utc_now()
    with engine.begin() as main, (ci_engine or engine).begin() as ci:
        conn = main if ci_engine is None else _Routed(main, ci)
        schema = detect_tables(ci)  # partitioned or flat, as the database has them
        for seed_batch in SEEDERS.values():  # in the registry's order: each batch's random rows stay the same
            seed_batch(conn, redis_client, schema, rng, now)


class _Routed:
    """What the demos use of a connection, each statement run in the database of its table (``Insert.table``, or
    the one table a ``Select`` reads)."""

    def __init__(self, main: Connection, ci: Connection):
        self._main, self._ci = main, ci

    def _of(self, statement) -> Connection:
        table = getattr(statement, "table", None)
        if table is None:
            [table] = statement.get_final_froms()
        return self._ci if database_of(table) == CI_DATABASE else self._main

    def execute(self, statement, *args, **kwargs):
        return self._of(statement).execute(statement, *args, **kwargs)

    def scalar(self, statement, *args, **kwargs):
        return self._of(statement).scalar(statement, *args, **kwargs)
