"""``Ci::ScheduleBulkDeleteJobArtifactCronWorker`` and its ``Ci::BulkDeleteExpiredJobArtifactsWorker``.

The rule, without Dagster: the scheduler reads the feature flags (``read_flags.sql``) and keeps the Redis buckets
whole (:mod:`ci_cleanup.gitlab.artifact_buckets`); each bucket worker claims a bucket and deletes that bucket's
expired artifacts 100 at a time, each batch one statement (``delete_expired_batch.sql``) that also records the
stored files in ``ci_deleted_objects`` for :mod:`.files` to remove.
"""

from __future__ import annotations

import datetime as dt
from contextlib import ExitStack
from dataclasses import dataclass

import redis
from sqlalchemy.engine import Connection, Engine

from ..gitlab import artifact_buckets
from ..gitlab.batching import autocommit
from ..gitlab.loop_helpers import NO_HOOKS, Hooks, loop_until
from ..gitlab.schema import GitLabSchema
from ..gitlab.sql_files import SqlFile

FEATURE_FLAG = "bulk_delete_job_artifacts"
HIGH_CONCURRENCY_FLAG = "bulk_delete_job_artifacts_high_concurrency"
MAX_BUCKETS = 5  # max_running_jobs_limit
MAX_BUCKETS_HIGH_CONCURRENCY = 10
BATCH_SIZE = 100  # BulkDeleteExpiredJobArtifactsWorker::BATCH_SIZE
MAX_BATCHES = 500  # BulkDeleteExpiredJobArtifactsWorker::LOOP_LIMIT
MAX_RUNTIME = dt.timedelta(minutes=5)  # BulkDeleteExpiredJobArtifactsWorker::LOOP_TIMEOUT
# A worker's cursor (the last expire_at it deleted) before its first batch: before any expire_at, '-infinity' and BC
# dates included. The cursor stays PostgreSQL's text of the timestamp, never a Python datetime: those stop at year 1,
# and a year-1 expire_at read in a session west of UTC is "year -1"; the text goes back into the next batch exactly.
START = "-infinity"
# ci_deleted_objects.pick_up_at = expire_at, but never more than a day back nor an hour ahead.
PICK_UP_AT_EARLIEST = dt.timedelta(days=1)
PICK_UP_AT_LATEST = dt.timedelta(hours=1)

READ_FLAGS = SqlFile(__package__, "read_flags.sql")
WOULD_DELETE = SqlFile(__package__, "would_delete_in_bucket.sql")
# A batch on one database reads the flags itself; decomposed, they are read in main and bound.
BATCH = SqlFile(__package__, "delete_expired_batch.sql")
BATCH_FLAGS_FROM_MAIN = SqlFile(__package__, "delete_expired_batch_flags_from_main.sql")


@dataclass(frozen=True)
class Flags:
    enabled: bool
    max_buckets: int
    persisted: bool = False  # bulk_delete_job_artifacts is in features (Feature.persisted_name?)
    gated: bool = False  # it has a row in feature_gates


@dataclass(frozen=True)
class FlagRule:
    """What decides the flags beside their gates (:mod:`ci_cleanup.gitlab.feature_flags`), bound to the statements."""

    on_for_ci_cleanup: bool = False  # the operator turned bulk_delete_job_artifacts on for ci_cleanup alone
    enabled_by_default: bool = False  # default_enabled of bulk_delete_job_artifacts
    high_concurrency_by_default: bool = False  # default_enabled of bulk_delete_job_artifacts_high_concurrency

    def params(self) -> dict[str, bool]:
        return {"on_for_ci_cleanup": self.on_for_ci_cleanup, "enabled_by_default": self.enabled_by_default,
                "high_concurrency_by_default": self.high_concurrency_by_default}


def read_flags(conn: Connection, schema: GitLabSchema, rule: FlagRule = FlagRule()) -> Flags:
    """The cron worker's gate and ``max_running_jobs_limit``: 10 buckets with the high-concurrency flag, else 5."""
    enabled, max_buckets, persisted, gated = conn.execute(READ_FLAGS.on(schema, conn.dialect), rule.params()).one()
    return Flags(enabled=enabled, max_buckets=max_buckets, persisted=persisted, gated=gated)


def count_expired_by_bucket(
    conn: Connection, schema: GitLabSchema, now: dt.datetime, max_buckets: int, ids_limit: int
) -> dict[int, tuple[int, list[int]]]:
    """Dry run: per bucket, how many expired deletable artifacts there are and the first ``ids_limit`` ids."""
    statement = WOULD_DELETE.on(schema, conn.dialect)
    found = {}
    for bucket in range(max_buckets):
        params = {"now": now, "max_buckets": max_buckets, "bucket": bucket, "ids_limit": ids_limit}
        count, ids = conn.execute(statement, params).one()
        found[bucket] = (count, list(ids))
    return found


def pick_up_at_bounds(now: dt.datetime) -> dict:
    """The pick_up_at clamp, computed in Python: ``interval '1 day'`` would follow the session time zone's DST."""
    return {"earliest": now - PICK_UP_AT_EARLIEST, "latest": now + PICK_UP_AT_LATEST}


@dataclass(frozen=True)
class DeletedBatch:
    count: int  # artifacts deleted
    ids: list[int]  # their ids in order
    size: int  # bytes freed, the sum of the artifacts' ``size``
    deleted_objects: int
    last: str  # the cursor for the next batch: the last expire_at deleted, as PostgreSQL's text
    flags: Flags  # as the batch read them (it deleted nothing when they stop the worker)


