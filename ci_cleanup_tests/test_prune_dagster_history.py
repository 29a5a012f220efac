"""prune_dagster_history on the PostgreSQL instance storage (dagster-postgres), the production set-up.

Old runs are copies of one real run of stale_runner_machines_cleanup (its run row, tags and EVENTS
events, observations on gitlab/ci_runner_machines included), made in SQL by ``clone_runs`` with
timestamps moved back: thousands in a second, where the instance API takes 70 ms a run.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from dagster import AssetKey, DagsterInstance, DagsterRunStatus, build_run_status_sensor_context
from dagster._core.definitions.run_request import InstigatorType
from dagster._core.scheduler.instigation import TickStatus
from sqlalchemy import create_engine, text

from ci_cleanup.drop_canceling_builds.job import drop_canceling_builds
from ci_cleanup.gitlab.exclusive_lease import PREFIX
from ci_cleanup.gitlab.schema import utc_now
from ci_cleanup.prune_dagster_history import service
from ci_cleanup.prune_dagster_history.job import (
    KEEP_DAYS_ENV,
    KEEP_FAILED_DAYS_ENV,
    LEASE_KEY,
    prune_dagster_history,
    prune_dagster_history_schedule,
)
from ci_cleanup.runs import DRY_RUN_TAG, ROWS_CHANGED_TAG
from ci_cleanup.sensors import run_failed_alert
from ci_cleanup.stale_runner_machines_cleanup.job import stale_runner_machines_cleanup
from ci_cleanup_dev.bench.prune import clone_runs
from ci_cleanup_dev.devstack import DAGSTER_YAML

from .factories import ago, create, naive_ago
from .harness import clean_env
from .runner import failure_messages, op_metadata, run_job

S, F, C = DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED
RUNS_ASSET = AssetKey(["dagster", "runs"])
# The template run's events: run and step events of its 3 ops, its 5 sub-batches in one observation, and the
# report op's summary line ("Done: …"), in one process.
EVENTS = 24
ORPHAN_EVENTS = "SELECT count(*) FROM event_logs WHERE run_id <> '' AND run_id NOT IN (SELECT run_id FROM runs)"


@pytest.fixture
def dagster_db(stack):
    engine = create_engine(stack.url("dagster"))
    yield engine
    engine.dispose()


@pytest.fixture
def instance(stack, dagster_db, tmp_path, monkeypatch):
    """deploy/dagster.yaml on the stack's ``dagster`` database, emptied before and after the test."""
    shutil.copy(DAGSTER_YAML, tmp_path / "dagster.yaml")
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
    assert before[template] == EVENTS and len(before) == 3301

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
    report = op_metadata(result, "report_pruned_runs")
    assert (report["runs_deleted"], report["events_deleted"]) == (2500, 2500 * EVENTS)
    assert report["batch_counts"] == [250] * 8 + [200, 250, 50]  # success and canceled, then failed
    oldest_kept = min(r.update_timestamp for r in instance.get_run_records() if r.dagster_run.run_id in kept)
    assert report["oldest_kept"] == oldest_kept.isoformat()
    tags = instance.get_run_by_id(result.run_id).tags
    assert tags[ROWS_CHANGED_TAG] == "2500"
    batches = [r.asset_observation.metadata for r in instance.fetch_observations(RUNS_ASSET, limit=100).records]
    assert sorted((m["runs_deleted"].value, m["events_deleted"].value) for m in batches) == sorted(
        (n, n * EVENTS) for n in report["batch_counts"]
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


def at(days_ago_: int, hour: int) -> dt.datetime:
    day = service.midnight(utc_now()) - dt.timedelta(days=days_ago_)
    return day + dt.timedelta(hours=hour)


def history(instance, job_name: str) -> list[tuple[float, dict]]:
    records = instance.fetch_observations(service.history_asset_key(job_name), limit=100, ascending=True).records
    return [(r.timestamp, {k: v.value for k, v in r.asset_observation.metadata.items()}) for r in records]


def totals(day: dt.datetime, runs=0, succeeded=0, failed=0, canceled=0, rows_changed=0) -> tuple[float, dict]:
    return (service.midnight(day) + dt.timedelta(days=1)).timestamp() - 1, {
        "day": day.date().isoformat(), "runs": runs, "succeeded": succeeded, "failed": failed,
        "canceled": canceled, "rows_changed": rows_changed,
    }


def test_each_jobs_totals_of_a_day_are_kept_once_as_an_observation_on_that_day(
    stack, engine, redis_client, instance, dagster_db, template
):
    create(engine, "ci_builds", created_at=naive_ago(hours=2), updated_at=naive_ago(hours=2))
    other = run_job(drop_canceling_builds, stack, instance=instance).run_id  # rows_changed 1
    d1, d2 = 40, 35
    clone_runs(dagster_db, template, [at(d1, 0), at(d1, 12), at(d1, 23)])
    clone_runs(dagster_db, template, [at(d1, 6)], F)
    clone_runs(dagster_db, template, [at(d2, 9)], C)
    clone_runs(dagster_db, other, [at(d1, 1), at(d1, 2)])
    clone_runs(dagster_db, other, [at(d2, 3)], F)

    assert prune(stack, instance).success

    assert history(instance, "stale_runner_machines_cleanup") == [
        totals(at(d1, 0), runs=4, succeeded=3, failed=1, rows_changed=4 * 250),
        totals(at(d2, 0), runs=1, canceled=1, rows_changed=250),
    ]
    assert history(instance, "drop_canceling_builds") == [
        totals(at(d1, 0), runs=2, succeeded=2, rows_changed=2),
        totals(at(d2, 0), runs=1, failed=1, rows_changed=1),
    ]
    assert service.summarised_through(instance) == (service.midnight(utc_now()) - dt.timedelta(days=31)).date()

    # Killed after writing a day's totals and before marking it: the next run does not write them again.
    instance.daemon_cursor_storage.set_cursor_values({service.SUMMARISED_KEY: at(d1 + 1, 0).date().isoformat()})
    assert prune(stack, instance).success
    assert [day["day"] for _, day in history(instance, "stale_runner_machines_cleanup")] == [
        at(d1, 0).date().isoformat(), at(d2, 0).date().isoformat()
    ]
    assert len(history(instance, "drop_canceling_builds")) == 2


def test_dry_run_lists_what_would_go_and_writes_nothing(stack, redis_client, instance, dagster_db, template):
    old = clone_runs(dagster_db, template, spread(150, 50, 31))
    clone_runs(dagster_db, template, spread(10, 20, 1))
    before = (run_ids(dagster_db), events_by_run(dagster_db))

    dry = run_job(prune_dagster_history, stack, instance=instance, dry_run=True)

    events = events_by_run(dagster_db)
    del events[dry.run_id]
    assert (run_ids(dagster_db) - {dry.run_id}, events) == before
    would = op_metadata(dry, "report_pruned_runs")
    assert (would["would_delete_count"], would["would_delete_run_ids"]) == (150, old)  # oldest first
    assert len(would["would_summarise_days"]) == 20
    assert history(instance, "stale_runner_machines_cleanup") == []
    assert instance.daemon_cursor_storage.get_cursor_values({service.SUMMARISED_KEY, service.DELETING_KEY}) == {}
    assert redis_client.keys(f"{PREFIX}*") == []
    tags = instance.get_run_by_id(dry.run_id).tags
    assert (tags[DRY_RUN_TAG], tags[ROWS_CHANGED_TAG]) == ("true", "0")


@pytest.mark.parametrize("config, named", [
    ({"keep_days": 0}, "keep_days"),
    ({"keep_days": 60, "keep_failed_days": 30}, "keep_failed_days (30) must be at least keep_days (60)"),
    ({"batch_size": 1001}, "batch_size"),
    ({"max_runtime_minutes": 56}, "max_runtime_minutes"),
    ({"env": "0"}, f"{KEEP_DAYS_ENV} must be a whole number of days from 1 to 3650, not '0'"),
    ({"env": "30d"}, f"{KEEP_DAYS_ENV} must be a whole number of days from 1 to 3650, not '30d'"),
    ({"env": "100"}, "keep_failed_days (90) must be at least keep_days (100)"),
])
def test_limits_out_of_range_fail_the_run_before_anything_is_deleted(
    stack, redis_client, instance, dagster_db, template, monkeypatch, config, named
):
    if "env" in config:
        monkeypatch.setenv(KEEP_DAYS_ENV, config.pop("env"))
    clone_runs(dagster_db, template, spread(20, 50, 31))
    before = (run_ids(dagster_db), events_by_run(dagster_db))

    result = prune(stack, instance, **config)

    assert not result.success
    assert named in failure_messages(result)
    events = events_by_run(dagster_db)
    del events[result.run_id]
    assert (run_ids(dagster_db) - {result.run_id}, events) == before
    assert redis_client.keys(f"{PREFIX}*") == []


def test_a_run_while_another_holds_the_lease_is_skipped_and_deletes_nothing(
    stack, redis_client, instance, dagster_db, template
):
    clone_runs(dagster_db, template, spread(20, 50, 31))
    redis_client.set(PREFIX + LEASE_KEY, "another-prune-run", ex=600)
    before = events_by_run(dagster_db)

    result = prune(stack, instance)

    assert result.success
    assert op_metadata(result, "report_pruned_runs")["status"] == "skipped: lease held"
    events = events_by_run(dagster_db)
    del events[result.run_id]
    assert events == before
    assert redis_client.get(PREFIX + LEASE_KEY) == b"another-prune-run"
    redis_client.delete(PREFIX + LEASE_KEY)

    assert prune(stack, instance).success  # free again: the run takes it, and gives it back
    assert len(events_by_run(dagster_db)) == 3 and redis_client.keys(f"{PREFIX}*") == []


# Runs the job in its own process on the instance in DAGSTER_HOME, so the test can SIGKILL it mid-deletion.
PRUNE_IN_A_PROCESS = """
import os, sys
from dagster import DagsterInstance
from ci_cleanup.prune_dagster_history.job import prune_dagster_history
from ci_cleanup.resources import GitLabRedis, RunOptions

with DagsterInstance.get() as instance:
    prune_dagster_history.execute_in_process(
        run_config={"ops": {"find_old_runs": {"config": {"batch_size": 10}}}}, instance=instance,
        resources={"gitlab_redis": GitLabRedis(url=os.environ["CI_CLEANUP_REDIS_URL"]), "run_options": RunOptions()},
    )
"""


def test_a_run_killed_mid_deletion_leaves_no_run_without_its_events_and_the_next_run_finishes_the_batch(
    stack, redis_client, instance, dagster_db, template, tmp_path
):
    old = set(clone_runs(dagster_db, template, spread(2000, 60, 31)))
    kept = set(clone_runs(dagster_db, template, spread(100, 29, 1))) | {template}
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path), "CI_CLEANUP_REDIS_URL": stack.redis_url}
    process = subprocess.Popen([sys.executable, "-c", PRUNE_IN_A_PROCESS], env=env, stderr=subprocess.DEVNULL)
    try:
        while len(old & run_ids(dagster_db)) > 1000:  # about half-way
            assert process.poll() is None, "the prune run ended before it could be killed"
            time.sleep(0.02)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()

    left, events = run_ids(dagster_db), events_by_run(dagster_db)
    assert 0 < len(old & left) < 2000
    assert all(events[run_id] == EVENTS for run_id in (old | kept) & left)  # every run left is whole
    with dagster_db.connect() as conn:
        orphans = conn.scalar(text(ORPHAN_EVENTS))
    assert orphans <= 10 * EVENTS  # at most the batch under way, whose ids are recorded
    pending = instance.daemon_cursor_storage.get_cursor_values({service.DELETING_KEY}).get(service.DELETING_KEY)
    # The killed run's lease would expire with its TTL (run monitoring fails the run); the test does not wait.
    redis_client.delete(PREFIX + LEASE_KEY)

    result = prune(stack, instance)

    assert result.success
    assert op_metadata(result, "report_pruned_runs")["resumed_run_ids"] == (json.loads(pending) if pending else [])
    assert not old & run_ids(dagster_db) and kept <= run_ids(dagster_db)
    with dagster_db.connect() as conn:
        assert conn.scalar(text(ORPHAN_EVENTS)) == 0
    assert all(events_by_run(dagster_db)[run_id] == EVENTS for run_id in kept)


