"""prune_dagster_history's workshop: nothing of its own.

Its rows are Dagster's own runs and events, not GitLab's: the demo's runs are its rows, and the benchmark
measures it apart, on cloned runs (:mod:`ci_cleanup_dev.bench.prune`).
"""

seed = None  # the demo's own runs are its rows

# The per-job tables it is left out of, each with why (ci_cleanup_tests/test_registry.py reads these).
EXEMPT = {
    "SEEDERS": "its rows are the Dagster instance's own runs and events: the demo's runs are its rows",
    "RUNNERS": "on Dagster's tables, not GitLab's: measured apart, on cloned runs (ci_cleanup_dev.bench.prune)",
    "FLOORS": "on Dagster's tables, not GitLab's: measured apart (ci_cleanup_dev.bench.prune)",
    "SCOPED": "on Dagster's tables, not GitLab's: measured apart (ci_cleanup_dev.bench.prune)",
    "SCENARIOS": "on Dagster's tables: test_prune_dagster_history has its own trials of a held lease and of a run "
                 "killed mid-deletion",
    "HANDOVERS": "no GitLab cron does its work: it bounds this project's own Dagster history",
}
