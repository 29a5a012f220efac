"""The monitoring sensors, delivering to a real HTTP webhook on localhost."""

from __future__ import annotations

import threading

import pytest
from dagster import DagsterInstance, build_run_status_sensor_context

from ci_cleanup.drop_canceling_builds.job import drop_canceling_builds
from ci_cleanup.sensors import repeated_failures_alert, run_failed_alert

from .harness import gitlab_database
from .runner import run_job


@pytest.fixture
def broken_database(scratch_database):
    """A GitLab database whose ci_builds lacks a column: every drop_canceling_builds run fails."""
    gitlab_database(scratch_database, "ALTER TABLE p_ci_builds DROP COLUMN lock_version").dispose()
    return scratch_database


def fail_once(stack, instance, database_url):
    result = run_job(drop_canceling_builds, stack, database_url=database_url, instance=instance, raise_on_error=False)
    assert not result.success
    return build_run_status_sensor_context(
        sensor_name="s", dagster_event=result.get_run_failure_event(), dagster_instance=instance,
        dagster_run=result.dagster_run,
    ).for_run_failure()


def test_a_failed_run_is_alerted_on_the_webhook(stack, redis_client, broken_database, webhook):
    instance = DagsterInstance.ephemeral()
    context = fail_once(stack, instance, broken_database)

    run_failed_alert(context)

    assert len(webhook) == 1
    alert = webhook[0]
    assert (alert["alert"], alert["job"], alert["run_id"]) == (
        "run_failed", "drop_canceling_builds", context.dagster_run.run_id
    )
    assert alert["text"].startswith(f"ci_cleanup: drop_canceling_builds run {context.dagster_run.run_id} failed")


def test_three_failures_in_a_row_are_alerted_once_the_third_fails(
    stack, engine, redis_client, broken_database, webhook
):
    instance = DagsterInstance.ephemeral()
    run_job(drop_canceling_builds, stack, instance=instance)  # a success first: it breaks any streak
    for _ in range(2):
        repeated_failures_alert(fail_once(stack, instance, broken_database))
    assert webhook == []

    third = fail_once(stack, instance, broken_database)
    repeated_failures_alert(third)

    assert [a["alert"] for a in webhook] == ["repeated_failures"]
    assert webhook[0]["job"] == "drop_canceling_builds" and len(webhook[0]["run_ids"]) == 3
    assert webhook[0]["run_ids"][0] == third.dagster_run.run_id


def test_deletion_cap_reached_run_after_run_is_a_backlog_alert(stack, engine, redis_client, webhook):
    from ci_cleanup.sensors import BACKLOG_RUNS, max_deletions_backlog_alert
    from ci_cleanup.stale_runner_machines_cleanup.job import stale_runner_machines_cleanup

    from .factories import ago, create

    for _ in range(10):
        create(engine, "ci_runner_machines", created_at=ago(days=30), contacted_at=ago(days=30))
    instance = DagsterInstance.ephemeral()
    capped = {"ops": {"find_stale_runner_machines": {"config": {"max_deletions": 2}}}}
    for n in range(1, BACKLOG_RUNS + 1):
        result = run_job(stale_runner_machines_cleanup, stack, run_config=capped, instance=instance)
        max_deletions_backlog_alert(build_run_status_sensor_context(
            sensor_name="s", dagster_event=result.get_run_success_event(), dagster_instance=instance,
            dagster_run=instance.get_run_by_id(result.run_id),
        ))
        assert len(webhook) == (1 if n == BACKLOG_RUNS else 0)

    assert webhook[0]["alert"] == "max_deletions_backlog" and webhook[0]["job"] == "stale_runner_machines_cleanup"
    assert instance.get_run_by_id(result.run_id).tags["ci_cleanup/rows_changed"] == "2"


