"""The seeds' ``Gitlab::Metrics`` counters, pushed to a Prometheus Pushgateway when CI_CLEANUP_PUSHGATEWAY_URL is
set (off by default), with prometheus_client: one gauge per total of the run, typed and with its help text.

Gauges, not counters: each is the last run's total, which the Pushgateway keeps until the job's next run replaces
the group (``ci_cleanup`` / ``dagster_job=<job>``); Prometheus' ``increase()`` would misread a total per run.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

PUSHGATEWAY_ENV = "CI_CLEANUP_PUSHGATEWAY_URL"
# What the totals every job reports mean; any other total of a job is described by its name.
HELP = {
    "rows_changed": "Rows the job's last run changed in GitLab's database",
    "rows_with_errors": "Rows the job's last run stepped over (an error on the row, a refused path)",
    "batches": "Batches the job's last run committed",
}

log = logging.getLogger("ci_cleanup.metrics")


def push_run_metrics(job_name: str, counters: Mapping[str, int | float]) -> None:
    url = os.environ.get(PUSHGATEWAY_ENV)
    if not url or not counters:
        return
    # Only when a Pushgateway is set: a run's process otherwise does not import it.
    from prometheus_client import CollectorRegistry, Gauge, push_to_gateway

    registry = CollectorRegistry()
    for name, value in counters.items():
        help_text = HELP.get(name, f"{name.replace('_', ' ').capitalize()}: a total of the job's last run")
        Gauge(f"ci_cleanup_{name}", help_text, registry=registry).set(value)
    try:
        push_to_gateway(url, job="ci_cleanup", grouping_key={"dagster_job": job_name}, registry=registry, timeout=10)
    except OSError as e:  # metrics are best effort: the run's own result stands
        log.warning("Could not push metrics for %s to the Pushgateway: %s", job_name, e)
