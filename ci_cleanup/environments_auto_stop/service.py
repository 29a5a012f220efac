"""``Environments::AutoStopService`` and the ``Environments::AutoStopWorker`` it enqueues, in one place.

The rule, without Dagster: GitLab's ``loop_until(timeout: 45.minutes, limit: 1000)`` over batches of 100
auto-stoppable environments, each stopped as ``Environment#stop_with_actions!`` does. The SQL is in this package:

- one database: a batch is ``stop_batch.sql``, one statement;
- two databases (environments and deployments in GitLab's ``main``, builds in ``ci``): ``pick_batch.sql`` locks the
  batch in main, ``find_group_jobs.sql`` reads the jobs of each one's deployment group in ci and ``find_group.sql``
  their deployments in main, ``play_stop_actions.sql`` plays their stop actions in ci, ``write_states.sql`` writes
  the batch in main. GitLab's two databases share no transaction, so ci commits first: a run killed between the two
  commits leaves the environments available and their actions pending; the next run picks them again, plays nothing
  more and writes their state;
- a dry run: ``find_batch.sql``, the group's two reads and ``find_stop_actions.sql``, which change nothing.

A batch the database refuses (a bad row) is done again environment by environment, the one refused reported.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field

from sqlalchemy.engine import Connection, Engine, Row
from sqlalchemy.exc import DBAPIError

from ..gitlab.batching import autocommit, database_error, row_by_row_on_failure
from ..gitlab.loop_helpers import NO_HOOKS, Hooks, LoopEnd, loop_until
from ..gitlab.schema import AUTO_STOP_ALWAYS, GitLabSchema, naive_utc
from ..gitlab.sql_files import SqlFile

BATCH_SIZE = 100  # AutoStopService::BATCH_SIZE
LOOP_LIMIT = 1000  # AutoStopService::LOOP_LIMIT
LOOP_TIMEOUT = dt.timedelta(minutes=45)  # AutoStopService::LOOP_TIMEOUT, below the 50-minute lease

COUNT_AUTO_STOPPABLE = SqlFile(__package__, "count_auto_stoppable.sql")
STOP_BATCH = SqlFile(__package__, "stop_batch.sql")
PICK_BATCH = SqlFile(__package__, "pick_batch.sql")
FIND_BATCH = SqlFile(__package__, "find_batch.sql")
PLAY_STOP_ACTIONS = SqlFile(__package__, "play_stop_actions.sql")
FIND_STOP_ACTIONS = SqlFile(__package__, "find_stop_actions.sql")
FIND_GROUP_JOBS = SqlFile(__package__, "find_group_jobs.sql")
FIND_GROUP = SqlFile(__package__, "find_group.sql")
WRITE_STATES = SqlFile(__package__, "write_states.sql")

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

# The cursor (auto_stop_at as PostgreSQL's text, id) before the first batch: before any auto_stop_at.
START = ("-infinity", 0)


@dataclass(frozen=True)
class Limits:
    """GitLab's loop limits (``loop_until``) and batch size; without ``play_stop_actions`` (the queue's unique index
    is missing) environments with stop actions are left ``not_played`` and the others stopped. ``max_ids``: the ids
    a result keeps of each outcome."""

    batch_size: int = BATCH_SIZE
    max_loops: int = LOOP_LIMIT
    max_runtime: dt.timedelta = LOOP_TIMEOUT
    play_stop_actions: bool = True
    max_ids: int = 1000


DEFAULT_LIMITS = Limits()  # GitLab's


@dataclass(frozen=True)
class Flags:
    """What a run may do (its :class:`Limits` and whether it is a dry run): ``dry_run`` writes nothing."""

    dry_run: bool = False
    play_stop_actions: bool = True

    @property
    def plays(self) -> bool:
        return self.play_stop_actions and not self.dry_run


@dataclass
class BatchOutcome:
    """One batch: the environment ids by outcome, the stop actions played, and the cursor after it."""

    ids: dict[str, list[int]] = field(default_factory=lambda: {o: [] for o in OUTCOMES})
    stop_actions_started: list[int] = field(default_factory=list)
    errors: list[tuple[int, str]] = field(default_factory=list)  # (environment id, error)
    cursor: tuple[str, int] | None = None  # None: nothing was picked

    def count(self, outcome: str) -> int:
        return len(self.ids[outcome])

    def played(self, stop_action_ids) -> None:
        """Counted once each: environments deployed from one pipeline can share a stop action."""
        self.stop_actions_started = sorted({*self.stop_actions_started, *(stop_action_ids or ())})

    def merge(self, part: BatchOutcome) -> None:
        self.played(part.stop_actions_started)
        for name, ids in part.ids.items():
            self.ids[name] += ids
        self.errors += part.errors


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


def count_auto_stoppable(conn: Connection, schema: GitLabSchema, now: dt.datetime) -> int:
    return conn.execute(COUNT_AUTO_STOPPABLE.on(schema, conn.dialect), {"now": now}).scalar_one()


def outcome(written: str | None, has_stop_actions: bool, auto_stop_setting: int, flags: Flags) -> str:
    """``stop_with_actions!``'s outcome: the state written, else what was meant (stop actions -> ``stopping``, or
    ``not_played`` when they cannot be played; none and ``always`` -> ``stopped``; else left), and a write that was
    meant but found the environment no longer auto-stoppable is ``changed_concurrently``. A dry run's is what was
    meant."""
    if written:
        return written
    if has_stop_actions:
        meant = STOPPING if flags.play_stop_actions else NOT_PLAYED
    else:
        meant = STOPPED if auto_stop_setting == AUTO_STOP_ALWAYS else LEFT_UNTOUCHED
    return meant if flags.dry_run or meant in (LEFT_UNTOUCHED, NOT_PLAYED) else CHANGED_CONCURRENTLY


@dataclass(frozen=True)
class Run:
    """A run's connections (the same one on one database), tables and flags."""

    main: Connection
    ci: Connection
    schema: GitLabSchema
    flags: Flags
    hooks: Hooks

    @property
    def one_database(self) -> bool:
        return self.ci is self.main

    def execute(self, conn: Connection, sql: SqlFile, params: dict) -> list[Row]:
        """``sql`` on ``conn``: in the open transaction, else its own (SQLAlchemy's autobegun one would be left open,
        and the connection's isolation level could not be changed for a batch in steps)."""
        with nullcontext() if conn.in_transaction() else conn.begin():
            return conn.execute(sql.on(self.schema, conn.dialect), params).all()


