"""Which GitLab release a database is, as far as the jobs care: read once from the catalog, in one place.

GitLab's ``db/structure.sql`` changes under the jobs from release to release (``docs/gitlab-releases.md``): builds
and artifacts went from flat tables to partitioned ones whose partitions later moved to
``gitlab_partitions_dynamic``, and columns came and went. :func:`read_catalog` reads what a database has of them,
:class:`Release` is what was found (as a run's metadata: :meth:`Release.metadata`), and a GitLab older than the
oldest release supported is refused before a job reads a row (:meth:`Release.refusal`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import Table, text
from sqlalchemy.engine import Connection

from .schema import FLAT, PARTITIONED, GitLabSchema, SchemaMismatch

OLDEST_SUPPORTED = "16.0"
# p_ci_builds / p_ci_job_artifacts whose partitions are all in GitLab's partition manager's schema: the newest
# releases no longer keep public.ci_builds (100) / public.ci_job_artifacts.
PARTITIONED_DYNAMIC = "partitioned_dynamic"
DYNAMIC_SCHEMA = "gitlab_partitions_dynamic"

# A feature -> the table (GitLabSchema's field) and the column whose presence it is.
COLUMN_FEATURES = {
    "builds_partition_id": ("ci_builds", "partition_id"),
    "pending_builds_partition_id": ("ci_pending_builds", "partition_id"),
    "running_builds_partition_id": ("ci_running_builds", "partition_id"),
    "runner_machines_runner_type": ("ci_runner_machines", "runner_type"),
    "runner_machines_sharding_key_id": ("ci_runner_machines", "sharding_key_id"),
    "environments_auto_stop_setting": ("environments", "auto_stop_setting"),
    "deleted_objects_project_id": ("ci_deleted_objects", "project_id"),
    "deleted_objects_created_at": ("ci_deleted_objects", "created_at"),
    "export_jobs_user_id": ("project_export_jobs", "user_id"),
    "relation_exports_project_id": ("project_relation_exports", "project_id"),
    # GitLab 17.0's AddRunnerOwnerNamespaceIdColumnToCiRunningBuilds: the release whose Environment#stop_actions
    # takes the last finished deployment (docs/gitlab-releases.md).
    "running_builds_runner_owner_namespace_xid": ("ci_running_builds", "runner_owner_namespace_xid"),
    # A build's tags in p_ci_build_tags (GitLab 17.3+), else in taggings.
    "build_tags": ("p_ci_build_tags", "tag_id"),
}
# The other tables read for their kind (partitioned or not) and their partitions' schemas.
KIND_TABLES = ("ci_builds", "ci_job_artifacts", "ci_runner_machines")
RELEASE_TABLES = tuple(dict.fromkeys([table for table, _ in COLUMN_FEATURES.values()] + list(KIND_TABLES)))

# Each table named: its kind (pg_class.relkind; NULL: not there), its partitions' schemas, and the columns asked of it.
_CATALOG = text(
    "SELECT t.name, c.relkind::text, "
    "  ARRAY(SELECT DISTINCT n.nspname::text FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhrelid "
    "        JOIN pg_namespace n ON n.oid = p.relnamespace WHERE i.inhparent = c.oid ORDER BY 1), "
    "  ARRAY(SELECT a.attname::text FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0 "
    "        AND NOT a.attisdropped AND a.attname = ANY(CAST(:columns AS text[])) ORDER BY 1) "
    "FROM unnest(CAST(:names AS text[])) AS t(name) LEFT JOIN pg_class c ON c.oid = to_regclass(t.name)"
)


@dataclass(frozen=True)
class TableFacts:
    """What one database's catalog says of one table."""

    kind: str | None  # pg_class.relkind: r (plain), p (partitioned); None: no such table
    partition_schemas: tuple[str, ...] = ()
    columns: frozenset[str] = frozenset()


def read_catalog(conn: Connection, schema: GitLabSchema, fields: Iterable[str]) -> dict[str, TableFacts]:
    """The facts of the tables ``fields`` (GitLabSchema's names: ``ci_builds``, …) in ``conn``'s database, in one
    query; each under its field's name."""
    tables: dict[str, Table] = {field: getattr(schema, field) for field in fields}
    columns = sorted({column for _, column in COLUMN_FEATURES.values()})
    by_name = {table.name: field for field, table in tables.items()}
    rows = conn.execute(_CATALOG, {"names": list(by_name), "columns": columns})
    return {by_name[name]: TableFacts(kind, tuple(schemas), frozenset(found)) for name, kind, schemas, found in rows}


def _layout(facts: TableFacts) -> str:
    if facts.kind != "p":
        return FLAT
    return PARTITIONED if any(s != DYNAMIC_SCHEMA for s in facts.partition_schemas) else PARTITIONED_DYNAMIC


