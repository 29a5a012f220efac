"""``Environments::AutoStopService`` and the ``Environments::AutoStopWorker`` it enqueues, in one place.

The rule, without Dagster, in one statement (:func:`stop_statement`): page through the environments
whose auto-stop time has passed (``Environment.auto_stoppable``), 100 at a time, and stop each as
GitLab's ``Environments::StopService`` → ``Environment#stop_with_actions!`` does:

- stop actions = the ``Ci::Build`` rows of the last successful deployment's pipeline whose name is
  that deployment's ``on_stop``;
- with stop actions: the environment goes ``stopping`` (``wait_for_stop?``) and each ``manual`` stop
  action is played (``pending``, ``queued_at``);
- without, and ``auto_stop_setting`` is ``always``: ``stopped``, ``auto_stop_at`` cleared;
- without, and ``with_action``: nothing (the environment stays available).

GitLab's cron loop would pick the environments left available again and again; paging by
``(auto_stop_at, id)`` here, along GitLab's ``index_environments_on_state_and_auto_stop_at``, means each
is seen once per run and a batch reads only its own rows, however large the backlog. A batch the
database refuses (a bad row) is stopped environment by environment, by the same statement for one id.

``auto_stop_at`` never reaches Python as a ``datetime``: the cursor is PostgreSQL's own text of it,
bound back as it came. Python's datetime stops at year 1, and a year-1 ``auto_stop_at`` read in a session
west of UTC is "year -1"; ``-infinity`` and BC dates sort before any cursor Python could hold.
"""

from __future__ import annotations

import datetime as dt
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    FromClause,
    Integer,
    Select,
    Text,
    and_,
    any_,
    bindparam,
    case,
    cast,
    func,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, insert
from sqlalchemy.engine import Connection, Engine, Row
from sqlalchemy.exc import DBAPIError

from ..gitlab.schema import (
    AUTO_STOP_ALWAYS,
    DEPLOYMENT_SUCCESS,
    TIMESTAMP,
    TIMESTAMPTZ,
    GitLabSchema,
    naive_utc,
    utc_now,
)

BATCH_SIZE = 100  # AutoStopService::BATCH_SIZE
LOOP_LIMIT = 1000  # AutoStopService::LOOP_LIMIT
LOOP_TIMEOUT = dt.timedelta(minutes=45)  # AutoStopService::LOOP_TIMEOUT, below the 50-minute lease

# Outcomes of one environment.
STOPPED = "stopped"  # no stop actions, auto_stop_setting always
STOPPING = "stopping"  # stop actions found (and the manual ones played)
LEFT_UNTOUCHED = "left_untouched"  # no stop actions, auto_stop_setting with_action
CHANGED_CONCURRENTLY = "changed_concurrently"  # no longer auto-stoppable when we came to write
FAILED = "failed"
# Stop actions found, but not played and left available: the database lacks GitLab's unique index on
# ci_pending_builds (build_id), which queueing them needs (``play_stop_actions=False``); the run fails naming it.
NOT_PLAYED = "not_played"
OUTCOMES = (STOPPED, STOPPING, LEFT_UNTOUCHED, CHANGED_CONCURRENTLY, FAILED, NOT_PLAYED)
PENDING_BUILDS_INDEX = "index_ci_pending_builds_on_build_id"  # GitLab's unique index the queue's upsert relies on


@dataclass
class BatchOutcome:
    """One batch: the environment ids by outcome and the stop actions played."""

    ids: dict[str, list[int]] = field(default_factory=lambda: {o: [] for o in OUTCOMES})
    stop_actions_started: list[int] = field(default_factory=list)
    errors: list[tuple[int, str]] = field(default_factory=list)  # (environment id, error)

    def count(self, outcome: str) -> int:
        return len(self.ids[outcome])


