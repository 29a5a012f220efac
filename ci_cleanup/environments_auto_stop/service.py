"""Seed 003, ``Environments::AutoStopService`` and the ``AutoStopWorker`` it enqueues, in one place.

The rule, without Dagster: page through the environments whose auto-stop time has passed
(``Environment.auto_stoppable``), 100 at a time, and stop each as GitLab's
``Environments::StopService`` → ``Environment#stop_with_actions!`` does:

- stop actions = the ``Ci::Build`` rows of the last successful deployment's pipeline whose name is
  that deployment's ``on_stop``;
- with stop actions: the environment goes ``stopping`` (``wait_for_stop?``) and each ``manual`` stop
  action is played (``pending``, ``queued_at``);
- without, and ``auto_stop_setting`` is ``always``: ``stopped``, ``auto_stop_at`` cleared;
- without, and ``with_action``: nothing (the environment stays available).

GitLab's cron loop would pick the environments left available again and again; paging by id here
means each is seen once per run.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import ColumnElement, Select, and_, func, select, true, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.engine import Connection, Engine, Row
from sqlalchemy.exc import DBAPIError

from ..gitlab.schema import AUTO_STOP_ALWAYS, DEPLOYMENT_SUCCESS, GitLabSchema, naive_utc, utc_now

BATCH_SIZE = 100  # AutoStopService::BATCH_SIZE
LOOP_LIMIT = 1000  # AutoStopService::LOOP_LIMIT
LOOP_TIMEOUT = dt.timedelta(minutes=45)  # AutoStopService::LOOP_TIMEOUT, below the 50-minute lease

# Outcomes of one environment.
STOPPED = "stopped"  # no stop actions, auto_stop_setting always
STOPPING = "stopping"  # stop actions found (and the manual ones played)
LEFT_UNTOUCHED = "left_untouched"  # no stop actions, auto_stop_setting with_action
CHANGED_CONCURRENTLY = "changed_concurrently"  # no longer auto-stoppable when we came to write
FAILED = "failed"


@dataclass
class BatchOutcome:
    """One batch: the environment ids by outcome and the stop actions played."""

    ids: dict[str, list[int]] = field(default_factory=lambda: {o: [] for o in (STOPPED, STOPPING, LEFT_UNTOUCHED, CHANGED_CONCURRENTLY, FAILED)})
    stop_actions_started: list[int] = field(default_factory=list)
    errors: list[tuple[int, str]] = field(default_factory=list)  # (environment id, error)

    def count(self, outcome: str) -> int:
        return len(self.ids[outcome])


@dataclass
class AutoStopResult:
    loops: int = 0
    limit_reached: str | None = None  # "time", "loops" or None (ran out of environments)
    counts: dict[str, int] = field(default_factory=lambda: {o: 0 for o in (STOPPED, STOPPING, LEFT_UNTOUCHED, CHANGED_CONCURRENTLY, FAILED)})
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


def auto_stoppable(schema: GitLabSchema, now: dt.datetime) -> ColumnElement[bool]:
    """``Environment.auto_stoppable``: ``available.where('auto_stop_at < ?', Time.zone.now)``."""
    e = schema.environments
    return and_(e.c.state == "available", e.c.auto_stop_at < now)


def count_auto_stoppable(conn: Connection, schema: GitLabSchema, now: dt.datetime) -> int:
    return conn.scalar(select(func.count()).select_from(schema.environments).where(auto_stoppable(schema, now)))


def find_batch_query(schema: GitLabSchema, now: dt.datetime, after_id: int, limit: int) -> Select:
    """The next ``limit`` auto-stoppable environments after ``after_id``, by id (keyset paging)."""
    e = schema.environments
    return (
        select(e.c.id, e.c.project_id, e.c.auto_stop_setting)
        .where(auto_stoppable(schema, now), e.c.id > after_id)
        .order_by(e.c.id)
        .limit(limit)
    )


def find_batch(conn: Connection, schema: GitLabSchema, now: dt.datetime, after_id: int, limit: int) -> list[Row]:
    return conn.execute(find_batch_query(schema, now, after_id, limit)).all()


def find_stop_actions(conn: Connection, schema: GitLabSchema, environment_ids: list[int]) -> dict[int, list[Row]]:
    """``Environment#stop_actions`` for a whole batch in one query.

    For each environment, its last successful deployment (``status = 2 ORDER BY id DESC LIMIT 1``,
    one index probe each through a LATERAL join), that deployment's build's pipeline, and the
    ``Ci::Build`` rows of that pipeline named by ``on_stop``.
    """
    e, d = schema.environments, schema.deployments
    deployable = schema.ci_builds.alias("deployable")
    stop_action = schema.ci_builds.alias("stop_action")
    last_deployment = (
        select(d.c.deployable_id, d.c.on_stop)
        .where(d.c.environment_id == e.c.id, d.c.status == DEPLOYMENT_SUCCESS)
        .order_by(d.c.id.desc())
        .limit(1)
        .lateral("last_deployment")
    )
    rows = conn.execute(
        select(e.c.id.label("environment_id"), stop_action.c.id, stop_action.c.status)
        .select_from(
            e.join(last_deployment, true())
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
        .where(e.c.id.in_(environment_ids))
        .order_by(e.c.id, stop_action.c.id)
    ).all()
    actions: dict[int, list[Row]] = {}
    for r in rows:
        actions.setdefault(r.environment_id, []).append(r)
    return actions


def outcome_for(environment: Row, stop_actions: list[Row]) -> str:
    """What ``stop_with_actions!`` does to an available environment (``wait_for_stop?`` = stop actions present)."""
    if stop_actions:
        return STOPPING
    if environment.auto_stop_setting == AUTO_STOP_ALWAYS:
        return STOPPED
    return LEFT_UNTOUCHED


def _play(conn: Connection, schema: GitLabSchema, stop_actions: list[Row], now: dt.datetime) -> list[int]:
    """``Ci::Build#play``: a manual stop action is enqueued (``pending``); one in any other status is left as is."""
    b = schema.ci_builds
    played = conn.execute(
        update(b)
        .where(b.c.id.in_([a.id for a in stop_actions]), b.c.status == "manual")
        .values(
            status="pending",
            queued_at=naive_utc(now),
            updated_at=naive_utc(now),
            lock_version=func.coalesce(b.c.lock_version, 0) + 1,
        )
        .returning(b.c.id, b.c.project_id, b.c.partition_id)
    ).all()
    if played:
        # A build entering `pending` joins the runners' queue (GitLab's Ci::UpdateBuildQueueService#push).
        pending = schema.ci_pending_builds
        conn.execute(
            insert(pending)
            .values([{"build_id": p.id, "project_id": p.project_id, "partition_id": p.partition_id} for p in played])
            .on_conflict_do_nothing(index_elements=[pending.c.build_id])
        )
    return sorted(p.id for p in played)


