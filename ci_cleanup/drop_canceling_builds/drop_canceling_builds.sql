-- Ci::StuckBuilds::DropCancelingService, the next batch (seed 000): the builds canceling and untouched for over an
-- hour (Ci::Build.canceling.created_at_before(1.hour.ago).updated_at_before(1.hour.ago), both strict), 100 at a
-- time in the order GitLab reads them (created_at, project_id), dropped as failed with the failure reason given
-- (the seed's stuck_or_timeout_failure, 3; GitLab 19.1+ writes no_updates_canceling, 28).
-- One statement, so one transaction: a batch is dropped whole or not at all.
WITH picked AS (
  SELECT id, created_at, project_id
  FROM p_ci_builds
  WHERE {{ outdated_canceling }}
    -- Builds this run picked and did not drop are not picked again (else a build left would come back each batch).
    AND id <> ALL(CAST(:passed_over AS bigint[]))
  ORDER BY created_at, project_id, id
  LIMIT :batch_size
),
dropped AS (
  UPDATE p_ci_builds
  SET status = 'failed', failure_reason = :failure_reason, finished_at = coalesce(finished_at, :now), updated_at = :now,
      lock_version = coalesce(lock_version, 0) + 1
  -- The candidate condition again: a build changed by someone else after this statement's snapshot is re-checked
  -- by PostgreSQL when its row is locked (EvalPlanQual). One no longer a candidate is never overwritten; one still
  -- a candidate is dropped in its new version (what GitLab's retry_lock achieves).
  WHERE id = ANY(ARRAY(SELECT id FROM picked))
    AND {{ outdated_canceling }}
  RETURNING id, runner_id
),
-- A build leaving canceling leaves GitLab's queues: every row of its id, whatever partition the row claims
-- (Ci::Build#all_queuing_entries and #all_runtime_metadata, by build_id). The rows are found in GitLab's build_id
-- index, then deleted by id. ORDER BY build_id is an order only that index gives: without it, a queue whose
-- statistics say it is empty (as autovacuum leaves a queue it saw drained) was read whole, through the
-- (partition_id, build_id) index, for every batch.
pending AS (
  DELETE FROM ci_pending_builds WHERE id = ANY(ARRAY(
    SELECT id FROM ci_pending_builds WHERE build_id = ANY(ARRAY(SELECT id FROM dropped)) ORDER BY build_id))
),
running AS (
  DELETE FROM ci_running_builds WHERE id = ANY(ARRAY(
    SELECT id FROM ci_running_builds WHERE build_id = ANY(ARRAY(SELECT id FROM dropped)) ORDER BY build_id))
)
-- Each build picked, in the batch's order: dropped, or passed over (it changed meanwhile).
SELECT picked.id, dropped.id IS NOT NULL AS dropped, dropped.runner_id
FROM picked LEFT JOIN dropped USING (id)
ORDER BY picked.created_at, picked.project_id, picked.id
