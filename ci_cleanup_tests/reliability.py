"""Fault and concurrency harness for the batch jobs: datasets, state checks, runs in other processes.

Each :class:`Scenario` knows, for one job, how to seed thousands of candidates in a few statements
(``generate_series``), and how to tell, per candidate, whether it is *untouched* (exactly as seeded,
with its related rows) or *done* (fully processed, with every related row GitLab changes
with it). Anything else is a violation: a half-processed row. Keepers (rows the job must never
touch) are compared with their seeded state.

Runs happen in other processes: the ``dagster`` CLI, or a forked copy of the test process calling
``execute_in_process`` (fast: nothing to import), which can be SIGKILLed at any moment.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime as dt
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus
from sqlalchemy import bindparam, create_engine, text
from sqlalchemy.engine import Connection, Engine

from ci_cleanup import lease as job_leases
from ci_cleanup.batches import BY_NAME, Batch
from ci_cleanup.gitlab import artifact_buckets, sidekiq_status
from ci_cleanup.gitlab.config_files import ENV_CONFIG_DIR
from ci_cleanup.gitlab.exclusive_lease import PREFIX as LEASE_PREFIX
from ci_cleanup.gitlab.schema import naive_utc, utc_now
from ci_cleanup.resources import close_client, job_resources
from ci_cleanup.schedule_bulk_delete_job_artifacts.service import MAX_BUCKETS

from .factories import TABLES
from .harness import Databases, DeployedStack, clean_env, on, reset
from .redis_servers import RedisStores

BIN = Path(sys.executable).parent
FORK = multiprocessing.get_context("fork")
KEEPERS = 20  # rows of each kind the job must leave alone

# --------------------------------------------------------------------------- one database, or GitLab's main + ci

# Where a job's GitLab database(s) are: (main, None) for one database, (main, ci) for GitLab as deployed.
Urls = tuple[str, "str | None"]


def direct_urls(stack) -> Urls:
    """The stack's GitLab database(s), straight to PostgreSQL (never through PgBouncer): for the harness's own
    seeding, checks and writers."""
    if isinstance(stack, DeployedStack):
        return stack.direct_url(stack.MAIN), stack.direct_url(stack.CI)
    return stack.url(), None


def engine_of(urls: Urls, **kwargs) -> Engine | Databases:
    main, ci = urls
    if ci is None:
        return create_engine(main, **kwargs)
    return Databases(create_engine(main, **kwargs), create_engine(ci, **kwargs))


def engines(engine: Engine | Databases) -> list[Engine]:
    return [engine.main, engine.ci] if isinstance(engine, Databases) else [engine]


class Conns:
    """A connection per database, opened on first use: :meth:`of` is the one holding a table's rows (the one
    connection, on a single database)."""

    def __init__(self, engine: Engine | Databases, stack: contextlib.ExitStack, begin: bool):
        self.engine, self._stack, self._begin = engine, stack, begin
        self._conns: dict[int, Connection] = {}

    def of(self, table: str) -> Connection:
        target = on(self.engine, table)
        if id(target) not in self._conns:
            self._conns[id(target)] = self._stack.enter_context(target.begin() if self._begin else target.connect())
        return self._conns[id(target)]


@contextlib.contextmanager
def connections(engine: Engine | Databases, *, begin: bool = False):
    """Connections (each in a transaction of its own with ``begin``; no transaction spans two databases)."""
    with contextlib.ExitStack() as stack:
        yield Conns(engine, stack, begin)

# --------------------------------------------------------------------------- audit: every write, per row

AUDIT_TABLES = (
    "p_ci_builds", "ci_runner_machines", "project_export_jobs", "environments", "p_ci_job_artifacts",
    "ci_deleted_objects",
)
AUDIT_DDL = """
CREATE TABLE IF NOT EXISTS reliability_audit (
  id bigserial PRIMARY KEY, tbl text NOT NULL, row_id bigint NOT NULL, op text NOT NULL,
  old_state text, new_state text, at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE OR REPLACE FUNCTION reliability_audit_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'DELETE' THEN
    INSERT INTO reliability_audit (tbl, row_id, op, old_state)
    VALUES (TG_TABLE_NAME, OLD.id, TG_OP, coalesce(to_jsonb(OLD)->>'status', to_jsonb(OLD)->>'state'));
    RETURN OLD;
  END IF;
  INSERT INTO reliability_audit (tbl, row_id, op, old_state, new_state)
  VALUES (TG_TABLE_NAME, NEW.id, TG_OP, coalesce(to_jsonb(OLD)->>'status', to_jsonb(OLD)->>'state'),
          coalesce(to_jsonb(NEW)->>'status', to_jsonb(NEW)->>'state'));
  RETURN NEW;
END $$;
"""


def _audited_in(engine: Engine | Databases, one: Engine) -> list[str]:
    """The audited tables whose rows are in ``one`` (every one of them, on a single database)."""
    return [table for table in AUDIT_TABLES if on(engine, table) is one]


def install_audit(engine: Engine | Databases) -> None:
    """A row trigger on each table a job writes: the audit counts how often each row was changed. Decomposed:
    the audit table in both databases (``reset`` empties it in each), the triggers on each one's own tables."""
    for one in engines(engine):
        with one.begin() as conn:
            conn.execute(text(AUDIT_DDL))
            for table in _audited_in(engine, one):
                conn.execute(text(f'DROP TRIGGER IF EXISTS reliability_audit ON "{table}"'))
                conn.execute(text(
                    f'CREATE TRIGGER reliability_audit AFTER UPDATE OR DELETE ON "{table}" '
                    "FOR EACH ROW EXECUTE FUNCTION reliability_audit_row()"
                ))


def remove_audit(engine: Engine | Databases) -> None:
    for one in engines(engine):
        with one.begin() as conn:
            for table in AUDIT_TABLES:
                conn.execute(text(f'DROP TRIGGER IF EXISTS reliability_audit ON "{table}"'))
            conn.execute(text("DROP TABLE IF EXISTS reliability_audit"))
            conn.execute(text("DROP FUNCTION IF EXISTS reliability_audit_row()"))


def changed_more_than_once(engine: Engine | Databases) -> list[tuple]:
    """Rows changed more than once, from the audit of every database (a table's rows are in one of them)."""
    found = []
    for one in engines(engine):
        with one.connect() as conn:
            found += conn.execute(text(
                "SELECT tbl, row_id, count(*), "
                "string_agg(op || ':' || coalesce(old_state, '') || '>' || coalesce(new_state, ''), ' ' ORDER BY id) "
                "FROM reliability_audit GROUP BY tbl, row_id HAVING count(*) > 1 ORDER BY 1, 2 LIMIT 20"
            )).all()
    return sorted(found)[:20]


def audited_rows(engine: Engine | Databases) -> int:
    total = 0
    for one in engines(engine):
        with one.connect() as conn:
            total += conn.scalar(text("SELECT count(*) FROM reliability_audit"))
    return total


# --------------------------------------------------------------------------- the five jobs

def _rows(conn: Conns, table: str, ids: list[int]) -> dict[int, tuple]:
    name = TABLES[table].name if table in TABLES else table  # ci_builds: every partition, through p_ci_builds
    query = text(f'SELECT * FROM "{name}" WHERE id IN :ids ORDER BY id').bindparams(bindparam("ids", expanding=True))
    return {r.id: r for r in conn.of(table).execute(query, {"ids": ids or [-1]})}  # rows compare as tuples, by name


@dataclass
class Seeded:
    candidates: list[int]
    snapshot: dict[int, tuple]  # candidates as seeded
    keepers: dict[str, dict[int, tuple]]  # table -> id -> row
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class State:
    done: set[int] = field(default_factory=set)
    untouched: set[int] = field(default_factory=set)
    violations: list[str] = field(default_factory=list)


class Scenario:
    """One registered batch's dataset and checks; its job, report op, table and lease come from the registry."""

    batch: Batch
    # Its workers claim Redis buckets: a killed worker's bucket is not handed out again before stale recovery.
    claims_buckets = False
    reads_sidekiq_statuses = False
    # What its Redis store holds once every candidate is done: the keys it seeded and those GitLab keeps (its
    # lease given back).
    keys_when_done: frozenset[bytes] = frozenset()

    @property
    def name(self) -> str:
        return self.batch.name

    @property
    def job(self):
        return self.batch.job

    @property
    def report_op(self) -> str:
        return self.batch.report_op

    @property
    def uses_redis(self) -> bool:
        """It keeps something in GitLab's Redis: a lease, buckets, or it reads Sidekiq statuses."""
        return self.lease is not None or self.claims_buckets or self.reads_sidekiq_statuses

    @property
    def table(self) -> str:
        return self.batch.table

    @property
    def lease(self) -> str | None:
        return LEASE_PREFIX + self.batch.lease.key if self.batch.lease is not None else None

    def shorten_lease(self, ttl_seconds: int | None) -> None:
        """In a forked run's process only: the lease a killed run leaves expires in ``ttl_seconds``."""
        if ttl_seconds is not None:
            job_leases.declare(self.batch.name, dataclasses.replace(self.batch.lease, ttl_seconds=ttl_seconds))

    def run_config(self, batch: int) -> dict:
        raise NotImplementedError

    # ``conn``: a connection per database (:class:`Conns`); each statement goes to its table's, ``conn.of(table)``.
    def seed(self, conn: Conns, client, n: int) -> None:
        raise NotImplementedError

    def keeper_ids(self, conn: Conns, n: int) -> dict[str, list[int]]:
        raise NotImplementedError

    def classify(self, conn: Conns, client, seeded: Seeded, ids: list[int]) -> State:
        raise NotImplementedError

    def done_count(self, metadata: dict) -> int:
        return metadata["rows_changed"]

    # A concurrent writer: change some candidates as GitLab would; returns id -> the values written.
    def write(self, conn: Conns, ids: list[int], rng: random.Random) -> dict[int, tuple]:
        raise NotImplementedError

    def read_written(self, conn: Conns, ids: list[int]) -> dict[int, tuple]:
        raise NotImplementedError

    def reset_and_seed(self, engine: Engine | Databases, client, n: int) -> Seeded:
        reset(engine, client, also=("reliability_audit",))
        return self.seed_and_snapshot(engine, client, n)

    def seed_and_snapshot(self, engine: Engine | Databases, client, n: int) -> Seeded:
        """Seed next to whatever the other scenarios seeded: each job's rows are apart from the others'."""
        with connections(engine, begin=True) as conn:
            self.seed(conn, client, n)
        with connections(engine) as conn:
            candidates = list(range(1, n + 1))
            keepers = {t: _rows(conn, t, ids) for t, ids in self.keeper_ids(conn, n).items()}
            return Seeded(candidates, _rows(conn, self.table, candidates), keepers)

    def check(self, engine: Engine | Databases, client, seeded: Seeded, exclude: set[int] = frozenset()) -> State:
        """Every candidate untouched or done; every keeper as seeded."""
        with connections(engine) as conn:
            state = self.classify(conn, client, seeded, [i for i in seeded.candidates if i not in exclude])
            for table, rows in seeded.keepers.items():
                now = _rows(conn, table, list(rows))
                for row_id, before in rows.items():
                    if now.get(row_id) != before:
                        state.violations.append(f"{table} keeper {row_id} changed: {before} -> {now.get(row_id)}")
        return state


def _sort(state: State, row_id: int, is_done: bool, is_untouched: bool, what: Any) -> None:
    if is_done:
        state.done.add(row_id)
    elif is_untouched:
        state.untouched.add(row_id)
    else:
        state.violations.append(f"row {row_id} half processed: {what}")


class DropCancelingBuilds(Scenario):
    """Ci::StuckBuilds::DropCancelingService: a build is canceling (lock_version 0, in both queues) or
    failed/3 with lock_version 1, finished, out of both."""

    batch = BY_NAME["drop_canceling_builds"]

    def run_config(self, batch: int) -> dict:
        return {"ops": {"find_canceling_builds": {"config": {"batch_size": batch}}}}

    def seed(self, conn, client, n):
        old, recent = naive_utc(utc_now() - dt.timedelta(hours=2)), naive_utc(utc_now() - dt.timedelta(minutes=5))
        insert = (
            "INSERT INTO p_ci_builds (partition_id, project_id, commit_id, name, type, status, lock_version, "
            "created_at, updated_at, runner_id) "
            "SELECT 100 + g % 3, g % 50, 1, 'rspec', 'Ci::Build', :status, 0, :created - make_interval(secs => g), "
            ":updated, 7 "
            "FROM generate_series(1, :n) g"
        )
        conn = conn.of("p_ci_builds")  # and both queues: every table here is in ci
        conn.execute(text(insert), dict(status="canceling", created=old, updated=old, n=n))
        queued = "SELECT id, project_id, partition_id FROM p_ci_builds WHERE id <= :n AND name = 'rspec'"
        conn.execute(text(
            "INSERT INTO ci_running_builds (build_id, project_id, runner_id, runner_type, partition_id) "
            f"SELECT id, project_id, 7, 1, partition_id FROM ({queued}) b"
        ), dict(n=n))
        conn.execute(text(f"INSERT INTO ci_pending_builds (build_id, project_id, partition_id) {queued}"), dict(n=n))
        conn.execute(text(insert), dict(status="canceling", created=old, updated=recent, n=KEEPERS))  # updated recently
        conn.execute(text(insert), dict(status="running", created=old, updated=old, n=KEEPERS))

    def keeper_ids(self, conn, n):
        return {"ci_builds": list(range(n + 1, n + 2 * KEEPERS + 1))}

    def classify(self, conn, client, seeded, ids):
        query = text(
            "SELECT b.id, b.status, b.lock_version, b.failure_reason, b.finished_at IS NOT NULL AS finished, "
            "EXISTS (SELECT 1 FROM ci_pending_builds p WHERE p.build_id = b.id) AS pending, "
            "EXISTS (SELECT 1 FROM ci_running_builds r WHERE r.build_id = b.id) AS running "
            "FROM p_ci_builds b WHERE b.id IN :ids"
        ).bindparams(bindparam("ids", expanding=True))
        state = State()
        rows = {r.id: tuple(r)[1:] for r in conn.of("p_ci_builds").execute(query, {"ids": ids or [-1]})}
        builds = _rows(conn, "ci_builds", ids)
        for build_id in ids:
            what = rows.get(build_id)
            untouched = (what == ("canceling", 0, None, False, True, True)
                         and builds[build_id] == seeded.snapshot[build_id])
            _sort(state, build_id, what == ("failed", 1, 3, True, False, False), untouched, what)
        return state

    def write(self, conn, ids, rng):
        # A user cancels the build (canceled), or the runner reports on it (touched: no longer outdated).
        now = naive_utc(utc_now())
        if rng.random() < 0.5:
            sql = ("UPDATE p_ci_builds SET status = 'canceled', finished_at = :now, updated_at = :now, "
                   "lock_version = lock_version + 1")
        else:
            sql = "UPDATE p_ci_builds SET updated_at = :now, lock_version = lock_version + 1"
        query = text(
            sql + " WHERE id IN :ids AND status = 'canceling' RETURNING id, status, lock_version, updated_at"
        ).bindparams(bindparam("ids", expanding=True))
        return {r.id: tuple(r)[1:] for r in conn.of("p_ci_builds").execute(query, {"now": now, "ids": ids})}

    def read_written(self, conn, ids):
        query = text("SELECT id, status, lock_version, updated_at FROM p_ci_builds WHERE id IN :ids").bindparams(
            bindparam("ids", expanding=True))
        return {r.id: tuple(r)[1:] for r in conn.of("p_ci_builds").execute(query, {"ids": ids or [-1]})}


class StaleRunnerMachines(Scenario):
    """Ci::Runners::StaleManagersCleanupService: a stale machine is there as seeded, or gone; sub-batches are whole."""

    batch = BY_NAME["stale_runner_machines_cleanup"]

    def run_config(self, batch: int) -> dict:
        config = {"sub_batch_size": batch, "max_deletions": batch * 1000}
        return {"ops": {"find_stale_runner_machines": {"config": config}}}

    def seed(self, conn, client, n):
        now = utc_now()
        insert = (
            "INSERT INTO ci_runner_machines (runner_id, system_xid, runner_type, sharding_key_id, created_at, "
            "updated_at, contacted_at) "
            "SELECT g, md5(random()::text), 1 + g % 3, CASE WHEN g % 3 > 0 THEN g END, :created, :created, "
            "CASE WHEN g % 3 = 0 THEN NULL ELSE :contacted - make_interval(secs => g) END "
            "FROM generate_series(1, :n) g"
        )
        month, week = now - dt.timedelta(days=30), now - dt.timedelta(days=8)
        conn = conn.of("ci_runner_machines")
        conn.execute(text(insert), dict(created=month, contacted=week, n=n))
        conn.execute(text(insert.replace("WHEN g % 3 = 0", "WHEN false")),
                     dict(created=month, contacted=now - dt.timedelta(hours=1) + dt.timedelta(seconds=KEEPERS),
                          n=KEEPERS))
        conn.execute(text(insert.replace("WHEN g % 3 = 0", "WHEN true")),
                     dict(created=now - dt.timedelta(days=1), contacted=week, n=KEEPERS))

    def keeper_ids(self, conn, n):
        return {"ci_runner_machines": list(range(n + 1, n + 2 * KEEPERS + 1))}

    def classify(self, conn, client, seeded, ids):
        rows = _rows(conn, "ci_runner_machines", ids)
        state = State()
        for machine_id in ids:
            _sort(state, machine_id, machine_id not in rows, rows.get(machine_id) == seeded.snapshot[machine_id],
                  rows.get(machine_id))
        return state

    def done_count(self, metadata):
        return metadata["total_deleted"]

    def write(self, conn, ids, rng):
        # The runner checks in (Ci::RunnerManager#heartbeat): contacted_at moves to now.
        query = text(
            "UPDATE ci_runner_machines SET contacted_at = :now, updated_at = :now WHERE id IN :ids "
            "RETURNING id, contacted_at"
        ).bindparams(bindparam("ids", expanding=True))
        params = {"now": utc_now(), "ids": ids}
        return {r.id: tuple(r)[1:] for r in conn.of("ci_runner_machines").execute(query, params)}

    def read_written(self, conn, ids):
        query = text("SELECT id, contacted_at FROM ci_runner_machines WHERE id IN :ids").bindparams(
            bindparam("ids", expanding=True))
        return {r.id: tuple(r)[1:] for r in conn.of("ci_runner_machines").execute(query, {"ids": ids or [-1]})}


class StuckExportJobs(Scenario):
    """StuckExportJobsWorker: an export job whose Sidekiq job is gone is still queued/started as seeded, or
    failed (3)."""

    batch = BY_NAME["stuck_export_jobs"]
    reads_sidekiq_statuses = True
    keys_when_done = frozenset(sidekiq_status.status_key(f"running-{g}").encode() for g in range(1, KEEPERS + 1))

    def run_config(self, batch: int) -> dict:
        return {"ops": {"find_enqueued_export_jobs": {"config": {"chunk_size": batch}}}}

    def seed(self, conn, client, n):
        day = utc_now() - dt.timedelta(days=1)
        insert = (
            "INSERT INTO project_export_jobs (project_id, status, jid, created_at, updated_at) "
            "SELECT g, :status, :prefix || g, :day, :day FROM generate_series(1, :n) g"
        )
        conn = conn.of("project_export_jobs")
        conn.execute(text(insert.replace(":status", "g % 2")), dict(prefix="gone-", day=day, n=n))
        conn.execute(text(insert), dict(status=1, prefix="running-", day=day, n=KEEPERS))  # Sidekiq still has it
        conn.execute(text(insert), dict(status=2, prefix="finished-", day=day, n=KEEPERS))
        client.mset({sidekiq_status.status_key(f"running-{g}"): "1" for g in range(1, KEEPERS + 1)})

    def keeper_ids(self, conn, n):
        return {"project_export_jobs": list(range(n + 1, n + 2 * KEEPERS + 1))}

    def classify(self, conn, client, seeded, ids):
        rows = _rows(conn, "project_export_jobs", ids)
        state = State()
        for job_id in ids:
            now, before = rows.get(job_id), seeded.snapshot[job_id]
            kept = ("project_id", "jid", "user_id", "created_at")
            failed = (
                now is not None and now.status == 3 and now.updated_at > before.updated_at
                and [getattr(now, c) for c in kept] == [getattr(before, c) for c in kept]
            )
            _sort(state, job_id, failed, now == before, now)
        return state

    def done_count(self, metadata):
        return metadata["failed_jobs_count"]

    def write(self, conn, ids, rng):
        # The export finishes (ProjectExportJob#finish!).
        query = text(
            "UPDATE project_export_jobs SET status = 2, updated_at = :now WHERE id IN :ids AND status IN (0, 1) "
            "RETURNING id, status, updated_at"
        ).bindparams(bindparam("ids", expanding=True))
        params = {"now": utc_now(), "ids": ids}
        return {r.id: tuple(r)[1:] for r in conn.of("project_export_jobs").execute(query, params)}

    def read_written(self, conn, ids):
        query = text("SELECT id, status, updated_at FROM project_export_jobs WHERE id IN :ids").bindparams(
            bindparam("ids", expanding=True))
        return {r.id: tuple(r)[1:] for r in conn.of("project_export_jobs").execute(query, {"ids": ids or [-1]})}


PIPELINE = 10_000  # an environment's deploy and stop builds are in pipeline (commit_id) PIPELINE + its id


class EnvironmentsAutoStop(Scenario):
    """Environments::AutoStopService: odd environments have a stop action (stopping + action pending
    together), even ones stop plainly."""

    batch = BY_NAME["environments_auto_stop"]

    def run_config(self, batch: int) -> dict:
        return {"ops": {"find_auto_stoppable_environments": {"config": {"batch_size": batch}}}}

    def seed(self, conn, client, n):
        now = utc_now()
        naive = naive_utc(now - dt.timedelta(days=3))
        env = (
            "INSERT INTO environments (id, project_id, name, slug, state, auto_stop_at, auto_stop_setting, created_at, "
            "updated_at) "
            "SELECT g, 1, 'review/' || g, 'review-' || g, :state, :stop_at, :setting, :naive, :naive "
            "FROM generate_series(:a, :b) g"
        )
        due = now - dt.timedelta(hours=1)
        main, ci = conn.of("environments"), conn.of("p_ci_builds")  # deployments in main, builds in ci
        main.execute(text(env), dict(state="available", stop_at=due, setting=0, naive=naive, a=1, b=n))
        main.execute(text(env), dict(state="available", stop_at=now + dt.timedelta(days=1), setting=0, naive=naive,
                                     a=n + 1, b=n + KEEPERS))
        main.execute(text(env), dict(state="available", stop_at=due, setting=1, naive=naive,
                                     a=n + KEEPERS + 1, b=n + 2 * KEEPERS))
        build = (
            "INSERT INTO p_ci_builds (partition_id, project_id, commit_id, name, type, status, lock_version, "
            "created_at, updated_at) "
            "SELECT 100 + g % 3, 1, :pipeline + g, :name, 'Ci::Build', :status, 0, :naive, :naive "
            "FROM generate_series(1, :n) g WHERE g % 2 = 1"
        )
        ci.execute(text(build), dict(pipeline=PIPELINE, name="deploy", status="success", naive=naive, n=n))
        ci.execute(text(build), dict(pipeline=PIPELINE, name="stop_review", status="manual", naive=naive, n=n))
        # Each deployment names its deploy build (in ci, on a decomposed GitLab: read there, written in main).
        deploys = ci.execute(text(
            "SELECT commit_id - :pipeline AS env_id, id FROM p_ci_builds "
            "WHERE name = 'deploy' AND commit_id > :pipeline"
        ), dict(pipeline=PIPELINE)).all()
        main.execute(text(
            "INSERT INTO deployments (iid, project_id, environment_id, ref, tag, sha, status, deployable_type, "
            "deployable_id, on_stop, created_at, updated_at) "
            "SELECT d.env_id, 1, d.env_id, 'main', false, repeat('a', 40), 2, 'CommitStatus', d.build_id, "
            "'stop_review', :naive, :naive "
            "FROM unnest(CAST(:envs AS bigint[]), CAST(:builds AS bigint[])) AS d (env_id, build_id)"
        ), dict(envs=[d.env_id for d in deploys], builds=[d.id for d in deploys], naive=naive))

    def keeper_ids(self, conn, n):
        return {"environments": list(range(n + 1, n + 2 * KEEPERS + 1))}

    @staticmethod
    def stop_actions(conn: Conns, columns: str, ids: list[int]) -> dict[int, tuple]:
        """``columns`` of each environment's stop action (``s``), by environment id: in ci, the environments in main."""
        query = text(
            f"SELECT s.commit_id - :pipeline AS env_id, {columns} FROM p_ci_builds s "
            "WHERE s.commit_id - :pipeline IN :ids AND s.commit_id > :pipeline AND s.name = 'stop_review'"
        ).bindparams(bindparam("ids", expanding=True))
        return {r.env_id: tuple(r)[1:]
                for r in conn.of("p_ci_builds").execute(query, {"ids": ids or [-1], "pipeline": PIPELINE})}

    def classify(self, conn, client, seeded, ids):
        # What a LEFT JOIN of environments and their stop actions gave, on one database.
        query = text(
            "SELECT e.id, e.state, e.auto_stop_at IS NULL AS cleared FROM environments e WHERE e.id IN :ids"
        ).bindparams(bindparam("ids", expanding=True))
        actions = self.stop_actions(
            conn, "s.status, s.lock_version, s.queued_at IS NOT NULL AS queued, "
            "EXISTS (SELECT 1 FROM ci_pending_builds p WHERE p.build_id = s.id) AS pending", ids)
        rows = {r.id: tuple(r)[1:] + actions.get(r.id, (None, None, False, False))
                for r in conn.of("environments").execute(query, {"ids": ids or [-1]})}
        envs = _rows(conn, "environments", ids)
        # Decomposed, no transaction spans main and ci: a run killed after ci's commit (the stop action played and
        # queued, once) and before main's leaves the environment as seeded; the next run picks it again, plays
        # nothing twice (lock_version stays 1, else a violation) and finishes it. That is untouched there, and a
        # half-processed row on one database, where both are one transaction.
        between_commits = isinstance(conn.engine, Databases)
        state = State()
        for env_id in ids:
            what = rows.get(env_id)
            if env_id % 2:
                done = what == ("stopping", False, "pending", 1, True, True)
                untouched = what == ("available", False, "manual", 0, False, False) or (
                    between_commits and what == ("available", False, "pending", 1, True, True))
            else:
                done = what == ("stopped", True, None, None, False, False)
                untouched = what == ("available", False, None, None, False, False)
            _sort(state, env_id, done, untouched and envs[env_id] == seeded.snapshot[env_id], what)
        return state

    def done_count(self, metadata):
        return metadata["stopped_count"] + metadata["stopping_count"]

    def write(self, conn, ids, rng):
        # A new deployment starts the environment again: auto_stop_at moves a day ahead.
        query = text(
            "UPDATE environments SET auto_stop_at = :later, updated_at = :naive "
            "WHERE id IN :ids AND state = 'available' RETURNING id, state, auto_stop_at"
        ).bindparams(bindparam("ids", expanding=True))
        now = utc_now()
        params = {"later": now + dt.timedelta(days=1), "naive": naive_utc(now), "ids": ids}
        return {r.id: tuple(r)[1:] for r in conn.of("environments").execute(query, params)}

    def read_written(self, conn, ids):
        # The environment as written, and its stop action never played.
        query = text("SELECT e.id, e.state, e.auto_stop_at FROM environments e WHERE e.id IN :ids").bindparams(
            bindparam("ids", expanding=True))
        actions = self.stop_actions(conn, "s.status, s.lock_version", ids)
        found = {}
        for r in conn.of("environments").execute(query, {"ids": ids or [-1]}):
            status, lock_version = actions.get(r.id, (None, None))
            if r.id % 2 and (status, lock_version) != ("manual", 0):
                found[r.id] = (r.state, r.auto_stop_at, f"stop action {status}/{lock_version}")
            else:
                found[r.id] = (r.state, r.auto_stop_at)
        return found


class BulkDeleteJobArtifacts(Scenario):
    """Ci::BulkDeleteExpiredJobArtifactsWorker: an expired artifact is there as seeded with no
    ci_deleted_objects row, or gone with exactly one."""

    batch = BY_NAME["schedule_bulk_delete_job_artifacts"]
    claims_buckets = True
    keys_when_done = frozenset({artifact_buckets.AVAILABLE_KEY.encode()})  # every bucket free: OCCUPIED_KEY gone

    def run_config(self, batch: int) -> dict:
        return {"ops": {"schedule_buckets": {"config": {"batch_size": batch}}}}

    def seed(self, conn, client, n):
        now = utc_now()
        conn.of("feature_gates").execute(text(  # GitLab's flags in main, the artifacts in ci
            "INSERT INTO feature_gates (feature_key, key, value, created_at, updated_at) "
            "VALUES ('bulk_delete_job_artifacts', 'boolean', 'true', now(), now())"
        ))
        insert = (
            "INSERT INTO p_ci_job_artifacts (partition_id, project_id, job_id, file_type, size, file, file_store, "
            "locked, expire_at, created_at, updated_at) "
            "SELECT 100 + g % 3, g % 7, :job + g, :file_type, 1000, 'artifacts.zip', 1, :locked, :expire_at, :created, "
            ":created FROM generate_series(1, :n) g"
        )
        expired, week = now - dt.timedelta(days=2), now - dt.timedelta(days=7)
        conn = conn.of("p_ci_job_artifacts")
        conn.execute(text(insert), dict(job=0, file_type=1, locked=0, expire_at=expired, created=week, n=n))
        conn.execute(text(insert), dict(job=n, file_type=1, locked=1, expire_at=expired, created=week, n=KEEPERS))
        conn.execute(text(insert), dict(job=n + KEEPERS, file_type=3, locked=0, expire_at=expired, created=week,
                                        n=KEEPERS))  # trace
        conn.execute(text(insert), dict(job=n + 2 * KEEPERS, file_type=1, locked=0,
                                        expire_at=now + dt.timedelta(days=1), created=week, n=KEEPERS))

    def keeper_ids(self, conn, n):
        return {"ci_job_artifacts": list(range(n + 1, n + 3 * KEEPERS + 1))}

    def classify(self, conn, client, seeded, ids):
        rows = _rows(conn, "ci_job_artifacts", ids)
        # store_dir ends in <job_id>/<artifact id> (JobArtifactUploader#hashed_path)
        objects = dict(conn.of("ci_deleted_objects").execute(text(
            "SELECT regexp_replace(store_dir, '^.*/', '')::bigint, count(*) FROM ci_deleted_objects GROUP BY 1"
        )).all())
        state = State()
        for artifact_id in ids:
            present = rows.get(artifact_id)
            _sort(state, artifact_id, present is None and objects.get(artifact_id) == 1,
                  present == seeded.snapshot[artifact_id] and artifact_id not in objects,
                  (present, objects.get(artifact_id)))
        for artifact_id in set(objects) - set(seeded.candidates):
            state.violations.append(f"ci_deleted_objects row for artifact {artifact_id}, not a candidate")
        buckets = artifact_buckets.read_state(client)
        if buckets.available & set(buckets.occupied):  # a claim or release is one atomic step
            state.violations.append(f"buckets both available and occupied: {buckets.available & set(buckets.occupied)}")
        return state

    def done_count(self, metadata):
        return metadata["destroyed_job_artifacts_count"]

    def write(self, conn, ids, rng):
        # The pipeline's artifacts get locked (Ci::UnlockArtifactsService's opposite: a ref keeps them).
        query = text(
            "UPDATE p_ci_job_artifacts SET locked = 1, updated_at = :now WHERE id IN :ids "
            "RETURNING id, locked, updated_at"
        ).bindparams(bindparam("ids", expanding=True))
        params = {"now": utc_now(), "ids": ids}
        return {r.id: tuple(r)[1:] for r in conn.of("p_ci_job_artifacts").execute(query, params)}

    def read_written(self, conn, ids):
        query = text("SELECT id, locked, updated_at FROM p_ci_job_artifacts WHERE id IN :ids").bindparams(
            bindparam("ids", expanding=True))
        return {r.id: tuple(r)[1:] for r in conn.of("p_ci_job_artifacts").execute(query, {"ids": ids or [-1]})}


# Where DeleteExpiredArtifactFiles keeps its stored files: one folder for every process of the session, each
# test seeding it afresh. 0755 like the servers' folder (conftest.servers_dir).
FILES_ROOT = Path(tempfile.mkdtemp(prefix="ci_cleanup_files_"))
os.chmod(FILES_ROOT, 0o755)
atexit.register(shutil.rmtree, FILES_ROOT, ignore_errors=True)  # gone with the process that made it


class DeleteExpiredArtifactFiles(Scenario):
    """Ci::DeleteObjectsService: a due local ci_deleted_objects row is there as seeded, or gone with its file.

    A row still there whose file is gone is a run killed between the unlink and its batch's commit: the
    row is untouched, and the next run counts the file as already gone. A row gone with its file still
    on disk is a violation (an orphaned file). Keepers: rows not yet due and object-storage rows, with files.
    """

    batch = BY_NAME["delete_expired_artifact_files"]

    def run_config(self, batch: int) -> dict:
        config = {"artifacts_root": str(FILES_ROOT), "batch_size": batch}
        return {"ops": {"plan_artifact_file_removal": {"config": config}}}

    @staticmethod
    def path(store_dir: str) -> Path:
        return FILES_ROOT / store_dir / "a.zip"

    def seed(self, conn, client, n):
        shutil.rmtree(FILES_ROOT / "files", ignore_errors=True)
        insert = (
            "INSERT INTO ci_deleted_objects (file_store, store_dir, file, project_id, pick_up_at) "
            "SELECT :store, 'files/' || :kind || '/' || g, 'a.zip', g, :at - make_interval(secs => g) "
            "FROM generate_series(1, :n) g RETURNING store_dir"
        )
        now = utc_now()
        hour_ago, tomorrow = now - dt.timedelta(hours=1), now + dt.timedelta(days=1)
        conn = conn.of("ci_deleted_objects")
        dirs = list(conn.scalars(text(insert), dict(store=1, kind="due", at=hour_ago, n=n)))
        dirs += conn.scalars(text(insert), dict(store=1, kind="later", at=tomorrow, n=KEEPERS)).all()
        dirs += conn.scalars(text(insert), dict(store=2, kind="remote", at=hour_ago, n=KEEPERS)).all()
        for store_dir in dirs:
            self.path(store_dir).parent.mkdir(parents=True)
            self.path(store_dir).write_bytes(b"zip")

    def keeper_ids(self, conn, n):
        return {"ci_deleted_objects": list(range(n + 1, n + 2 * KEEPERS + 1))}

    def classify(self, conn, client, seeded, ids):
        rows = _rows(conn, "ci_deleted_objects", ids)
        columns = conn.of("ci_deleted_objects").execute(text("SELECT * FROM ci_deleted_objects LIMIT 0")).keys()
        store_dir = list(columns).index("store_dir")
        state = State()
        for row_id in ids:
            on_disk = self.path(seeded.snapshot[row_id][store_dir]).exists()
            _sort(state, row_id, row_id not in rows and not on_disk, rows.get(row_id) == seeded.snapshot[row_id],
                  (rows.get(row_id), on_disk))
        for row_id, before in seeded.keepers["ci_deleted_objects"].items():
            if not self.path(before[store_dir]).exists():
                state.violations.append(f"keeper {row_id}'s file {before[store_dir]} was removed")
        return state

    def write(self, conn, ids, rng):
        # GitLab's own DeleteObjectsService could not remove the file: it puts the row off for later.
        query = text(
            "UPDATE ci_deleted_objects SET pick_up_at = :later WHERE id IN :ids RETURNING id, pick_up_at"
        ).bindparams(bindparam("ids", expanding=True))
        later = utc_now() + dt.timedelta(hours=1)
        return {r.id: tuple(r)[1:] for r in conn.of("ci_deleted_objects").execute(query, {"later": later, "ids": ids})}

    def read_written(self, conn, ids):
        query = text("SELECT id, pick_up_at FROM ci_deleted_objects WHERE id IN :ids").bindparams(
            bindparam("ids", expanding=True)
        )
        return {r.id: tuple(r)[1:] for r in conn.of("ci_deleted_objects").execute(query, {"ids": ids or [-1]})}


SCENARIOS = {
    s.name: s for s in (
        DropCancelingBuilds(), StaleRunnerMachines(), StuckExportJobs(), EnvironmentsAutoStop(),
        BulkDeleteJobArtifacts(), DeleteExpiredArtifactFiles(),
    )
}


# --------------------------------------------------------------------------- runs in other processes

# Dagster's console logger prints every event of a run (hundreds per run, thousands per series) to an output no one
# reads: these scenarios assert on rows, keys and the metadata in the run's events, so the runs log only errors.
QUIET_CONSOLE = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}


