"""``ci-cleanup bench --traffic``: what each job costs GitLab's own traffic while it runs, unthrottled, braked at
fixed duty cycles and paced by its adaptive default (issue 70).

A synthetic GitLab workload (:mod:`ci_cleanup_dev.bench.workload`, open loop: latency from each transaction's
scheduled start) runs at a fixed rate against the bench database, alone and beside each job. Per job and round, every
contender's window starts from the same reset state (:func:`ci_cleanup_dev.bench.launched.reset`) with the job's
connections open and used, in an order that changes between rounds (:func:`ci_cleanup_dev.bench.launched.
round_order`):

- ``alone``: the workload with no job;
- ``unthrottled``, ``duty 0.5``, ``duty 0.25``: the job's service in this process with the brake its first op builds
  (``RunOptions.brake``) for ``throttle: off`` and that duty cycle;
- ``adaptive``: the same with no setting at all, the job's default: the brake and its pacer built by
  ``RunOptions().brake()``, the signals read by ``ci_cleanup.batch.paced`` on the job's table, as its process op does;
- ``no traffic: unthrottled`` and ``no traffic: adaptive``: the same two without the workload, what the pacing costs
  a job with nobody to yield to.

A window lasts long enough for :data:`MIN_TRANSACTIONS` of the workload; the job is told to stop at its end (the
bucket workers by ``Hooks.stop``, the others after the batch that ends past it) and the window is the job's run,
start to stop. Then, per job, a step test: the workload at half its rate, then full, then half again, while the
job runs at its adaptive default. PostgreSQL runs on one CPU, the workload and the job's client on the other
(:mod:`~ci_cleanup_dev.bench.affinity`). The figures and the section: :mod:`~ci_cleanup_dev.bench.traffic_report`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import redis
from dagster import build_init_resource_context
from sqlalchemy import create_engine, insert, text
from sqlalchemy.engine import Engine

from ci_cleanup.batch import RunMode, Start, paced
from ci_cleanup.environments_auto_stop import service as auto_stop
from ci_cleanup.gitlab import artifact_buckets
from ci_cleanup.gitlab.loop_helpers import Brake, Hooks
from ci_cleanup.gitlab.schema import naive_utc, utc_now
from ci_cleanup.resources import GitLabDatabase, RunOptions
from ci_cleanup.resources.run_options import DUTY_CYCLE_ENV, THROTTLE_ENV
from ci_cleanup.schedule_bulk_delete_job_artifacts import service as bulk_delete
from ci_cleanup_dev.ddl import create_schema

from ..batches import BY_NAME, JOBS
from . import launched, seed
from .affinity import pinned
from .floor import connect
from .jobs import UNLIMITED, S
from .traffic_report import (
    ADAPTIVE,
    ALONE,
    CONTENDERS,
    QUIET,
    STEP,
    UNTHROTTLED,
    JobTraffic,
    Sample,
    lock_waits,
    merged,
    report,
)
from .workload import JOB_IDS, Done, Spec

RATE = 150  # the workload's transactions per second
CLIENTS = 6  # its connections
MIN_TRANSACTIONS = 1000  # in every window and step phase: enough for a p99
WINDOW_MARGIN_S = 0.5  # each window this much longer than MIN_TRANSACTIONS need at the rate
WARM_S = 1.0  # the workload running before a window opens
MAX_WORKLOAD_S = 900  # the workload's own bound, past any window
LOCK_LOG_MS = 5  # the workload's deadlock_timeout: its lock waits longer than this are logged
SAMPLE_ROWS = 5000  # background builds and artifacts the workload picks from
OUTLAST_MARGIN = 1.4  # candidates: this many times what the fastest contender drains in a window
STEP_MARGIN = 1.2  # the step test's: this many times what the adaptive job drains in it at its rounds' pace
BULK = "schedule_bulk_delete_job_artifacts"
# Each job's table, as its process op hands it to ``paced`` (the pacing's cheap read and autovacuum signal).
WATCHED = {"drop_canceling_builds": "ci_builds", "stale_runner_machines_cleanup": "ci_runner_machines",
           "environments_auto_stop": "environments", "stuck_export_jobs": "project_export_jobs",
           BULK: "ci_job_artifacts"}
# The rows a batch changed, from what each service hands its ``on_batch``.
ROWS_OF_BATCH: dict[str, Callable[..., int]] = {
    "drop_canceling_builds": lambda batch: len(batch.dropped),
    "stale_runner_machines_cleanup": len,  # the deleted ids
    "environments_auto_stop": lambda batch: batch.count(auto_stop.STOPPED) + batch.count(auto_stop.STOPPING),
    "stuck_export_jobs": lambda chunk, outcome: len(outcome.failed),
    BULK: lambda bucket, batch: batch.count,
}
LEFT_OUT = {
    "delete_expired_artifact_files": "its work is a storage call per file, not SQL on GitLab's busy tables "
                                     "(`python -m ci_cleanup_dev.bench.objects` measures it)",
    "prune_dagster_history": "it deletes Dagster's own runs, in Dagster's database: none of GitLab's rows or "
                             "tables that the workload touches",
}
SMALL = dict(rows=20_000, candidates=2_000, rounds=1)


class WindowEnd(Exception):
    """The window is over: raised after the batch that ended past it, so the job's loop ends there."""


