"""The seeds' ``Gitlab::Metrics`` counters, pushed to a Prometheus Pushgateway when
CI_CLEANUP_PUSHGATEWAY_URL is set (off by default). Plain HTTP, text exposition format."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

PUSHGATEWAY_ENV = "CI_CLEANUP_PUSHGATEWAY_URL"

log = logging.getLogger("ci_cleanup.metrics")


def push_run_metrics(job_name: str, counters: Mapping[str, int | float]) -> None:
    url = os.environ.get(PUSHGATEWAY_ENV)
    if not url or not counters:
        return
    import urllib.request  # only when a Pushgateway is set: a run's process otherwise does not import it

    body = "".join(f"ci_cleanup_{name} {value}\n" for name, value in counters.items()).encode()
    request = urllib.request.Request(
        f"{url.rstrip('/')}/metrics/job/ci_cleanup/dagster_job/{job_name}", data=body, method="PUT",
        headers={"Content-Type": "text/plain; version=0.0.4"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
    except OSError as e:  # metrics are best effort: the run's own result stands
        log.warning("Could not push metrics for %s to the Pushgateway: %s", job_name, e)