def plain(metadata: dict) -> dict:
    """Metadata values that survive a pipe and JSON: numbers, strings, lists of them."""
    return {k: v for k, v in metadata.items() if isinstance(v, (int, float, str, bool, list, type(None)))}


def _report(result, op_name: str) -> dict:
    for event in result.events_for_node(op_name):
        if event.event_type_value == "STEP_OUTPUT":
            return plain({k: v.value for k, v in event.step_output_data.metadata.items()})
    return {}


def use_redis_stores(stores: RedisStores) -> None:
    """In a forked process only: its runs find GitLab's Redis stores in its variables, as ``ci-cleanup run`` does."""
    for name in [n for n in os.environ if n.startswith("CI_CLEANUP_REDIS") or n == ENV_CONFIG_DIR]:
        del os.environ[name]
    os.environ.update(stores.env)


def _child_run(send, scenario: Scenario, stack, stores: RedisStores, run_config: dict, lease_ttl: int | None,
               barrier, parent_engines):
    for engine in parent_engines:
        engine.dispose(close=False)  # the parent's pooled connections are not ours to use or close
    scenario.shorten_lease(lease_ttl)
    use_redis_stores(stores)
    if barrier is not None:
        barrier.wait()
    try:
        result = execute(scenario, (stack.url(), stack.ci_url()), run_config, raise_on_error=False)
        send.send({"run_id": result.run_id, "success": result.success, "metadata": _report(result, scenario.report_op)})
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
        send.send({"run_id": None, "success": False, "metadata": {}, "error": repr(e)})


