"""``Environments::AutoStopService``: environments past their auto-stop time are stopped as
``Environments::StopService`` does."""

from __future__ import annotations

import datetime as dt
import itertools
import threading
from contextlib import nullcontext
from dataclasses import replace

import pytest
from dagster import DagsterInstance
from sqlalchemy import text
from sqlalchemy.engine import make_url

from ci_cleanup import lease as job_leases
from ci_cleanup.environments_auto_stop import service
from ci_cleanup.environments_auto_stop.job import (
    LEASE_KEY,
    LEASE_TTL_SECONDS,
    environments_auto_stop,
    environments_auto_stop_schedule,
)
from ci_cleanup.gitlab.batching import autocommit
from ci_cleanup.gitlab.exclusive_lease import PREFIX, ExclusiveLease
from ci_cleanup.gitlab.schema import naive_utc
from ci_cleanup.runs import DRY_RUN_TAG
from ci_cleanup_dev.project_rows import add_projects

from .factories import S, ago, backend_waiting_on_lock, create, ids, naive_ago, row, updates_refused
from .harness import gitlab_database, on, statements_sent
from .runner import observed_per_batch, op_metadata, run_in_time_zone, run_job, step_failure_message

pytestmark = pytest.mark.layouts  # on one database and on GitLab as deployed (main + ci, PgBouncer)

LEASE = PREFIX + LEASE_KEY
CONFIG = "find_auto_stoppable_environments"
_names = itertools.count(1)


def environment(engine, *, auto_stop_at=None, **values) -> int:
    n = next(_names)
    return create(
        engine, "environments", name=f"review/app-{n}", slug=f"review-app-{n}",
        auto_stop_at=ago(hours=1) if auto_stop_at is None else auto_stop_at,
        created_at=naive_ago(days=3), updated_at=naive_ago(days=3), **values,
    )


def review_app(engine, *, stop_status="manual", **values) -> tuple[int, int]:
    """An expired review app deployed by `deploy` in pipeline 500+n, with its `stop_review` action."""
    env_id = environment(engine, **values)
    pipeline = 500 + env_id
    deploy = create(engine, "ci_builds", commit_id=pipeline, name="deploy", status="success")
    stop = create(engine, "ci_builds", commit_id=pipeline, name="stop_review", status=stop_status, queued_at=None)
    create(engine, "deployments", environment_id=env_id, deployable_id=deploy, on_stop="stop_review", status=2)
    return env_id, stop


def report(result) -> dict:
    return op_metadata(result, "report_stopped_environments")


def batch_params(now: dt.datetime) -> dict:
    """The first batch's parameters, as the service binds them."""
    return {"now": now, "naive_now": naive_utc(now), "after_at": service.START[0], "after_id": service.START[1],
            "limit": service.BATCH_SIZE}


def failure_metadata(result) -> dict:
    """The metadata of the run's failure (a ``dagster.Failure`` raised with the run's totals), as plain values."""
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    return {k: v.value for k, v in failure.step_failure_data.user_failure_data.metadata.items()}


def near_now(value: dt.datetime) -> bool:
    return abs(value - naive_ago()) < dt.timedelta(minutes=1)


def assert_stopped(engine, env_id: int) -> None:
    env = row(engine, "environments", env_id)
    assert (env.state, env.auto_stop_at) == ("stopped", None)
    assert near_now(env.updated_at)


def test_plain_environment_is_stopped(stack, engine, redis_client):
    env_id = environment(engine)

    result = run_job(environments_auto_stop, stack)

    assert_stopped(engine, env_id)
    meta = report(result)
    assert (meta["status"], meta["rows_changed"], meta["stopped_count"], meta["stopping_count"]) == ("success", 1, 1, 0)
    assert (meta["left_untouched_count"], meta["failed_count"], meta["loops"], meta["limit_reached"]) == (0, 0, 1, None)
    assert meta["stopped_ids"] == [env_id]
    assert redis_client.exists(LEASE) == 0  # released after the run


def batch_statements_sent(engine, flags: service.Flags) -> list[tuple[str, str]]:
    """The service run on ``engine``'s layout: each statement sent (savepoints aside), by the database it went to."""
    main, ci = on(engine, "environments"), on(engine, "ci_builds")
    with statements_sent(main, ci) as sent:
        limits = service.Limits(play_stop_actions=flags.play_stop_actions)
        (service.find_auto_stoppable if flags.dry_run else service.auto_stop_environments)(main, ci, S, limits)
    return [("ci" if to is not main else "main", sql) for to, sql, _ in sent if "SAVEPOINT" not in sql]


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry run"])
def test_each_batch_statement_sent_is_its_sql_file(stack, engine, dry_run):
    plain, (app, stop), kept = environment(engine), review_app(engine), environment(engine, auto_stop_setting=1)
    decomposed = on(engine, "environments") is not on(engine, "ci_builds")

    sent = batch_statements_sent(engine, service.Flags(dry_run=dry_run))

    def file(sql_file, in_ci=False):
        return ("ci" if in_ci and decomposed else "main", sql_file.sent(S, on(engine, "environments").dialect))

    group = [file(service.FIND_GROUP_JOBS, in_ci=True), file(service.FIND_GROUP)]  # the deployment group's reads
    if dry_run:
        batch = [file(service.FIND_BATCH), *group, file(service.FIND_STOP_ACTIONS, in_ci=True)]
        assert sent == [*batch, file(service.FIND_BATCH)]  # the last: none left
    elif decomposed:
        batch = [file(service.PICK_BATCH), *group, file(service.PLAY_STOP_ACTIONS, in_ci=True),
                 file(service.WRITE_STATES)]
        assert sent == [*batch, file(service.PICK_BATCH)]
    else:
        assert sent == [file(service.STOP_BATCH), file(service.STOP_BATCH)]
    expected = ("available", "manual") if dry_run else ("stopping", "pending")
    assert (row(engine, "environments", app).state, row(engine, "ci_builds", stop).status) == expected
    assert row(engine, "environments", plain).state == ("available" if dry_run else "stopped")
    assert row(engine, "environments", kept).state == "available"


