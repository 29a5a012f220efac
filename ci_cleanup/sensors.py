"""Monitoring of the jobs as Dagster sensors; each alert goes through :func:`send_alert`.

What GitLab's workers watch, and where it is watched here:

- run time over the lease TTL (``Ci::StuckBuilds::DropCancelingWorker`` 30 min, ``Environments::AutoStopService``
  50 min, ``Ci::BulkDeleteExpiredJobArtifactsWorker`` 60 s): the ``dagster/max_runtime`` tag on the job and run
  monitoring in dagster.yaml fail the run, then ``run_failed_alert``;
- errors and repeated failures (``Ci::Runners::StaleMachinesCleanupCronWorker``,
  ``Environments::AutoStopCronWorker``; the artifacts workers: 3 in a row): ``run_failed_alert`` on every
  failure, ``repeated_failures_alert`` at 3 in a row;
- ``Ci::Runners::StaleManagersCleanupService::MAX_DELETIONS`` reached every run: ``max_deletions_backlog_alert``.

Beyond what GitLab watches: a lease that never expires, or a job skipped run after run (``lease_held_alert``);
rows a green run stepped over, an error or a refused path (``rows_with_errors_alert``); a run whose worker
died unreported (``dead_run_worker_check`` fails it, then ``run_failed_alert``).

Sensors are evaluated every ``CI_CLEANUP_SENSOR_INTERVAL_SECONDS`` (default 30, Dagster's own default).

A run status sensor that alerts on nothing returns a :class:`SkipReason`: Dagster then writes nothing in the run's
log (it writes 'Sensor "…" acted on run status …' for a None), so a run's log names only the alerts sent about it.
Dagster then leaves the tick's other runs to the next ticks (one a tick): more than the few runs a minute that
these schedules start.
"""

from __future__ import annotations

import os

from dagster import (
    DagsterEventType,
    DagsterRunStatus,
    DefaultRunLauncher,
    DefaultSensorStatus,
    RunFailureSensorContext,
    RunsFilter,
    RunStatusSensorContext,
    SensorEvaluationContext,
    SkipReason,
    run_failure_sensor,
    run_status_sensor,
    sensor,
)

from .alerts import send_alert
from .errors import cause_line
from .runs import LEASE_WITHOUT_TTL_TAG, MAX_DELETIONS_TAG, ROWS_WITH_ERRORS_TAG, SKIPPED_TAG

FAILURES_IN_A_ROW = 3  # failed runs in a row that raise an alert (the artifacts workers' threshold)
BACKLOG_RUNS = 3  # hourly runs in a row that each reached MAX_DELETIONS: the backlog is growing
SKIPPED_RUNS = 3  # runs in a row that did nothing because the lease was held
INTERVAL_ENV = "CI_CLEANUP_SENSOR_INTERVAL_SECONDS"
INTERVAL_SECONDS = int(os.environ.get(INTERVAL_ENV, "30"))
# A process created up to this long after the run worker logged its pid is still that worker: /proc's
# start times count from a boot time rounded to the second.
START_TIME_SLACK_SECONDS = 1.0


SUCCEEDED = (DagsterRunStatus.SUCCESS,)
FINISHED = (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE)


def _in_a_row(context, n: int, holds, statuses=FINISHED) -> list:
    """The job's last ``n`` finished runs (of ``statuses``) when ``holds`` is true of every one of them, else []."""
    filters = RunsFilter(job_name=context.dagster_run.job_name, statuses=list(statuses))
    runs = context.instance.get_runs(filters, limit=n)
    return runs if len(runs) == n and all(holds(r) for r in runs) else []


