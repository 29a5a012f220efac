"""GitLab's tables the batches touch, declared as SQLAlchemy Core tables, and GitLab's values in their columns.

Names, types and nullability follow GitLab's ``db/structure.sql`` (vendored for the dev stack and the tests in
``tools/ci_cleanup_dev/ddl/structure.sql``). What a job checks of them at start is :mod:`.schema`.
"""

from __future__ import annotations

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    FetchedValue,
    Integer,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    func,
    text,
)

TIMESTAMP = DateTime(timezone=False)
TIMESTAMPTZ = DateTime(timezone=True)

# ci_builds.failure_reason (GitLab's Enums::Ci::CommitStatus.failure_reasons)
STUCK_OR_TIMEOUT_FAILURE = 3
# GitLab 19.1+'s DropCancelingService reason (Ci::HasStatus failure_reasons: no_updates_canceling: 28).
NO_UPDATES_CANCELING = 28
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


# Where each table lives (GitLab's ``db/docs/<table>.yml``, ``gitlab_schema``): the CI tables in the ``ci`` database
# of a decomposed GitLab, the others (``gitlab_main``, ``_cell``, ``_org``, ``_clusterwide``, by version) in ``main``.
# With one database both are the same. Each table below declares it in ``Table.info``.
GITLAB_CI, GITLAB_MAIN = "gitlab_ci", "gitlab_main"


# Declared under the names GitLab ships today (partitioned builds and artifacts); :func:`gitlab_schema` gives
# the same tables under the flat names of GitLab before partitioning.
metadata = MetaData()