def test_a_refused_batch_is_done_again_environment_by_environment_with_the_same_sql_files(stack, engine):
    good, (app, stop), bad = environment(engine), review_app(engine), environment(engine)
    files = {f.sent(S, engine.dialect) for f in (service.STOP_BATCH, service.PICK_BATCH, service.FIND_GROUP_JOBS,
                                                 service.FIND_GROUP, service.PLAY_STOP_ACTIONS, service.WRITE_STATES)}

    with updates_refused(engine, "environments", f"NEW.id = {bad}", "environment is broken"):
        sent = batch_statements_sent(engine, service.Flags())

    assert {sql for _, sql in sent} <= files
    assert_stopped(engine, good)
    assert (row(engine, "environments", app).state, row(engine, "ci_builds", stop).status) == ("stopping", "pending")
    assert row(engine, "environments", bad).state == "available"


def test_review_apps_with_stop_actions_go_stopping_and_their_stop_builds_pending(stack, engine, redis_client):
    apps = [review_app(engine) for _ in range(2)]
    auto_stop_ats = [row(engine, "environments", env_id).auto_stop_at for env_id, _ in apps]

    result = run_job(environments_auto_stop, stack)

    for (env_id, stop_id), auto_stop_at in zip(apps, auto_stop_ats):
        env = row(engine, "environments", env_id)
        assert (env.state, env.auto_stop_at) == ("stopping", auto_stop_at)
        assert near_now(env.updated_at)
        build = row(engine, "ci_builds", stop_id)
        assert (build.status, build.lock_version) == ("pending", 1)
        assert near_now(build.queued_at) and near_now(build.updated_at)
    # the deploy builds are not stop actions
    assert ids(engine, "ci_builds", S.ci_builds.c.name == "deploy", S.ci_builds.c.status == "success") == [1, 3]
    with on(engine, "ci_pending_builds").connect() as conn:  # played builds join the runners' queue
        assert sorted(conn.execute(text("SELECT build_id, project_id FROM ci_pending_builds")).all()) == [
            (2, 1), (4, 1)]
    meta = report(result)
    assert (meta["stopping_count"], meta["stop_actions_started"], meta["stopped_count"], meta["rows_changed"]) == (
        2, 2, 0, 4)
    assert meta["stopping_ids"] == [env_id for env_id, _ in apps]


def test_stop_action_shared_by_two_environments_is_played_and_counted_once(stack, engine, redis_client):
    """Two environments deployed from one pipeline, both ``on_stop: stop_review``: one stop action for both."""
    deploy = create(engine, "ci_builds", commit_id=900, name="deploy", status="success")
    stop = create(engine, "ci_builds", commit_id=900, name="stop_review", status="manual", queued_at=None)
    envs = [environment(engine) for _ in range(2)]
    for env_id in envs:
        create(engine, "deployments", environment_id=env_id, deployable_id=deploy, on_stop="stop_review", status=2)

    result = run_job(environments_auto_stop, stack)

    assert [row(engine, "environments", env_id).state for env_id in envs] == ["stopping", "stopping"]
    assert (row(engine, "ci_builds", stop).status, row(engine, "ci_builds", stop).lock_version) == ("pending", 1)
    with on(engine, "ci_pending_builds").connect() as conn:
        assert conn.execute(text("SELECT build_id FROM ci_pending_builds")).all() == [(stop,)]
    meta = report(result)
    assert (meta["stopping_count"], meta["stop_actions_started"], meta["rows_changed"]) == (2, 1, 3)


def test_stop_action_not_manual_is_left_as_is_and_environment_goes_stopping(stack, engine, redis_client):
    env_id, stop_id = review_app(engine, stop_status="success")
    before = row(engine, "ci_builds", stop_id)

    result = run_job(environments_auto_stop, stack)

    assert row(engine, "environments", env_id).state == "stopping"
    assert row(engine, "ci_builds", stop_id) == before
    assert (report(result)["stopping_count"], report(result)["stop_actions_started"]) == (1, 0)


