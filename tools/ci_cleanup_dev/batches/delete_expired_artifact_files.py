"""delete_expired_artifact_files' workshop: nothing of its own.

Its demo rows are the stored files schedule_bulk_delete_job_artifacts' rows queue (that module seeds both). The
benchmark has no entries for it (it never had): its work is removing stored files, and test_registry lists it as
exempt from the benchmark's tables (``EXEMPT``).
"""

seed = None  # schedule_bulk_delete_job_artifacts.seed writes its ci_deleted_objects rows

# The per-job tables it is left out of, each with why (ci_cleanup_tests/test_registry.py reads these).
EXEMPT = {
    "SEEDERS": "schedule_bulk_delete_job_artifacts' module seeds the ci_deleted_objects rows whose files it removes",
    "RUNNERS": "never benchmarked as a SQL batch: its work is removing stored files, one storage call a row "
               "(python -m ci_cleanup_dev.bench.objects measures that)",
    "FLOORS": "no SQL floor bounds a storage call a row (see RUNNERS)",
    "SCOPED": "not launched by the benchmark (see RUNNERS)",
}