@run_failure_sensor(
    default_status=DefaultSensorStatus.RUNNING, minimum_interval_seconds=INTERVAL_SECONDS,
    description="Alert on every failed ci_cleanup run",
)
def run_failed_alert(context: RunFailureSensorContext) -> None:
    run = context.dagster_run
    # The cause in one line (a setting out of bounds, a missing column), not only "Steps failed: [...]"
    error = getattr(context.failure_event.event_specific_data, "error", None)
    steps = [event.step_key for event in context.get_step_failure_events()]
    cause = f"{', '.join(steps)}: {cause_line(error)}" if error and steps else (
        cause_line(error) if error else context.failure_event.message)
    send_alert(
        "run_failed", f"ci_cleanup: {run.job_name} run {run.run_id} failed: {cause}", job=run.job_name,
        run_id=run.run_id,
    )


@run_failure_sensor(
    default_status=DefaultSensorStatus.RUNNING, minimum_interval_seconds=INTERVAL_SECONDS,
    description=f"Alert when a job failed {FAILURES_IN_A_ROW} runs in a row",
)
def repeated_failures_alert(context: RunFailureSensorContext):
    run = context.dagster_run
    if runs := _in_a_row(context, FAILURES_IN_A_ROW, lambda r: r.status == DagsterRunStatus.FAILURE):
        send_alert(
            "repeated_failures", f"ci_cleanup: {run.job_name} failed {FAILURES_IN_A_ROW} runs in a row",
            job=run.job_name, run_ids=[r.run_id for r in runs],
        )
        return None
    return SkipReason(f"Fewer than {FAILURES_IN_A_ROW} failures in a row")


@run_status_sensor(
    run_status=DagsterRunStatus.SUCCESS, default_status=DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=INTERVAL_SECONDS,
    description=f"Alert when a cleanup hit its deletion cap {BACKLOG_RUNS} runs in a row: a backlog is building up",
)
def max_deletions_backlog_alert(context: RunStatusSensorContext):
    run = context.dagster_run
    if run.tags.get(MAX_DELETIONS_TAG) != "true":
        return SkipReason("The deletion cap was not reached")
    if runs := _in_a_row(context, BACKLOG_RUNS, lambda r: r.tags.get(MAX_DELETIONS_TAG) == "true", SUCCEEDED):
        send_alert(
            "max_deletions_backlog",
            f"ci_cleanup: {run.job_name} reached its deletion cap {BACKLOG_RUNS} runs in a row; "
            "a backlog is building up",
            job=run.job_name, run_ids=[r.run_id for r in runs],
        )
        return None
    return SkipReason(f"The deletion cap was reached fewer than {BACKLOG_RUNS} runs in a row")


@run_status_sensor(
    run_status=DagsterRunStatus.SUCCESS, default_status=DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=INTERVAL_SECONDS,
    description=f"Alert when a run skipped on a lease that has no TTL, or a job skipped {SKIPPED_RUNS} runs in a row",
)
def lease_held_alert(context: RunStatusSensorContext):
    """GitLab skips a run whose lease is held, and so do the jobs; a lease with no expiry (set by hand, or by
    a tool that forgot EX) would turn the job off for ever behind green runs."""
    run = context.dagster_run
    if not run.tags.get(SKIPPED_TAG):
        return SkipReason("The run did not skip")
    alerted = False
    if key := run.tags.get(LEASE_WITHOUT_TTL_TAG):
        alerted = True
        send_alert(
            "lease_without_ttl",
            f"ci_cleanup: {run.job_name} skipped because lease {key} is held and has no TTL: it never expires, so "
            "every run will skip; delete the key once no GitLab process holds it",
            job=run.job_name, run_id=run.run_id, lease=key,
        )
    if runs := _in_a_row(context, SKIPPED_RUNS, lambda r: r.tags.get(SKIPPED_TAG), SUCCEEDED):
        alerted = True
        send_alert(
            "skipped_in_a_row",
            f"ci_cleanup: {run.job_name} skipped {SKIPPED_RUNS} runs in a row ({run.tags[SKIPPED_TAG]})",
            job=run.job_name, run_ids=[r.run_id for r in runs],
        )
    return None if alerted else SkipReason(f"Skipped fewer than {SKIPPED_RUNS} runs in a row, on a lease with a TTL")


