"""``Environments::AutoStopService`` and the ``Environments::AutoStopWorker`` it enqueues, in one place.

The rule, without Dagster: page through the environments whose auto-stop time has passed
(``Environment.auto_stoppable``), 100 at a time, and stop each as GitLab's ``Environments::StopService`` →
``Environment#stop_with_actions!`` does:

- stop actions = the ``Ci::Build`` rows of the last successful deployment's pipeline whose name is
  that deployment's ``on_stop``;
- with stop actions: the environment goes ``stopping`` (``wait_for_stop?``) and each ``manual`` stop
  action is played (``pending``, ``queued_at``);
- without, and ``auto_stop_setting`` is ``always``: ``stopped``, ``auto_stop_at`` cleared;
- without, and ``with_action``: nothing (the environment stays available).

Environments and deployments are in GitLab's ``main`` database, builds and the runners' queue in ``ci``
(the same database when GitLab is not decomposed). A batch is three statements: picked and locked in main
(:func:`pick_statement`), stop actions played in ci (:func:`stop_actions_statement`), states written in main
(:func:`state_statement`); :func:`stop_picked` says why in that order. On one database the three are one
(:func:`batch_statement`), each fed by the one before.

GitLab's cron loop would pick the environments left available again and again; paging by
``(auto_stop_at, id)`` here, along GitLab's ``index_environments_on_state_and_auto_stop_at``, means each
is seen once per run and a batch reads only its own rows, however large the backlog. What a database
refuses for a batch (a bad row) is done environment by environment.

``auto_stop_at`` never reaches Python as a ``datetime``: the cursor is PostgreSQL's own text of it,
bound back as it came. Python's datetime stops at year 1, and a year-1 ``auto_stop_at`` read in a session
west of UTC is "year -1"; ``-infinity`` and BC dates sort before any cursor Python could hold.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    CompoundSelect,
    Integer,
    Select,
    Text,
    and_,
    any_,
    bindparam,
    cast,
    func,
    literal,
    or_,
    select,
    true,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import aggregate_order_by, insert
from sqlalchemy.engine import Connection, Dialect, Engine, Row
from sqlalchemy.exc import DBAPIError

from ..gitlab.schema import (
    AUTO_STOP_ALWAYS,
    DEPLOYMENT_SUCCESS,
    TIMESTAMP,
    TIMESTAMPTZ,
    GitLabSchema,
    array_literal,
    array_param,
    driver_sql,
    execute_driver_sql,
    int_array,
    naive_utc,
    one_row,
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
AUTOCOMMIT = "AUTOCOMMIT"  # SQLAlchemy's isolation level: each statement its own transaction


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


@functools.lru_cache(maxsize=8)
def pick_statement(schema: GitLabSchema, *, one: bool = False, lock: bool = True) -> Select:
    """The main database's half: the next ``:limit`` auto-stoppable environments after the cursor (with ``one``,
    the environment ``:environment_id`` if still auto-stoppable), each with its last successful deployment's
    deployable and ``on_stop`` (``status = 2 ORDER BY id DESC LIMIT 1``, one index probe through a LATERAL join).

    ``lock``: ``FOR UPDATE OF environments``, held until the environments are written: an environment restarted
    (a new deployment pushes ``auto_stop_at``) before the lock is re-checked by PostgreSQL and not picked, and
    none is restarted between its stop actions being played and its state being written.
    """
    e, d = schema.environments, schema.deployments
    now = bindparam("now", type_=TIMESTAMPTZ)
    last_deployment = (
        select(d.c.deployable_id, d.c.on_stop)
        .where(d.c.environment_id == e.c.id, d.c.status == DEPLOYMENT_SUCCESS)
        .order_by(d.c.id.desc())
        .limit(1)
        .lateral("last_deployment")
    )
    if one:
        picked = select(*picked_columns(schema)).where(
            e.c.id == bindparam("environment_id", type_=BigInteger), auto_stoppable(schema, now)
        )
    else:
        after = (bindparam("after_at", type_=TIMESTAMPTZ), bindparam("after_id", type_=BigInteger))
        picked = find_batch_query(schema, now, after, bindparam("limit", type_=Integer))
    # Never auto_stop_at itself (see the module's docstring): its text, cursor_at.
    columns = picked.selected_columns
    picked = picked.with_only_columns(
        columns.id, columns.auto_stop_setting, columns.cursor_at, last_deployment.c.deployable_id,
        last_deployment.c.on_stop,
    ).outerjoin_from(e, last_deployment, true())
    return picked.with_for_update(of=e) if lock else picked


def _stop_action_ctes(schema: GitLabSchema, wanted, dry_run: bool) -> tuple:
    """``Environment#stop_actions`` (the ``Ci::Build`` rows of the deployable's pipeline named ``on_stop``) of each
    environment ``wanted`` (a CTE of ``environment_id``, ``deployable_id``, ``on_stop``), and the ``manual`` ones
    played (``Ci::Build#play``: ``pending``, ``queued_at``) and queued for the runners (``ci_pending_builds``, GitLab's
    ``Ci::UpdateBuildQueueService#push``).

    CTEs: ``actions`` (``environment_id``, ``id``, ``status``: a row per environment and stop action), ``played`` (the
    builds played; None on a ``dry_run``) and ``queued``, which the statement must carry (``add_cte``). Played once
    only: a stop action already ``pending`` is not played again, so playing them twice for the same environments (a
    run killed before it wrote them) plays nothing more.
    """
    b, pending = schema.ci_builds, schema.ci_pending_builds
    deployable, stop_action = b.alias("deployable"), b.alias("stop_action")
    actions = select(wanted.c.environment_id, stop_action.c.id, stop_action.c.status).select_from(
        wanted.join(deployable, deployable.c.id == wanted.c.deployable_id).join(
            stop_action,
            and_(
                stop_action.c.commit_id == deployable.c.commit_id,
                stop_action.c.name == wanted.c.on_stop,
                stop_action.c.type == "Ci::Build",
            ),
        )
    ).cte("actions")
    if dry_run:
        return actions, None, None
    naive_now = bindparam("naive_now", type_=TIMESTAMP)
    played = (
        update(b).where(b.c.id == any_(func.array(select(actions.c.id).scalar_subquery())), b.c.status == "manual")
        .values(
            status="pending", queued_at=naive_now, updated_at=naive_now,
            lock_version=func.coalesce(b.c.lock_version, 0) + 1,
        )
        .returning(b.c.id, b.c.project_id, b.c.partition_id).cte("played")
    )
    queued = (
        insert(pending)
        .from_select(
            ["build_id", "project_id", "partition_id"], select(played.c.id, played.c.project_id, played.c.partition_id)
        )
        .on_conflict_do_nothing(index_elements=[pending.c.build_id])
        .cte("queued")
    )
    return actions, played, queued


def _stop_actions_per_environment(schema: GitLabSchema, wanted, dry_run: bool) -> Select:
    """:func:`_stop_action_ctes`, a row per environment that has stop actions: ``environment_id``, ``actions`` (all of
    them) and ``played``. ``dry_run``: ``played`` is what would be."""
    actions, played, queued = _stop_action_ctes(schema, wanted, dry_run)
    all_actions = func.array_agg(aggregate_order_by(actions.c.id, actions.c.id)).label("actions")
    if dry_run:
        would_play = func.array_agg(aggregate_order_by(actions.c.id, actions.c.id)).filter(actions.c.status == "manual")
        return select(actions.c.environment_id, all_actions, would_play.label("played")).group_by(
            actions.c.environment_id
        )
    played_ids = func.array_agg(aggregate_order_by(played.c.id, played.c.id)).filter(played.c.id.is_not(None))
    return (
        select(actions.c.environment_id, all_actions, played_ids.label("played"))
        .select_from(actions.outerjoin(played, played.c.id == actions.c.id))
        .group_by(actions.c.environment_id)
        .add_cte(queued)
    )


@functools.lru_cache(maxsize=8)
def stop_actions_statement(schema: GitLabSchema, *, dry_run: bool = False) -> Select:
    """The ci database's half, in one statement: the stop actions of the environments given (``:environment_ids``,
    ``:deployable_ids``, ``:on_stops``, in step), played (:func:`_stop_actions_per_environment`)."""
    wanted = select(
        func.unnest(array_param("environment_ids", BigInteger)).label("environment_id"),
        func.unnest(array_param("deployable_ids", BigInteger)).label("deployable_id"),
        func.unnest(array_param("on_stops", Text)).label("on_stop"),
    ).cte("wanted")
    return _stop_actions_per_environment(schema, wanted, dry_run)


def _states(schema: GitLabSchema, stopping_ids: ColumnElement, stopped_ids: ColumnElement) -> tuple:
    """``stopping_ids`` go ``stopping`` (they have stop actions), ``stopped_ids`` (none) ``stopped`` with
    ``auto_stop_at`` cleared if ``always``, each only if still auto-stoppable: two CTEs, ``stopping`` and ``stopped``,
    each returning the ids it wrote."""
    e = schema.environments
    now, naive_now = bindparam("now", type_=TIMESTAMPTZ), bindparam("naive_now", type_=TIMESTAMP)
    due = auto_stoppable(schema, now)
    stopping = (
        update(e).where(e.c.id == any_(stopping_ids), due)
        .values(state="stopping", updated_at=naive_now)
        .returning(e.c.id).cte("stopping")
    )
    stopped = (
        update(e)
        .where(e.c.id == any_(stopped_ids), due, e.c.auto_stop_setting == AUTO_STOP_ALWAYS)
        .values(state="stopped", auto_stop_at=None, updated_at=naive_now)
        .returning(e.c.id).cte("stopped")
    )
    return stopping, stopped


@functools.lru_cache(maxsize=8)
def state_statement(schema: GitLabSchema) -> CompoundSelect:
    """The main database's write (:func:`_states`) of ``:stopping_ids`` and ``:stopped_ids``: the ids written, with
    their outcome."""
    stopping, stopped = _states(
        schema, array_param("stopping_ids", BigInteger), array_param("stopped_ids", BigInteger)
    )
    return union_all(
        select(stopping.c.id, literal(STOPPING).label("outcome")),
        select(stopped.c.id, literal(STOPPED).label("outcome")),
    )


@functools.lru_cache(maxsize=8)
def batch_statement(schema: GitLabSchema) -> Select:
    """On one database, a batch in one statement: the three above, each fed by the one before instead of by
    parameters. Picked and locked (:func:`pick_statement`), their stop actions played (:func:`_stop_action_ctes`), their
    states written (:func:`_states`: those with stop actions ``stopping``, the others ``stopped``).

    One row (its arrays NULL when none was picked): ``ids`` and ``auto_stop_settings``, an element per picked
    environment in the cursor's order; ``with_actions`` (the environments that have stop actions, an id per stop
    action), ``stopping`` and ``stopped`` (the ids written), ``played`` (the stop actions played) and ``cursor_at``,
    the last environment's. Each array is read from its own CTE, not joined back to the picked environments: parsed
    and planned, the statement then costs PostgreSQL what the floor's does (1.67 ms each, ``EXPLAIN`` 300 times);
    joined, with the outcomes in the cursor's order, it cost 0.12-0.25 ms more per batch. Arrays, not a row per
    environment: that cost the client 0.24 ms more per 100-row batch (psycopg2 parsed 100 rows and SQLAlchemy made a
    Row of each, where an array is parsed in C). ``auto_stop_settings`` and ``with_actions`` come as array text, read
    only for a batch with environments not written (:func:`stop_batch_at_once`): psycopg2 reads an array at 700
    instructions an element, and most batches need neither.
    """
    pick = pick_statement(schema)
    picked = pick.add_columns(schema.environments.c.auto_stop_at).cte("picked")
    wanted = (
        select(picked.c.id.label("environment_id"), picked.c.deployable_id, picked.c.on_stop)
        .where(picked.c.deployable_id.is_not(None), picked.c.on_stop.is_not(None))
        .cte("wanted")
    )
    actions, played, queued = _stop_action_ctes(schema, wanted, dry_run=False)
    without = select(picked.c.id).where(picked.c.id.not_in(select(actions.c.environment_id)))
    stopping, stopped = _states(
        schema, func.array(select(actions.c.environment_id).scalar_subquery()), func.array(without.scalar_subquery())
    )

    def in_order(column):
        return func.array_agg(aggregate_order_by(column, picked.c.auto_stop_at, picked.c.id))

    def whole(column):  # over its whole CTE, not correlated with the outer query's row
        return select(func.array_agg(column)).correlate(None).scalar_subquery()

    last = picked.c.auto_stop_at.desc(), picked.c.id.desc()
    return select(
        in_order(picked.c.id).label("ids"),
        cast(in_order(picked.c.auto_stop_setting), Text).label("auto_stop_settings"),
        cast(whole(actions.c.environment_id), Text).label("with_actions"), whole(stopping.c.id).label("stopping"),
        whole(stopped.c.id).label("stopped"), whole(played.c.id).label("played"),
        select(picked.c.cursor_at).order_by(*last).limit(1).correlate(None).scalar_subquery().label("cursor_at"),
    ).select_from(picked).add_cte(queued)


@functools.lru_cache(maxsize=8)
def compiled_batch_statement(schema: GitLabSchema, dialect: Dialect) -> tuple[str, dict]:
    """:func:`batch_statement` compiled once for ``dialect``, run as driver SQL (:func:`driver_sql`)."""
    return driver_sql(batch_statement(schema), dialect)


def _cursor(rows) -> tuple | None:
    """The cursor after a batch: its last row's (auto_stop_at as text, id); None when the batch was empty."""
    return (rows[-1].cursor_at, rows[-1].id) if rows else None


