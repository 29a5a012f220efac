-- One batch of Ci::BulkDeleteExpiredJobArtifactsWorker (seed 004), on one database: one statement, its own
-- transaction, so the artifacts are deleted and their files recorded both or neither.
--
-- flags: GitLab's worker reads them before each batch (Feature.enabled? and max_running_jobs_limit: 10 buckets
-- with the high-concurrency flag, else 5), with read_flags.sql's text (flags.sql, its defaults bound); read here, the batch
-- deletes nothing once the feature is off or the bucket is no longer below max_buckets (a scale-down).
WITH {{ flags }},
{{ delete_and_record }}
