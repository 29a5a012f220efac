"""The Dagster code location: every batch's job and schedule, and the resources they share."""

from __future__ import annotations

import os

from dagster import AssetSpec, Definitions, EnvVar, in_process_executor

from .drop_canceling_builds.job import drop_canceling_builds, drop_canceling_builds_schedule
from .environments_auto_stop.job import environments_auto_stop, environments_auto_stop_schedule
from .prune_dagster_history.job import prune_dagster_history, prune_dagster_history_schedule
from .prune_dagster_history.service import history_asset_key
from .resources import GitLabDatabase, GitLabRedis, RunOptions
from .schedule_bulk_delete_job_artifacts.job import (
    delete_expired_artifact_files,
    delete_expired_artifact_files_schedule,
    schedule_bulk_delete_job_artifacts,
    schedule_bulk_delete_job_artifacts_schedule,
)
from .sensors import alert_sensors
from .stale_runner_machines_cleanup.job import stale_runner_machines_cleanup, stale_runner_machines_cleanup_schedule
from .stuck_export_jobs.job import stuck_export_jobs, stuck_export_jobs_schedule

# GitLab's tables, declared so that each batch's per-batch observations are plotted on them in the UI.
gitlab_tables = [
    AssetSpec(["gitlab", "ci_builds"], group_name="gitlab", description="Builds; drop_canceling_builds fails stuck canceling ones"),
    AssetSpec(["gitlab", "environments"], group_name="gitlab", description="Environments; environments_auto_stop stops those past auto_stop_at"),
    AssetSpec(["gitlab", "ci_runner_machines"], group_name="gitlab", description="Runner machines; stale_runner_machines_cleanup deletes those silent for 7 days"),
    AssetSpec(["gitlab", "project_export_jobs"], group_name="gitlab", description="Project export jobs; stuck_export_jobs fails those whose Sidekiq job is gone"),
    AssetSpec(["gitlab", "ci_job_artifacts"], group_name="gitlab", description="Job artifacts; schedule_bulk_delete_job_artifacts deletes expired unlocked ones by bucket"),
    AssetSpec(["gitlab", "ci_deleted_objects"], group_name="gitlab", description="Stored files of deleted artifacts, waiting for removal (delete_expired_artifact_files)"),
]

jobs = [
    drop_canceling_builds, stale_runner_machines_cleanup, environments_auto_stop, stuck_export_jobs,
    schedule_bulk_delete_job_artifacts, delete_expired_artifact_files, prune_dagster_history,
]
# The instance's own history: prune_dagster_history's batches, and each job's daily totals, which outlive its runs.
history = [
    AssetSpec(
        ["dagster", "runs"], group_name="history", description="Dagster's runs; prune_dagster_history deletes old ones"
    ),
    *(
        AssetSpec(history_asset_key(j.name), group_name="history", description=f"Daily totals of {j.name}'s runs")
        for j in jobs
    ),
]


def resources() -> dict:
    """Resources from the environment; secrets stay in env vars and never enter run config."""
    return {
        # url defaults to EnvVar("CI_CLEANUP_DATABASE_URL") / EnvVar("CI_CLEANUP_REDIS_URL") in the class.
        "gitlab_db": GitLabDatabase(),
        "gitlab_redis": GitLabRedis(
            queues_url=EnvVar("CI_CLEANUP_REDIS_QUEUES_URL") if os.environ.get("CI_CLEANUP_REDIS_QUEUES_URL") else None,
        ),
        "run_options": RunOptions(),
    }


defs = Definitions(
    assets=[*gitlab_tables, *history],
    jobs=jobs,
    schedules=[
        drop_canceling_builds_schedule, stale_runner_machines_cleanup_schedule, environments_auto_stop_schedule,
        stuck_export_jobs_schedule, schedule_bulk_delete_job_artifacts_schedule, delete_expired_artifact_files_schedule,
        prune_dagster_history_schedule,
    ],
    sensors=alert_sensors,
    resources=resources(),
    # Linear jobs run their ops in the run's own process: a process per op would import everything again
    # (seconds per run with nothing to do). schedule_bulk_delete_job_artifacts keeps its multiprocess executor.
    executor=in_process_executor,
)
