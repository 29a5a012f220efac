"""``Ci::ScheduleBulkDeleteJobArtifactCronWorker`` and its ``Ci::BulkDeleteExpiredJobArtifactsWorker``.

The rule, without Dagster: the scheduler reads the feature flags and keeps the Redis buckets whole
(:mod:`ci_cleanup.gitlab.artifact_buckets`); each bucket worker claims a bucket and deletes that
bucket's expired artifacts 100 at a time, each batch one statement (its own transaction) that also records the
stored files in ``ci_deleted_objects`` (GitLab's ``Ci::DeletedObject.bulk_import``) for later removal.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
from sqlalchemy import (
    BigInteger,
    Boolean,
    ColumnElement,
    FromClause,
    Integer,
    Numeric,
    Select,
    Text,
    and_,
    any_,
    bindparam,
    case,
    cast,
    delete,
    false,
    func,
    insert,
    null,
    or_,
    select,
    true,
)
from sqlalchemy.dialects.postgresql import aggregate_order_by, array
from sqlalchemy.engine import Connection, Engine

from ..gitlab import artifact_buckets
from ..gitlab.schema import (
    ARTIFACT_TRACE,
    ARTIFACT_UNLOCKED,
    FILE_STORE_LOCAL,
    TIMESTAMPTZ,
    GitLabSchema,
    driver_sql,
    execute_driver_sql,
    one_row,
    utc_now,
)

FEATURE_FLAG = "bulk_delete_job_artifacts"
HIGH_CONCURRENCY_FLAG = "bulk_delete_job_artifacts_high_concurrency"
MAX_BUCKETS = 5
MAX_BUCKETS_HIGH_CONCURRENCY = 10
BATCH_SIZE = 100
MAX_BATCHES = 500
MAX_RUNTIME = dt.timedelta(minutes=5)
# A worker's cursor (the last expire_at it deleted) before its first batch: before any expire_at, '-infinity' and BC
# dates included. The cursor stays PostgreSQL's text of the timestamp, never a Python datetime: those stop at year 1,
# and a year-1 expire_at read in a session west of UTC is "year -1"; the text goes back into the next batch exactly.
START = "-infinity"
# ci_deleted_objects.pick_up_at = expire_at, but never more than a day back nor an hour ahead.
PICK_UP_AT_EARLIEST = dt.timedelta(days=1)
PICK_UP_AT_LATEST = dt.timedelta(hours=1)


@dataclass(frozen=True)
class Flags:
    enabled: bool
    max_buckets: int


def read_flags(conn: Connection, schema: GitLabSchema) -> Flags:
    """The cron worker's gate and ``max_running_jobs_limit``: 10 buckets with the high-concurrency flag, else 5.

    The bucket workers read it again before each batch: as driver SQL compiled once
    (:func:`~ci_cleanup.gitlab.schema.driver_sql`; SQLAlchemy's cache key, built again for each execution, cost more
    than the rest of a worker's Python per batch).
    """
    enabled, max_buckets = execute_driver_sql(conn, flags_query(schema)).one()
    return Flags(enabled=enabled, max_buckets=max_buckets)


@functools.lru_cache(maxsize=8)
def flags_query(schema: GitLabSchema) -> Select:
    """Both flags in one row, each as :func:`ci_cleanup.gitlab.feature_flags.feature_enabled` reads it (the boolean
    gate set to true)."""
    gates = schema.feature_gates
    high_concurrency = func.bool_or(gates.c.feature_key == HIGH_CONCURRENCY_FLAG)
    return select(
        func.coalesce(func.bool_or(gates.c.feature_key == FEATURE_FLAG), false()).label("enabled"),
        case((high_concurrency, MAX_BUCKETS_HIGH_CONCURRENCY), else_=MAX_BUCKETS).label("max_buckets"),
    ).where(
        # An array, not an expanding IN, which would be rendered again for every batch.
        gates.c.feature_key == any_(array([FEATURE_FLAG, HIGH_CONCURRENCY_FLAG])),
        gates.c.key == "boolean", gates.c.value == "true",
    )


def expired_in_bucket(
    schema: GitLabSchema, now: dt.datetime, max_buckets: int | ColumnElement[int], bucket: int | ColumnElement[int]
) -> ColumnElement[bool]:
    """``expire_at < now AND file_type <> 3 AND locked = 0 AND MOD(project_id + job_id, max_buckets) = bucket``.

    Traces are never bulk-deleted; ``locked = 0`` (unlocked) leaves artifacts_locked (1) and unknown (2).
    The first three terms are GitLab's partial index ``p_ci_job_artifacts_expire_at_idx`` (expire_at).
    """
    a = schema.ci_job_artifacts
    return and_(
        a.c.expire_at < now,
        a.c.file_type != ARTIFACT_TRACE,
        a.c.locked == ARTIFACT_UNLOCKED,
        # Written as a CASE: PostgreSQL has no statistics on the MOD (GitLab has no index on it) and guesses
        # that 0.5 % of the rows match, not 1 in max_buckets; it then sorts the whole backlog past the cursor
        # instead of reading the expire_at index in order (45 ms vs 0.2 ms a batch at 1 M artifacts). A
        # boolean CASE is guessed at a third, close enough for the ordered index scan.
        # In numeric: a project_id + job_id past 2^63-1 (a bad row) would make bigint's + fail every batch.
        case((func.mod(cast(a.c.project_id, Numeric) + a.c.job_id, max_buckets) == bucket, true()), else_=false()),
    )


def count_expired_by_bucket(
    conn: Connection, schema: GitLabSchema, now: dt.datetime, max_buckets: int, ids_limit: int
) -> dict[int, tuple[int, list[int]]]:
    """Dry run: per bucket, how many expired deletable artifacts there are and the first ``ids_limit`` ids."""
    found = {}
    for bucket in range(max_buckets):
        condition = expired_in_bucket(schema, now, max_buckets, bucket)
        a = schema.ci_job_artifacts
        count = conn.scalar(select(func.count()).select_from(a).where(condition))
        first_ids = list(conn.scalars(select(a.c.id).where(condition).order_by(a.c.id).limit(ids_limit)))
        found[bucket] = (count, first_ids)
    return found


def deleted_objects_select(artifacts: FromClause) -> Select:
    """``Ci::JobArtifact#to_deleted_object_attrs``: the ``ci_deleted_objects`` rows for ``artifacts`` (the table,
    or the deleted rows).

    An artifact that names no stored file has none (GitLab's ``Ci::DeletedObject.bulk_import`` skips it).
    When ``file_final_path`` is set, ``store_dir`` is its dirname and ``file`` its basename; else GitLab's
    hashed path (``JobArtifactUploader#hashed_path``: ``h[0:2]/h[2:4]/h/<created UTC YYYY_MM_DD>/<job_id>/<id>``
    with ``h`` the sha256 of project_id) and ``file``.

    Bound parameters ``earliest`` and ``latest``: the pick_up_at clamp, computed in Python
    (``interval '1 day'`` would follow the session time zone's DST, a timedelta does not).
    The day of the hashed path is created_at's UTC day, whatever the session time zone.
    """
    a = artifacts.c
    final_path = func.nullif(a.file_final_path, "")  # an empty file_final_path is none (Rails' ``present?``)
    # posixpath.split: the head is everything up to the last "/", trailing slashes stripped unless it is all slashes.
    head = func.regexp_replace(final_path, "[^/]*$", "")
    dirname = case((head.regexp_match("^/*$"), head), else_=func.rtrim(head, "/"))
    basename = func.regexp_replace(final_path, "^.*/", "")
    digest = func.encode(func.sha256(func.convert_to(cast(a.project_id, Text), "UTF8")), "hex")
    day = func.to_char(func.timezone("UTC", a.created_at), "YYYY_MM_DD")
    hashed = func.concat_ws("/", func.substr(digest, 1, 2), func.substr(digest, 3, 2), digest, day, a.job_id, a.id)
    has_final_path = final_path.is_not(None)
    return select(
        func.coalesce(a.file_store, FILE_STORE_LOCAL).label("file_store"),
        case((has_final_path, dirname), else_=hashed).label("store_dir"),
        case((has_final_path, basename), else_=a.file).label("file"),
        a.project_id,
        func.least(
            func.greatest(a.expire_at, bindparam("earliest", type_=TIMESTAMPTZ)), bindparam("latest", type_=TIMESTAMPTZ)
        ).label("pick_up_at"),
    ).where(or_(has_final_path, and_(func.nullif(a.file, "").is_not(None), a.created_at.is_not(None))))


def pick_up_at_bounds(now: dt.datetime) -> dict:
    return {"earliest": now - PICK_UP_AT_EARLIEST, "latest": now + PICK_UP_AT_LATEST}


@dataclass
class DeletedBatch:
    count: int  # artifacts deleted
    ids: list[int] | None  # their ids in order; None: the batch was asked not to return them (``with_rows``)
    size: int  # bytes freed, the sum of the artifacts' ``size``
    deleted_objects: int
    last: str  # the cursor for the next batch: the last expire_at deleted, as PostgreSQL's text
    flags: Flags  # as the batch read them (it deleted nothing when they stop the worker)


def expired_batch_query(
    schema: GitLabSchema, bucket: int | ColumnElement[int], max_buckets: int | ColumnElement[int], now: dt.datetime,
    batch_size: int,
    after: str | ColumnElement = START,
) -> Select:
    """The bucket's next ``batch_size`` expired artifacts from ``after`` (the last expire_at deleted) on, locked for
    this worker (``FOR UPDATE SKIP LOCKED``).

    The worker's cursor: each batch starts where the last one ended instead of at the oldest expired
    artifact, so it does not read again past the rows of the other buckets (and the dead rows it
    left) before it: with a backlog of a million, a batch went from ~1 ms to ~1 s without it.
    """
    a = schema.ci_job_artifacts
    return (
        # GitLab's partial index is (expire_at) alone: ``expire_at >= cursor`` and ``ORDER BY expire_at`` read
        # it in order from the cursor on (no sort of the whole backlog). Rows at the cursor's own expire_at
        # are read again, and still deleted if they are still there.
        select(a.c.id).where(expired_in_bucket(schema, now, max_buckets, bucket), a.c.expire_at >= after)
        # Oldest first, through the partial expire_at index: without an order the planner reads the
        # table sequentially, past every row earlier batches and other buckets left (cost grows with the table).
        .order_by(a.c.expire_at)
        .limit(batch_size)
        .with_for_update(skip_locked=True)
    )


@functools.lru_cache(maxsize=8)
def batch_statement(schema: GitLabSchema, *, flags_read: bool = True, rows: bool = True) -> Select:
    """A whole batch in one statement, built once: read the flags, delete, record the files, report.

    ``WITH flags AS (<both flags>), deleted AS (DELETE … WHERE id = ANY(ARRAY(<expired in the bucket, FOR UPDATE
    SKIP LOCKED, while the flags let the worker go on>)) RETURNING …), recorded AS (INSERT INTO ci_deleted_objects
    SELECT … FROM deleted) SELECT <the last expire_at deleted>, count, ids, size, deleted_objects, <the flags>``.
    The worker reads the flags before each batch, as GitLab's does: here in the batch's own statement, which
    deletes nothing when the feature is off or the bucket is no longer below ``max_buckets`` (a round trip fewer a
    batch). Bound per batch: bucket, now, limit, the worker's cursor (after) and the pick_up_at bounds. Not
    ``flags_read``: the flags as bound (``enabled``, ``max_buckets``), read just before by :func:`read_flags` in
    GitLab's main database, where feature_gates is, when the artifacts are in ci. Not ``rows``: no ids (NULL), only
    their count: sorting and sending them cost PostgreSQL 0.04-0.05 ms a batch and the client a parse of the array,
    for a run that observes the first 100 of each observation.
    """
    a, d = schema.ci_job_artifacts, schema.ci_deleted_objects
    if flags_read:
        flags = flags_query(schema).cte("flags")
    else:
        flags = select(  # psycopg2 sends True as true: no SQLAlchemy conversion (driver_sql)
            cast(bindparam("enabled"), Boolean).label("enabled"),
            bindparam("max_buckets", type_=Integer).label("max_buckets"),
        ).cte("flags")
    enabled = select(flags.c.enabled).scalar_subquery()
    max_buckets = select(flags.c.max_buckets).scalar_subquery()
    bucket = bindparam("bucket", type_=Integer)
    after = bindparam("after", type_=TIMESTAMPTZ)
    picked = expired_batch_query(
        schema, bucket, max_buckets, bindparam("now", type_=TIMESTAMPTZ), bindparam("limit", type_=Integer), after,
    ).where(enabled, bucket < max_buckets)
    deleted = (
        delete(a).where(a.c.id == any_(func.array(picked.scalar_subquery())))
        .returning(
            a.c.id, a.c.project_id, a.c.job_id, a.c.file, a.c.file_store, a.c.file_final_path, a.c.expire_at,
            a.c.created_at, a.c.size,
        )
        .cte("deleted")
    )
    recorded = (
        insert(d)
        .from_select(["file_store", "store_dir", "file", "project_id", "pick_up_at"], deleted_objects_select(deleted))
        .returning(d.c.id)
        .cte("recorded")
    )
    ids = select(func.array_agg(aggregate_order_by(deleted.c.id, deleted.c.id))).scalar_subquery() if rows else null()
    return select(
        select(cast(func.max(deleted.c.expire_at), Text)).scalar_subquery().label("last"),
        select(func.count()).select_from(deleted).scalar_subquery().label("count"),
        ids.label("ids"),
        select(cast(func.coalesce(func.sum(deleted.c.size), 0), BigInteger)).scalar_subquery().label("size"),
        select(func.count()).select_from(recorded).scalar_subquery().label("deleted_objects"),
        enabled.label("enabled"), max_buckets.label("max_buckets"),
    )


def delete_batch(
    conn: Connection, schema: GitLabSchema, bucket: int, now: dt.datetime, batch_size: int, after: str = START,
    flags: Flags | None = None, with_rows: bool = True,
) -> DeletedBatch:
    """One statement: read the flags (``flags``: as read in main, when GitLab is decomposed), and while they let the
    worker go on, delete up to ``batch_size`` expired artifacts of the bucket and record their files. Their ids come
    back only ``with_rows``.

    ``FOR UPDATE SKIP LOCKED`` keeps two workers (or a worker and a live GitLab) off the same rows.
    One statement is atomic, in the caller's transaction or, on an autocommit connection, in its own: it
    deletes and records both or neither, and a worker that dies mid-batch leaves the batch untouched.
    """
    params = {
        "bucket": bucket, "now": now, "limit": batch_size, "after": after, **pick_up_at_bounds(now),
    }
    if flags is not None:
        params.update(enabled=flags.enabled, max_buckets=flags.max_buckets)
    statement, fixed = driver_sql(batch_statement(schema, flags_read=flags is None, rows=with_rows), conn.dialect)
    last, count, ids, size, deleted_objects, enabled, max_buckets = one_row(conn, statement, {**fixed, **params})
    return DeletedBatch(
        count=count, ids=(ids or []) if with_rows else None, size=size, deleted_objects=deleted_objects,
        last=last or after, flags=Flags(enabled=enabled, max_buckets=max_buckets),
    )


@dataclass
class WorkerResult:
    """One bucket worker's run, with the fields ``Ci::BulkDeleteExpiredJobArtifactsWorker`` logs."""

    mod_bucket: int | None = None  # None: no bucket was available
    destroyed_job_artifacts_count: int = 0
    size: int = 0
    deleted_objects: int = 0
    batches: int = 0
    artifacts_empty: bool = False  # the bucket had nothing left to delete
    terminated_early_due_to_scale_down: bool = False
    stopped_by_feature_flag: bool = False
    stopped: bool = False  # told to stop (``stop``: the run was terminated) before its work was done
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
    stop: threading.Event | None = None,
    flags_engine: Engine | None = None,
    with_rows: Callable[[], bool] = lambda: True,
) -> WorkerResult:
    """Claim a bucket (``bucket``, or any free one), delete its expired artifacts for at most ``max_batches``
    batches or ``max_runtime``, or until ``stop`` is set, release it. ``with_rows``, asked before each batch: whether
    ``on_batch`` wants the batch's ids (:func:`delete_batch`).

    The flags are read again before each batch: by the batch's own statement, or from ``flags_engine`` when given
    (GitLab's main database, where ``feature_gates`` is, when the artifacts are in ci): the worker stops early when
    its bucket is no longer below ``max_buckets`` (a scale-down) or the feature is turned off. Each batch starts after
    the last artifact the worker deleted (its cursor, see :func:`expired_batch_query`). There is no ``finally``
    release: a worker that crashes keeps its bucket occupied until stale recovery, as GitLab's does, so a
    bucket is never handed out while a dead worker's transaction may linger.
    """
    result = WorkerResult()
    bucket = artifact_buckets.claim(client, now(), bucket)
    if bucket is None:
        return result
    result.mod_bucket = bucket
    started, after = time.monotonic(), START

    def go_on(flags: Flags) -> bool:
        result.terminated_early_due_to_scale_down = bucket >= flags.max_buckets
        result.stopped_by_feature_flag = not result.terminated_early_due_to_scale_down and not flags.enabled
        return not (result.terminated_early_due_to_scale_down or result.stopped_by_feature_flag)

    # One connection per worker (and one to main for the flags), in autocommit: every statement here is one
    # batch or one read, and a single statement is its own transaction (all or nothing), so BEGIN and COMMIT
    # around it would only add two round trips (about a quarter of a worker's time at 100 k candidates).
    autocommit = {"isolation_level": "AUTOCOMMIT"}
    with contextlib.ExitStack() as connections:
        conn = connections.enter_context(engine.connect().execution_options(**autocommit))
        flags_conn = None if flags_engine is None else connections.enter_context(
            flags_engine.connect().execution_options(**autocommit))
        flags = None
        while True:
            if flags_conn is not None:
                flags = read_flags(flags_conn, schema)
                if not go_on(flags):
                    break
            result.stopped = stop is not None and stop.is_set()
            out_of_time = time.monotonic() - started >= max_runtime.total_seconds()
            if result.stopped or result.batches >= max_batches or out_of_time:
                flags = flags or read_flags(conn, schema)  # for the release: no batch read them yet
                break
            batch = delete_batch(conn, schema, bucket, now(), batch_size, after, None if flags_conn is None else flags,
                                 with_rows())
            flags = batch.flags
            if not go_on(flags):  # the batch read them and deleted nothing
                break
            result.batches, after = result.batches + 1, batch.last
            result.destroyed_job_artifacts_count += batch.count
            result.size += batch.size
            result.deleted_objects += batch.deleted_objects
            on_batch(bucket, batch)
            if batch.count < batch_size:
                result.artifacts_empty = True
                break
    result.released = artifact_buckets.release(client, bucket, flags.max_buckets)
    return result
