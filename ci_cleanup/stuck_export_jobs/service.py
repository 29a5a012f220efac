"""Seed 002, ``StuckExportJobsWorker``: fail project exports whose Sidekiq job is gone.

The rule, without Dagster: page through queued and started export jobs by id, ask Sidekiq's Redis
in one MGET per chunk which of their jids are completed (status key absent), re-read those rows
(a job may have finished or been re-enqueued meanwhile), spare parallel exports still inside
their 6-hour grace, and fail the rest one row per transaction (the seed: record-level transactions).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import redis
from sqlalchemy import BigInteger, Select, String, and_, bindparam, exists, func, select, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection, Engine, Row
from sqlalchemy.exc import DBAPIError

from ..gitlab import sidekiq_status
from ..gitlab.schema import EXPORT_FAILED, EXPORT_QUEUED, EXPORT_STARTED, GitLabSchema, utc_now

CHUNK_SIZE = 1000
# GitLab's StuckExportJobsWorker::EXPORT_JOBS_EXPIRATION: a parallel export (one with relation
# exports) may legitimately outlive its enqueuing job for this long.
EXPORT_JOBS_EXPIRATION = dt.timedelta(hours=6)
ENQUEUED = (EXPORT_QUEUED, EXPORT_STARTED)  # ProjectExportJob.with_status([:started, :queued])


@dataclass
class StuckChunk:
    """One chunk of enqueued export jobs, sorted by what the rule decides for them."""

    candidates: int = 0
    last_id: int = 0
    stuck: list[Row] = field(default_factory=list)  # (id, jid): to be failed
    running: int = 0  # status key present: Sidekiq still has the job
    left_meanwhile: list[int] = field(default_factory=list)  # no longer queued/started when re-read
    reenqueued: list[int] = field(default_factory=list)  # jid changed since the first read
    parallel_in_grace: list[int] = field(default_factory=list)  # has relation exports, younger than 6 h


@dataclass
class FailOutcome:
    failed: list[Row] = field(default_factory=list)  # (id, jid)
    changed_meanwhile: list[int] = field(default_factory=list)  # finished or re-enqueued before the update
    errors: list[tuple[int, str]] = field(default_factory=list)  # (id, the error)


@dataclass
class StuckResult:
    """The run's totals; counts are exact, id lists keep the first ``max_ids``."""

    max_ids: int = 1000
    chunks: int = 0
    candidates: int = 0
    stuck: int = 0  # failed, or in a dry run would be failed
    running: int = 0
    changed_meanwhile: int = 0
    reenqueued: int = 0
    parallel_in_grace: int = 0
    errors_count: int = 0
    stuck_ids: list[int] = field(default_factory=list)
    stuck_jids: list[str] = field(default_factory=list)
    errors: list[tuple[int, str]] = field(default_factory=list)

    def add(self, chunk: StuckChunk, outcome: FailOutcome | None) -> None:
        """Add a chunk; ``outcome`` is None in a dry run, where every stuck job counts as would-be failed."""
        self.chunks += 1
        self.candidates += chunk.candidates
        self.running += chunk.running
        self.reenqueued += len(chunk.reenqueued)
        self.parallel_in_grace += len(chunk.parallel_in_grace)
        self.changed_meanwhile += len(chunk.left_meanwhile)
        stuck = chunk.stuck if outcome is None else outcome.failed
        if outcome is not None:
            self.changed_meanwhile += len(outcome.changed_meanwhile)
            self.errors_count += len(outcome.errors)
            self.errors += outcome.errors[: self.max_ids - len(self.errors)]
        self.stuck += len(stuck)
        room = self.max_ids - len(self.stuck_ids)
        self.stuck_ids += [job.id for job in stuck[:room]]
        self.stuck_jids += [job.jid for job in stuck[:room]]


def enqueued_exports_query(schema: GitLabSchema, after_id: int, limit: int) -> Select:
    """``status IN (0, 1) AND id > :after_id ORDER BY id LIMIT :limit``: a keyset page on the partial id index."""
    j = schema.project_export_jobs
    return select(j.c.id, j.c.jid).where(j.c.status.in_(ENQUEUED), j.c.id > after_id).order_by(j.c.id).limit(limit)


def enqueued_exports(conn: Connection, schema: GitLabSchema, after_id: int, limit: int) -> list[Row]:
    return conn.execute(enqueued_exports_query(schema, after_id, limit)).all()


def count_enqueued(conn: Connection, schema: GitLabSchema) -> int:
    j = schema.project_export_jobs
    return conn.scalar(select(func.count()).select_from(j).where(j.c.status.in_(ENQUEUED)))


def find_stuck(
    conn: Connection, schema: GitLabSchema, queues: redis.Redis, candidates: list[Row], grace_cutoff: dt.datetime
) -> StuckChunk:
    """Ask Sidekiq about one chunk (one MGET), then re-read the completed ones and apply the seed's checks."""
    chunk = StuckChunk(candidates=len(candidates), last_id=candidates[-1].id if candidates else 0)
    completed_jids = sidekiq_status.completed_jids(queues, [job.jid for job in candidates])
    completed = {job.id: job.jid for job in candidates if job.jid in completed_jids}
    chunk.running = len(candidates) - len(completed)
    if not completed:
        return chunk

    j, r = schema.project_export_jobs, schema.project_relation_exports
    # Read again: a job may have moved from started to finished while we asked Redis.
    reread = conn.execute(
        select(
            j.c.id, j.c.jid, j.c.created_at,
            exists().where(r.c.project_export_job_id == j.c.id).label("parallel"),
        )
        .where(j.c.id.in_(list(completed)), j.c.status.in_(ENQUEUED))
        .order_by(j.c.id)
    ).all()
    chunk.left_meanwhile = sorted(set(completed) - {job.id for job in reread})
    for job in reread:
        if job.jid != completed[job.id]:
            chunk.reenqueued.append(job.id)  # a new Sidekiq job owns the export now
        elif job.parallel and job.created_at > grace_cutoff:
            chunk.parallel_in_grace.append(job.id)
        else:
            chunk.stuck.append(job)
    return chunk


