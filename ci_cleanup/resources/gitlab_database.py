"""GitLab's PostgreSQL databases as one resource: ``main`` and, when GitLab is decomposed, ``ci``."""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace

import psycopg2.errors
from dagster import ConfigurableResource, InitResourceContext
from pydantic import Field, PrivateAttr
from sqlalchemy import Table, create_engine, event, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, OperationalError, SQLAlchemyError

from ..gitlab.config_files import database_urls
from ..gitlab.redis_stores import config_dir_from
from ..gitlab.release import RELEASE_TABLES, Release, detect_release, read_catalog, refuse_unsupported
from ..gitlab.schema import (
    CI_DATABASE,
    MAIN_DATABASE,
    GitLabSchema,
    SchemaMismatch,
    database_of,
    detect_tables,
    require_columns,
    write_locked,
)
from .errors import (
    DatabaseUnavailable,
    NotConfigured,
    ServiceUnavailable,
    StatementTimeout,
    UnusableSetting,
    starting,
    unreachable,
)

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
# Leads every statement of the jobs, as GitLab's Marginalia comments do: pg_stat_activity then shows which sessions
# are a job's (how pacing tells the locks they hold), with no session setting for a pooler to pass on.
JOB_MARK = "/*application:ci_cleanup*/"
_VARIABLES = {MAIN_DATABASE: "CI_CLEANUP_DATABASE_URL", CI_DATABASE: CI_DATABASE_ENV}
_DATABASE_NAMES = {MAIN_DATABASE: "the GitLab database (PostgreSQL)", CI_DATABASE: "GitLab's ci database (PostgreSQL)"}


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
        limit = JOB_MARK + f" SET LOCAL statement_timeout = {int(self.statement_timeout_seconds * 1000)}; "

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