def stop_environment(
    engine: Engine, schema: GitLabSchema, environment: Row, stop_actions: list[Row], now: dt.datetime
) -> tuple[str, list[int]]:
    """Stop one environment in its own transaction; returns its outcome and the stop actions played.

    The update re-checks that the environment is still auto-stoppable, so one restarted (a new
    deployment pushes ``auto_stop_at``) or stopped meanwhile is not overwritten.
    """
    outcome = outcome_for(environment, stop_actions)
    if outcome == LEFT_UNTOUCHED:
        return outcome, []
    e = schema.environments
    values = {"state": "stopping"} if outcome == STOPPING else {"state": "stopped", "auto_stop_at": None}
    with engine.begin() as conn:
        changed = conn.execute(
            update(e)
            .where(e.c.id == environment.id, auto_stoppable(schema, now))
            .where(e.c.auto_stop_setting == AUTO_STOP_ALWAYS if outcome == STOPPED else true())
            .values(updated_at=naive_utc(now), **values)
            .returning(e.c.id)
        ).first()
        if changed is None:
            return CHANGED_CONCURRENTLY, []
        played = _play(conn, schema, stop_actions, now) if outcome == STOPPING else []
    return outcome, played


def stop_together(
    engine: Engine, schema: GitLabSchema, environments: list[Row], actions: dict[int, list[Row]], now: dt.datetime
) -> BatchOutcome:
    """The batch in one transaction: one UPDATE per outcome and one for the stop actions to play.

    The same guards as :func:`stop_environment` (still auto-stoppable; ``always`` for a plain stop),
    so each environment ends as it would alone; an environment that no longer qualifies is
    ``changed_concurrently`` and its stop actions are not played.
    """
    e = schema.environments
    outcomes = {env.id: outcome_for(env, actions.get(env.id, [])) for env in environments}
    by_outcome = {o: [i for i, out in outcomes.items() if out == o] for o in (STOPPED, STOPPING)}
    batch = BatchOutcome()
    with engine.begin() as conn:
        stopped = set(conn.scalars(
            update(e)
            .where(e.c.id.in_(by_outcome[STOPPED]), auto_stoppable(schema, now), e.c.auto_stop_setting == AUTO_STOP_ALWAYS)
            .values(state="stopped", auto_stop_at=None, updated_at=naive_utc(now))
            .returning(e.c.id)
        )) if by_outcome[STOPPED] else set()
        stopping = set(conn.scalars(
            update(e)
            .where(e.c.id.in_(by_outcome[STOPPING]), auto_stoppable(schema, now))
            .values(state="stopping", updated_at=naive_utc(now))
            .returning(e.c.id)
        )) if by_outcome[STOPPING] else set()
        to_play = [a for env_id in sorted(stopping) for a in actions[env_id]]
        played = set(_play(conn, schema, to_play, now)) if to_play else set()
    for env in environments:
        outcome = outcomes[env.id]
        if outcome != LEFT_UNTOUCHED and env.id not in stopped | stopping:
            outcome = CHANGED_CONCURRENTLY
        batch.ids[outcome].append(env.id)
        if outcome == STOPPING:
            batch.stop_actions_started += sorted(a.id for a in actions[env.id] if a.id in played)
    return batch