@dataclass
class AutoStopResult:
    loops: int = 0
    limit_reached: str | None = None  # "time", "loops" or None (ran out of environments)
    counts: dict[str, int] = field(default_factory=lambda: {o: 0 for o in OUTCOMES})
    ids: dict[str, list[int]] = field(default_factory=dict)  # the first ``max_ids`` per outcome
    stop_actions_started: int = 0
    stop_action_ids: list[int] = field(default_factory=list)
    errors: list[tuple[int, str]] = field(default_factory=list)

    @property
    def rows_changed(self) -> int:
        return self.counts[STOPPED] + self.counts[STOPPING] + self.stop_actions_started

    def add(self, batch: BatchOutcome, max_ids: int) -> None:
        self.loops += 1
        for outcome, env_ids in batch.ids.items():
            self.counts[outcome] += len(env_ids)
            kept = self.ids.setdefault(outcome, [])
            kept += env_ids[: max(0, max_ids - len(kept))]
        self.stop_actions_started += len(batch.stop_actions_started)
        self.stop_action_ids += batch.stop_actions_started[: max(0, max_ids - len(self.stop_action_ids))]
        self.errors += batch.errors[: max(0, max_ids - len(self.errors))]


def auto_stoppable(schema: GitLabSchema, now) -> ColumnElement[bool]:
    """``Environment.auto_stoppable``: ``available.where('auto_stop_at < ?', Time.zone.now)``."""
    e = schema.environments
    return and_(e.c.state == "available", e.c.auto_stop_at < now)


def count_auto_stoppable(conn: Connection, schema: GitLabSchema, now: dt.datetime) -> int:
    return conn.scalar(select(func.count()).select_from(schema.environments).where(auto_stoppable(schema, now)))


# The cursor (auto_stop_at, id) before the first batch: before any auto_stop_at, '-infinity' and BC included.
START = ("-infinity", 0)


def picked_columns(schema: GitLabSchema) -> list:
    """What a batch reads of an environment; ``cursor_at`` is ``auto_stop_at`` as the session's text, for the cursor."""
    e = schema.environments
    return [e.c.id, e.c.auto_stop_setting, e.c.auto_stop_at, cast(e.c.auto_stop_at, Text).label("cursor_at")]


def find_batch_query(schema: GitLabSchema, now, after: tuple, limit) -> Select:
    """The next ``limit`` auto-stoppable environments after the cursor ``after`` = (auto_stop_at, id).

    ``auto_stop_at >= :after_at`` is an index condition on ``(state, auto_stop_at)``; the id breaks ties.
    ``after_at`` is a cursor's text (:data:`START`, or a batch's last ``cursor_at``), compared as a timestamptz.
    """
    e = schema.environments
    after_at, after_id = after
    return (
        select(*picked_columns(schema))
        .where(
            auto_stoppable(schema, now), e.c.auto_stop_at >= after_at,
            or_(e.c.auto_stop_at > after_at, e.c.id > after_id),
        )
        .order_by(e.c.auto_stop_at, e.c.id)
        .limit(limit)
    )


def find_batch(conn: Connection, schema: GitLabSchema, now: dt.datetime, after: tuple, limit: int) -> list[Row]:
    """The next batch's ``id`` and ``cursor_at`` (never ``auto_stop_at`` itself: see the module's docstring)."""
    query = find_batch_query(schema, now, after, limit)
    return conn.execute(query.with_only_columns(query.selected_columns.id, query.selected_columns.cursor_at)).all()


def stop_actions_query(schema: GitLabSchema, environments: FromClause) -> Select:
    """``Environment#stop_actions`` of each row of ``environments`` (anything with an ``id`` column).

    For each environment, its last successful deployment (``status = 2 ORDER BY id DESC LIMIT 1``,
    one index probe each through a LATERAL join), that deployment's build's pipeline, and the
    ``Ci::Build`` rows of that pipeline named by ``on_stop``.
    """
    d = schema.deployments
    deployable = schema.ci_builds.alias("deployable")
    stop_action = schema.ci_builds.alias("stop_action")
    last_deployment = (
        select(d.c.deployable_id, d.c.on_stop)
        .where(d.c.environment_id == environments.c.id, d.c.status == DEPLOYMENT_SUCCESS)
        .order_by(d.c.id.desc())
        .limit(1)
        .lateral("last_deployment")
    )
    return select(environments.c.id.label("environment_id"), stop_action.c.id, stop_action.c.status).select_from(
        environments.join(last_deployment, true())
        .join(deployable, deployable.c.id == last_deployment.c.deployable_id)
        .join(
            stop_action,
            and_(
                stop_action.c.commit_id == deployable.c.commit_id,
                stop_action.c.name == last_deployment.c.on_stop,
                stop_action.c.type == "Ci::Build",
            ),
        )
    )


