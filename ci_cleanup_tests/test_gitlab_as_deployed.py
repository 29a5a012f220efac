"""GitLab as deployed: decomposed ``main`` + ``ci`` databases (GitLab's lock-writes triggers on each other's
tables) reached through Debian's PgBouncer in transaction pooling. The job suites run here too (``layouts``);
this module holds what only this layout has: the wrong copy of a table, and PgBouncer's shared sessions."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal

import pytest
from sqlalchemy import create_engine, text

from ci_cleanup.batches import BY_NAME
from ci_cleanup.environments_auto_stop import job as auto_stop_job
from ci_cleanup.environments_auto_stop import service as auto_stop
from ci_cleanup.gitlab.schema import database_of, gitlab_schema

from .factories import ago, create, naive_ago, row
from .harness import Databases, reset
from .runner import failure_messages, op_metadata, run_job

S = gitlab_schema()
NEEDS_CI = ("drop_canceling_builds", "stale_runner_machines_cleanup", "environments_auto_stop",
            "schedule_bulk_delete_job_artifacts", "delete_expired_artifact_files")
GITLAB_JOBS = (*NEEDS_CI, "stuck_export_jobs")


@pytest.fixture
def dbs(deployed, redis_client):
    """The deployed stack's main and ci databases, direct, emptied before the test."""
    databases = Databases(create_engine(deployed.direct_url(deployed.MAIN)),
                          create_engine(deployed.direct_url(deployed.CI)))
    reset(databases)
    yield databases
    databases.dispose()


def seed_one_candidate_each(dbs) -> dict[str, tuple[str, int]]:
    """One row each job must change, in the database GitLab keeps it in: job -> (table, id)."""
    create(dbs, "features", key="bulk_delete_job_artifacts")
    create(dbs, "feature_gates", feature_key="bulk_delete_job_artifacts")
    return {
        "drop_canceling_builds": ("ci_builds", create(dbs, "ci_builds", created_at=naive_ago(hours=2),
                                                      updated_at=naive_ago(hours=2))),
        "stale_runner_machines_cleanup": ("ci_runner_machines", create(dbs, "ci_runner_machines",
                                                                       created_at=ago(days=8))),
        "environments_auto_stop": ("environments", create(dbs, "environments", auto_stop_at=ago(hours=1))),
        "schedule_bulk_delete_job_artifacts": ("ci_job_artifacts", create(dbs, "ci_job_artifacts",
                                                                          expire_at=ago(days=2))),
        "delete_expired_artifact_files": ("ci_deleted_objects", create(
            dbs, "ci_deleted_objects", store_dir="aa/bb", file="a.zip", project_id=1, pick_up_at=ago(hours=1))),
        "stuck_export_jobs": ("project_export_jobs", create(dbs, "project_export_jobs", status=1)),
    }


def test_with_only_the_main_url_every_job_needing_ci_fails_naming_the_ci_variable_and_changes_nothing(
    deployed, dbs, redis_client
):
    seeded = seed_one_candidate_each(dbs)
    before = {name: row(dbs, table, id) for name, (table, id) in seeded.items()}

    for name in NEEDS_CI:
        result = run_job(BY_NAME[name].job, deployed, database_url=deployed.url(), raise_on_error=False)
        assert not result.success, name
        message = failure_messages(result)
        assert "CI_CLEANUP_CI_DATABASE_URL" in message and "write-locked by GitLab" in message, (name, message)
        assert row(dbs, *seeded[name]) == before[name], name
    # Its tables are all main's: it needs no ci database and works.
    result = run_job(BY_NAME["stuck_export_jobs"].job, deployed, database_url=deployed.url())
    assert op_metadata(result, "report_stuck_export_jobs")["failed_jobs_count"] == 1
    assert redis_client.keys("gitlab:exclusive_lease:*") == []


