"""A small, realistic GitLab dataset for the dev stack: some rows each batch must change, more it must not.

Each batch's ``demo.py`` seeds its own rows (the registry's ``demo``); :func:`seed` runs them all. Rows
are inserted relative to ``now`` so a demo run always finds the same work, on GitLab's own schema:
builds and artifacts spread over partitions 100, 101 and 102, and names, iids, job ids, machine and
Sidekiq ids unique as GitLab's indexes require, so a second demo on the data of the first adds rows
beside them.
"""

from __future__ import annotations

import random

import redis
from sqlalchemy.engine import Engine

from .batches import BATCHES
from .gitlab.schema import detect_tables, utc_now


def seed(engine: Engine, redis_client: redis.Redis, *, random_seed: int = 0) -> None:
    rng, now = random.Random(random_seed), utc_now()
    with engine.begin() as conn:
        schema = detect_tables(conn)  # partitioned or flat, as the database has them
        for batch in BATCHES:
            if batch.demo is not None:
                batch.demo(conn, redis_client, schema, rng, now)
