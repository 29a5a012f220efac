"""The two external systems a batch touches: GitLab's PostgreSQL and GitLab's Redis.

Engines and clients are built in ``setup_for_execution`` (once per step process, never at import)
with small pools, and checked there, so an unreachable server fails the step with a message that
names the server, without its password.
"""

from __future__ import annotations

import os
import re
import threading
import time
import traceback
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace

import psycopg2.errors
import redis
import redis.backoff
import redis.cluster
import redis.retry
import redis.sentinel
from dagster import ConfigurableResource, InitResourceContext
from dagster._core.errors import DagsterUserCodeProcessError
from dagster_shared.error import SerializableErrorInfo
from pydantic import Field, PrivateAttr
from sqlalchemy import Table, create_engine, event, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, OperationalError, SQLAlchemyError

from .gitlab.config_files import database_urls
from .gitlab.loop_helpers import Brake
from .gitlab.redis_stores import (  # noqa: F401  (redact_redis_url, UNSHOWN_URL: this module's API before them)
    DEFAULT,
    UNSHOWN_URL,
    USES,
    StoreConfig,
    StoreNotSet,
    config_dir_from,
    redact_redis_url,
    resolve,
)
from .gitlab.release import RELEASE_TABLES, Release, detect_release, read_catalog, refuse_unsupported
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


class AuthenticationFailed(ServiceUnavailable):
    """The server is up and refused the URL's user or password: the credentials, not the server, are to fix."""


class NotConfigured(ServiceUnavailable):
    """Nothing says where a server is: no variable, no resource field, no GitLab config folder."""


class UnusableSetting(ServiceUnavailable):
    """A variable or one of GitLab's config files says where a server is and cannot be used: the setting, not the
    server, is to fix (the message names the variable, or the file and key)."""


# PostgreSQL's "password authentication failed" (also "SCRAM authentication failed") and 'role "x" does not
# exist' (where no password is asked), libpq's "no password supplied", Redis' WRONGPASS ("invalid
# username-password pair") and NOAUTH ("Authentication required").
_AUTHENTICATION = re.compile(
    r'authentication failed|role "[^"]*" does not exist|no password supplied|invalid username-password'
    r"|authentication required", re.I
)


def unreachable(what: str, reason: str) -> ServiceUnavailable:
    """``Cannot reach <what>: <reason>``; or, when the server refused the credentials, that authentication failed
    (the server answered: telling the operator to check that it is up would send them the wrong way)."""
    reason = " ".join(reason.split())
    if _AUTHENTICATION.search(reason):
        return AuthenticationFailed(f"Authentication failed for {what}: {reason}")
    return ServiceUnavailable(f"Cannot reach {what}: {reason}")


@contextmanager
def starting(context: InitResourceContext, resource: ConfigurableResource | None = None) -> Iterator[bool]:
    """A resource's start: whether to connect, and a start that fails for a reason the operator can fix (no URL
    set, a server down, a bad setting: :class:`ServiceUnavailable`) fails the run in that error's one line.

    Dagster would print the error under its stack traces on the console (``dagster job execute``, ``dg launch``, a
    run worker's output), where they say nothing more: the error goes to Dagster as its message alone, the way
    Dagster passes on an error from another process. A run that has finished is not connected again: ``dagster
    job execute`` and ``dg launch`` open its resources once more to read its outputs.
    """
    if context.run is not None and context.run.is_finished:
        yield False
        return
    try:
        yield True
    except ServiceUnavailable as error:
        if isinstance(error, NotConfigured) and resource is not None:
            error = NotConfigured("; ".join([str(error), *_also_not_configured(context, resource)]))
        info = SerializableErrorInfo("".join(traceback.format_exception_only(error)), [], type(error).__name__)
        raise DagsterUserCodeProcessError(info.message.strip(), user_code_process_error_infos=[info]) from None


