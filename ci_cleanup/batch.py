"""The skeleton every batch job shares, written once: find candidates -> process batch -> emit metadata.

A GitLab cron worker is a few lines of scheduling and locking around its service (e.g.
``Ci::StuckBuilds::DropCancelingWorker`` takes an ``ExclusiveLease`` and calls
``Ci::StuckBuilds::DropCancelingService``). Here each job's first op calls :func:`start` (dry run or
lease, decided once into a :class:`RunMode`), its last op calls :func:`finish` (lease given back, the
run's totals, and in a dry run what would change: the one place dry-run output goes), and
:func:`batch_job` gives the job its tags, run-time limit, lease (:mod:`ci_cleanup.lease`) and schedule.
A job module then holds only what is particular to its batch: its config, queries and metadata.

Redis errors need no handling here: the clients of :class:`~ci_cleanup.resources.GitLabRedis` name the server in
every error they raise, for every job alike.
"""

from __future__ import annotations

import atexit
import enum
import functools
import gc
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

from dagster import (
    JobDefinition,
    OpDefinition,
    OpExecutionContext,
    ScheduleDefinition,
    job,
)
from sqlalchemy import Table

from . import lease as leases
from .console import LOGGER_DEFS
from .gitlab.exclusive_lease import ExclusiveLease
from .gitlab.loop_helpers import Brake
from .gitlab.pacing import Watch
from .resources import GitLabDatabase, GitLabRedis, RunOptions
from .resources.errors import one_line_error
from .resources.gitlab_database import JOB_MARK
from .resources.run_options import APDEX_URL_ENV
from .runs import DRY_RUN_TAG, LEASE_WITHOUT_TTL_TAG, SKIPPED_TAG, report_run


class RunMode(enum.Enum):
    """What a run does, decided by its first op."""

    RUN = "run"
    DRY_RUN = "dry run"
    SKIPPED = "skipped"  # e.g. the lease is held by another process, as GitLab's workers skip


@dataclass(frozen=True)
class Start:
    """The first op's decision: the run's mode, why it skips, what to show about it, the run's brake (the process
    op's loop pauses by it and renews the lease with it, the report op reports its pauses) and the lease it holds."""

    mode: RunMode
    why_skipped: str = ""
    details: Mapping[str, object] = field(default_factory=dict)
    brake: Brake = field(default_factory=Brake)
    lease: leases.RunLease | None = None

    @property
    def status(self) -> str:
        """The first op's ``status``: ``run``, ``dry run`` or ``skipped: <why>``."""
        return f"skipped: {self.why_skipped}" if self.mode is RunMode.SKIPPED else self.mode.value

    @property
    def metadata(self) -> dict:
        return {"status": self.status, **self.details}

    @property
    def runs(self) -> bool:
        return self.mode is RunMode.RUN


def skipped(why: str) -> Start:
    """A run with nothing to do for a reason of the batch's own (e.g. its feature flag is off)."""
    return Start(RunMode.SKIPPED, why)


@functools.cache
def freeze_startup_objects() -> None:
    """Put what the process holds when its first op starts (Dagster's modules, the run's set-up) out of the garbage
    collector's reach, once per process and again at exit: collections then walk only what the batches make, and
    the interpreter's last collections at exit, which only free memory the system frees anyway, are skipped.
    Measured in docs/performance.md."""
    gc.freeze()
    atexit.register(gc.freeze)


def start(context: OpExecutionContext, run_options: RunOptions, gitlab_redis: GitLabRedis | None = None) -> Start:
    """Dry run, or take the job's lease (when it declares one): a held lease skips the run, as in GitLab."""
    freeze_startup_objects()
    try:
        brake = run_options.brake()  # a bad CI_CLEANUP_DUTY_CYCLE fails every run, a dry run too
    except ValueError as error:  # a setting out of range: the run's one line, as BoundedConfig's
        raise one_line_error(f"ValueError: {error}", "ValueError") from None
    lease = leases.of_job(context.job_name)
    store = gitlab_redis.store_used("leases") if lease is not None else {}
    if run_options.dry_run:
        context.instance.add_run_tags(context.run_id, {DRY_RUN_TAG: "true"})
        context.log.info("Dry run: finding what would change, writing nothing")
        return Start(RunMode.DRY_RUN, details=store)
    if lease is None:
        return Start(RunMode.RUN, brake=brake)
    held = lease.of_run(context.run_id, gitlab_redis.leases)
    if lease.obtain(held):
        gitlab_redis.hold_until_teardown(held)  # given back then if a step fails: no failure hook, no HOOK_SKIPPED
        brake.keep = lease.keeper(held)
        return Start(RunMode.RUN, details=store, brake=brake, lease=leases.RunLease(held, gitlab_redis))
    return _skip_for_held_lease(context, held, store)