def test_stop_actions_come_from_the_last_finished_deployment(stack, engine, redis_client):
    """GitLab 17.0+ (this schema's): the last deployment that finished, failed or canceled included
    (Deployment.last_finished_deployment_group_for_environment); one still running is not finished."""
    env_id = environment(engine)
    old_deploy = create(engine, "ci_builds", commit_id=10, name="deploy", status="success")
    old_stop = create(engine, "ci_builds", commit_id=10, name="stop_review", status="manual")
    create(engine, "deployments", environment_id=env_id, deployable_id=old_deploy, on_stop="stop_review", status=2)
    failed_deploy = create(engine, "ci_builds", commit_id=20, name="deploy", status="failed")
    failed_stop = create(engine, "ci_builds", commit_id=20, name="stop_review", status="manual")
    bridge = create(engine, "ci_builds", commit_id=20, name="stop_review", type="Ci::Bridge", status="manual")
    create(engine, "deployments", environment_id=env_id, deployable_id=failed_deploy, on_stop="stop_review", status=3)
    running_deploy = create(engine, "ci_builds", commit_id=30, name="deploy", status="running")
    running_stop = create(engine, "ci_builds", commit_id=30, name="stop_review", status="manual")
    create(engine, "deployments", environment_id=env_id, deployable_id=running_deploy, on_stop="stop_review", status=1)

    run_job(environments_auto_stop, stack)

    assert row(engine, "environments", env_id).state == "stopping"
    assert ids(engine, "ci_builds", S.ci_builds.c.status == "pending") == [failed_stop]
    assert ids(engine, "ci_builds", S.ci_builds.c.status == "manual") == [old_stop, bridge, running_stop]


def deployed(engine, env_id: int, pipeline: int, on_stop: str, *, status="success", retried=None) -> tuple[int, int]:
    """A deploy job of ``pipeline`` to ``env_id`` (its deployment's status the job's) and its manual stop action
    ``on_stop``, in ``pipeline`` too: (deploy job, stop action)."""
    deploy = create(engine, "ci_builds", commit_id=pipeline, name=f"deploy_{on_stop}", status=status, retried=retried)
    stop = create(engine, "ci_builds", commit_id=pipeline, name=on_stop, status="manual", queued_at=None)
    create(engine, "deployments", environment_id=env_id, deployable_id=deploy, on_stop=on_stop,
           status={"success": 2, "failed": 3, "running": 1}[status], finished_at=None if status == "running" else ago())
    return deploy, stop


def test_stop_actions_are_those_of_the_last_pipelines_deployment_group(stack, engine, redis_client):
    """Environment#stop_actions = last_finished_deployment_group.map(&:stop_action): every deployment of this
    environment whose job is one of the last finished deployment's pipeline's latest finished jobs, each with its own
    on_stop; a deployment of another environment in that pipeline is not of the group."""
    env_id, other = environment(engine), environment(engine, auto_stop_at=ago(hours=-1))  # the other not due
    _, stop_a = deployed(engine, env_id, 40, "stop_a", status="failed")
    _, stop_other = deployed(engine, other, 40, "stop_other")
    _, stop_b = deployed(engine, env_id, 40, "stop_b")  # the last deployment

    dry = report(run_job(environments_auto_stop, stack, dry_run=True))
    assert (dry["would_set_stopping_ids"], dry["would_start_stop_action_ids"]) == ([env_id], [stop_a, stop_b])
    result = report(run_job(environments_auto_stop, stack))

    assert [row(engine, "environments", e).state for e in (env_id, other)] == ["stopping", "available"]
    assert ids(engine, "ci_builds", S.ci_builds.c.status == "pending") == [stop_a, stop_b]
    assert row(engine, "ci_builds", stop_other).status == "manual"
    with on(engine, "ci_pending_builds").connect() as conn:  # both join the runners' queue
        assert conn.execute(text("SELECT build_id FROM ci_pending_builds ORDER BY build_id")).all() == [
            (stop_a,), (stop_b,)]
    assert (result["stopping_ids"], result["stop_actions_started"], result["rows_changed"]) == ([env_id], 2, 3)


def test_a_retried_jobs_deployment_is_not_of_the_group(stack, engine, redis_client):
    """latest_finished_jobs are the pipeline's latest (not retried) finished jobs: the last finished deployment's job
    retried (its retry still running) brings no stop action; the group is the pipeline's other deployment."""
    env_id = environment(engine)
    _, stop_b = deployed(engine, env_id, 41, "stop_b")
    retried, stop_review = deployed(engine, env_id, 41, "stop_review", retried=True)  # the last finished deployment
    retry = create(engine, "ci_builds", commit_id=41, name="deploy_stop_review", status="running")
    create(engine, "deployments", environment_id=env_id, deployable_id=retry, on_stop="stop_review", status=1)

    result = report(run_job(environments_auto_stop, stack))

    assert row(engine, "environments", env_id).state == "stopping"
    assert ids(engine, "ci_builds", S.ci_builds.c.status == "pending") == [stop_b]
    assert row(engine, "ci_builds", stop_review).status == "manual"
    assert (result["stopping_ids"], result["stop_actions_started"]) == ([env_id], 1)