@dataclass
class ForkedRun:
    process: Any
    receive: Any

    def result(self, timeout: float = 180) -> dict:
        if not self.receive.poll(timeout):
            self.process.kill()
            raise AssertionError(f"forked run gave no result in {timeout} s")
        found = self.receive.recv()
        self.process.join(30)
        return found


def fork_run(scenario: Scenario, stack, stores: RedisStores, run_config: dict, parent_engines, *,
             lease_ttl: int | None = None, barrier=None) -> ForkedRun:
    """A run in a forked process, on ``stack``'s database(s) (PgBouncer's, deployed) and ``stores``."""
    receive, send = FORK.Pipe(duplex=False)
    process = FORK.Process(target=_child_run, args=(send, scenario, stack, stores, run_config, lease_ttl, barrier,
                                                    parent_engines), daemon=True)
    process.start()
    send.close()
    return ForkedRun(process, receive)


@dataclass
class CliRun:
    home: Path
    process: subprocess.Popen
    log: Path

    def result(self, report_op: str, timeout: float = 240) -> dict:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"dagster job execute did not finish in {timeout} s") from None
        instance = DagsterInstance.from_config(str(self.home))
        try:
            runs = instance.get_runs()
            assert len(runs) == 1, (runs, self.log.read_text()[-3000:])
            run = runs[0]
            metadata = {}
            for record in instance.all_logs(run.run_id, of_type=DagsterEventType.STEP_OUTPUT):
                if record.step_key == report_op:
                    metadata = plain({k: v.value for k, v in record.dagster_event.step_output_data.metadata.items()})
            success = run.status == DagsterRunStatus.SUCCESS and self.process.returncode == 0
            return {"run_id": run.run_id, "success": success, "metadata": metadata, "log": self.log.read_text()[-3000:]}
        finally:
            instance.dispose()


