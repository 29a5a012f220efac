"""The registry: every batch this code location runs, one entry each.

The code location (jobs, schedules, the GitLab tables in the catalog), the demo dataset, the benchmark
and the tests' reliability scenarios all read this tuple: a new batch is its package (``uses.py``,
``service.py``, ``job.py``), one entry here, and its workshop module (demo rows, benchmark entries) in
``tools/ci_cleanup_dev/batches/``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dagster import JobDefinition, ScheduleDefinition

from . import lease as leases
from .drop_canceling_builds import job as drop_job
from .environments_auto_stop import job as stop_job
from .prune_dagster_history import job as prune_job
from .schedule_bulk_delete_job_artifacts import files_job
from .schedule_bulk_delete_job_artifacts import job as artifacts_job
from .stale_runner_machines_cleanup import job as stale_job
from .stuck_export_jobs import job as export_job


@dataclass(frozen=True)
class Batch:
    job: JobDefinition
    schedule: ScheduleDefinition
    report_op: str  # the last op: the run's totals, and a dry run's would_… (runs.report_run)
    asset: tuple[str, ...]  # what its batches change and are observed on: ("gitlab", <GitLab table>), …
    about: str  # what it does there, for the catalog

    @property
    def name(self) -> str:
        return self.job.name

    @property
    def lease(self) -> leases.Lease | None:
        """The ``ExclusiveLease`` its runs take, as its job declares it."""
        return leases.of_job(self.name)

    @property
    def table(self) -> str:
        return self.asset[-1]


BATCHES = (
    Batch(drop_job.drop_canceling_builds, drop_job.drop_canceling_builds_schedule, "report_dropped_builds",
          drop_job.ASSET, "Builds; drop_canceling_builds fails stuck canceling ones"),
    Batch(stale_job.stale_runner_machines_cleanup, stale_job.stale_runner_machines_cleanup_schedule,
          "report_deleted_runner_machines", stale_job.ASSET,
          "Runner machines; stale_runner_machines_cleanup deletes those silent for 7 days"),
    Batch(stop_job.environments_auto_stop, stop_job.environments_auto_stop_schedule, "report_stopped_environments",
          stop_job.ASSET, "Environments; environments_auto_stop stops those past auto_stop_at"),
    Batch(export_job.stuck_export_jobs, export_job.stuck_export_jobs_schedule, "report_stuck_export_jobs",
          export_job.ASSET, "Project export jobs; stuck_export_jobs fails those whose Sidekiq job is gone"),
    Batch(artifacts_job.schedule_bulk_delete_job_artifacts, artifacts_job.schedule_bulk_delete_job_artifacts_schedule,
          "report_destroyed_job_artifacts", artifacts_job.ARTIFACTS,
          "Job artifacts; schedule_bulk_delete_job_artifacts deletes expired unlocked ones by bucket"),
    Batch(files_job.delete_expired_artifact_files, files_job.delete_expired_artifact_files_schedule,
          "report_removed_artifact_files", artifacts_job.DELETED_OBJECTS,
          "Stored files of deleted artifacts, waiting for removal (delete_expired_artifact_files)"),
    Batch(prune_job.prune_dagster_history, prune_job.prune_dagster_history_schedule, "report_pruned_runs",
          prune_job.ASSET, "Dagster's runs; prune_dagster_history deletes old ones"),
)
BY_NAME = {batch.name: batch for batch in BATCHES}