def _stop_actions(
    ci: Connection, schema: GitLabSchema, now: dt.datetime, picked: list[Row], dry_run: bool, savepoint: bool = True
) -> dict[int, Row]:
    """Each picked environment's stop actions (and those played), in one ci transaction, committed; on one database
    (``ci`` is main's connection, in the batch's transaction), under a savepoint of the batch's transaction unless
    ``savepoint`` is false."""
    deployed = [env for env in picked if env.deployable_id is not None and env.on_stop is not None]
    if not deployed:
        return {}
    params = {
        "environment_ids": array_literal(env.id for env in deployed),
        "deployable_ids": array_literal(env.deployable_id for env in deployed),
        "on_stops": array_literal(env.on_stop for env in deployed), "naive_now": naive_utc(now),
    }
    in_batch = ci.in_transaction()
    with (ci.begin_nested() if savepoint else contextlib.nullcontext()) if in_batch else ci.begin():
        statement = stop_actions_statement(schema, dry_run=dry_run)
        return {r.environment_id: r for r in execute_driver_sql(ci, statement, params)}


def _planned(has_actions: bool, auto_stop_setting: int, play: bool) -> str:
    """``stop_with_actions!``: stop actions -> ``stopping`` (``not_played`` when they cannot be played); none and
    ``always`` -> ``stopped``; else nothing."""
    if has_actions:
        return STOPPING if play else NOT_PLAYED
    return STOPPED if auto_stop_setting == AUTO_STOP_ALWAYS else LEFT_UNTOUCHED


