"""The true floor of each job, for the benchmark: plain psycopg2, one database round trip per batch
(autocommit: the statement is the batch's transaction), its statement text sent each batch as GitLab sends its
own behind PgBouncer in transaction pooling (``prepared_statements: false``: no session-level PREPARE, which
a pooled server connection would not keep), doing exactly the job's work: the same rows changed, the same
guards re-checked in the writing statement, the same side rows (queue deletes, queued stop actions,
``ci_deleted_objects``).

The SQL is written out by hand from the services (``ci_cleanup/*/service.py``); the benchmark checks
that a floor and its job leave identical tables (:mod:`ci_cleanup.bench.launched`). Each floor takes a
database URL and a Redis client, opens its own connections (one, or one per bucket worker) and returns
``(rows changed, batches)``. Work per run that is not per batch is left out where it is cheap and writes no table
(the jobs' Redis leases).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
from concurrent.futures import ThreadPoolExecutor

import psycopg2
import psycopg2.extensions
import redis
from sqlalchemy.engine import make_url

from ..drop_canceling_builds.service import BATCH_SIZE as DROP_BATCH
from ..drop_canceling_builds.service import TIMEOUT
from ..environments_auto_stop.service import BATCH_SIZE as ENVS_BATCH
from ..gitlab import artifact_buckets, sidekiq_status
from ..gitlab.schema import naive_utc, utc_now
from ..schedule_bulk_delete_job_artifacts.service import (
    BATCH_SIZE as ARTIFACTS_BATCH,
)
from ..schedule_bulk_delete_job_artifacts.service import (
    PICK_UP_AT_EARLIEST,
    PICK_UP_AT_LATEST,
)
from ..stale_runner_machines_cleanup.service import SUB_BATCH_LIMIT, stale_deadline
from ..stuck_export_jobs.service import CHUNK_SIZE, EXPORT_JOBS_EXPIRATION

# The limits the benchmark launches the jobs with (their run config), so job and floor stop at the same place.
STALE_MAX_DELETIONS = 100_000
ENVS_MAX_LOOPS = 10_000
# The class of every floor's cursors: :mod:`ci_cleanup.bench.statements` records a floor's statements through its own.
CURSOR = psycopg2.extensions.cursor


def connect(url: str):
    """A psycopg2 connection for a ``postgresql+psycopg2://`` URL (parsed only; no SQLAlchemy on the path)."""
    parsed = make_url(url)
    args = parsed.translate_connect_args(username="user", database="dbname")
    conn = psycopg2.connect(**args, **{k: v for k, v in parsed.query.items() if isinstance(v, str)},
                            cursor_factory=CURSOR)
    conn.autocommit = True  # each statement is its own transaction: one round trip, no BEGIN / COMMIT
    return conn


# -- drop_canceling_builds: candidates in GitLab's order, dropped if still outdated and canceling, out of the queues

DROP = """WITH dropped AS (
  UPDATE p_ci_builds SET status = 'failed', failure_reason = 3, finished_at = coalesce(finished_at, %(now)s),
         updated_at = %(now)s, lock_version = coalesce(lock_version, 0) + 1
  WHERE id = ANY(ARRAY(SELECT id FROM p_ci_builds
                       WHERE type = 'Ci::Build' AND status = 'canceling'
                         AND created_at < %(cutoff)s AND updated_at < %(cutoff)s
                       ORDER BY created_at, project_id, id LIMIT %(limit)s))
    AND type = 'Ci::Build' AND status = 'canceling' AND created_at < %(cutoff)s AND updated_at < %(cutoff)s
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


# -- stale_runner_machines_cleanup: two ordered scans of the contacted_at index, the stale rule repeated on the DELETE

STALE = """WITH deleted AS (
  DELETE FROM ci_runner_machines WHERE id = ANY(ARRAY(
    SELECT id FROM ((SELECT id FROM ci_runner_machines WHERE contacted_at <= %(deadline)s AND created_at <= %(deadline)s
                     ORDER BY contacted_at DESC, id DESC LIMIT %(limit)s)
                    UNION ALL
                    (SELECT id FROM ci_runner_machines WHERE contacted_at IS NULL AND created_at <= %(deadline)s
                     ORDER BY contacted_at DESC, id DESC LIMIT %(limit)s)) stale LIMIT %(limit)s))
    AND created_at <= %(deadline)s AND (contacted_at IS NULL OR contacted_at <= %(deadline)s)
  RETURNING 1)
