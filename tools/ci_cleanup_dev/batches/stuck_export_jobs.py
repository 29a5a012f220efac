"""stuck_export_jobs's workshop.

Its rows in the demo dataset (``ci-cleanup demo``), some it must change and more it must not; and its entries in
the benchmark (``ci-cleanup bench``): the job's service, a raw SQL loop and a per-row loop
(:mod:`~ci_cleanup_dev.bench.jobs`), its true floor (:mod:`~ci_cleanup_dev.bench.floor`), and the tables and cases
its launched runs meet (:mod:`~ci_cleanup_dev.bench.launched`)."""

from __future__ import annotations

import datetime as dt
import random
import uuid

import redis
from sqlalchemy import insert, text
from sqlalchemy.engine import Connection

from ci_cleanup.gitlab import sidekiq_status
from ci_cleanup.gitlab.loop_helpers import NO_HOOKS
from ci_cleanup.gitlab.schema import (
    EXPORT_FAILED,
    EXPORT_FINISHED,
    EXPORT_QUEUED,
    EXPORT_STARTED,
    GitLabSchema,
    utc_now,
)
from ci_cleanup.gitlab.sidekiq_status import status_key
from ci_cleanup.gitlab.sql_files import condition
from ci_cleanup.stuck_export_jobs import service as stuck_exports
from ci_cleanup.stuck_export_jobs.service import CHUNK_SIZE, EXPORT_JOBS_EXPIRATION

from ..bench.floor import on_a_connection
from ..bench.jobs import S, per_row, with_callback


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


# -- the benchmark (see bench/jobs.py, bench/floor.py) ---------------------------------------------------------

def exports_job(engine, client, on_batch, hooks=NO_HOOKS):
    with engine.connect() as conn:  # the job's first op
        enqueued = stuck_exports.count_enqueued(conn, S)
    return stuck_exports.mark_stuck_jobs_as_failed(
        engine, S, client,
        stuck_exports.Limits(utc_now() - stuck_exports.EXPORT_JOBS_EXPIRATION, first_id=enqueued.first_id,
                             walk=enqueued.dense),
        with_callback(hooks, on_batch),
    ).stuck


# The rule's condition, as the batch's statements have it (stuck_export_jobs/enqueued.sql).
ENQUEUED = condition("ci_cleanup.stuck_export_jobs", "enqueued")


def exports_raw(engine, client, on_batch):
    with engine.connect() as conn:
        total, after = 0, (conn.execute(text(FIRST_ENQUEUED)).one()[1] or 1) - 1
    while True:
        with engine.begin() as conn:
            page = conn.execute(text(f"SELECT id, jid FROM project_export_jobs WHERE {ENQUEUED} AND id > :after "
                                     "ORDER BY id LIMIT 1000"), {"after": after}).all()
            if not page:
                return total
            completed = sidekiq_status.completed_jids(client, [r.jid for r in page])
            ids = [r.id for r in page if r.jid in completed]
            total += conn.execute(text("UPDATE project_export_jobs SET status = 3, updated_at = :now "
                                       f"WHERE id = ANY(:ids) AND {ENQUEUED}"),
                                  {"ids": ids, "now": utc_now()}).rowcount
        after = page[-1].id
        on_batch()


def exports_per_row(engine, client, on_batch):
    def fail(conn, job_id):  # read the job, ask Sidekiq about its jid, fail it if still enqueued under that jid
        read = text(f"SELECT id, jid FROM project_export_jobs WHERE id = :id AND {ENQUEUED}")
        job = conn.execute(read, {"id": job_id}).first()
        if job is None or client.exists(sidekiq_status.status_key(job.jid)):
            return 0
        fail = text("UPDATE project_export_jobs SET status = 3, updated_at = :now "
                    f"WHERE id = :id AND jid = :jid AND {ENQUEUED}")
        return conn.execute(fail, {"id": job_id, "jid": job.jid, "now": utc_now()}).rowcount

    page = f"SELECT id FROM project_export_jobs WHERE {ENQUEUED} AND id > :after ORDER BY id LIMIT 100"
    return per_row(engine, page, {}, fail)


