"""``StuckExportJobsWorker``: fail project exports whose Sidekiq job is gone.

The rule, without Dagster: page through queued and started export jobs by id (``enqueued_page.sql``), ask
Sidekiq's Redis in one pipelined EXISTS per chunk which of their jids are completed (status key absent), and fail
those still queued or started under the same jid (a job may have finished or been re-enqueued meanwhile), sparing
parallel exports inside their 6-hour grace (``fail_stuck.sql``, one statement a chunk). A chunk the database
refuses is failed job by job, each in its own transaction, the job refused reported. A dry run re-reads the
completed jobs by the same rule (``reread_completed.sql``) and writes nothing.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import redis
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from ..gitlab import sidekiq_status
from ..gitlab.batching import autocommit, database_error, row_by_row_on_failure
from ..gitlab.loop_helpers import NO_HOOKS, Hooks, loop_until
from ..gitlab.schema import EXPORT_QUEUED, EXPORT_STARTED, GitLabSchema
from ..gitlab.sql_files import SqlFile

CHUNK_SIZE = 1000
# GitLab's StuckExportJobsWorker::EXPORT_JOBS_EXPIRATION: a parallel export (one with relation
# exports) may legitimately outlive its enqueuing job for this long.
EXPORT_JOBS_EXPIRATION = dt.timedelta(hours=6)
ENQUEUED = (EXPORT_QUEUED, EXPORT_STARTED)  # ProjectExportJob.with_status([:started, :queued])

COUNT_ENQUEUED = SqlFile(__package__, "count_enqueued.sql")
ENQUEUED_PAGE = SqlFile(__package__, "enqueued_page.sql")
ENQUEUED_PAGE_WALKED = SqlFile(__package__, "enqueued_page_walked.sql")
REREAD_COMPLETED = SqlFile(__package__, "reread_completed.sql")
FAIL_STUCK = SqlFile(__package__, "fail_stuck.sql")

# The pages walk the primary key (``enqueued_page_walked.sql``) when at least one id in this many, from the first
# enqueued job's to the last's, is enqueued: a page then reads at most this many rows per job it returns.
WALK_DENSITY = 4


class Export(NamedTuple):
    """An enqueued export job as a chunk carries it."""

    id: int
    jid: str | None


@dataclass
class StuckChunk:
    """One chunk of enqueued export jobs, sorted by what the rule decides for them."""

    candidates: int = 0
    last_id: int = 0
    stuck: list[Export] = field(default_factory=list)  # (id, jid): to be failed
    running: int = 0  # status key present: Sidekiq still has the job
    left_meanwhile: list[int] = field(default_factory=list)  # no longer queued/started when re-read
    reenqueued: list[int] = field(default_factory=list)  # jid changed since the first read
    parallel_in_grace: list[int] = field(default_factory=list)  # has relation exports, younger than 6 h


@dataclass
class FailOutcome:
    failed: list[Export] = field(default_factory=list)  # (id, jid)
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


class Enqueued(NamedTuple):
    count: int
    first_id: int | None  # the oldest enqueued job's id; None: none enqueued
    last_id: int | None = None

    @property
    def dense(self) -> bool:
        """Enqueued jobs are at least one id in :data:`WALK_DENSITY` between the first and the last (a backlog)."""
        return bool(self.count) and self.count * WALK_DENSITY >= self.last_id - self.first_id + 1


def count_enqueued(conn: Connection, schema: GitLabSchema) -> Enqueued:
    """How many export jobs are queued or started, the first one's id and the last's (``count_enqueued.sql``)."""
    return Enqueued(*conn.execute(COUNT_ENQUEUED.on(schema, conn.dialect)).one())


def enqueued_exports(
    conn: Connection, schema: GitLabSchema, after_id: int, limit: int, *, walk: bool = False
) -> list[Export]:
    """The next page of candidates after ``after_id``; ``walk``: along the primary key (a dense backlog)."""
    page = ENQUEUED_PAGE_WALKED if walk else ENQUEUED_PAGE
    return [Export(*row) for row in conn.execute(page.on(schema, conn.dialect), {"after_id": after_id, "limit": limit})]


def ask_sidekiq(queues: redis.Redis, candidates: list[Export]) -> tuple[StuckChunk, list[Export]]:
    """One pipelined EXISTS for the chunk: its counts so far, and the candidates whose Sidekiq job is completed."""
    completed_jids = sidekiq_status.completed_jids(queues, [job.jid for job in candidates])
    completed = [job for job in candidates if job.jid in completed_jids]
    chunk = StuckChunk(candidates=len(candidates), last_id=candidates[-1].id, running=len(candidates) - len(completed))
    return chunk, completed


def completed_params(completed: Sequence[Export], grace_cutoff: dt.datetime) -> dict:
    """The re-read's and the fail statement's parameters for these ``(id, jid)`` pairs."""
    return {"ids": [job.id for job in completed], "jids": [job.jid for job in completed], "grace_cutoff": grace_cutoff}


def _sort(chunk: StuckChunk, outcomes: Iterable[tuple[Export, str]]) -> None:
    """Each job into ``chunk``'s list for its outcome (``reread_completed.sql``)."""
    not_stuck = dict(left=chunk.left_meanwhile, reenqueued=chunk.reenqueued, parallel_in_grace=chunk.parallel_in_grace)
    for job, outcome in outcomes:
        if outcome == "stuck":
            chunk.stuck.append(job)
        else:
            not_stuck[outcome].append(job.id)