@dataclass(frozen=True)
class Release:
    """The features the jobs depend on, as one GitLab database (or a decomposed GitLab's two) has them."""

    layout: str  # builds and artifacts: flat, partitioned, partitioned_dynamic
    builds: bool  # the builds table is there (else require names it missing, for a job that uses it)
    runner_machines: bool  # the table is there (15.8+)
    runner_machines_partitioned: bool
    features: dict[str, bool]  # COLUMN_FEATURES' keys: the column is there

    @classmethod
    def of(cls, facts: dict[str, TableFacts]) -> Release:
        layouts = {_layout(facts["ci_builds"]), _layout(facts["ci_job_artifacts"])}
        machines = facts["ci_runner_machines"]
        return cls(
            layout=layouts.pop() if len(layouts) == 1 else
            f"builds {_layout(facts['ci_builds'])}, job artifacts {_layout(facts['ci_job_artifacts'])}",
            builds=facts["ci_builds"].kind is not None,
            runner_machines=machines.kind is not None,
            runner_machines_partitioned=machines.kind == "p",
            features={name: column in facts[table].columns for name, (table, column) in COLUMN_FEATURES.items()},
        )

    @property
    def absent(self) -> frozenset[str]:
        """The columns of :data:`COLUMN_FEATURES` this release lacks, as a batch's .sql files name them
        (``environments.auto_stop_setting``): :mod:`~ci_cleanup.gitlab.sql_files` leaves out their lines."""
        named = {"ci_builds": "p_ci_builds", "ci_job_artifacts": "p_ci_job_artifacts"}
        return frozenset(f"{named.get(table, table)}.{column}" for name, (table, column) in COLUMN_FEATURES.items()
                         if not self.features[name])

    def refusal(self, schema: GitLabSchema) -> str | None:
        """Why this GitLab is older than :data:`OLDEST_SUPPORTED`, in one line; None when it is not. Builds without
        ``partition_id`` are (GitLab partitions them from 16.0 on); what else 16.0 has and this lacks is named too."""
        if self.features["builds_partition_id"] or not self.builds:
            return None
        lacks = [f"no partition_id on {schema.ci_builds.name}"]
        lacks += [f"no partition_id on {table}" for table, feature in (
            ("ci_pending_builds", "pending_builds_partition_id"), ("ci_running_builds", "running_builds_partition_id"))
            if not self.features[feature]]
        if not self.runner_machines:
            lacks.append("no ci_runner_machines table")
        return (f"This GitLab is older than {OLDEST_SUPPORTED}, the oldest release ci_cleanup supports: "
                f"{', '.join(lacks)}. No row was read or changed")

    def metadata(self) -> dict[str, object]:
        """For a run's metadata: the layout and every feature detected."""
        features = {"runner_machines": self.runner_machines,
                    "runner_machines_partitioned": self.runner_machines_partitioned, **self.features}
        return {"gitlab_layout": self.layout, "gitlab_features": features,
                "gitlab_release_like": [name for name, known in KNOWN.items() if known == self]}


class UnsupportedRelease(SchemaMismatch):
    """The database is a GitLab older than :data:`OLDEST_SUPPORTED`."""


def _known(layout: str, machines_partitioned: bool, lacks: Iterable[str] = ()) -> Release:
    return Release(layout, True, True, machines_partitioned, {name: name not in lacks for name in COLUMN_FEATURES})


# The vendored releases' features (their DDL is in ``tools/ci_cleanup_dev/ddl/versions/``, never read at run time),
# to name the release a run met (test_gitlab_releases checks each against its schema).
KNOWN = {
    "16.0": _known(FLAT, False, ("runner_machines_runner_type", "runner_machines_sharding_key_id",
                                 "environments_auto_stop_setting", "deleted_objects_project_id",
                                 "deleted_objects_created_at", "export_jobs_user_id", "relation_exports_project_id",
                                 "running_builds_runner_owner_namespace_xid", "build_tags")),
    "17.x": _known(PARTITIONED, True),
    "18.x": _known(PARTITIONED, True),
    "18.y": _known(PARTITIONED_DYNAMIC, True, ("runner_machines_sharding_key_id",)),
    "19.x": _known(PARTITIONED_DYNAMIC, True, ("runner_machines_sharding_key_id",)),
}


def detect_release(facts: Iterable[dict[str, TableFacts]]) -> Release:
    """The release of the facts read in each database (:func:`read_catalog`), each table's from its own."""
    merged: dict[str, TableFacts] = {}
    for found in facts:
        merged.update(found)
    return Release.of(merged)


def refuse_unsupported(release: Release, schema: GitLabSchema) -> None:
    refusal = release.refusal(schema)
    if refusal:
        raise UnsupportedRelease(refusal)

