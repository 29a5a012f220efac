"""The columns this job reads or writes (its service's statements), the only ones its start-up check requires:
not the export job's user_id nor the relation exports' project_id, which it never reads."""

USES = {
    "project_export_jobs": ("id", "status", "jid", "created_at", "updated_at"),
    "project_relation_exports": ("project_export_job_id",),
}