def _also_not_configured(context: InitResourceContext, resource: ConfigurableResource) -> list[str]:
    """What the run's other GitLab resources lack too: Dagster starts them one at a time and stops at the first that
    fails, so without this an operator would learn one missing variable per launch."""
    missing = []
    for key, definition in (context.all_resource_defs or {}).items():
        kind = getattr(definition, "configurable_resource_cls", None)
        if kind not in (GitLabDatabase, GitLabRedis) or isinstance(resource, kind):
            continue
        try:
            kind(**_fields_of_run(context, key, definition)).check_configured()
        except NotConfigured as e:
            missing.append(str(e))
        except (ServiceUnavailable, ValueError):
            pass  # set, though not usable: that resource says so itself when it starts
    return missing


def _fields_of_run(context: InitResourceContext, key: str, definition) -> dict:
    """A resource's fields as the run sets them: bound in code, then the run's config, an EnvVar read."""
    field = definition.config_field
    bound = field.default_value if field is not None and field.default_provided else {}
    run_config = context.dagster_run.run_config if context.dagster_run is not None else {}
    fields = {**bound, **(run_config.get("resources", {}).get(key, {}).get("config") or {})}
    return {k: os.environ.get(v["env"]) if isinstance(v, dict) and "env" in v else v for k, v in fields.items()}


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


CI_DATABASE_ENV = "CI_CLEANUP_CI_DATABASE_URL"
_VARIABLES = {MAIN_DATABASE: "CI_CLEANUP_DATABASE_URL", CI_DATABASE: CI_DATABASE_ENV}
_DATABASE_NAMES = {MAIN_DATABASE: "the GitLab database (PostgreSQL)", CI_DATABASE: "GitLab's ci database (PostgreSQL)"}


class StatementTimeout(RuntimeError):
    """A statement ran over ``statement_timeout_seconds``; PostgreSQL cancelled it (its transaction rolled back)."""


class WrongDatabase(SchemaMismatch):
    """A table the job needs is GitLab's write-locked legacy copy in the database it would use."""


