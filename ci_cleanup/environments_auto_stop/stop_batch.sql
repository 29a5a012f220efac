-- Environments::AutoStopService's batch on one database, in one statement: pick_batch.sql, play_stop_actions.sql
-- and write_states.sql, each fed by the one before (on two databases they are three statements).
-- Environment.auto_stoppable(100) (seed 003: available and auto_stop_at before now, 100 at a time), paged by
-- the cursor (auto_stop_at, id), locked; each with its last successful deployment (status 2 = success).
WITH picked AS (
  SELECT environments.id,
         -- GitLab before 17.7 has no auto_stop_setting: it stops every due environment without stop actions (0).
         environments.auto_stop_setting,  -- if environments.auto_stop_setting
         0 AS auto_stop_setting,  -- unless environments.auto_stop_setting
         environments.auto_stop_at,
         CAST(environments.auto_stop_at AS text) AS cursor_at,
         last_deployment.deployable_id,
         last_deployment.on_stop
  FROM environments
  LEFT JOIN LATERAL (
    SELECT deployments.deployable_id, deployments.on_stop
    FROM deployments
    WHERE deployments.environment_id = environments.id AND deployments.status = 2
    ORDER BY deployments.id DESC
    LIMIT 1
  ) AS last_deployment ON true
  WHERE environments.state = 'available' AND environments.auto_stop_at < :now
    AND environments.auto_stop_at >= CAST(:after_at AS timestamptz)
    AND (environments.auto_stop_at > CAST(:after_at AS timestamptz) OR environments.id > :after_id)
  ORDER BY environments.auto_stop_at, environments.id
  LIMIT :limit
  FOR UPDATE OF environments
),
-- Environment#stop_actions: the Ci::Build rows of the deployable's pipeline whose name is the deployment's on_stop.
actions AS (
  SELECT picked.id AS environment_id, stop_action.id
  FROM picked
  JOIN p_ci_builds AS deployable ON deployable.id = picked.deployable_id
  JOIN p_ci_builds AS stop_action
    ON stop_action.commit_id = deployable.commit_id
   AND stop_action.name = picked.on_stop
   AND stop_action.type = 'Ci::Build'
),
-- Ci::Build#play: manual -> pending, queued_at = now, and into the runners' queue.
played AS (
  UPDATE p_ci_builds
  SET status = 'pending', queued_at = :naive_now, updated_at = :naive_now,
      lock_version = coalesce(lock_version, 0) + 1
  WHERE id = ANY(ARRAY(SELECT id FROM actions)) AND status = 'manual'
  RETURNING id, project_id, partition_id
),
queued AS (
  INSERT INTO ci_pending_builds (build_id, project_id, partition_id)
  SELECT id, project_id, partition_id FROM played
  ON CONFLICT (build_id) DO NOTHING
),
-- Environment#stop_with_actions!: with stop actions -> stopping; without, and auto_stop_setting 0 (always) ->
-- stopped, auto_stop_at cleared; without, and 1 (with_action): nothing.
stopping AS (
  UPDATE environments
  SET state = 'stopping', updated_at = :naive_now
  WHERE id = ANY(ARRAY(SELECT environment_id FROM actions)) AND state = 'available' AND auto_stop_at < :now
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
-- A row per environment picked, in the cursor's order: whether it has stop actions, those played, and the
-- state written (NULL: none).
SELECT picked.id,
       picked.auto_stop_setting,
       picked.cursor_at,
       EXISTS (SELECT FROM actions WHERE actions.environment_id = picked.id) AS has_stop_actions,
       ARRAY(SELECT played.id FROM actions JOIN played ON played.id = actions.id
             WHERE actions.environment_id = picked.id ORDER BY played.id) AS played,
       written.state AS written
FROM picked
LEFT JOIN written ON written.id = picked.id
ORDER BY picked.auto_stop_at, picked.id
