"""The part of GitLab's ``db/structure.sql`` the batches touch, as SQLAlchemy Core tables.

Names, types and defaults follow GitLab. ``timestamp`` (without time zone) columns hold UTC:
every cut-off compared with them is a naive UTC ``datetime`` passed as a parameter, never
``now()``, so the session's ``TimeZone`` cannot shift a result.

In GitLab >= 16 ``ci_builds`` and ``ci_job_artifacts`` are partitions of ``p_ci_builds`` and
``p_ci_job_artifacts``; :func:`gitlab_schema` takes their physical names.

The jobs never create anything: :func:`create_schema` is for the dev stack and the tests, and
:func:`require_columns` is what a job calls at start against a database it is pointed at.
"""

from __future__ import annotations

import datetime as dt
import functools
from dataclasses import dataclass

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Numeric,
    SmallInteger,
    String,
    Table,
    Text,
    func,
    inspect,
    text,
)
from sqlalchemy.engine import Connection, Engine

TIMESTAMP = DateTime(timezone=False)
TIMESTAMPTZ = DateTime(timezone=True)

# ci_builds.failure_reason (GitLab's Enums::Ci::CommitStatus.failure_reasons)
STUCK_OR_TIMEOUT_FAILURE = 3
DATA_INTEGRITY_FAILURE = 12

# project_export_jobs.status
EXPORT_QUEUED, EXPORT_STARTED, EXPORT_FINISHED, EXPORT_FAILED = 0, 1, 2, 3

# deployments.status
DEPLOYMENT_SUCCESS = 2

# environments.auto_stop_setting
AUTO_STOP_ALWAYS, AUTO_STOP_WITH_ACTION = 0, 1

# ci_job_artifacts.file_type / locked / file_store
ARTIFACT_TRACE = 3
ARTIFACT_UNLOCKED, ARTIFACT_LOCKED, ARTIFACT_LOCK_UNKNOWN = 0, 1, 2
FILE_STORE_LOCAL, FILE_STORE_REMOTE = 1, 2


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def naive_utc(moment: dt.datetime) -> dt.datetime:
    """The value to compare with or write to a ``timestamp without time zone`` column (UTC by GitLab's rule)."""
    return moment.astimezone(dt.timezone.utc).replace(tzinfo=None)


class SchemaMismatch(RuntimeError):
    """The database lacks a table or column a batch needs (we never create them there)."""


@dataclass(frozen=True)
class GitLabSchema:
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