def _outcome(planned: str, written: str | None) -> str:
    """What became of an environment: the state written, else nothing (as planned, or it changed concurrently)."""
    return written or (planned if planned in (LEFT_UNTOUCHED, NOT_PLAYED) else CHANGED_CONCURRENTLY)


def _write_states(main: Connection, schema: GitLabSchema, now: dt.datetime, plan: dict[int, str]) -> dict[int, str]:
    params = {
        "now": now, "naive_now": naive_utc(now),
        "stopping_ids": array_literal(i for i, o in plan.items() if o == STOPPING),
        "stopped_ids": array_literal(i for i, o in plan.items() if o == STOPPED),
    }
    written = {r.id: r.outcome for r in execute_driver_sql(main, state_statement(schema), params)}
    return {i: _outcome(o, written.get(i)) for i, o in plan.items()}


def _failed(batch: BatchOutcome, environment_id: int, error: DBAPIError, report_error) -> None:
    if error.connection_invalidated:
        raise error
    report_error(environment_id, error)
    batch.ids[FAILED].append(environment_id)
    batch.errors.append((environment_id, str(getattr(error, "orig", error)).strip().splitlines()[0]))


def stop_picked(
    main: Connection, ci: Connection, schema: GitLabSchema, now: dt.datetime, picked: list[Row], *,
    dry_run: bool = False, play: bool = True, report_error: Callable[[int, BaseException], None] = lambda i, e: None,
    careful: bool = True, batch: BatchOutcome | None = None,
) -> BatchOutcome:
    """Stop the environments ``picked`` (locked in ``main``'s open transaction), as ``stop_with_actions!`` does.

    GitLab's two databases share no transaction, so the order makes each step safe to repeat: the stop actions are
    played and committed in ``ci`` first, then the environments are written in ``main``. A run killed between the
    two commits leaves the environments available and their actions ``pending``: the next run picks them again,
    plays nothing more and writes their state, so nothing is lost or done twice. What a database refuses for the
    batch is done environment by environment (``ci`` in its own transactions, ``main`` under savepoints); an
    environment refused is reported (``failed``) and left available. ``play=False``: the stop actions are only
    looked up (as in a dry run), and their environments left ``not_played``. ``careful=False``: no savepoints, and
    what a database refuses is raised, for the caller to roll ``main`` back and do the batch again carefully. The
    outcome goes into ``batch`` (a new one if None), its ``stop_actions_started`` before ``main``'s write: what ``ci``
    committed stays counted when that write is refused and the batch done again, playing nothing more.
    """
    batch = BatchOutcome() if batch is None else batch
    look_only = dry_run or not play
    try:
        actions = _stop_actions(ci, schema, now, picked, look_only, savepoint=careful)
    except DBAPIError as e:
        if e.connection_invalidated or not careful:
            raise
        actions = {}
        for env in list(picked):
            try:
                actions.update(_stop_actions(ci, schema, now, [env], look_only))
            except DBAPIError as error:
                _failed(batch, env.id, error, report_error)
                picked = [p for p in picked if p.id != env.id]
    if play:
        batch.stop_actions_started = _started([batch.stop_actions_started, *(a.played for a in actions.values())])
    plan = {env.id: _planned(env.id in actions, env.auto_stop_setting, play) for env in picked}
    if dry_run:
        outcomes = plan
    else:
        try:
            with main.begin_nested() if careful else contextlib.nullcontext():
                outcomes = _write_states(main, schema, now, plan)
        except DBAPIError as e:
            if e.connection_invalidated or not careful:
                raise
            outcomes = {}
            for env_id, outcome in plan.items():
                try:
                    with main.begin_nested():
                        outcomes.update(_write_states(main, schema, now, {env_id: outcome}))
                except DBAPIError as error:
                    _failed(batch, env_id, error, report_error)
    for env_id, outcome in outcomes.items():
        batch.ids[outcome].append(env_id)
    return batch


