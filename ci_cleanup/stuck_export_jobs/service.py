"""``StuckExportJobsWorker``: fail project exports whose Sidekiq job is gone.

The rule, without Dagster: page through queued and started export jobs by id, ask Sidekiq's Redis
in one pipelined EXISTS per chunk which of their jids are completed (status key absent), and fail
those still queued or started under the same jid (a job may have finished or been re-enqueued
meanwhile), sparing parallel exports inside their 6-hour grace. The worker re-reads the rows, then
fails each in its own transaction; here the re-read's rule is written once (:func:`_checked_and_outcome`):
one UPDATE per chunk carries it, says why it spared the others and reads the next page (a chunk, one round trip
to the database and one to Redis), and a chunk the database refuses is failed job by job by the same UPDATE for one
job.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import redis
from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Integer,
    Select,
    String,
    and_,
    bindparam,
    case,
    func,
    literal_column,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import aggregate_order_by
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from ..gitlab import sidekiq_status
from ..gitlab.schema import (
    EXPORT_FAILED,
    EXPORT_QUEUED,
    EXPORT_STARTED,
    TIMESTAMPTZ,
    GitLabSchema,
    array_literal,
    array_param,
    driver_sql,
    one_row,
    utc_now,
)

CHUNK_SIZE = 1000
# GitLab's StuckExportJobsWorker::EXPORT_JOBS_EXPIRATION: a parallel export (one with relation
# exports) may legitimately outlive its enqueuing job for this long.
EXPORT_JOBS_EXPIRATION = dt.timedelta(hours=6)
ENQUEUED = (EXPORT_QUEUED, EXPORT_STARTED)  # ProjectExportJob.with_status([:started, :queued])


def is_enqueued(status: ColumnElement) -> ColumnElement[bool]:
    """``status IN (0, 1)``, the statuses written in the statement, as GitLab's SQL has them (a bound list would be
    expanded at each execution, which a statement compiled once as driver SQL cannot be)."""
    return status.in_([literal_column(str(value)) for value in ENQUEUED])


class Export(NamedTuple):
    """An enqueued export job as a chunk carries it. A plain tuple: a chunk reads each of its 1000 jobs' fields
    several times, and a SQLAlchemy Row's attribute costs about 0.5 µs, ten times a tuple's."""

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
    # The page after the chunk, read by the chunk's statement (:func:`fail_completed`); None: not read.
    next_page: list[Export] | None = None


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


def enqueued_exports_query(schema: GitLabSchema, after_id, limit, *, walk: bool = False) -> Select:
    """``status IN (0, 1) AND id > :after_id ORDER BY id LIMIT :limit``: a keyset page.

    ``walk`` (when the enqueued jobs are :attr:`Enqueued.dense`): ``(status + 0) IN (0, 1)``, so that GitLab's
    status index is left out and the page is the primary key walked from ``:after_id`` until ``:limit`` enqueued
    jobs are found. PostgreSQL takes the enqueued jobs to be spread over all ids, when a backlog is mostly the
    newest ids, and once the table's rows have moved by their updates it reads every enqueued job after the cursor
    through the status index and sorts them, for each page: 16.6 ms for a page halfway through the bench's 100 k
    enqueued jobs, 0.9 ms walking the key; a run's pages cost the square of its backlog. Walked, a run's pages
    read the ids from the first enqueued job to the last once.
    """
    j = schema.project_export_jobs
    status = j.c.status + literal_column("0") if walk else j.c.status
    return select(j.c.id, j.c.jid).where(is_enqueued(status), j.c.id > after_id).order_by(j.c.id).limit(limit)


class Page(NamedTuple):
    """The page to read: up to ``limit`` enqueued jobs after ``after_id`` (:func:`enqueued_exports_query`)."""

    after_id: int
    limit: int
    walk: bool = False

    def params(self) -> dict:
        return {"after_id": self.after_id, "limit": self.limit}


@functools.lru_cache(maxsize=8)
def _page_statement(schema: GitLabSchema, walk: bool) -> Select:
    """The page as one row of two arrays, its ids and its jids (1000 rows cost twice as much to fetch), so that it can
    ride in a chunk's fail statement (:func:`fail_and_page_statement`); built once, bound per chunk.

    Both arrays are aggregated from one read of the page, in the page's own order: PostgreSQL sorts nothing again.
    Two scalar subqueries of a page CTE read it twice, each sorting it (0.5 ms a chunk).
    """
    page = enqueued_exports_query(
        schema, bindparam("after_id", type_=BigInteger), bindparam("limit", type_=Integer), walk=walk
    ).subquery("page")
    return select(*(func.array_agg(aggregate_order_by(column, page.c.id)).label(column.name) for column in page.c))


# Export(id, jid) made in C from an (id, jid) pair: a NamedTuple's own __new__ is Python, 150 µs for a page of 1000.
_export = functools.partial(tuple.__new__, Export)


def _exports(ids, jids) -> list[Export]:
    return list(map(_export, zip(ids or (), jids or ())))


def enqueued_exports(
    conn: Connection, schema: GitLabSchema, after_id: int, limit: int, *, walk: bool = False
) -> list[Export]:
    return _exports(*conn.execute(_page_statement(schema, walk), {"after_id": after_id, "limit": limit}).one())


# The pages walk the primary key (:func:`enqueued_exports_query`) when at least one id in this many, from the first
# enqueued job's to the last's, is enqueued: a page then reads at most this many rows per job it returns.
WALK_DENSITY = 4


class Enqueued(NamedTuple):
    count: int
    first_id: int | None  # the oldest enqueued job's id; None: none enqueued
    last_id: int | None = None

    @property
    def dense(self) -> bool:
        """Enqueued jobs are at least one id in :data:`WALK_DENSITY` between the first and the last (a backlog)."""
        return bool(self.count) and self.count * WALK_DENSITY >= self.last_id - self.first_id + 1


def count_enqueued(conn: Connection, schema: GitLabSchema) -> Enqueued:
    """How many export jobs are queued or started, the first one's id and the last's, in one scan of GitLab's
    status index.

    The first page then starts at that id. From 0, PostgreSQL reads it on the primary key, through every
    finished export older than the first enqueued one (2.2 million rows, 0.3 s once per run, on the bench's table);
    ``min(id)`` alone would be planned the same way, beside ``count(*)`` it is not.
    """
    return Enqueued(*conn.execute(count_enqueued_query(schema)).one())


def count_enqueued_query(schema: GitLabSchema) -> Select:
    j = schema.project_export_jobs
    return select(func.count(), func.min(j.c.id), func.max(j.c.id)).where(is_enqueued(j.c.status))


def ask_sidekiq(queues: redis.Redis, candidates: list[Export]) -> tuple[StuckChunk, list[Export]]:
    """One pipelined EXISTS for the chunk: its counts so far, and the candidates whose Sidekiq job is completed."""
    completed_jids = sidekiq_status.completed_jids(queues, [job.jid for job in candidates])
    completed = [job for job in candidates if job.jid in completed_jids]
    chunk = StuckChunk(candidates=len(candidates), last_id=candidates[-1].id, running=len(candidates) - len(completed))
    return chunk, completed


def _checked_and_outcome(schema: GitLabSchema):
    """The ``(:ids, :jids)`` pairs checked with Sidekiq, and the rule: what the re-read decides for each job.

    ``left`` (no longer queued or started), ``reenqueued`` (another jid owns the export now),
    ``parallel_in_grace`` (it has relation exports and is younger than ``:grace_cutoff``), or ``stuck``
    (to be failed). The pairs are two array literals (see completed_params): a list of 1000 pairs costs
    more to send, compile and plan than to run.
    """
    j, r = schema.project_export_jobs, schema.project_relation_exports
    ids, jids = array_param("ids", BigInteger), array_param("jids", String)
    pairs = func.unnest(ids, jids).table_valued("id", "jid").render_derived(name="pairs")
    # A CTE, so that a statement reading the pairs twice (:func:`fail_statement`) sends and parses its 1000 jids once.
    checked = select(pairs.c.id, pairs.c.jid).cte("checked")
    # created_at first: PostgreSQL evaluates it before the subquery, which only a young job then needs. The subquery
    # is one index probe per young job, whatever project_relation_exports' statistics say: OFFSET 0 keeps PostgreSQL
    # from turning it into a hashed subplan, which reads the whole table for every chunk and which it chose when the
    # statistics said the table was empty (60,000 rows read per chunk in the benchmark's tables, 14 -> 28 ms).
    young = j.c.created_at > bindparam("grace_cutoff", type_=TIMESTAMPTZ)
    relation_exports = select(literal_column("1")).where(r.c.project_export_job_id == j.c.id)
    in_grace = and_(young, relation_exports.offset(literal_column("0")).exists())
    outcome = case(
        (or_(j.c.id.is_(None), ~is_enqueued(j.c.status)), "left"),
        (j.c.jid != checked.c.jid, "reenqueued"),
        (in_grace, "parallel_in_grace"),
        else_="stuck",
    )
    return checked, outcome


def _enqueued_by_id(j, checked) -> ColumnElement[bool]:
    # The status beside the id, though the rule checks it too: without it the planner expects every
    # job to match and reads the whole table (a hash join) instead of the checked ids by primary key.
    return and_(j.c.id == checked.c.id, is_enqueued(j.c.status))


@functools.lru_cache(maxsize=8)
def reread_statement(schema: GitLabSchema) -> Select:
    """The worker's re-read of the completed jobs: one ``outcome`` per ``(:ids, :jids)`` pair, writing nothing."""
    j = schema.project_export_jobs
    checked, outcome = _checked_and_outcome(schema)
    return (
        select(checked.c.id, checked.c.jid, outcome.label("outcome"))
        .select_from(checked.outerjoin(j, _enqueued_by_id(j, checked)))
        .order_by(checked.c.id)
    )


@functools.lru_cache(maxsize=8)
def fail_statement(schema: GitLabSchema) -> Select:
    """Fail every ``(:ids, :jids)`` pair the re-read would call stuck, in one guarded UPDATE; one row: the failed ids,
    then the ids and outcomes of the others, as the statement's snapshot has them (the re-read, without its round trip).

    The re-read's rule is the UPDATE's condition: a job finished or re-enqueued after the statement's
    snapshot is re-checked by PostgreSQL when its row lock is taken, and left as it is; its snapshot
    outcome is then "stuck" (:func:`fail_completed` re-reads it). Each list comes back as one array
    (``NULL`` if empty), not a row each. For one pair, the per-job fallback.
    """
    j = schema.project_export_jobs
    checked, outcome = _checked_and_outcome(schema)  # read by the UPDATE, and beside it for its snapshot's outcomes
    failed = (
        update(j)
        .where(_enqueued_by_id(j, checked), outcome == "stuck")
        .values(status=EXPORT_FAILED, updated_at=bindparam("now", type_=TIMESTAMPTZ))
        .returning(j.c.id)
        .cte("failed")
    )
    spared = (
        select(checked.c.id, outcome.label("outcome"))
        .select_from(checked.outerjoin(j, _enqueued_by_id(j, checked)))
        .where(checked.c.id.not_in(select(failed.c.id)))
        .subquery("spared")
    )
    return select(
        select(func.array_agg(failed.c.id)).scalar_subquery(),
        func.array_agg(aggregate_order_by(spared.c.id, spared.c.id)),
        func.array_agg(aggregate_order_by(spared.c.outcome, spared.c.id)),
    )


@functools.lru_cache(maxsize=8)
def fail_and_page_statement(schema: GitLabSchema, walk: bool) -> Select:
    """:func:`fail_statement`, and the next page in the same statement (two more arrays: its ids and jids): a chunk
    costs one round trip. The page is past the chunk's ids, so the two never meet; it is read at the statement's
    snapshot, as a page read just before it would be."""
    chunk, page = fail_statement(schema).subquery("chunk"), _page_statement(schema, walk).subquery("next_page")
    return select(*chunk.c, *page.c).select_from(chunk.join(page, true()))


def completed_params(completed: Sequence[Export], grace_cutoff: dt.datetime) -> dict:
    """The re-read's and the UPDATE's parameters for these ``(id, jid)`` rows: two array literals
    (:func:`~ci_cleanup.gitlab.schema.array_param`)."""
    return {"ids": array_literal(job.id for job in completed), "jids": array_literal(job.jid for job in completed),
            "grace_cutoff": grace_cutoff}


def _sort(chunk: StuckChunk, outcomes: Iterable[tuple[Export, str]]) -> None:
    """Each job into ``chunk``'s list for its outcome (:func:`_checked_and_outcome`)."""
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
        rows = conn.execute(reread_statement(schema), completed_params(jobs, grace_cutoff))
        _sort(chunk, ((Export(row.id, row.jid), row.outcome) for row in rows))


def find_stuck(
    conn: Connection, schema: GitLabSchema, queues: redis.Redis, candidates: list[Export], grace_cutoff: dt.datetime
) -> StuckChunk:
    """Ask Sidekiq about one chunk (one EXISTS pipeline), re-read the completed jobs, apply the checks; no writes."""
    chunk, completed = ask_sidekiq(queues, candidates)
    classify(conn, schema, chunk, completed, grace_cutoff)
    return chunk


def fail_completed(
    conn: Connection, schema: GitLabSchema, chunk: StuckChunk, completed: list[Export], grace_cutoff: dt.datetime,
    now: dt.datetime, next_page: Page | None = None,
) -> FailOutcome:
    """Fail the chunk's completed jobs in one statement (all or nothing), which says why it spared the others, and
    reads ``next_page`` (into :attr:`FailOutcome.next_page`).

    The chunk costs one statement, as plain SQL would. A job the statement's snapshot called stuck but the update
    did not fail was changed while the update waited for it: only those are re-read; one still stuck then was
    changed and changed back (changed meanwhile).
    """
    if not completed:
        return FailOutcome()
    failed_ids, spared, page = _fail(conn, schema, completed, grace_cutoff, now, next_page)
    outcome = FailOutcome(failed=[job for job in completed if job.id in failed_ids], next_page=page)
    spared_jobs = [job for job in completed if job.id in spared]
    _sort(chunk, ((job, spared[job.id]) for job in spared_jobs if spared[job.id] != "stuck"))
    classify(conn, schema, chunk, [job for job in spared_jobs if spared[job.id] == "stuck"], grace_cutoff)
    outcome.changed_meanwhile = [job.id for job in chunk.stuck]
    chunk.stuck = outcome.failed + chunk.stuck
    return outcome


def _fail(
    conn: Connection, schema: GitLabSchema, jobs: Sequence[Export], grace_cutoff: dt.datetime, now: dt.datetime,
    next_page: Page | None = None,
) -> tuple[set[int], dict[int, str], list[Export] | None]:
    """Run :func:`fail_statement` for these ``(id, jid)`` rows, in the caller's transaction: the ids it failed, the
    others' outcomes by id, and ``next_page`` if asked for (:func:`fail_and_page_statement`)."""
    params = {**completed_params(jobs, grace_cutoff), "now": now}
    if next_page is None:
        statement, fixed = driver_sql(fail_statement(schema), conn.dialect)  # compiled once
        failed, spared, outcomes = one_row(conn, statement, {**fixed, **params})
        page = None
    else:
        statement, fixed = driver_sql(fail_and_page_statement(schema, next_page.walk), conn.dialect)
        params = {**fixed, **params, **next_page.params()}
        failed, spared, outcomes, ids, jids = one_row(conn, statement, params)
        page = _exports(ids, jids)
    return set(failed or ()), dict(zip(spared or (), outcomes or ())), page


def fail_stuck_one_by_one(
    conn: Connection, schema: GitLabSchema, stuck: list[Export], grace_cutoff: dt.datetime, now: dt.datetime,
    report_error: Callable[[int, BaseException], None],
) -> FailOutcome:
    """Fail each stuck job alone, by :func:`fail_statement` in its own transaction; a row that errors is
    reported and the others go on (the worker's ``RecordInvalid`` case)."""
    outcome = FailOutcome()
    for job in stuck:
        try:
            with conn.begin():
                failed, _, _ = _fail(conn, schema, [job], grace_cutoff, now)
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


def fail_chunk(
    conn: Connection, schema: GitLabSchema, chunk: StuckChunk, completed: list[Export], grace_cutoff: dt.datetime,
    now: dt.datetime, report_error: Callable[[int, BaseException], None], next_page: Page | None = None,
) -> FailOutcome:
    """The chunk's statement (reading ``next_page`` too) in its own transaction; if the database refuses it (a bad
    row), each job alone, and the next page is not read.

    Each row ends as the worker's record-level transactions leave it: the statement is all or
    nothing, and when it fails every stuck job is retried in its own transaction, the bad one
    reported and the others failed (the worker's ``RecordInvalid`` case).
    """
    try:
        with conn.begin():
            return fail_completed(conn, schema, chunk, completed, grace_cutoff, now, next_page)
    except DBAPIError as e:
        if e.connection_invalidated:
            raise
    with conn.begin():
        classify(conn, schema, chunk, completed, grace_cutoff)
    return fail_stuck_one_by_one(conn, schema, chunk.stuck, grace_cutoff, now, report_error)


def mark_stuck_jobs_as_failed(
    engine: Engine,
    schema: GitLabSchema,
    queues: redis.Redis,
    *,
    grace_cutoff: dt.datetime,
    chunk_size: int = CHUNK_SIZE,
    dry_run: bool = False,
    max_ids: int = 1000,
    first_id: int | None = None,
    walk: bool = False,
    on_chunk: Callable[[StuckChunk, FailOutcome | None], None] = lambda chunk, outcome: None,
    report_error: Callable[[int, BaseException], None] = lambda job_id, error: None,
    now: Callable[[], dt.datetime] = utc_now,
) -> StuckResult:
    """The worker's ``mark_stuck_jobs_as_failed!``, ``chunk_size`` jobs at a time by id (a million queued rows never
    load at once), from ``first_id`` (:func:`count_enqueued`'s; a job enqueued since has a higher id), else from
    the first id; ``walk``: the pages walk the primary key (:func:`enqueued_exports_query`), for a dense backlog
    (:attr:`Enqueued.dense`); in a dry run, find the stuck jobs and write nothing."""
    result = StuckResult(max_ids=max_ids)
    # One connection for the run, in autocommit: each statement is its own transaction (``begin()`` sends nothing),
    # and none is open while Redis is asked. After the first page, each chunk's fail statement reads the next one.
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        after_id, candidates = (first_id or 1) - 1, None
        while True:
            if candidates is None:  # not read by the last chunk's statement
                with conn.begin():
                    candidates = enqueued_exports(conn, schema, after_id, chunk_size, walk=walk)
            if not candidates:
                return result
            chunk, completed = ask_sidekiq(queues, candidates)
            after_id = chunk.last_id
            if dry_run:
                with conn.begin():
                    classify(conn, schema, chunk, completed, grace_cutoff)
                outcome = None
            else:
                next_page = Page(after_id, chunk_size, walk)
                outcome = fail_chunk(conn, schema, chunk, completed, grace_cutoff, now(), report_error, next_page)
            result.add(chunk, outcome)
            on_chunk(chunk, outcome)
            candidates = None if outcome is None else outcome.next_page
