"""Seed 004, ``Ci::ScheduleBulkDeleteJobArtifactCronWorker`` and its ``Ci::BulkDeleteExpiredJobArtifactsWorker``.

The rule, without Dagster: the scheduler reads the feature flags and keeps the Redis buckets whole
(:mod:`ci_cleanup.gitlab.artifact_buckets`); each bucket worker claims a bucket and deletes that
bucket's expired artifacts 100 at a time, each batch one transaction that also records the stored
files in ``ci_deleted_objects`` (GitLab's ``Ci::DeletedObject.bulk_import``) for later removal.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
from sqlalchemy import ColumnElement, Integer, Select, and_, bindparam, or_, delete, func, insert, select
from sqlalchemy.engine import Connection, Engine, Row

from ..gitlab import artifact_buckets
from ..gitlab.feature_flags import feature_enabled
from ..gitlab.schema import ARTIFACT_TRACE, ARTIFACT_UNLOCKED, TIMESTAMPTZ, GitLabSchema, utc_now

FEATURE_FLAG = "bulk_delete_job_artifacts"
HIGH_CONCURRENCY_FLAG = "bulk_delete_job_artifacts_high_concurrency"
MAX_BUCKETS = 5
MAX_BUCKETS_HIGH_CONCURRENCY = 10
BATCH_SIZE = 100
MAX_BATCHES = 500
MAX_RUNTIME = dt.timedelta(minutes=5)
# ci_deleted_objects.pick_up_at = expire_at, but never more than a day back nor an hour ahead.
PICK_UP_AT_EARLIEST = dt.timedelta(days=1)
PICK_UP_AT_LATEST = dt.timedelta(hours=1)


@dataclass(frozen=True)
class Flags:
    enabled: bool
    max_buckets: int


def read_flags(conn: Connection, schema: GitLabSchema) -> Flags:
    """The seed's gate and ``max_running_jobs_limit``: 10 buckets with the high-concurrency flag, else 5.

    Both flags in one query (as :func:`feature_enabled` reads each: the boolean gate set to true):
    the bucket workers read them before every batch.
    """
    on = set(conn.scalars(_flags_query(schema)))
    return Flags(
        enabled=FEATURE_FLAG in on,
        max_buckets=MAX_BUCKETS_HIGH_CONCURRENCY if HIGH_CONCURRENCY_FLAG in on else MAX_BUCKETS,
    )


@functools.lru_cache(maxsize=8)
def _flags_query(schema: GitLabSchema) -> Select:
    gates = schema.feature_gates
    return select(gates.c.feature_key).where(
        gates.c.feature_key.in_([FEATURE_FLAG, HIGH_CONCURRENCY_FLAG]), gates.c.key == "boolean", gates.c.value == "true"
    )


def expired_in_bucket(schema: GitLabSchema, now: dt.datetime, max_buckets: int, bucket: int) -> ColumnElement[bool]:
    """``expire_at < now AND file_type <> 3 AND locked = 0 AND MOD(project_id + job_id, max_buckets) = bucket``.

    Traces are never bulk-deleted; ``locked = 0`` (unlocked) leaves artifacts_locked (1) and unknown (2).
    The first three terms are the partial index ``index_ci_job_artifacts_on_expire_at_for_bulk_delete``.
    """
    a = schema.ci_job_artifacts
    return and_(
        a.c.expire_at < now,
        a.c.file_type != ARTIFACT_TRACE,
        a.c.locked == ARTIFACT_UNLOCKED,
        func.mod(a.c.project_id + a.c.job_id, max_buckets) == bucket,
        # A stored file's location needs created_at (GitLab's hashed path) unless file_final_path names it:
        # such a row is left for an admin rather than deleted with its file orphaned (GitLab raises on it).
        or_(a.c.file.is_(None), a.c.file_final_path.is_not(None), a.c.created_at.is_not(None)),
    )


def count_expired_by_bucket(conn: Connection, schema: GitLabSchema, now: dt.datetime, max_buckets: int, ids_limit: int) -> dict[int, tuple[int, list[int]]]:
    """Dry run: per bucket, how many expired deletable artifacts there are and the first ``ids_limit`` ids."""
    found = {}
    for bucket in range(max_buckets):
        condition = expired_in_bucket(schema, now, max_buckets, bucket)
        a = schema.ci_job_artifacts
        count = conn.scalar(select(func.count()).select_from(a).where(condition))
        first_ids = list(conn.scalars(select(a.c.id).where(condition).order_by(a.c.id).limit(ids_limit)))
        found[bucket] = (count, first_ids)
    return found


def hashed_store_dir(project_id: int, created_at: dt.datetime, job_id: int, artifact_id: int) -> str:
    """GitLab's ``JobArtifactUploader#hashed_path``: ``h[0:2]/h[2:4]/h/<created UTC YYYY_MM_DD>/<job_id>/<id>``."""
    h = hashlib.sha256(str(project_id).encode()).hexdigest()
    day = created_at.astimezone(dt.timezone.utc).strftime("%Y_%m_%d")
    return f"{h[0:2]}/{h[2:4]}/{h}/{day}/{job_id}/{artifact_id}"


def deleted_object(artifact: Row, now: dt.datetime) -> dict | None:
    """The ``ci_deleted_objects`` row for a deleted artifact (``Ci::JobArtifact#to_deleted_object_attrs``).

    None when the artifact names no stored file (GitLab's ``bulk_import`` skips those too).
    """
    if artifact.file_final_path:
        store_dir, file = posixpath.dirname(artifact.file_final_path), posixpath.basename(artifact.file_final_path)
    elif artifact.file and artifact.created_at is not None:
        store_dir, file = hashed_store_dir(artifact.project_id, artifact.created_at, artifact.job_id, artifact.id), artifact.file
    else:
        return None
    pick_up_at = min(max(artifact.expire_at, now - PICK_UP_AT_EARLIEST), now + PICK_UP_AT_LATEST)
    return dict(
        file_store=artifact.file_store if artifact.file_store is not None else 1,
        store_dir=store_dir, file=file, project_id=artifact.project_id, pick_up_at=pick_up_at,
    )