def project_review_app(engine, project_id: int) -> tuple[int, int]:
    """A review app of project ``project_id``, its environment, deployment and builds all the project's."""
    env_id = environment(engine, project_id=project_id)
    build = dict(commit_id=700 + env_id, project_id=project_id)
    deploy = create(engine, "ci_builds", name="deploy", status="success", **build)
    stop = create(engine, "ci_builds", name="stop_review", status="manual", queued_at=None, **build)
    create(engine, "deployments", project_id=project_id, environment_id=env_id, deployable_id=deploy,
           on_stop="stop_review", status=2)
    return env_id, stop


def test_a_stop_action_is_queued_from_its_projects_settings_and_not_at_all_without_its_project(
        stack, engine, redis_client):
    """args_from_build: builds enabled means a project_features row with builds_access_level > 0 and the project not
    pending_delete; group runners need a project_ci_cd_settings row that enables them."""
    with on(engine, "projects").begin() as conn:
        add_projects(conn, [2, 3, 4])
        conn.execute(text("UPDATE projects SET pending_delete = true WHERE id = 2;"
                          "DELETE FROM project_features WHERE project_id = 3;"
                          "DELETE FROM project_ci_cd_settings WHERE project_id = 4"))
    deleting, featureless, settingless, lost = (project_review_app(engine, p) for p in (2, 3, 4, 5))

    dry = report(run_job(environments_auto_stop, stack, dry_run=True))
    assert (dry["failed_ids"], ids(engine, "ci_pending_builds")) == ([lost[0]], [])
    result = report(run_job(environments_auto_stop, stack))

    with on(engine, "ci_pending_builds").connect() as conn:
        assert conn.execute(text(
            "SELECT build_id, namespace_id, instance_runners_enabled, namespace_traversal_ids "
            "FROM ci_pending_builds ORDER BY build_id")).all() == [
            (deleting[1], 2, False, []), (featureless[1], 3, False, []), (settingless[1], 4, True, [])]
    assert [row(engine, "environments", env).state for env, _ in (deleting, featureless, settingless, lost)] == [
        "stopping", "stopping", "stopping", "available"]
    assert row(engine, "ci_builds", lost[1]).status == "manual"
    assert (result["failed_ids"], result["stopping_count"], result["stop_actions_started"]) == ([lost[0]], 3, 3)
    assert result["errors"] == [f"environment {lost[0]}: project 5 has no row in projects (or its namespace none in "
                                f"namespaces): its stop actions cannot be queued for a runner, so none was played "
                                f"and environment {lost[0]} was left available"]


@pytest.mark.parametrize(
    "values",
    [
        pytest.param(dict(auto_stop_at=ago(hours=-1)), id="future"),
        pytest.param(dict(auto_stop_at=dt.datetime.max.replace(tzinfo=dt.UTC)), id="far future"),
        pytest.param(dict(state="stopped"), id="already stopped"),
        pytest.param(dict(state="stopping"), id="already stopping"),
    ],
)
def test_environment_not_due_is_untouched(stack, engine, redis_client, values):
    env_id = environment(engine, **values)
    before = row(engine, "environments", env_id)
    result = run_job(environments_auto_stop, stack)
    assert row(engine, "environments", env_id) == before
    assert (report(result)["rows_changed"], report(result)["loops"]) == (0, 0)


def test_environment_without_auto_stop_at_is_untouched(stack, engine, redis_client):
    env_id = create(engine, "environments", auto_stop_at=None)
    before = row(engine, "environments", env_id)
    run_job(environments_auto_stop, stack)
    assert row(engine, "environments", env_id) == before


def test_with_action_setting_without_stop_actions_is_untouched_and_not_picked_again(stack, engine, redis_client):
    with engine.begin() as conn:
        conn.execute(
            S.environments.insert(),
            [dict(project_id=1, name=f"review/{i}", slug=f"review-{i}", state="available", auto_stop_at=ago(hours=2),
                  auto_stop_setting=1 if i < 150 else 0, created_at=naive_ago(days=1), updated_at=naive_ago(days=1))
             for i in range(410)],
        )
    with_action = ids(engine, "environments", S.environments.c.auto_stop_setting == 1)

    result = run_job(environments_auto_stop, stack)

    assert ids(engine, "environments", S.environments.c.state == "available") == with_action
    assert len(ids(engine, "environments", S.environments.c.state == "stopped",
                   S.environments.c.auto_stop_at.is_(None))) == 260
    meta = report(result)
    assert (meta["stopped_count"], meta["left_untouched_count"], meta["loops"], meta["limit_reached"]) == (
        260, 150, 5, None)
    observations = [e.event_specific_data.asset_observation for e in result.all_events
                    if e.event_type_value == "ASSET_OBSERVATION"]
    assert observed_per_batch(result, "stopped") == [0, 50, 100, 100, 10]
    assert observed_per_batch(result, "left_untouched") == [100, 50, 0, 0, 0]
    assert sum(o.metadata["stopped"].value for o in observations) == 260
    assert all(o.asset_key.path == ["gitlab", "environments"] for o in observations)