@run_status_sensor(
    run_status=DagsterRunStatus.SUCCESS, default_status=DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=INTERVAL_SECONDS,
    description="Alert when a run succeeded but stepped over rows it could not process (errors, refused paths)",
)
def rows_with_errors_alert(context: RunStatusSensorContext):
    """A bad row is reported and stepped over, never blocks the others: the run is green, so say it here."""
    run = context.dagster_run
    if count := run.tags.get(ROWS_WITH_ERRORS_TAG):
        send_alert(
            "rows_with_errors",
            f"ci_cleanup: {run.job_name} run {run.run_id} left {count} rows it could not process; "
            "the run's metadata (errors, refused) says which and why",
            job=run.job_name, run_id=run.run_id, rows=int(count),
        )
        return None
    return SkipReason("No row was stepped over")


def worker_alive(pid: int, logged_at: float) -> bool:
    """Whether the run worker that logged ``pid`` at ``logged_at`` still runs: after a reboot the pid may
    belong to another process, created after the worker logged it."""
    import psutil  # the sensor's alone: a run's process does not import it

    try:
        process = psutil.Process(pid)
        started = process.create_time()
        return process.status() != psutil.STATUS_ZOMBIE and started <= logged_at + START_TIME_SLACK_SECONDS
    except psutil.NoSuchProcess:
        return False


WORKER_STARTED = "Started process for run"  # the engine event a launched run's worker logs first, with its pid


def _worker_pid(instance, run_id: str) -> tuple[int, float] | None:
    """The run worker's pid and when it logged it. Only that event: the multiprocess executor's step processes
    log pids too, and each exits when its step is done while the run goes on."""
    for record in instance.all_logs(run_id, of_type=DagsterEventType.ENGINE_EVENT):
        if record.dagster_event and (record.dagster_event.message or "").startswith(WORKER_STARTED):
            pid = record.dagster_event.engine_event_data.metadata.get("pid")
            return (int(pid.value), record.timestamp) if pid is not None else None
    return None


@sensor(
    default_status=DefaultSensorStatus.RUNNING, minimum_interval_seconds=INTERVAL_SECONDS,
    description="Fail a run whose worker process is gone without reporting (host crash, SIGKILL), so it alerts and "
    "the job's next runs are no longer queued behind it",
)
def dead_run_worker_check(context: SensorEvaluationContext):
    """Run monitoring asks the run launcher whether a run's worker is healthy, and Dagster's default launcher
    cannot tell: a run whose worker died stays STARTED until its ``dagster/max_runtime`` (up to 50 minutes),
    with the job's next runs queued behind it (one run per job at a time). With that launcher the workers are
    children of the code server that evaluates this sensor, on this host: look at their pids."""
    instance = context.instance
    if not isinstance(instance.run_launcher, DefaultRunLauncher):
        return SkipReason("The run launcher checks its run workers' health itself (run monitoring)")
    failed = []
    for run in instance.get_runs(RunsFilter(statuses=[DagsterRunStatus.STARTED])):
        logged = _worker_pid(instance, run.run_id)
        if logged is None or worker_alive(*logged):
            continue
        # Read again once the worker is known gone: a run that ended normally reported it before its worker exited.
        run = instance.get_run_by_id(run.run_id)
        if run is None or run.status != DagsterRunStatus.STARTED:
            continue
        instance.report_run_failed(
            run,
            f"The run worker (pid {logged[0]}) is gone without reporting the end of the run (host crash, SIGKILL, "
            "OOM kill); marked failed by dead_run_worker_check. Rows are whole (each batch is one transaction); "
            "a lease the run held expires with its TTL",
        )
        failed.append(run.run_id)
    return SkipReason(f"Marked failed, their workers gone: {failed}" if failed else "Every started run's worker lives")


alert_sensors = [
    run_failed_alert, repeated_failures_alert, max_deletions_backlog_alert, lease_held_alert, rows_with_errors_alert,
    dead_run_worker_check,
]
