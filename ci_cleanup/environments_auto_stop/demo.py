"""The demo dataset's rows for environments_auto_stop (``ci-cleanup demo``): some it must change, more it must not."""

from __future__ import annotations

import datetime as dt
import random

import redis
from sqlalchemy import func, insert, select
from sqlalchemy.engine import Connection

from ..gitlab.schema import GitLabSchema, naive_utc


def seed(
    conn: Connection, queues: redis.Redis, schema: GitLabSchema, rng: random.Random, now: dt.datetime
) -> None:
    """environments_auto_stop: expired review apps (plain ones to stop, ones with a manual stop job, with_action
    ones to leave; two batches), and environments it must not touch (not due yet, no auto-stop, already stopped)."""
    kinds = (
        ["plain"] * 110 + ["stop_action"] * 15 + ["with_action"] * 10 + ["future"] * 20 + ["production"] * 5
        + ["stopped"] * 10
    )
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
    returning_ids = insert(schema.environments).returning(schema.environments.c.id, sort_by_parameter_order=True)
    env_ids = conn.execute(returning_ids, rows).scalars().all()
    for n, (env_id, kind, env) in enumerate(zip(env_ids, kinds, rows)):
        if kind not in ("stop_action", "with_action"):
            continue
        # Each review app deployed by its own pipeline; a with_action app's pipeline has no stop job: left available.
        pipeline = 90_000 + env_id
        deployed = naive_utc(now - dt.timedelta(days=2))
        build = dict(partition_id=100 + n % 3, project_id=env["project_id"], commit_id=pipeline, type="Ci::Build",
                     lock_version=0, created_at=deployed, updated_at=deployed)
        deploy_id = conn.execute(
            insert(schema.ci_builds).values(name="deploy_review", status="success", **build)
            .returning(schema.ci_builds.c.id)
        ).scalar_one()
        if kind == "stop_action":
            conn.execute(insert(schema.ci_builds).values(name="stop_review", status="manual", **build))
        conn.execute(insert(schema.deployments).values(
            iid=env_id, project_id=env["project_id"], environment_id=env_id, ref=f"feature-{n}", tag=False,
            sha=f"{rng.getrandbits(160):040x}", status=2, deployable_type="CommitStatus", deployable_id=deploy_id,
            on_stop="stop_review" if kind == "stop_action" else None, created_at=deployed, updated_at=deployed,
            finished_at=now,
        ))