def test_lease_held_elsewhere_changes_nothing(stack, engine, redis_client):
    env_id = environment(engine)
    before = row(engine, "environments", env_id)
    redis_client.set(LEASE, "someone-else", ex=1200)

    result = run_job(environments_auto_stop, stack)

    assert result.success
    assert row(engine, "environments", env_id) == before
    assert redis_client.get(LEASE) == b"someone-else"
    assert 1190 <= redis_client.ttl(LEASE) <= 1200
    assert (report(result)["status"], report(result)["rows_changed"]) == ("skipped: lease held", 0)


def test_lease_is_released_when_the_run_fails(stack, engine, redis_client, monkeypatch):
    env_id = environment(engine)
    taken = []

    def crash(*args, **kwargs):
        taken.append((redis_client.get(LEASE), redis_client.ttl(LEASE)))
        raise RuntimeError("boom")

    monkeypatch.setattr(service, "auto_stop_environments", crash)
    result = run_job(environments_auto_stop, stack, raise_on_error=False)

    assert not result.success
    assert taken[0][0] == result.run_id.encode()  # held by this run, for 50 minutes, while it worked
    assert LEASE_TTL_SECONDS - 10 <= taken[0][1] <= LEASE_TTL_SECONDS
    assert redis_client.exists(LEASE) == 0
    assert row(engine, "environments", env_id).state == "available"


def test_lease_taken_over_mid_run_stops_the_run(stack, engine, redis_client, monkeypatch):
    first, second = environment(engine), environment(engine)
    renew = ExclusiveLease.renew

    def taken_over(lease):  # another process holds the key by the time we renew after batch 1
        redis_client.set(LEASE, "someone-else", ex=600)
        return renew(lease)

    monkeypatch.setattr(ExclusiveLease, "renew", taken_over)
    # a run of seconds renews after every batch
    every_batch = replace(job_leases.of_job("environments_auto_stop"), renew_every_seconds=0)
    monkeypatch.setitem(job_leases.DECLARED, "environments_auto_stop", every_batch)
    result = run_job(environments_auto_stop, stack, run_config={"ops": {CONFIG: {"config": {"batch_size": 1}}}},
                     raise_on_error=False)

    assert not result.success
    assert_stopped(engine, first)
    assert row(engine, "environments", second).state == "available"
    assert redis_client.get(LEASE) == b"someone-else"  # the other holder's lease is not released by us


def test_loop_limit_config_is_honoured(stack, engine, redis_client):
    env_ids = [environment(engine) for _ in range(3)]

    result = run_job(
        environments_auto_stop, stack, run_config={"ops": {CONFIG: {"config": {"max_loops": 1, "batch_size": 1}}}}
    )

    assert_stopped(engine, env_ids[0])
    assert ids(engine, "environments", S.environments.c.state == "available") == env_ids[1:]
    meta = report(result)
    assert (meta["stopped_count"], meta["loops"], meta["limit_reached"]) == (1, 1, "loops")


def test_time_limit_ends_the_loop_before_a_new_batch(stack, engine):
    env_ids = [environment(engine) for _ in range(3)]
    ticks = iter([0.0, 10.0, 46 * 60.0])

    result = service.auto_stop_environments(
        on(engine, "environments"), on(engine, "ci_builds"), S, service.Limits(batch_size=1),
        service.Hooks(clock=lambda: next(ticks)))

    assert (result.loops, result.limit_reached, result.counts[service.STOPPED]) == (2, "time", 2)
    assert ids(engine, "environments", S.environments.c.state == "available") == env_ids[2:]


def test_environment_whose_stop_fails_is_reported_and_the_others_are_stopped(stack, engine, redis_client):
    good_before = environment(engine)
    bad = environment(engine)
    good_after, good_stop = review_app(engine)
    bad_row = row(engine, "environments", bad)
    # Stopping `bad` fails in the database, as a broken row would.
    with updates_refused(engine, "environments", f"NEW.id = {bad}", "environment is broken"):
        result = run_job(environments_auto_stop, stack)

    assert result.success
    assert row(engine, "environments", bad) == bad_row
    assert_stopped(engine, good_before)
    assert row(engine, "environments", good_after).state == "stopping"
    assert row(engine, "ci_builds", good_stop).status == "pending"
    meta = report(result)
    assert (meta["failed_count"], meta["stopped_count"], meta["stopping_count"], meta["rows_changed"]) == (1, 1, 1, 3)
    assert meta["failed_ids"] == [bad]
    assert meta["errors"] == [f"environment {bad}: environment is broken"]
    assert redis_client.exists(LEASE) == 0


