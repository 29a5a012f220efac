-- The ci database's part of a batch: the stop actions of the environments given (their ids, each one's last
-- successful deployment's deployable and on_stop, in step), and the manual ones played.
-- Environment#stop_actions: the Ci::Build rows of the deployable's pipeline whose name is the deployment's on_stop.
-- Ci::Build#play (seed 003 via Environments::StopService): manual -> pending, queued_at = now, and the build joins
-- the runners' queue (Ci::UpdateBuildQueueService#push, GitLab's unique index on ci_pending_builds (build_id)).
-- A stop action already pending is not played again: a batch done twice plays nothing more.
WITH wanted AS (
  SELECT *
  FROM unnest(CAST(:environment_ids AS bigint[]), CAST(:deployable_ids AS bigint[]), CAST(:on_stops AS text[]))
    AS wanted (environment_id, deployable_id, on_stop)
),
actions AS (
  SELECT wanted.environment_id, stop_action.id
  FROM wanted
  JOIN p_ci_builds AS deployable ON deployable.id = wanted.deployable_id
  JOIN p_ci_builds AS stop_action
    ON stop_action.commit_id = deployable.commit_id
   AND stop_action.name = wanted.on_stop
   AND stop_action.type = 'Ci::Build'
),
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
)
-- A row per environment that has stop actions: those played (NULL: none).
SELECT actions.environment_id,
       array_agg(played.id ORDER BY played.id) FILTER (WHERE played.id IS NOT NULL) AS played
FROM actions
LEFT JOIN played ON played.id = actions.id
GROUP BY actions.environment_id
