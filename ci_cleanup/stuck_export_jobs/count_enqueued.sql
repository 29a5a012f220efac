-- ProjectExportJob.with_status([:started, :queued]) (seed 002: status IN (0, 1)), counted once a run, with the
-- first and last ids: the pages start at the first (never a walk through every finished export before it), and
-- how densely the enqueued jobs fill the ids between says whether the pages walk the primary key.
-- One scan of GitLab's index_project_export_jobs_on_status.
SELECT count(*) AS count, min(id) AS first_id, max(id) AS last_id
FROM project_export_jobs
WHERE {{ enqueued }}
