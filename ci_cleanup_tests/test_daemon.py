"""dagster-daemon, on deploy/dagster.yaml (PostgreSQL storage, run queue), launches a scheduled run;
a run killed with its whole host (daemon, code server, run worker) is failed, alerted, and blocks nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter
from sqlalchemy import text

from ci_cleanup.alerts import WEBHOOK_ENV
from ci_cleanup.sensors import INTERVAL_ENV
from ci_cleanup_dev.devstack import DAGSTER_YAML, REPO_ROOT

from .factories import ago, backend_waiting_on_lock, create, ids, naive_ago, row
from .harness import clean_env

BIN = Path(sys.executable).parent


def test_daemon_launches_a_scheduled_run_that_drops_the_stuck_build(stack, engine, redis_client, tmp_path, monkeypatch):
    build_id = create(engine, "ci_builds", created_at=naive_ago(hours=2), updated_at=naive_ago(hours=2))
    shutil.copy(DAGSTER_YAML, tmp_path / "dagster.yaml")
    env = clean_env(
        CI_CLEANUP_DATABASE_URL=stack.url(), CI_CLEANUP_REDIS_URL=stack.redis_url,
        CI_CLEANUP_DAGSTER_PG_URL=stack.url("dagster"), DAGSTER_HOME=str(tmp_path),
    )
    monkeypatch.setenv("CI_CLEANUP_DAGSTER_PG_URL", stack.url("dagster"))  # for this process's view of the instance
    daemon = subprocess.Popen(
        [BIN / "dagster-daemon", "run", "-m", "ci_cleanup_tests.daemon_location"],
        env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        with DagsterInstance.from_config(str(tmp_path)) as instance:
            queue = instance.get_concurrency_config().run_queue_config
            assert queue.tag_concurrency_limits == [
                {"key": "ci_cleanup/job", "value": {"applyLimitPerUniqueValue": True}, "limit": 1}
            ]  # one run per job at a time
            assert not instance.run_retries_enabled and instance.run_monitoring_enabled
            schedule_runs = RunsFilter(tags={"dagster/schedule_name": "test_drop_canceling_builds_every_minute"})
            deadline = time.monotonic() + 200  # the next minute boundary, then the queue and the run
            while True:
                runs = instance.get_runs(schedule_runs)
                if runs and runs[-1].status in (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE):
                    break
                assert daemon.poll() is None, daemon.stdout.read()[-3000:]
                if time.monotonic() > deadline:
                    daemon.terminate()
                    raise AssertionError(f"no finished scheduled run ({runs}): {daemon.communicate()[0][-4000:]}")
                time.sleep(2)
            first = runs[-1]
            assert first.status == DagsterRunStatus.SUCCESS
            assert first.job_name == "drop_canceling_builds"
            instance.wipe()  # this test's runs leave the shared Dagster database as they found it
    finally:
        daemon.terminate()
        daemon.communicate(timeout=60)
    dropped = row(engine, "ci_builds", build_id)
    assert (dropped.status, dropped.failure_reason) == ("failed", 3)


def start_daemon(env: dict, log: Path) -> subprocess.Popen:
    with log.open("a") as out:
        return subprocess.Popen(
            [BIN / "dagster-daemon", "run", "-m", "ci_cleanup"], env=env, cwd=REPO_ROOT, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )


def launch(env: dict, job_name: str) -> None:
    """``dagster job launch``: the run goes to the instance's run queue, for the daemon to start."""
    subprocess.run(
        [BIN / "dagster", "job", "launch", "-m", "ci_cleanup", "-j", job_name], env=env, cwd=REPO_ROOT,
        check=True, capture_output=True, timeout=120,
    )


def sigkill_with_every_descendant(process: subprocess.Popen) -> list[str]:
    """The host goes down: the daemon, its code server, the run worker and its step processes, all at once."""
    root = psutil.Process(process.pid)
    tree = [root, *root.children(recursive=True)]
    names = [" ".join(p.cmdline()[1:4]) for p in tree]
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=30)
    process.wait(10)
    return names


def wait_for(what: str, check, timeout: float, log: Path):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout} s: {log.read_text()[-4000:]}")
        time.sleep(1)
    return found