@dataclass
class DeletedBatch:
    ids: list[int]
    size: int  # bytes freed, the sum of the artifacts' ``size``
    deleted_objects: int


def expired_batch_query(schema: GitLabSchema, bucket: int, max_buckets: int, now: dt.datetime, batch_size: int) -> Select:
    """The bucket's next ``batch_size`` expired artifacts, locked for this worker (``FOR UPDATE SKIP LOCKED``)."""
    a = schema.ci_job_artifacts
    return (
        select(a.c.id).where(expired_in_bucket(schema, now, max_buckets, bucket))
        # Oldest first, through the partial expire_at index: without an order the planner reads the
        # table sequentially, past every row earlier batches and other buckets left (cost grows with the table).
        .order_by(a.c.expire_at, a.c.id)
        .limit(batch_size)
        .with_for_update(skip_locked=True)
    )


@functools.lru_cache(maxsize=8)
def _delete_batch_statement(schema: GitLabSchema):
    """The batch DELETE built once, bucket, bucket count, moment and size bound per batch."""
    a = schema.ci_job_artifacts
    picked = expired_batch_query(
        schema, bindparam("bucket", type_=Integer), bindparam("max_buckets", type_=Integer),
        bindparam("now", type_=TIMESTAMPTZ), bindparam("limit", type_=Integer),
    ).scalar_subquery()
    return delete(a).where(a.c.id.in_(picked)).returning(
        a.c.id, a.c.project_id, a.c.job_id, a.c.file, a.c.file_store, a.c.file_final_path,
        a.c.expire_at, a.c.created_at, a.c.size,
    )


def delete_batch(engine: Engine | Connection, schema: GitLabSchema, bucket: int, max_buckets: int, now: dt.datetime, batch_size: int) -> DeletedBatch:
    """One transaction: delete up to ``batch_size`` expired artifacts of the bucket and record their files.

    ``FOR UPDATE SKIP LOCKED`` keeps two workers (or a worker and a live GitLab) off the same rows.
    The transaction commits both or neither: a worker that dies mid-batch leaves the batch untouched.
    """
    if isinstance(engine, Engine):
        with engine.begin() as conn:
            return delete_batch(conn, schema, bucket, max_buckets, now, batch_size)
    conn = engine  # in the caller's transaction
    params = {"bucket": bucket, "max_buckets": max_buckets, "now": now, "limit": batch_size}
    deleted = conn.execute(_delete_batch_statement(schema), params).all()
    objects = [o for o in (deleted_object(row, now) for row in deleted) if o is not None]
    if objects:
        conn.execute(insert(schema.ci_deleted_objects), objects)
    return DeletedBatch(ids=sorted(row.id for row in deleted), size=sum(row.size or 0 for row in deleted), deleted_objects=len(objects))


@dataclass
class WorkerResult:
    """One bucket worker's run, with the seed's log fields."""

    mod_bucket: int | None = None  # None: no bucket was available
    destroyed_job_artifacts_count: int = 0
    size: int = 0
    deleted_objects: int = 0
    batches: int = 0
    artifacts_empty: bool = False  # the bucket had nothing left to delete
    terminated_early_due_to_scale_down: bool = False
    stopped_by_feature_flag: bool = False
    released: bool = False  # back to available (False: retired, or not claimed)


def run_bucket_worker(
    engine: Engine,
    client: redis.Redis,
    schema: GitLabSchema,
    *,
    bucket: int | None = None,
    batch_size: int = BATCH_SIZE,
    max_batches: int = MAX_BATCHES,
    max_runtime: dt.timedelta = MAX_RUNTIME,
    on_batch: Callable[[int, DeletedBatch], None] = lambda bucket, batch: None,
    now: Callable[[], dt.datetime] = utc_now,
) -> WorkerResult:
    """Claim a bucket (``bucket``, or any free one), delete its expired artifacts for at most ``max_batches`` batches or ``max_runtime``, release it.

    The flags are read again before each batch: the worker stops early when its bucket is no
    longer below ``max_buckets`` (a scale-down) or the feature is turned off. There is no
    ``finally`` release: a worker that crashes keeps its bucket occupied until stale recovery,
    as GitLab's does, so a bucket is never handed out while a dead worker's transaction may linger.
    """
    result = WorkerResult()
    bucket = artifact_buckets.claim(client, now(), bucket)
    if bucket is None:
        return result
    result.mod_bucket = bucket
    started = time.monotonic()
    conn = engine.connect()  # one connection per worker; each batch one transaction, the flags read in it
    try:
        while True:
            with conn.begin():
                flags = read_flags(conn, schema)
                if bucket >= flags.max_buckets:
                    result.terminated_early_due_to_scale_down = True
                    break
                if not flags.enabled:
                    result.stopped_by_feature_flag = True
                    break
                if result.batches >= max_batches or time.monotonic() - started >= max_runtime.total_seconds():
                    break
                batch = delete_batch(conn, schema, bucket, flags.max_buckets, now(), batch_size)
            result.batches += 1
            result.destroyed_job_artifacts_count += len(batch.ids)
            result.size += batch.size
            result.deleted_objects += batch.deleted_objects
            on_batch(bucket, batch)
            if len(batch.ids) < batch_size:
                result.artifacts_empty = True
                break
    finally:
        conn.close()
    result.released = artifact_buckets.release(client, bucket, flags.max_buckets)
    return result
