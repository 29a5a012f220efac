-- The cron worker's gate and Ci::BulkDeleteExpiredJobArtifactsWorker.max_running_jobs_limit, in one row:
-- a flag is on when feature_gates has its boolean gate set to true (Feature.enabled? with no actor).
-- max_buckets: 10 with bulk_delete_job_artifacts_high_concurrency, else 5.
SELECT coalesce(bool_or(feature_key = 'bulk_delete_job_artifacts'), false) AS enabled,
       CASE WHEN bool_or(feature_key = 'bulk_delete_job_artifacts_high_concurrency') THEN 10 ELSE 5 END AS max_buckets
FROM feature_gates
WHERE feature_key IN ('bulk_delete_job_artifacts', 'bulk_delete_job_artifacts_high_concurrency')
  AND key = 'boolean' AND value = 'true'
