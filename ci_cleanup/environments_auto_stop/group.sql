-- Deployment.last_finished_deployment_group_for_environment (last_deployment_group_for_environment before GitLab
-- 17.0): the deployments of the group's jobs (``jobs``: environment_id, job_id, commit_id), deployable_type
-- 'CommitStatus', each environment's own (group_by(&:environment_id)), with the on_stop naming its stop action
-- (Deployment#stop_action) and the pipeline it is found in. Named {{ group }} by find_group.sql and stop_batch.sql.
SELECT jobs.environment_id, deployments.on_stop, jobs.commit_id
FROM jobs
JOIN deployments
  ON deployments.deployable_type = 'CommitStatus'
 AND deployments.deployable_id = jobs.job_id
 AND deployments.environment_id = jobs.environment_id
