"""Projects as GitLab makes them, for the dev stack, the demo, the benchmark and the tests: a project with its
namespace (a group of its own) and its project namespace, builds enabled and GitLab's defaults for runners
(shared and group runners on). Every place that writes projects writes them here.

Not used by the jobs: they only read these rows (``environments_auto_stop`` queues a stop action from them).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from sqlalchemy import BigInteger, Column, MetaData, Table
from sqlalchemy.dialects.postgresql import insert

from ci_cleanup.gitlab.schema import GitLabSchema, gitlab_schema, naive_utc, utc_now

ENABLED = 20  # ProjectFeature::ENABLED
DEFAULT_ORGANIZATION_ID = 1  # Organizations::Organization::DEFAULT_ORGANIZATION_ID: every row's organization
# A project's project namespace (Namespaces::ProjectNamespace, type 'Project') takes an id of this range, so that
# its group keeps the project's own id, as the tests name it.
PROJECT_NAMESPACE_IDS = 10**12
# The columns GitLab's DDL (ci_cleanup_dev/ddl/queue_sources.sql) requires of a row, NOT NULL or by a CHECK, with
# no default, beyond those the jobs read (ci_cleanup.gitlab.tables declares only these).
_REQUIRED = {"namespaces": ("organization_id",), "projects": ("organization_id", "project_namespace_id")}


@functools.cache
def _as_written(table: Table) -> Table:
    """``table`` (its database kept: ``info``) with the columns a row of it needs that the jobs do not read."""
    written = table.to_metadata(MetaData())
    for name in _REQUIRED.get(table.name, ()):
        written.append_column(Column(name, BigInteger))
    return written


def add_projects(conn, ids: Iterable[int], schema: GitLabSchema | None = None) -> None:
    """Projects ``ids`` (each in a group of the same id), unless there already; in ``conn``'s transaction (a
    connection, or anything that runs each statement in its table's database)."""
    schema, ids, now = schema or gitlab_schema(), sorted(set(ids)), naive_utc(utc_now())
    if not ids:
        return
    made = dict(organization_id=DEFAULT_ORGANIZATION_ID, created_at=now, updated_at=now)
    groups = [dict(id=i, name=f"group-{i}", path=f"group-{i}", type="Group", traversal_ids=[i], **made) for i in ids]
    project_namespaces = [dict(id=PROJECT_NAMESPACE_IDS + i, name=f"project-{i}", path=f"project-{i}",
                               type="Project", parent_id=i, traversal_ids=[i, PROJECT_NAMESPACE_IDS + i], **made)
                          for i in ids]
    rows = {
        schema.namespaces: groups + project_namespaces,
        schema.projects: [dict(id=i, name=f"project-{i}", path=f"project-{i}", namespace_id=i,
                               project_namespace_id=PROJECT_NAMESPACE_IDS + i, **made) for i in ids],
        # The access levels a row needs (NOT NULL without a default), builds enabled.
        schema.project_features: [dict(project_id=i, builds_access_level=ENABLED, pages_access_level=ENABLED,
                                       model_experiments_access_level=ENABLED, model_registry_access_level=ENABLED)
                                  for i in ids],
        schema.project_ci_cd_settings: [dict(project_id=i) for i in ids],  # group runners on: the column's default
    }
    for table, values in rows.items():
        key = ["id"] if table.name in ("namespaces", "projects") else ["project_id"]
        conn.execute(insert(_as_written(table)).values(values).on_conflict_do_nothing(index_elements=key))
