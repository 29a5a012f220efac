-- One batch of Ci::BulkDeleteExpiredJobArtifactsWorker (seed 004) when GitLab is decomposed: the artifacts are in
-- ci, the flags in main (feature_gates). The worker read the flags there just before (read_flags.sql) and binds
-- them; the rest is delete_expired_batch.sql's, line for line.
WITH flags AS (
  SELECT CAST(:enabled AS boolean) AS enabled, CAST(:max_buckets AS integer) AS max_buckets
),
{{ delete_and_record }}