def _started(played: Iterable[list[int] | None]) -> list[int]:
    """The stop actions played (each environment's ``played``), once each: environments deployed from one pipeline
    can share a stop action."""
    return sorted({i for ids in played for i in ids or ()})


def stop_batch_at_once(main: Connection, schema: GitLabSchema, now: dt.datetime, params: dict) -> tuple[
        BatchOutcome, tuple | None]:
    """On one database, the next batch in one statement (:func:`batch_statement`) and its transaction; what the
    database refuses is raised, nothing of the batch written.

    On an autocommit connection (the run's, see :func:`auto_stop_environments`) the statement is its own
    transaction: one round trip instead of three (BEGIN, the statement, COMMIT).
    """
    with main.begin():  # on an autocommit connection, SQLAlchemy's bookkeeping only: nothing is sent
        statement, fixed = compiled_batch_statement(schema, main.dialect)
        ids, settings, with_actions, stopping, stopped, played, cursor_at = one_row(
            main, statement, {**fixed, **params, "naive_now": naive_utc(now)})
    batch = BatchOutcome()
    if ids is None:
        return batch, None
    stopping, stopped = set(stopping or ()), set(stopped or ())
    batch.ids[STOPPING] = [env_id for env_id in ids if env_id in stopping]
    batch.ids[STOPPED] = [env_id for env_id in ids if env_id in stopped]
    if len(stopping) + len(stopped) < len(ids):  # not written: left as planned, or changed meanwhile
        with_actions = set(int_array(with_actions))
        for env_id, auto_stop_setting in zip(ids, int_array(settings)):
            if env_id not in stopping and env_id not in stopped:
                batch.ids[_outcome(_planned(env_id in with_actions, auto_stop_setting, play=True), None)].append(env_id)
    batch.stop_actions_started = _started([played])
    return batch, (cursor_at, ids[-1])