def classify(
    conn: Connection, schema: GitLabSchema, chunk: StuckChunk, jobs: list[Export], grace_cutoff: dt.datetime
) -> None:
    """Read-only: re-read completed jobs and sort them into ``chunk`` (dry run, refused chunk, jobs changed while
    the update waited for them)."""
    if jobs:
        rows = conn.execute(REREAD_COMPLETED.on(schema, conn.dialect), completed_params(jobs, grace_cutoff))
        _sort(chunk, ((Export(row.id, row.jid), row.outcome) for row in rows))


def find_stuck(
    conn: Connection, schema: GitLabSchema, queues: redis.Redis, candidates: list[Export], grace_cutoff: dt.datetime
) -> StuckChunk:
    """Ask Sidekiq about one chunk (one EXISTS pipeline), re-read the completed jobs, apply the checks; no writes."""
    chunk, completed = ask_sidekiq(queues, candidates)
    classify(conn, schema, chunk, completed, grace_cutoff)
    return chunk


def fail(
    conn: Connection, schema: GitLabSchema, jobs: Sequence[Export], grace_cutoff: dt.datetime, now: dt.datetime
) -> dict[int, str]:
    """``fail_stuck.sql`` for these jobs, its own transaction: each job's outcome, ``failed`` or the re-read's."""
    params = {**completed_params(jobs, grace_cutoff), "now": now}
    return dict(conn.execute(FAIL_STUCK.on(schema, conn.dialect), params).all())


def fail_completed(
    conn: Connection, schema: GitLabSchema, chunk: StuckChunk, completed: list[Export], grace_cutoff: dt.datetime,
    now: dt.datetime,
) -> FailOutcome:
    """Fail the chunk's completed jobs in one statement, which says why it spared the others.

    A job the statement's snapshot called stuck but the update did not fail was changed while the update waited for
    it: only those are re-read; one still stuck then was changed and changed back (changed meanwhile).
    """
    if not completed:
        return FailOutcome()
    outcomes = fail(conn, schema, completed, grace_cutoff, now)
    outcome = FailOutcome(failed=[job for job in completed if outcomes[job.id] == "failed"])
    _sort(chunk, ((job, outcomes[job.id]) for job in completed if outcomes[job.id] not in ("failed", "stuck")))
    classify(conn, schema, chunk, [job for job in completed if outcomes[job.id] == "stuck"], grace_cutoff)
    outcome.changed_meanwhile = [job.id for job in chunk.stuck]
    chunk.stuck = outcome.failed + chunk.stuck
    return outcome


