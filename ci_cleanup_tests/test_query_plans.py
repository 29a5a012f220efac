"""Every candidate query and batch statement of every job reads the large tables through GitLab's own indexes.

The statements are the services' own (their query builders, compiled here), explained on GitLab's
real DDL (partitions 100, 101, 102; no index GitLab lacks) with a moderate GitLab.com-like dataset
(200 k builds and artifacts, 20 k of the other tables) after ANALYZE, so the planner sees realistic
statistics. A Seq Scan on one of these tables or their partitions means a batch's cost grows with
the table, not with the work.
"""

from __future__ import annotations

import re

import pytest
from sqlalchemy import select

from ci_cleanup.drop_canceling_builds import service as drop_canceling
from ci_cleanup.environments_auto_stop import service as auto_stop
from ci_cleanup.gitlab.schema import gitlab_schema, utc_now
from ci_cleanup.schedule_bulk_delete_job_artifacts import service as bulk_delete
from ci_cleanup.stale_runner_machines_cleanup import service as stale_machines
from ci_cleanup.stuck_export_jobs import service as stuck_exports
from ci_cleanup_dev.bench.seed import seed_scale

from .harness import reset

S = gitlab_schema()
# The large tables and their partitions (ci_builds_101, instance_type_ci_runner_machines, …).
LARGE = re.compile(
    r"(\w+_type_)?(ci_builds|ci_runner_machines|project_export_jobs|environments|ci_job_artifacts|deployments)(_\d+)?"
)
NOW = utc_now()
CUTOFF = NOW - drop_canceling.TIMEOUT
DEADLINE = stale_machines.stale_deadline(NOW)

# Its module fixture is the costly part: on one xdist worker (``--dist loadgroup``), it is set up once.
pytestmark = pytest.mark.xdist_group("query_plans")


@pytest.fixture(scope="module")
def seeded(_engine):
    reset(_engine)
    seed_scale(_engine, 0.02, log=lambda line: None)
    yield _engine
    reset(_engine)


def first_ids(engine, query, n=100):
    with engine.connect() as conn:
        return conn.execute(query.limit(n)).all()


def statements(engine):
    """(name, statement) for every job, built by the services' own functions."""
    with engine.connect() as conn:
        builds = drop_canceling.find_batch(conn, S, CUTOFF, 100)
        exports = stuck_exports.enqueued_exports(conn, S, 0, stuck_exports.CHUNK_SIZE)
    envs = first_environments(engine)
    cutoff, naive_now = CUTOFF.replace(tzinfo=None), NOW.replace(tzinfo=None)
    def drop_sql(sql_file, **params):
        return sql_file.on(S, engine.dialect).bindparams(cutoff=cutoff, **params)

    yield "drop_canceling_builds count", drop_sql(drop_canceling.COUNT)
    yield "drop_canceling_builds batch excluding left builds", drop_sql(
        drop_canceling.CANDIDATES, batch_size=100, passed_over=builds[:3])
    yield "drop_canceling_builds drop", drop_sql(
        drop_canceling.NEXT_BATCH, now=naive_now, batch_size=100, passed_over=builds[:3], failure_reason=3)
    yield "drop_canceling_builds drop these builds", drop_sql(
        drop_canceling.THESE_BUILDS, now=naive_now, ids=builds[3:], failure_reason=3)
    yield "stale_runner_machines_cleanup count", stale_machines.COUNT.on(S, engine.dialect).bindparams(
        deadline=DEADLINE, limit=None)
    yield "stale_runner_machines_cleanup delete", stale_machines.SUB_BATCH.on(S, engine.dialect).bindparams(
        deadline=DEADLINE, limit=100)
    yield from exports_statements(engine.dialect, exports)
    yield from environments_statements(engine.dialect, envs)
    yield "schedule_bulk_delete_job_artifacts dry run count", bulk_delete.WOULD_DELETE.on(S, engine.dialect).bindparams(
        now=NOW, max_buckets=bulk_delete.MAX_BUCKETS, bucket=1, ids_limit=100)
    yield "schedule_bulk_delete_job_artifacts batch", artifact_batch(engine)