@functools.cache
def gitlab_schema(builds_table: str = "ci_builds", job_artifacts_table: str = "ci_job_artifacts") -> GitLabSchema:
    md = MetaData()

    ci_builds = Table(
        builds_table,
        md,
        Column("id", BigInteger, primary_key=True),
        Column("partition_id", BigInteger, nullable=False, server_default=text("100")),
        Column("project_id", BigInteger),
        Column("commit_id", BigInteger),
        Column("name", String),
        Column("type", String),
        Column("status", String),
        Column("failure_reason", Integer),
        Column("runner_id", BigInteger),
        Column("user_id", BigInteger),
        Column("lock_version", Integer, server_default=text("0")),
        Column("created_at", TIMESTAMP),
        Column("updated_at", TIMESTAMP),
        Column("started_at", TIMESTAMP),
        Column("queued_at", TIMESTAMP),
        Column("finished_at", TIMESTAMP),
        Column("scheduled_at", TIMESTAMPTZ),
        Column("when", String),
        Column("allow_failure", Boolean, nullable=False, server_default=text("false")),
    )
    # drop_canceling_builds: the canceling builds in the seed's order, nothing else.
    Index(
        f"index_{builds_table}_on_created_at_project_id_id_when_canceling",
        ci_builds.c.created_at,
        ci_builds.c.project_id,
        ci_builds.c.id,
        postgresql_where=text("status = 'canceling' AND type = 'Ci::Build'"),
    )
    # environments_auto_stop: a deployment's stop actions are its pipeline's builds by name.
    Index(f"index_{builds_table}_on_commit_id_and_name", ci_builds.c.commit_id, ci_builds.c.name)

    ci_pending_builds = Table(
        "ci_pending_builds",
        md,
        Column("id", BigInteger, primary_key=True),
        Column("build_id", BigInteger, nullable=False, unique=True),
        Column("project_id", BigInteger, nullable=False),
        Column("created_at", TIMESTAMPTZ, nullable=False, server_default=func.now()),
        Column("partition_id", BigInteger, nullable=False, server_default=text("100")),
    )
    ci_running_builds = Table(
        "ci_running_builds",
        md,
        Column("id", BigInteger, primary_key=True),
        Column("build_id", BigInteger, nullable=False, unique=True),
        Column("project_id", BigInteger, nullable=False),
        Column("runner_id", BigInteger, nullable=False),
        Column("runner_type", SmallInteger, nullable=False),
        Column("partition_id", BigInteger, nullable=False, server_default=text("100")),
        Column("created_at", TIMESTAMPTZ, nullable=False, server_default=func.now()),
    )

    ci_runner_machines = Table(
        "ci_runner_machines",
        md,
        Column("id", BigInteger, primary_key=True),
        Column("runner_id", BigInteger, nullable=False),
        Column("system_xid", Text, nullable=False),
        Column("runner_type", SmallInteger, nullable=False),
        Column("creation_state", SmallInteger, nullable=False, server_default=text("0")),
        Column("created_at", TIMESTAMPTZ, nullable=False),
        Column("updated_at", TIMESTAMPTZ, nullable=False),
        Column("contacted_at", TIMESTAMPTZ),
    )
    # stale_runner_machines_cleanup: GitLab's two indexes; the stale scope is a BitmapOr of both.
    Index("index_ci_runner_machines_on_contacted_at_desc_and_id_desc", ci_runner_machines.c.contacted_at.desc(), ci_runner_machines.c.id.desc())
    Index("index_ci_runner_machines_on_created_at_and_id_desc", ci_runner_machines.c.created_at, ci_runner_machines.c.id.desc())

    project_export_jobs = Table(
        "project_export_jobs",
        md,
        Column("id", BigInteger, primary_key=True),
        Column("project_id", BigInteger, nullable=False),
        Column("status", SmallInteger, nullable=False, server_default=text("0")),
        Column("jid", String(100), nullable=False),
        Column("user_id", BigInteger),
        Column("created_at", TIMESTAMPTZ, nullable=False),
        Column("updated_at", TIMESTAMPTZ, nullable=False),
    )
    # stuck_export_jobs: page through queued and started jobs by id.
    Index(
        "index_project_export_jobs_on_id_when_queued_or_started",
        project_export_jobs.c.id,
        postgresql_where=text("status IN (0, 1)"),
    )

    project_relation_exports = Table(
        "project_relation_exports",
        md,
        Column("id", BigInteger, primary_key=True),
        Column("project_export_job_id", BigInteger, nullable=False, index=True),
        Column("project_id", BigInteger),
        Column("relation", Text, nullable=False),
        Column("status", SmallInteger, nullable=False, server_default=text("0")),
        Column("jid", Text),
        Column("export_error", Text),
        Column("created_at", TIMESTAMPTZ),
        Column("updated_at", TIMESTAMPTZ),
    )

    environments = Table(
        "environments",
        md,
        Column("id", BigInteger, primary_key=True),
        Column("project_id", BigInteger, nullable=False),
        Column("name", String, nullable=False),
        Column("slug", String, nullable=False),
        Column("state", String, nullable=False, server_default=text("'available'")),
        Column("auto_stop_at", TIMESTAMPTZ),
        Column("auto_delete_at", TIMESTAMPTZ),
        Column("auto_stop_setting", SmallInteger, nullable=False, server_default=text("0")),
        Column("created_at", TIMESTAMP),
        Column("updated_at", TIMESTAMP),
    )
    # GitLab's own index for Environment.auto_stoppable (counts use it).
    Index(
        "index_environments_on_state_and_auto_stop_at",
        environments.c.state,
        environments.c.auto_stop_at,
        postgresql_where=text("auto_stop_at IS NOT NULL AND state = 'available'"),
    )
    # environments_auto_stop pages by id: the same rows ordered by id, auto_stop_at checked inside the index,
    # so a batch reads its 100 rows instead of sorting every due environment (cost would grow with the backlog).
    Index(
        "index_environments_on_id_and_auto_stop_at_when_available",
        environments.c.id,
        environments.c.auto_stop_at,
        postgresql_where=text("auto_stop_at IS NOT NULL AND state = 'available'"),
    )

    deployments = Table(
        "deployments",
        md,
        Column("id", BigInteger, primary_key=True),
        Column("iid", Integer, nullable=False),
        Column("project_id", BigInteger, nullable=False),
        Column("environment_id", BigInteger, nullable=False),
        Column("ref", String, nullable=False),
        Column("sha", String, nullable=False),
        Column("status", SmallInteger, nullable=False),
        Column("deployable_type", String),
        Column("deployable_id", BigInteger),
        Column("on_stop", String),
        Column("user_id", BigInteger),
        Column("created_at", TIMESTAMPTZ),
        Column("updated_at", TIMESTAMPTZ),
        Column("finished_at", TIMESTAMPTZ),
    )
    # environments_auto_stop: the last successful deployment of an environment.
    Index("index_deployments_on_environment_id_status_and_id", deployments.c.environment_id, deployments.c.status, deployments.c.id)

    ci_job_artifacts = Table(
        job_artifacts_table,
        md,
        Column("id", BigInteger, primary_key=True),
        Column("partition_id", BigInteger, nullable=False, server_default=text("100")),
        Column("project_id", BigInteger, nullable=False),
        Column("job_id", BigInteger, nullable=False),
        Column("file_type", Integer, nullable=False),
        Column("size", BigInteger),
        Column("file", String),
        Column("file_store", Integer, server_default=text("1")),
        Column("file_final_path", Text),
        Column("expire_at", TIMESTAMPTZ),
        Column("locked", SmallInteger, server_default=text("2")),
        Column("created_at", TIMESTAMPTZ),
        Column("updated_at", TIMESTAMPTZ),
    )
    # schedule_bulk_delete_job_artifacts: unlocked, non-trace artifacts by expiry.
    Index(
        f"index_{job_artifacts_table}_on_expire_at_for_bulk_delete",
        ci_job_artifacts.c.expire_at,
        ci_job_artifacts.c.id,
        postgresql_where=text("locked = 0 AND file_type <> 3 AND expire_at IS NOT NULL"),
    )

    ci_deleted_objects = Table(
        "ci_deleted_objects",
        md,
        Column("id", BigInteger, primary_key=True),
        Column("file_store", SmallInteger, nullable=False, server_default=text("1")),
        Column("pick_up_at", TIMESTAMPTZ, nullable=False, server_default=func.now()),
        Column("store_dir", Text, nullable=False),
        Column("file", Text, nullable=False),
        Column("project_id", BigInteger),
        Column("created_at", TIMESTAMPTZ, nullable=False, server_default=func.now()),
    )
    Index("index_ci_deleted_objects_on_pick_up_at", ci_deleted_objects.c.pick_up_at)

    features = Table(
        "features",
        md,
        Column("id", BigInteger, primary_key=True),
        Column("key", String, nullable=False, unique=True),
        Column("created_at", TIMESTAMP, nullable=False, server_default=func.now()),
        Column("updated_at", TIMESTAMP, nullable=False, server_default=func.now()),
    )
    feature_gates = Table(
        "feature_gates",
        md,
        Column("id", BigInteger, primary_key=True),
        Column("feature_key", String, nullable=False),
        Column("key", String, nullable=False),
        Column("value", String),
        Column("created_at", TIMESTAMP, nullable=False, server_default=func.now()),
        Column("updated_at", TIMESTAMP, nullable=False, server_default=func.now()),
    )
    Index("index_feature_gates_on_feature_key_and_key_and_value", feature_gates.c.feature_key, feature_gates.c.key, feature_gates.c.value, unique=True)

    return GitLabSchema(
        metadata=md,
        ci_builds=ci_builds,
        ci_pending_builds=ci_pending_builds,
        ci_running_builds=ci_running_builds,
        ci_runner_machines=ci_runner_machines,
        project_export_jobs=project_export_jobs,
        project_relation_exports=project_relation_exports,
        environments=environments,
        deployments=deployments,
        ci_job_artifacts=ci_job_artifacts,
        ci_deleted_objects=ci_deleted_objects,
        features=features,
        feature_gates=feature_gates,
    )


