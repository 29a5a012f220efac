"""What the tests share: an embedded stack with GitLab's tables, resetting it, scratch databases, and the
processes of ``ci-cleanup dev`` (its port, its servers, its UI coming up)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import psycopg2.extensions
import redis
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Engine

from ci_cleanup.gitlab.schema import CI_DATABASE, MAIN_DATABASE, database_of, gitlab_schema
from ci_cleanup_dev.ddl import create_schema, truncate_all
from ci_cleanup_dev.devstack import EmbeddedStack, PgBouncer, create_decomposed
from ci_cleanup_dev.project_rows import add_projects


@contextlib.contextmanager
def gitlab_stack(data_dir: Path) -> Iterator[EmbeddedStack]:
    """An embedded stack in ``data_dir`` whose GitLab database has GitLab's tables; stopped afterwards.

    Its PostgreSQL does not fsync: the tests' data need not outlive a crash of the machine, and every commit, and
    every scratch database's CREATE and DROP (a checkpoint), then waits for no disk flush. A PostgreSQL killed or
    restarted by a test loses nothing either way: what it wrote is in the operating system's cache.
    """
    with EmbeddedStack(data_dir) as stack:
        admin = create_engine(stack.url("postgres"), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text("ALTER SYSTEM SET fsync = off"))
            conn.execute(text("SELECT pg_reload_conf()"))
        admin.dispose()
        gitlab_database(stack.url()).dispose()
        yield stack


def gitlab_database(url: str, *statements: str) -> Engine:
    """An engine on ``url`` whose database has GitLab's tables and project 1, after ``statements`` (to break or
    fill it)."""
    engine = create_engine(url)
    create_schema(engine)
    with engine.begin() as conn:
        if conn.scalar(text("SELECT to_regclass('projects')")) is not None:
            add_projects(conn, [1])
        for statement in statements:
            conn.execute(text(statement))
    return engine


def reset(engine: Engine | Databases, redis_client=None, *, also: tuple[str, ...] = ()) -> None:
    """Every GitLab table emptied (with ``also``) but for GitLab's project 1 (the factories' default, its group,
    builds and runners on: ``add_projects``), and the client's Redis db flushed (that db only: tests and
    series that use other dbs of the same server flush their own). Decomposed: each database's own tables."""
    if isinstance(engine, Databases):
        for database, own in ((MAIN_DATABASE, engine.main), (CI_DATABASE, engine.ci)):
            with own.begin() as conn:
                truncate_all(conn, gitlab_schema(), also=also, database=database)
                if database == MAIN_DATABASE:
                    add_projects(conn, [1])
    else:
        with engine.begin() as conn:
            truncate_all(conn, gitlab_schema(), also=also)
            add_projects(conn, [1])
    if redis_client is not None:
        redis_client.flushdb()


class Databases:
    """A decomposed GitLab's databases as a test sees them: direct connections (never through PgBouncer) to
    ``main`` and ``ci``. :meth:`of` is the engine of a table's rows; anything else (``begin``, ``connect``) is
    main's, so a test that writes a ci table there meets GitLab's lock-writes trigger, loudly."""

    def __init__(self, main: Engine, ci: Engine):
        self.main, self.ci = main, ci

    def of(self, table: str) -> Engine:
        """``table``: a factory's name (``ci_builds``) or the database's (``p_ci_builds``)."""
        schema = gitlab_schema()
        declared = getattr(schema, table, None) if hasattr(schema, table) else schema.metadata.tables[table]
        return self.ci if database_of(declared) == CI_DATABASE else self.main

    def __getattr__(self, name: str):
        return getattr(self.main, name)

    def dispose(self) -> None:
        self.main.dispose()
        self.ci.dispose()


def on(engine: Engine | Databases, table: str) -> Engine:
    """The engine holding ``table``'s rows: ``engine`` itself unless it is a decomposed GitLab's databases."""
    return engine.of(table) if isinstance(engine, Databases) else engine