SELECT count(*) FROM deleted"""


def stale_floor(conn, client: redis.Redis) -> tuple[int, int]:
    cur = conn.cursor()
    deadline = stale_deadline(utc_now())
    total = batches = 0
    while True:  # the job's loop: until a pass deletes nothing or max_deletions are gone (then count what is left)
        cur.execute(STALE, {"deadline": deadline, "limit": min(SUB_BATCH_LIMIT, STALE_MAX_DELETIONS - total)})
        n = cur.fetchone()[0]
        total, batches = total + n, batches + 1
        if not n:
            return total, batches
        if total >= STALE_MAX_DELETIONS:
            cur.execute("SELECT count(*) FROM ci_runner_machines WHERE created_at <= %(deadline)s "
                        "AND (contacted_at IS NULL OR contacted_at <= %(deadline)s)", {"deadline": deadline})
            return total, batches


# -- stuck_export_jobs: the count and the first enqueued id (as the job's first op), then page by id from it, one
# pipelined EXISTS per chunk (as the job), fail the completed ones if still enqueued under the same jid and not a
# parallel export in its 6 h grace. The fail of chunk k and the read of chunk k+1 are one statement (the page is
# past chunk k's ids, so the two never meet): one database and one Redis round trip per chunk.

FIRST_ENQUEUED = "SELECT count(*), min(id) FROM project_export_jobs WHERE status IN (0, 1)"

EXPORTS = """WITH failed AS (
  UPDATE project_export_jobs j SET status = 3, updated_at = %(now)s
  FROM unnest(%(ids)s::bigint[], %(jids)s::text[]) AS checked(id, jid)
  WHERE j.id = checked.id AND j.jid = checked.jid AND j.status IN (0, 1)
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


# -- environments_auto_stop: page by (auto_stop_at, id), the batch locked as the job's pick locks it; stopping
# with stop actions (the manual ones played and queued with their partition_id), stopped when always, left
# otherwise; each UPDATE re-checks auto-stoppable.

ENVS = """WITH batch AS (
  SELECT id, auto_stop_setting, auto_stop_at FROM environments
  WHERE state = 'available' AND auto_stop_at < %(now)s
    AND auto_stop_at >= %(after_at)s AND (auto_stop_at > %(after_at)s OR id > %(after_id)s)
  ORDER BY auto_stop_at, id LIMIT %(limit)s FOR UPDATE),
actions AS (
  SELECT batch.id AS environment_id, stop_action.id
  FROM batch
  JOIN LATERAL (SELECT deployable_id, on_stop FROM deployments d WHERE d.environment_id = batch.id AND d.status = 2
                ORDER BY d.id DESC LIMIT 1) last_deployment ON true
  JOIN p_ci_builds deployable ON deployable.id = last_deployment.deployable_id
  JOIN p_ci_builds stop_action ON stop_action.commit_id = deployable.commit_id
   AND stop_action.name = last_deployment.on_stop AND stop_action.type = 'Ci::Build'),
stopping AS (
  UPDATE environments SET state = 'stopping', updated_at = %(now_naive)s
  WHERE id = ANY(ARRAY(SELECT environment_id FROM actions)) AND state = 'available' AND auto_stop_at < %(now)s
  RETURNING id),
stopped AS (
  UPDATE environments SET state = 'stopped', auto_stop_at = NULL, updated_at = %(now_naive)s
  WHERE id = ANY(ARRAY(SELECT id FROM batch WHERE auto_stop_setting = 0
                       AND id NOT IN (SELECT environment_id FROM actions)))
    AND state = 'available' AND auto_stop_at < %(now)s AND auto_stop_setting = 0
  RETURNING id),
played AS (
  UPDATE p_ci_builds SET status = 'pending', queued_at = %(now_naive)s, updated_at = %(now_naive)s,
         lock_version = coalesce(lock_version, 0) + 1
  WHERE id = ANY(ARRAY(SELECT id FROM actions WHERE environment_id IN (SELECT id FROM stopping))) AND status = 'manual'
  RETURNING id, project_id, partition_id),
queued AS (
  INSERT INTO ci_pending_builds (build_id, project_id, partition_id)
  SELECT id, project_id, partition_id FROM played ON CONFLICT (build_id) DO NOTHING)
SELECT (SELECT count(*) FROM stopping) + (SELECT count(*) FROM stopped),
       (SELECT auto_stop_at FROM batch ORDER BY auto_stop_at DESC, id DESC LIMIT 1),
       (SELECT id FROM batch ORDER BY auto_stop_at DESC, id DESC LIMIT 1)"""


def envs_floor(conn, client: redis.Redis) -> tuple[int, int]:
    cur = conn.cursor()
    after = (dt.datetime(1, 1, 1, tzinfo=dt.UTC), 0)
    total = batches = 0
    while batches < ENVS_MAX_LOOPS:
        now = utc_now()
        cur.execute(ENVS, {"now": now, "now_naive": naive_utc(now), "after_at": after[0], "after_id": after[1],
                           "limit": ENVS_BATCH})
        changed, last_at, last_id = cur.fetchone()
        if last_id is None:
            break
        total, batches, after = total + changed, batches + 1, (last_at, last_id)
    return total, batches


# -- schedule_bulk_delete_job_artifacts: per bucket, the flags read by the batch itself, the worker's (expire_at)
# cursor on GitLab's expire_at index, the MOD bucket as a CASE (as the job writes it), ci_deleted_objects for
# every row with a file (its final path, else GitLab's hashed path).

FLAGS = """WITH flags AS (
  SELECT coalesce(bool_or(feature_key = 'bulk_delete_job_artifacts'), false) AS enabled,
         CASE WHEN bool_or(feature_key = 'bulk_delete_job_artifacts_high_concurrency') THEN 10 ELSE 5 END AS max_buckets
  FROM feature_gates
  WHERE feature_key IN ('bulk_delete_job_artifacts', 'bulk_delete_job_artifacts_high_concurrency')
    AND key = 'boolean' AND value = 'true')"""

ARTIFACTS = FLAGS + """,
deleted AS (
  DELETE FROM p_ci_job_artifacts WHERE id = ANY(ARRAY(
    SELECT id FROM p_ci_job_artifacts
    WHERE expire_at < %(now)s AND file_type <> 3 AND locked = 0
      AND CASE WHEN mod(project_id::numeric + job_id, (SELECT max_buckets FROM flags)) = %(bucket)s
               THEN true ELSE false END
      AND expire_at >= %(after)s AND (SELECT enabled FROM flags) AND %(bucket)s < (SELECT max_buckets FROM flags)
    ORDER BY expire_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED))
  RETURNING id, project_id, job_id, file, file_store, file_final_path, expire_at, created_at),
recorded AS (
  INSERT INTO ci_deleted_objects (file_store, store_dir, file, project_id, pick_up_at)
  SELECT coalesce(file_store, 1),
         CASE WHEN path IS NOT NULL THEN (CASE WHEN head ~ '^/*$' THEN head ELSE rtrim(head, '/') END)
              ELSE concat_ws('/', substr(digest, 1, 2), substr(digest, 3, 2), digest,
                             to_char(timezone('UTC', created_at), 'YYYY_MM_DD'), job_id, id) END,
         CASE WHEN path IS NOT NULL THEN regexp_replace(path, '^.*/', '') ELSE file END,
         project_id, least(greatest(expire_at, %(earliest)s), %(latest)s)
  FROM deleted, LATERAL (SELECT nullif(file_final_path, '') AS path,
                                regexp_replace(nullif(file_final_path, ''), '[^/]*$', '') AS head,
                                encode(sha256(convert_to(project_id::text, 'UTF8')), 'hex') AS digest) derived
  WHERE path IS NOT NULL OR (nullif(file, '') IS NOT NULL AND created_at IS NOT NULL))
SELECT (SELECT count(*) FROM deleted), (SELECT max(expire_at) FROM deleted),
       (SELECT enabled FROM flags), (SELECT max_buckets FROM flags)"""


def artifacts_floor(url: str, client: redis.Redis) -> tuple[int, int]:
    """The scheduler's read of the flags, then its workers at once, worker i on bucket i, each on a connection of its
    own, as the job runs them (GitLab's ``perform_with_capacity``): threads, which psycopg2 lets run while each waits
    for the server."""
    with contextlib.closing(connect(url)) as conn:
        cur = conn.cursor()
        cur.execute(FLAGS + " SELECT enabled, max_buckets FROM flags")  # the scheduler's read, once per run
        enabled, max_buckets = cur.fetchone()
    if not enabled:
        return 0, 0
    artifact_buckets.schedule(client, max_buckets, utc_now())
    with ThreadPoolExecutor(max_buckets) as pool:
        done = list(pool.map(lambda bucket: _artifacts_worker(url, client, bucket), range(max_buckets)))
    return sum(rows for rows, _ in done), sum(batches for _, batches in done)


def _artifacts_worker(url: str, client: redis.Redis, bucket: int) -> tuple[int, int]:
    if artifact_buckets.claim(client, utc_now(), bucket) is None:
        return 0, 0
    total = batches = 0
    after = dt.datetime(1, 1, 1, tzinfo=dt.UTC)
    with contextlib.closing(connect(url)) as conn:
        cur = conn.cursor()
        while True:
            now = utc_now()
            cur.execute(ARTIFACTS, {"bucket": bucket, "now": now, "limit": ARTIFACTS_BATCH, "after": after,
                                    "earliest": now - PICK_UP_AT_EARLIEST, "latest": now + PICK_UP_AT_LATEST})
            n, last, enabled, max_buckets = cur.fetchone()  # as the worker reads them each batch
            if not enabled or bucket >= max_buckets:
                break
            total, batches = total + n, batches + 1
            after = last or after
            if n < ARTIFACTS_BATCH:
                break
    artifact_buckets.release(client, bucket, max_buckets)
    return total, batches


def on_a_connection(floor):
    """A floor of one loop, on a connection of its own that it opens and closes, as each launched job's process does."""

    @functools.wraps(floor)
    def run(url: str, client: redis.Redis) -> tuple[int, int]:
        with contextlib.closing(connect(url)) as conn:
            return floor(conn, client)

    return run


FLOORS = {
    "drop_canceling_builds": on_a_connection(drop_floor),
    "stale_runner_machines_cleanup": on_a_connection(stale_floor),
    "stuck_export_jobs": on_a_connection(exports_floor),
    "environments_auto_stop": on_a_connection(envs_floor),
    "schedule_bulk_delete_job_artifacts": artifacts_floor,
}
