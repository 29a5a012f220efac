-- The candidates, a chunk at a time (seed 002: ProjectExportJob.with_status([:started, :queued]), pluck(:jid, :id)):
-- queued (0) or started (1) export jobs after the cursor, by id, through GitLab's index_project_export_jobs_on_status.
SELECT id, jid
FROM project_export_jobs
WHERE {{ enqueued }} AND id > :after_id
ORDER BY id
LIMIT :limit