class GitLabDatabase(ConfigurableResource):
    """GitLab's databases: ``main`` (``CI_CLEANUP_DATABASE_URL``) and, when GitLab is decomposed, ``ci``
    (``CI_CLEANUP_CI_DATABASE_URL``; unset, the CI tables are in the main database, GitLab's single-database
    setup). Each table is used in the database of its GitLab schema (:func:`engine_for`); no job picks one.

    The URLs are read when a run starts: a field set, else its variable, else GitLab's ``database.yml`` (in
    ``CI_CLEANUP_GITLAB_CONFIG_DIR``); so any other field can be set in the Launchpad without a URL, and no
    password enters run config. Each database gets its own engine.
    """

    url: str | None = Field(
        default=None,
        description="GitLab's main database: SQLAlchemy URL, postgresql+psycopg2://…; unix-socket hosts allowed. "
        "Unset: env CI_CLEANUP_DATABASE_URL, else database.yml in CI_CLEANUP_GITLAB_CONFIG_DIR",
    )
    ci_url: str | None = Field(
        default=None,
        description=f"GitLab's ci database when decomposed; unset: env {CI_DATABASE_ENV}, else database.yml's ci:, "
        "else the main database",
    )
    config_dir: str | None = Field(
        default=None, description="GitLab's config folder (database.yml); unset: env CI_CLEANUP_GITLAB_CONFIG_DIR",
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
        description="Builds table, its name as it is (schema.name for one in another schema); unset: p_ci_builds "
        "if it exists (every partition), else the flat ci_builds",
    )
    job_artifacts_table: str | None = Field(
        default=None,
        description="Job artifacts table; unset: p_ci_job_artifacts if it exists, else the flat ci_job_artifacts",
    )

    _engines: dict[str, Engine] = PrivateAttr(default_factory=dict)
    _tables: GitLabSchema | None = PrivateAttr(default=None)
    _release: Release | None = PrivateAttr(default=None)
    _resolved: dict[str, str] | None = PrivateAttr(default=None)

    def setup_for_execution(self, context: InitResourceContext) -> None:
        with starting(context, self) as connect:
            if connect:
                self._connect(context)

    def check_configured(self) -> None:
        """Raise :class:`NotConfigured` when nothing says where the main database is, without connecting."""
        self._read_urls()

    def _connect(self, context: InitResourceContext) -> None:
        self._resolved = self._read_urls()
        try:
            for database in self._urls:
                self._engines[database] = self._create_engine(database, self.pool_size)
                with self._engines[database].connect() as conn:
                    conn.scalar(text("SELECT 1"))
        except (SQLAlchemyError, DatabaseUnavailable) as e:
            self.teardown_after_execution(context)
            raise unreachable(f"{_DATABASE_NAMES[database]} at {self._where(database)}", str(getattr(e, "orig", e))
                              ) from None
        self._engines.setdefault(CI_DATABASE, self._engines[MAIN_DATABASE])
        with self._engines[CI_DATABASE].connect() as conn:
            self._tables = detect_tables(conn, self.builds_table, self.job_artifacts_table)

    @property
    def _urls(self) -> dict[str, str]:
        return self._resolved if self._resolved is not None else self._read_urls()

    def _read_urls(self) -> dict[str, str]:
        """Each database's URL: the field, else its variable, else GitLab's database.yml (variables override it)."""
        main = self.url or os.environ.get(_VARIABLES[MAIN_DATABASE])
        ci = self.ci_url or os.environ.get(CI_DATABASE_ENV)
        config_dir = self.config_dir or config_dir_from(os.environ)
        if config_dir and not (main and ci):
            try:
                from_files = database_urls(config_dir)
            except ValueError as e:  # ConfigFileError: one line naming the file and key, as a bad variable is
                raise UnusableSetting(str(e)) from None
            main, ci = main or from_files[0], ci or from_files[1]
        if not main:
            raise NotConfigured(
                "No GitLab database: set CI_CLEANUP_DATABASE_URL (and CI_CLEANUP_CI_DATABASE_URL when GitLab is "
                "decomposed), or CI_CLEANUP_GITLAB_CONFIG_DIR to GitLab's config folder (database.yml)"
            )
        urls = {MAIN_DATABASE: main, **({CI_DATABASE: ci} if ci else {})}
        for database, url in urls.items():
            try:  # a URL that cannot be used is the resource's one-line failure, as any other bad setting
                database_url(url, _VARIABLES[database])
            except ValueError as e:
                raise ServiceUnavailable(str(e)) from None
        return urls

    def targets(self) -> dict[str, str]:
        """Each database a run will use and where it is, password hidden, read as a run reads them (no connection)."""
        return {database: self._where(database) for database in self._urls}

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
            # Not before a savepoint's rollback or release: in a failed transaction the SET itself would fail.
            if statement.startswith(("ROLLBACK", "RELEASE", "SAVEPOINT")):
                return statement, parameters
            return limit + statement, parameters

        where = f"{_DATABASE_NAMES[database]} at {self._where(database)}"

        @event.listens_for(engine, "handle_error")
        def _name_the_server(ctx):
            # psycopg2 says "server closed the connection unexpectedly" or "connection to server on socket
            # … failed" without naming which server: say it is GitLab's PostgreSQL. A lost connection,
            # or one that cannot be opened (no statement yet), fails the run; never a pre-ping, which
            # must stay a plain disconnect so the pool reconnects after a restart.
            if isinstance(ctx.original_exception, psycopg2.errors.QueryCanceled):
                statement = " ".join((ctx.statement or "").removeprefix(limit).split())
                error = StatementTimeout(
                    f"A statement ran over the statement timeout ({self.statement_timeout_seconds} s) in {where} "
                    f"and was cancelled: {statement[:300]}"
                )
                error.orig = ctx.original_exception
                return error
            never_opened = ctx.connection is None and isinstance(ctx.sqlalchemy_exception, OperationalError)
            lost = ctx.is_disconnect or never_opened
            if lost and not ctx.is_pre_ping:
                error = DatabaseUnavailable(
                    f"Lost {where}: {str(ctx.original_exception).strip()}"
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
        if not self._tables.absent and self.release.absent:
            self._tables = replace(self._tables, absent=self.release.absent)
        return self._tables

    @property
    def release(self) -> Release:
        """The GitLab release's features, read from the catalog once a run (each table's in its own database)."""
        if self._release is None:
            by_database: dict[str, list[str]] = {}
            for field in RELEASE_TABLES:
                by_database.setdefault(self._database(getattr(self._tables, field)), []).append(field)
            facts = []
            for fields in by_database.values():
                with self.engine_for(getattr(self._tables, fields[0])).connect() as conn:
                    facts.append(read_catalog(conn, self._tables, fields))
            self._release = detect_release(facts)
        return self._release

    def require(self, tables: list[Table] | Mapping[str, Collection[str]]) -> dict[str, object]:
        """Fail before anything is read unless this GitLab is a release supported (:mod:`~ci_cleanup.gitlab.release`)
        and each of ``tables`` is, in the database it will be used in, as the job needs it
        (:func:`~ci_cleanup.gitlab.schema.require_columns`) and not GitLab's write-locked copy of another database's
        table (a job reading it would find it empty and change nothing).

        ``tables``: the tables, each checked whole, or the job's ``USES``: per table (GitLabSchema's name) the
        columns it reads or writes, the only ones checked. The run's metadata: the tables, the database each is used
        in, and the release's layout and features (:meth:`~ci_cleanup.gitlab.release.Release.metadata`)."""
        uses = None
        if isinstance(tables, Mapping):
            uses = {getattr(self.schema, field).name: columns for field, columns in tables.items()}
            tables = [getattr(self.schema, field) for field in tables]
        refuse_unsupported(self.release, self.schema)
        by_database: dict[str, list[Table]] = {}
        for table in tables:
            by_database.setdefault(self._database(table), []).append(table)
        for database, own in by_database.items():
            with self.engine_for(own[0]).connect() as conn:
                locked = write_locked(conn, own)
                if locked:
                    raise WrongDatabase(self._locked_message(database, locked))
                require_columns(conn, own, uses)
        return {
            "gitlab_tables": [t.fullname for t in tables],
            "gitlab_databases": {t.fullname: self._database(t) for t in tables},
            **self.release.metadata(),
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
    if isinstance(error, redis.ResponseError) and not isinstance(error, redis.exceptions.ClusterError):
        advice = _refusal(error)
        return RedisRefused(f"{server} refused a write: {advice} ({error})") if advice else error
    return RedisUnavailable(f"Lost {server}: {_reason(error)}")


def _reason(error: Exception) -> str:
    """redis-py's text, but a Sentinel's "No master found" without the repr of every sentinel's client."""
    text = str(error)
    if isinstance(error, redis.sentinel.MasterNotFoundError) and " : " in text:
        kinds = re.findall(r" - \w+:(\w+)", text)
        return text.split(" : ", 1)[0] + (f" (the sentinels answered: {', '.join(kinds)})" if kinds else "")
    return text


# What a client names in its errors: a connection lost, a server that refused, a cluster that cannot answer.
_NAMED_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.ResponseError, redis.exceptions.ClusterError,
                 redis.exceptions.RedisClusterException)


def _naming(server: str | None, call, *args, **kwargs):
    """``call``'s result; its Redis error named after ``server`` (:func:`_named`). redis-py says "Error 111
    connecting to unix socket: …": the server, never its password, is named instead."""
    try:
        return call(*args, **kwargs)
    except _NAMED_ERRORS as e:
        raise _named(server, e) from None


class _NamedPipeline(redis.client.Pipeline):
    server: str | None = None

    def execute(self, raise_on_error: bool = True):
        return _naming(self.server, super().execute, raise_on_error)


class _NamedRedis(redis.Redis):
    """A Redis client whose errors name the server (:func:`_naming`)."""

    server: str | None = None  # e.g. "Redis (CI_CLEANUP_REDIS_URL) at unix://…", set once the first PING went through
    sentinel: redis.sentinel.Sentinel | None = None  # a Sentinel set's: its connections to the sentinels

    def execute_command(self, *args, **options):
        return _naming(self.server, super().execute_command, *args, **options)

    def pipeline(self, transaction=True, shard_hint=None) -> redis.client.Pipeline:
        pipe = _NamedPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.server = self.server
        return pipe


class _NamedClusterPipeline(redis.cluster.ClusterPipeline):
    server: str | None = None

    def execute(self, raise_on_error: bool = True):
        return _naming(self.server, super().execute, raise_on_error)


class _NamedRedisCluster(redis.cluster.RedisCluster):
    """A Redis Cluster (GitLab.com's ClusterSharedState): commands go to the slot's master, MOVED and ASK
    redirections are followed by redis-py; errors name the cluster as :class:`_NamedRedis` names a server."""

    server: str | None = None

    def execute_command(self, *args, **kwargs):
        return _naming(self.server, super().execute_command, *args, **kwargs)

    def pipeline(self, transaction=None, shard_hint=None):
        pipe = super().pipeline(transaction=transaction, shard_hint=shard_hint)
        pipe.__class__ = _NamedClusterPipeline
        pipe.server = self.server
        return pipe


# A Sentinel set's client waits this long for a failover (Sentinel's down-after-milliseconds, then the election
# and promotion: 10-20 s on Omnibus' defaults) before a command fails naming the store: the work carries on
# against the promoted replica.
FAILOVER_SECONDS = 35.0
_TIMEOUTS = dict(socket_timeout=10, socket_connect_timeout=5)


class _FailoverRetry(redis.retry.Retry):
    """Connection errors tried again for ``seconds`` (0.1 s doubling up to 1 s apart), once per command.

    redis-py calls the same retry for the command and, inside it, for the (re)connection that asks the sentinels
    where the primary is: the inner call tries once, so the waits do not multiply. A refused password is never
    tried again.
    """

    def __init__(self, seconds: float):
        super().__init__(redis.backoff.ExponentialBackoff(cap=1.0, base=0.1), -1)
        self.seconds, self._active = seconds, threading.local()

    def __deepcopy__(self, memo):
        return _FailoverRetry(self.seconds)

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        if getattr(self._active, "on", False):
            return do()
        self._active.on, failures, deadline = True, 0, time.monotonic() + self.seconds
        try:
            while True:
                try:
                    return do()
                except self._supported_errors as error:
                    if isinstance(error, redis.AuthenticationError) or (is_retryable and not is_retryable(error)):
                        raise
                    failures += 1
                    fail(error, failures) if with_failure_count else fail(error)
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(self._backoff.compute(failures))
        finally:
            self._active.on = False


def _unparsable(what: str) -> ServiceUnavailable:
    # redis-py's own errors for such a URL quote the piece it choked on, which may be part of the password.
    return ServiceUnavailable(
        f"{what}: the URL cannot be parsed safely (not shown); percent-encode any '@', ':', '/', '?' or '#' "
        "in its password"
    )


def _connect(config: StoreConfig, failover_seconds: float):
    """A client of the store's shape: one server, the master of a Sentinel set, or a Redis Cluster."""
    if config.shape == "cluster":
        nodes = [redis.cluster.ClusterNode(host, port) for host, port in config.cluster]
        return _NamedRedisCluster(startup_nodes=nodes, username=config.username, password=config.password,
                                  ssl=config.ssl, **_TIMEOUTS)
    if config.shape == "sentinel":
        sentinel = redis.sentinel.Sentinel(
            config.sentinels,
            sentinel_kwargs=dict(username=config.sentinel_username, password=config.sentinel_password, **_TIMEOUTS,
                                 retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0)),  # the failover retry's job
        )
        retry = _FailoverRetry(failover_seconds)
        client = sentinel.master_for(
            config.master_name, redis_class=_NamedRedis, username=config.username, password=config.password,
            db=config.db, ssl=config.ssl, retry=retry, health_check_interval=30, **_TIMEOUTS,
        )
        client.sentinel = sentinel
        return client
    return _NamedRedis.from_url(config.url, health_check_interval=30, **_TIMEOUTS)


