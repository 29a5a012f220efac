"""drop_canceling_builds's workshop.

Its rows in the demo dataset (``ci-cleanup demo``), some it must change and more it must not; and its entries in
the benchmark (``ci-cleanup bench``): the job's service, a raw SQL loop and a per-row loop
(:mod:`~ci_cleanup_dev.bench.jobs`), its true floor (:mod:`~ci_cleanup_dev.bench.floor`), and the tables and cases
its launched runs meet (:mod:`~ci_cleanup_dev.bench.launched`)."""

from __future__ import annotations

import datetime as dt
import random

import redis
from sqlalchemy import insert, text
from sqlalchemy.engine import Connection

from ci_cleanup.drop_canceling_builds import service as drop_canceling
from ci_cleanup.drop_canceling_builds.service import BATCH_SIZE as DROP_BATCH
from ci_cleanup.drop_canceling_builds.service import TIMEOUT
from ci_cleanup.gitlab.loop_helpers import NO_HOOKS
from ci_cleanup.gitlab.schema import GitLabSchema, naive_utc, utc_now
from ci_cleanup.gitlab.sql_files import condition

from ..bench.floor import on_a_connection
from ..bench.jobs import S, loop, per_row, with_callback


def seed(
    conn: Connection, queues: redis.Redis, schema: GitLabSchema, rng: random.Random, now: dt.datetime
) -> None:
    """drop_canceling_builds: 120 builds stuck canceling (two batches), and builds it must leave alone."""
    rows = []
    for _ in range(120):
        stuck_since = now - dt.timedelta(hours=rng.randint(2, 48), minutes=rng.randint(0, 59))
        rows.append(dict(status="canceling", created_at=naive_utc(stuck_since), updated_at=naive_utc(stuck_since)))
    for status in ("running", "pending", "success", "failed", "canceled", "canceling"):
        for _ in range(10):  # recent ones, and old ones in other statuses
            at = now - dt.timedelta(minutes=rng.randint(1, 50) if status == "canceling" else rng.randint(61, 600))
            rows.append(dict(status=status, created_at=naive_utc(at), updated_at=naive_utc(at)))
    for i, values in enumerate(rows):
        values.update(
            partition_id=100 + i // 5 % 3, project_id=rng.randint(1, 20), commit_id=1000 + i // 5,
            name=rng.choice(["rspec", "lint", "build"]),
            type="Ci::Build", runner_id=rng.randint(1, 5), lock_version=0,
        )
    conn.execute(insert(schema.ci_builds), rows)


# -- the benchmark (see bench/jobs.py, bench/floor.py) ---------------------------------------------------------

# The rule's condition, as the batch's statements have it (drop_canceling_builds/outdated_canceling.sql).
CANCELING = condition("ci_cleanup.drop_canceling_builds", "outdated_canceling")
CANCELING_PY = condition("ci_cleanup.drop_canceling_builds", "outdated_canceling", pyformat=True)


def _drop_params():
    return {"cutoff": naive_utc(utc_now() - drop_canceling.TIMEOUT), "now": naive_utc(utc_now())}


def drop_job(engine, client, on_batch, hooks=NO_HOOKS):
    result = drop_canceling.drop_canceling_builds(
        engine, S, drop_canceling.Limits(utc_now() - drop_canceling.TIMEOUT),
        with_callback(hooks, on_batch),
    )
    return result.dropped


def drop_raw(engine, client, on_batch):
    sql = text(f"""
        WITH dropped AS (
          UPDATE p_ci_builds SET status = 'failed', failure_reason = 3, finished_at = coalesce(finished_at, :now),
                 updated_at = :now, lock_version = coalesce(lock_version, 0) + 1
          WHERE id = ANY(ARRAY(SELECT id FROM p_ci_builds WHERE {CANCELING}
                               ORDER BY created_at, project_id, id LIMIT 100))
            AND {CANCELING}
          RETURNING id),
        pending AS (DELETE FROM ci_pending_builds WHERE build_id IN (SELECT id FROM dropped)),
        running AS (DELETE FROM ci_running_builds WHERE build_id IN (SELECT id FROM dropped))
        SELECT count(*) FROM dropped""")
    params = _drop_params()
    return loop(engine, on_batch, lambda conn: conn.scalar(sql, params))