def test_run_counters_are_pushed_to_a_pushgateway(stack, engine, redis_client, monkeypatch):
    """A local receiver stands in for the Pushgateway: counters arrive in Prometheus text format."""
    import http.server

    pushed = []

    class Gateway(http.server.BaseHTTPRequestHandler):
        def do_PUT(self):
            pushed.append((self.path, self.rfile.read(int(self.headers["Content-Length"])).decode()))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("CI_CLEANUP_PUSHGATEWAY_URL", f"http://127.0.0.1:{server.server_port}")
    from .factories import create, naive_ago

    create(engine, "ci_builds", created_at=naive_ago(hours=2), updated_at=naive_ago(hours=2))
    try:
        run_job(drop_canceling_builds, stack)
    finally:
        server.shutdown()

    from prometheus_client.parser import text_string_to_metric_families

    assert [path for path, _ in pushed] == ["/metrics/job/ci_cleanup/dagster_job/drop_canceling_builds"]
    families = {f.name: f for f in text_string_to_metric_families(pushed[0][1])}
    assert {name: (f.type, [s.value for s in f.samples]) for name, f in families.items()} == {
        "ci_cleanup_rows_changed": ("gauge", [1.0]), "ci_cleanup_dropped_count": ("gauge", [1.0]),
        "ci_cleanup_doomed_count": ("gauge", [0.0]), "ci_cleanup_changed_concurrently_count": ("gauge", [0.0]),
        "ci_cleanup_left_count": ("gauge", [0.0]), "ci_cleanup_batches": ("gauge", [1.0]),
        "ci_cleanup_rows_with_errors": ("gauge", [0.0]),
    }
    assert families["ci_cleanup_rows_changed"].documentation == "Rows the job's last run changed in GitLab's database"
    assert families["ci_cleanup_dropped_count"].documentation == "Dropped count: a total of the job's last run"


def skipped_run(job, stack, instance, lease_alert):
    """A run of ``job`` that finds its lease held; the sensor then sees the run's success."""
    from .runner import op_metadata

    result = run_job(job, stack, instance=instance)
    lease_alert(build_run_status_sensor_context(
        sensor_name="s", dagster_event=result.get_run_success_event(), dagster_instance=instance,
        dagster_run=instance.get_run_by_id(result.run_id),
    ))
    return result, op_metadata


@pytest.mark.parametrize("job_name", ["drop_canceling_builds", "environments_auto_stop"])
def test_a_lease_with_no_ttl_skips_as_gitlab_does_and_is_alerted(stack, engine, redis_client, webhook, job_name):
    from ci_cleanup.drop_canceling_builds import job as drop
    from ci_cleanup.environments_auto_stop import job as auto_stop
    from ci_cleanup.gitlab.exclusive_lease import PREFIX
    from ci_cleanup.sensors import lease_held_alert

    from .factories import ago, create, naive_ago, row

    module = {"drop_canceling_builds": drop, "environments_auto_stop": auto_stop}[job_name]
    job = getattr(module, job_name)
    if module is drop:
        table = "ci_builds"
        candidate = create(engine, table, created_at=naive_ago(hours=2), updated_at=naive_ago(hours=2))
    else:
        table = "environments"
        candidate = create(engine, table, auto_stop_at=ago(hours=1), auto_stop_setting=0)
    before = row(engine, table, candidate)
    key = PREFIX + module.LEASE_KEY
    redis_client.set(key, "someone-by-hand")  # no EX: never expires
    instance = DagsterInstance.ephemeral()

    result, op_metadata = skipped_run(job, stack, instance, lease_held_alert)

    assert row(engine, table, candidate) == before  # still skipped, as GitLab does
    plan_op = {
        "drop_canceling_builds": "find_canceling_builds", "environments_auto_stop": "find_auto_stoppable_environments"
    }
    plan = op_metadata(result, plan_op[job_name])
    assert (plan["status"], plan["lease_ttl_seconds"]) == ("skipped: lease held", -1)
    tags = instance.get_run_by_id(result.run_id).tags
    assert (tags["ci_cleanup/skipped"], tags["ci_cleanup/lease_without_ttl"]) == ("lease held", key)
    assert [(a["alert"], a["job"], a["lease"]) for a in webhook] == [("lease_without_ttl", job_name, key)]
    assert "has no TTL: it never expires" in webhook[0]["text"]
    assert (redis_client.get(key), redis_client.ttl(key)) == (b"someone-by-hand", -1)  # someone else's key, left


def test_a_job_skipped_three_runs_in_a_row_on_a_held_lease_is_alerted(stack, engine, redis_client, webhook):
    from ci_cleanup.drop_canceling_builds.job import LEASE_KEY
    from ci_cleanup.gitlab.exclusive_lease import PREFIX
    from ci_cleanup.sensors import SKIPPED_RUNS, lease_held_alert

    instance = DagsterInstance.ephemeral()
    run_job(drop_canceling_builds, stack, instance=instance)  # a run that did its work first: it breaks any streak
    redis_client.set(PREFIX + LEASE_KEY, "a-live-gitlab", ex=3600)  # held, with a TTL: no TTL alert
    for n in range(1, SKIPPED_RUNS + 1):
        result, _ = skipped_run(drop_canceling_builds, stack, instance, lease_held_alert)
        assert len(webhook) == (1 if n == SKIPPED_RUNS else 0)

    assert (webhook[0]["alert"], webhook[0]["job"]) == ("skipped_in_a_row", "drop_canceling_builds")
    assert webhook[0]["run_ids"][0] == result.run_id and len(webhook[0]["run_ids"]) == SKIPPED_RUNS
    assert "ci_cleanup/lease_without_ttl" not in instance.get_run_by_id(result.run_id).tags