@functools.lru_cache(maxsize=16)
def stop_statement(schema: GitLabSchema, *, one: bool = False, dry_run: bool = False, play: bool = True) -> Select:
    """Pick environments and stop them as ``stop_with_actions!`` does, in one statement.

    One row per environment picked, in cursor order: ``id``, ``cursor_at``, ``outcome`` and
    ``played`` (the stop actions played for it). The pieces, as CTEs:

    - ``batch``: the next ``:limit`` environments after the cursor (``:after_at``, ``:after_id``), as
      :func:`find_batch_query`; with ``one``, the environment ``:environment_id`` if still auto-stoppable
      (the per-environment fallback of a batch the database refuses);
    - ``actions``: their stop actions (:func:`stop_actions_query`); ``planned``: the rule, each
      environment's outcome (stop actions: ``stopping``; none and ``always``: ``stopped``; else untouched);
    - ``stopping`` / ``stopped``: ``UPDATE … WHERE id = ANY(ARRAY(planned ids)) AND <still auto-stoppable>``
      (and ``always`` for a plain stop). An environment restarted or stopped by someone else after the
      statement's snapshot is re-checked by PostgreSQL when its row is locked, and left as it is;
    - ``played``: the ``manual`` stop actions of the environments that went ``stopping`` (``Ci::Build#play``),
      re-checked the same way, and ``queued``: those joining the runners' queue (``ci_pending_builds``).

    ``dry_run``: ``batch``, ``actions`` and ``planned`` alone, writing nothing; ``played`` is then what
    would be played. ``play=False`` (no unique index for ``queued``'s ``ON CONFLICT``): an environment with
    stop actions is planned ``not_played`` and left as it is, and the statement has no ``queued``.
    Built once; bound per batch: ``:now`` (aware, for ``auto_stop_at``), ``:naive_now``,
    and the cursor and ``:limit`` (or ``:environment_id``).
    """
    e = schema.environments
    now = bindparam("now", type_=TIMESTAMPTZ)
    if one:
        picked = select(*picked_columns(schema)).where(
            e.c.id == bindparam("environment_id", type_=BigInteger), auto_stoppable(schema, now)
        )
    else:
        after = (bindparam("after_at", type_=TIMESTAMPTZ), bindparam("after_id", type_=BigInteger))
        picked = find_batch_query(schema, now, after, bindparam("limit", type_=Integer))
    batch = picked.cte("batch")
    actions = stop_actions_query(schema, batch).cte("actions")
    has_actions = select(actions.c.environment_id).where(actions.c.environment_id == batch.c.id).exists()
    planned = select(
        batch.c.id,
        batch.c.auto_stop_at,
        batch.c.cursor_at,
        case(
            (has_actions, STOPPING if play else NOT_PLAYED), (batch.c.auto_stop_setting == AUTO_STOP_ALWAYS, STOPPED),
            else_=LEFT_UNTOUCHED,
        ).label("outcome"),
    ).cte("planned")
    if dry_run:
        would_play = select(actions.c.id).where(
            actions.c.environment_id == planned.c.id, planned.c.outcome == STOPPING, actions.c.status == "manual"
        )
        would_be_played = _ids_array(would_play, actions.c.id).label("played")
        return select(planned.c.id, planned.c.cursor_at, planned.c.outcome, would_be_played).order_by(
            planned.c.auto_stop_at, planned.c.id
        )
    return _stopped_and_played(schema, now, planned, actions, play)


