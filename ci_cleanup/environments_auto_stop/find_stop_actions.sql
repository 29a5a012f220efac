-- play_stop_actions.sql without playing them: for a dry run, and for a database that lacks GitLab's unique index
-- on ci_pending_builds (build_id), without which no stop action can join the runners' queue. A row per deployment of
-- each environment's group (find_group.sql's rows).
WITH wanted AS (
  SELECT *
  FROM unnest(CAST(:environment_ids AS bigint[]), CAST(:commit_ids AS bigint[]), CAST(:on_stops AS text[]))
    AS wanted (environment_id, commit_id, on_stop)
)
-- A row per environment that has stop actions: the manual ones, which a run would play (NULL: none).
SELECT wanted.environment_id,
       array_agg(DISTINCT stop_action.id ORDER BY stop_action.id) FILTER (WHERE stop_action.status = 'manual') AS played
FROM wanted
{{ stop_actions }}
GROUP BY wanted.environment_id
