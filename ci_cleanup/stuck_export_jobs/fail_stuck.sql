-- StuckExportJobsWorker#mark_stuck_jobs_as_failed! (seed 002) for the jobs whose Sidekiq job is completed, given
-- as the (id, jid) pairs first read: reread_completed.sql's rule, and each job it calls stuck failed
-- (fail_op: status 3 = failed, updated_at = now). One statement a chunk, all or nothing; a chunk the database
-- refuses is done again a job at a time, with this statement for one pair.
WITH checked AS (
  SELECT * FROM unnest(CAST(:ids AS bigint[]), CAST(:jids AS text[])) AS checked (id, jid)
),
reread AS (
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
),
-- The status and jid again on the row updated: a job finished or enqueued again after the statement's snapshot
-- is re-checked by PostgreSQL once it has the row's lock, and left as it is.
failed AS (
  UPDATE project_export_jobs
  SET status = 3, updated_at = :now
  FROM reread
  WHERE project_export_jobs.id = reread.id AND reread.outcome = 'stuck'
    AND {{ enqueued }} AND project_export_jobs.jid = reread.jid
  RETURNING project_export_jobs.id
)
-- An outcome per job: failed, or the re-read's (stuck: the UPDATE found it changed meanwhile).
SELECT reread.id, CASE WHEN failed.id IS NULL THEN reread.outcome ELSE 'failed' END AS outcome
FROM reread
LEFT JOIN failed ON failed.id = reread.id
ORDER BY reread.id