def stop_next_batch(
    main: Connection, ci: Connection, schema: GitLabSchema, now: dt.datetime, after: tuple, limit: int, *,
    dry_run: bool = False, play: bool = True, report_error: Callable[[int, BaseException], None] = lambda i, e: None,
) -> tuple[BatchOutcome, tuple | None]:
    """The next batch: picked (and locked) in ``main``, stopped by :func:`stop_picked`, committed; with the cursor
    after it (None: no more).

    First tried without savepoints: on one database as one statement (:func:`stop_batch_at_once`; a dry run, or
    stop actions not to be played: its steps), decomposed as its three steps, ``ci``'s one statement committed on
    its own (the run's ``ci`` connection is in autocommit). If a database refuses it, ``main``'s transaction is
    rolled back and the batch done again step by step under savepoints, so that what is refused is done
    environment by environment. On one database nothing of the first try stays; decomposed, what ``ci`` committed
    does: done again, the batch plays nothing more, and the stop actions the first try played stay counted.
    """
    params = {"now": now, "after_at": after[0], "after_id": after[1], "limit": limit}

    def attempt(careful: bool, batch: BatchOutcome) -> tuple[BatchOutcome, tuple | None]:
        with main.begin():
            picked = execute_driver_sql(main, pick_statement(schema, lock=not dry_run), params).all()
            stop_picked(main, ci, schema, now, picked, dry_run=dry_run, play=play, report_error=report_error,
                        careful=careful, batch=batch)
        return batch, _cursor(picked)

    first = BatchOutcome()
    try:
        if main is ci and play and not dry_run:
            return stop_batch_at_once(main, schema, now, params)
        return attempt(careful=False, batch=first)
    except DBAPIError as e:
        if e.connection_invalidated:
            raise
    committed = first.stop_actions_started if main is not ci else []  # on one database, rolled back with the rest
    with in_transactions(main):
        return attempt(careful=True, batch=BatchOutcome(stop_actions_started=committed))