def _skip_for_held_lease(context: OpExecutionContext, lease: ExclusiveLease, store: Mapping[str, str]) -> Start:
    """Tagged, so that a lease that never expires (no TTL, e.g. set by hand) or a job skipped run after run is
    alerted (sensors.lease_held_alert), not silent."""
    ttl = lease.client.ttl(lease.redis_key)  # -1: the key has no expiry; -2: it went away meanwhile
    tags = {SKIPPED_TAG: "lease held"}
    if ttl == -1:
        tags[LEASE_WITHOUT_TTL_TAG] = lease.redis_key
        context.log.warning(f"Lease {lease.redis_key} has no TTL: it is never released by expiry, so every run skips")
    context.instance.add_run_tags(context.run_id, tags)
    context.log.info(f"Lease {lease.key} is held by another process; skipping as GitLab's worker does")
    return Start(RunMode.SKIPPED, "lease held", {"lease": lease.redis_key, "lease_ttl_seconds": ttl, **store})


@contextmanager
def paced(
    context: OpExecutionContext, begun: Start, gitlab_db: GitLabDatabase | None = None, table: Table | None = None,
) -> Iterator[None]:
    """Around the process op's batches: the signals of ``table``'s database read for the run's pacer, on a
    connection of its own (:class:`~ci_cleanup.gitlab.pacing.Watch`; no table: the batches' time alone), and then
    how the run was paced, on the op's output. Nothing when pacing is off or nothing runs."""
    pacer = begun.brake.pacer
    if pacer is None or not begun.runs:
        yield
        return
    with gitlab_db.dedicated_engine(table, 1) if table is not None else nullcontext() as engine:
        if engine is not None:
            pacer.watch = Watch(engine, table, JOB_MARK, context.log.warning, os.environ.get(APDEX_URL_ENV) or None)
            pacer.watch.paused = pacer.paused
            pacer.watch.start()
        try:
            yield
        finally:
            if pacer.watch is not None:
                pacer.watch.stop()
    context.add_output_metadata(begun.brake.pacing_metadata)


def finish(
    context: OpExecutionContext, begun: Start, metadata: Mapping[str, object], *,
    would: Mapping[str, object] | None = None, tags: Mapping[str, str] | None = None,
) -> None:
    """The last op's part: give the lease back, and report the run's totals with its status (``success``,
    ``dry run`` or ``skipped: …``) and, in a dry run, ``would``: what a run would change."""
    if begun.lease is not None:
        begun.lease.give_back()
    status = "success" if begun.runs else begun.status
    dry = dict(would or {}) if begun.mode is RunMode.DRY_RUN else {}
    # In the run's log, so that a run launched from a terminal (``dagster job execute``) shows its result.
    if begun.mode is RunMode.DRY_RUN:
        context.log.info(f"Dry run, nothing changed: {_counts(dry) or 'nothing would change'}")
    elif begun.runs:
        context.log.info(f"Done: {_counts(metadata)}")
    else:
        context.log.info(f"Skipped ({begun.why_skipped}), nothing changed")
    # What would change leads a dry run's metadata, ahead of the totals of what it did (nothing).
    totals = {**{k: v for k, v in metadata.items() if k not in dry}, **begun.brake.metadata}
    report_run(context, {**dry, "status": status, **totals}, tags)


def _counts(metadata: Mapping[str, object]) -> str:
    return ", ".join(f"{k} {v}" for k, v in metadata.items() if isinstance(v, int) and not isinstance(v, bool))


def find_process_report(find: OpDefinition, process: OpDefinition, report: OpDefinition) -> Callable[[], None]:
    """The graph of every job, the user's three ops: find candidates -> process batch -> emit metadata.

    ``find`` decides the run (dry run, lease, candidates) into a plan; ``process`` does the batches and returns what
    they did; ``report`` alone puts the run's totals, and a dry run's ``would_…``, on the run (:func:`finish`).
    """

    def graph() -> None:
        report(process(find()))

    return graph


def batch_job(
    name: str, graph: Callable[[], None], *, description: str, cron: str, max_runtime_seconds: int,
    seed: str | None = None, lease: leases.Lease | None = None,
) -> tuple[JobDefinition, ScheduleDefinition]:
    """The job ``name`` wiring its ops as ``graph`` does, and its UTC schedule ``<name>_schedule``.

    ``max_runtime_seconds`` becomes ``dagster/max_runtime``: run monitoring fails a longer run, which alerts
    (GitLab's run-time alerts). ``seed`` is the ``ci_cleanup/seed`` tag the alerts group by. The job runs on the
    code location's executor: every op in the run's own process. ``lease``: the ``ExclusiveLease`` its runs take.
    """
    tags = {"ci_cleanup/job": name, "dagster/max_runtime": str(max_runtime_seconds)}
    if seed is not None:
        tags["ci_cleanup/seed"] = seed
    batch = job(name=name, description=description, tags=tags, logger_defs=LOGGER_DEFS)(graph)
    if lease is not None:
        leases.declare(name, lease)
    schedule = ScheduleDefinition(name=f"{name}_schedule", job=batch, cron_schedule=cron, execution_timezone="UTC")
    return batch, schedule