@contextmanager
def merged(run: Run, batch: BatchOutcome) -> Iterator[BatchOutcome]:
    """A part of ``batch`` done into an outcome of its own, merged into ``batch`` once committed; if main refuses it,
    the stop actions ci committed stay counted (on one database they are undone with the rest)."""
    part = BatchOutcome()
    try:
        yield part
    except DBAPIError:
        if not run.one_database:
            batch.played(part.stop_actions_started)
        raise
    batch.merge(part)


@contextmanager
def in_transaction(conn: Connection) -> Iterator[None]:
    """A transaction on the run's autocommit connection, for a batch in steps: its lock must hold from its pick to
    its write (on an autocommit connection ``begin()`` sends no BEGIN)."""
    conn.execution_options(isolation_level=conn.default_isolation_level)
    try:
        with conn.begin():
            yield
    finally:
        conn.execution_options(isolation_level="AUTOCOMMIT")


def unqueued(env_id: int, project_id: int) -> str:
    """Why an environment's stop actions were not played: what ``upsert_from_build!`` would fail on."""
    return (f"project {project_id} has no row in projects (or its namespace none in namespaces): its stop actions "
            f"cannot be queued for a runner, so none was played and environment {env_id} was left available")


def deployment_group(run: Run, picked: list[Row]) -> list[Row]:
    """The deployments of each picked environment's deployment group (environment_id, on_stop, commit_id): the jobs
    read in ci (``find_group_jobs.sql``), their deployments in main (``find_group.sql``)."""
    deployed = [env for env in picked if env.deployable_id is not None]
    if not deployed:
        return []
    jobs = run.execute(run.ci, FIND_GROUP_JOBS, {"environment_ids": [env.id for env in deployed],
                                                  "deployable_ids": [env.deployable_id for env in deployed]})
    if not jobs:
        return []
    return run.execute(run.main, FIND_GROUP, {"environment_ids": [job.environment_id for job in jobs],
                                              "job_ids": [job.job_id for job in jobs],
                                              "commit_ids": [job.commit_id for job in jobs]})


