"""The demo dataset's rows for drop_canceling_builds (``ci-cleanup demo``): some it must change, more it must not."""

from __future__ import annotations

import datetime as dt
import random

import redis
from sqlalchemy import insert
from sqlalchemy.engine import Connection

from ..gitlab.schema import GitLabSchema, naive_utc


def seed(
    conn: Connection, queues: redis.Redis, schema: GitLabSchema, rng: random.Random, now: dt.datetime
) -> None:
    """drop_canceling_builds: 120 builds stuck canceling (two batches), and builds it must leave alone."""
    rows = []
    for _ in range(120):
        stuck_since = now - dt.timedelta(hours=rng.randint(2, 48), minutes=rng.randint(0, 59))
        rows.append(dict(status="canceling", created_at=naive_utc(stuck_since), updated_at=naive_utc(stuck_since)))
    for status in ("running", "pending", "success", "failed", "canceled", "canceling"):
        for _ in range(10):  # recent ones, and old ones in other statuses
            at = now - dt.timedelta(minutes=rng.randint(1, 50) if status == "canceling" else rng.randint(61, 600))
            rows.append(dict(status=status, created_at=naive_utc(at), updated_at=naive_utc(at)))
    for i, values in enumerate(rows):
        values.update(
            partition_id=100 + i // 5 % 3, project_id=rng.randint(1, 20), commit_id=1000 + i // 5,
            name=rng.choice(["rspec", "lint", "build"]),
            type="Ci::Build", runner_id=rng.randint(1, 5), lock_version=0,
        )
    conn.execute(insert(schema.ci_builds), rows)