def drop_per_row(engine, client, on_batch):
    params = _drop_params()

    def drop(conn, build_id):  # Ci::Build#drop! : read, then UPDATE … WHERE lock_version = read one
        read = text(f"SELECT id, lock_version FROM p_ci_builds WHERE id = :id AND {CANCELING}")
        build = conn.execute(read, {**params, "id": build_id}).first()
        if build is None:
            return 0
        n = conn.execute(text("""UPDATE p_ci_builds SET status = 'failed', failure_reason = 3, finished_at = :now,
                                 updated_at = :now, lock_version = lock_version + 1
                                 WHERE id = :id AND lock_version = :lv"""),
                         {**params, "id": build_id, "lv": build.lock_version}).rowcount
        conn.execute(text("DELETE FROM ci_pending_builds WHERE build_id = :id"), {"id": build_id})
        conn.execute(text("DELETE FROM ci_running_builds WHERE build_id = :id"), {"id": build_id})
        return n

    page = f"SELECT id FROM p_ci_builds WHERE {CANCELING} AND id > :after ORDER BY id LIMIT 100"
    return per_row(engine, page, params, drop)


# -- drop_canceling_builds: candidates in GitLab's order, dropped if still outdated and canceling, out of the queues

DROP = f"""WITH dropped AS (
  UPDATE p_ci_builds SET status = 'failed', failure_reason = 3, finished_at = coalesce(finished_at, %(now)s),
         updated_at = %(now)s, lock_version = coalesce(lock_version, 0) + 1
  WHERE id = ANY(ARRAY(SELECT id FROM p_ci_builds WHERE {CANCELING_PY}
                       ORDER BY created_at, project_id, id LIMIT %(limit)s))
    AND {CANCELING_PY}
  RETURNING id),
pending AS (DELETE FROM ci_pending_builds WHERE id = ANY(ARRAY(
  SELECT id FROM ci_pending_builds WHERE build_id = ANY(ARRAY(SELECT id FROM dropped)) ORDER BY build_id))),
running AS (DELETE FROM ci_running_builds WHERE id = ANY(ARRAY(
  SELECT id FROM ci_running_builds WHERE build_id = ANY(ARRAY(SELECT id FROM dropped)) ORDER BY build_id)))
SELECT count(*) FROM dropped"""


def drop_floor(conn, client: redis.Redis) -> tuple[int, int]:
    cur = conn.cursor()
    cutoff = naive_utc(utc_now() - TIMEOUT)
    total = batches = 0
    while True:
        cur.execute(DROP, {"cutoff": cutoff, "now": naive_utc(utc_now()), "limit": DROP_BATCH})
        n = cur.fetchone()[0]
        if not n:
            return total, batches
        total, batches = total + n, batches + 1


def _drop_cases(conn, client: redis.Redis, before: dict[str, int]) -> None:
    """Every other dropped build also leaves the pending queue."""
    conn.execute(text("""
        INSERT INTO ci_pending_builds (build_id, project_id, partition_id)
        SELECT id, project_id, partition_id FROM p_ci_builds WHERE id > :before AND id % 2 = 0
    """), {"before": before["p_ci_builds"]})


# Its entries in the benchmark's per-job tables (ci_cleanup_dev.batches).
RUNNERS = (drop_job, drop_raw, drop_per_row)
FLOOR = on_a_connection(drop_floor)
# The tables whose candidate rows (id > the id before the candidates were added) the job may change, where the
# release has them.
SCOPED = ("p_ci_builds",)
CASES = _drop_cases  # the cases its guards decide, beyond its plain candidates