def test_urls_swapped_or_both_on_main_fail_naming_which_variable_to_fix(deployed, dbs):
    seeded = seed_one_candidate_each(dbs)
    build = row(dbs, *seeded["drop_canceling_builds"])
    exports = row(dbs, *seeded["stuck_export_jobs"])
    job = BY_NAME["drop_canceling_builds"].job
    both_main = run_job(job, deployed, database_url=deployed.url(), raise_on_error=False)
    both_main_message = failure_messages(both_main)
    assert "set CI_CLEANUP_CI_DATABASE_URL" in both_main_message
    swapped = BY_NAME["stuck_export_jobs"].job.execute_in_process(
        resources={**_resources(deployed, main=deployed.ci_url(), ci=deployed.url())}, raise_on_error=False)
    assert "project_export_jobs" in failure_messages(swapped)
    assert "point CI_CLEANUP_DATABASE_URL at GitLab's main database" in failure_messages(swapped)
    assert (row(dbs, *seeded["drop_canceling_builds"]), row(dbs, *seeded["stuck_export_jobs"])) == (build, exports)


def _resources(deployed, *, main: str, ci: str | None, **fields):
    from ci_cleanup.resources import GitLabDatabase, GitLabRedis, RunOptions

    return {"gitlab_db": GitLabDatabase(url=main, ci_url=ci, **fields),
            "gitlab_redis": GitLabRedis(url=deployed.redis_url), "run_options": RunOptions()}


def test_each_table_is_used_in_the_database_of_its_gitlab_schema_and_the_run_says_which(deployed, dbs):
    seeded = seed_one_candidate_each(dbs)
    result = run_job(BY_NAME["environments_auto_stop"].job, deployed)
    used = op_metadata(result, "find_auto_stoppable_environments")["gitlab_databases"]
    assert used == {"environments": "main", "deployments": "main", "p_ci_builds": "ci", "ci_pending_builds": "ci",
                    "projects": "main", "namespaces": "main", "project_features": "main",
                    "project_ci_cd_settings": "main", "p_ci_build_tags": "ci"}
    assert row(dbs, *seeded["environments_auto_stop"]).state == "stopped"
    assert {t.name: database_of(t) for t in S.metadata.sorted_tables} == {
        "p_ci_builds": "ci", "ci_pending_builds": "ci", "ci_running_builds": "ci", "ci_runner_machines": "ci",
        "p_ci_job_artifacts": "ci", "ci_deleted_objects": "ci", "environments": "main", "deployments": "main",
        "project_export_jobs": "main", "project_relation_exports": "main", "features": "main", "feature_gates": "main",
        "projects": "main", "namespaces": "main", "project_features": "main", "project_ci_cd_settings": "main",
        "p_ci_build_tags": "ci", "taggings": "ci",
    }