class Tally:
    """The rows each batch of a run changed and when the batch ended; past ``stop``, the run's end (the bucket
    workers see ``Hooks.stop`` themselves)."""

    def __init__(self, job: str, stop: threading.Event) -> None:
        self.rows_of, self.stop, self.raises = ROWS_OF_BATCH[job], stop, job != BULK
        self.ends: list[tuple[float, int]] = []
        self._lock = threading.Lock()

    def __call__(self, *batch) -> None:
        with self._lock:
            self.ends.append((time.time(), self.rows_of(*batch)))
        if self.raises and self.stop.is_set():
            raise WindowEnd

    def rows(self, start: float = float("-inf"), end: float = float("inf")) -> int:
        with self._lock:
            return sum(n for at, n in self.ends if start <= at <= end)


@dataclass
class Run:
    """A job's run in a window: from its start to its stop."""

    start: float
    end: float
    tally: Tally | None = None
    stopped: bool = True  # stopped by the window's end; False: it ran out of candidates first
    pacing: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.tally.rows() if self.tally else 0


@dataclass
class Scenario:
    """What every window shares: the job's client (the run's resources, as a launched run builds them) and the
    bench's own connections."""

    env: dict[str, str]
    db: GitLabDatabase  # the job's engines: its statements marked and timed out as a run's
    client: redis.Redis
    engine: Engine  # the bench's own (candidates, seeding)
    cur: object  # the bench's own psycopg2 cursor (autocommit)
    log_dir: Path
    background: dict[str, list[list[int]]]  # builds and artifacts: (id, partition_id) the workload picks from
    rate: float = RATE
    log: Callable[[str], None] = print
    bulk_engine: Engine | None = None  # the bucket workers' connections, open across the windows

    @property
    def window_s(self) -> float:
        return MIN_TRANSACTIONS / self.rate + WINDOW_MARGIN_S

    def table(self, job: str):
        return getattr(self.db.schema, WATCHED[job])

    def job_engine(self, job: str) -> Engine:
        return self.bulk_engine if job == BULK else self.db.engine_for(self.table(job))


@contextlib.contextmanager
def high_concurrency(engine: Engine) -> Iterator[None]:
    """The bulk delete's high-concurrency flag on (10 buckets) while the scenario runs, off after: the other parts of
    the bench measure its 5."""
    flag, stamp = bulk_delete.HIGH_CONCURRENCY_FLAG, dict(created_at=naive_utc(utc_now()),
                                                          updated_at=naive_utc(utc_now()))
    with engine.begin() as conn:
        present = conn.scalar(text("SELECT 1 FROM feature_gates WHERE feature_key = :k"), {"k": flag})
        if not present:
            conn.execute(insert(S.features).values(key=flag, **stamp))
            conn.execute(insert(S.feature_gates).values(feature_key=flag, key="boolean", value="true", **stamp))
    try:
        yield
    finally:
        if not present:
            with engine.begin() as conn:
                conn.execute(text("DELETE FROM feature_gates WHERE feature_key = :k"), {"k": flag})
                conn.execute(text("DELETE FROM features WHERE key = :k"), {"k": flag})