def start_cli(scenario: Scenario, stack, home: Path, run_config: dict) -> CliRun:
    """``dagster job execute`` in its own process and its own DAGSTER_HOME (sqlite storage, read back afterwards)."""
    home.mkdir(parents=True)
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    config = home / "run_config.yaml"
    config.write_text(json.dumps({**run_config, **QUIET_CONSOLE}))  # JSON is YAML
    log = home / "run.log"
    ci_url = stack.ci_url()  # GitLab as deployed: ci too (the runs reach both through PgBouncer)
    with log.open("w") as out:
        process = subprocess.Popen(
            [BIN / "dagster", "job", "execute", "-m", "ci_cleanup", "-j", scenario.name, "-c", str(config)],
            env=clean_env(CI_CLEANUP_DATABASE_URL=stack.url(), CI_CLEANUP_REDIS_URL=stack.redis_url,
                          DAGSTER_HOME=str(home), **({"CI_CLEANUP_CI_DATABASE_URL": ci_url} if ci_url else {})),
            stdout=out, stderr=subprocess.STDOUT, cwd=home,
        )
    return CliRun(home, process, log)


class LeaseWatch(threading.Thread):
    """Samples a lease key every 2 ms through ``client`` (closed when it stops): the sequence of holders (run ids)
    it saw, None for free."""

    def __init__(self, client, key: str):
        super().__init__(daemon=True)
        self.client, self.key = client, key
        self.holders: list[str | None] = []
        self._stop_event = threading.Event()

    def run(self):
        last = object()
        while not self._stop_event.is_set():
            value = self.client.get(self.key)
            value = value.decode() if value is not None else None
            if value != last:
                self.holders.append(value)
                last = value
            time.sleep(0.002)

    def stop(self) -> list[str | None]:
        self._stop_event.set()
        self.join(5)
        close_client(self.client)
        return self.holders