def test_rows_a_green_run_stepped_over_are_alerted(stack, engine, redis_client, webhook, tmp_path):
    """A ci_deleted_objects row through a symbolic link is refused and kept; the run goes on and is green."""
    from ci_cleanup.schedule_bulk_delete_job_artifacts.files_job import delete_expired_artifact_files
    from ci_cleanup.sensors import rows_with_errors_alert

    from .factories import ago, create, ids

    root = tmp_path / "artifacts"
    root.mkdir()
    (root / "evil").symlink_to(tmp_path)
    (tmp_path / "victim").write_bytes(b"zip")
    refused = create(
        engine, "ci_deleted_objects", store_dir="evil", file="victim", file_store=1, project_id=1,
        pick_up_at=ago(hours=1),
    )
    instance = DagsterInstance.ephemeral()
    config = {"ops": {"plan_artifact_file_removal": {"config": {"artifacts_root": str(root)}}}}

    result = run_job(delete_expired_artifact_files, stack, run_config=config, instance=instance)
    rows_with_errors_alert(build_run_status_sensor_context(
        sensor_name="s", dagster_event=result.get_run_success_event(), dagster_instance=instance,
        dagster_run=instance.get_run_by_id(result.run_id),
    ))

    assert (tmp_path / "victim").read_bytes() == b"zip" and ids(engine, "ci_deleted_objects") == [refused]
    assert instance.get_run_by_id(result.run_id).tags["ci_cleanup/rows_with_errors"] == "1"
    assert [(a["alert"], a["job"], a["run_id"], a["rows"]) for a in webhook] == [
        ("rows_with_errors", "delete_expired_artifact_files", result.run_id, 1)
    ]


def test_a_run_with_nothing_to_alert_has_no_line_of_a_hook_or_a_sensor_in_its_log(stack, engine, redis_client):
    """Every line of a run's log tells the operator something: no HOOK_SKIPPED per step (the lease is given back
    as the run's resources close, not by a failure hook), and no 'Sensor "…" acted on run status SUCCESS' from the
    sensors that sent no alert (Dagster writes that line for each run reaction a sensor returns)."""
    from dagster import build_sensor_context

    from ci_cleanup.definitions import defs
    from ci_cleanup.sensors import lease_held_alert, max_deletions_backlog_alert, rows_with_errors_alert

    instance = DagsterInstance.ephemeral()
    sensors = (max_deletions_backlog_alert, lease_held_alert, rows_with_errors_alert)
    repository = defs.get_repository_def()
    # A run status sensor's first tick starts at the end of the event log: a tick before the run, for its cursor.
    cursors = {s.name: s.evaluate_tick(build_sensor_context(instance=instance, repository_def=repository)).cursor
               for s in sensors}

    result = run_job(drop_canceling_builds, stack, instance=instance)

    assert result.success
    assert [e.event_type_value for e in result.all_events if e.event_type_value.startswith("HOOK_")] == []
    for sensor in sensors:
        tick = sensor.evaluate_tick(
            build_sensor_context(instance=instance, repository_def=repository, cursor=cursors[sensor.name]))
        assert tick.dagster_run_reactions == [] and tick.skip_message, (sensor.name, tick)


def test_a_run_failed_on_an_out_of_range_setting_is_alerted_in_that_one_line(stack, engine, redis_client, webhook):
    """Not only "Steps failed: [...]": the step and its cause, as the run's log has it."""
    from .factories import create, naive_ago, row

    build = create(engine, "ci_builds", status="canceling", created_at=naive_ago(hours=2),
                   updated_at=naive_ago(hours=2))
    before = row(engine, "ci_builds", build)
    instance = DagsterInstance.ephemeral()
    result = run_job(drop_canceling_builds, stack, instance=instance, raise_on_error=False,
                     run_config={"ops": {"find_canceling_builds": {"config": {"batch_size": 0}}}})

    run_failed_alert(build_run_status_sensor_context(
        sensor_name="s", dagster_event=result.get_run_failure_event(), dagster_instance=instance,
        dagster_run=result.dagster_run,
    ).for_run_failure())

    assert [alert["text"] for alert in webhook] == [
        f"ci_cleanup: drop_canceling_builds run {result.run_id} failed: find_canceling_builds: "
        "ValueError: batch_size must be at least 1, not 0"
    ]
    assert row(engine, "ci_builds", build) == before
