"""Projects as GitLab makes them, for the dev stack, the demo, the benchmark and the tests: a project with its
namespace (a group of its own), builds enabled and GitLab's defaults for runners (shared and group runners on).

Not used by the jobs: they only read these rows (``environments_auto_stop`` queues a stop action from them).
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import text
from sqlalchemy.engine import Connection

# ProjectFeature::ENABLED (20) for builds and the access levels a row needs; project_ci_cd_settings' defaults.
_INSERT = text("""
WITH ids AS (SELECT DISTINCT id FROM unnest(CAST(:ids AS bigint[])) AS id),
namespaces_added AS (
  INSERT INTO namespaces (id, name, path, type, traversal_ids, created_at, updated_at)
  SELECT id, 'group-' || id, 'group-' || id, 'Group', ARRAY[id], now(), now() FROM ids
  ON CONFLICT (id) DO NOTHING
),
projects_added AS (
  INSERT INTO projects (id, name, path, namespace_id, created_at, updated_at)
  SELECT id, 'project-' || id, 'project-' || id, id, now(), now() FROM ids
  ON CONFLICT (id) DO NOTHING
),
features_added AS (
  INSERT INTO project_features (project_id, builds_access_level, pages_access_level, model_experiments_access_level,
                                model_registry_access_level)
  SELECT id, 20, 20, 20, 20 FROM ids
  ON CONFLICT (project_id) DO NOTHING
)
INSERT INTO project_ci_cd_settings (project_id) SELECT id FROM ids ON CONFLICT (project_id) DO NOTHING
""")


def add_projects(conn: Connection, ids: Iterable[int]) -> None:
    """Projects ``ids`` (each in a group of the same id), unless there already; in ``conn``'s transaction."""
    conn.execute(_INSERT, {"ids": sorted(set(ids))})
