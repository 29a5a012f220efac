-- Environment#stop_actions = last_finished_deployment_group.map(&:stop_action).compact: for each deployment of the
-- group (``wanted``: environment, deployable, on_stop; group.sql), Deployment#stop_action, the Ci::Build rows of its
-- deployable's pipeline named its on_stop. Named {{ stop_actions }}.
JOIN p_ci_builds AS deployable ON deployable.id = wanted.deployable_id
JOIN p_ci_builds AS stop_action
  ON stop_action.commit_id = deployable.commit_id
 AND stop_action.name = wanted.on_stop
 AND stop_action.type = 'Ci::Build'