def brake_of(contender: str) -> Brake:
    """The run's brake as the job's first op builds it (``RunOptions.brake``): for the adaptive contenders with no
    setting at all (the default), for the others pacing off and the duty cycle (unthrottled: 1)."""
    if contender.endswith(ADAPTIVE):
        return RunOptions().brake()
    duty = 1.0 if contender.endswith(UNTHROTTLED) else float(contender.split()[-1])
    return RunOptions(duty_cycle=duty, throttle="off").brake()


def bucket_workers(scenario: Scenario, hooks: Hooks) -> None:
    """The bulk delete's bucket workers at once, one per bucket of the high-concurrency flag's 10, each a thread on
    its own connection, all on the run's one brake (and pacer), as the job's ``run_bucket_workers`` runs them."""
    workers = bulk_delete.MAX_BUCKETS_HIGH_CONCURRENCY
    artifact_buckets.schedule(scenario.client, workers, utc_now())
    limits = bulk_delete.Limits(max_batches=UNLIMITED, max_runtime=dt.timedelta(days=1))
    with ThreadPoolExecutor(workers, "bucket_worker") as pool:
        list(pool.map(lambda bucket: bulk_delete.run_bucket_worker(
            scenario.bulk_engine, scenario.client, S, limits, hooks, bucket=bucket), range(workers)))


def run_job(scenario: Scenario, job: str, contender: str, seconds: float) -> Run:
    """The job's service in this process with ``contender``'s brake, paced (adaptive) as its process op paces it,
    told to stop after ``seconds``."""
    brake, stop = brake_of(contender), threading.Event()
    tally = Tally(job, stop)
    hooks = Hooks(on_batch=tally, brake=brake, stop=stop)
    context = SimpleNamespace(log=SimpleNamespace(warning=scenario.log), add_output_metadata=lambda metadata: None)
    timer = threading.Timer(seconds, stop.set)
    start = time.time()
    timer.start()
    try:
        with paced(context, Start(RunMode.RUN, brake=brake), scenario.db, scenario.table(job)):
            if job == BULK:
                bucket_workers(scenario, hooks)
            else:
                BY_NAME[job].job(scenario.job_engine(job), scenario.client, lambda: None, hooks=hooks)
    except WindowEnd:
        pass
    finally:
        timer.cancel()
    return Run(start, time.time(), tally, stop.is_set(), brake.pacing_metadata)


def warm(scenario: Scenario, job: str) -> None:
    """The job's connections open and used before its window, as a run's are after its first op."""
    engine = scenario.job_engine(job)
    with contextlib.ExitStack() as stack:
        for _ in range(bulk_delete.MAX_BUCKETS_HIGH_CONCURRENCY if job == BULK else 1):
            stack.enter_context(engine.connect()).execute(text("SELECT 1"))


def server_log(cur) -> Path | None:
    """The file the database's postmaster writes its log to (its standard error); None where it cannot be read."""
    pid = launched.postmaster_pid(cur)
    try:
        path = Path(os.readlink(f"/proc/{pid}/fd/2")) if pid else None
    except OSError:
        return None
    return path if path and path.is_file() else None