def create_schema(engine: Engine, schema: GitLabSchema | None = None) -> None:
    """Create the tables and indexes (dev stack and tests only; never called by a job)."""
    (schema or gitlab_schema()).metadata.create_all(engine)


# Type families a reflected column must share with its declaration: int, bigint and smallint are one
# family (GitLab widens ids over time), varchar and text another; a timestamp must also agree on time zone.
_TYPE_FAMILIES = (Boolean, Integer, String, DateTime, Numeric, LargeBinary)


def _family(column_type) -> tuple:
    family = next((f for f in _TYPE_FAMILIES if isinstance(column_type, f)), type(column_type))
    return (family, bool(getattr(column_type, "timezone", False))) if family is DateTime else (family,)


def require_columns(conn: Connection, tables: list[Table]) -> None:
    """Fail, naming every missing table and column and every column of an incompatible type, unless the database has what ``tables`` use."""
    inspector = inspect(conn)
    problems = []
    for table in tables:
        if not inspector.has_table(table.name):
            problems.append(f"table {table.name} is missing")
            continue
        present = {c["name"]: c["type"] for c in inspector.get_columns(table.name)}
        for column in table.columns:
            if column.name not in present:
                problems.append(f"column {table.name}.{column.name} is missing")
            elif _family(present[column.name]) != _family(column.type):
                found = present[column.name].compile(dialect=conn.dialect)
                problems.append(
                    f"column {table.name}.{column.name} is {found}, expected {column.type.compile(dialect=conn.dialect)}"
                )
    if problems:
        raise SchemaMismatch(
            "The database does not have what this job needs (ci_cleanup never creates or alters tables in it): "
            + ", ".join(problems)
        )
