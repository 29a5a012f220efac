-- The worker's re-read of the jobs whose Sidekiq job is completed (seed 002: the status key is gone), given as the
-- (id, jid) pairs first read; writes nothing (a dry run, and jobs a chunk's UPDATE passed over). The rule, the same
-- as fail_stuck.sql's, an outcome per job:
--   left               no longer queued or started (0, 1): it finished meanwhile;
--   reenqueued         its jid changed since the first read: the export was enqueued again;
--   parallel_in_grace  it has project_relation_exports rows and was created after the grace cutoff (now - 6 h,
--                      GitLab's EXPORT_JOBS_EXPIRATION);
--   stuck              to be failed.
-- The EXISTS is probed only for a young job, one index probe each (OFFSET 0 keeps it from becoming a hashed
-- subplan that reads the whole table, which PostgreSQL picks when its statistics say the table is empty).
WITH checked AS (
  SELECT * FROM unnest(CAST(:ids AS bigint[]), CAST(:jids AS text[])) AS checked (id, jid)
)
SELECT checked.id,
       checked.jid,
       CASE
         WHEN project_export_jobs.id IS NULL THEN 'left'
         WHEN project_export_jobs.jid <> checked.jid THEN 'reenqueued'
         WHEN project_export_jobs.created_at > :grace_cutoff
              AND EXISTS (SELECT 1 FROM project_relation_exports
                          WHERE project_relation_exports.project_export_job_id = project_export_jobs.id
                          OFFSET 0)
           THEN 'parallel_in_grace'
         ELSE 'stuck'
       END AS outcome
FROM checked
LEFT JOIN project_export_jobs ON project_export_jobs.id = checked.id AND {{ enqueued }}
ORDER BY checked.id
