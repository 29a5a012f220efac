-- The ci database's part of a batch: the stop actions of the deployments given (each environment's deployment group,
-- find_group.sql's rows: environment, pipeline, on_stop, in step), and the manual ones played.
-- Environment#stop_actions (stop_actions.sql), played and queued (play.sql), as stop_batch.sql does: a batch done
-- twice plays nothing more.
-- Each comes with its environment's project's part of the queue row, read in main (pick_batch.sql): its namespace
-- (NULL: no project row, so its stop actions are not played), instance runners, traversal ids (as text: arrays of
-- arrays cannot be unnested).
WITH wanted AS (
  SELECT *
  FROM unnest(CAST(:environment_ids AS bigint[]), CAST(:commit_ids AS bigint[]), CAST(:on_stops AS text[]),
              CAST(:namespace_ids AS bigint[]), CAST(:instance_runners_enabled AS boolean[]),
              CAST(:namespace_traversal_ids AS text[]))
    AS wanted (environment_id, commit_id, on_stop, namespace_id, instance_runners_enabled, namespace_traversal_ids)
),
actions AS (
  SELECT wanted.environment_id, stop_action.id, wanted.namespace_id, wanted.instance_runners_enabled,
         CAST(wanted.namespace_traversal_ids AS bigint[]) AS namespace_traversal_ids
  FROM wanted
  {{ stop_actions }}
),
{{ play }}
-- A row per environment that has stop actions: those played (NULL: none).
SELECT actions.environment_id,
       array_agg(DISTINCT played.id ORDER BY played.id) FILTER (WHERE played.id IS NOT NULL) AS played
FROM actions
LEFT JOIN played ON played.id = actions.id
GROUP BY actions.environment_id