ci_builds = Table(
    "p_ci_builds",
    metadata,
    Column("id", BigInteger, FetchedValue(), primary_key=True),  # assigned by GitLab's trigger (ci_builds_id_seq)
    Column("partition_id", BigInteger, primary_key=True),
    Column("project_id", BigInteger),  # NOT NULL by CHECK constraint
    Column("commit_id", BigInteger),  # the pipeline
    Column("name", String),
    Column("type", String),
    Column("status", String),
    Column("failure_reason", Integer),
    Column("runner_id", BigInteger),
    Column("user_id", BigInteger),
    Column("lock_version", Integer, server_default=text("0")),  # NOT NULL by CHECK constraint
    Column("created_at", TIMESTAMP),
    Column("updated_at", TIMESTAMP),
    Column("started_at", TIMESTAMP),
    Column("queued_at", TIMESTAMP),
    Column("finished_at", TIMESTAMP),
    Column("scheduled_at", TIMESTAMPTZ),
    Column("when", String),
    Column("ref", String),
    Column("allow_failure", Boolean, nullable=False, server_default=text("false")),
    Column("protected", Boolean),  # the ref is protected (Ci::Build#protected?)
    Column("retried", Boolean),  # a retry replaced it (NULL: not retried; CommitStatus.latest)
    info={"gitlab_schema": GITLAB_CI},
)
# The runners' queue: a row per pending build, with what runners choose by (Ci::Queue::PendingBuildsStrategy).
ci_pending_builds = Table(
    "ci_pending_builds",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("build_id", BigInteger, nullable=False),  # unique
    Column("project_id", BigInteger, nullable=False),
    Column("created_at", TIMESTAMPTZ, nullable=False, server_default=func.now()),
    Column("protected", Boolean, nullable=False, server_default=text("false")),
    Column("instance_runners_enabled", Boolean, nullable=False, server_default=text("false")),
    Column("namespace_id", BigInteger),
    Column("tag_ids", ARRAY(BigInteger), server_default=text("'{}'")),  # integer[] before 17.x
    Column("namespace_traversal_ids", ARRAY(BigInteger), server_default=text("'{}'")),
    Column("partition_id", BigInteger, nullable=False),  # the build's; no default
    info={"gitlab_schema": GITLAB_CI},
)
ci_running_builds = Table(
    "ci_running_builds",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("build_id", BigInteger, nullable=False),  # unique
    Column("project_id", BigInteger, nullable=False),
    Column("runner_id", BigInteger, nullable=False),
    Column("runner_type", SmallInteger, nullable=False),
    Column("partition_id", BigInteger, nullable=False),
    Column("created_at", TIMESTAMPTZ, nullable=False, server_default=func.now()),
    info={"gitlab_schema": GITLAB_CI},
)
# LIST-partitioned by runner_type; a trigger mirrors every change into ci_runner_machines_archived.
ci_runner_machines = Table(
    "ci_runner_machines",
    metadata,
    Column("id", BigInteger, FetchedValue(), primary_key=True),  # assigned by GitLab's trigger
    Column("runner_type", SmallInteger, primary_key=True),
    Column("runner_id", BigInteger, nullable=False),
    Column("sharding_key_id", BigInteger),  # NULL exactly for instance runners (CHECK per partition)
    Column("system_xid", Text, nullable=False),
    Column("creation_state", SmallInteger, nullable=False, server_default=text("0")),
    Column("created_at", TIMESTAMPTZ, nullable=False),
    Column("updated_at", TIMESTAMPTZ, nullable=False),
    Column("contacted_at", TIMESTAMPTZ),
    info={"gitlab_schema": GITLAB_CI},
)
project_export_jobs = Table(
    "project_export_jobs",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("project_id", BigInteger, nullable=False),
    Column("status", SmallInteger, nullable=False, server_default=text("0")),
    Column("jid", String(100), nullable=False),  # unique
    Column("user_id", BigInteger),
    Column("created_at", TIMESTAMPTZ, nullable=False),
    Column("updated_at", TIMESTAMPTZ, nullable=False),
    info={"gitlab_schema": GITLAB_MAIN},
)
project_relation_exports = Table(
    "project_relation_exports",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("project_export_job_id", BigInteger, nullable=False),
    Column("project_id", BigInteger),  # filled from the export job by GitLab's trigger
    Column("relation", Text, nullable=False),
    Column("status", SmallInteger, nullable=False, server_default=text("0")),
    Column("jid", Text),
    Column("export_error", Text),
    Column("created_at", TIMESTAMPTZ, nullable=False),
    Column("updated_at", TIMESTAMPTZ, nullable=False),
    info={"gitlab_schema": GITLAB_MAIN},
)
environments = Table(
    "environments",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("project_id", BigInteger, nullable=False),
    Column("name", String, nullable=False),  # unique per project
    Column("slug", String, nullable=False),  # unique per project
    Column("state", String, nullable=False, server_default=text("'available'")),
    Column("auto_stop_at", TIMESTAMPTZ),
    Column("auto_delete_at", TIMESTAMPTZ),
    Column("auto_stop_setting", SmallInteger, nullable=False, server_default=text("0")),
    Column("created_at", TIMESTAMP),
    Column("updated_at", TIMESTAMP),
    info={"gitlab_schema": GITLAB_MAIN},
)
deployments = Table(
    "deployments",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("iid", Integer, nullable=False),  # unique per project
    Column("project_id", BigInteger, nullable=False),
    Column("environment_id", BigInteger, nullable=False),
    Column("ref", String, nullable=False),
    Column("tag", Boolean, nullable=False),
    Column("sha", String, nullable=False),
    Column("status", SmallInteger, nullable=False),
    Column("deployable_type", String),
    Column("deployable_id", BigInteger),
    Column("on_stop", String),
    Column("user_id", BigInteger),
    Column("created_at", TIMESTAMP),
    Column("updated_at", TIMESTAMP),
    Column("finished_at", TIMESTAMPTZ),
    info={"gitlab_schema": GITLAB_MAIN},
)
ci_job_artifacts = Table(
    "p_ci_job_artifacts",
    metadata,
    Column("id", BigInteger, FetchedValue(), primary_key=True),  # by GitLab's trigger (ci_job_artifacts_id_seq)
    Column("partition_id", BigInteger, primary_key=True),
    Column("project_id", BigInteger, nullable=False),
    Column("job_id", BigInteger, nullable=False),  # unique with file_type and partition_id
    Column("file_type", Integer, nullable=False),
    Column("size", BigInteger),
    Column("file", String),
    Column("file_store", Integer, server_default=text("1")),  # NOT NULL by CHECK constraint
    Column("file_final_path", Text),
    Column("expire_at", TIMESTAMPTZ),
    Column("locked", SmallInteger, server_default=text("2")),
    Column("created_at", TIMESTAMPTZ, nullable=False),
    Column("updated_at", TIMESTAMPTZ, nullable=False),
    info={"gitlab_schema": GITLAB_CI},
)
ci_deleted_objects = Table(
    "ci_deleted_objects",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("file_store", SmallInteger, nullable=False, server_default=text("1")),
    Column("pick_up_at", TIMESTAMPTZ, nullable=False, server_default=func.now()),
    Column("store_dir", Text, nullable=False),
    Column("file", Text, nullable=False),
    Column("project_id", BigInteger),  # NOT NULL by CHECK constraint
    Column("created_at", TIMESTAMPTZ, nullable=False, server_default=func.now()),
    info={"gitlab_schema": GITLAB_CI},
)
features = Table(
    "features",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("key", String, nullable=False),
    Column("created_at", TIMESTAMP, nullable=False),
    Column("updated_at", TIMESTAMP, nullable=False),
    info={"gitlab_schema": GITLAB_MAIN},
)
feature_gates = Table(
    "feature_gates",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("feature_key", String, nullable=False),
    Column("key", String, nullable=False),
    Column("value", String),
    Column("created_at", TIMESTAMP, nullable=False),
    Column("updated_at", TIMESTAMP, nullable=False),
    info={"gitlab_schema": GITLAB_MAIN},
)
# What Ci::PendingBuild.args_from_build reads of a build's project (ci_cleanup_dev/ddl/queue_sources.sql): main's.
projects = Table(
    "projects",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("name", String),
    Column("path", String),
    Column("namespace_id", BigInteger, nullable=False),
    Column("shared_runners_enabled", Boolean, nullable=False, server_default=text("true")),
    Column("pending_delete", Boolean, server_default=text("false")),
    Column("created_at", TIMESTAMP),
    Column("updated_at", TIMESTAMP),
    info={"gitlab_schema": GITLAB_MAIN},
)
namespaces = Table(
    "namespaces",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("name", String, nullable=False),
    Column("path", String, nullable=False),
    Column("type", String, nullable=False, server_default=text("'User'")),
    Column("parent_id", BigInteger),
    Column("traversal_ids", ARRAY(BigInteger), nullable=False, server_default=text("'{}'")),
    Column("created_at", TIMESTAMP),
    Column("updated_at", TIMESTAMP),
    info={"gitlab_schema": GITLAB_MAIN},
)
project_features = Table(
    "project_features",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("project_id", BigInteger, nullable=False),  # unique
    Column("builds_access_level", Integer),  # 0: disabled (ProjectFeature::DISABLED)
    Column("pages_access_level", Integer, nullable=False),  # these three: NOT NULL without a default
    Column("model_experiments_access_level", Integer, nullable=False),
    Column("model_registry_access_level", Integer, nullable=False),
    info={"gitlab_schema": GITLAB_MAIN},
)
project_ci_cd_settings = Table(
    "project_ci_cd_settings",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("project_id", BigInteger, nullable=False),  # unique
    Column("group_runners_enabled", Boolean, nullable=False, server_default=text("true")),
    info={"gitlab_schema": GITLAB_MAIN},
)
# A build's tags: p_ci_build_tags from GitLab 17.3 (Ci::BuildTag), taggings before (acts-as-taggable-on); each
# release has one of them here (ci_cleanup_dev/ddl/build_tags.sql, taggings.sql).
p_ci_build_tags = Table(
    "p_ci_build_tags",
    metadata,
    Column("id", BigInteger, FetchedValue(), primary_key=True),
    Column("partition_id", BigInteger, primary_key=True),
    Column("tag_id", BigInteger, nullable=False),
    Column("build_id", BigInteger, nullable=False),
    Column("project_id", BigInteger, nullable=False),
    info={"gitlab_schema": GITLAB_CI},
)
taggings = Table(
    "taggings",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("tag_id", BigInteger),
    Column("taggable_id", BigInteger),
    Column("taggable_type", String),
    Column("context", String),
    info={"gitlab_schema": GITLAB_CI},
)
