"""A small, realistic GitLab dataset for the dev stack: some rows each batch must change, more it must not.

One function per batch; :func:`seed` runs them all. Rows are inserted relative to ``now`` so a
demo run always finds the same work, on GitLab's own schema: builds and artifacts spread over
partitions 100, 101 and 102, and names, iids, job ids, machine and Sidekiq ids unique as GitLab's
indexes require, so a second demo on the data of the first adds rows beside them.
"""

from __future__ import annotations

import datetime as dt
import random
import uuid

import redis
from sqlalchemy import func, insert, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Connection, Engine

from .gitlab.schema import EXPORT_FAILED, EXPORT_FINISHED, EXPORT_QUEUED, EXPORT_STARTED, GitLabSchema, detect_tables, naive_utc, utc_now
from .gitlab.sidekiq_status import status_key


def seed_builds(conn: Connection, queues: redis.Redis, schema: GitLabSchema, rng: random.Random, now: dt.datetime) -> None:
    """drop_canceling_builds: 120 builds stuck canceling (two batches), and builds it must leave alone."""
    rows = []
    for i in range(120):
        stuck_since = now - dt.timedelta(hours=rng.randint(2, 48), minutes=rng.randint(0, 59))
        rows.append(dict(status="canceling", created_at=naive_utc(stuck_since), updated_at=naive_utc(stuck_since)))
    for status in ("running", "pending", "success", "failed", "canceled", "canceling"):
        for _ in range(10):  # recent ones, and old ones in other statuses
            at = now - dt.timedelta(minutes=rng.randint(1, 50) if status == "canceling" else rng.randint(61, 600))
            rows.append(dict(status=status, created_at=naive_utc(at), updated_at=naive_utc(at)))
    for i, values in enumerate(rows):
        values.update(
            partition_id=100 + i // 5 % 3, project_id=rng.randint(1, 20), commit_id=1000 + i // 5, name=rng.choice(["rspec", "lint", "build"]),
            type="Ci::Build", runner_id=rng.randint(1, 5), lock_version=0,
        )
    conn.execute(insert(schema.ci_builds), rows)


def seed_runner_machines(conn: Connection, queues: redis.Redis, schema: GitLabSchema, rng: random.Random, now: dt.datetime) -> None:
    """stale_runner_machines_cleanup: 130 machines silent for over 7 days (two sub-batches), and live or new ones."""
    rows = []
    for i in range(130):
        created = now - dt.timedelta(days=rng.randint(8, 400))
        contacted = None if i % 4 == 0 else created + (now - created - dt.timedelta(days=7)) * rng.random()
        rows.append(dict(created_at=created, contacted_at=contacted))
    for i in range(40):  # old but contacted within the week, or registered within the week and never contacted
        if i % 2:
            created, contacted = now - dt.timedelta(days=rng.randint(8, 400)), now - dt.timedelta(hours=rng.randint(0, 160))
        else:
            created, contacted = now - dt.timedelta(days=rng.randint(0, 6), hours=rng.randint(0, 23)), None
        rows.append(dict(created_at=created, contacted_at=contacted))
    for values in rows:
        values.update(
            runner_id=rng.randint(1, 12), system_xid=f"r_{uuid.uuid4().hex[:12]}", runner_type=rng.choice([1, 2, 3]),
            updated_at=values["contacted_at"] or values["created_at"],
        )
        # GitLab: instance runners (type 1) have no sharding key, group and project runners one.
        values["sharding_key_id"] = None if values["runner_type"] == 1 else values["runner_id"]
    conn.execute(insert(schema.ci_runner_machines), rows)


def seed_environments(conn: Connection, queues: redis.Redis, schema: GitLabSchema, rng: random.Random, now: dt.datetime) -> None:
    """environments_auto_stop: expired review apps (plain ones to stop, ones with a manual stop job, with_action
    ones to leave; two batches), and environments it must not touch (not due yet, no auto-stop, already stopped)."""
    kinds = ["plain"] * 110 + ["stop_action"] * 15 + ["with_action"] * 10 + ["future"] * 20 + ["production"] * 5 + ["stopped"] * 10
    rows, base = [], conn.scalar(select(func.coalesce(func.max(schema.environments.c.id), 0)))
    for i, kind in enumerate(kinds, start=base + 1):
        expired = now - dt.timedelta(hours=rng.randint(1, 72))
        auto_stop_at = {"future": now + dt.timedelta(hours=rng.randint(1, 72)), "production": None}.get(kind, expired)
        created = naive_utc(now - dt.timedelta(days=rng.randint(2, 30)))
        name = "production" if kind == "production" else f"review/feature-{i}"
        rows.append(dict(
            project_id=100 + i if kind == "production" else rng.randint(1, 20), name=name, slug=name.replace("/", "-"),
            state="stopped" if kind == "stopped" else "available", auto_stop_at=auto_stop_at,
            auto_stop_setting=1 if kind == "with_action" else 0, created_at=created, updated_at=created,
        ))
    env_ids = conn.execute(insert(schema.environments).returning(schema.environments.c.id, sort_by_parameter_order=True), rows).scalars().all()
    for n, (env_id, kind, env) in enumerate(zip(env_ids, kinds, rows)):
        if kind not in ("stop_action", "with_action"):
            continue
        # Each review app deployed by its own pipeline; a with_action app's pipeline has no stop job: left available.
        pipeline = 90_000 + env_id
        deployed = naive_utc(now - dt.timedelta(days=2))
        build = dict(partition_id=100 + n % 3, project_id=env["project_id"], commit_id=pipeline, type="Ci::Build",
                     lock_version=0, created_at=deployed, updated_at=deployed)
        deploy_id = conn.execute(
            insert(schema.ci_builds).values(name="deploy_review", status="success", **build).returning(schema.ci_builds.c.id)
        ).scalar_one()
        if kind == "stop_action":
            conn.execute(insert(schema.ci_builds).values(name="stop_review", status="manual", **build))
        conn.execute(insert(schema.deployments).values(
            iid=env_id, project_id=env["project_id"], environment_id=env_id, ref=f"feature-{n}", tag=False,
            sha=f"{rng.getrandbits(160):040x}", status=2, deployable_type="CommitStatus", deployable_id=deploy_id,
            on_stop="stop_review" if kind == "stop_action" else None, created_at=deployed, updated_at=deployed,
            finished_at=now,
        ))