def _session_settings(url: str) -> list[tuple[str, str]]:
    """Settings set in the session of the one server connection behind ``url`` (a pool of one)."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT name, setting FROM pg_settings WHERE source = 'session'")).all()
    finally:
        engine.dispose()


def test_no_setting_of_a_run_reaches_another_client_of_the_pool(deployed, dbs, redis_client):
    main_one, ci_one = deployed.bouncer.url("deployed_main_one"), deployed.bouncer.url("deployed_ci_one")
    # The check sees a leak: a session SET by one client is what the next client of a pool of one gets.
    leaky = create_engine(main_one)
    with leaky.connect() as conn:
        conn.execute(text("SET statement_timeout = 15000"))
        conn.commit()
    leaky.dispose()
    assert ("statement_timeout", "15000") in _session_settings(main_one)
    with create_engine(main_one).connect() as conn:
        conn.execute(text("RESET ALL"))
        conn.commit()
    assert _session_settings(main_one) == [] and _session_settings(ci_one) == []

    seed_one_candidate_each(dbs)
    for name in GITLAB_JOBS:
        result = BY_NAME[name].job.execute_in_process(resources=_resources(deployed, main=main_one, ci=ci_one))
        assert result.success, name
    assert _session_settings(main_one) == [] and _session_settings(ci_one) == []


# Every write of a job, per statement: the statement timeout it ran under.
_RECORD_TIMEOUT = """
CREATE TABLE IF NOT EXISTS timeout_seen (tbl text, op text, timeout text);
CREATE OR REPLACE FUNCTION record_timeout() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO timeout_seen VALUES (TG_TABLE_NAME, TG_OP, current_setting('statement_timeout')); RETURN NULL; END $$;
"""


def test_the_statement_timeout_holds_in_every_transaction_the_jobs_open(deployed, dbs, redis_client):
    seeded = seed_one_candidate_each(dbs)
    written = ["p_ci_builds", "ci_runner_machines", "environments", "p_ci_job_artifacts", "ci_deleted_objects",
               "project_export_jobs"]
    for table in written:
        engine = dbs.of(table)
        with engine.begin() as conn:
            conn.execute(text(_RECORD_TIMEOUT))
            conn.execute(text(f"CREATE TRIGGER record_timeout AFTER INSERT OR UPDATE OR DELETE ON {table} "
                              "FOR EACH STATEMENT EXECUTE FUNCTION record_timeout()"))
    try:
        for name in GITLAB_JOBS:
            resources = _resources(deployed, main=deployed.url(), ci=deployed.ci_url(), statement_timeout_seconds=7)
            assert BY_NAME[name].job.execute_in_process(resources=resources).success, name
        seen = []
        for engine in (dbs.main, dbs.ci):
            with engine.connect() as conn:
                seen += conn.execute(text("SELECT tbl, op, timeout FROM timeout_seen")).all()
    finally:
        for table in written:
            with dbs.of(table).begin() as conn:
                conn.execute(text(f"DROP TRIGGER record_timeout ON {table}"))
        for engine in (dbs.main, dbs.ci):
            with engine.begin() as conn:
                conn.execute(text("DROP TABLE IF EXISTS timeout_seen; DROP FUNCTION IF EXISTS record_timeout()"))
    # drop (update), stale (delete, autocommit), environments (update), artifacts (delete + insert, autocommit),
    # exports (update): every one under the run's 7 s, none without it.
    assert {(tbl, op) for tbl, op, _ in seen} >= {
        ("p_ci_builds", "UPDATE"), ("ci_runner_machines", "DELETE"), ("environments", "UPDATE"),
        ("p_ci_job_artifacts", "DELETE"), ("ci_deleted_objects", "INSERT"), ("project_export_jobs", "UPDATE")}
    assert {timeout for _, _, timeout in seen} == {"7s"}
    assert row(dbs, *seeded["stale_runner_machines_cleanup"]) is None


# What each job's statement meets, held by another session: stale's table locked (its DELETE), or drop's build's row
# (its batch statement); and how it is named.
_HELD = {
    "stale_runner_machines_cleanup": (
        lambda dbs: create(dbs, "ci_runner_machines", created_at=ago(days=8)), "ci_runner_machines",
        "LOCK TABLE ci_runner_machines IN ACCESS EXCLUSIVE MODE", "DELETE FROM ci_runner_machines WHERE id = ANY("),
    "drop_canceling_builds": (
        lambda dbs: create(dbs, "ci_builds", created_at=naive_ago(hours=2), updated_at=naive_ago(hours=2)),
        "ci_builds", "SELECT id FROM p_ci_builds FOR UPDATE",
        "WITH picked AS ( SELECT id, created_at, project_id FROM p_ci_builds"),
}


@pytest.mark.parametrize("name", sorted(_HELD))
def test_a_statement_over_the_timeout_is_cancelled_through_pgbouncer_and_the_run_fails_naming_it(
    deployed, dbs, redis_client, name
):
    make, table, hold, statement = _HELD[name]
    made = make(dbs)
    before = row(dbs, table, made)
    with dbs.ci.connect() as holder:
        holder.execute(text(hold))
        result = BY_NAME[name].job.execute_in_process(
            resources=_resources(deployed, main=deployed.url(), ci=deployed.ci_url(), statement_timeout_seconds=1),
            raise_on_error=False)
        holder.rollback()
    message = failure_messages(result)
    assert not result.success
    assert "ran over the statement timeout (1 s) in GitLab's ci database (PostgreSQL) at " in message, message
    assert f"was cancelled: {statement}" in message, message  # the statement's own text, the timeout's prefix off
    assert row(dbs, table, made) == before


# --------------------------------------------------------------------------- environments_auto_stop, killed between
# its two databases' commits: stop actions played and committed in ci, environments not yet written in main.

FORK = multiprocessing.get_context("fork")
TRIALS = 10  # 5 kills after the first batch's ci commit, 5 after the second's


def _killed_after_a_ci_commit(deployed, kill_at: int, parents) -> None:
    """A run of environments_auto_stop (batches of 4) that SIGKILLs itself right after its ``kill_at``-th ci commit."""
    for engine in parents:
        engine.dispose(close=False)
    commits = itertools.count(1)
    played_in_ci = auto_stop.stop_actions

    def then_die(*args, **kwargs):
        found = played_in_ci(*args, **kwargs)
        if next(commits) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return found

    auto_stop.stop_actions = then_die
    BY_NAME["environments_auto_stop"].job.execute_in_process(
        resources=_resources(deployed, main=deployed.url(), ci=deployed.ci_url()),
        run_config={"ops": {"find_auto_stoppable_environments": {"config": {"batch_size": 4}}}},
    )


def _review_app(dbs, *, setting: int = 0) -> tuple[int, int]:
    env_id = create(dbs, "environments", auto_stop_at=ago(hours=1), auto_stop_setting=setting)
    deploy = create(dbs, "ci_builds", commit_id=900 + env_id, name="deploy", status="success")
    stop = create(dbs, "ci_builds", commit_id=900 + env_id, name="stop_review", status="manual", queued_at=None)
    create(dbs, "deployments", environment_id=env_id, deployable_id=deploy, on_stop="stop_review", status=2)
    return env_id, stop


def _state(dbs) -> tuple[dict, dict, list]:
    """Environments' states, stop builds' (status, lock_version), and the runners' queue."""
    with dbs.main.connect() as conn:
        environments = dict(conn.execute(text("SELECT id, state FROM environments")).all())
    with dbs.ci.connect() as conn:
        builds = {i: (s, v) for i, s, v in conn.execute(
            text("SELECT id, status, lock_version FROM p_ci_builds WHERE name = 'stop_review'"))}
        queue = sorted(conn.scalars(text("SELECT build_id FROM ci_pending_builds")))
    return environments, builds, queue


