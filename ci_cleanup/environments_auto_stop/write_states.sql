-- The main database's write of a batch, Environment#stop_with_actions! (seed 003 via Environments::StopService):
-- with stop actions -> stopping (its auto_stop_at kept, as GitLab keeps it); without, and auto_stop_setting 0
-- (always) -> stopped, auto_stop_at cleared; without, and 1 (with_action): nothing, so never among the stopped ids.
-- Each only if still auto-stoppable: one restarted meanwhile is left as it is.
WITH stopping AS (
  UPDATE environments
  SET state = 'stopping', updated_at = :naive_now
  WHERE id = ANY(CAST(:stopping_ids AS bigint[])) AND {{ auto_stoppable }}
  RETURNING id, state
),
stopped AS (
  UPDATE environments
  SET state = 'stopped', auto_stop_at = NULL, updated_at = :naive_now
  WHERE id = ANY(CAST(:stopped_ids AS bigint[])) AND {{ auto_stoppable }}
    AND auto_stop_setting = 0  -- if environments.auto_stop_setting
  RETURNING id, state
)
SELECT id, state FROM stopping
UNION ALL
SELECT id, state FROM stopped