def _ids_array(query: Select, id_column) -> ColumnElement:
    return func.array(query.order_by(id_column).scalar_subquery(), type_=ARRAY(BigInteger))


def _stopped_and_played(schema: GitLabSchema, now, planned, actions, play: bool) -> Select:
    """The writing half of :func:`stop_statement`: what ``planned`` says, done, and each environment's outcome."""
    e, b, pending = schema.environments, schema.ci_builds, schema.ci_pending_builds
    naive_now = bindparam("naive_now", type_=TIMESTAMP)
    due = auto_stoppable(schema, now)

    def planned_ids(outcome: str):
        return any_(func.array(select(planned.c.id).where(planned.c.outcome == outcome).scalar_subquery()))

    stopping = (
        update(e).where(e.c.id == planned_ids(STOPPING), due)
        .values(state="stopping", updated_at=naive_now)
        .returning(e.c.id).cte("stopping")
    )
    stopped = (
        update(e).where(e.c.id == planned_ids(STOPPED), due, e.c.auto_stop_setting == AUTO_STOP_ALWAYS)
        .values(state="stopped", auto_stop_at=None, updated_at=naive_now)
        .returning(e.c.id).cte("stopped")
    )
    to_play = select(actions.c.id).where(actions.c.environment_id.in_(select(stopping.c.id))).scalar_subquery()
    played = (
        update(b).where(b.c.id == any_(func.array(to_play)), b.c.status == "manual")
        .values(
            status="pending", queued_at=naive_now, updated_at=naive_now,
            lock_version=func.coalesce(b.c.lock_version, 0) + 1,
        )
        .returning(b.c.id, b.c.project_id, b.c.partition_id).cte("played")
    )
    # A build entering `pending` joins the runners' queue (GitLab's Ci::UpdateBuildQueueService#push).
    queued = (
        insert(pending)
        .from_select(
            ["build_id", "project_id", "partition_id"], select(played.c.id, played.c.project_id, played.c.partition_id)
        )
        .on_conflict_do_nothing(index_elements=[pending.c.build_id])
        .cte("queued")
    )
    played_for = select(played.c.id).join(actions, actions.c.id == played.c.id).where(
        actions.c.environment_id == planned.c.id
    )
    done = or_(
        planned.c.outcome.in_([LEFT_UNTOUCHED, NOT_PLAYED]), stopping.c.id.is_not(None), stopped.c.id.is_not(None)
    )
    statement = (
        select(
            planned.c.id, planned.c.cursor_at,
            case((done, planned.c.outcome), else_=CHANGED_CONCURRENTLY).label("outcome"),
            _ids_array(played_for, played.c.id).label("played"),
        )
        .select_from(
            planned.outerjoin(stopping, stopping.c.id == planned.c.id).outerjoin(stopped, stopped.c.id == planned.c.id)
        )
        .order_by(planned.c.auto_stop_at, planned.c.id)
    )
    return statement.add_cte(queued) if play else statement


def _batch_params(now: dt.datetime, after: tuple, limit: int) -> dict:
    return {"now": now, "naive_now": naive_utc(now), "after_at": after[0], "after_id": after[1], "limit": limit}


def _outcome(rows) -> BatchOutcome:
    """A batch's rows from :func:`stop_statement`, sorted by outcome."""
    batch = BatchOutcome()
    for r in rows:
        batch.ids[r.outcome].append(r.id)
        batch.stop_actions_started += r.played
    return batch


def _cursor(rows) -> tuple | None:
    """The cursor after a batch: its last row's (auto_stop_at as text, id); None when the batch was empty."""
    return (rows[-1].cursor_at, rows[-1].id) if rows else None


def preview_batch(
    conn: Connection, schema: GitLabSchema, now: dt.datetime, after: tuple, limit: int, play: bool = True
) -> tuple[BatchOutcome, tuple | None]:
    """Dry run: what the next batch would do, read only; with the cursor after it (None: no more)."""
    with conn.begin():
        rows = conn.execute(stop_statement(schema, dry_run=True, play=play), _batch_params(now, after, limit)).all()
    return _outcome(rows), _cursor(rows)


