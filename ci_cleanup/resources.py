"""The two external systems a batch touches: GitLab's PostgreSQL and GitLab's Redis.

Engines and clients are built in ``setup_for_execution`` (once per step process, never at import)
with small pools, and checked there, so an unreachable server fails the step with a message that
names the server, without its password.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import parse_qsl, quote, urlsplit

import psycopg2.errors
import redis
from dagster import ConfigurableResource, EnvVar, InitResourceContext
from pydantic import Field, PrivateAttr
from sqlalchemy import Table, create_engine, event, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, OperationalError, SQLAlchemyError

from .gitlab.schema import (
    CI_DATABASE,
    MAIN_DATABASE,
    GitLabSchema,
    SchemaMismatch,
    database_of,
    detect_tables,
    require_columns,
    write_locked,
)


class ServiceUnavailable(RuntimeError):
    """PostgreSQL or Redis could not be reached or used; the message names which."""


class DatabaseUnavailable(ServiceUnavailable):
    """The GitLab database went away mid-run (server stopped, connection terminated): the run fails."""


class RedisUnavailable(ServiceUnavailable, redis.ConnectionError):
    """A Redis server went away mid-run; still a ``redis.ConnectionError`` for code that handles those."""


_BAD_PASSWORD = (
    "{variable} has a raw '@' or ':' in its password (or cannot be parsed): "
    "percent-encode the password ('@' as %40, ':' as %3A, '/' as %2F)"
)


def database_url(url: str, variable: str = "CI_CLEANUP_DATABASE_URL"):
    """Parse an SQLAlchemy URL; a bare ``postgresql://`` means psycopg2 (SQLAlchemy 2.1 would pick psycopg 3).

    A raw ``@`` or ``:`` in the password is refused before parsing: SQLAlchemy would cut the password
    there and put the rest in the host or port, and psycopg2's error would print it.
    No error here carries any part of the URL, which holds the password; each names ``variable``.
    """
    bad_password = _BAD_PASSWORD.format(variable=variable)
    _, sep, rest = url.partition("://")
    # SQLAlchemy's grammar: user [^:/]*, then ":" password [^@]*, then "@", then host[:port] up to "/" or "?".
    userinfo = re.match(r"[^:/@]*(?::([^@]*))?@", rest) if sep else None
    if userinfo is not None:
        host = re.split(r"[/?]", rest[userinfo.end():], maxsplit=1)[0]
        if ":" in (userinfo.group(1) or "") or "@" in host:
            raise ValueError(bad_password)
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise ValueError(f"{variable} is not a valid SQLAlchemy URL (postgresql+psycopg2://…)") from None
    except ValueError:  # e.g. int() of a "port" that is a piece of the password
        raise ValueError(bad_password) from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg2")
    if parsed.drivername != "postgresql+psycopg2":
        raise ValueError(f"{variable} must be postgresql+psycopg2://…, not {parsed.drivername}://")
    return parsed


_REDIS_SCHEMES = ("redis", "rediss", "unix")
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]*)(:[0-9]+)?")
UNSHOWN_URL = "<URL not shown: it cannot be parsed safely>"


def redact_redis_url(url: str) -> str:
    """The URL as it can be shown: any user or password as ``***``, query values other than ``db`` hidden.

    A URL whose shape leaves any doubt where the credentials end (no ``scheme://``, an ``@`` or
    ``#`` outside the user part, a host that is not a host name) is never echoed: a password
    with a raw ``/``, ``?`` or ``#`` in it would land in the path, query or fragment.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return UNSHOWN_URL
    if parts.scheme not in _REDIS_SCHEMES or not url.startswith(f"{parts.scheme}://") or "#" in url:
        return UNSHOWN_URL
    _, at, host = parts.netloc.rpartition("@")
    if "@" in parts.path + parts.query or not _HOST_PORT.fullmatch(host):
        return UNSHOWN_URL
    if parts.scheme != "unix" and not re.fullmatch(r"(/[0-9]*)?", parts.path):
        return UNSHOWN_URL
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    query = "&".join(f"{quote(k)}={v if k == 'db' and v.isdigit() else '***'}" for k, v in pairs)
    return f"{parts.scheme}://{'***@' if at else ''}{host}{parts.path}{'?' if query else ''}{query}"


CI_DATABASE_ENV = "CI_CLEANUP_CI_DATABASE_URL"
_VARIABLES = {MAIN_DATABASE: "CI_CLEANUP_DATABASE_URL", CI_DATABASE: CI_DATABASE_ENV}


class StatementTimeout(RuntimeError):
    """A statement ran over ``statement_timeout_seconds``; PostgreSQL cancelled it (its transaction rolled back)."""


class WrongDatabase(SchemaMismatch):
    """A table the job needs is GitLab's write-locked legacy copy in the database it would use."""


class GitLabDatabase(ConfigurableResource):
    """GitLab's databases: ``main`` (``CI_CLEANUP_DATABASE_URL``) and, when GitLab is decomposed, ``ci``
    (``CI_CLEANUP_CI_DATABASE_URL``; unset, the CI tables are in the main database, GitLab's single-database
    setup). Each table is used in the database of its GitLab schema (:func:`engine_for`); no job picks one.

    The URLs default to the environment variables (the config shows the main one's name, never a value), so
    any other field can be set in the Launchpad without repeating a URL. Each database gets its own engine.
    """

    url: str = Field(
        default=EnvVar("CI_CLEANUP_DATABASE_URL"),
        description="GitLab's main database: SQLAlchemy URL, postgresql+psycopg2://…; unix-socket hosts allowed",
    )
    ci_url: str | None = Field(
        default=None,
        description=f"GitLab's ci database when decomposed; unset: env {CI_DATABASE_ENV}, else the main database",
    )
    statement_timeout_seconds: int = Field(
        default=15, ge=1, le=600, description="Every statement's limit (GitLab.com applies 15 s)"
    )
    pool_size: int = Field(
        default=2, ge=1, le=20,
        description="Connections of the run's engine, per database (the bucket workers have their own)",
    )
    builds_table: str | None = Field(
        default=None,
        description="Builds table; unset: p_ci_builds if it exists (every partition), else the flat ci_builds",
    )
    job_artifacts_table: str | None = Field(
        default=None,
        description="Job artifacts table; unset: p_ci_job_artifacts if it exists, else the flat ci_job_artifacts",
    )

    _engines: dict[str, Engine] = PrivateAttr(default_factory=dict)
    _tables: GitLabSchema | None = PrivateAttr(default=None)

    def setup_for_execution(self, context: InitResourceContext) -> None:
        try:
            for database in self._urls:
                self._engines[database] = self._create_engine(database, self.pool_size)
                with self._engines[database].connect() as conn:
                    conn.scalar(text("SELECT 1"))
        except (SQLAlchemyError, DatabaseUnavailable) as e:
            self.teardown_after_execution(context)
            raise ServiceUnavailable(
                f"Cannot reach the GitLab database (PostgreSQL) {database} at {self._where(database)}: "
                f"{getattr(e, 'orig', e)}".strip()
            ) from None
        self._engines.setdefault(CI_DATABASE, self._engines[MAIN_DATABASE])
        with self._engines[CI_DATABASE].connect() as conn:
            self._tables = detect_tables(conn, self.builds_table, self.job_artifacts_table)

    @property
    def _urls(self) -> dict[str, str]:
        ci_url = self.ci_url or os.environ.get(CI_DATABASE_ENV)
        return {MAIN_DATABASE: self.url, **({CI_DATABASE: ci_url} if ci_url else {})}

    @property
    def decomposed(self) -> bool:
        """Whether GitLab's ci database is configured apart from main."""
        return CI_DATABASE in self._urls

    def _where(self, database: str) -> str:
        return database_url(self._urls[database], _VARIABLES[database]).render_as_string(hide_password=True)

    def _create_engine(self, database: str, pool_size: int) -> Engine:
        """At most ``pool_size`` connections; every statement under the timeout; a lost server named in errors.

        The timeout is ``SET LOCAL``, sent with each statement: it holds in that statement's transaction (the
        implicit one of an autocommit statement included) and in nothing else, so no setting outlives a
        transaction on a connection PgBouncer hands to another client (GitLab's transaction pooling).
        """
        engine = create_engine(
            database_url(self._urls[database], _VARIABLES[database]),
            pool_size=pool_size, max_overflow=0, pool_pre_ping=True, hide_parameters=True,
        )
        limit = f"SET LOCAL statement_timeout = {int(self.statement_timeout_seconds * 1000)}; "

        @event.listens_for(engine, "before_cursor_execute", retval=True)
        def _limit_statement(_conn, _cursor, statement, parameters, _context, _executemany):
            return limit + statement, parameters

        where = f"{database} at {self._where(database)}"

        @event.listens_for(engine, "handle_error")
        def _name_the_server(ctx):
            # psycopg2 says "server closed the connection unexpectedly" or "connection to server on socket
            # … failed" without naming which server: say it is GitLab's PostgreSQL. A lost connection,
            # or one that cannot be opened (no statement yet), fails the run; never a pre-ping, which
            # must stay a plain disconnect so the pool reconnects after a restart.
            if isinstance(ctx.original_exception, psycopg2.errors.QueryCanceled):
                statement = " ".join((ctx.statement or "").removeprefix(limit).split())
                error = StatementTimeout(
                    f"A statement ran over the statement timeout ({self.statement_timeout_seconds} s) in the GitLab "
                    f"database {where} and was cancelled: {statement[:300]}"
                )
                error.orig = ctx.original_exception
                return error
            never_opened = ctx.connection is None and isinstance(ctx.sqlalchemy_exception, OperationalError)
            lost = ctx.is_disconnect or never_opened
            if lost and not ctx.is_pre_ping:
                error = DatabaseUnavailable(
                    f"Lost the GitLab database (PostgreSQL) {where}: {str(ctx.original_exception).strip()}"
                )
                error.orig = ctx.original_exception
                return error
            return None

        return engine

    @contextmanager
    def dedicated_engine(self, table: Table, connections: int) -> Iterator[Engine]:
        """An engine of ``connections`` connections to ``table``'s database for one op that works on that many at
        once (the bucket workers), closed when the op is done; the run's own engines keep their small pools."""
        engine = self._create_engine(self._database(table), connections)
        try:
            yield engine
        finally:
            engine.dispose()

    def teardown_after_execution(self, context: InitResourceContext) -> None:
        for engine in {id(e): e for e in self._engines.values()}.values():
            engine.dispose()
        self._engines = {}

    def _database(self, table: Table) -> str:
        """The database of ``table``'s GitLab schema, as configured: ``ci`` only when decomposed."""
        return database_of(table) if self.decomposed else MAIN_DATABASE

    def engine_for(self, table: Table) -> Engine:
        """The engine of the database that holds ``table``'s rows (GitLab's ``gitlab_schema`` → connection)."""
        assert self._engines, "GitLabDatabase used outside a run"
        return self._engines[database_of(table)]

    @property
    def schema(self) -> GitLabSchema:
        """GitLab's tables as the ci database has them (:func:`~ci_cleanup.gitlab.schema.detect_tables`)."""
        assert self._tables is not None, "GitLabDatabase used outside a run"
        return self._tables

    def require(self, tables: list[Table]) -> dict[str, object]:
        """Fail before anything is written unless each of ``tables`` is, in the database it will be used in, as
        the job needs it (:func:`~ci_cleanup.gitlab.schema.require_columns`) and not GitLab's write-locked copy
        of another database's table (a job reading it would find it empty and change nothing). The run's
        metadata: the tables and the database each is used in."""
        by_database: dict[str, list[Table]] = {}
        for table in tables:
            by_database.setdefault(self._database(table), []).append(table)
        for database, own in by_database.items():
            with self.engine_for(own[0]).connect() as conn:
                locked = write_locked(conn, own)
                if locked:
                    raise WrongDatabase(self._locked_message(database, locked))
                require_columns(conn, own)
        return {
            "gitlab_tables": [t.name for t in tables],
            "gitlab_databases": {t.name: self._database(t) for t in tables},
        }

    def _locked_message(self, database: str, locked: list[str]) -> str:
        where = f"the {database} database ({self._where(database)})"
        tables = ", ".join(locked)
        if database == MAIN_DATABASE and not self.decomposed:
            return (f"{tables}: write-locked by GitLab in {where}: this GitLab is decomposed and these rows are in "
                    f"its ci database; set {CI_DATABASE_ENV} to it. Nothing was changed")
        return (f"{tables}: write-locked by GitLab in {where}, which does not hold these rows: point "
                f"{_VARIABLES[database]} at GitLab's {database} database. Nothing was changed")


class RedisRefused(ServiceUnavailable, redis.ResponseError):
    """A Redis server answered but would not write (read-only replica, out of memory): says which, and what to do."""


def _refusal(error: redis.ResponseError) -> str | None:
    """What to do about a write Redis refused; None for any other error. A Lua script's refusal is a plain
    ResponseError carrying ``-READONLY`` / ``-OOM`` in its text."""
    text = str(error)
    if isinstance(error, redis.ReadOnlyError) or "-READONLY " in text:
        return "it is a read-only replica; point the URL at the primary (GitLab writes there too)"
    if isinstance(error, redis.exceptions.OutOfMemoryError) or "-OOM " in text:
        return "it is out of memory (maxmemory reached, no eviction); free memory or raise maxmemory"
    return None


def _named(server: str | None, error: Exception) -> Exception:
    if server is None or isinstance(error, ServiceUnavailable):
        return error
    if isinstance(error, redis.ResponseError):
        advice = _refusal(error)
        return RedisRefused(f"{server} refused a write: {advice} ({error})") if advice else error
    return RedisUnavailable(f"Lost {server}: {error}")


class _NamedPipeline(redis.client.Pipeline):
    server: str | None = None

    def execute(self, raise_on_error: bool = True):
        try:
            return super().execute(raise_on_error)
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as e:
            raise _named(self.server, e) from None


class _NamedRedis(redis.Redis):
    """redis-py says "Error 111 connecting to unix socket: …": name the server (never its password) instead."""

    server: str | None = None  # e.g. "Redis (CI_CLEANUP_REDIS_URL) at unix://…", set once the first PING went through

    def execute_command(self, *args, **options):
        try:
            return super().execute_command(*args, **options)
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as e:
            raise _named(self.server, e) from None

    def pipeline(self, transaction=True, shard_hint=None) -> redis.client.Pipeline:
        pipe = _NamedPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.server = self.server
        return pipe


def _redis_client(url: str, what: str) -> redis.Redis:
    shown = redact_redis_url(url)
    # redis-py's own errors for such a URL quote the piece it choked on, which may be part of the password.
    unparsable = ServiceUnavailable(
        f"{what}: the URL cannot be parsed safely (not shown); percent-encode any '@', ':', '/', '?' or '#' "
        "in its password"
    )
    if shown == UNSHOWN_URL:
        raise unparsable
    where = f"{what} at {shown}"
    try:
        client = _NamedRedis.from_url(url, socket_timeout=10, socket_connect_timeout=5, health_check_interval=30)
    except ValueError:
        raise unparsable from None
    try:
        client.ping()
    except (redis.RedisError, ValueError) as e:
        client.close()
        raise ServiceUnavailable(f"Cannot reach {where}: {e}") from None
    client.server = where
    return client


class GitLabRedis(ConfigurableResource):
    """GitLab's SharedState Redis (leases, buckets) and, optionally, its Sidekiq Redis (job status keys)."""

    url: str = Field(
        default=EnvVar("CI_CLEANUP_REDIS_URL"), description="redis://… or unix://… (GitLab's SharedState)"
    )
    queues_url: str | None = Field(default=None, description="Sidekiq's Redis, if not the same server")

    _shared_state: redis.Redis | None = PrivateAttr(default=None)
    _queues: redis.Redis | None = PrivateAttr(default=None)

    def setup_for_execution(self, context: InitResourceContext) -> None:
        self._shared_state = _redis_client(self.url, "Redis (CI_CLEANUP_REDIS_URL)")
        self._queues = (
            _redis_client(self.queues_url, "Sidekiq's Redis (CI_CLEANUP_REDIS_QUEUES_URL)")
            if self.queues_url
            else self._shared_state
        )

    def teardown_after_execution(self, context: InitResourceContext) -> None:
        for client in {id(c): c for c in (self._shared_state, self._queues) if c is not None}.values():
            client.close()

    @property
    def shared_state(self) -> redis.Redis:
        assert self._shared_state is not None, "GitLabRedis used outside a run"
        return self._shared_state

    @property
    def queues(self) -> redis.Redis:
        assert self._queues is not None, "GitLabRedis used outside a run"
        return self._queues


class RunOptions(ConfigurableResource):
    """Settings that apply to the whole run, set once in the Launchpad or a run config file."""

    dry_run: bool = Field(
        default=False,
        description="Find and report exactly what would change, and write nothing: no rows, leases or buckets",
    )


def job_resources(
    database_url: str, redis_url: str, *, ci_database_url: str | None = None, queues_url: str | None = None,
    dry_run: bool = False,
) -> dict[str, ConfigurableResource]:
    """The resources every job runs with, for a run started in process (CLI, tests, benchmark)."""
    return {
        "gitlab_db": GitLabDatabase(url=database_url, ci_url=ci_database_url),
        "gitlab_redis": GitLabRedis(url=redis_url, queues_url=queues_url),
        "run_options": RunOptions(dry_run=dry_run),
    }