def store_client(config: StoreConfig, failover_seconds: float = FAILOVER_SECONDS):
    """The store's client, checked with a PING; errors name the store and where it is, never a password.

    A Sentinel set's client waits up to ``failover_seconds`` for a primary (:class:`_FailoverRetry`).
    """
    if config.shape == "url" and config.shown() == UNSHOWN_URL:
        raise _unparsable(config.label)
    try:
        client = _connect(config, failover_seconds)
    except ValueError:
        raise _unparsable(config.label) from None
    except (redis.RedisError, redis.exceptions.RedisClusterException) as e:  # a cluster asks its nodes at once
        raise unreachable(config.where, _reason(e)) from None
    try:
        client.ping()
    except (redis.RedisError, redis.exceptions.RedisClusterException, ValueError) as e:
        close_client(client)
        raise unreachable(config.where, _reason(e)) from None
    client.server = config.where
    return client


def close_client(client) -> None:
    client.close()
    for sentinel in getattr(getattr(client, "sentinel", None), "sentinels", ()):
        sentinel.close()


def _redis_client(url: str, what: str) -> redis.Redis:
    """A client of one Redis URL, named ``what`` in its errors (the CLI's seed and start-up checks)."""
    return store_client(StoreConfig(store=DEFAULT, source=what, url=url, named=what))


