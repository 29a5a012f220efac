"""The columns each of this package's jobs reads or writes (their statements), the only ones their start-up
checks require."""

from ..gitlab.schema import where_present

# schedule_bulk_delete_job_artifacts: the expired artifacts deleted, their files recorded in ci_deleted_objects
# (created_at is left to its default), the flags read.
USES = {
    "ci_job_artifacts": ("id", "project_id", "job_id", "file_type", "locked", "expire_at", "file", "file_store",
                         "file_final_path", "created_at", "size"),
    "ci_deleted_objects": ("id", "file_store", "store_dir", "file", where_present("project_id"), "pick_up_at"),
    # Feature.enabled?: a flag stored in features is decided by its gates.
    "features": ("key",),
    "feature_gates": ("feature_key", "key", "value"),
}
# delete_expired_artifact_files: the due rows read, removed once their files are gone.
FILES_USES = {"ci_deleted_objects": ("id", "file_store", "store_dir", "file", "pick_up_at")}
