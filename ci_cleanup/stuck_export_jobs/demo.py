"""The demo dataset's rows for stuck_export_jobs (``ci-cleanup demo``): some it must change, more it must not."""

from __future__ import annotations

import datetime as dt
import random
import uuid

import redis
from sqlalchemy import insert
from sqlalchemy.engine import Connection

from ..gitlab.schema import EXPORT_FAILED, EXPORT_FINISHED, EXPORT_QUEUED, EXPORT_STARTED, GitLabSchema
from ..gitlab.sidekiq_status import status_key


def seed(
    conn: Connection, queues: redis.Redis, schema: GitLabSchema, rng: random.Random, now: dt.datetime
) -> None:
    """stuck_export_jobs: exports whose Sidekiq job is gone (to fail), ones Sidekiq still has (status key set),
    parallel exports inside and past their 6 h grace, and finished or failed ones it must not touch."""
    kinds = (
        ["stuck"] * 25 + ["in_sidekiq"] * 15 + ["parallel_young"] * 5 + ["parallel_old"] * 5 + ["finished"] * 20
        + ["failed"] * 5
    )
    rows = []
    for kind in kinds:
        young = kind == "parallel_young"
        age = dt.timedelta(hours=rng.randint(1, 5)) if young else dt.timedelta(hours=rng.randint(7, 72))
        enqueued = rng.choice([EXPORT_QUEUED, EXPORT_STARTED])
        status = {"finished": EXPORT_FINISHED, "failed": EXPORT_FAILED}.get(kind, enqueued)
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
