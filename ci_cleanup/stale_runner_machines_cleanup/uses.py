"""The columns this job reads or writes (its service's statements), the only ones its start-up check requires:
not runner_type, sharding_key_id or creation_state, which GitLab's StaleManagersCleanupService never reads."""

USES = {"ci_runner_machines": ("id", "created_at", "contacted_at")}
