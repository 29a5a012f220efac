-- A dry run: the artifacts a bucket's worker would delete now (the rule of delete_expired_batch.sql:
-- expired.sql AND MOD(project_id + job_id, max_buckets) = bucket),
-- how many, and the first of them by id.
WITH expired AS (
  SELECT id FROM p_ci_job_artifacts
  WHERE {{ expired }}
    AND CASE WHEN MOD(project_id::numeric + job_id, :max_buckets) = :bucket THEN true ELSE false END
)
SELECT (SELECT count(*) FROM expired) AS count,
       ARRAY(SELECT id FROM expired ORDER BY id LIMIT :ids_limit) AS ids
