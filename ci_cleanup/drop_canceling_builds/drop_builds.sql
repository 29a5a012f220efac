-- Ci::StuckBuilds::DropHelpers#drop_build for builds read earlier (the per-build path after a failed batch): each
-- dropped if it is still canceling and outdated, with the failure reason given (the run's: 3,
-- stuck_or_timeout_failure, or 28, no_updates_canceling; 12, data_integrity_failure: GitLab's doom! when the drop
-- failed).
WITH dropped AS (
  UPDATE p_ci_builds
  SET status = 'failed', failure_reason = :failure_reason, finished_at = coalesce(finished_at, :now),
      updated_at = :now, lock_version = coalesce(lock_version, 0) + 1
  -- The candidate condition again, re-checked by PostgreSQL on a row changed meanwhile (EvalPlanQual): a build no
  -- longer a candidate is never overwritten.
  WHERE id = ANY(CAST(:ids AS bigint[]))
    AND {{ outdated_canceling }}
  RETURNING id, runner_id
),
-- Every queue row of a dropped build goes, by build_id, whatever partition it claims (as GitLab removes them),
-- found in GitLab's build_id index (the order only it gives, as in drop_canceling_builds.sql), deleted by id.
pending AS (
  DELETE FROM ci_pending_builds WHERE id = ANY(ARRAY(
    SELECT id FROM ci_pending_builds WHERE build_id = ANY(ARRAY(SELECT id FROM dropped)) ORDER BY build_id))
),
running AS (
  DELETE FROM ci_running_builds WHERE id = ANY(ARRAY(
    SELECT id FROM ci_running_builds WHERE build_id = ANY(ARRAY(SELECT id FROM dropped)) ORDER BY build_id))
)
SELECT given.id, dropped.id IS NOT NULL AS dropped, dropped.runner_id
FROM unnest(CAST(:ids AS bigint[])) WITH ORDINALITY AS given (id, position) LEFT JOIN dropped USING (id)
ORDER BY given.position
