-- The jobs whose deployments make an environment's deployment group: the latest (not retried: CommitStatus.latest,
-- retried false or NULL) jobs of the pipeline of ``wanted``'s deployable (its last finished deployment's job, the last
-- successful one's before GitLab 17.0), finished from 17.0 (Pipeline#latest_finished_jobs: success, failed,
-- canceled), successful before (#latest_successful_builds). Only jobs have deployments, so the pipeline's other rows
-- (commit_id) need no type. Named {{ group_jobs }} by find_group_jobs.sql and stop_batch.sql.
JOIN p_ci_builds AS last_deployable ON last_deployable.id = wanted.deployable_id
JOIN p_ci_builds AS job
  ON job.commit_id = last_deployable.commit_id
 AND job.retried IS NOT TRUE
 AND job.status IN ('success', 'failed', 'canceled')  -- if ci_running_builds.runner_owner_namespace_xid
 AND job.status = 'success'  -- unless ci_running_builds.runner_owner_namespace_xid
