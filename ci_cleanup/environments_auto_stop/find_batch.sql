-- A dry run's next batch: pick_batch.sql without its lock, since a dry run changes nothing, row locks included.
-- Environment.auto_stoppable(100) (seed 003: available and auto_stop_at before now), paged by the cursor
-- (auto_stop_at, id); each with its last successful deployment (status 2 = success).
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