def test_a_batch_left_half_deleted_is_deleted_again_first(stack, redis_client, instance, dagster_db, template):
    """What a kill inside ``delete_run`` leaves on PostgreSQL: the run rows gone (one autocommitted statement
    each), their events not yet; the batch's ids were recorded before it started."""
    old = clone_runs(dagster_db, template, spread(30, 50, 31))
    batch = old[:10]
    instance.daemon_cursor_storage.set_cursor_values({service.DELETING_KEY: json.dumps(batch)})
    for run_id in batch[:5]:
        instance.run_storage.delete_run(run_id)
    with dagster_db.connect() as conn:
        assert conn.scalar(text(ORPHAN_EVENTS)) == 5 * EVENTS

    result = prune(stack, instance)

    report = op_metadata(result, "report_pruned_runs")
    assert (report["resumed_run_ids"], report["runs_deleted"]) == (batch, 20)
    assert run_ids(dagster_db) == {template, result.run_id}
    with dagster_db.connect() as conn:
        assert conn.scalar(text(ORPHAN_EVENTS)) == 0
    assert instance.daemon_cursor_storage.get_cursor_values({service.DELETING_KEY}) == {service.DELETING_KEY: "[]"}


def test_no_new_batch_starts_after_the_run_time_limit(instance, dagster_db, template):
    clone_runs(dagster_db, template, spread(100, 50, 31))
    start, calls = utc_now(), []

    def clock():  # each call is a minute later: the start, then one after each day and batch (GitLab's loop_until)
        calls.append(None)
        return start + dt.timedelta(minutes=len(calls) - 1)

    result = service.prune_history(  # 20 days, then the batches after minutes 21 and 22: past 21 minutes
        instance, service.Limits(service.Cutoffs.at(utc_now()), batch_size=10, max_runtime=dt.timedelta(minutes=21)),
        service.Hooks(clock=lambda: clock().timestamp()),
    )

    assert (result.days_summarised, result.batch_counts, result.time_limit_reached) == (20, [10, 10], True)
    assert len(run_ids(dagster_db)) == 1 + 80


