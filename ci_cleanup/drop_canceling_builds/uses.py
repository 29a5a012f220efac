"""The columns this job reads or writes (its .sql files), the only ones its start-up check requires."""

USES = {
    "ci_builds": ("id", "type", "status", "created_at", "updated_at", "project_id", "runner_id",
                  "failure_reason", "finished_at", "lock_version"),
    # A dropped build's queue rows, found by build_id whatever partition they claim, deleted by id.
    "ci_pending_builds": ("id", "build_id"),
    "ci_running_builds": ("id", "build_id"),
}
