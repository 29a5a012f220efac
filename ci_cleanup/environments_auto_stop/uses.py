"""The columns this job reads or writes (its service's statements), the only ones its start-up check requires."""

from ..gitlab.schema import where_present

USES = {
    "environments": ("id", "state", "auto_stop_at", where_present("auto_stop_setting"), "updated_at"),
    "deployments": ("id", "environment_id", "status", "deployable_id", "on_stop"),
    # The stop actions: found by pipeline and name, played (status, queued_at, lock_version), queued.
    "ci_builds": ("id", "commit_id", "name", "type", "status", "queued_at", "updated_at", "lock_version",
                  "project_id", "partition_id"),
    "ci_pending_builds": ("build_id", "project_id", "partition_id"),
}
