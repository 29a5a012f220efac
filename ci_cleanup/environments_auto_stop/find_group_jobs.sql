-- The ci database's part of each environment's deployment group (group_jobs.sql), read when GitLab is decomposed
-- and in a dry run: the environments given (their ids and their last deployment's deployable, in step), a row per
-- job of the group.
WITH wanted AS (
  SELECT *
  FROM unnest(CAST(:environment_ids AS bigint[]), CAST(:deployable_ids AS bigint[]))
    AS wanted (environment_id, deployable_id)
)
SELECT wanted.environment_id, job.id AS job_id, job.commit_id
FROM wanted
{{ group_jobs }}
