"""prune_dagster_history's workshop: nothing of its own.

Its rows are Dagster's own runs and events, not GitLab's: the demo's runs are its rows, and the benchmark
measures it apart, on cloned runs (:mod:`ci_cleanup_dev.bench.prune`).
"""

seed = None  # the demo's own runs are its rows
