"""stale_runner_machines_cleanup's workshop.

Its rows in the demo dataset (``ci-cleanup demo``), some it must change and more it must not; and its entries in
the benchmark (``ci-cleanup bench``): the job's service, a raw SQL loop and a per-row loop
(:mod:`~ci_cleanup_dev.bench.jobs`), its true floor (:mod:`~ci_cleanup_dev.bench.floor`), and the tables and cases
its launched runs meet (:mod:`~ci_cleanup_dev.bench.launched`)."""

from __future__ import annotations

import datetime as dt
import json
import random
import uuid

import redis
from sqlalchemy import insert, text
from sqlalchemy.engine import Connection

from ci_cleanup.gitlab.loop_helpers import NO_HOOKS
from ci_cleanup.gitlab.schema import GitLabSchema, utc_now
from ci_cleanup.gitlab.sql_files import condition
from ci_cleanup.stale_runner_machines_cleanup import service as stale_machines
from ci_cleanup.stale_runner_machines_cleanup.service import SUB_BATCH_LIMIT, stale_deadline

from ..bench.floor import on_a_connection
from ..bench.jobs import UNLIMITED, S, loop, per_row, with_callback


def seed(
    conn: Connection, queues: redis.Redis, schema: GitLabSchema, rng: random.Random, now: dt.datetime
) -> None:
    """stale_runner_machines_cleanup: 130 machines silent for over 7 days (two sub-batches), and live or new ones."""
    rows = []
    for i in range(130):
        created = now - dt.timedelta(days=rng.randint(8, 400))
        contacted = None if i % 4 == 0 else created + (now - created - dt.timedelta(days=7)) * rng.random()
        rows.append(dict(created_at=created, contacted_at=contacted))
    for i in range(40):  # old but contacted within the week, or registered within the week and never contacted
        if i % 2:
            created = now - dt.timedelta(days=rng.randint(8, 400))
            contacted = now - dt.timedelta(hours=rng.randint(0, 160))
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


# -- the benchmark (see bench/jobs.py, bench/floor.py) ---------------------------------------------------------

# The limit the benchmark launches the job with (its run config), so job and floor stop at the same place.
STALE_MAX_DELETIONS = 100_000

# The rule's condition, as the batch's statements have it (stale_runner_machines_cleanup/stale.sql).
STALE = condition("ci_cleanup.stale_runner_machines_cleanup", "stale")
STALE_PY = condition("ci_cleanup.stale_runner_machines_cleanup", "stale", pyformat=True)


def stale_job(engine, client, on_batch, hooks=NO_HOOKS):
    return stale_machines.delete_stale_runner_managers(
        engine, S, stale_machines.Limits(stale_machines.stale_deadline(utc_now()), max_deletions=UNLIMITED),
        with_callback(hooks, on_batch),
    ).total_deleted


def stale_raw(engine, client, on_batch):
    sql = text("""
        DELETE FROM ci_runner_machines WHERE id = ANY(ARRAY(
          (SELECT id FROM ci_runner_machines WHERE contacted_at <= :deadline AND created_at <= :deadline
           ORDER BY contacted_at DESC, id DESC LIMIT 100)
          UNION ALL
          (SELECT id FROM ci_runner_machines WHERE contacted_at IS NULL AND created_at <= :deadline
           ORDER BY contacted_at DESC, id DESC LIMIT 100) LIMIT 100))""")
    params = {"deadline": stale_machines.stale_deadline(utc_now())}
    return loop(engine, on_batch, lambda conn: conn.execute(sql, params).rowcount)


def stale_per_row(engine, client, on_batch):
    params = {"deadline": stale_machines.stale_deadline(utc_now())}

    def destroy(conn, machine_id):  # RunnerManager#destroy: read, then delete that row
        read = text(f"SELECT id FROM ci_runner_machines WHERE id = :id AND {STALE}")
        if conn.execute(read, {**params, "id": machine_id}).first() is None:
            return 0
        return conn.execute(text("DELETE FROM ci_runner_machines WHERE id = :id"), {"id": machine_id}).rowcount

    page = f"SELECT id FROM ci_runner_machines WHERE {STALE} AND id > :after ORDER BY id LIMIT 100"
    return per_row(engine, page, params, destroy)


# -- stale_runner_machines_cleanup: two ordered scans of the contacted_at index, the stale rule repeated on the DELETE

STALE_FLOOR = f"""WITH deleted AS (
  DELETE FROM ci_runner_machines WHERE id = ANY(ARRAY(
    SELECT id FROM ((SELECT id FROM ci_runner_machines WHERE contacted_at <= %(deadline)s AND created_at <= %(deadline)s
                     ORDER BY contacted_at DESC, id DESC LIMIT %(limit)s)
                    UNION ALL
                    (SELECT id FROM ci_runner_machines WHERE contacted_at IS NULL AND created_at <= %(deadline)s
                     ORDER BY contacted_at DESC, id DESC LIMIT %(limit)s)) stale LIMIT %(limit)s))
    AND {STALE_PY}
  RETURNING 1)
SELECT count(*) FROM deleted"""


def stale_floor(conn, client: redis.Redis) -> tuple[int, int]:
    cur = conn.cursor()
    deadline = stale_deadline(utc_now())
    total = batches = 0
    while True:  # the job's loop: until a pass deletes nothing or max_deletions are gone (then count what is left)
        cur.execute(STALE_FLOOR, {"deadline": deadline, "limit": min(SUB_BATCH_LIMIT, STALE_MAX_DELETIONS - total)})
        n = cur.fetchone()[0]
        total, batches = total + n, batches + 1
        if not n:
            return total, batches
        if total >= STALE_MAX_DELETIONS:
            cur.execute(f"SELECT count(*) FROM ci_runner_machines WHERE {STALE_PY}", {"deadline": deadline})
            return total, batches


# Its entries in the benchmark's per-job tables (ci_cleanup_dev.batches).
RUNNERS = (stale_job, stale_raw, stale_per_row)
FLOOR = on_a_connection(stale_floor)
# The tables whose candidate rows (id > the id before the candidates were added) the job may change, where the
# release has them.
SCOPED = ("ci_runner_machines", "ci_runner_machines_archived")
# What the job is launched with beyond its defaults (YAML, written as JSON).
RUN_CONFIG = json.dumps({"ops": {"find_stale_runner_machines": {"config": {"max_deletions": STALE_MAX_DELETIONS}}}})
