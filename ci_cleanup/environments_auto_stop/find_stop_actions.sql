-- play_stop_actions.sql without playing them: for a dry run, and for a database that lacks GitLab's unique index
-- on ci_pending_builds (build_id), without which no stop action can join the runners' queue.
-- Environment#stop_actions: the Ci::Build rows of the deployable's pipeline whose name is the deployment's on_stop.
WITH wanted AS (
  SELECT *
  FROM unnest(CAST(:environment_ids AS bigint[]), CAST(:deployable_ids AS bigint[]), CAST(:on_stops AS text[]))
    AS wanted (environment_id, deployable_id, on_stop)
)
-- A row per environment that has stop actions: the manual ones, which a run would play (NULL: none).
SELECT wanted.environment_id,
       array_agg(stop_action.id ORDER BY stop_action.id) FILTER (WHERE stop_action.status = 'manual') AS played
FROM wanted
JOIN p_ci_builds AS deployable ON deployable.id = wanted.deployable_id
JOIN p_ci_builds AS stop_action
  ON stop_action.commit_id = deployable.commit_id
 AND stop_action.name = wanted.on_stop
 AND stop_action.type = 'Ci::Build'
GROUP BY wanted.environment_id
