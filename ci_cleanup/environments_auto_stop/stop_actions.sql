-- Environment#stop_actions = last_finished_deployment_group.map(&:stop_action).compact: for each deployment of the
-- group (``wanted``: environment, on_stop, commit_id; group.sql), Deployment#stop_action, the Ci::Build rows of its
-- deployable's pipeline named its on_stop. The deployable is a job of the group, so its pipeline (commit_id) comes
-- with the group, not read again. Named {{ stop_actions }}.
JOIN p_ci_builds AS stop_action
  ON stop_action.commit_id = wanted.commit_id
 AND stop_action.name = wanted.on_stop
 AND stop_action.type = 'Ci::Build'
