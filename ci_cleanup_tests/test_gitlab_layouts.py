"""Every job on GitLab's real DDL, in both layouts it ships: partitioned (today) and flat (before partitioning).

Each database is made by ``create_schema`` from the vendored ``structure.sql``; the jobs find the layout
themselves (no setting), say in their metadata which tables they used, and reach every partition.
"""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, select

from ci_cleanup.drop_canceling_builds.job import drop_canceling_builds
from ci_cleanup.environments_auto_stop.job import environments_auto_stop
from ci_cleanup.gitlab.schema import FLAT, PARTITIONED, detect_tables
from ci_cleanup.schedule_bulk_delete_job_artifacts.job import schedule_bulk_delete_job_artifacts
from ci_cleanup.stale_runner_machines_cleanup.job import stale_runner_machines_cleanup
from ci_cleanup.stuck_export_jobs.job import stuck_export_jobs
from ci_cleanup_dev.ddl import create_schema
from ci_cleanup_dev.project_rows import add_projects

from .factories import ago, create, naive_ago
from .harness import scratch_database_of
from .runner import op_metadata, run_job

BUILDS = {PARTITIONED: "p_ci_builds", FLAT: "ci_builds"}
ARTIFACTS = {PARTITIONED: "p_ci_job_artifacts", FLAT: "ci_job_artifacts"}
# The partition a row goes to: the newest one GitLab.com has (a dynamic partition); the flat table has none.
NEWEST = {PARTITIONED: 102, FLAT: 100}


@pytest.fixture(scope="module", params=[PARTITIONED, FLAT])
def layout(request, stack):
    with scratch_database_of(stack) as url:
        engine = create_engine(url)
        create_schema(engine, request.param)
        with engine.connect() as conn:
            schema = detect_tables(conn)
        yield request.param, url, engine, schema
        engine.dispose()


def test_the_layout_is_detected_from_the_database(layout):
    name, _, _, schema = layout
    assert (schema.ci_builds.name, schema.ci_job_artifacts.name) == (BUILDS[name], ARTIFACTS[name])


def test_drop_canceling_builds_drops_a_build_in_the_newest_partition(stack, layout, redis_client):
    name, url, engine, schema = layout
    build = create(engine, "ci_builds", schema=schema, partition_id=NEWEST[name],
                   created_at=naive_ago(hours=2), updated_at=naive_ago(hours=2))
    create(engine, "ci_pending_builds", schema=schema, build_id=build)

    result = run_job(drop_canceling_builds, stack, database_url=url)

    b = schema.ci_builds
    with engine.connect() as conn:
        assert conn.execute(select(b.c.status, b.c.failure_reason, b.c.partition_id).where(b.c.id == build)).one() == (
            "failed", 3, NEWEST[name])
        assert conn.execute(select(schema.ci_pending_builds.c.id)).all() == []
    assert op_metadata(result, "find_canceling_builds")["gitlab_tables"] == [
        BUILDS[name], "ci_pending_builds", "ci_running_builds"]


def test_stale_runner_machines_cleanup_deletes_in_every_runner_type_partition(stack, layout, redis_client):
    _, url, engine, schema = layout
    stale = [create(engine, "ci_runner_machines", schema=schema, runner_type=t, sharding_key_id=None if t == 1 else 5,
                    created_at=ago(days=8)) for t in (1, 2, 3)]
    live = create(engine, "ci_runner_machines", schema=schema, created_at=ago(days=8), contacted_at=ago(hours=1))

    result = run_job(stale_runner_machines_cleanup, stack, database_url=url)

    m = schema.ci_runner_machines
    with engine.connect() as conn:
        assert conn.execute(select(m.c.id)).scalars().all() == [live]
        # GitLab's sync trigger removed the archived copies of the deleted machines too.
        assert conn.exec_driver_sql("SELECT id FROM ci_runner_machines_archived").scalars().all() == [live]
    assert op_metadata(result, "report_deleted_runner_machines")["total_deleted"] == len(stale)


def test_stuck_export_jobs_fails_an_export_whose_sidekiq_job_is_gone(stack, layout, redis_client):
    _, url, engine, schema = layout
    job = create(engine, "project_export_jobs", schema=schema, status=1, jid="jid-gone", created_at=ago(hours=7))

    run_job(stuck_export_jobs, stack, database_url=url)

    j = schema.project_export_jobs
    with engine.connect() as conn:
        assert conn.execute(select(j.c.status).where(j.c.id == job)).scalar_one() == 3


def test_environments_auto_stop_queues_the_stop_action_with_its_own_partition(stack, layout, redis_client):
    name, url, engine, schema = layout
    with engine.begin() as conn:
        add_projects(conn, [7], schema)
    env = create(engine, "environments", schema=schema, auto_stop_at=ago(hours=1), project_id=7)
    pipeline = dict(schema=schema, partition_id=NEWEST[name], commit_id=4242, project_id=7)
    deploy = create(engine, "ci_builds", status="success", name="deploy_review", **pipeline)
    stop = create(engine, "ci_builds", status="manual", name="stop_review", **pipeline)
    create(engine, "deployments", schema=schema, environment_id=env, deployable_id=deploy, on_stop="stop_review")

    run_job(environments_auto_stop, stack, database_url=url)

    e, b, pending = schema.environments, schema.ci_builds, schema.ci_pending_builds
    with engine.connect() as conn:
        assert conn.execute(select(e.c.state).where(e.c.id == env)).scalar_one() == "stopping"
        assert conn.execute(select(b.c.status).where(b.c.id == stop)).scalar_one() == "pending"
        assert conn.execute(select(pending.c.build_id, pending.c.project_id, pending.c.partition_id,
                                   pending.c.instance_runners_enabled, pending.c.namespace_traversal_ids)).all() == [
            (stop, 7, NEWEST[name], True, [7])]


def test_schedule_bulk_delete_job_artifacts_deletes_in_every_partition(stack, layout, redis_client):
    name, url, engine, schema = layout
    create(engine, "feature_gates", schema=schema, feature_key="bulk_delete_job_artifacts")
    partitions = (100, 101, 102) if name == PARTITIONED else (100,)
    expired = [create(engine, "ci_job_artifacts", schema=schema, partition_id=p, job_id=9, file_type=2,
                      file_final_path=f"final/{p}/a.zip", expire_at=ago(hours=2)) for p in partitions]
    kept = create(engine, "ci_job_artifacts", schema=schema, job_id=9, file_type=4, expire_at=ago(days=-1))

    result = run_job(schedule_bulk_delete_job_artifacts, stack, database_url=url)

    a, d = schema.ci_job_artifacts, schema.ci_deleted_objects
    with engine.connect() as conn:
        assert conn.execute(select(a.c.id)).scalars().all() == [kept]
        assert sorted(conn.execute(select(d.c.store_dir)).scalars()) == [f"final/{p}" for p in partitions]
    assert op_metadata(result, "schedule_buckets")["gitlab_tables"] == [
        ARTIFACTS[name], "ci_deleted_objects", "features", "feature_gates"]
    assert len(expired) == len(partitions)