class GitLabRedis(ConfigurableResource):
    """GitLab's Redis stores, each use on the store GitLab keeps it in, falling back as GitLab's stores do:
    leases in cluster_shared_state → shared_state → default, artifact buckets in shared_state → default, Sidekiq
    statuses in queues_metadata → queues → default (the default store is GitLab's ``resque.yml``).

    Each store is read from its variables (``CI_CLEANUP_REDIS_<STORE>_URL`` …), else from GitLab's files in
    ``config_dir`` (``CI_CLEANUP_GITLAB_CONFIG_DIR``); see :mod:`ci_cleanup.gitlab.redis_stores`. Variables are
    read when a run starts, never copied into run config. Stores that are one server share one client.
    """

    url: str | None = Field(
        default=None,
        description="The default store (GitLab's resque.yml), redis://… or unix://…; unset: env CI_CLEANUP_REDIS_URL, "
        "else the config folder's files",
    )
    queues_url: str | None = Field(
        default=None, description="GitLab's queues store (Sidekiq's Redis); unset: env CI_CLEANUP_REDIS_QUEUES_URL, "
        "else the config folder's files, else the default store",
    )
    config_dir: str | None = Field(
        default=None, description="GitLab's config folder (resque.yml, redis.yml, redis.<store>.yml); unset: env "
        "CI_CLEANUP_GITLAB_CONFIG_DIR",
    )

    _configs: dict[str, StoreConfig] = PrivateAttr(default_factory=dict)
    _clients: dict[str, object] = PrivateAttr(default_factory=dict)
    _held: dict[str, object] = PrivateAttr(default_factory=dict)  # key -> the ExclusiveLease the run holds

    def setup_for_execution(self, context: InitResourceContext) -> None:
        with starting(context, self) as connect:
            if connect:
                self._connect()

    def check_configured(self) -> None:
        """Raise :class:`NotConfigured` when a store's whereabouts are set nowhere, without connecting."""
        self.store_configs()

    def _connect(self) -> None:
        self._configs = self.store_configs()
        shared: dict[tuple, object] = {}
        try:
            for use, config in self._configs.items():
                if config.identity not in shared:
                    shared[config.identity] = store_client(config)
                self._clients[use] = shared[config.identity]
        except BaseException:
            for client in shared.values():
                close_client(client)
            raise

    def store_configs(self) -> dict[str, StoreConfig]:
        """Each use's store settings (``USES``), resolved as a run would, without connecting."""
        env = os.environ
        overrides = {DEFAULT: self.url, "queues": self.queues_url}
        config_dir = self.config_dir or config_dir_from(env)
        try:
            return {use: resolve(store, env, config_dir, overrides) for use, store in USES.items()}
        except StoreNotSet as e:
            raise NotConfigured(str(e)) from None
        except ValueError as e:  # ConfigFileError: one line naming the variable or the file and key
            raise UnusableSetting(str(e)) from None

    def hold_until_teardown(self, lease) -> None:
        """A lease the run took (an ``ExclusiveLease`` of its uuid): given back when the run's resources close
        unless the run gave it back itself (:meth:`given_back`), e.g. after a failed step, instead of held for its
        TTL. Every job runs its steps in the run's one process, whose resources close once, after the last step."""
        self._held[lease.redis_key] = lease

    def given_back(self, lease) -> None:
        self._held.pop(lease.redis_key, None)

    def teardown_after_execution(self, context: InitResourceContext) -> None:
        for key, lease in self._held.items():
            try:
                if lease.cancel():  # compare-and-delete: never a lease another process took since
                    context.log.info(f"Released lease {key}: the run ended without giving it back (a step failed)")
            except redis.RedisError as e:
                context.log.warning(f"Could not release lease {key} (it expires with its TTL): {e}")
        self._held = {}
        for client in {id(c): c for c in self._clients.values()}.values():
            close_client(client)

    def _client(self, use: str):
        assert use in self._clients, "GitLabRedis used outside a run"
        return self._clients[use]

    @property
    def leases(self) -> redis.Redis:
        """``Gitlab::ExclusiveLease``'s store: cluster_shared_state, falling back to shared_state, then default."""
        return self._client("leases")

    @property
    def artifact_buckets(self) -> redis.Redis:
        """The artifact buckets' store: shared_state, falling back to default."""
        return self._client("artifact_buckets")

    @property
    def sidekiq_status(self) -> redis.Redis:
        """``Gitlab::SidekiqStatus``' store: queues_metadata, falling back to queues, then default."""
        return self._client("sidekiq_status")

    def store_used(self, use: str) -> dict[str, str]:
        """For a run's metadata: ``{"redis_<use>": "<store> (<source>) at <where, no password>"}``."""
        config = self._configs[use]
        return {f"redis_{use}": f"{config.store}: {config.label} at {config.shown()}"}


