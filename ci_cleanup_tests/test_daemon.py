"""dagster-daemon, on the repo's dagster.yaml (PostgreSQL storage, run queue), launches a scheduled run."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from dagster import DagsterInstance, DagsterRunStatus, RunsFilter

from ci_cleanup.devstack import REPO_ROOT

from .factories import create, naive_ago, row
from .test_code_location import clean_env

BIN = Path(sys.executable).parent


def test_daemon_launches_a_scheduled_run_that_drops_the_stuck_build(stack, engine, redis_client, tmp_path, monkeypatch):
    build_id = create(engine, "ci_builds", created_at=naive_ago(hours=2), updated_at=naive_ago(hours=2))
    shutil.copy(REPO_ROOT / "dagster.yaml", tmp_path / "dagster.yaml")
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
    assert (row(engine, "ci_builds", build_id).status, row(engine, "ci_builds", build_id).failure_reason) == ("failed", 3)