def client_backends(engine: Engine | Databases) -> set[int]:
    """Client sessions on the GitLab database(s) (main's and ci's, decomposed)."""
    found = set()
    for one in engines(engine):
        with one.connect() as conn:
            found |= set(conn.scalars(text(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND backend_type = 'client backend'"
            )))
    return found


def wait_for_backends_to_end(engine: Engine | Databases, keep: set[int], timeout: float = 10) -> None:
    """A killed run's server sessions end (and roll back) once PostgreSQL notices the closed socket."""
    deadline = time.monotonic() + timeout
    while True:
        mine = set()
        for one in engines(engine):
            with one.connect() as conn:
                mine.add(conn.scalar(text("SELECT pg_backend_pid()")))
        left = client_backends(engine) - keep - mine
        if not left:
            return
        assert time.monotonic() < deadline, f"backends of a killed run still there after {timeout} s: {left}"
        time.sleep(0.02)


def _writer(send, stop, scenario: Scenario, urls: Urls, candidates: list[int], seed: int, parent_engines) -> None:
    for engine in parent_engines:
        engine.dispose(close=False)
    engine = engine_of(urls)
    rng = random.Random(seed)
    order = list(candidates)
    rng.shuffle(order)
    written: dict[int, tuple] = {}
    try:
        while order and not stop.is_set():
            picked = [order.pop() for _ in range(min(5, len(order)))]
            with connections(engine, begin=True) as conn:
                written.update(scenario.write(conn, picked, rng))
                time.sleep(0.03)  # hold the row locks: the job's statements wait on them and re-check
            time.sleep(0.002)
    finally:
        engine.dispose()
        send.send(written)


