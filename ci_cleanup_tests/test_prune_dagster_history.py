"""prune_dagster_history on the PostgreSQL instance storage (dagster-postgres), the production set-up.

Old runs are copies of one real run of stale_runner_machines_cleanup (its run row, tags and 30
events, observations on gitlab/ci_runner_machines included), made in SQL by ``clone_runs`` with
timestamps moved back: thousands in a second, where the instance API takes 70 ms a run.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
from dagster import AssetKey, DagsterInstance, DagsterRunStatus
from dagster._core.definitions.run_request import InstigatorType
from dagster._core.scheduler.instigation import TickStatus
from sqlalchemy import create_engine, text

from ci_cleanup.bench.prune import clone_runs
from ci_cleanup.devstack import REPO_ROOT
from ci_cleanup.gitlab.exclusive_lease import PREFIX
from ci_cleanup.gitlab.schema import utc_now
from ci_cleanup.prune_dagster_history import service
from ci_cleanup.prune_dagster_history.job import LEASE_KEY, prune_dagster_history, prune_dagster_history_schedule
from ci_cleanup.runs import DRY_RUN_TAG, ROWS_CHANGED_TAG
from ci_cleanup.stale_runner_machines_cleanup.job import stale_runner_machines_cleanup

from .factories import ago, create
from .runner import op_metadata, run_job

S, F, C = DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED
RUNS_ASSET = AssetKey(["dagster", "runs"])
ORPHAN_EVENTS = "SELECT count(*) FROM event_logs WHERE run_id <> '' AND run_id NOT IN (SELECT run_id FROM runs)"


@pytest.fixture
def dagster_db(stack):
    engine = create_engine(stack.url("dagster"))
    yield engine
    engine.dispose()


@pytest.fixture
def instance(stack, dagster_db, tmp_path, monkeypatch):
    """The repo's dagster.yaml on the stack's ``dagster`` database, emptied before and after the test."""
    shutil.copy(REPO_ROOT / "dagster.yaml", tmp_path / "dagster.yaml")
    monkeypatch.setenv("CI_CLEANUP_DAGSTER_PG_URL", stack.url("dagster"))
    with DagsterInstance.from_config(str(tmp_path)) as instance:
        _empty(instance, dagster_db)
        yield instance
        _empty(instance, dagster_db)


def _empty(instance, dagster_db):
    instance.wipe()
    with dagster_db.begin() as conn:
        conn.execute(text("DELETE FROM kvs WHERE key LIKE 'ci_cleanup/%'"))


@pytest.fixture
def template(stack, engine, redis_client, instance) -> str:
    """A real run on the instance: stale_runner_machines_cleanup deleting 250 machines in 5 sub-batches."""
    for _ in range(250):
        create(engine, "ci_runner_machines", created_at=ago(days=30), contacted_at=None)
    config = {"ops": {"find_stale_runner_machines": {"config": {"sub_batch_size": 50}}}}
    return run_job(stale_runner_machines_cleanup, stack, instance=instance, run_config=config).run_id


def days_ago(days: float) -> dt.datetime:
    return utc_now() - dt.timedelta(days=days)


def spread(n: int, oldest_days: float, newest_days: float) -> list[dt.datetime]:
    return [days_ago(oldest_days - (oldest_days - newest_days) * i / max(1, n - 1)) for i in range(n)]


def events_by_run(dagster_db) -> Counter:
    with dagster_db.connect() as conn:
        counts = conn.execute(text("SELECT run_id, count(*) FROM event_logs WHERE run_id <> '' GROUP BY run_id"))
        return Counter(dict(counts.all()))


def run_ids(dagster_db) -> set[str]:
    with dagster_db.connect() as conn:
        return set(conn.scalars(text("SELECT run_id FROM runs")))


def prune(stack, instance, **config):
    return run_job(
        prune_dagster_history, stack, instance=instance, raise_on_error=False,
        run_config={"ops": {"find_old_runs": {"config": config}}} if config else None,
    )


def test_old_finished_runs_go_with_their_event_logs_and_every_other_run_stays_whole(
    stack, redis_client, instance, dagster_db, template
):
    old_success = clone_runs(dagster_db, template, spread(2000, 60, 31))
    old_canceled = clone_runs(dagster_db, template, spread(200, 45, 32), C)
    old_failed = clone_runs(dagster_db, template, spread(300, 120, 91), F)
    failed_kept = clone_runs(dagster_db, template, spread(300, 89, 31), F)
    recent = clone_runs(dagster_db, template, spread(300, 29, 1))
    # Only finished statuses are ever selected; a QUEUED copy cannot be made (Dagster requires a queued run to
    # carry its code location's origin), NOT_STARTED stands for the runs not launched yet.
    not_finished = [
        *clone_runs(dagster_db, template, spread(50, 60, 40), DagsterRunStatus.STARTED),
        *clone_runs(dagster_db, template, spread(50, 60, 40), DagsterRunStatus.NOT_STARTED),
        *clone_runs(dagster_db, template, spread(50, 60, 40), DagsterRunStatus.STARTING),
        *clone_runs(dagster_db, template, spread(50, 60, 40), DagsterRunStatus.CANCELING),
    ]
    before = events_by_run(dagster_db)
    assert before[template] == 30 and len(before) == 3301

    result = prune(stack, instance, batch_size=250)

    assert result.success
    gone = {*old_success, *old_canceled, *old_failed}
    kept = {template, *failed_kept, *recent, *not_finished, result.run_id}
    assert run_ids(dagster_db) == kept
    after = events_by_run(dagster_db)
    assert {run_id: after[run_id] for run_id in kept - {result.run_id}} == {
        run_id: before[run_id] for run_id in kept - {result.run_id}
    }
    assert not gone & set(after)
    with dagster_db.connect() as conn:
        assert conn.scalar(text(ORPHAN_EVENTS)) == 0
    report = op_metadata(result, "report_prune")
    assert (report["runs_deleted"], report["events_deleted"]) == (2500, 2500 * 30)
    assert report["batch_counts"] == [250] * 8 + [200, 250, 50]  # success and canceled, then failed
    oldest_kept = min(r.update_timestamp for r in instance.get_run_records() if r.dagster_run.run_id in kept)
    assert report["oldest_kept"] == oldest_kept.isoformat()
    tags = instance.get_run_by_id(result.run_id).tags
    assert tags[ROWS_CHANGED_TAG] == "2500"
    batches = [r.asset_observation.metadata for r in instance.fetch_observations(RUNS_ASSET, limit=100).records]
    assert sorted((m["runs_deleted"].value, m["events_deleted"].value) for m in batches) == sorted(
        (n, n * 30) for n in report["batch_counts"]
    )


def test_schedule_runs_daily_at_04_13_utc():
    assert prune_dagster_history_schedule.cron_schedule == "13 4 * * *"
    assert prune_dagster_history_schedule.execution_timezone == "UTC"
    assert prune_dagster_history_schedule.job_name == "prune_dagster_history"


def test_dagster_yaml_bounds_schedule_and_sensor_ticks(instance):
    assert instance.get_tick_retention_settings(InstigatorType.SCHEDULE) == {
        TickStatus.STARTED: -1, TickStatus.SKIPPED: 7, TickStatus.SUCCESS: 90, TickStatus.FAILURE: 90,
    }
    assert instance.get_tick_retention_settings(InstigatorType.SENSOR) == {
        TickStatus.STARTED: -1, TickStatus.SKIPPED: 7, TickStatus.SUCCESS: 30, TickStatus.FAILURE: 90,
    }
