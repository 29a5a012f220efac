"""Rows as GitLab writes them, with only what a test cares about spelled out."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import itertools
import time
import uuid

from sqlalchemy import insert, select, text
from sqlalchemy.engine import Engine

from ci_cleanup.gitlab.schema import GitLabSchema, gitlab_schema, naive_utc, utc_now

from .harness import on

S = gitlab_schema()


def ago(**delta) -> dt.datetime:
    """An aware UTC moment in the past."""
    return utc_now() - dt.timedelta(**delta)


def naive_ago(**delta) -> dt.datetime:
    """The same, as GitLab stores it in a ``timestamp without time zone`` column."""
    return naive_utc(ago(**delta))


@contextlib.contextmanager
def _before_update(engine: Engine, table: str, name: str, condition: str, action: str):
    """While open, a trigger does ``action`` (PL/pgSQL) before an update of ``table`` whose new row meets
    ``condition`` (SQL on ``NEW``); it is dropped afterwards."""
    engine = on(engine, table)
    with engine.begin() as conn:
        conn.execute(text(f"""
            CREATE FUNCTION {name}() RETURNS trigger AS $$ BEGIN
              IF {condition} THEN {action}; END IF;
              RETURN NEW; END $$ LANGUAGE plpgsql;
            CREATE TRIGGER {name} BEFORE UPDATE ON {table} FOR EACH ROW EXECUTE FUNCTION {name}();
        """))
    try:
        yield
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP TRIGGER {name} ON {table}; DROP FUNCTION {name}()"))


def updates_refused(engine: Engine, table: str, condition: str, message: str = "row is broken"):
    """While open, PostgreSQL refuses an update of ``table`` whose new row meets ``condition`` (SQL on ``NEW``)
    with ``message``, as it would a broken row's."""
    return _before_update(engine, table, "refuse_update", condition, f"RAISE EXCEPTION '{message}'")


def updates_skipped(engine: Engine, table: str, condition: str):
    """While open, PostgreSQL passes over an update of ``table`` whose new row meets ``condition`` (SQL on ``NEW``):
    the row is left as it is and not returned, as a change and its undoing while we waited would leave it."""
    return _before_update(engine, table, "skip_update", condition, "RETURN NULL")


# Builds and artifacts are spread over GitLab's partitions 100 (ci_builds / ci_job_artifacts), 101 and 102
# (gitlab_partitions_dynamic), so every test meets more than one partition.
PARTITIONS = (100, 101, 102)
# Artifact file types other than trace (3): with the partition, they keep GitLab's unique index
# (job_id, file_type, partition_id) satisfied when a test makes many artifacts of one job.
FILE_TYPES = tuple(t for t in range(1, 31) if t != 3)
# Instance (1, no sharding key), group (2) and project (3) runner machines: ci_runner_machines' three partitions.
RUNNER_TYPES = (1, 2, 3)
_serial = itertools.count()

TABLES = {f.name: getattr(S, f.name) for f in dataclasses.fields(S) if f.name != "metadata"}


