"""The columns this job reads or writes (its service's statements), the only ones its start-up check requires."""

from ..gitlab.schema import where_present

USES = {
    "environments": ("id", "project_id", "state", "auto_stop_at", where_present("auto_stop_setting"), "updated_at"),
    # The last finished deployment (the latest finished_at), and the deployment group: its pipeline's latest jobs'.
    "deployments": ("id", "environment_id", "status", "finished_at", "deployable_type", "deployable_id", "on_stop"),
    # The group's jobs (the pipeline's, not retried, finished); the stop actions: found by pipeline and name, played
    # (status, queued_at, lock_version), queued.
    "ci_builds": ("id", "commit_id", "retried", "name", "type", "status", "queued_at", "updated_at", "lock_version",
                  "project_id", "partition_id", "protected"),
    # Their queue rows as Ci::PendingBuild.upsert_from_build! writes them (args_from_build).
    "ci_pending_builds": ("build_id", "project_id", "partition_id", "protected", "namespace_id", "tag_ids",
                          "instance_runners_enabled", "namespace_traversal_ids"),
    # The project's part of a queue row, read in main with the pick.
    "projects": ("id", "namespace_id", "shared_runners_enabled", "pending_delete"),
    "namespaces": ("id", "traversal_ids"),
    "project_features": ("project_id", "builds_access_level"),
    "project_ci_cd_settings": ("project_id", "group_runners_enabled"),
}
# A build's tags (Ci::Build#tags_ids): p_ci_build_tags from GitLab 17.3, taggings before; the one the release has.
BUILD_TAGS = {"p_ci_build_tags": ("build_id", "partition_id", "tag_id")}
TAGGINGS = {"taggings": ("taggable_id", "taggable_type", "context", "tag_id")}