def stop_actions(run: Run, params: dict, picked: list[Row]) -> dict[int, list[int]]:
    """Each picked environment's stop actions (its deployment group's), by environment id: those played (a dry run's:
    those it would play); an environment without any is not in it. Each is queued with its project's part of the
    queue row, read with the pick (main's)."""
    group = deployment_group(run, picked)
    if not group:
        return {}
    by_id = {env.id: env for env in picked}
    envs = [by_id[deployment.environment_id] for deployment in group]
    params = {
        **params, "environment_ids": [d.environment_id for d in group],
        "commit_ids": [d.commit_id for d in group], "on_stops": [d.on_stop for d in group],
        "namespace_ids": [env.namespace_id for env in envs],
        "instance_runners_enabled": [env.instance_runners_enabled for env in envs],
        "namespace_traversal_ids": [None if env.namespace_traversal_ids is None
                                    else "{" + ",".join(map(str, env.namespace_traversal_ids)) + "}" for env in envs],
    }
    sql = PLAY_STOP_ACTIONS if run.flags.plays else FIND_STOP_ACTIONS
    return {row.environment_id: row.played or [] for row in run.execute(run.ci, sql, params)}


def write_states(run: Run, params: dict, picked: list[Row], actions: dict[int, list[int]]) -> dict[int, str]:
    """``write_states.sql`` for the picked environments: the state written, by id."""
    stopping = [env.id for env in picked
                if env.id in actions and run.flags.play_stop_actions and env.namespace_id is not None]
    stopped = [env.id for env in picked if env.id not in actions and env.auto_stop_setting == AUTO_STOP_ALWAYS]
    if not stopping and not stopped:
        return {}
    rows = run.execute(run.main, WRITE_STATES, {**params, "stopping_ids": stopping, "stopped_ids": stopped})
    return dict(rows)


def stop_picked(run: Run, params: dict, picked: list[Row], batch: BatchOutcome) -> None:
    """The picked environments stopped in steps, in main's open transaction (ci's part committed first)."""
    actions = stop_actions(run, params, picked)
    if run.flags.play_stop_actions:
        batch.played(i for played in actions.values() for i in played)
    written = {} if run.flags.dry_run else write_states(run, params, picked, actions)
    for env in picked:
        if env.id in actions and env.namespace_id is None and run.flags.play_stop_actions:
            failed(batch, env.id, unqueued(env.id, env.project_id))
        else:
            batch.ids[outcome(written.get(env.id), env.id in actions, env.auto_stop_setting, run.flags)].append(env.id)


def failed(batch: BatchOutcome, env_id: int, error: str) -> None:
    batch.ids[FAILED].append(env_id)
    batch.errors.append((env_id, error))


def stop_batch(run: Run, params: dict, batch: BatchOutcome) -> None:
    """The batch as one statement on one database, else in steps in one main transaction."""
    if run.one_database and run.flags.plays:
        rows = run.execute(run.main, STOP_BATCH, params)
        for env in rows:
            if env.has_stop_actions and env.namespace_id is None:
                failed(batch, env.id, unqueued(env.id, env.project_id))
            else:
                batch.ids[outcome(env.written, env.has_stop_actions, env.auto_stop_setting, run.flags)].append(env.id)
        batch.played(i for env in rows for i in env.played)
    elif run.flags.dry_run:
        rows = run.execute(run.main, FIND_BATCH, params)
        stop_picked(run, params, rows, batch)
    else:
        with merged(run, batch) as part, in_transaction(run.main):
            rows = run.execute(run.main, PICK_BATCH, params)
            stop_picked(run, params, rows, part)
    batch.cursor = (rows[-1].cursor_at, rows[-1].id) if rows else None