def test_a_failed_prune_run_is_alerted_gives_its_lease_back_and_deletes_nothing(
    stack, redis_client, instance, dagster_db, template, webhook  # noqa: F811
):
    clone_runs(dagster_db, template, spread(20, 50, 31))
    instance.daemon_cursor_storage.set_cursor_values({service.DELETING_KEY: "not json"})
    before = run_ids(dagster_db)

    result = prune(stack, instance)

    assert not result.success
    named = f"The instance's key '{service.DELETING_KEY}' does not hold a JSON list of run ids"
    assert named in failure_messages(result)
    assert run_ids(dagster_db) - {result.run_id} == before
    assert redis_client.keys(f"{PREFIX}*") == []  # released as the failed run ended
    run_failed_alert(build_run_status_sensor_context(
        sensor_name="run_failed_alert", dagster_event=result.get_run_failure_event(), dagster_instance=instance,
        dagster_run=result.dagster_run,
    ).for_run_failure())
    assert [(alert["alert"], alert["job"]) for alert in webhook] == [("run_failed", "prune_dagster_history")]


def test_dagster_job_execute_prunes_the_instance_in_dagster_home(
    stack, redis_client, instance, dagster_db, template, tmp_path
):
    old = set(clone_runs(dagster_db, template, spread(100, 50, 31)))
    recent = set(clone_runs(dagster_db, template, spread(5, 20, 1)))

    done = subprocess.run(
        [Path(sys.executable).parent / "dagster", "job", "execute", "-m", "ci_cleanup", "-j", "prune_dagster_history"],
        env=clean_env(
            DAGSTER_HOME=str(tmp_path), CI_CLEANUP_DAGSTER_PG_URL=stack.url("dagster"),
            CI_CLEANUP_DATABASE_URL=stack.url(), CI_CLEANUP_REDIS_URL=stack.redis_url,
        ),
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )

    assert done.returncode == 0, done.stderr[-3000:]
    assert "RUN_SUCCESS" in done.stderr
    left = run_ids(dagster_db)
    assert not old & left and recent | {template} <= left


def test_keep_times_come_from_the_environment_of_the_code_location_and_run_config_overrides_them(
    stack, redis_client, instance, dagster_db, template, monkeypatch
):
    monkeypatch.setenv(KEEP_DAYS_ENV, "45")
    monkeypatch.setenv(KEEP_FAILED_DAYS_ENV, "60")
    days_50, days_40 = clone_runs(dagster_db, template, [days_ago(50), days_ago(40)])
    failed_70, failed_55 = clone_runs(dagster_db, template, [days_ago(70), days_ago(55)], F)

    first = prune(stack, instance)

    assert run_ids(dagster_db) == {template, days_40, failed_55, first.run_id}
    report = op_metadata(first, "report_pruned_runs")
    assert (report["keep_days"], report["keep_failed_days"]) == (45, 60)

    second = prune(stack, instance, keep_days=35, keep_failed_days=50)

    assert run_ids(dagster_db) == {template, first.run_id, second.run_id}