def test_a_run_killed_between_its_ci_and_main_commits_loses_and_doubles_nothing_10_times(deployed, dbs, redis_client):
    for trial in range(TRIALS):
        reset(dbs, redis_client)
        apps = [_review_app(dbs) for _ in range(6)]  # stop actions: -> stopping, each action played once
        plain = [create(dbs, "environments", auto_stop_at=ago(hours=1)) for _ in range(3)]  # always -> stopped
        kept = [create(dbs, "environments", auto_stop_at=ago(hours=1), auto_stop_setting=1) for _ in range(2)]
        kill_at = 1 + trial % 2  # batches of 4: the review apps are in the first two, each batch killed in turn
        run = FORK.Process(target=_killed_after_a_ci_commit, args=(deployed, kill_at, [dbs.main, dbs.ci]))
        run.start()
        run.join(120)
        assert run.exitcode == -signal.SIGKILL, (trial, run.exitcode)

        environments, builds, queue = _state(dbs)
        played = sorted(i for i, (status, _) in builds.items() if status == "pending")
        # Killed after ci's commit, before main's: the batch's actions played once, its environments not written.
        assert all(builds[i] in {("manual", 0), ("pending", 1)} for i in builds), (trial, builds)
        assert queue == played and played, (trial, queue, played)
        assert {environments[i] for i, _ in apps} | {environments[i] for i in plain} <= {"available", "stopping",
                                                                                          "stopped"}
        redis_client.delete(f"gitlab:exclusive_lease:{auto_stop_job.LEASE_KEY}")  # the dead run's lease, expired

        result = run_job(BY_NAME["environments_auto_stop"].job, deployed)
        assert op_metadata(result, "report_stopped_environments")["rows_with_errors"] == 0
        environments, builds, queue = _state(dbs)
        assert [environments[i] for i, _ in apps] == ["stopping"] * 6, trial
        assert [environments[i] for i in plain] == ["stopped"] * 3, trial
        assert [environments[i] for i in kept] == ["available"] * 2, trial
        assert builds == {stop: ("pending", 1) for _, stop in apps}, trial  # each played exactly once
        assert queue == sorted(stop for _, stop in apps), trial  # each queued exactly once