@contextlib.contextmanager
def in_transactions(conn: Connection) -> Iterator[None]:
    """``conn`` out of autocommit for a while: the steps of a batch done again need their transaction."""
    autocommit = conn.get_execution_options().get("isolation_level") == AUTOCOMMIT
    if autocommit:
        conn.execution_options(isolation_level=conn.default_isolation_level)
    try:
        yield
    finally:
        if autocommit:
            conn.execution_options(isolation_level=AUTOCOMMIT)


def stop_environment(
    main: Connection, ci: Connection, schema: GitLabSchema, environment_id: int, now: dt.datetime
) -> tuple[str, list[int]]:
    """Stop one environment, if still auto-stoppable: its outcome and the stop actions played."""
    with main.begin():
        params = {"environment_id": environment_id, "now": now}
        picked = execute_driver_sql(main, pick_statement(schema, one=True), params).all()
        batch = stop_picked(main, ci, schema, now, picked)
    if not picked:
        return CHANGED_CONCURRENTLY, []
    [outcome] = [o for o, found in batch.ids.items() if found]
    return outcome, batch.stop_actions_started


def auto_stop_environments(
    main: Engine,
    ci: Engine,
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
    # One connection to each database for the run. Decomposed, a transaction per batch in main, and ci in
    # autocommit: its part of a batch is one statement. On one database (the same engine) one connection, and
    # each batch one transaction: stopped and played together, or neither. There, a batch is one statement
    # (stop_batch_at_once) and the connection in autocommit.
    with contextlib.ExitStack() as connections:
        main_conn = connections.enter_context(main.connect())
        ci_conn = main_conn if ci is main else connections.enter_context(ci.connect())
        if ci is not main:
            ci_conn.execution_options(isolation_level=AUTOCOMMIT)
        elif play_stop_actions and not dry_run:
            main_conn.execution_options(isolation_level=AUTOCOMMIT)
        while True:
            if result.loops >= max_loops:
                result.limit_reached = "loops"
                return result
            if result.loops and clock() - started > max_runtime.total_seconds():
                result.limit_reached = "time"
                return result
            batch, after = stop_next_batch(
                main_conn, ci_conn, schema, now(), cursor, batch_size, dry_run=dry_run, play=play_stop_actions,
                report_error=report_error,
            )
            if after is None:
                return result
            cursor = after
            result.add(batch, max_ids)
            on_batch(batch)
