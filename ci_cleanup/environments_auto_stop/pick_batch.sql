-- Environment.auto_stoppable(100), the next batch (seed 003: available and auto_stop_at before now, 100 at a
-- time), paged by the cursor (auto_stop_at, id) along GitLab's index_environments_on_state_and_auto_stop_at, so
-- that an environment left available is not picked again in the same run. The cursor's auto_stop_at is the text
-- PostgreSQL gave (cursor_at): no datetime of Python's holds '-infinity' or a BC date.
-- Each comes with its last successful deployment (status 2 = success), whose deployable's pipeline holds the
-- stop actions (Environment#stop_actions).
-- Locked until the batch is written: an environment restarted meanwhile (a new deployment pushes auto_stop_at)
-- is re-checked by PostgreSQL and not picked, and none is restarted between its stop actions and its state.
SELECT environments.id,
       -- GitLab before 17.7 has no auto_stop_setting: it stops every due environment without stop actions (0).
       environments.auto_stop_setting,  -- if environments.auto_stop_setting
       0 AS auto_stop_setting,  -- unless environments.auto_stop_setting
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