def test_environment_restarted_after_it_was_read_is_not_overwritten(stack, engine):
    env_id = environment(engine)
    main, ci = on(engine, "environments"), on(engine, "ci_builds")
    params = batch_params(ago())
    with main.connect() as conn:
        [read] = conn.execute(service.FIND_BATCH.on(S, conn.dialect), params).all()
    with engine.begin() as conn:  # a new deployment pushes auto_stop_at into the future
        conn.execute(S.environments.update().where(S.environments.c.id == env_id).values(auto_stop_at=ago(days=-1)))
    before = row(engine, "environments", env_id)

    batch = service.BatchOutcome()
    with autocommit(main) as main_conn, (nullcontext(main_conn) if ci is main else autocommit(ci)) as ci_conn:
        run = service.Run(main_conn, ci_conn, S, service.Flags(), service.Hooks())
        service.stop_picked(run, params, [read], batch)

    assert {outcome: ids for outcome, ids in batch.ids.items() if ids} == {service.CHANGED_CONCURRENTLY: [env_id]}
    assert row(engine, "environments", env_id) == before


def test_environment_restarted_while_the_batch_waits_on_it_is_not_picked_and_its_stop_action_not_played(
    stack, engine
):
    """The batch is picked and locked before its stop actions are played: a restart committed meanwhile is
    re-checked by PostgreSQL, and the restarted environments are neither written nor have their actions played."""
    plain = environment(engine)
    app, stop = review_app(engine)
    other = environment(engine)
    main = on(engine, "environments")
    locker = main.connect()
    restart = locker.begin()  # a new deployment pushes auto_stop_at of both, and holds their rows until it commits
    locker.execute(
        S.environments.update().where(S.environments.c.id.in_([plain, app])).values(auto_stop_at=ago(days=-1)))
    out = []
    ci = on(engine, "ci_builds")
    worker = threading.Thread(target=lambda: out.append(service.auto_stop_environments(main, ci, S)))
    worker.start()
    try:
        # the pick waits on the restarted rows (its FOR UPDATE is past pg_stat_activity's first 1024 bytes)
        backend_waiting_on_lock(main, "%FROM environments%")
        restart.commit()
    finally:
        if restart.is_active:
            restart.rollback()
        locker.close()
    worker.join(60)

    [result] = out
    assert {outcome: ids for outcome, ids in result.ids.items() if ids} == {service.STOPPED: [other]}
    assert result.stop_actions_started == 0
    assert [row(engine, "environments", i).state for i in (plain, app)] == ["available", "available"]
    # the stop action of an environment left running is not played
    assert row(engine, "ci_builds", stop).status == "manual"
    assert ids(engine, "ci_pending_builds") == []


@pytest.mark.parametrize("zone", ["Pacific/Kiritimati", "America/Los_Angeles"])
def test_session_time_zone_does_not_change_the_result(stack, engine, redis_client, zone):
    due = environment(engine, auto_stop_at=ago(minutes=5))
    not_due = environment(engine, auto_stop_at=ago(minutes=-5))
    before = row(engine, "environments", not_due)

    run_in_time_zone(environments_auto_stop, stack, zone)

    assert_stopped(engine, due)  # updated_at written as naive UTC
    assert row(engine, "environments", not_due) == before


def test_dry_run_reports_and_writes_nothing(stack, engine, redis_client):
    plain = environment(engine)
    app, stop = review_app(engine)
    kept = environment(engine, auto_stop_setting=1)
    before = {t: [row(engine, t, i) for i in ids(engine, t)] for t in ("environments", "ci_builds", "deployments")}
    instance = DagsterInstance.ephemeral()

    result = run_job(environments_auto_stop, stack, dry_run=True, instance=instance)

    assert {t: [row(engine, t, i) for i in ids(engine, t)] for t in before} == before
    assert ids(engine, "ci_pending_builds") == []
    would = op_metadata(result, "report_stopped_environments")
    assert (would["would_stop_count"], would["would_stop_ids"]) == (1, [plain])
    assert (would["would_set_stopping_count"], would["would_set_stopping_ids"]) == (1, [app])
    assert (would["would_start_stop_actions_count"], would["would_start_stop_action_ids"]) == (1, [stop])
    assert (would["would_leave_untouched_count"], would["would_leave_untouched_ids"]) == (1, [kept])
    meta = report(result)
    assert (meta["status"], meta["rows_changed"], meta["stopped_count"], meta["loops"]) == ("dry run", 0, 0, 1)
    assert (meta["would_stop_count"], meta["would_set_stopping_count"], meta["would_leave_untouched_count"]) == (
        1, 1, 1)
    assert redis_client.keys("*") == []
    assert instance.get_run_by_id(result.run_id).tags[DRY_RUN_TAG] == "true"


@pytest.mark.parametrize(
    "bad", [{"batch_size": 0}, {"max_loops": 0}, {"max_runtime_minutes": -5}, {"max_runtime_minutes": 50},
            {"batch_size": 1_000_000}]
)
def test_invalid_config_is_refused_before_anything_is_written(stack, engine, redis_client, bad):
    env_id = environment(engine)
    before = row(engine, "environments", env_id)
    result = run_job(environments_auto_stop, stack, run_config={"ops": {CONFIG: {"config": bad}}}, raise_on_error=False)
    assert not result.success
    assert row(engine, "environments", env_id) == before
    assert redis_client.keys("*") == []