def stop_environment(
    conn: Connection, schema: GitLabSchema, environment_id: int, now: dt.datetime, play: bool = True
) -> tuple[str, list[int]]:
    """Stop one environment with :func:`stop_statement` in its own transaction: its outcome and the stop actions played.

    One restarted (a new deployment pushes ``auto_stop_at``) or stopped meanwhile is not overwritten.
    """
    with conn.begin():
        params = {"environment_id": environment_id, "now": now, "naive_now": naive_utc(now)}
        row = conn.execute(stop_statement(schema, one=True, play=play), params).first()
    return (CHANGED_CONCURRENTLY, []) if row is None else (row.outcome, row.played)


def stop_one_by_one(
    conn: Connection, schema: GitLabSchema, now: dt.datetime, after: tuple, limit: int,
    report_error: Callable[[int, BaseException], None], play: bool = True,
) -> tuple[BatchOutcome, tuple | None]:
    """The batch read again, each environment stopped in its own transaction; one the database refuses is reported."""
    with conn.begin():
        environments = find_batch(conn, schema, now, after, limit)
    batch = BatchOutcome()
    for env in environments:
        try:
            outcome, played = stop_environment(conn, schema, env.id, now, play)
        except DBAPIError as e:
            if e.connection_invalidated:
                raise
            report_error(env.id, e)
            batch.ids[FAILED].append(env.id)
            batch.errors.append((env.id, str(getattr(e, "orig", e)).strip().splitlines()[0]))
            continue
        batch.ids[outcome].append(env.id)
        batch.stop_actions_started += played
    return batch, _cursor(environments)


def stop_next_batch(
    conn: Connection, schema: GitLabSchema, now: dt.datetime, after: tuple, limit: int,
    report_error: Callable[[int, BaseException], None], play: bool = True,
) -> tuple[BatchOutcome, tuple | None]:
    """The next batch in one statement; if the database refuses it (a bad row), environment by environment."""
    try:
        with conn.begin():
            rows = conn.execute(stop_statement(schema, play=play), _batch_params(now, after, limit)).all()
    except DBAPIError as e:
        if e.connection_invalidated:
            raise
        return stop_one_by_one(conn, schema, now, after, limit, report_error, play)
    return _outcome(rows), _cursor(rows)


def auto_stop_environments(
    engine: Engine,
    schema: GitLabSchema,
    *,
    batch_size: int = BATCH_SIZE,
    max_loops: int = LOOP_LIMIT,
    max_runtime: dt.timedelta = LOOP_TIMEOUT,
    dry_run: bool = False,
    play_stop_actions: bool = True,
    max_ids: int = 1000,
    on_batch: Callable[[BatchOutcome], None] = lambda batch: None,
    report_error: Callable[[int, BaseException], None] = lambda environment_id, error: None,
    now: Callable[[], dt.datetime] = utc_now,
    clock: Callable[[], float] = time.monotonic,
) -> AutoStopResult:
    """GitLab's ``loop_until(timeout: 45.minutes, limit: 1000) { stop_in_batch }``, each batch stopped here.

    ``play_stop_actions=False``: environments with stop actions are left (``not_played``), the others stopped.
    """
    result = AutoStopResult()
    started, cursor = clock(), START
    with engine.connect() as conn:  # one connection for the run, one transaction per batch
        while True:
            if result.loops >= max_loops:
                result.limit_reached = "loops"
                return result
            if result.loops and clock() - started > max_runtime.total_seconds():
                result.limit_reached = "time"
                return result
            if dry_run:
                batch, after = preview_batch(conn, schema, now(), cursor, batch_size, play_stop_actions)
            else:
                batch, after = stop_next_batch(
                    conn, schema, now(), cursor, batch_size, report_error, play_stop_actions
                )
            if after is None:
                return result
            cursor = after
            result.add(batch, max_ids)
            on_batch(batch)
