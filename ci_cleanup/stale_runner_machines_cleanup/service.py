"""``Ci::Runners::StaleManagersCleanupService``: delete runner machines that stopped contacting.

The rule is SQL, in this package: ``delete_stale_runner_machines.sql`` deletes up to 100 stale ``ci_runner_machines``
rows, its own transaction; the service repeats it until a pass deletes nothing or 1000 are gone. There is no
lease: GitLab relies on idempotence, and each DELETE returns what this run itself removed, so two runs at once
delete every row once and their counts add up.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from sqlalchemy.engine import Connection, Engine

from ..gitlab.batching import autocommit
from ..gitlab.loop_helpers import NO_HOOKS, Hooks, loop_until
from ..gitlab.schema import GitLabSchema
from ..gitlab.sql_files import SqlFile

STALE_TIMEOUT = dt.timedelta(days=7)  # Ci::RunnerManager::STALE_TIMEOUT
SUB_BATCH_LIMIT = 100  # StaleManagersCleanupService::SUB_BATCH_LIMIT
MAX_DELETIONS = 1000  # StaleManagersCleanupService::MAX_DELETIONS

SUB_BATCH = SqlFile(__package__, "delete_stale_runner_machines.sql")
COUNT = SqlFile(__package__, "count_stale_runner_machines.sql")
STALE_IDS = SqlFile(__package__, "find_stale_runner_machines.sql")


@dataclass(frozen=True)
class Limits:
    deadline: dt.datetime  # stale_deadline: created and last contacted at or before it is stale
    sub_batch_limit: int = SUB_BATCH_LIMIT
    max_deletions: int = MAX_DELETIONS

    def __post_init__(self) -> None:
        if self.sub_batch_limit < 1 or self.max_deletions < 1:
            raise ValueError("sub_batch_limit and max_deletions must be at least 1")


@dataclass
class CleanupResult:
    """What the service returns and its cron worker logs: ``total_deleted`` and ``batch_counts``."""

    max_deletions: int
    total_deleted: int = 0
    batch_counts: list[int] = field(default_factory=list)
    # Stale rows left for the next run: counted when the cap stopped the run; else 0, as its last pass found.
    left: int = 0

    @property
    def max_deletions_reached(self) -> bool:
        # Worth an alert when reached run after run: the backlog outgrows the cap.
        return self.total_deleted >= self.max_deletions


def stale_deadline(now: dt.datetime, stale_after: dt.timedelta = STALE_TIMEOUT) -> dt.datetime:
    """``Ci::RunnerManager.stale_deadline``; the columns are timestamptz, so an aware UTC moment."""
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware (ci_runner_machines uses timestamptz)")
    return now.astimezone(dt.UTC) - stale_after


def count_stale(conn: Connection, schema: GitLabSchema, deadline: dt.datetime, limit: int | None = None) -> int:
    """The stale rows, or as many up to ``limit``. Counted only where a run needs it (a dry run, a run its cap
    stopped): a run that ended on an empty sub-batch knows there are none."""
    return conn.scalar(COUNT.on(schema, conn.dialect), {"deadline": deadline, "limit": limit})


def find_stale_ids(conn: Connection, schema: GitLabSchema, deadline: dt.datetime, limit: int) -> list[int]:
    """Stale ids in id order, for a dry run's report."""
    return list(conn.scalars(STALE_IDS.on(schema, conn.dialect), {"deadline": deadline, "limit": limit}))


def delete_sub_batch(conn: Connection, schema: GitLabSchema, deadline: dt.datetime, limit: int) -> list[int]:
    """``id_in(stale.limit(n)).delete_all``, one statement (its own transaction on an autocommit connection); the
    ids it deleted."""
    return list(conn.scalars(SUB_BATCH.on(schema, conn.dialect), {"deadline": deadline, "limit": limit}))


def delete_stale_runner_managers(
    engine: Engine, schema: GitLabSchema, limits: Limits, hooks: Hooks = NO_HOOKS
) -> CleanupResult:
    """GitLab's loop: stop when a pass deletes 0 or ``max_deletions`` are gone (then no trailing 0, and the stale
    rows left are counted). ``hooks.on_batch`` gets each sub-batch's deleted ids."""
    deadline = limits.deadline
    result = CleanupResult(max_deletions=limits.max_deletions)
    with autocommit(engine) as conn:

        def sub_batch() -> bool:
            # The last pass never overshoots the cap.
            deleted = delete_sub_batch(
                conn, schema, deadline,
                min(hooks.batch_size(limits.sub_batch_limit), limits.max_deletions - result.total_deleted))
            result.batch_counts.append(len(deleted))
            result.total_deleted += len(deleted)
            hooks.on_batch(deleted)
            return bool(deleted) and not result.max_deletions_reached

        loop_until(sub_batch, brake=hooks.brake)
        if result.max_deletions_reached:
            result.left = count_stale(conn, schema, deadline)
    return result
