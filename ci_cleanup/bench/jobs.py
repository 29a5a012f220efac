"""The registered batches three ways, for the benchmark: the job's own service, a raw SQL loop with the same
batch size (the floor), and a per-row read-then-write loop in the style of GitLab's ``drop!`` with
optimistic locking (what running the Rails workers does today).

Each runner takes ``(engine, redis_client, on_batch)`` and returns the rows it processed;
``on_batch`` is called after every batch, so the caller can time batches.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass

import redis
from sqlalchemy import insert, text
from sqlalchemy.engine import Engine

from ..batches import BATCHES
from ..drop_canceling_builds import service as drop_canceling
from ..environments_auto_stop import service as auto_stop
from ..gitlab import artifact_buckets, sidekiq_status
from ..gitlab.schema import gitlab_schema, naive_utc, utc_now
from ..schedule_bulk_delete_job_artifacts import service as bulk_delete
from ..stale_runner_machines_cleanup import service as stale_machines
from ..stuck_export_jobs import service as stuck_exports
from .floor import FIRST_ENQUEUED

S = gitlab_schema()
UNLIMITED = 10**9
Runner = Callable[[Engine, redis.Redis, Callable[[], None]], int]


@dataclass(frozen=True)
class BenchJob:
    name: str
    table: str  # where its candidates live (see seed.INSERTS): the registry's table of the batch
    job: Runner
    raw: Runner
    per_row: Runner


def _loop(engine: Engine, on_batch, batch: Callable[..., int]) -> int:
    """Run ``batch(conn)`` in its own transaction until it processes nothing."""
    total = 0
    while True:
        with engine.begin() as conn:
            n = batch(conn)
        if not n:
            return total
        total += n
        on_batch()


def _per_row(engine: Engine, page_sql: str, params: dict, handle: Callable) -> int:
    """Read a page of candidate ids (100, as ``each_batch`` would), then read and write each row in a transaction."""
    total, after = 0, 0
    while True:
        with engine.connect() as conn:
            ids = list(conn.execute(text(page_sql), {**params, "after": after}).scalars())
        if not ids:
            return total
        for row_id in ids:
            with engine.begin() as conn:
                total += handle(conn, row_id)
        after = ids[-1]


# -- drop_canceling_builds -----------------------------------------------------------------------

CANCELING = "type = 'Ci::Build' AND status = 'canceling' AND created_at < :cutoff AND updated_at < :cutoff"


def _drop_params():
    return {"cutoff": naive_utc(utc_now() - drop_canceling.TIMEOUT), "now": naive_utc(utc_now())}


def drop_job(engine, client, on_batch):
    result = drop_canceling.drop_canceling_builds(
        engine, S, drop_canceling.Limits(utc_now() - drop_canceling.TIMEOUT),
        drop_canceling.Hooks(on_batch=lambda batch: on_batch()),
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
    return _loop(engine, on_batch, lambda conn: conn.scalar(sql, params))


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
    return _per_row(engine, page, params, drop)


# -- stale_runner_machines_cleanup ---------------------------------------------------------------

STALE = "created_at <= :deadline AND (contacted_at IS NULL OR contacted_at <= :deadline)"


def stale_job(engine, client, on_batch):
    return stale_machines.delete_stale_runner_managers(
        engine, S, stale_machines.Limits(stale_machines.stale_deadline(utc_now()), max_deletions=UNLIMITED),
        stale_machines.Hooks(lambda ids: on_batch())
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
    return _loop(engine, on_batch, lambda conn: conn.execute(sql, params).rowcount)


def stale_per_row(engine, client, on_batch):
    params = {"deadline": stale_machines.stale_deadline(utc_now())}

    def destroy(conn, machine_id):  # RunnerManager#destroy: read, then delete that row
        read = text(f"SELECT id FROM ci_runner_machines WHERE id = :id AND {STALE}")
        if conn.execute(read, {**params, "id": machine_id}).first() is None:
            return 0
        return conn.execute(text("DELETE FROM ci_runner_machines WHERE id = :id"), {"id": machine_id}).rowcount

    page = f"SELECT id FROM ci_runner_machines WHERE {STALE} AND id > :after ORDER BY id LIMIT 100"
    return _per_row(engine, page, params, destroy)


# -- stuck_export_jobs ---------------------------------------------------------------------------

def exports_job(engine, client, on_batch):
    with engine.connect() as conn:  # the job's first op
        enqueued = stuck_exports.count_enqueued(conn, S)
    return stuck_exports.mark_stuck_jobs_as_failed(
        engine, S, client,
        stuck_exports.Limits(utc_now() - stuck_exports.EXPORT_JOBS_EXPIRATION, first_id=enqueued.first_id,
                             walk=enqueued.dense),
        stuck_exports.Hooks(on_batch=lambda chunk, outcome: on_batch()),
    ).stuck


def exports_raw(engine, client, on_batch):
    with engine.connect() as conn:
        total, after = 0, (conn.execute(text(FIRST_ENQUEUED)).one()[1] or 1) - 1
    while True:
        with engine.begin() as conn:
            page = conn.execute(text("SELECT id, jid FROM project_export_jobs WHERE status IN (0, 1) AND id > :after "
                                     "ORDER BY id LIMIT 1000"), {"after": after}).all()
            if not page:
                return total
            completed = sidekiq_status.completed_jids(client, [r.jid for r in page])
            ids = [r.id for r in page if r.jid in completed]
            total += conn.execute(text("UPDATE project_export_jobs SET status = 3, updated_at = :now "
                                       "WHERE id = ANY(:ids) AND status IN (0, 1)"),
                                  {"ids": ids, "now": utc_now()}).rowcount
        after = page[-1].id
        on_batch()


def exports_per_row(engine, client, on_batch):
    def fail(conn, job_id):  # read the job, ask Sidekiq about its jid, fail it if still enqueued under that jid
        read = text("SELECT id, jid FROM project_export_jobs WHERE id = :id AND status IN (0, 1)")
        job = conn.execute(read, {"id": job_id}).first()
        if job is None or client.exists(sidekiq_status.status_key(job.jid)):
            return 0
        fail = text("UPDATE project_export_jobs SET status = 3, updated_at = :now "
                    "WHERE id = :id AND jid = :jid AND status IN (0, 1)")
        return conn.execute(fail, {"id": job_id, "jid": job.jid, "now": utc_now()}).rowcount

    page = "SELECT id FROM project_export_jobs WHERE status IN (0, 1) AND id > :after ORDER BY id LIMIT 100"
    return _per_row(engine, page, {}, fail)


# -- environments_auto_stop ----------------------------------------------------------------------

DUE = "state = 'available' AND auto_stop_at < :now"


def envs_job(engine, client, on_batch):
    result = auto_stop.auto_stop_environments(
        engine, engine, S, auto_stop.Limits(max_loops=UNLIMITED, max_runtime=dt.timedelta(days=1)),
        auto_stop.Hooks(on_batch=lambda b: on_batch()),
    )
    return result.counts[auto_stop.STOPPED] + result.counts[auto_stop.STOPPING]


def envs_raw(engine, client, on_batch):
    """Page by id, look up stop actions (the last successful deployment) for the page, stop the rest in one UPDATE."""
    total, after, now = 0, 0, utc_now()
    while True:
        with engine.begin() as conn:
            page = text(f"SELECT id FROM environments WHERE {DUE} AND id > :after ORDER BY id LIMIT 100")
            ids = list(conn.scalars(page, {"now": now, "after": after}))
            if not ids:
                return total
            with_actions = set(conn.scalars(text("""
                SELECT e.id FROM environments e, LATERAL (SELECT deployable_id, on_stop FROM deployments d
                  WHERE d.environment_id = e.id AND d.status = 2 ORDER BY d.id DESC LIMIT 1) last
                JOIN p_ci_builds deployable ON deployable.id = last.deployable_id
                JOIN p_ci_builds stop ON stop.commit_id = deployable.commit_id AND stop.name = last.on_stop
                                     AND stop.type = 'Ci::Build'
                WHERE e.id = ANY(:ids)"""), {"ids": ids}))
            stop = text(f"""UPDATE environments SET state = 'stopped', auto_stop_at = NULL, updated_at = :naive
                            WHERE id = ANY(:ids) AND {DUE} AND auto_stop_setting = 0""")
            without = [i for i in ids if i not in with_actions]
            total += conn.execute(stop, {"ids": without, "now": now, "naive": naive_utc(now)}).rowcount
        after = ids[-1]
        on_batch()


def envs_per_row(engine, client, on_batch):
    now = utc_now()

    def stop(conn, env_id):  # Environment#stop_with_actions!: read it and its last deployment, then stop it
        read = text(f"SELECT id, auto_stop_setting FROM environments WHERE id = :id AND {DUE}")
        env = conn.execute(read, {"id": env_id, "now": now}).first()
        if env is None:
            return 0
        last = text("SELECT deployable_id, on_stop FROM deployments WHERE environment_id = :id AND status = 2 "
                    "ORDER BY id DESC LIMIT 1")
        conn.execute(last, {"id": env_id}).first()
        stop = text(f"UPDATE environments SET state = 'stopped', auto_stop_at = NULL, updated_at = :naive "
                    f"WHERE id = :id AND {DUE}")
        return conn.execute(stop, {"id": env_id, "now": now, "naive": naive_utc(now)}).rowcount

    page = f"SELECT id FROM environments WHERE {DUE} AND id > :after ORDER BY id LIMIT 100"
    return _per_row(engine, page, {"now": now}, stop)


# -- schedule_bulk_delete_job_artifacts ----------------------------------------------------------

EXPIRED = "expire_at < :now AND file_type <> 3 AND locked = 0"


def _enable_bulk_delete(engine: Engine, client: redis.Redis) -> None:
    with engine.begin() as conn:
        if not conn.scalar(text("SELECT 1 FROM feature_gates WHERE feature_key = :k"), {"k": bulk_delete.FEATURE_FLAG}):
            stamp = dict(created_at=naive_utc(utc_now()), updated_at=naive_utc(utc_now()))
            conn.execute(insert(S.features).values(key=bulk_delete.FEATURE_FLAG, **stamp))
            conn.execute(insert(S.feature_gates).values(
                feature_key=bulk_delete.FEATURE_FLAG, key="boolean", value="true", **stamp
            ))
    artifact_buckets.schedule(client, bulk_delete.MAX_BUCKETS, utc_now())


def artifacts_job(engine, client, on_batch):
    _enable_bulk_delete(engine, client)
    total = 0
    for bucket in range(bulk_delete.MAX_BUCKETS):  # one worker per bucket, one after the other
        total += bulk_delete.run_bucket_worker(
            engine, client, S, bucket=bucket, limits=bulk_delete.Limits(max_batches=UNLIMITED,
                                                                       max_runtime=dt.timedelta(days=1)),
            hooks=bulk_delete.Hooks(on_batch=lambda b, batch: on_batch()),
        ).destroyed_job_artifacts_count
    return total


def artifacts_raw(engine, client, on_batch):
    sql = text(f"""
        WITH deleted AS (
          DELETE FROM p_ci_job_artifacts WHERE id = ANY(ARRAY(
            SELECT id FROM p_ci_job_artifacts
            WHERE {EXPIRED} AND CASE WHEN mod(project_id + job_id, 5) = :bucket THEN true ELSE false END
            ORDER BY expire_at LIMIT 100 FOR UPDATE SKIP LOCKED))
          RETURNING project_id, file_store, file_final_path, expire_at),
        recorded AS (
          INSERT INTO ci_deleted_objects (file_store, store_dir, file, project_id, pick_up_at)
          SELECT file_store, regexp_replace(file_final_path, '/[^/]*$', ''),
                 regexp_replace(file_final_path, '^.*/', ''), project_id,
                 least(greatest(expire_at, :now - interval '1 day'), :now + interval '1 hour')
          FROM deleted WHERE file_final_path IS NOT NULL)
        SELECT count(*) FROM deleted""")
    total = 0
    for bucket in range(bulk_delete.MAX_BUCKETS):
        params = {"bucket": bucket}
        total += _loop(engine, on_batch, lambda conn, params=params: conn.scalar(sql, {**params, "now": utc_now()}))
    return total


# One artifact's ci_deleted_objects row, as Ci::JobArtifact#to_deleted_object_attrs, for the bench's artifacts (a
# final path without trailing slashes, else GitLab's hashed path).
RECORD_ONE = text("""
    INSERT INTO ci_deleted_objects (file_store, store_dir, file, project_id, pick_up_at)
    SELECT file_store,
           CASE WHEN file_final_path IS NOT NULL THEN regexp_replace(file_final_path, '/[^/]*$', '')
                ELSE concat_ws('/', substr(h, 1, 2), substr(h, 3, 2), h,
                               to_char(timezone('UTC', created_at), 'YYYY_MM_DD'), job_id, id) END,
           CASE WHEN file_final_path IS NOT NULL THEN regexp_replace(file_final_path, '^.*/', '') ELSE file END,
           project_id, least(greatest(expire_at, :earliest), :latest)
    FROM p_ci_job_artifacts, LATERAL (SELECT encode(sha256(convert_to(project_id::text, 'UTF8')), 'hex') AS h) hashed
    WHERE id = :id""")


def artifacts_per_row(engine, client, on_batch):
    now = utc_now()
    read = text(f"SELECT id FROM p_ci_job_artifacts WHERE id = :id AND {EXPIRED} FOR UPDATE")

    def destroy(conn, artifact_id):  # read the artifact, record its file, delete it
        if conn.execute(read, {"id": artifact_id, "now": now}).first() is None:
            return 0
        conn.execute(RECORD_ONE, {"id": artifact_id, **bulk_delete.pick_up_at_bounds(now)})
        conn.execute(text("DELETE FROM p_ci_job_artifacts WHERE id = :id"), {"id": artifact_id})
        return 1

    page = f"SELECT id FROM p_ci_job_artifacts WHERE {EXPIRED} AND id > :after ORDER BY id LIMIT 100"
    return _per_row(engine, page, {"now": now}, destroy)


# Per registered batch on GitLab's tables: its service, the floor and the per-row loop.
RUNNERS = {
    "drop_canceling_builds": (drop_job, drop_raw, drop_per_row),
    "stale_runner_machines_cleanup": (stale_job, stale_raw, stale_per_row),
    "stuck_export_jobs": (exports_job, exports_raw, exports_per_row),
    "environments_auto_stop": (envs_job, envs_raw, envs_per_row),
    "schedule_bulk_delete_job_artifacts": (artifacts_job, artifacts_raw, artifacts_per_row),
}
JOBS = [BenchJob(batch.name, batch.table, *RUNNERS[batch.name]) for batch in BATCHES if batch.name in RUNNERS]
BY_NAME = {job.name: job for job in JOBS}