def fail_chunk(
    conn: Connection, schema: GitLabSchema, chunk: StuckChunk, completed: list[Export], grace_cutoff: dt.datetime,
    now: dt.datetime, report_error: Callable[[int, BaseException], None],
) -> FailOutcome:
    """The chunk's statement; if the database refuses it (a bad row), the jobs the re-read calls stuck each failed
    alone, as the worker's record-level transactions leave them: the bad one reported, the others failed."""
    outcome = FailOutcome()

    def alone() -> list[Export]:
        classify(conn, schema, chunk, completed, grace_cutoff)
        return chunk.stuck

    def fail_one(job: Export) -> None:
        if fail(conn, schema, [job], grace_cutoff, now)[job.id] == "failed":
            outcome.failed.append(job)
        else:
            outcome.changed_meanwhile.append(job.id)

    def failed(job: Export, error: DBAPIError) -> None:
        report_error(job.id, error)
        outcome.errors.append((job.id, database_error(error)))

    def whole_chunk() -> None:
        done = fail_completed(conn, schema, chunk, completed, grace_cutoff, now)
        outcome.failed, outcome.changed_meanwhile = done.failed, done.changed_meanwhile

    row_by_row_on_failure(whole_chunk, alone, fail_one, failed)
    return outcome


@dataclass(frozen=True)
class Limits:
    """The cut-off, and which enqueued jobs a run reads, ``chunk_size`` at a time: from ``first_id``
    (:func:`count_enqueued`'s; a job enqueued since has a higher id), else from the first id; ``walk``: along the
    primary key (:attr:`Enqueued.dense`). ``max_ids``: the ids a result keeps of each kind."""

    grace_cutoff: dt.datetime  # a parallel export created after it is spared (EXPORT_JOBS_EXPIRATION ago)
    chunk_size: int = CHUNK_SIZE
    first_id: int | None = None
    walk: bool = False
    max_ids: int = 1000


def mark_stuck_jobs_as_failed(
    engine: Engine, schema: GitLabSchema, queues: redis.Redis, limits: Limits, hooks: Hooks = NO_HOOKS
) -> StuckResult:
    """The worker's ``mark_stuck_jobs_as_failed!``, a chunk at a time by id (a million queued rows never load at
    once), on one autocommit connection: each statement its own transaction, none open while Redis is asked.
    ``hooks.on_batch`` gets each chunk and what failing it did."""
    return _chunks(engine, schema, queues, limits, hooks, dry_run=False)


def find_stuck_jobs(engine: Engine, schema: GitLabSchema, queues: redis.Redis, limits: Limits) -> StuckResult:
    """A dry run: the same chunks and questions, every job sorted as a run would, nothing written."""
    return _chunks(engine, schema, queues, limits, NO_HOOKS, dry_run=True)


def _chunks(
    engine: Engine, schema: GitLabSchema, queues: redis.Redis, limits: Limits, hooks: Hooks, dry_run: bool
) -> StuckResult:
    result = StuckResult(max_ids=limits.max_ids)
    after_id = (limits.first_id or 1) - 1
    with autocommit(engine) as conn:

        def next_chunk() -> bool:
            nonlocal after_id
            candidates = enqueued_exports(conn, schema, after_id, hooks.batch_size(limits.chunk_size), walk=limits.walk)
            if not candidates:
                return False
            chunk, completed = ask_sidekiq(queues, candidates)
            after_id = chunk.last_id
            if dry_run:
                classify(conn, schema, chunk, completed, limits.grace_cutoff)
                outcome = None
            else:
                outcome = fail_chunk(
                    conn, schema, chunk, completed, limits.grace_cutoff, hooks.now(), hooks.report_error)
            result.add(chunk, outcome)
            hooks.on_batch(chunk, outcome)
            return True

        loop_until(next_chunk, brake=hooks.brake)
    return result