def test_missing_column_fails_clearly_and_changes_nothing(stack, scratch_database, redis_client):
    scratch = gitlab_database(
        scratch_database,
        "ALTER TABLE environments DROP COLUMN updated_at",
        "DROP TABLE deployments",
        "INSERT INTO environments (id, project_id, name, slug, state, auto_stop_at) "
        "VALUES (1, 1, 'review/a', 'review-a', 'available', now() - interval '1 hour')",
    )

    result = run_job(environments_auto_stop, stack, database_url=scratch_database, raise_on_error=False)

    assert not result.success
    message = step_failure_message(result)
    assert "column environments.updated_at" in message and "table deployments" in message
    with scratch.connect() as conn:
        assert conn.execute(text("SELECT state FROM environments")).scalar_one() == "available"
    assert redis_client.exists(LEASE) == 0
    scratch.dispose()


def test_schedule_runs_at_24_past_every_hour_utc():
    assert environments_auto_stop_schedule.cron_schedule == "24 * * * *"
    assert environments_auto_stop_schedule.execution_timezone == "UTC"
    assert environments_auto_stop_schedule.job_name == "environments_auto_stop"


# --- auto_stop_at values Python's datetime cannot hold, in any session time zone --------------------------

# Year 1 read in a session west of UTC is "year -1" for Python; '-infinity' and BC sort before year 1.
ODD_AUTO_STOP_AT = {"year 1": "0001-01-01 00:00:00+00", "-infinity": "-infinity", "BC": "0044-03-15 12:00:00+00 BC"}
ZONES = ["UTC", "America/New_York"]


def zoned_database(url: str, zone: str):
    """GitLab's tables in the scratch database ``url``, whose sessions default to the time zone ``zone``."""
    scratch = gitlab_database(url)
    with scratch.begin() as conn:
        conn.execute(text(f"ALTER DATABASE \"{make_url(url).database}\" SET timezone TO '{zone}'"))
    scratch.dispose()  # new sessions only take the database's setting
    return scratch


def due_environments(engine, count: int, **values) -> list[int]:
    with engine.begin() as conn:
        return list(conn.scalars(S.environments.insert().returning(S.environments.c.id), [
            dict(project_id=1, name=f"review/due-{i}", slug=f"review-due-{i}", state="available",
                 auto_stop_at=ago(minutes=10 + i), created_at=naive_ago(days=1), updated_at=naive_ago(days=1),
                 **values)
            for i in range(count)
        ]))


def odd_environment(engine, auto_stop_at: str, **values) -> int:
    return create(engine, "environments", auto_stop_at=text(f"'{auto_stop_at}'::timestamptz"), **values)


def row_text(engine, env_id: int) -> str:
    """The whole environments row as PostgreSQL's text: an odd auto_stop_at cannot be read as a datetime."""
    with engine.connect() as conn:
        return conn.execute(text("SELECT e::text FROM environments e WHERE id = :id"), {"id": env_id}).scalar_one()


@pytest.mark.parametrize("zone", ZONES)
@pytest.mark.parametrize("odd", sorted(ODD_AUTO_STOP_AT))
def test_one_odd_auto_stop_at_among_251_due_environments_is_stopped_with_all_the_others(
    stack, scratch_database, redis_client, zone, odd
):
    scratch = zoned_database(scratch_database, zone)
    others = due_environments(scratch, 250)
    odd_id = odd_environment(scratch, ODD_AUTO_STOP_AT[odd])

    result = run_job(environments_auto_stop, stack, database_url=scratch_database)

    with scratch.connect() as conn:
        assert conn.execute(text("SELECT current_setting('TimeZone')")).scalar_one() == zone
        assert conn.execute(text(
            "SELECT id FROM environments WHERE state = 'stopped' AND auto_stop_at IS NULL ORDER BY id"
        )).scalars().all() == sorted([*others, odd_id])
        assert conn.execute(text("SELECT count(*) FROM environments")).scalar_one() == 251
    meta = report(result)
    assert (meta["status"], meta["rows_changed"], meta["stopped_count"], meta["loops"]) == ("success", 251, 251, 3)
    assert (meta["rows_with_errors"], meta["failed_ids"], meta["errors"]) == (0, [], [])
    assert meta["stopped_ids"][0] == odd_id  # it sorts first: the first batch is where it used to fail
    scratch.dispose()


