-- Environments::AutoStopService's batch on one database, in one statement: pick_batch.sql, play_stop_actions.sql
-- and write_states.sql, each fed by the one before (on two databases they are three statements).
-- Environment.auto_stoppable(100) (seed 003: available and auto_stop_at before now, 100 at a time), paged by
-- the cursor (auto_stop_at, id), locked; each with its last finished deployment (the last successful one before
-- GitLab 17.0).
WITH picked AS (
  SELECT environments.id,
         -- GitLab before 17.7 has no auto_stop_setting: it stops every due environment without stop actions (0).
         environments.auto_stop_setting,  -- if environments.auto_stop_setting
         0 AS auto_stop_setting,  -- unless environments.auto_stop_setting
         environments.auto_stop_at,
         CAST(environments.auto_stop_at AS text) AS cursor_at,
         last_deployment.deployable_id,
         last_deployment.on_stop,
         environments.project_id,
         queue.namespace_id,
         queue.instance_runners_enabled,
         queue.namespace_traversal_ids
  FROM environments
  LEFT JOIN LATERAL (
    SELECT deployments.deployable_id, deployments.on_stop
    FROM deployments
    WHERE deployments.environment_id = environments.id
      -- Environment#stop_actions from GitLab 17.0: the last finished deployment (success 2, failed 3, canceled 4);
      -- before, the last successful one. Told apart by 17.1's project_relation_exports.project_id (gitlab-releases.md).
      AND deployments.status IN (2, 3, 4)  -- if project_relation_exports.project_id
      AND deployments.status = 2  -- unless project_relation_exports.project_id
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
  WHERE environments.state = 'available' AND environments.auto_stop_at < :now
    AND environments.auto_stop_at >= CAST(:after_at AS timestamptz)
    AND (environments.auto_stop_at > CAST(:after_at AS timestamptz) OR environments.id > :after_id)
  ORDER BY environments.auto_stop_at, environments.id
  LIMIT :limit
  FOR UPDATE OF environments
),
-- Environment#stop_actions: the Ci::Build rows of the deployable's pipeline whose name is the deployment's on_stop,
-- each with its environment's project part of the queue row.
actions AS (
  SELECT picked.id AS environment_id, stop_action.id, picked.namespace_id, picked.instance_runners_enabled,
         picked.namespace_traversal_ids
  FROM picked
  JOIN p_ci_builds AS deployable ON deployable.id = picked.deployable_id
  JOIN p_ci_builds AS stop_action
    ON stop_action.commit_id = deployable.commit_id
   AND stop_action.name = picked.on_stop
   AND stop_action.type = 'Ci::Build'
),
-- Ci::Build#play: manual -> pending, queued_at = now, and into the runners' queue; not when its project (or the
-- project's namespace) has no row: GitLab's upsert_from_build! fails validating the namespace, so nothing changes.
played AS (
  UPDATE p_ci_builds
  SET status = 'pending', queued_at = :naive_now, updated_at = :naive_now,
      lock_version = coalesce(lock_version, 0) + 1
  WHERE id = ANY(ARRAY(SELECT id FROM actions WHERE namespace_id IS NOT NULL)) AND status = 'manual'
  RETURNING id, project_id, partition_id, protected
),
-- Ci::PendingBuild.upsert_from_build! (args_from_build): protected, namespace, tag ids, instance runners and
-- traversal ids, as runners choose jobs by them (Ci::Queue::PendingBuildsStrategy).
queued AS (
  INSERT INTO ci_pending_builds (build_id, project_id, partition_id, protected, namespace_id, tag_ids,
                                 instance_runners_enabled, namespace_traversal_ids)
  SELECT DISTINCT ON (played.id) played.id, played.project_id, played.partition_id, coalesce(played.protected, false),
         actions.namespace_id,
         -- Ci::Build#tags_ids: p_ci_build_tags from GitLab 17.3, acts-as-taggable's taggings before.
         ARRAY(SELECT tags.tag_id FROM p_ci_build_tags AS tags  -- if p_ci_build_tags.tag_id
               WHERE tags.build_id = played.id AND tags.partition_id = played.partition_id  -- if p_ci_build_tags.tag_id
               ORDER BY tags.tag_id),  -- if p_ci_build_tags.tag_id
         ARRAY(SELECT tags.tag_id FROM taggings AS tags  -- unless p_ci_build_tags.tag_id
               WHERE tags.taggable_id = played.id  -- unless p_ci_build_tags.tag_id
                 AND tags.taggable_type = 'CommitStatus' AND tags.context = 'tags'  -- unless p_ci_build_tags.tag_id
               ORDER BY tags.tag_id),  -- unless p_ci_build_tags.tag_id
         actions.instance_runners_enabled, actions.namespace_traversal_ids
  FROM played JOIN actions ON actions.id = played.id
  -- A stop action shared by environments: their project is its own in GitLab; the first environment's, to be sure.
  ORDER BY played.id, actions.environment_id
  ON CONFLICT (build_id) DO NOTHING
),
-- Environment#stop_with_actions!: with stop actions -> stopping (unless they could not be queued); without, and
-- auto_stop_setting 0 (always) -> stopped, auto_stop_at cleared; without, and 1 (with_action): nothing.
stopping AS (
  UPDATE environments
  SET state = 'stopping', updated_at = :naive_now
  WHERE id = ANY(ARRAY(SELECT environment_id FROM actions WHERE namespace_id IS NOT NULL))
    AND state = 'available' AND auto_stop_at < :now
  RETURNING id, state
),
stopped AS (
  UPDATE environments
  SET state = 'stopped', auto_stop_at = NULL, updated_at = :naive_now
  WHERE id = ANY(ARRAY(SELECT id FROM picked WHERE id NOT IN (SELECT environment_id FROM actions)))
    AND state = 'available' AND auto_stop_at < :now
    AND auto_stop_setting = 0  -- if environments.auto_stop_setting
  RETURNING id, state
),
written AS (
  SELECT id, state FROM stopping
  UNION ALL
  SELECT id, state FROM stopped
)
-- A row per environment picked, in the cursor's order: whether it has stop actions, those played, the state
-- written (NULL: none), and its project and namespace (NULL: no project row, its stop actions not played).
SELECT picked.id,
       picked.auto_stop_setting,
       picked.cursor_at,
       EXISTS (SELECT FROM actions WHERE actions.environment_id = picked.id) AS has_stop_actions,
       ARRAY(SELECT played.id FROM actions JOIN played ON played.id = actions.id
             WHERE actions.environment_id = picked.id ORDER BY played.id) AS played,
       written.state AS written,
       picked.project_id,
       picked.namespace_id
FROM picked
LEFT JOIN written ON written.id = picked.id
ORDER BY picked.auto_stop_at, picked.id
