"""The demo dataset's rows for stale_runner_machines_cleanup (``ci-cleanup demo``): some it must change,
more it must not."""

from __future__ import annotations

import datetime as dt
import random
import uuid

import redis
from sqlalchemy import insert
from sqlalchemy.engine import Connection

from ..gitlab.schema import GitLabSchema


def seed(
    conn: Connection, queues: redis.Redis, schema: GitLabSchema, rng: random.Random, now: dt.datetime
) -> None:
    """stale_runner_machines_cleanup: 130 machines silent for over 7 days (two sub-batches), and live or new ones."""
    rows = []
    for i in range(130):
        created = now - dt.timedelta(days=rng.randint(8, 400))
        contacted = None if i % 4 == 0 else created + (now - created - dt.timedelta(days=7)) * rng.random()
        rows.append(dict(created_at=created, contacted_at=contacted))
    for i in range(40):  # old but contacted within the week, or registered within the week and never contacted
        if i % 2:
            created = now - dt.timedelta(days=rng.randint(8, 400))
            contacted = now - dt.timedelta(hours=rng.randint(0, 160))
        else:
            created, contacted = now - dt.timedelta(days=rng.randint(0, 6), hours=rng.randint(0, 23)), None
        rows.append(dict(created_at=created, contacted_at=contacted))
    for values in rows:
        values.update(
            runner_id=rng.randint(1, 12), system_xid=f"r_{uuid.uuid4().hex[:12]}", runner_type=rng.choice([1, 2, 3]),
            updated_at=values["contacted_at"] or values["created_at"],
        )
        # GitLab: instance runners (type 1) have no sharding key, group and project runners one.
        values["sharding_key_id"] = None if values["runner_type"] == 1 else values["runner_id"]
    conn.execute(insert(schema.ci_runner_machines), rows)