DUTY_CYCLE_ENV = "CI_CLEANUP_DUTY_CYCLE"


class RunOptions(ConfigurableResource):
    """Settings that apply to the whole run, set once in the Launchpad or a run config file."""

    dry_run: bool = Field(
        default=False,
        description="Find and report exactly what would change, and write nothing: no rows, leases or buckets",
    )
    duty_cycle: float | None = Field(
        default=None, gt=0, le=1,
        description="The brake: the share of the run's time spent in batches. After each batch the run pauses for "
                    "the batch's time × (1 − duty_cycle) / duty_cycle, leaving the database to GitLab's own "
                    f"traffic. Unset: env {DUTY_CYCLE_ENV}, else 1 (no pause). docs/configuration.md, \"The brake\"",
    )

    def brake(self) -> Brake:
        """A new brake for one run: ``duty_cycle``, else the environment's (the schedules' runs), else none."""
        if self.duty_cycle is not None:
            return Brake(self.duty_cycle)
        raw = os.environ.get(DUTY_CYCLE_ENV, "").strip()
        try:
            return Brake(float(raw) if raw else 1.0)
        except ValueError:
            raise ValueError(f"{DUTY_CYCLE_ENV} must be a number above 0 and at most 1, not {raw!r}") from None


def job_resources(
    database_url: str | None, redis_url: str | None, *, ci_database_url: str | None = None,
    queues_url: str | None = None, dry_run: bool = False,
) -> dict[str, ConfigurableResource]:
    """The resources every job runs with, for a run started in process (CLI, tests, benchmark); a URL not given
    is read from its variable or GitLab's config files when the run starts."""
    return {
        "gitlab_db": GitLabDatabase(url=database_url, ci_url=ci_database_url),
        "gitlab_redis": GitLabRedis(url=redis_url, queues_url=queues_url),
        "run_options": RunOptions(dry_run=dry_run),
    }
