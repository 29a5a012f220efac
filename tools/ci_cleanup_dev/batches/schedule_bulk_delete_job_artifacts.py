"""schedule_bulk_delete_job_artifacts's workshop.

Its rows in the demo dataset (``ci-cleanup demo``), some it must change and more it must not; and its entries in
the benchmark (``ci-cleanup bench``): the job's service, a raw SQL loop and a per-row loop
(:mod:`~ci_cleanup_dev.bench.jobs`), its true floor (:mod:`~ci_cleanup_dev.bench.floor`), and the tables and cases
its launched runs meet (:mod:`~ci_cleanup_dev.bench.launched`)."""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis
from sqlalchemy import func, insert, literal, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Connection

from ci_cleanup.gitlab import artifact_buckets
from ci_cleanup.gitlab.schema import FILE_STORE_LOCAL, GitLabSchema, naive_utc, utc_now
from ci_cleanup.gitlab.sql_files import condition
from ci_cleanup.schedule_bulk_delete_job_artifacts import service as bulk_delete
from ci_cleanup.schedule_bulk_delete_job_artifacts.service import BATCH_SIZE as ARTIFACTS_BATCH
from ci_cleanup.schedule_bulk_delete_job_artifacts.service import PICK_UP_AT_EARLIEST, PICK_UP_AT_LATEST

from ..bench.floor import connect
from ..bench.jobs import UNLIMITED, S, loop, per_row


def seed(
    conn: Connection, queues: redis.Redis, schema: GitLabSchema, rng: random.Random, now: dt.datetime
) -> None:
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
            partition_id=100 + i % 3, project_id=rng.randint(1, 40), job_id=first_job + i,
            file_type=3 if kind == "trace" else rng.choice([1, 2, 4]),
            size=rng.randint(1_000, 5_000_000), file="artifacts.zip", file_store=rng.choice([1, 2]),
            locked={"locked": 1, "unknown": 2}.get(kind, 0), expire_at=expire_at, created_at=created,
            updated_at=created,
        ))
    conn.execute(insert(schema.ci_job_artifacts), rows)
    conn.execute(insert(schema.ci_deleted_objects), [
        dict(file_store=store, store_dir=f"{i:02x}/{i + 16:02x}/demo/{i}", file="artifacts.zip",
             project_id=rng.randint(1, 40),
             pick_up_at=now + dt.timedelta(hours=-rng.randint(1, 24) if due else rng.randint(1, 24)))
        for i, (store, due) in enumerate([(1, True), (2, True), (1, False)] * 10)
    ])


def hashed_store_dir(project_id: int, created_at: dt.datetime, job_id: int, artifact_id: int) -> str:
    """Where GitLab keeps an artifact without a final path (``JobArtifactUploader#hashed_path``), as
    delete_expired_batch.sql records it."""
    digest = hashlib.sha256(str(project_id).encode()).hexdigest()
    day = created_at.astimezone(dt.UTC).strftime("%Y_%m_%d")
    return "/".join([digest[:2], digest[2:4], digest, day, str(job_id), str(artifact_id)])


def write_stored_files(conn: Connection, schema: GitLabSchema, root: Path) -> int:
    """The stored files of the demo's local artifacts and ``ci_deleted_objects`` rows, under ``root`` where GitLab
    keeps them, so that delete_expired_artifact_files has files to remove. Each is a sparse file of its artifact's
    size (no disk used); returns how many were written. The demo's artifacts have no final path."""
    a, queued = schema.ci_job_artifacts.c, schema.ci_deleted_objects.c
    artifacts = conn.execute(select(a.id, a.project_id, a.job_id, a.created_at, a.file, a.size).where(
        a.file_store == FILE_STORE_LOCAL, a.file_final_path.is_(None), a.file.is_not(None))).all()
    stored = [(hashed_store_dir(r.project_id, r.created_at, r.job_id, r.id), r.file, r.size) for r in artifacts]
    stored += conn.execute(select(queued.store_dir, queued.file, literal(0)).where(
        queued.file_store == FILE_STORE_LOCAL)).all()
    for store_dir, file, size in stored:
        folder = root / store_dir
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / file, "wb") as f:
            os.truncate(f.fileno(), size or 0)
    return len(stored)


# -- the benchmark (see bench/jobs.py, bench/floor.py) ---------------------------------------------------------

# The rule's condition, as the batch's statements have it (schedule_bulk_delete_job_artifacts/expired.sql).
EXPIRED = condition("ci_cleanup.schedule_bulk_delete_job_artifacts", "expired")
EXPIRED_PY = condition("ci_cleanup.schedule_bulk_delete_job_artifacts", "expired", pyformat=True)


def enable_bulk_delete(conn: Connection, client: redis.Redis) -> None:
    """The feature flag on, and the buckets scheduled as the job's scheduler leaves them."""
    if not conn.scalar(text("SELECT 1 FROM feature_gates WHERE feature_key = :k"), {"k": bulk_delete.FEATURE_FLAG}):
        stamp = dict(created_at=naive_utc(utc_now()), updated_at=naive_utc(utc_now()))
        conn.execute(insert(S.features).values(key=bulk_delete.FEATURE_FLAG, **stamp))
        conn.execute(insert(S.feature_gates).values(
            feature_key=bulk_delete.FEATURE_FLAG, key="boolean", value="true", **stamp
        ))
    artifact_buckets.schedule(client, bulk_delete.MAX_BUCKETS, utc_now())


def _cases(conn: Connection, client: redis.Redis, before: dict[str, int]) -> None:
    enable_bulk_delete(conn, client)


def artifacts_job(engine, client, on_batch):
    with engine.begin() as conn:
        enable_bulk_delete(conn, client)
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
        total += loop(engine, on_batch, lambda conn, params=params: conn.scalar(sql, {**params, "now": utc_now()}))
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
    return per_row(engine, page, {"now": now}, destroy)


# -- schedule_bulk_delete_job_artifacts: per bucket, the flags read by the batch itself, the worker's (expire_at)
# cursor on GitLab's expire_at index, the MOD bucket as a CASE (as the job writes it), ci_deleted_objects for
# every row with a file (its final path, else GitLab's hashed path).

FLAGS = """WITH flags AS (
  SELECT coalesce(bool_or(feature_key = 'bulk_delete_job_artifacts'), false) AS enabled,
         CASE WHEN bool_or(feature_key = 'bulk_delete_job_artifacts_high_concurrency') THEN 10 ELSE 5 END AS max_buckets
  FROM feature_gates
  WHERE feature_key IN ('bulk_delete_job_artifacts', 'bulk_delete_job_artifacts_high_concurrency')
    AND key = 'boolean' AND value = 'true')"""

ARTIFACTS = FLAGS + f""",
deleted AS (
  DELETE FROM p_ci_job_artifacts WHERE id = ANY(ARRAY(
    SELECT id FROM p_ci_job_artifacts
    WHERE {EXPIRED_PY}
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


# Its entries in the benchmark's per-job tables (ci_cleanup_dev.batches).
RUNNERS = (artifacts_job, artifacts_raw, artifacts_per_row)
FLOOR = artifacts_floor
# The tables whose candidate rows (id > the id before the candidates were added) the job may change, where the
# release has them.
SCOPED = ("p_ci_job_artifacts",)
CASES = _cases  # what its launched runs need beyond their candidates: the flag on