def stop_batch(
    engine: Engine, schema: GitLabSchema, environments: list[Row], *, now: dt.datetime, dry_run: bool,
    report_error: Callable[[int, BaseException], None],
) -> BatchOutcome:
    """Stop a batch together; if the database refuses the batch (a bad row), each environment alone."""
    with engine.connect() as conn:
        actions = find_stop_actions(conn, schema, [env.id for env in environments])
    if not dry_run:
        try:
            return stop_together(engine, schema, environments, actions, now)
        except DBAPIError as e:
            if e.connection_invalidated:
                raise
    batch = BatchOutcome()
    for env in environments:
        env_actions = actions.get(env.id, [])
        if dry_run:
            outcome = outcome_for(env, env_actions)
            played = [a.id for a in env_actions if a.status == "manual"] if outcome == STOPPING else []
        else:
            try:
                outcome, played = stop_environment(engine, schema, env, env_actions, now)
            except DBAPIError as e:
                if e.connection_invalidated:
                    raise
                report_error(env.id, e)
                batch.ids[FAILED].append(env.id)
                batch.errors.append((env.id, str(getattr(e, "orig", e)).strip().splitlines()[0]))
                continue
        batch.ids[outcome].append(env.id)
        batch.stop_actions_started += played
    return batch


def auto_stop_environments(
    engine: Engine,
    schema: GitLabSchema,
    *,
    batch_size: int = BATCH_SIZE,
    max_loops: int = LOOP_LIMIT,
    max_runtime: dt.timedelta = LOOP_TIMEOUT,
    dry_run: bool = False,
    max_ids: int = 1000,
    on_batch: Callable[[BatchOutcome], None] = lambda batch: None,
    report_error: Callable[[int, BaseException], None] = lambda environment_id, error: None,
    now: Callable[[], dt.datetime] = utc_now,
    clock: Callable[[], float] = time.monotonic,
) -> AutoStopResult:
    """GitLab's ``loop_until(timeout: 45.minutes, limit: 1000) { stop_in_batch }``, each batch stopped here."""
    result = AutoStopResult()
    started, last_id = clock(), 0
    while True:
        if result.loops >= max_loops:
            result.limit_reached = "loops"
            return result
        if result.loops and clock() - started > max_runtime.total_seconds():
            result.limit_reached = "time"
            return result
        moment = now()
        with engine.connect() as conn:
            environments = find_batch(conn, schema, moment, last_id, batch_size)
        if not environments:
            return result
        batch = stop_batch(engine, schema, environments, now=moment, dry_run=dry_run, report_error=report_error)
        last_id = environments[-1].id
        result.add(batch, max_ids)
        on_batch(batch)
