"""``Ci::Runners::StaleMachinesCleanupCronWorker``: delete runner machines that stopped contacting GitLab."""
