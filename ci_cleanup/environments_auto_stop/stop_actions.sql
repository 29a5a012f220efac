-- Environment#stop_actions: the Ci::Build rows of the deployable's pipeline (``wanted``: each environment's last
-- finished deployment's deployable and on_stop) whose name is the deployment's on_stop. Named {{ stop_actions }}.
JOIN p_ci_builds AS deployable ON deployable.id = wanted.deployable_id
JOIN p_ci_builds AS stop_action
  ON stop_action.commit_id = deployable.commit_id
 AND stop_action.name = wanted.on_stop
 AND stop_action.type = 'Ci::Build'
