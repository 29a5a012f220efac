-- Environments::AutoStopService's batch on one database, in one statement: pick_batch.sql, find_group_jobs.sql,
-- find_group.sql, play_stop_actions.sql and write_states.sql, each fed by the one before (on two databases they are
-- five statements). Environment.auto_stoppable(100) (seed 003: available and auto_stop_at before now, 100 at a time),
-- paged by the cursor (auto_stop_at, id), locked; each with its last finished deployment's deployable (the last
-- successful one's before GitLab 17.0), the jobs of its deployment group, the group, and its stop actions.
WITH picked AS (
  {{ picked }}
  FOR UPDATE OF environments
),
jobs AS (
  SELECT wanted.id AS environment_id, job.id AS job_id, job.commit_id
  FROM picked AS wanted
  {{ group_jobs }}
),
deployment_group AS (
  {{ group }}
),
actions AS (
  SELECT wanted.environment_id, stop_action.id, picked.namespace_id, picked.instance_runners_enabled,
         picked.namespace_traversal_ids
  FROM deployment_group AS wanted
  JOIN picked ON picked.id = wanted.environment_id
  {{ stop_actions }}
),
{{ play }},
stopping AS (
  UPDATE environments
  SET state = 'stopping', updated_at = :naive_now
  WHERE id = ANY(ARRAY(SELECT environment_id FROM actions WHERE namespace_id IS NOT NULL))
    AND {{ auto_stoppable }}
  RETURNING id, state
),
stopped AS (
  UPDATE environments
  SET state = 'stopped', auto_stop_at = NULL, updated_at = :naive_now
  WHERE id = ANY(ARRAY(SELECT id FROM picked WHERE id NOT IN (SELECT environment_id FROM actions)))
    AND {{ auto_stoppable }}
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
       ARRAY(SELECT DISTINCT played.id FROM actions JOIN played ON played.id = actions.id
             WHERE actions.environment_id = picked.id ORDER BY played.id) AS played,
       written.state AS written,
       picked.project_id,
       picked.namespace_id
FROM picked
LEFT JOIN written ON written.id = picked.id
ORDER BY CAST(picked.cursor_at AS timestamptz), picked.id