# -- stuck_export_jobs: the count and the first enqueued id (as the job's first op), then page by id from it, one
# pipelined EXISTS per chunk (as the job), fail the completed ones if still enqueued under the same jid and not a
# parallel export in its 6 h grace. The fail of chunk k and the read of chunk k+1 are one statement (the page is
# past chunk k's ids, so the two never meet): one database and one Redis round trip per chunk.

FIRST_ENQUEUED = f"SELECT count(*), min(id) FROM project_export_jobs WHERE {ENQUEUED}"

EXPORTS = f"""WITH failed AS (
  UPDATE project_export_jobs j SET status = 3, updated_at = %(now)s
  FROM unnest(%(ids)s::bigint[], %(jids)s::text[]) AS checked(id, jid)
  WHERE j.id = checked.id AND j.jid = checked.jid AND j.{ENQUEUED}
    AND NOT (j.created_at > %(grace_cutoff)s
             AND EXISTS (SELECT 1 FROM project_relation_exports r WHERE r.project_export_job_id = j.id OFFSET 0))
  RETURNING 1),
page AS (SELECT id, jid FROM project_export_jobs WHERE (status + 0) IN (0, 1) AND id > %(after)s ORDER BY id
          LIMIT %(limit)s)  -- the primary key walked, as the job's pages of a backlog
SELECT (SELECT count(*) FROM failed), array_agg(id ORDER BY id), array_agg(jid ORDER BY id) FROM page"""


def exports_floor(conn, client: redis.Redis) -> tuple[int, int]:
    cur = conn.cursor()
    grace_cutoff = utc_now() - EXPORT_JOBS_EXPIRATION
    cur.execute(FIRST_ENQUEUED)
    after = (cur.fetchone()[1] or 1) - 1
    total = batches = 0
    ids: list = []
    jids: list = []
    while True:
        cur.execute(EXPORTS, {"after": after, "limit": CHUNK_SIZE, "ids": list(ids),
                              "jids": list(jids), "grace_cutoff": grace_cutoff, "now": utc_now()})
        failed, page_ids, page_jids = cur.fetchone()
        total += failed
        if not page_ids:
            return total, batches
        completed = sidekiq_status.completed_jids(client, page_jids)
        ids = [i for i, jid in zip(page_ids, page_jids) if jid in completed]
        jids = [jid for jid in page_jids if jid in completed]
        after, batches = page_ids[-1], batches + 1


def _export_cases(conn, client: redis.Redis, before: dict[str, int]) -> None:
    # Exports an earlier bench's rounds spared (running, or in their grace) are still enqueued: every idle
    # run would page through them. Finished, as they would be by now.
    conn.execute(text(f"UPDATE project_export_jobs SET status = 2 WHERE id <= :before AND {ENQUEUED}"),
                 {"before": before["project_export_jobs"]})
    # A tenth are parallel exports (relation exports), half of those inside the 6-hour grace: spared.
    conn.execute(text("""
        INSERT INTO project_relation_exports
               (project_export_job_id, project_id, relation, created_at, updated_at)
        SELECT id, project_id, 'issues', created_at, created_at FROM project_export_jobs
        WHERE id > :before AND id % 10 = 0
    """), {"before": before["project_export_jobs"]})
    conn.execute(text("""
        UPDATE project_export_jobs
        SET created_at = now() - CASE WHEN id % 20 = 0 THEN interval '1 hour' ELSE interval '7 hours' END
        WHERE id > :before AND id % 10 = 0
    """), {"before": before["project_export_jobs"]})
    # A seventh still have their Sidekiq job (status key present): running, left.
    running = conn.execute(text("SELECT jid FROM project_export_jobs WHERE id > :before AND id % 7 = 0"),
                           {"before": before["project_export_jobs"]}).scalars().all()
    pipe = client.pipeline(transaction=False)
    for jid in running:
        pipe.set(sidekiq_status.status_key(jid), "1")
    pipe.execute()


# Its entries in the benchmark's per-job tables (ci_cleanup_dev.batches).
RUNNERS = (exports_job, exports_raw, exports_per_row)
FLOOR = on_a_connection(exports_floor)
# The tables whose candidate rows (id > the id before the candidates were added) the job may change, where the
# release has them.
SCOPED = ("project_export_jobs",)
CASES = _export_cases  # the cases its guards decide, beyond its plain candidates
