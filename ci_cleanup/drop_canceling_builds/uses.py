"""The columns this job reads or writes (its service's statements), the only ones its start-up check requires."""

USES = {
    "ci_builds": ("id", "partition_id", "type", "status", "created_at", "updated_at", "project_id", "runner_id",
                  "failure_reason", "finished_at", "lock_version"),
    # A dropped build's queue rows, looked up by (partition_id, build_id) and deleted by id.
    "ci_pending_builds": ("id", "build_id", "partition_id"),
    "ci_running_builds": ("id", "build_id", "partition_id"),
}
