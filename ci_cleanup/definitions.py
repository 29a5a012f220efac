"""The Dagster code location: every registered batch's job and schedule, and the resources they share."""

from __future__ import annotations

import os

from dagster import AssetSpec, Definitions, EnvVar, in_process_executor, mem_io_manager

from .batches import BATCHES
from .prune_dagster_history.service import history_asset_key
from .resources import GitLabDatabase, GitLabRedis, RunOptions
from .sensors import alert_sensors

jobs = [batch.job for batch in BATCHES]
# The tables the batches change, declared so that each batch's per-batch observations are plotted on them in the
# UI: GitLab's, and the instance's own history (prune_dagster_history's batches, and each job's daily totals,
# which outlive its runs).
assets = [
    *(AssetSpec(list(b.asset), group_name="gitlab" if b.asset[0] == "gitlab" else "history", description=b.about)
      for b in BATCHES),
    *(AssetSpec(history_asset_key(j.name), group_name="history", description=f"Daily totals of {j.name}'s runs")
      for j in jobs),
]


def resources() -> dict:
    """Resources from the environment; secrets stay in env vars and never enter run config."""
    return {
        # URLs unset: each resource reads its variables (or GitLab's files) when a run starts, never run config.
        "gitlab_db": GitLabDatabase(),
        "gitlab_redis": GitLabRedis(
            queues_url=EnvVar("CI_CLEANUP_REDIS_QUEUES_URL") if os.environ.get("CI_CLEANUP_REDIS_QUEUES_URL") else None,
        ),
        "run_options": RunOptions(),
        # The ops' outputs (a plan, the totals) stay in the run's process, where every op runs: no file written and
        # read back per output (five events of the run's log). A run is re-executed whole, never from a later step:
        # Dagster refuses that at the run's start, and rightly, since the step would act under a lease the first op
        # took for another run.
        "io_manager": mem_io_manager,
    }


defs = Definitions(
    assets=assets,
    jobs=jobs,
    schedules=[batch.schedule for batch in BATCHES],
    sensors=alert_sensors,
    resources=resources(),
    # Every job runs its ops in the run's own process: a process per op would import everything again
    # (seconds per run with nothing to do). schedule_bulk_delete_job_artifacts' bucket workers are threads of one op.
    executor=in_process_executor,
)
