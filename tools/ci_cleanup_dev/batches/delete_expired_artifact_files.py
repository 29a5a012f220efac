"""delete_expired_artifact_files' workshop: nothing of its own.

Its demo rows are the stored files schedule_bulk_delete_job_artifacts' rows queue (that module seeds both). The
benchmark has no entries for it (it never had): its work is removing stored files, and test_registry lists it as
exempt from the benchmark's tables.
"""

seed = None  # schedule_bulk_delete_job_artifacts.seed writes its ci_deleted_objects rows
