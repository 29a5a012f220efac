"""The production Dagster instance's storage (deploy/dagster.yaml): dagster-postgres, its URL read here.

Dagster resolves ``postgres_url: {env: …}`` itself and, when the variable is unset or its URL names a driver that is
not installed, every command (webserver, daemon, code server, ``dagster job list``) stops in a traceback of some
70 lines. Read here, the same mistakes stop the command in one line naming the variable and what to set.
"""

from __future__ import annotations

import os

from dagster import Field
from dagster_postgres import DagsterPostgresStorage
from dagster_postgres.utils import DagsterPostgresException
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool

from .resources import AuthenticationFailed, database_url, unreachable

PG_URL_ENV = "CI_CLEANUP_DAGSTER_PG_URL"
EXAMPLE_URL = "postgresql+psycopg2://user:password@host:5432/dagster"


class InstanceConfigError(SystemExit):
    """The instance cannot load: its one line goes to stderr and the command exits 1, with no traceback (a
    SystemExit is what every Dagster command, click and the run worker let through as it is)."""

    def __init__(self, message: str):
        super().__init__(f"ci_cleanup: the Dagster instance (DAGSTER_HOME's dagster.yaml) cannot load: {message}")


def instance_url(variable: str = PG_URL_ENV) -> str:
    """The instance's PostgreSQL URL from ``variable``, with psycopg2 (a bare ``postgresql://`` means it, as for the
    GitLab URL: SQLAlchemy 2.1 would look for psycopg 3, which is not installed). No error shows the URL."""
    url = os.environ.get(variable)
    if not url:
        raise InstanceConfigError(f"{variable} is not set: set {variable}={EXAMPLE_URL}")
    try:
        return database_url(url, variable).render_as_string(hide_password=False)
    except ValueError as e:
        raise InstanceConfigError(f"{e}: set {variable}={EXAMPLE_URL}") from None


def refuse_wrong_login(url: str, variable: str) -> None:
    """One try before dagster-postgres' own: a server that refuses the user or password answers at once, and
    retrying it (six warnings over a minute) then telling to check that it is up would send the operator the wrong
    way. Any other failure is left to dagster-postgres' retries (a server still starting)."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect():
            pass
    except OperationalError as e:
        error = unreachable(f"the Dagster instance's PostgreSQL at {shown_url(url)} ({variable})", str(e.orig))
        if isinstance(error, AuthenticationFailed):
            raise InstanceConfigError(f"{error}: check the user and password in {variable}") from None
    finally:
        engine.dispose()


def shown_url(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


class PostgresStorage(DagsterPostgresStorage):
    """dagster-postgres' run, event-log and schedule storage; ``postgres_url_env`` names the variable holding the
    URL, so that the password stays in the environment and never in the instance's config or the UI."""

    @classmethod
    def config_type(cls):
        return {
            "postgres_url_env": Field(str, is_required=False, default_value=PG_URL_ENV),
            "should_autocreate_tables": Field(bool, is_required=False, default_value=True),
        }

    @classmethod
    def from_config_value(cls, inst_data, config_value):
        variable = config_value["postgres_url_env"]
        url = instance_url(variable)
        refuse_wrong_login(url, variable)
        try:
            return cls(postgres_url=url, should_autocreate_tables=config_value["should_autocreate_tables"],
                       inst_data=inst_data)
        except DagsterPostgresException:  # dagster-postgres has retried the connection for a while
            raise InstanceConfigError(
                f"cannot connect to {shown_url(url)} ({variable}): check that the server is up and the URL is right"
            ) from None