def seed_export_jobs(conn: Connection, queues: redis.Redis, schema: GitLabSchema, rng: random.Random, now: dt.datetime) -> None:
    """stuck_export_jobs: exports whose Sidekiq job is gone (to fail), ones Sidekiq still has (status key set),
    parallel exports inside and past their 6 h grace, and finished or failed ones it must not touch."""
    kinds = ["stuck"] * 25 + ["in_sidekiq"] * 15 + ["parallel_young"] * 5 + ["parallel_old"] * 5 + ["finished"] * 20 + ["failed"] * 5
    rows = []
    for kind in kinds:
        age = dt.timedelta(hours=rng.randint(1, 5)) if kind == "parallel_young" else dt.timedelta(hours=rng.randint(7, 72))
        status = {"finished": EXPORT_FINISHED, "failed": EXPORT_FAILED}.get(kind, rng.choice([EXPORT_QUEUED, EXPORT_STARTED]))
        rows.append(dict(
            project_id=rng.randint(1, 20), status=status, jid=uuid.uuid4().hex[:24], user_id=rng.randint(1, 5),
            created_at=now - age, updated_at=now - age,
        ))
    t = schema.project_export_jobs
    job_ids = conn.execute(insert(t).returning(t.c.id, sort_by_parameter_order=True), rows).scalars().all()
    for job_id, kind, job in zip(job_ids, kinds, rows):
        if kind == "in_sidekiq":  # GitLab's SidekiqStatus keeps the key 30 minutes while the job is queued or running
            queues.set(status_key(job["jid"]), 1, ex=30 * 60)
        if kind.startswith("parallel"):
            conn.execute(insert(schema.project_relation_exports), [
                dict(project_export_job_id=job_id, project_id=job["project_id"], relation=relation, status=1,
                     created_at=job["created_at"], updated_at=job["created_at"])
                for relation in ("issues", "merge_requests", "ci_pipelines")
            ])


def seed_job_artifacts(conn: Connection, queues: redis.Redis, schema: GitLabSchema, rng: random.Random, now: dt.datetime) -> None:
    """schedule_bulk_delete_job_artifacts: the feature flag on, 300 expired unlocked artifacts over 40 projects
    (to delete), and traces, locked, unknown-lock, never-expiring and not-yet-expired ones it must keep.
    delete_expired_artifact_files: stored files of earlier deletions, due and not yet due, local and remote."""
    # The flag may be on already (a second demo on the same data): seeding adds rows, never fails.
    stamp = dict(created_at=naive_utc(now), updated_at=naive_utc(now))
    conn.execute(pg_insert(schema.features).on_conflict_do_nothing(), [dict(key="bulk_delete_job_artifacts", **stamp)])
    conn.execute(
        pg_insert(schema.feature_gates).on_conflict_do_nothing(),
        [dict(feature_key="bulk_delete_job_artifacts", key="boolean", value="true", **stamp)],
    )
    first_job = 1 + conn.scalar(select(func.coalesce(func.max(schema.ci_job_artifacts.c.job_id), 5000)))
    kinds = ["expired"] * 300 + ["trace", "locked", "unknown", "never_expires", "not_yet_expired"] * 12
    rows = []
    for i, kind in enumerate(kinds):
        created = now - dt.timedelta(days=rng.randint(8, 90))
        expire_at = {"never_expires": None, "not_yet_expired": now + dt.timedelta(days=rng.randint(1, 30))}.get(
            kind, now - dt.timedelta(hours=rng.randint(1, 72))
        )
        rows.append(dict(
            partition_id=100 + i % 3, project_id=rng.randint(1, 40), job_id=first_job + i, file_type=3 if kind == "trace" else rng.choice([1, 2, 4]),
            size=rng.randint(1_000, 5_000_000), file="artifacts.zip", file_store=rng.choice([1, 2]),
            locked={"locked": 1, "unknown": 2}.get(kind, 0), expire_at=expire_at, created_at=created, updated_at=created,
        ))
    conn.execute(insert(schema.ci_job_artifacts), rows)
    conn.execute(insert(schema.ci_deleted_objects), [
        dict(file_store=store, store_dir=f"{i:02x}/{i + 16:02x}/demo/{i}", file="artifacts.zip", project_id=rng.randint(1, 40),
             pick_up_at=now + dt.timedelta(hours=-rng.randint(1, 24) if due else rng.randint(1, 24)))
        for i, (store, due) in enumerate([(1, True), (2, True), (1, False)] * 10)
    ])


SEEDERS = [seed_builds, seed_runner_machines, seed_environments, seed_export_jobs, seed_job_artifacts]


def seed(engine: Engine, redis_client: redis.Redis, *, random_seed: int = 0) -> None:
    rng, now = random.Random(random_seed), utc_now()
    with engine.begin() as conn:
        schema = detect_tables(conn)  # partitioned or flat, as the database has them
        for seeder in SEEDERS:
            seeder(conn, redis_client, schema, rng, now)
