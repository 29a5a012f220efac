"""GitLab's tables the batches touch (declared in :mod:`.tables`) as one database has them, and what a job checks
of them at start.

``timestamp`` (without time zone) columns hold UTC: every cut-off compared with them is a naive UTC
``datetime`` passed as a parameter, never ``now()``, so the session's ``TimeZone`` cannot shift a result.

Builds and job artifacts live in the partitioned ``p_ci_builds`` / ``p_ci_job_artifacts`` (GitLab >= 16;
``ci_builds`` is the partition for 100, newer ones are ``gitlab_partitions_dynamic.ci_builds_101``, …),
or in the plain ``ci_builds`` / ``ci_job_artifacts`` of GitLab before partitioning: :func:`detect_tables`
finds which, and a query on the parent reaches every partition.

The jobs never create anything (``ci_cleanup_dev.ddl.create_schema`` is for the dev stack, the benchmark and the
tests): :func:`require_columns` is what a job calls at start against a database it is pointed at.
"""

from __future__ import annotations

import datetime as dt
import functools
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields

from sqlalchemy import (
    ARRAY,
    Boolean,
    DateTime,
    Integer,
    LargeBinary,
    MetaData,
    Numeric,
    String,
    Table,
    text,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql.base import ischema_names
from sqlalchemy.engine import Connection
from sqlalchemy.types import NullType

# GitLab's tables and the values of their columns, declared in .tables: this module's API before them.
from .tables import (  # noqa: F401
    ARTIFACT_LOCK_UNKNOWN,
    ARTIFACT_LOCKED,
    ARTIFACT_TRACE,
    ARTIFACT_UNLOCKED,
    AUTO_STOP_ALWAYS,
    AUTO_STOP_WITH_ACTION,
    DATA_INTEGRITY_FAILURE,
    DEPLOYMENT_SUCCESS,
    EXPORT_FAILED,
    EXPORT_FINISHED,
    EXPORT_QUEUED,
    EXPORT_STARTED,
    FILE_STORE_LOCAL,
    FILE_STORE_REMOTE,
    GITLAB_CI,
    GITLAB_MAIN,
    NO_UPDATES_CANCELING,
    STUCK_OR_TIMEOUT_FAILURE,
    TIMESTAMP,
    TIMESTAMPTZ,
    ci_builds,
    ci_deleted_objects,
    ci_job_artifacts,
    ci_pending_builds,
    ci_runner_machines,
    ci_running_builds,
    deployments,
    environments,
    feature_gates,
    features,
    metadata,
    namespaces,
    p_ci_build_tags,
    project_ci_cd_settings,
    project_export_jobs,
    project_features,
    project_relation_exports,
    projects,
    taggings,
)

# A dialect that writes names as they are: one with psycopg2's paramstyle (pyformat) doubles each % in a name, which
# is right inside SQL text and wrong in a value (to_regclass('"ci%%builds"') finds no ci%builds).
_POSTGRESQL = postgresql.dialect(paramstyle="named")


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def naive_utc(moment: dt.datetime) -> dt.datetime:
    """The value to compare with or write to a ``timestamp without time zone`` column (UTC by GitLab's rule)."""
    return moment.astimezone(dt.UTC).replace(tzinfo=None)


# The databases of GitLab's database.yml; a table's gitlab_schema (.tables) says which holds its rows.
MAIN_DATABASE, CI_DATABASE = "main", "ci"


def database_of(table: Table) -> str:
    """``ci`` or ``main``: the database of GitLab's ``database.yml`` that holds ``table``'s rows."""
    return CI_DATABASE if table.info["gitlab_schema"] == GITLAB_CI else MAIN_DATABASE


class SchemaMismatch(RuntimeError):
    """The database lacks a table or column a batch needs (we never create them there)."""


@dataclass(frozen=True)
class GitLabSchema:
    """The tables as one database has them: builds and artifacts under its names, every other table as declared."""

    metadata: MetaData
    ci_builds: Table
    ci_pending_builds: Table
    ci_running_builds: Table
    ci_runner_machines: Table
    project_export_jobs: Table
    project_relation_exports: Table
    environments: Table
    deployments: Table
    ci_job_artifacts: Table
    ci_deleted_objects: Table
    features: Table
    feature_gates: Table
    projects: Table
    namespaces: Table
    project_features: Table
    project_ci_cd_settings: Table
    p_ci_build_tags: Table
    taggings: Table
    # ``table.column`` (as the .sql files name them) of the columns only some releases have that this one lacks
    absent: frozenset[str] = frozenset()


@functools.cache
def gitlab_schema(builds_table: str = ci_builds.name, job_artifacts_table: str = ci_job_artifacts.name) -> GitLabSchema:
    """The tables, with builds and artifacts under the names given (:func:`detect_tables` finds them): a name as
    it is (no quoting), ``schema.name`` for one in another schema.

    Other names than the declared ones get a copy of every table in a MetaData of their own, so that
    ``metadata.sorted_tables`` is exactly the database's tables.
    """
    names = {ci_builds.name: builds_table, ci_job_artifacts.name: job_artifacts_table}
    md = metadata
    if any(declared != name for declared, name in names.items()):
        md = MetaData()
        for table in metadata.sorted_tables:
            # A dot names the table's schema (gitlab_partitions_dynamic.ci_builds_101): a Table in that schema.
            schema, _, name = names.get(table.name, table.name).rpartition(".")
            table.to_metadata(md, schema=schema or None, name=name)
    return GitLabSchema(
        metadata=md,
        ci_builds=md.tables[builds_table],
        ci_job_artifacts=md.tables[job_artifacts_table],
        **{name: md.tables[name] for name in metadata.tables if name not in names},
    )


def declared_tables(schema: GitLabSchema) -> dict[str, Table]:
    """Each table under the name GitLab ships it with today (``p_ci_builds``, ``ci_pending_builds``, …), as this
    database has it: what a batch's ``.sql`` file names (:mod:`~ci_cleanup.gitlab.sql_files`)."""
    renamed = {"ci_builds": ci_builds.name, "ci_job_artifacts": ci_job_artifacts.name}
    return {renamed.get(f.name, f.name): getattr(schema, f.name) for f in fields(schema)
            if f.name not in ("metadata", "absent")}


# Builds and artifacts partitioned (GitLab >= 16) or flat (before): :mod:`~ci_cleanup.gitlab.release` names them.
PARTITIONED, FLAT = "partitioned", "flat"
# A build's tags: one of these per release (p_ci_build_tags from GitLab 17.3, taggings before).
BUILD_TAG_TABLES = ("p_ci_build_tags", "taggings")


def write_locked(conn: Connection, tables: list[Table]) -> list[str]:
    """Which of ``tables`` carry GitLab's lock-writes trigger here: GitLab's empty legacy copies of another
    database's tables (GitLab's own ``table_write_locked?`` query, by the name the jobs use)."""
    return list(conn.scalars(
        text("SELECT DISTINCT c.relname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
             "JOIN pg_proc p ON p.oid = t.tgfoid WHERE p.proname = 'gitlab_schema_prevent_write' "
             "AND t.tgrelid = ANY(SELECT to_regclass(n) FROM unnest(CAST(:names AS text[])) n) ORDER BY 1"),
        {"names": [regclass(t) for t in tables]},
    ))


def detect_tables(
    conn: Connection, builds_table: str | None = None, job_artifacts_table: str | None = None
) -> GitLabSchema:
    """The schema with GitLab's builds and artifacts tables as this database has them.

    ``p_ci_builds`` / ``p_ci_job_artifacts`` when they exist (every partition is reached through them),
    else the flat ``ci_builds`` / ``ci_job_artifacts`` of GitLab before partitioning; a name given wins.
    """
    def first_present(*names: str) -> str:
        found = conn.scalar(
            text("SELECT name FROM unnest(CAST(:names AS text[])) WITH ORDINALITY AS n(name, i) "
                 "WHERE to_regclass(name) IS NOT NULL ORDER BY i LIMIT 1"),
            {"names": list(names)},
        )
        return found or names[0]

    return gitlab_schema(
        builds_table or first_present("p_ci_builds", "ci_builds"),
        job_artifacts_table or first_present("p_ci_job_artifacts", "ci_job_artifacts"),
    )


# Type families a column found must share with its declaration: int, bigint and smallint are one
# family (GitLab widens ids over time), varchar and text another; a timestamp must also agree on time zone.
_TYPE_FAMILIES = (Boolean, Integer, String, DateTime, Numeric, LargeBinary)

# Every column of each table named, as PostgreSQL spells its type; a table that is not there, one row of NULLs.
# One query from the catalog: SQLAlchemy's reflection takes seven, and compiling them costs a new process
# (every launched run) more than the check itself.
_COLUMNS = text(
    "SELECT n.name, a.attname, format_type(a.atttypid, a.atttypmod) "
    "FROM unnest(CAST(:names AS text[])) AS n(name) "
    "LEFT JOIN pg_attribute a ON a.attrelid = to_regclass(n.name) AND a.attnum > 0 AND NOT a.attisdropped"
)


def _family(column_type) -> tuple:
    if isinstance(column_type, ARRAY):  # an array of the item's family (traversal_ids: integer[] then bigint[])
        return (ARRAY, *_family(column_type.item_type))
    family = next((f for f in _TYPE_FAMILIES if isinstance(column_type, f)), type(column_type))
    return (family, bool(getattr(column_type, "timezone", False))) if family is DateTime else (family,)


def _found_family(pg_type: str) -> tuple:
    """:func:`_family` of a type as ``format_type`` spells it (``character varying(100)``, ``bigint[]``): an array
    is its items' family as an array, a domain or an enum a family of its own, equal to none of the declared ones."""
    base = re.sub(r"\(.*?\)", "", pg_type)
    if base.endswith("[]"):
        return (ARRAY, *_found_family(base[:-2]))
    found = ischema_names.get(base, NullType)
    family = next((f for f in _TYPE_FAMILIES if issubclass(found, f)), found)
    return (family, "with time zone" in base) if family is DateTime else (family,)


def regclass(table: Table) -> str:
    """``table``'s name as ``to_regclass`` reads it: quoted where PostgreSQL needs it, with its schema if any."""
    return _POSTGRESQL.identifier_preparer.format_table(table)


class WherePresent(str):
    """A column a job uses only where the release has it (:func:`where_present`): not required, its type still
    checked where it is there."""


def where_present(column: str) -> WherePresent:
    return WherePresent(column)


def require_columns(
    conn: Connection, tables: list[Table], uses: Mapping[str, Collection[str]] | None = None
) -> list[str]:
    """Fail, naming every missing table and column and every column of an incompatible type, unless the
    database has what ``tables`` use; the names of the tables checked, for the run's metadata.

    ``uses``: per table name, the columns the job reads or writes (:func:`where_present` ones only where there);
    a table not in it is checked whole. A column the database lacks and no job uses is not GitLab's mistake."""
    present: dict[str, dict[str, str]] = {regclass(table): {} for table in tables}
    for name, column, pg_type in conn.execute(_COLUMNS, {"names": list(present)}):
        if column is not None:
            present[name][column] = pg_type
    problems = []
    for table in tables:
        if not present[regclass(table)]:
            problems.append(f"table {table.fullname} is missing")
            continue
        used = (uses or {}).get(table.name)
        for name in table.columns.keys() if used is None else used:
            column, found = table.c[name], present[regclass(table)].get(name)
            if found is None:
                if not isinstance(name, WherePresent):
                    problems.append(f"column {table.fullname}.{column.name} is missing")
            elif _found_family(found) != _family(column.type):
                expected = column.type.compile(dialect=conn.dialect)
                problems.append(f"column {table.fullname}.{column.name} is {found.upper()}, expected {expected}")
    if problems:
        raise SchemaMismatch(
            "The database does not have what this job needs (ci_cleanup never creates or alters tables in it): "
            + ", ".join(problems)
        )
    return [table.fullname for table in tables]


def missing_unique_index(conn: Connection, table: Table, column: str, gitlab_name: str) -> str | None:
    """None when ``table (column)`` is unique as GitLab's index ``gitlab_name`` makes it (a valid, whole, unique
    index on that column alone, which ``ON CONFLICT (column)`` needs; unique constraints and primary keys have
    one), else what is missing, to be named. An index a failed ``CREATE INDEX CONCURRENTLY`` left invalid does not
    count: PostgreSQL does not use it."""
    unique = conn.scalar(
        text("SELECT EXISTS (SELECT FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid "
             "AND a.attnum = i.indkey[0] WHERE i.indrelid = to_regclass(:table) AND a.attname = :column "
             "AND i.indisunique AND i.indisvalid AND i.indnkeyatts = 1 AND i.indpred IS NULL AND i.indexprs IS NULL)"),
        {"table": table.name, "column": column},
    )
    return None if unique else f"{gitlab_name} (UNIQUE, {table.name}.{column})"