def start_writer(scenario: Scenario, urls: Urls, candidates: list[int], seed: int, parent_engines):
    """Another process changing candidates as GitLab would, on ``urls`` (:func:`direct_urls`)."""
    receive, send = FORK.Pipe(duplex=False)
    stop = FORK.Event()
    process = FORK.Process(target=_writer, args=(send, stop, scenario, urls, candidates, seed, parent_engines),
                           daemon=True)
    process.start()
    send.close()

    def finish() -> dict[int, tuple]:
        stop.set()
        assert receive.poll(60), "the writer gave no result"
        written = receive.recv()
        process.join(10)
        return written

    return finish


def age_occupied_buckets(client) -> list[int]:
    """Ten minutes pass for every occupied bucket (its claim score moves past the stale threshold)."""
    occupied = artifact_buckets.read_state(client).occupied
    past = (utc_now() - artifact_buckets.STALE_AFTER - dt.timedelta(seconds=1)).timestamp()
    if occupied:
        client.zadd(artifact_buckets.OCCUPIED_KEY, {str(b): past for b in occupied}, xx=True)
    return sorted(occupied)


def wait_for_lease_to_expire(client, key: str, ttl: int) -> float:
    """Returns how long the dead run's lease lived on; fails if it outlives its TTL."""
    started = time.monotonic()
    pttl = client.pttl(key)
    assert pttl == -2 or 0 <= pttl <= ttl * 1000, f"lease {key} left with PTTL {pttl} ms (TTL {ttl} s): held forever?"
    while client.exists(key):
        assert time.monotonic() - started < ttl + 2, f"lease {key} still held {ttl + 2} s after the kill"
        time.sleep(0.01)
    return time.monotonic() - started