def exports_statements(dialect, exports):
    """stuck_export_jobs' SQL files, the page's cursor halfway through the first chunk."""
    yield "stuck_export_jobs count", stuck_exports.COUNT_ENQUEUED.on(S, dialect)
    page = {"after_id": exports[len(exports) // 2].id, "limit": stuck_exports.CHUNK_SIZE}
    yield "stuck_export_jobs chunk", stuck_exports.ENQUEUED_PAGE.on(S, dialect).bindparams(**page)
    yield "stuck_export_jobs walked chunk", stuck_exports.ENQUEUED_PAGE_WALKED.on(S, dialect).bindparams(**page)
    completed = stuck_exports.completed_params(exports, NOW - stuck_exports.EXPORT_JOBS_EXPIRATION)
    yield "stuck_export_jobs re-read", stuck_exports.REREAD_COMPLETED.on(S, dialect).bindparams(**completed)
    yield "stuck_export_jobs fail", stuck_exports.FAIL_STUCK.on(S, dialect).bindparams(**completed, now=NOW)


def environment_params(after) -> dict:
    return {"now": NOW, "naive_now": NOW.replace(tzinfo=None), "after_at": after[0], "after_id": after[1],
            "limit": auto_stop.BATCH_SIZE}


def first_environments(engine):
    with engine.connect() as conn:
        return conn.execute(auto_stop.FIND_BATCH.on(S, conn.dialect), environment_params(auto_stop.START)).all()


def environments_statements(dialect, envs):
    """environments_auto_stop's SQL files, the batch's cursor halfway through the first 100 due environments."""
    middle = envs[len(envs) // 2]
    batch = environment_params((middle.cursor_at, middle.id))
    yield "environments_auto_stop count", auto_stop.COUNT_AUTO_STOPPABLE.on(S, dialect).bindparams(now=NOW)
    yield "environments_auto_stop batch on one database", auto_stop.STOP_BATCH.on(S, dialect).bindparams(**batch)
    del batch["naive_now"]  # the pick writes nothing
    yield "environments_auto_stop pick", auto_stop.PICK_BATCH.on(S, dialect).bindparams(**batch)
    yield "environments_auto_stop dry run's batch", auto_stop.FIND_BATCH.on(S, dialect).bindparams(**batch)
    deployed = {"environment_ids": [env.id for env in envs], "commit_ids": [env.id for env in envs],
                "on_stops": ["stop_review"] * len(envs)}
    queue = {"namespace_ids": [env.project_id for env in envs], "instance_runners_enabled": [True] * len(envs),
             "namespace_traversal_ids": [f"{{{env.project_id}}}" for env in envs]}
    group = {"environment_ids": deployed["environment_ids"], "deployable_ids": [env.id for env in envs]}
    yield "environments_auto_stop deployment group's jobs", auto_stop.FIND_GROUP_JOBS.on(S, dialect).bindparams(**group)
    yield "environments_auto_stop deployment group", auto_stop.FIND_GROUP.on(S, dialect).bindparams(
        environment_ids=group["environment_ids"], job_ids=group["deployable_ids"], commit_ids=deployed["commit_ids"])
    yield "environments_auto_stop stop actions", auto_stop.PLAY_STOP_ACTIONS.on(S, dialect).bindparams(
        **deployed, **queue, naive_now=NOW.replace(tzinfo=None))
    yield "environments_auto_stop dry run's stop actions", auto_stop.FIND_STOP_ACTIONS.on(S, dialect).bindparams(
        **deployed)
    yield "environments_auto_stop states", auto_stop.WRITE_STATES.on(S, dialect).bindparams(
        now=NOW, naive_now=NOW.replace(tzinfo=None), stopping_ids=[env.id for env in envs[:50]],
        stopped_ids=[env.id for env in envs[50:]])


def artifact_batch(engine):
    """A bucket worker's batch statement, its cursor at an expired artifact halfway through the backlog."""
    a = S.ci_job_artifacts
    query = select(a.c.expire_at, a.c.id).where(a.c.expire_at < NOW, a.c.locked == 0).order_by(a.c.expire_at, a.c.id)
    expired = first_ids(engine, query, 1000)
    cursor = expired[len(expired) // 2]
    return bulk_delete.BATCH.on(S, engine.dialect).bindparams(
        bucket=1, now=NOW, limit=bulk_delete.BATCH_SIZE, after=str(cursor.expire_at),
        **bulk_delete.pick_up_at_bounds(NOW), **bulk_delete.FlagRule().params(),
    )


def explain(conn, statement) -> dict:
    expanded = statement.compile(dialect=conn.dialect).construct_expanded_state()  # IN lists rendered, .params() kept
    [plan] = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {expanded.statement}", expanded.parameters).scalar()
    return plan["Plan"]


def nodes(plan: dict):
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def test_no_candidate_query_or_batch_statement_scans_a_large_table(seeded):
    checked, failures = 0, []
    with seeded.connect() as conn:
        for name, statement in statements(seeded):
            checked += 1
            plan = nodes(explain(conn, statement))
            if scans := [n["Relation Name"] for n in plan
                         if n["Node Type"] == "Seq Scan" and LARGE.fullmatch(n["Relation Name"])]:
                failures.append(f"{name}: Seq Scan on {', '.join(scans)}")
    assert checked == 22
    assert failures == []


def test_artifact_worker_batch_starts_its_index_scan_at_its_cursor(seeded):
    """Not at the oldest expired artifact: past the other buckets' rows and the dead rows earlier batches left, read
    again each batch."""
    with seeded.connect() as conn:
        plan = explain(conn, artifact_batch(seeded))
    scans = [n for n in nodes(plan) if "expire_at" in n.get("Index Name", "")]
    # GitLab's partial expire_at index of each partition (100 and 101 in ci_job_artifacts, 102 in its own),
    # read in order (a Merge Append, no Sort of the backlog) from the cursor on.
    assert {(n["Node Type"], n["Relation Name"], n["Index Name"]) for n in scans} == {
        ("Index Scan", "ci_job_artifacts", "index_ci_job_artifacts_expire_at_unlocked_non_trace"),
        ("Index Scan", "ci_job_artifacts_102", "ci_job_artifacts_102_expire_at_idx"),
    }
    assert all("(expire_at >= " in n["Index Cond"] for n in scans)
    [merge] = [n for n in nodes(plan) if n["Node Type"] == "Merge Append"]
    assert {n.get("Index Name") for n in nodes(merge)} >= {n["Index Name"] for n in scans}
