"""Projects as GitLab makes them, for the dev stack, the demo, the benchmark and the tests: a project with its
namespace (a group of its own), builds enabled and GitLab's defaults for runners (shared and group runners on).

Not used by the jobs: they only read these rows (``environments_auto_stop`` queues a stop action from them).
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy.dialects.postgresql import insert

from ci_cleanup.gitlab.schema import GitLabSchema, gitlab_schema, naive_utc, utc_now

ENABLED = 20  # ProjectFeature::ENABLED


def add_projects(conn, ids: Iterable[int], schema: GitLabSchema | None = None) -> None:
    """Projects ``ids`` (each in a group of the same id), unless there already; in ``conn``'s transaction (a
    connection, or anything that runs each statement in its table's database)."""
    schema, ids, now = schema or gitlab_schema(), sorted(set(ids)), naive_utc(utc_now())
    if not ids:
        return
    rows = {
        schema.namespaces: [dict(id=i, name=f"group-{i}", path=f"group-{i}", type="Group", traversal_ids=[i],
                                 created_at=now, updated_at=now) for i in ids],
        schema.projects: [dict(id=i, name=f"project-{i}", path=f"project-{i}", namespace_id=i, created_at=now,
                               updated_at=now) for i in ids],
        # The access levels a row needs (NOT NULL without a default), builds enabled.
        schema.project_features: [dict(project_id=i, builds_access_level=ENABLED, pages_access_level=ENABLED,
                                       model_experiments_access_level=ENABLED, model_registry_access_level=ENABLED)
                                  for i in ids],
        schema.project_ci_cd_settings: [dict(project_id=i) for i in ids],  # group runners on: the column's default
    }
    for table, values in rows.items():
        key = ["id"] if table.name in ("namespaces", "projects") else ["project_id"]
        conn.execute(insert(table).values(values).on_conflict_do_nothing(index_elements=key))
