"""Rows as GitLab writes them, with only what a test cares about spelled out."""

from __future__ import annotations

import datetime as dt
import time
import uuid

from sqlalchemy import insert, select, text
from sqlalchemy.engine import Engine

from ci_cleanup.gitlab.schema import gitlab_schema, naive_utc, utc_now

S = gitlab_schema()


def ago(**delta) -> dt.datetime:
    """An aware UTC moment in the past."""
    return utc_now() - dt.timedelta(**delta)


def naive_ago(**delta) -> dt.datetime:
    """The same, as GitLab stores it in a ``timestamp without time zone`` column."""
    return naive_utc(ago(**delta))


def _defaults(table: str) -> dict:
    now, naive_now = utc_now(), naive_utc(utc_now())
    return {
        "ci_builds": {
            "partition_id": 100, "project_id": 1, "commit_id": 1, "name": "rspec", "type": "Ci::Build",
            "status": "canceling", "lock_version": 0, "created_at": naive_now, "updated_at": naive_now, "runner_id": 7,
        },
        "ci_runner_machines": {
            "runner_id": 1, "system_xid": uuid.uuid4().hex[:12], "runner_type": 1, "created_at": now, "updated_at": now,
        },
        "project_export_jobs": {"project_id": 1, "status": 0, "jid": uuid.uuid4().hex[:24], "created_at": now, "updated_at": now},
        "project_relation_exports": {"relation": "issues", "status": 0, "created_at": now, "updated_at": now},
        "environments": {"project_id": 1, "name": "review/x", "slug": "review-x", "state": "available", "created_at": naive_now, "updated_at": naive_now},
        "deployments": {"iid": 1, "project_id": 1, "ref": "main", "sha": "a" * 40, "status": 2, "deployable_type": "CommitStatus", "created_at": now, "updated_at": now},
        "ci_job_artifacts": {"partition_id": 100, "project_id": 1, "job_id": 1, "file_type": 1, "size": 1024, "file": "artifacts.zip", "file_store": 1, "locked": 0, "created_at": now, "updated_at": now},
        "ci_pending_builds": {"project_id": 1},
        "ci_running_builds": {"project_id": 1, "runner_id": 7, "runner_type": 1},
        "feature_gates": {"key": "boolean", "value": "true"},
    }.get(table, {})


def create(engine: Engine, table: str, **values) -> int:
    """Insert one row of ``table`` and return its id."""
    t = S.metadata.tables[table]
    with engine.begin() as conn:
        return conn.execute(insert(t).values({**_defaults(table), **values}).returning(t.c.id)).scalar_one()


def row(engine: Engine, table: str, id: int):
    t = S.metadata.tables[table]
    with engine.connect() as conn:
        return conn.execute(select(t).where(t.c.id == id)).one_or_none()


def ids(engine: Engine, table: str, *where) -> list[int]:
    t = S.metadata.tables[table]
    with engine.connect() as conn:
        return list(conn.scalars(select(t.c.id).where(*where).order_by(t.c.id)))


def backend_waiting_on_lock(engine: Engine, query_like: str = "%") -> int:
    """The pid of a backend (not ours) waiting for a lock, running a query ``LIKE query_like``, within 60 s."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with engine.connect() as conn:  # a connection per look: pg_stat_activity is a snapshot per transaction
            pid = conn.scalar(text(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid() AND query LIKE :q LIMIT 1"
            ), {"q": query_like})
        if pid:
            return pid
        time.sleep(0.05)
    raise AssertionError("no backend ever waited on the lock")
