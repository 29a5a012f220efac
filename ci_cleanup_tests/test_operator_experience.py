"""What every job offers an operator: a dry run that writes nothing, and its headline number on the run."""

from __future__ import annotations

import pytest
from dagster import DagsterInstance
from sqlalchemy import text

from ci_cleanup.drop_canceling_builds.job import drop_canceling_builds
from ci_cleanup.environments_auto_stop.job import environments_auto_stop
from ci_cleanup.gitlab.schema import gitlab_schema
from ci_cleanup.prune_dagster_history.job import prune_dagster_history
from ci_cleanup.resources import DUTY_CYCLE_ENV
from ci_cleanup.runs import DRY_RUN_TAG, ROWS_CHANGED, ROWS_CHANGED_TAG
from ci_cleanup.schedule_bulk_delete_job_artifacts.files_job import delete_expired_artifact_files
from ci_cleanup.schedule_bulk_delete_job_artifacts.job import schedule_bulk_delete_job_artifacts
from ci_cleanup.stale_runner_machines_cleanup.job import stale_runner_machines_cleanup
from ci_cleanup.stuck_export_jobs.job import stuck_export_jobs
from ci_cleanup_dev.demo import seed

from .runner import run_job, step_failure_message

JOBS = [
    drop_canceling_builds, stale_runner_machines_cleanup, stuck_export_jobs, environments_auto_stop,
    schedule_bulk_delete_job_artifacts, delete_expired_artifact_files, prune_dagster_history,
]


def snapshot(engine, redis_client) -> dict:
    """Every GitLab table's rows and every Redis key with its value and TTL."""
    state = {}
    with engine.connect() as conn:
        for table in gitlab_schema().metadata.sorted_tables:
            if conn.scalar(text("SELECT to_regclass(:t)"), {"t": table.name}) is None:
                continue  # the table of a build's tags this release does not have (taggings or p_ci_build_tags)
            digest = f"SELECT md5(coalesce(string_agg(t::text, ',' ORDER BY t.id), '')) FROM \"{table.name}\" t"
            state[table.name] = conn.execute(text(digest)).scalar()
    for key in redis_client.keys("*"):
        kind = redis_client.type(key)
        value = {b"string": redis_client.get, b"set": lambda k: sorted(redis_client.smembers(k)),
                 b"zset": lambda k: redis_client.zrange(k, 0, -1, withscores=True)}[kind](key)
        state[key] = (value, redis_client.ttl(key) >= 0)  # whether it expires; the seconds left drift
    return state


@pytest.mark.parametrize("job", JOBS, ids=lambda j: j.name)
def test_dry_run_writes_nothing_and_is_tagged(stack, engine, redis_client, job):
    seed(engine, redis_client)
    before = snapshot(engine, redis_client)
    instance = DagsterInstance.ephemeral()

    result = run_job(job, stack, dry_run=True, instance=instance)

    assert snapshot(engine, redis_client) == before
    tags = instance.get_run_by_id(result.run_id).tags
    assert (tags[DRY_RUN_TAG], tags[ROWS_CHANGED_TAG]) == ("true", "0")


@pytest.mark.parametrize("job", JOBS[:5], ids=lambda j: j.name)
def test_a_run_carries_its_rows_changed_as_a_tag(stack, engine, redis_client, job):
    seed(engine, redis_client)
    instance = DagsterInstance.ephemeral()

    result = run_job(job, stack, instance=instance)

    reported = [
        e.step_output_data.metadata[ROWS_CHANGED].value for e in result.all_events
        if e.event_type_value == "STEP_OUTPUT" and ROWS_CHANGED in e.step_output_data.metadata
    ]
    assert len(reported) == 1 and reported[0] > 0
    assert instance.get_run_by_id(result.run_id).tags[ROWS_CHANGED_TAG] == str(reported[0])
    assert DRY_RUN_TAG not in instance.get_run_by_id(result.run_id).tags


def _report(result) -> dict:
    """The run's totals: the metadata of the one output that carries its rows changed."""
    (report,) = [{k: v.value for k, v in e.step_output_data.metadata.items()} for e in result.all_events
                 if e.event_type_value == "STEP_OUTPUT" and ROWS_CHANGED in e.step_output_data.metadata]
    return report


@pytest.mark.parametrize("job", JOBS[:5], ids=lambda j: j.name)
def test_a_braked_run_pauses_between_batches_and_still_does_all_the_work(stack, engine, redis_client, job):
    seed(engine, redis_client)
    braked = {"resources": {"run_options": {"config": {"duty_cycle": 0.5}}}}
    if job is schedule_bulk_delete_job_artifacts:  # the seed's artifacts are one batch a bucket: no pause after a last
        braked["ops"] = {"schedule_buckets": {"config": {"batch_size": 10}}}

    first = _report(run_job(job, stack, run_config=braked))
    after = _report(run_job(job, stack))

    assert first[ROWS_CHANGED] > 0 and first["duty_cycle"] == 0.5 and first["paused_seconds"] > 0
    assert after[ROWS_CHANGED] == 0  # nothing left: the brake slowed the run, it did not stop it short
    assert "duty_cycle" not in after and "paused_seconds" not in after


def test_the_brake_of_every_run_comes_from_the_environment_and_a_bad_one_changes_nothing(
        stack, engine, redis_client, monkeypatch):
    seed(engine, redis_client)
    before = snapshot(engine, redis_client)
    monkeypatch.setenv(DUTY_CYCLE_ENV, "fast")
    failed = run_job(drop_canceling_builds, stack, raise_on_error=False)
    assert not failed.success
    assert step_failure_message(failed) == (
        "ValueError: CI_CLEANUP_DUTY_CYCLE must be a number above 0 and at most 1, not 'fast'\n")
    assert snapshot(engine, redis_client) == before

    monkeypatch.setenv(DUTY_CYCLE_ENV, "0.25")
    report = _report(run_job(drop_canceling_builds, stack))
    assert report[ROWS_CHANGED] > 0 and report["duty_cycle"] == 0.25


def test_run_time_limits_follow_the_seeds_lease_ttls_and_one_run_per_job_is_queued():
    """Run monitoring fails a run past ``dagster/max_runtime``; the run queue limits on ``ci_cleanup/job``."""
    limits = {job.name: job.tags.get("dagster/max_runtime") for job in JOBS}
    assert limits["drop_canceling_builds"] == str(30 * 60)
    assert limits["environments_auto_stop"] == str(50 * 60)
    assert limits["schedule_bulk_delete_job_artifacts"] == str(60 + 5 * 60)  # scheduler's 60 s + its workers
    # The jobs without a lease are bounded too: a run whose worker died is failed at the latest then.
    assert limits["stale_runner_machines_cleanup"] == limits["stuck_export_jobs"] == str(30 * 60)
    assert limits["delete_expired_artifact_files"] == str(10 * 60)  # its cron: every 10 minutes
    assert limits["prune_dagster_history"] == str(60 * 60)  # its lease
    assert {job.tags["ci_cleanup/job"] for job in JOBS} == {job.name for job in JOBS}
