-- Environment.auto_stoppable(100) (seed 003: available and auto_stop_at before now, 100 at a time), paged by the
-- cursor (auto_stop_at, id) along GitLab's index_environments_on_state_and_auto_stop_at, so that an environment left
-- available is not picked again in the same run. The cursor's auto_stop_at is the text PostgreSQL gave (cursor_at):
-- no datetime of Python's holds '-infinity' or a BC date. Each comes with its last finished deployment's deployable
-- (successful before GitLab 17.0), whose pipeline's jobs make its deployment group (group_jobs.sql), and its
-- project's part of their queue rows. Named {{ picked }} by pick_batch.sql, find_batch.sql and stop_batch.sql.
SELECT environments.id,
       -- GitLab before 17.7 has no auto_stop_setting: it stops every due environment without stop actions (0).
       environments.auto_stop_setting,  -- if environments.auto_stop_setting
       0 AS auto_stop_setting,  -- unless environments.auto_stop_setting
       CAST(environments.auto_stop_at AS text) AS cursor_at,
       last_deployment.deployable_id,
       environments.project_id,
       queue.namespace_id,
       queue.instance_runners_enabled,
       queue.namespace_traversal_ids
FROM environments
LEFT JOIN LATERAL (
  SELECT deployments.deployable_id
  FROM deployments
  WHERE deployments.environment_id = environments.id
    -- Environment#last_finished_deployment from GitLab 17.0 (success 2, failed 3, canceled 4); before, the last
    -- successful one (#last_deployment). Told apart by 17.0's ci_running_builds.runner_owner_namespace_xid
    -- (gitlab-releases.md).
    AND deployments.status IN (2, 3, 4)  -- if ci_running_builds.runner_owner_namespace_xid
    AND deployments.status = 2  -- unless ci_running_builds.runner_owner_namespace_xid
  ORDER BY deployments.id DESC
  LIMIT 1
) AS last_deployment ON true
-- Ci::PendingBuild.args_from_build's part from the project (GitLab's main database), for the stop actions' queue
-- rows: builds enabled (project_features.builds_access_level > 0, ProjectFeature::DISABLED = 0; no row: off) and
-- not pending_delete; then instance runners when shared_runners_enabled, the namespace's traversal ids when group
-- runners are enabled (project_ci_cd_settings; no row: off), else none. No project or namespace row: NULL.
LEFT JOIN LATERAL (
  SELECT projects.namespace_id,
         builds.enabled AND projects.shared_runners_enabled AS instance_runners_enabled,
         CASE WHEN builds.enabled AND coalesce(project_ci_cd_settings.group_runners_enabled, false)
              THEN namespaces.traversal_ids ELSE CAST('{}' AS bigint[]) END AS namespace_traversal_ids
  FROM projects
  JOIN namespaces ON namespaces.id = projects.namespace_id
  LEFT JOIN project_features ON project_features.project_id = projects.id
  LEFT JOIN project_ci_cd_settings ON project_ci_cd_settings.project_id = projects.id
  CROSS JOIN LATERAL (
    SELECT coalesce(project_features.builds_access_level > 0, false) AND NOT coalesce(projects.pending_delete, false)
      AS enabled
  ) AS builds
  WHERE projects.id = environments.project_id
) AS queue ON true
WHERE {{ auto_stoppable }}
  AND environments.auto_stop_at >= CAST(:after_at AS timestamptz)
  AND (environments.auto_stop_at > CAST(:after_at AS timestamptz) OR environments.id > :after_id)
ORDER BY environments.auto_stop_at, environments.id
LIMIT :limit