def _defaults(table: str) -> dict:
    now, naive_now, n = utc_now(), naive_utc(utc_now()), next(_serial)
    return {
        "ci_builds": {
            "partition_id": PARTITIONS[n % 3], "project_id": 1, "commit_id": 1, "name": "rspec", "type": "Ci::Build",
            "status": "canceling", "lock_version": 0, "created_at": naive_now, "updated_at": naive_now, "runner_id": 7,
        },
        "ci_runner_machines": {
            "runner_id": 1, "system_xid": uuid.uuid4().hex[:12], "runner_type": RUNNER_TYPES[n % 3],
            "sharding_key_id": None if n % 3 == 0 else 1, "created_at": now, "updated_at": now,
        },
        "project_export_jobs": {
            "project_id": 1, "status": 0, "jid": uuid.uuid4().hex[:24], "created_at": now, "updated_at": now,
        },
        "project_relation_exports": {"relation": f"issues_{n}", "status": 0, "created_at": now, "updated_at": now},
        "environments": {
            "project_id": 1, "name": f"review/x-{n}", "slug": f"review-x-{n}", "state": "available",
            "created_at": naive_now, "updated_at": naive_now,
        },
        "deployments": {
            "iid": n + 1, "project_id": 1, "ref": "main", "tag": False, "sha": "a" * 40, "status": 2,
            "deployable_type": "CommitStatus", "created_at": naive_now, "updated_at": naive_now,
        },
        "ci_job_artifacts": {
            "partition_id": PARTITIONS[n % 3], "file_type": FILE_TYPES[n // 3 % len(FILE_TYPES)], "project_id": 1,
            "job_id": 1, "size": 1024, "file": "artifacts.zip", "file_store": 1, "locked": 0,
            "created_at": now, "updated_at": now,
        },
        "ci_pending_builds": {"project_id": 1},
        "ci_running_builds": {"project_id": 1, "runner_id": 7, "runner_type": 1},
        "features": {"created_at": naive_now, "updated_at": naive_now},
        "feature_gates": {"key": "boolean", "value": "true", "created_at": naive_now, "updated_at": naive_now},
    }.get(table, {})


def create(engine: Engine, table: str, *, schema: GitLabSchema = S, **values) -> int:
    """Insert one row of ``table`` (GitLab's triggers assign ids) and return its id.

    A queue row (``ci_pending_builds``, ``ci_running_builds``) takes its build's partition_id, as GitLab's do.
    ``schema``: another layout's tables (the flat ``ci_builds`` of GitLab before partitioning).
    """
    t = getattr(schema, table)
    with on(engine, table).begin() as conn:
        if table in ("ci_pending_builds", "ci_running_builds") and "partition_id" not in values:
            b = schema.ci_builds
            values["partition_id"] = conn.scalar(select(b.c.partition_id).where(b.c.id == values["build_id"])) or 100
        return conn.execute(insert(t).values({**_defaults(table), **values}).returning(t.c.id)).scalar_one()


def row(engine: Engine, table: str, id: int):
    t = TABLES[table]
    with on(engine, table).connect() as conn:
        return conn.execute(select(t).where(t.c.id == id)).one_or_none()


def ids(engine: Engine, table: str, *where) -> list[int]:
    t = TABLES[table]
    with on(engine, table).connect() as conn:
        return list(conn.scalars(select(t.c.id).where(*where).order_by(t.c.id)))


def backend_waiting_on_lock(engine: Engine, query_like: str = "%") -> int:
    """The pid of a backend (not ours) waiting for a lock, running a query ``LIKE query_like``, within 60 s."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with engine.connect() as conn:  # a connection per look: pg_stat_activity is a snapshot per transaction
            pid = conn.scalar(text(
                "SELECT pid FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid() AND query LIKE :q LIMIT 1"
            ), {"q": query_like})
        if pid:
            return pid
        time.sleep(0.05)
    raise AssertionError("no backend ever waited on the lock")


@contextlib.contextmanager
def statistics_say_empty(engine: Engine, fill, *tables: str):
    """While open, ``tables`` (of ``engine``'s database) hold what ``fill`` (a statement) writes, but their
    statistics say they are empty, as autovacuum leaves them after it saw them drained: ``fill`` run, its rows
    deleted, the tables analyzed (their pages, no live row), ``fill`` run again; autovacuum off for them meanwhile."""
    names = ", ".join(tables)
    try:
        with engine.begin() as conn:
            for table in tables:
                conn.execute(text(f"ALTER TABLE {table} SET (autovacuum_enabled = false)"))
            conn.execute(fill)
            conn.execute(text(";".join(f"DELETE FROM {table}" for table in tables)))
        with engine.begin() as conn:
            conn.execute(text(f"ANALYZE {names}"))
            stats = conn.execute(text("SELECT reltuples, relpages > 0 FROM pg_class WHERE relname = ANY(:tables)"),
                                 {"tables": list(tables)}).all()
            assert stats == [(0, True)] * len(tables)
            conn.execute(fill)
        yield
    finally:
        with engine.begin() as conn:
            for table in tables:
                conn.execute(text(f"ALTER TABLE {table} RESET (autovacuum_enabled)"))


def rows_read(engine: Engine, run, *tables: str) -> tuple:
    """``run(conn)``'s result, in a transaction of its own, and the rows it read of each of ``tables`` (sequential
    scans' and index fetches', PostgreSQL's counters of that transaction)."""
    with engine.connect() as conn:
        # The counts of this connection's earlier transactions flushed: the next transaction's are its own.
        conn.execute(text("SELECT pg_stat_force_next_flush()"))
        conn.commit()
        result = run(conn)
        read = dict(conn.execute(text(
            "SELECT relname, coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables "
            "WHERE relname = ANY(:tables)"), {"tables": list(tables)}).all())
        conn.commit()
    return result, read