def delete_batch(
    conn: Connection, schema: GitLabSchema, bucket: int, now: dt.datetime, batch_size: int, after: str = START,
    flags: Flags | None = None, rule: FlagRule = FlagRule(),
) -> DeletedBatch:
    """One statement: while the flags let the worker go on, delete up to ``batch_size`` expired artifacts of the
    bucket after the cursor ``after`` and record their files. ``flags``: as read in main when GitLab is decomposed;
    None: the statement reads them (by ``rule``).

    One statement is atomic, in the caller's transaction or, on an autocommit connection, in its own: a worker that
    dies mid-batch leaves the batch untouched.
    """
    params = {"bucket": bucket, "now": now, "limit": batch_size, "after": after, **pick_up_at_bounds(now)}
    if flags is None:
        statement = BATCH.on(schema, conn.dialect)
        params.update(rule.params())
    else:
        statement = BATCH_FLAGS_FROM_MAIN.on(schema, conn.dialect)
        params.update(enabled=flags.enabled, max_buckets=flags.max_buckets)
    last, count, ids, size, deleted_objects, enabled, max_buckets = conn.execute(statement, params).one()
    return DeletedBatch(
        count=count, ids=ids or [], size=size, deleted_objects=deleted_objects, last=last or after,
        flags=Flags(enabled=enabled, max_buckets=max_buckets),
    )


@dataclass(frozen=True)
class Limits:
    """A worker's run: ``loop_until(timeout: LOOP_TIMEOUT, limit: LOOP_LIMIT)`` of batches of ``batch_size``."""

    batch_size: int = BATCH_SIZE
    max_batches: int = MAX_BATCHES
    max_runtime: dt.timedelta = MAX_RUNTIME
    flag_rule: FlagRule = FlagRule()  # how each batch's flags are decided beside their gates


DEFAULT_LIMITS = Limits()  # GitLab's


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
    stopped: bool = False  # told to stop (``hooks.stop``: the run was terminated) before its work was done
    released: bool = False  # back to available (False: retired, or not claimed)

    def goes_on(self, flags: Flags) -> bool:
        """Whether the flags let the worker take another batch; if not, why it stops."""
        self.terminated_early_due_to_scale_down = self.mod_bucket >= flags.max_buckets
        self.stopped_by_feature_flag = not self.terminated_early_due_to_scale_down and not flags.enabled
        return not (self.terminated_early_due_to_scale_down or self.stopped_by_feature_flag)

    def add(self, batch: DeletedBatch) -> None:
        self.batches += 1
        self.destroyed_job_artifacts_count += batch.count
        self.size += batch.size
        self.deleted_objects += batch.deleted_objects


def run_bucket_worker(
    engine: Engine, client: redis.Redis, schema: GitLabSchema, limits: Limits = DEFAULT_LIMITS,
    hooks: Hooks = NO_HOOKS, *, bucket: int | None = None, flags_engine: Engine | None = None,
) -> WorkerResult:
    """``perform_work``: claim a bucket (``bucket``, or any free one), delete its expired artifacts batch after
    batch within ``limits`` or until ``hooks.stop`` is set, release it. ``hooks.on_batch`` gets the bucket and each
    batch that deleted.

    The flags are read again before each batch: by the batch's own statement, or from ``flags_engine`` when given
    (GitLab's main database, where ``feature_gates`` is, when the artifacts are in ci). There is no ``finally``
    release: a worker that raises keeps its bucket occupied until stale recovery, as GitLab's does, so a bucket is
    never handed out while a dead worker's transaction may linger.
    """
    result = WorkerResult(mod_bucket=artifact_buckets.claim(client, hooks.now(), bucket))
    if result.mod_bucket is None:
        return result
    with ExitStack() as connections:
        conn = connections.enter_context(autocommit(engine))
        flags_conn = None if flags_engine is None else connections.enter_context(autocommit(flags_engine))
        flags = _delete_batches(conn, flags_conn, schema, result, limits, hooks)
        flags = flags or read_flags(flags_conn or conn, schema, limits.flag_rule)  # none read yet: for the release
    result.released = artifact_buckets.release(client, result.mod_bucket, flags.max_buckets)
    return result


def _delete_batches(
    conn: Connection, flags_conn: Connection | None, schema: GitLabSchema, result: WorkerResult, limits: Limits,
    hooks: Hooks,
) -> Flags | None:
    """The worker's ``loop_until``; returns the flags last read (None: it stopped before reading any)."""
    flags, after = None, START

    def batch() -> bool:
        nonlocal flags, after
        result.stopped = hooks.stop is not None and hooks.stop.is_set()
        if result.stopped:
            return False
        if flags_conn is not None:
            flags = read_flags(flags_conn, schema, limits.flag_rule)
            if not result.goes_on(flags):
                return False
        size = hooks.batch_size(limits.batch_size)
        deleted = delete_batch(conn, schema, result.mod_bucket, hooks.now(), size, after,
                               None if flags_conn is None else flags, limits.flag_rule)
        flags = deleted.flags
        if not result.goes_on(flags):  # the batch read them and deleted nothing
            return False
        result.add(deleted)
        after = deleted.last
        hooks.on_batch(result.mod_bucket, deleted)
        result.artifacts_empty = deleted.count < size
        return not result.artifacts_empty

    loop_until(batch, timeout=limits.max_runtime.total_seconds(), limit=limits.max_batches, brake=hooks.brake,
               sleep=hooks.sleep)
    return flags