@pytest.mark.parametrize("zone", ZONES)
def test_odd_auto_stop_at_with_stop_actions_goes_stopping_and_its_action_is_played(
    stack, scratch_database, redis_client, zone
):
    scratch = zoned_database(scratch_database, zone)
    apps = {odd: review_app(scratch) for odd in ODD_AUTO_STOP_AT}
    with scratch.begin() as conn:
        for odd, (env_id, _) in apps.items():
            conn.execute(text("UPDATE environments SET auto_stop_at = CAST(:at AS timestamptz) WHERE id = :id"),
                         {"at": ODD_AUTO_STOP_AT[odd], "id": env_id})

    result = run_job(environments_auto_stop, stack, database_url=scratch_database)

    with scratch.connect() as conn:
        stopping = conn.execute(text("SELECT id FROM environments WHERE state = 'stopping' ORDER BY id")).all()
        pending = conn.execute(text("SELECT id FROM p_ci_builds WHERE status = 'pending' ORDER BY id")).scalars().all()
        queued = conn.execute(text("SELECT build_id FROM ci_pending_builds ORDER BY build_id")).scalars().all()
        kept = [  # auto_stop_at is kept, as GitLab keeps it
            conn.execute(text("SELECT auto_stop_at = CAST(:at AS timestamptz) FROM environments WHERE id = :id"),
                         {"at": ODD_AUTO_STOP_AT[odd], "id": env_id}).scalar_one()
            for odd, (env_id, _) in apps.items()
        ]
    assert stopping == [(env_id,) for env_id, _ in apps.values()]
    assert kept == [True, True, True]
    assert pending == queued == [stop for _, stop in apps.values()]
    meta = report(result)
    assert (meta["stopping_count"], meta["stop_actions_started"], meta["rows_with_errors"]) == (3, 3, 0)
    scratch.dispose()


@pytest.mark.parametrize("zone", ZONES)
def test_dry_run_reports_odd_auto_stop_at_as_would_stop(stack, scratch_database, redis_client, zone):
    scratch = zoned_database(scratch_database, zone)
    odd_ids = [odd_environment(scratch, value) for value in ODD_AUTO_STOP_AT.values()]
    ordinary = due_environments(scratch, 1)

    result = run_job(environments_auto_stop, stack, database_url=scratch_database, dry_run=True)

    with scratch.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM environments WHERE state = 'available'")).scalar_one() == 4
    meta = report(result)
    # in auto_stop_at order: -infinity, BC, year 1, then the ordinary one
    assert meta["would_stop_ids"] == [odd_ids[1], odd_ids[2], odd_ids[0], *ordinary]
    scratch.dispose()


@pytest.mark.parametrize("zone", ZONES)
def test_odd_auto_stop_at_the_database_refuses_to_stop_is_reported_and_the_others_are_stopped(
    stack, scratch_database, redis_client, zone
):
    scratch = zoned_database(scratch_database, zone)
    refused = odd_environment(scratch, ODD_AUTO_STOP_AT["year 1"])
    others = [odd_environment(scratch, ODD_AUTO_STOP_AT["BC"]), *due_environments(scratch, 2)]
    before = row_text(scratch, refused)

    with updates_refused(scratch, "environments", f"NEW.id = {refused}", "environment is broken"):
        result = run_job(environments_auto_stop, stack, database_url=scratch_database)

    assert result.success
    assert row_text(scratch, refused) == before
    for env_id in others:
        assert_stopped(scratch, env_id)
    meta = report(result)
    assert (meta["stopped_count"], meta["rows_with_errors"], meta["failed_ids"]) == (3, 1, [refused])
    assert meta["errors"] == [f"environment {refused}: environment is broken"]
    scratch.dispose()


@pytest.mark.parametrize("breakage", [
    "DROP INDEX index_ci_pending_builds_on_build_id",
    # what a failed CREATE UNIQUE INDEX CONCURRENTLY leaves: the index is there, PostgreSQL does not use it
    "UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'index_ci_pending_builds_on_build_id'::regclass",
], ids=["dropped", "invalid"])
def test_without_gitlabs_unique_index_on_pending_builds_the_run_fails_naming_it_and_stops_the_others(
    stack, scratch_database, redis_client, breakage
):
    """Playing a stop action puts it in GitLab's queue, ``ON CONFLICT (build_id)``: only possible on GitLab's unique
    index. Its absence once failed every batch and tagged every environment as an error."""
    scratch = gitlab_database(scratch_database, breakage)
    plain = environment(scratch)
    app, stop = review_app(scratch)
    kept = environment(scratch, auto_stop_setting=1)
    app_before, kept_before = row(scratch, "environments", app), row(scratch, "environments", kept)
    stop_before = row(scratch, "ci_builds", stop)

    result = run_job(environments_auto_stop, stack, database_url=scratch_database, raise_on_error=False)

    assert not result.success
    message = step_failure_message(result)
    assert "ci_pending_builds" in message and "index_ci_pending_builds_on_build_id" in message
    assert "environments with stop actions left available, their stop actions not played: 1" in message
    found = op_metadata(result, CONFIG)  # known at start, before anything is written
    assert found["missing_index"] == "index_ci_pending_builds_on_build_id (UNIQUE, ci_pending_builds.build_id)"
    assert_stopped(scratch, plain)
    assert (row(scratch, "environments", app), row(scratch, "environments", kept)) == (app_before, kept_before)
    assert row(scratch, "ci_builds", stop) == stop_before  # not played
    assert ids(scratch, "ci_pending_builds") == []
    meta = failure_metadata(result)
    assert (meta["stopped_ids"], meta["not_played_ids"], meta["failed_ids"], meta["rows_with_errors"]) == (
        [plain], [app], [], 0)
    assert (meta["rows_changed"], meta["left_untouched_count"]) == (1, 1)
    assert redis_client.exists(LEASE) == 0
    scratch.dispose()
