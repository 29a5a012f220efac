"""The seeds' monitoring tables as Dagster sensors; each alert goes through :func:`send_alert`.

| seed row | here |
|---|---|
| run time over the lease TTL (000: 30 min, 003: 50 min, 004: 60 s) | ``dagster/max_runtime`` tag on the job + run monitoring in dagster.yaml fails the run, then ``run_failed_alert`` |
| errors / repeated failures (001, 003; 004: 3 in a row) | ``run_failed_alert`` on every failure, ``repeated_failures_alert`` at 3 in a row |
| MAX_DELETIONS reached every run (001) | ``max_deletions_backlog_alert`` |
| (beyond the seeds) a lease that never expires, or a job skipped run after run | ``lease_held_alert`` |
"""

from __future__ import annotations

from dagster import (
    DagsterRunStatus,
    DefaultSensorStatus,
    RunFailureSensorContext,
    RunsFilter,
    RunStatusSensorContext,
    run_failure_sensor,
    run_status_sensor,
)

from .alerts import send_alert
from .runs import LEASE_WITHOUT_TTL_TAG, MAX_DELETIONS_TAG, SKIPPED_TAG

FAILURES_IN_A_ROW = 3  # seed 004: 連続3回失敗
BACKLOG_RUNS = 3  # seed 001: 毎回MAX_DELETIONS到達 — three hourly runs in a row
SKIPPED_RUNS = 3  # runs in a row that did nothing because the lease was held


def _last_runs(context, job_name: str, limit: int, statuses=(DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE)):
    return context.instance.get_runs(RunsFilter(job_name=job_name, statuses=list(statuses)), limit=limit)


@run_failure_sensor(default_status=DefaultSensorStatus.RUNNING, description="Alert on every failed ci_cleanup run")
def run_failed_alert(context: RunFailureSensorContext):
    run = context.dagster_run
    send_alert(
        "run_failed", f"ci_cleanup: {run.job_name} run {run.run_id} failed: {context.failure_event.message}",
        job=run.job_name, run_id=run.run_id,
    )


@run_failure_sensor(
    default_status=DefaultSensorStatus.RUNNING, description=f"Alert when a job failed {FAILURES_IN_A_ROW} runs in a row"
)
def repeated_failures_alert(context: RunFailureSensorContext):
    run = context.dagster_run
    runs = _last_runs(context, run.job_name, FAILURES_IN_A_ROW)
    if len(runs) == FAILURES_IN_A_ROW and all(r.status == DagsterRunStatus.FAILURE for r in runs):
        send_alert(
            "repeated_failures", f"ci_cleanup: {run.job_name} failed {FAILURES_IN_A_ROW} runs in a row",
            job=run.job_name, run_ids=[r.run_id for r in runs],
        )


@run_status_sensor(
    run_status=DagsterRunStatus.SUCCESS, default_status=DefaultSensorStatus.RUNNING,
    description=f"Alert when a cleanup hit its deletion cap {BACKLOG_RUNS} runs in a row: a backlog is building up",
)
def max_deletions_backlog_alert(context: RunStatusSensorContext):
    run = context.dagster_run
    if run.tags.get(MAX_DELETIONS_TAG) != "true":
        return
    runs = _last_runs(context, run.job_name, BACKLOG_RUNS, statuses=[DagsterRunStatus.SUCCESS])
    if len(runs) == BACKLOG_RUNS and all(r.tags.get(MAX_DELETIONS_TAG) == "true" for r in runs):
        send_alert(
            "max_deletions_backlog",
            f"ci_cleanup: {run.job_name} reached its deletion cap {BACKLOG_RUNS} runs in a row; a backlog is building up",
            job=run.job_name, run_ids=[r.run_id for r in runs],
        )


@run_status_sensor(
    run_status=DagsterRunStatus.SUCCESS, default_status=DefaultSensorStatus.RUNNING,
    description=f"Alert when a run skipped on a lease that has no TTL, or a job skipped {SKIPPED_RUNS} runs in a row",
)
def lease_held_alert(context: RunStatusSensorContext):
    """GitLab skips a run whose lease is held, and so do the jobs; a lease with no expiry (set by hand, or by
    a tool that forgot EX) would turn the job off for ever behind green runs."""
    run = context.dagster_run
    if not run.tags.get(SKIPPED_TAG):
        return
    if key := run.tags.get(LEASE_WITHOUT_TTL_TAG):
        send_alert(
            "lease_without_ttl",
            f"ci_cleanup: {run.job_name} skipped because lease {key} is held and has no TTL: it never expires, so "
            "every run will skip; delete the key once no GitLab process holds it",
            job=run.job_name, run_id=run.run_id, lease=key,
        )
    runs = _last_runs(context, run.job_name, SKIPPED_RUNS, statuses=[DagsterRunStatus.SUCCESS])
    if len(runs) == SKIPPED_RUNS and all(r.tags.get(SKIPPED_TAG) for r in runs):
        send_alert(
            "skipped_in_a_row",
            f"ci_cleanup: {run.job_name} skipped {SKIPPED_RUNS} runs in a row ({run.tags[SKIPPED_TAG]})",
            job=run.job_name, run_ids=[r.run_id for r in runs],
        )


alert_sensors = [run_failed_alert, repeated_failures_alert, max_deletions_backlog_alert, lease_held_alert]
