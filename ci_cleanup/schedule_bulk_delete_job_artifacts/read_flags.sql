-- The cron worker's gate and Ci::BulkDeleteExpiredJobArtifactsWorker.max_running_jobs_limit, in one row (flags.sql).
WITH {{ flags }}
SELECT enabled, max_buckets, persisted, gated FROM flags
