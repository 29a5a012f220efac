-- The main database's part of each environment's deployment group (group.sql), read when GitLab is decomposed (in
-- the transaction that holds the batch's lock) and in a dry run: the group's jobs (find_group_jobs.sql's rows, in
-- step), a row per deployment of the group.
WITH jobs AS (
  SELECT *
  FROM unnest(CAST(:environment_ids AS bigint[]), CAST(:job_ids AS bigint[]), CAST(:commit_ids AS bigint[]))
    AS jobs (environment_id, job_id, commit_id)
)
{{ group }}