@contextlib.contextmanager
def workload(scenario: Scenario, hot: tuple[str, list[list[int]]], phases: list[list[float]]) -> Iterator[dict]:
    """The workload on ``phases`` in its own process, for :data:`WARM_S` before the block; yields ``{"pids": [...],
    "start": ...}``, then (after) ``"done"``: every transaction (:class:`~ci_cleanup_dev.bench.workload.Done`)."""
    spec = Spec(url=scenario.env["CI_CLEANUP_DATABASE_URL"], phases=phases, clients=CLIENTS,
                builds=scenario.background["builds"], artifacts=scenario.background["artifacts"],
                hot_table=hot[0], hot=hot[1], lock_log_ms=LOCK_LOG_MS)
    path = scenario.log_dir / "workload.json"
    path.write_text(json.dumps(asdict(spec)))
    process = subprocess.Popen([sys.executable, "-m", "ci_cleanup_dev.bench.workload", str(path)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    state: dict = {}
    try:
        ready = process.stdout.readline()
        if not ready.startswith("ready "):
            raise RuntimeError(f"the workload did not start: {process.communicate()[1][-3000:]}")
        state.update(json.loads(ready.split(" ", 1)[1]))
        time.sleep(max(0.0, state["start"] + WARM_S - time.time()))
        yield state
    finally:
        out, err = process.communicate("", timeout=MAX_WORKLOAD_S)
    if process.returncode:
        raise RuntimeError(f"the workload failed (exit {process.returncode}): {err[-3000:]}")
    state["done"] = [Done(*t) for t in json.loads(out.strip().splitlines()[-1])]


def read_waits(log: Path | None, offset: int, pids: list[int]) -> tuple[float, float]:
    """The longest lock wait of the workload's backends since ``offset`` of the server's log, and the longest the
    job caused (NaN: the log cannot be read)."""
    if log is None:
        return float("nan"), float("nan")
    with log.open(errors="replace") as f:
        f.seek(offset)
        return lock_waits(f.read().splitlines(), set(pids))


def measure(scenario: Scenario, job: str, contender: str, hot: tuple[str, list[list[int]]]) -> Sample:
    """One window of ``contender`` (with the workload beside it, but for the no-traffic ones)."""
    warm(scenario, job)
    if contender.startswith(QUIET):
        return Sample.of([], (0.0, 0.0), run_job(scenario, job, contender, scenario.window_s))
    log = server_log(scenario.cur)
    with workload(scenario, hot, [[MAX_WORKLOAD_S, scenario.rate]]) as state:
        offset = log.stat().st_size if log else 0
        if contender == ALONE:
            start = time.time()
            time.sleep(scenario.window_s)
            run = Run(start, time.time())
        else:
            run = run_job(scenario, job, contender, scenario.window_s)
    if max((d.due for d in state["done"]), default=0.0) < run.end - 1:
        raise RuntimeError(f"{job} {contender}: the workload stopped before the window ended")
    inside = [d for d in state["done"] if run.start <= d.due <= run.end]
    return Sample.of(inside, read_waits(log, offset, state["pids"]), run)


def step_test(scenario: Scenario, job: str, hot: tuple[str, list[list[int]]]) -> dict[str, Sample]:
    """The workload at each of :data:`STEP`'s shares of its rate in turn, each phase long enough for
    :data:`MIN_TRANSACTIONS`, while the job runs once at its adaptive default: each phase's figures."""
    seconds = [MIN_TRANSACTIONS / (scenario.rate * share) + WINDOW_MARGIN_S for _, share in STEP]
    rates = [scenario.rate * share for _, share in STEP]
    phases = [[WARM_S, rates[0]], *map(list, zip(seconds, rates, strict=True)), [MAX_WORKLOAD_S, rates[-1]]]
    warm(scenario, job)
    log = server_log(scenario.cur)
    with workload(scenario, hot, phases) as state:
        offset = log.stat().st_size if log else 0
        run = run_job(scenario, job, ADAPTIVE, sum(seconds))
        time.sleep(max(0.0, state["start"] + WARM_S + sum(seconds) - time.time()))  # every phase whole
    waits = read_waits(log, offset, state["pids"])
    found, at = {}, state["start"] + WARM_S
    for (name, _), length in zip(STEP, seconds, strict=True):
        inside = [d for d in state["done"] if at <= d.due < at + length]
        phase = Run(at, at + length, None, stopped=run.stopped or run.end >= at + length, pacing=run.pacing)
        found[name] = Sample.of(inside, waits, phase, rows=run.tally.rows(at, at + length))
        at += length
    return found


def hot_rows(cur, job: str, before: dict[str, int]) -> tuple[str, list[list[int]]]:
    """The job's table and its candidate rows (id, partition_id or 0), which the workload updates and reads too."""
    table = seed.PARENT.get(BY_NAME[job].table, BY_NAME[job].table)
    partition = "partition_id" if table in seed.PARENT.values() else "0"
    cur.execute(f"SELECT id, {partition} FROM {table} WHERE id > %s", (before[table],))  # table: a constant
    return table, [list(row) for row in cur.fetchall()]


def rounds_of(scenario: Scenario, figures: JobTraffic, rounds: int, reset: Callable[[], None],
              hot: tuple[str, list[list[int]]]) -> None:
    """Every contender each round, each from the same reset state, in an order that changes between rounds."""
    for r in range(rounds):
        for contender in launched.round_order(CONTENDERS, r):
            began = time.monotonic()
            reset()
            reset_s = time.monotonic() - began
            sample = figures.samples[contender]
            sample.append(measure(scenario, figures.job, contender, hot))
            scenario.log(f"  {figures.job} round {r + 1} {contender}: {sample[-1].summary} (reset {reset_s:.1f} s, "
                         f"all {time.monotonic() - began:.1f} s)")


def step_candidates(scenario: Scenario, figures: JobTraffic) -> int:
    """The step test's candidates: enough that the adaptive job, draining as fast as in its fastest window (with no
    traffic: the light phases drain faster than the rounds' full rate), does not run out before its end; at least
    the rounds' (a window of the unthrottled job's)."""
    fastest = max(s.rows / s.seconds for c in (ADAPTIVE, QUIET + ADAPTIVE) for s in figures.samples[c])
    length = sum(MIN_TRANSACTIONS / (scenario.rate * share) + WINDOW_MARGIN_S for _, share in STEP)
    return max(figures.candidates, round(fastest * length * STEP_MARGIN / figures.changed_share))


def enough_candidates(scenario: Scenario, figures: JobTraffic, before: dict[str, int]) -> int:
    """A window of the fastest contender (unthrottled, no traffic), not counted, which also warms the caches; where
    it ran out, as many candidates again as make it outlast a window (the job spares some: its guards' cases). The
    candidates now snapshotted."""
    cur, job, candidates = scenario.cur, figures.job, figures.candidates
    launched.snapshot(cur, job, before)
    launched.reset(cur, job, before)
    warm_up = measure(scenario, job, QUIET + UNTHROTTLED, ("", []))
    scenario.log(f"  {job} warm-up, not counted: {warm_up.summary}")
    if warm_up.stopped:
        return candidates
    figures.changed_share = warm_up.rows / candidates
    needed = round(warm_up.rows / warm_up.seconds * scenario.window_s * OUTLAST_MARGIN / figures.changed_share)
    scenario.log(f"  {job}: {needed:,} candidates instead, to outlast a window")
    # Candidates made again (its cases, as add_candidates makes them, may spare the earlier ones)
    launched.reset(cur, job, before, candidates=False)
    launched.add_candidates(scenario.engine, scenario.client, job, needed)
    launched.snapshot(cur, job, before)
    return needed


def bench_job(scenario: Scenario, job: str, candidates: int, rounds: int) -> JobTraffic:
    """The job's rounds on enough candidates, then its step test on candidates of its own; the tables left as they
    were before its candidates."""
    figures, cur = JobTraffic(job, candidates), scenario.cur
    before = launched.add_candidates(scenario.engine, scenario.client, job, candidates)
    figures.load = [os.getloadavg()[0]]
    with launched._no_autovacuum(cur, launched._met(before)):
        figures.candidates = enough_candidates(scenario, figures, before)
        hot = hot_rows(cur, job, before)
        rounds_of(scenario, figures, rounds, lambda: launched.reset(cur, job, before), hot)
        launched.reset(cur, job, before, candidates=False)
        figures.step_candidates = step_candidates(scenario, figures)
        scenario.log(f"  {job} step test: {figures.step_candidates:,} candidates")
        step_before = launched.add_candidates(scenario.engine, scenario.client, job, figures.step_candidates)
        cur.execute("CHECKPOINT")
        figures.step = step_test(scenario, job, hot_rows(cur, job, step_before))
        for name, sample in figures.step.items():
            scenario.log(f"  {job} step {name}: {sample.summary}")
        launched.reset(cur, job, before, candidates=False)  # the tables as they were before the candidates
    figures.load.append(os.getloadavg()[0])
    return figures


def background(cur) -> dict[str, list[list[int]]]:
    """Builds and artifacts the workload picks from, before any candidate is added."""
    found = {}
    for name, table in (("builds", "p_ci_builds"), ("artifacts", "p_ci_job_artifacts")):
        cur.execute(f"SELECT id, partition_id FROM {table} ORDER BY random() LIMIT %s", (SAMPLE_ROWS,))
        found[name] = [list(row) for row in cur.fetchall()]
    return found


@contextlib.contextmanager
def job_client(url: str) -> Iterator[GitLabDatabase]:
    """The jobs' database resource, started as a run starts it (its engines mark and time out every statement)."""
    db, context = GitLabDatabase(url=url), build_init_resource_context()
    db.setup_for_execution(context)
    try:
        yield db
    finally:
        db.teardown_after_execution(context)


def no_settings(log: Callable[[str], None]) -> None:
    """The adaptive contender is the job with no setting: a brake or throttle set in this environment is unset."""
    for name in (DUTY_CYCLE_ENV, THROTTLE_ENV):
        if os.environ.pop(name, None) is not None:
            log(f"{name} unset for the bench: the adaptive contender is the job with no setting")


def prepared(env: dict[str, str], rows: int, log) -> tuple[Engine, redis.Redis]:
    os.environ.update({n: env[n] for n in ("DAGSTER_HOME", "CI_CLEANUP_DAGSTER_PG_URL") if env.get(n)})
    no_settings(log)
    engine = create_engine(env["CI_CLEANUP_DATABASE_URL"])
    create_schema(engine)
    log(f"Tables at {rows:,} rows")
    seed.grow(engine, rows, log)
    return engine, redis.Redis.from_url(env["CI_CLEANUP_REDIS_URL"])


def bench_traffic(env: dict[str, str], *, rows: int, candidates: int, rounds: int, jobs: list[str],
                  rate: float = RATE, pin: bool = False, log=print) -> tuple[list[JobTraffic], str]:
    """The tables grown to ``rows`` (the others a tenth), then each job's rounds and step test (:func:`bench_job`),
    PostgreSQL pinned apart from the clients where ``pin`` (the embedded server); the results and how the CPUs
    were shared, in words."""
    engine, client = prepared(env, rows, log)
    admin, results = connect(env["CI_CLEANUP_DATABASE_URL"]), []
    try:
        cur = admin.cursor()
        cur.execute(f"CREATE SCHEMA IF NOT EXISTS {launched.TEMPLATE}")
        cur.execute(f"CREATE SEQUENCE IF NOT EXISTS {JOB_IDS} START 1000000000000")
        cur.execute("TRUNCATE " + ", ".join(launched.SIDE_TABLES))
        postmaster = launched.postmaster_pid(cur) if pin else None
        redis_pid = [int(client.info("server")["process_id"])] if pin else []
        with (tempfile.TemporaryDirectory(prefix="ci_cleanup_traffic_") as logs, high_concurrency(engine),
              launched._no_checkpoint_mid_run(engine, log), job_client(env["CI_CLEANUP_DATABASE_URL"]) as db,
              db.dedicated_engine(db.schema.ci_job_artifacts, bulk_delete.MAX_BUCKETS_HIGH_CONCURRENCY) as bulk,
              pinned(postmaster, redis_pid, log) as cpus):
            scenario = Scenario(env, db, client, engine, cur, Path(logs), background(cur), rate, log, bulk)
            for job in jobs:
                log(f"{job}: {candidates:,} candidates, {rounds} rounds of {' / '.join(CONTENDERS)}; "
                    f"windows of {scenario.window_s:.1f} s")
                results.append(bench_job(scenario, job, candidates, rounds))
                results[-1].rows = rows
    finally:
        admin.close()
        engine.dispose()
    return results, cpus


def main(env: dict[str, str], args) -> None:
    sizes = SMALL if args.small else dict(rows=args.traffic_rows, candidates=args.candidates,
                                          rounds=args.traffic_rounds)
    jobs = args.jobs.split(",") if args.jobs else [job.name for job in JOBS]
    if asked := [job for job in jobs if job in LEFT_OUT]:
        raise SystemExit("; ".join(f"bench --traffic leaves out {job}: {LEFT_OUT[job]}" for job in asked))
    print("Left out: " + "; ".join(f"{job} ({why})" for job, why in LEFT_OUT.items()), flush=True)
    started = time.monotonic()
    results, cpus = bench_traffic(env, jobs=jobs, rate=args.rate, pin=getattr(args, "embedded_stack", False),
                                  **sizes)
    results = merged(Path(args.traffic_results) if args.traffic_results else None, results)
    report(results, args, env, cpus=cpus, minutes=(time.monotonic() - started) / 60, left_out=LEFT_OUT,
           window_s=MIN_TRANSACTIONS / args.rate + WINDOW_MARGIN_S)