def picked_again(run: Run, params: dict, batch: BatchOutcome, fallback: ExitStack) -> list[Row]:
    """The batch picked and locked again after it failed, in a main transaction ``fallback`` ends once each
    environment is done. The cursor moves past them all, the refused ones included."""
    fallback.enter_context(in_transaction(run.main))
    picked = run.execute(run.main, PICK_BATCH, params)
    batch.cursor = (picked[-1].cursor_at, picked[-1].id) if picked else None
    return picked


def stop_one(run: Run, params: dict, env: Row, batch: BatchOutcome) -> None:
    """One environment of a failed batch, under a savepoint of main's transaction; ci's part is its own transaction
    (on one database, under the same savepoint, undone with it)."""
    with merged(run, batch) as part, run.main.begin_nested():
        stop_picked(run, params, [env], part)


def stop_next_batch(run: Run, now: dt.datetime, after: tuple[str, int], limit: int) -> BatchOutcome:
    """The next batch after the cursor ``after``; if a database refuses it, environment by environment."""
    params = {"now": now, "naive_now": naive_utc(now), "after_at": after[0], "after_id": after[1], "limit": limit}
    batch = BatchOutcome()

    def refused(env: Row, error: DBAPIError) -> None:
        run.hooks.report_error(env.id, error)
        failed(batch, env.id, database_error(error))

    with ExitStack() as fallback:
        row_by_row_on_failure(
            lambda: stop_batch(run, params, batch), lambda: picked_again(run, params, batch, fallback),
            lambda env: stop_one(run, params, env, batch), refused,
        )
    return batch


def auto_stop_environments(
    main: Engine, ci: Engine, schema: GitLabSchema, limits: Limits = DEFAULT_LIMITS, hooks: Hooks = NO_HOOKS
) -> AutoStopResult:
    """GitLab's ``loop_until(timeout: 45.minutes, limit: 1000) { stop_in_batch }``, each batch stopped here; on one
    database ``ci`` is ``main``, and one connection serves both."""
    return _loop(main, ci, schema, limits, hooks, Flags(play_stop_actions=limits.play_stop_actions))


def find_auto_stoppable(main: Engine, ci: Engine, schema: GitLabSchema, limits: Limits = DEFAULT_LIMITS
                        ) -> AutoStopResult:
    """A dry run: the same batches, each environment's outcome decided as a run would, nothing written."""
    return _loop(main, ci, schema, limits, NO_HOOKS, Flags(dry_run=True, play_stop_actions=limits.play_stop_actions))


def _loop(main: Engine, ci: Engine, schema: GitLabSchema, limits: Limits, hooks: Hooks, flags: Flags
          ) -> AutoStopResult:
    result = AutoStopResult()
    cursor = START
    with autocommit(main) as main_conn, (nullcontext(main_conn) if ci is main else autocommit(ci)) as ci_conn:
        run = Run(main_conn, ci_conn, schema, flags, hooks)

        def stop_in_batch() -> bool:
            nonlocal cursor
            batch = stop_next_batch(run, hooks.now(), cursor, hooks.batch_size(limits.batch_size))
            if batch.cursor is None:
                return False
            cursor = batch.cursor
            result.add(batch, limits.max_ids)
            hooks.on_batch(batch)
            return True

        end = loop_until(stop_in_batch, timeout=limits.max_runtime.total_seconds(), limit=limits.max_loops,
                         brake=hooks.brake, clock=hooks.clock)
    result.limit_reached = {LoopEnd.TIMEOUT: "time", LoopEnd.LIMIT: "loops"}.get(end)
    return result
