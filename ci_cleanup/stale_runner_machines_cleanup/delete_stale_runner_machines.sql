-- Ci::Runners::StaleManagersCleanupService, one sub-batch (seed 001): Ci::RunnerManager.id_in(stale.limit(100))
-- .delete_all. Stale (Ci::RunnerManager.stale, both inclusive): created, and last contacted if ever, at or before
-- the deadline, 7 days ago. One statement, so one transaction: the sub-batch is deleted whole or not at all.
DELETE FROM ci_runner_machines
WHERE id = ANY(ARRAY(
    -- The stale ids as two ordered scans of GitLab's (contacted_at DESC, id DESC) index, so a sub-batch reads what
    -- it deletes: last contacted at or before the deadline, then never contacted. A plain LIMIT over the OR is a
    -- sequential scan that re-reads the rows earlier sub-batches left dead: its cost grows with the table.
    SELECT id FROM (
      (SELECT id FROM ci_runner_machines WHERE contacted_at <= :deadline AND created_at <= :deadline
       ORDER BY contacted_at DESC, id DESC LIMIT :limit)
      UNION ALL
      (SELECT id FROM ci_runner_machines WHERE contacted_at IS NULL AND created_at <= :deadline
       ORDER BY contacted_at DESC, id DESC LIMIT :limit)
    ) AS stale
    LIMIT :limit))
  -- The stale condition repeated on the DELETE itself: a runner that checks in (contacted_at moves to now) after the
  -- ids were read is re-checked by PostgreSQL when its row is locked, and kept. The ids alone would be re-checked
  -- against the array read before, and the live runner deleted.
  AND {{ stale }}
-- The ids this statement deleted: a row another run deleted first is skipped by the re-check, never counted twice.
RETURNING id