class DeployedStack:
    """GitLab as deployed: ``gitlab_main`` and ``gitlab_ci`` (GitLab's DDL in both, GitLab's lock-writes
    triggers on the other's tables) in the embedded PostgreSQL, reached by the jobs through Debian's PgBouncer
    in transaction pooling (two server connections per database; ``deployed_main_one``, ``deployed_ci_one``: the
    same databases through a pool of one). Redis and the Dagster database are the embedded stack's."""

    MAIN, CI = "deployed_main", "deployed_ci"

    def __init__(self, embedded: EmbeddedStack, bouncer: PgBouncer):
        self.embedded, self.bouncer = embedded, bouncer

    def url(self, database: str = MAIN) -> str:
        """What a job is given: through PgBouncer for GitLab's databases, direct for any other (scratch)."""
        return self.bouncer.url(database) if database in self.bouncer.databases else self.embedded.url(database)

    def ci_url(self) -> str:
        return self.bouncer.url(self.CI)

    def direct_url(self, database: str = MAIN) -> str:
        return self.embedded.url(database)

    @property
    def redis_url(self) -> str:
        return self.embedded.redis_url

    def env(self) -> dict[str, str]:
        urls = {"CI_CLEANUP_DATABASE_URL": self.url(), "CI_CLEANUP_CI_DATABASE_URL": self.ci_url()}
        return {**self.embedded.env(), **urls}


@contextlib.contextmanager
def statements_sent(*engines: Engine) -> Iterator[list[tuple[Engine, str, object]]]:
    """Every statement sent on these engines' connections while inside (its engine, its SQL, its parameters), through
    SQLAlchemy or on a connection's own cursor, as psycopg2 is handed it."""
    sent: list[tuple[Engine, str, object]] = []

    def recording(engine: Engine) -> type:
        class Recording(psycopg2.extensions.cursor):
            def execute(self, query, vars=None):
                sent.append((engine, query, vars))
                return super().execute(query, vars)
        return Recording

    def checkin(dbapi_connection, _record):
        dbapi_connection.cursor_factory = None

    def checkout(factory: type):
        def checked_out(dbapi_connection, _record, _proxy):
            dbapi_connection.cursor_factory = factory
        return checked_out

    listeners = [(engine, name, fn) for engine in set(engines)
                 for name, fn in (("checkout", checkout(recording(engine))), ("checkin", checkin))]
    for listener in listeners:
        event.listen(*listener)
    try:
        yield sent
    finally:
        for listener in listeners:
            event.remove(*listener)


@contextlib.contextmanager
def deployed_stack(embedded: EmbeddedStack, data_dir: Path) -> Iterator[DeployedStack]:
    create_decomposed(embedded, DeployedStack.MAIN, DeployedStack.CI)
    pools = {DeployedStack.MAIN: (DeployedStack.MAIN, 2), DeployedStack.CI: (DeployedStack.CI, 2),
             "deployed_main_one": (DeployedStack.MAIN, 1), "deployed_ci_one": (DeployedStack.CI, 1)}
    with PgBouncer.of_stack(embedded, data_dir, pools) as bouncer:
        yield DeployedStack(embedded, bouncer)


@contextlib.contextmanager
def scratch_database_of(stack: EmbeddedStack) -> Iterator[str]:
    """A database of its own on ``stack``, dropped afterwards; yields its URL."""
    name = f"scratch_{uuid.uuid4().hex[:12]}"
    admin = create_engine(stack.url("postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield stack.url(name)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
        admin.dispose()


def clean_env(**extra) -> dict[str, str]:
    """The process environment without any ci_cleanup or Dagster setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CI_CLEANUP_", "DAGSTER_"))}
    return {**env, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servers_of(data_dir: Path) -> list:
    """PostgreSQL processes of the stack in ``data_dir``, and its Redis if its socket still answers."""
    procs = [p for p in psutil.process_iter(["cmdline"]) if str(data_dir) in " ".join(p.info["cmdline"] or [])]
    settings = data_dir / "redis" / "dump.rdb.settings"
    if settings.exists():
        try:
            redis.Redis(unix_socket_path=json.loads(settings.read_text())["unixsocket"]).ping()
            procs.append("redis")
        except (redis.ConnectionError, FileNotFoundError):
            pass
    return procs


def wait_for_ui(base_url: str, process: subprocess.Popen, seconds: float = 180) -> None:
    """Until the Dagster webserver at ``base_url`` answers; fails with the process's output if it exits first."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(base_url + "/server_info", timeout=2)
            return
        except OSError:
            assert process.poll() is None, process.stdout.read()[-3000:]
            assert time.monotonic() < deadline, f"the UI did not come up in {seconds:.0f} s"
            time.sleep(1)