def fail_export_job(engine: Engine, schema: GitLabSchema, job_id: int, jid: str, now: dt.datetime) -> bool:
    """GitLab's ``fail_op``, in its own transaction, only if the job is still enqueued under the jid we checked."""
    j = schema.project_export_jobs
    with engine.begin() as conn:
        failed = conn.execute(
            update(j)
            .where(and_(j.c.id == job_id, j.c.status.in_(ENQUEUED), j.c.jid == jid))
            .values(status=EXPORT_FAILED, updated_at=now)
            .returning(j.c.id)
        ).first()
    return failed is not None


def fail_stuck_statement(schema: GitLabSchema, stuck: list[Row], now: dt.datetime):
    """One guarded UPDATE for a chunk: each job failed only if still enqueued under the jid we checked."""
    j = schema.project_export_jobs
    # The (id, jid) pairs checked, as two array parameters (a literal list of pairs is slow to plan).
    checked = func.unnest(
        bindparam("ids", [job.id for job in stuck], type_=ARRAY(BigInteger)), bindparam("jids", [job.jid for job in stuck], type_=ARRAY(String))
    ).table_valued("id", "jid").render_derived(name="checked")
    return (
        update(j)
        .where(j.c.id == checked.c.id, j.c.jid == checked.c.jid)
        .where(j.c.status.in_(ENQUEUED))
        .values(status=EXPORT_FAILED, updated_at=now)
        .returning(j.c.id)
    )


def fail_stuck(
    engine: Engine, schema: GitLabSchema, stuck: list[Row], now: dt.datetime,
    report_error: Callable[[int, BaseException], None] = lambda job_id, error: None,
) -> FailOutcome:
    """Fail the chunk's stuck jobs in one statement; if the database refuses it, fail each alone.

    Each row ends as the seed's record-level transactions leave it: the chunk's statement is all or
    nothing, and when it fails (a bad row) every job is retried in its own transaction, the bad one
    reported and the others failed (the seed's RecordInvalid case). One statement instead of one
    transaction per row is what keeps a chunk of 1000 within reach of plain SQL.
    """
    if not stuck:
        return FailOutcome()
    try:
        with engine.begin() as conn:
            failed_ids = set(conn.scalars(fail_stuck_statement(schema, stuck, now)))
    except DBAPIError as e:
        if e.connection_invalidated:
            raise
        return fail_stuck_one_by_one(engine, schema, stuck, now, report_error)
    return FailOutcome(
        failed=[job for job in stuck if job.id in failed_ids],
        changed_meanwhile=[job.id for job in stuck if job.id not in failed_ids],
    )


def fail_stuck_one_by_one(
    engine: Engine, schema: GitLabSchema, stuck: list[Row], now: dt.datetime,
    report_error: Callable[[int, BaseException], None],
) -> FailOutcome:
    """Fail each stuck job alone; a row that errors is reported and the others go on (the seed's RecordInvalid case)."""
    outcome = FailOutcome()
    for job in stuck:
        try:
            failed = fail_export_job(engine, schema, job.id, job.jid, now)
        except DBAPIError as e:
            if e.connection_invalidated:
                raise
            report_error(job.id, e)
            outcome.errors.append((job.id, str(getattr(e, "orig", e)).strip().splitlines()[0]))
            continue
        if failed:
            outcome.failed.append(job)
        else:
            outcome.changed_meanwhile.append(job.id)
    return outcome


def stuck_chunks(
    engine: Engine, schema: GitLabSchema, queues: redis.Redis, *, chunk_size: int, grace_cutoff: dt.datetime
) -> Iterator[StuckChunk]:
    """Every enqueued export job, ``chunk_size`` at a time by id, so a million queued rows never load at once."""
    after_id = 0
    while True:
        with engine.connect() as conn:
            candidates = enqueued_exports(conn, schema, after_id, chunk_size)
            if not candidates:
                return
            chunk = find_stuck(conn, schema, queues, candidates, grace_cutoff)
        after_id = chunk.last_id
        yield chunk


def mark_stuck_jobs_as_failed(
    engine: Engine,
    schema: GitLabSchema,
    queues: redis.Redis,
    *,
    grace_cutoff: dt.datetime,
    chunk_size: int = CHUNK_SIZE,
    dry_run: bool = False,
    max_ids: int = 1000,
    on_chunk: Callable[[StuckChunk, FailOutcome | None], None] = lambda chunk, outcome: None,
    report_error: Callable[[int, BaseException], None] = lambda job_id, error: None,
    now: Callable[[], dt.datetime] = utc_now,
) -> StuckResult:
    """The worker's ``mark_stuck_jobs_as_failed!`` over all chunks; in a dry run, find the stuck jobs and write nothing."""
    result = StuckResult(max_ids=max_ids)
    for chunk in stuck_chunks(engine, schema, queues, chunk_size=chunk_size, grace_cutoff=grace_cutoff):
        outcome = None if dry_run else fail_stuck(engine, schema, chunk.stuck, now(), report_error)
        result.add(chunk, outcome)
        on_chunk(chunk, outcome)
    return result