# --------------------------------------------------------------------------- SIGKILL trials, one series per job

def execute(scenario: Scenario, urls: Urls, run_config: dict, *, raise_on_error: bool = True):
    """A run on ``urls``, its Redis stores read from the variables (:func:`use_redis_stores`)."""
    main, ci = urls
    return scenario.job.execute_in_process(
        run_config={**run_config, **QUIET_CONSOLE},
        resources=job_resources(main, None, ci_database_url=ci),
        instance=DagsterInstance.ephemeral(),
        raise_on_error=raise_on_error,
    )


def _killable_run(scenario: Scenario, urls: Urls, run_config: dict, lease_ttl: int | None, send,
                  parent_engines) -> None:
    for engine in parent_engines:
        engine.dispose(close=False)
    scenario.shorten_lease(lease_ttl)  # this process only: the dead run's lease must expire soon
    result = execute(scenario, urls, run_config, raise_on_error=False)
    errors = [e.event_specific_data.error.message for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    send.send({"success": result.success, "metadata": _report(result, scenario.report_op), "errors": errors})


@dataclass
class CrashSettings:
    n: int
    batch: int
    trials: int
    kill_within: float
    lease_ttl: int


def crash_series(scenario: Scenario, urls: Urls, stores: RedisStores, settings: CrashSettings, seed: str) -> dict:
    """``trials`` times: seed, start a run, SIGKILL it after a random delay, check every row and key, let the next
    run finish. ``urls``: one database, or main and ci (straight to PostgreSQL: a killed run's sessions end there).
    ``stores``: where the runs find Redis; in this process's variables (it is a forked one)."""
    use_redis_stores(stores)
    engine = engine_of(urls, pool_size=2)
    try:
        with stores.clients() as uses:
            return _trials(scenario, urls, engine, uses["leases"], uses["others"], settings, seed)
    finally:
        engine.dispose()


def _trials(scenario: Scenario, urls: Urls, engine, leases, client, settings: CrashSettings, seed: str) -> dict:
    """The trials of :func:`crash_series`; ``leases`` and ``client``: the lease store and the others' (one server,
    unless the leases are on a cluster)."""
    rng = random.Random(seed)
    config = scenario.run_config(settings.batch)
    violations: list[str] = []
    figures = dict(trials=settings.trials, killed_while_running=0, killed_mid_work=0, completed_before_kill=0,
                   lease_left_by_dead_run_then_expired=0, longest_wait_for_lease_expiry_s=0.0,
                   dead_workers_buckets_skipped_then_recovered=0, rows_checked=0, violations=0)
    window = settings.kill_within
    for trial in range(settings.trials):
        seeded = scenario.reset_and_seed(engine, client, settings.n)
        keep = client_backends(engine)
        receive, send = FORK.Pipe(duplex=False)
        lease_ttl = settings.lease_ttl if scenario.lease else None
        run = FORK.Process(target=_killable_run,
                           args=(scenario, urls, config, lease_ttl, send, engines(engine)), daemon=True)
        started = time.monotonic()
        run.start()
        send.close()
        # Stratified: trial i's kill lands at a random point of the i-th of ``trials`` equal slices of the window, so
        # even a few trials reach its every part (start-up, first batches, the end of the run).
        run.join((trial + rng.random()) * window / settings.trials)
        if run.is_alive():
            run.kill()  # SIGKILL
            run.join(10)
            figures["killed_while_running"] += 1
        else:
            figures["completed_before_kill"] += 1
            # The window shrinks to the run's length, so that the later kills land while a run works: on a fast
            # machine a whole run took less than the window's first third (3 of 3 trials ended before their kill).
            window = min(window, time.monotonic() - started)
            finished = receive.recv() if receive.poll(10) else {"success": False, "errors": ["no result"]}
            if not finished["success"] and any("Lost lease" in e for e in finished["errors"]):
                # A run stalled past the short test TTL stops itself (the job's own guard), changing nothing more.
                stopped = "stopped_after_losing_the_short_lease"
                figures[stopped] = figures.get(stopped, 0) + 1
            elif not finished["success"]:
                violations.append(f"trial {trial}: the run finished before the kill but failed: {finished}")
        receive.close()
        wait_for_backends_to_end(engine, keep)

        state = scenario.check(engine, client, seeded)
        violations += [f"trial {trial} after the kill: {v}" for v in state.violations]
        figures["rows_checked"] += len(seeded.candidates) + sum(len(k) for k in seeded.keepers.values())
        figures["killed_mid_work"] += 0 < len(state.done) < settings.n
        if scenario.claims_buckets:  # a claim or a release is one atomic step, the buckets added in one SADD
            buckets = artifact_buckets.read_state(client)
            if buckets.available | set(buckets.occupied) not in (set(), set(range(MAX_BUCKETS))):
                violations.append(f"trial {trial}: a bucket lost by the kill: {buckets}")
        if scenario.lease and leases.exists(scenario.lease):
            waited = wait_for_lease_to_expire(leases, scenario.lease, settings.lease_ttl)
            figures["lease_left_by_dead_run_then_expired"] += 1
            longest = figures["longest_wait_for_lease_expiry_s"]
            figures["longest_wait_for_lease_expiry_s"] = round(max(longest, waited), 2)

        to_do, done_by_next = len(state.untouched), 0
        stale = []
        if scenario.claims_buckets:
            occupied = sorted(artifact_buckets.read_state(client).occupied)
            if occupied and state.untouched:
                # The dead worker's bucket is not handed out before stale recovery...
                first = _report(execute(scenario, urls, config), scenario.report_op)
                done_by_next += first["destroyed_job_artifacts_count"]
                # ci_job_artifacts columns: (id, partition_id, project_id, job_id, ...)
                held = {i for i in state.untouched
                        if (seeded.snapshot[i].project_id + seeded.snapshot[i].job_id) % MAX_BUCKETS in occupied}
                if (set(first["buckets_processed"]) & set(occupied)
                        or not held <= scenario.check(engine, client, seeded).untouched):
                    violations.append(
                        f"trial {trial}: a bucket held by the dead worker was processed: {first}, {occupied}")
                figures["dead_workers_buckets_skipped_then_recovered"] += len(occupied)
            # ...and is recovered once ten minutes have passed.
            stale = age_occupied_buckets(client)

        recovery = _report(execute(scenario, urls, config), scenario.report_op)
        done_by_next += scenario.done_count(recovery)
        if recovery["status"] != "success" or done_by_next != to_do:
            violations.append(f"trial {trial}: the next run did {done_by_next} of {to_do}: {recovery}")
        if scenario.claims_buckets and (
            recovery["stale_count"] != len(stale) or artifact_buckets.read_state(client).occupied
        ):
            violations.append(f"trial {trial}: stale buckets {stale} not recovered: {recovery}")
        final = scenario.check(engine, client, seeded)
        violations += [f"trial {trial} after the next run: {v}" for v in final.violations]
        if final.done != set(seeded.candidates):
            violations.append(f"trial {trial}: the next run left {len(set(seeded.candidates) - final.done)} rows")
        keys = set(client.keys("*"))  # this job's db; a cluster's leases are every lease job's
        if scenario.lease and leases.exists(scenario.lease):
            keys.add(scenario.lease.encode())
        if keys != scenario.keys_when_done:
            violations.append(f"trial {trial}: Redis holds {sorted(keys)}, not {sorted(scenario.keys_when_done)}")
        figures["rows_checked"] += len(seeded.candidates) + sum(len(k) for k in seeded.keepers.values())
    figures["violations"] = len(violations)
    figures["kill_window_s"] = round(window, 2)
    return {"figures": figures, "violations": violations[:50]}


def _series_process(send, scenario: Scenario, urls: Urls, stores: RedisStores, settings: CrashSettings, seed: str,
                    parent_engines) -> None:
    import traceback

    for engine in parent_engines:
        engine.dispose(close=False)
    try:
        send.send(crash_series(scenario, urls, stores, settings, seed))
    except BaseException:  # noqa: BLE001 - the parent fails the test with it
        send.send({"figures": {}, "violations": [traceback.format_exc()]})


def start_crash_series(scenario: Scenario, urls: Urls, stores: RedisStores, settings: CrashSettings, seed: str,
                       parent_engines):
    """One job's trials in a process of their own (their own database(s) and Redis db), so the five series
    overlap."""
    receive, send = FORK.Pipe(duplex=False)
    process = FORK.Process(target=_series_process,
                           args=(send, scenario, urls, stores, settings, seed, parent_engines))
    process.start()
    send.close()

    def result(timeout: float = 400) -> dict:
        if not receive.poll(timeout):
            process.kill()
            raise AssertionError(f"{scenario.name}: the crash trials did not end in {timeout} s")
        found = receive.recv()
        process.join(30)
        return found

    return result