def test_a_run_killed_with_its_whole_host_is_failed_and_alerted_and_the_jobs_next_run_is_not_blocked(
    stack, engine, redis_client, tmp_path, monkeypatch, webhook  # noqa: F811
):
    """deploy/dagster.yaml (one run per job at a time) with the daemon: SIGKILL the daemon, its code server
    and the run's worker together, mid-batch; restart the daemon. The dead run is failed (dead_run_worker_check),
    run_failed_alert posts it, and the run queued behind it runs."""
    machines = [
        create(engine, "ci_runner_machines", created_at=ago(days=30), contacted_at=ago(days=30)) for _ in range(3)
    ]
    home, log = tmp_path / "home", tmp_path / "daemon.log"
    home.mkdir()
    config = DAGSTER_YAML.read_text()
    assert "poll_interval_seconds: 30" in config
    (home / "dagster.yaml").write_text(config.replace("poll_interval_seconds: 30", "poll_interval_seconds: 2"))
    env = clean_env(
        CI_CLEANUP_DATABASE_URL=stack.url(), CI_CLEANUP_REDIS_URL=stack.redis_url,
        CI_CLEANUP_DAGSTER_PG_URL=stack.url("dagster"), DAGSTER_HOME=str(home),
        **{INTERVAL_ENV: "2", WEBHOOK_ENV: os.environ[WEBHOOK_ENV]},
    )
    monkeypatch.setenv("CI_CLEANUP_DAGSTER_PG_URL", stack.url("dagster"))  # for this process's view of the instance
    holder = engine.connect()  # a lock on one machine holds the run's DELETE mid-batch, where it is killed
    transaction = holder.begin()
    holder.execute(text("SELECT id FROM ci_runner_machines WHERE id = :id FOR UPDATE"), {"id": machines[1]})
    daemon = start_daemon(env, log)
    try:
        with DagsterInstance.from_config(str(home)) as instance:
            instance.wipe()  # this test counts its own runs
            launch(env, "stale_runner_machines_cleanup")
            backend_waiting_on_lock(engine, "%DELETE FROM ci_runner_machines%")
            [dead] = instance.get_runs()
            killed = sigkill_with_every_descendant(daemon)
            assert len(killed) >= 3, killed  # daemon, code server, run worker (and its step process)
            launch(env, "stale_runner_machines_cleanup")  # the next run, queued while the dead one holds the job
            transaction.rollback()
            holder.close()
            assert instance.get_run_by_id(dead.run_id).status == DagsterRunStatus.STARTED

            daemon = start_daemon(env, log)
            runs = RunsFilter(job_name="stale_runner_machines_cleanup")
            finished = (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE)
            [after, _] = wait_for(
                "both runs finished",
                lambda: (r := instance.get_runs(runs)) and all(x.status in finished for x in r) and r, 240, log,
            )
            wait_for("the alert", lambda: webhook, 60, log)

            assert instance.get_run_by_id(dead.run_id).status == DagsterRunStatus.FAILURE
            [failure] = instance.all_logs(dead.run_id, of_type=DagsterEventType.RUN_FAILURE)
            assert "The run worker (pid " in failure.message and "is gone without reporting" in failure.message
            assert after.status == DagsterRunStatus.SUCCESS
            assert [(a["alert"], a["job"], a["run_id"]) for a in webhook] == [
                ("run_failed", "stale_runner_machines_cleanup", dead.run_id)
            ]
            instance.wipe()  # this test's runs leave the shared Dagster database as they found it
    finally:
        daemon.terminate()
        daemon.wait(60)
    assert ids(engine, "ci_runner_machines") == []  # the dead run's batch rolled back whole; the next run deleted all



def test_dead_run_worker_check_fails_only_runs_whose_worker_is_gone(tmp_path):
    """A step process that finished (the multiprocess executor logs its pid too) is not the run's worker."""
    from dagster import build_sensor_context
    from dagster._core.events import EngineEventData
    from dagster._core.test_utils import create_run_for_test

    from ci_cleanup.sensors import dead_run_worker_check

    exited = subprocess.Popen(["true"])
    exited.wait()
    with DagsterInstance.local_temp(str(tmp_path)) as instance:

        def started_run(worker_pid: int, step_pid: int | None = None):
            run = create_run_for_test(instance, job_name="stuck_export_jobs", status=DagsterRunStatus.STARTED)
            instance.report_engine_event(
                f"Started process for run (pid: {worker_pid}).", run, EngineEventData.in_process(worker_pid)
            )
            if step_pid is not None:
                instance.report_engine_event(
                    f"Executing steps in process (pid: {step_pid})", run,
                    EngineEventData.in_process(step_pid, ["fail_stuck_export_jobs_in_chunks"]),
                )
            return run

        alive = started_run(os.getpid(), step_pid=exited.pid)  # this process: started before it logged its pid
        gone = started_run(exited.pid)
        never_logged = create_run_for_test(instance, job_name="stuck_export_jobs", status=DagsterRunStatus.STARTED)

        dead_run_worker_check(build_sensor_context(instance=instance))

        status = {name: instance.get_run_by_id(run.run_id).status for name, run in
                  {"alive": alive, "gone": gone, "never_logged": never_logged}.items()}
        assert status == {
            "alive": DagsterRunStatus.STARTED, "gone": DagsterRunStatus.FAILURE,
            "never_logged": DagsterRunStatus.STARTED,
        }
        [failure] = instance.all_logs(gone.run_id, of_type=DagsterEventType.RUN_FAILURE)
        assert f"The run worker (pid {exited.pid}) is gone without reporting" in failure.message


def test_a_pid_held_by_a_process_started_after_the_worker_logged_it_is_not_the_worker():
    """After a reboot the dead worker's pid may be another process's: it started after the worker logged it."""
    from ci_cleanup.sensors import worker_alive

    newcomer = subprocess.Popen(["sleep", "60"])
    try:
        assert worker_alive(newcomer.pid, logged_at=time.time() + 5)
        assert not worker_alive(newcomer.pid, logged_at=time.time() - 60)
    finally:
        newcomer.kill()
        newcomer.wait()
