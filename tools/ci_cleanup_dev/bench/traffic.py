"""``ci-cleanup bench --traffic``: what each job costs GitLab's own traffic while it runs.

A synthetic GitLab workload (:mod:`ci_cleanup_dev.bench.workload`) runs at a fixed rate against the bench database:
alone,
then beside each job working through its candidates. Per job and round, every contender starts from the same reset
state (:func:`ci_cleanup_dev.bench.launched.reset`), in an order that changes between rounds:

- ``alone``: the workload with no job;
- ``launched``: the job as it is, ``dagster job execute`` (its default settings; bulk delete at 10 buckets, the
  high-concurrency flag on);
- ``duty D``: the job's service in this process with a brake applied from outside: after each batch (each bucket
  worker's, for bulk delete) a pause of the batch's time times (1 - D) / D, :class:`~ci_cleanup.gitlab.loop_helpers.
  Brake`'s rule, through the service's batch callback.

Each run records the workload's latencies inside the job's window, the longest lock wait the workload suffered (its
sessions log waits past a few ms with their holder: ``log_lock_waits``, read from the server's log), the job's rows and
the server's WAL over the window.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis
from sqlalchemy import create_engine, insert, text
from sqlalchemy.engine import Engine

from ci_cleanup.gitlab import artifact_buckets
from ci_cleanup.gitlab.loop_helpers import Brake
from ci_cleanup.gitlab.schema import gitlab_schema, naive_utc, utc_now
from ci_cleanup.schedule_bulk_delete_job_artifacts import service as bulk_delete
from ci_cleanup_dev.ddl import create_schema

from ..batches import BY_NAME, JOBS
from . import launched, seed
from .floor import connect
from .jobs import UNLIMITED
from .server import machine, postgres_settings
from .workload import JOB_IDS, Spec

HEADING = "## GitLab's traffic: a synthetic workload beside each job"
DUTY_CYCLES = (1.0, 0.5, 0.25, 0.1)
ALONE = "alone"
LAUNCHED = "launched"
CONTENDERS = (ALONE, LAUNCHED, *(f"duty {d:g}" for d in DUTY_CYCLES))
RATE = 150  # transactions per second
CLIENTS = 6  # the workload's connections
ALONE_S = 12  # the workload alone, per round
WARM_S = 1.0  # the workload running before a window opens
MAX_WINDOW_S = 1200  # the workload's own bound: no run of the scenario lasts longer
LOCK_LOG_MS = 5  # the workload's deadlock_timeout: its lock waits longer than this are logged
SAMPLE_ROWS = 5000  # background builds and artifacts the workload picks from
TARGETS = {"ratio": 1.5, "lock_ms": 200, "rows_per_s": 5000}
SMALL = dict(rows=20_000, candidates=2_000, rounds=1)
S = gitlab_schema()


def percentile(values: list[float], p: float) -> float:
    """The nearest-rank percentile: the smallest value with at least ``p`` % of the values at or below it."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


@dataclass
class Sample:
    """One run with the workload beside it: the workload's figures inside the window, the job's over it."""

    transactions: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    lock_ms: float  # the longest lock wait of the workload (0: none over LOCK_LOG_MS)
    job_lock_ms: float  # the longest whose holder was not one of the workload's own backends
    seconds: float
    rows: int = 0
    wal_bytes: int = 0

    @classmethod
    def of(cls, latencies_s: list[float], waits: tuple[float, float], seconds: float, rows: int = 0,
           wal_bytes: int = 0) -> Sample:
        ms = [s * 1000 for s in latencies_s]
        return cls(len(ms), percentile(ms, 50), percentile(ms, 99), max(ms), *waits, seconds, rows, wal_bytes)


def in_window(done: list[tuple[str, float, float]], start: float, end: float) -> list[float]:
    """The seconds of the transactions that started inside [start, end]."""
    return [seconds for _, began, seconds in done if start <= began <= end]


WAIT = re.compile(r"\[(\d+)\] LOG:  process \d+ (still waiting for|acquired) .+? after ([\d.]+) ms")
HOLDERS = re.compile(r"\[(\d+)\] DETAIL:  Process(?:es)? holding the lock: ([\d, ]+)\.")


def lock_waits(lines: list[str], waiters: set[int]) -> tuple[float, float]:
    """From the server's log: the longest lock wait of a backend in ``waiters``, and the longest whose holders were
    not all ``waiters`` (another session's lock: the job's). A wait still going on counts for as long as logged."""
    holders: dict[int, set[int]] = {}
    longest = by_others = 0.0
    for line in lines:
        if match := HOLDERS.search(line):
            holders[int(match[1])] = {int(p) for p in match[2].replace(" ", "").split(",") if p}
        elif (match := WAIT.search(line)) and int(match[1]) in waiters:
            ms = float(match[3])
            longest = max(longest, ms)
            if not holders.get(int(match[1]), set()) <= waiters:
                by_others = max(by_others, ms)
    return longest, by_others


@dataclass
class JobTraffic:
    job: str
    candidates: int
    samples: dict[str, list[Sample]] = field(default_factory=lambda: {c: [] for c in CONTENDERS})
    load: list[float] = field(default_factory=list)  # the 1-minute load average before and after its rounds
    rows: int = 0  # ci_builds / ci_job_artifacts rows before the candidates

    @classmethod
    def from_dict(cls, stored: dict) -> JobTraffic:
        samples = {c: [Sample(**s) for s in stored["samples"][c]] for c in CONTENDERS}
        return cls(stored["job"], stored["candidates"], samples, stored["load"], stored["rows"])

    def median(self, contender: str, figure: Callable[[Sample], float]) -> float:
        return statistics.median(figure(s) for s in self.samples[contender])

    def ratio(self, contender: str) -> float:
        """p99 beside the job over p99 alone, each round's own pair, the median of the rounds'."""
        return statistics.median(s.p99_ms / alone.p99_ms for s, alone in
                                 zip(self.samples[contender], self.samples[ALONE], strict=True))

    def job_lock_ms(self, contender: str) -> float:
        """The longest lock wait the job caused, over every round (the worst, not a median)."""
        return max(s.job_lock_ms for s in self.samples[contender])

    def rows_per_s(self, contender: str) -> float:
        return self.median(contender, lambda s: s.rows / s.seconds)

    def wal_per_row(self, contender: str) -> float:
        """The server's WAL over the window, less what the workload writes alone in as long (its round's rate), per
        changed row."""
        return statistics.median(
            (s.wal_bytes - alone.wal_bytes / alone.seconds * s.seconds) / max(1, s.rows)
            for s, alone in zip(self.samples[contender], self.samples[ALONE], strict=True))

    def meets(self, contender: str) -> bool:
        return (self.ratio(contender) <= TARGETS["ratio"] and self.job_lock_ms(contender) <= TARGETS["lock_ms"]
                and self.rows_per_s(contender) >= TARGETS["rows_per_s"])

    def best_duty(self) -> str:
        """The widest duty cycle that meets every target, or ``none``."""
        return next((f"{d:g}" for d in DUTY_CYCLES if self.meets(f"duty {d:g}")), "none")


def p99_ratio_max(results: list[JobTraffic], contender: str = LAUNCHED) -> float:
    return max(r.ratio(contender) for r in results)


# -- the runs ------------------------------------------------------------------------------------------------------


class Pacer:
    """A :class:`Brake` applied from outside a service, through its batch callback: the pause after a batch is in
    proportion to the time since the last callback returned, the batch's own."""

    def __init__(self, duty_cycle: float, clock: Callable[[], float] = time.perf_counter, sleep=time.sleep):
        self.brake, self.clock, self.sleep = Brake(duty_cycle), clock, sleep
        self.last = clock()

    def __call__(self, *_) -> None:
        pause = self.brake.pause_after(self.clock() - self.last)
        if pause > 0:
            self.sleep(pause)
        self.last = self.clock()


def bucket_workers(engine: Engine, client: redis.Redis, duty_cycle: float) -> int:
    """The bulk delete's bucket workers at once, one per bucket of the high-concurrency flag's 10, each a thread on
    its own connection and braked on its own, as the job runs them."""
    workers = bulk_delete.MAX_BUCKETS_HIGH_CONCURRENCY
    artifact_buckets.schedule(client, workers, utc_now())

    def work(bucket: int) -> int:
        pace = Pacer(duty_cycle)
        return bulk_delete.run_bucket_worker(
            engine, client, S, bucket=bucket,
            limits=bulk_delete.Limits(max_batches=UNLIMITED, max_runtime=dt.timedelta(days=1)),
            hooks=bulk_delete.Hooks(on_batch=lambda claimed, batch: pace()),
        ).destroyed_job_artifacts_count

    with ThreadPoolExecutor(workers, "bucket_worker") as pool:
        return sum(pool.map(work, range(workers)))


def run_service(engine: Engine, client: redis.Redis, job: str, duty_cycle: float) -> int:
    """The job's service in process, braked at ``duty_cycle``: rows changed."""
    engine.dispose()  # a connection of its own, as a launched job's process opens one
    if job == "schedule_bulk_delete_job_artifacts":
        return bucket_workers(engine, client, duty_cycle)
    return BY_NAME[job].job(engine, client, Pacer(duty_cycle))


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


def server_log(cur) -> Path | None:
    """The file the database's postmaster writes its log to (its standard error); None where it cannot be read."""
    pid = launched.postmaster_pid(cur)
    try:
        path = Path(os.readlink(f"/proc/{pid}/fd/2")) if pid else None
    except OSError:
        return None
    return path if path and path.is_file() else None


@dataclass
class Scenario:
    """What every run of the scenario shares."""

    env: dict[str, str]
    engine: Engine
    client: redis.Redis
    cur: object  # the bench's own psycopg2 cursor (autocommit)
    log_dir: Path
    background: dict[str, list[list[int]]]  # builds and artifacts: (id, partition_id) the workload picks from
    rate: float = RATE


@contextlib.contextmanager
def workload(scenario: Scenario, hot_table: str, hot: list[list[int]]) -> Iterator[dict]:
    """The workload running in its own process; yields ``{"pids": [...]}``, then (after) ``"done"``: every
    transaction (kind, started, seconds)."""
    spec = Spec(url=scenario.env["CI_CLEANUP_DATABASE_URL"], rate=scenario.rate,
                count=int(scenario.rate * MAX_WINDOW_S), seconds=MAX_WINDOW_S, clients=CLIENTS,
                builds=scenario.background["builds"], artifacts=scenario.background["artifacts"],
                hot_table=hot_table, hot=hot, lock_log_ms=LOCK_LOG_MS)
    path = scenario.log_dir / "workload.json"
    path.write_text(json.dumps(asdict(spec)))
    process = subprocess.Popen([sys.executable, "-m", "ci_cleanup_dev.bench.workload", str(path)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    state: dict = {}
    try:
        ready = process.stdout.readline()
        if not ready.startswith("ready "):
            raise RuntimeError(f"the workload did not start: {process.communicate()[1][-3000:]}")
        state["pids"] = json.loads(ready.split(" ", 1)[1])
        time.sleep(WARM_S)
        yield state
    finally:
        out, err = process.communicate("", timeout=MAX_WINDOW_S)
    if process.returncode:
        raise RuntimeError(f"the workload failed (exit {process.returncode}): {err[-3000:]}")
    state["done"] = [tuple(t) for t in json.loads(out.strip().splitlines()[-1])]


def run_contender(scenario: Scenario, job: str, contender: str) -> tuple[float, float, int]:
    """The window (wall-clock start, end) of ``contender``'s run and the rows it changed."""
    if contender == ALONE:
        start = time.time()
        time.sleep(ALONE_S)
        return start, time.time(), 0
    if contender == LAUNCHED:
        launched_at = time.time()
        seconds, run_s, _, rows = launched.launch(scenario.env, job, scenario.log_dir)
        return launched_at + seconds - run_s, launched_at + seconds, rows  # the run's own start -> end
    start = time.time()
    rows = run_service(scenario.engine, scenario.client, job, float(contender.split()[1]))
    return start, time.time(), rows


def wal_lsn(cur) -> str:
    cur.execute("SELECT pg_current_wal_lsn()")
    return cur.fetchone()[0]


def measure(scenario: Scenario, job: str, contender: str, hot: tuple[str, list[list[int]]]) -> Sample:
    """One run of ``contender`` with the workload beside it."""
    cur, log = scenario.cur, server_log(scenario.cur)
    with workload(scenario, *hot) as state:
        offset = log.stat().st_size if log else 0
        lsn = wal_lsn(cur)
        start, end, rows = run_contender(scenario, job, contender)
        cur.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (lsn,))
        wal = int(cur.fetchone()[0])
    last_began = max(began for _, began, _ in state["done"])
    if last_began < end - 1:
        raise RuntimeError(f"{job} {contender}: the workload stopped before the run ended")
    if log:
        with log.open(errors="replace") as f:
            f.seek(offset)
            waits = lock_waits(f.read().splitlines(), set(state["pids"]))
    else:
        waits = (math.nan, math.nan)
    return Sample.of(in_window(state["done"], start, end), waits, end - start, rows, wal)


def hot_rows(cur, job: str, before: dict[str, int]) -> tuple[str, list[list[int]]]:
    """The job's table and its candidate rows (id, partition_id or 0), which the workload updates and reads too."""
    table = seed.PARENT.get(BY_NAME[job].table, BY_NAME[job].table)
    partition = "partition_id" if table in seed.PARENT.values() else "0"
    cur.execute(f"SELECT id, {partition} FROM {table} WHERE id > %s", (before[table],))  # table: a constant
    return table, [list(row) for row in cur.fetchall()]


def bench_job(scenario: Scenario, job: str, candidates: int, rounds: int, log=print) -> JobTraffic:
    """Every contender each round, from the same reset state, in a changing order; every service run must change as
    many rows as the first."""
    figures, cur = JobTraffic(job, candidates), scenario.cur
    before = launched.add_candidates(scenario.engine, scenario.client, job, candidates)
    hot = hot_rows(cur, job, before)
    expected, figures.load = None, [os.getloadavg()[0]]
    with launched._no_autovacuum(cur, launched._met(before)):
        launched.snapshot(cur, job, before)
        for r in range(rounds):
            for contender in launched.round_order(CONTENDERS, r):
                launched.reset(cur, job, before)
                sample = measure(scenario, job, contender, hot)
                figures.samples[contender].append(sample)
                log(f"  {job} round {r + 1} {contender}: {sample.rows:,} rows in {sample.seconds:.2f} s; workload "
                    f"p50 {sample.p50_ms:.1f} p99 {sample.p99_ms:.1f} max {sample.max_ms:.1f} ms, "
                    f"lock wait {sample.lock_ms:.0f} ms ({sample.job_lock_ms:.0f} ms by the job)")
                if contender.startswith("duty"):
                    expected = sample.rows if expected is None else expected
                    if sample.rows != expected:
                        raise AssertionError(f"{job} {contender} changed {sample.rows} rows, the first {expected}")
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


def bench_traffic(env: dict[str, str], *, rows: int, candidates: int, rounds: int, jobs: list[str],
                  rate: float = RATE, log=print) -> list[JobTraffic]:
    """The tables grown to ``rows`` (the others a tenth), then each job's rounds (:func:`bench_job`)."""
    os.environ.update({n: env[n] for n in ("DAGSTER_HOME", "CI_CLEANUP_DAGSTER_PG_URL") if env.get(n)})
    url = env["CI_CLEANUP_DATABASE_URL"]
    engine = create_engine(url, pool_size=bulk_delete.MAX_BUCKETS_HIGH_CONCURRENCY)
    client = redis.Redis.from_url(env["CI_CLEANUP_REDIS_URL"])
    create_schema(engine)
    log(f"Tables at {rows:,} rows")
    seed.grow(engine, rows, log)
    admin = connect(url)
    results = []
    try:
        cur = admin.cursor()
        cur.execute(f"CREATE SCHEMA IF NOT EXISTS {launched.TEMPLATE}")
        cur.execute(f"CREATE SEQUENCE IF NOT EXISTS {JOB_IDS} START 1000000000000")
        cur.execute("TRUNCATE " + ", ".join(launched.SIDE_TABLES))
        with (tempfile.TemporaryDirectory(prefix="ci_cleanup_traffic_") as logs, high_concurrency(engine),
              launched._no_checkpoint_mid_run(engine, log)):
            scenario = Scenario(env, engine, client, cur, Path(logs), background(cur), rate)
            for job in jobs:
                log(f"{job}: {candidates:,} candidates, {rounds} rounds of {' / '.join(CONTENDERS)}")
                results.append(bench_job(scenario, job, candidates, rounds, log))
                results[-1].rows = rows
    finally:
        admin.close()
        engine.dispose()
    return results


# -- the section ---------------------------------------------------------------------------------------------------


def table(results: list[JobTraffic]) -> str:
    head = ("| job | run | workload p50 / p99 / max ms | p99 ratio (≤1.5) "
            "| longest lock wait ms: any / the job's (≤200) | job rows/s (≥5,000) | WAL bytes / changed row "
            "| meets the targets |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        for c in CONTENDERS:
            p50, p99, top = (r.median(c, lambda s, k=k: getattr(s, k)) for k in ("p50_ms", "p99_ms", "max_ms"))
            lock = f"{max(s.lock_ms for s in r.samples[c]):.0f} / {r.job_lock_ms(c):.0f}"
            if c == ALONE:
                lines.append(f"| {r.job} | {c} | {p50:.1f} / {p99:.1f} / {top:.1f} | | {lock} | | | |")
                continue
            lines.append(f"| {r.job} | {c} | {p50:.1f} / {p99:.1f} / {top:.1f} | {r.ratio(c):.2f} | {lock} "
                         f"| {r.rows_per_s(c):,.0f} | {r.wal_per_row(c):,.0f} | {'yes' if r.meets(c) else 'no'} |")
    return "\n".join(lines)


def figure_lines(results: list[JobTraffic]) -> str:
    """``gitlab_p99_ratio_max=`` at the jobs' own settings (launched), then the same for each duty cycle, and the
    widest duty cycle that meets every target, per job."""
    lines = [f"gitlab_p99_ratio_max={p99_ratio_max(results):.2f}",
             f"gitlab_job_lock_wait_ms_max={max(r.job_lock_ms(LAUNCHED) for r in results):.0f}"]
    lines += [f"gitlab_p99_ratio_max_duty_{d:g}={p99_ratio_max(results, f'duty {d:g}'):.2f}" for d in DUTY_CYCLES]
    lines += [f"duty_cycle_meeting_targets_{r.job}={r.best_duty()}" for r in results]
    return "\n".join(lines)


def section(results: list[JobTraffic], *, rows: int, rounds: int, rate: float, context: str) -> str:
    return f"""{HEADING}

{context}

A synthetic GitLab workload (`tools/ci_cleanup_dev/bench/workload.py`, a process of its own on {CLIENTS} connections)
at {rate:g} transactions/s: 40 % a runner's update of its build by id (`lock_version + 1`, as optimistic locking
writes it), 20 % an artifact inserted for a new job, 40 % reads by id of builds and artifacts; a fifth of the updates
and reads on the job's own candidate rows (updates where those are builds). Its latency is each transaction's own,
BEGIN to COMMIT.
`ci_builds` and `ci_job_artifacts` at {rows:,} rows before the candidates (the other tables a tenth), each job's
candidates added on top. Per job, {rounds} rounds; in each, every run starts from the same reset state (the
launched-jobs section's), in an order that changes between rounds:

- "alone": the workload for {ALONE_S} s with no job; "launched": the job as it is, `dagster job execute`, at its
  defaults (schedule_bulk_delete_job_artifacts at 10 buckets: the high-concurrency flag on), its window the run
  record's start → end; "duty D": the job's service in process (no Dagster), braked from outside by its batch
  callback with `Brake(D)`'s rule: after each batch (each bucket worker's) a pause of the batch's time × (1 − D) / D.
- Latencies of the transactions that started inside the job's window; p50, p99, max and rows/s the median of the
  rounds'; "p99 ratio" each round's p99 over the same round's alone p99, the median of the rounds'.
- Lock waits: the workload's sessions set `log_lock_waits` and `deadlock_timeout = {LOCK_LOG_MS}ms`, so each of its
  waits longer than that is logged with the lock's holder; "the job's" are those whose holder is not the workload's own
  backend; the longest over every round (0: none over {LOCK_LOG_MS} ms).
- WAL: `pg_current_wal_lsn()` before and after the window, less the workload's own WAL rate alone (its round's) over as
  long, per changed row; the launched job's includes its Dagster instance's writes (same server).
- The last lines: `gitlab_p99_ratio_max=` the worst job's ratio at its own settings (launched; target ≤ 1.5),
  `gitlab_job_lock_wait_ms_max=` the longest lock wait a launched job caused (target ≤ 200), the ratio per duty
  cycle, and per job the widest duty cycle that meets all three targets (≤ 1.5, ≤ 200 ms, ≥ 5,000 rows/s).

{table(results)}

{figure_lines(results)}
"""


def with_section(markdown: str, text_: str) -> str:
    """BENCHMARKS.md with this section (up to the next one) replaced by ``text_``, or ``text_`` added at its end."""
    before, found, after = markdown.partition(HEADING)
    if not found:
        return markdown.rstrip("\n") + "\n\n" + text_
    rest = after.split("\n## ", 1)
    return before + text_ + ("\n## " + rest[1] if len(rest) > 1 else "")


def merged(path: Path | None, results: list[JobTraffic]) -> list[JobTraffic]:
    """``results`` with the other jobs' from an earlier run stored at ``path`` (a job measured again replaces its
    own), in the jobs' order; all of them stored back. Lets the jobs be measured one at a time, when the machine
    is quiet."""
    if path is None:
        return results
    stored = {r["job"]: JobTraffic.from_dict(r) for r in json.loads(path.read_text())} if path.is_file() else {}
    stored.update({r.job: r for r in results})
    order = [job.name for job in JOBS]
    every = sorted(stored.values(), key=lambda r: order.index(r.job))
    path.write_text(json.dumps([asdict(r) for r in every], indent=1))
    return every


def main(env: dict[str, str], args) -> None:
    sizes = SMALL if args.small else dict(rows=args.traffic_rows, candidates=args.candidates,
                                          rounds=args.traffic_rounds)
    jobs = args.jobs.split(",") if args.jobs else [job.name for job in JOBS]
    results = bench_traffic(env, jobs=jobs, rate=args.rate, **sizes)
    results = merged(Path(args.traffic_results) if args.traffic_results else None, results)
    now = dt.datetime.now(dt.UTC)
    loads = "; ".join(f"{r.job} {r.load[0]:.2f} → {r.load[1]:.2f}" for r in results)
    context = (f"Written by `ci-cleanup bench --traffic{' --small' if args.small else ''}` on {now:%Y-%m-%d %H:%M} "
               f"UTC: {machine()}; PostgreSQL: {postgres_settings(env['CI_CLEANUP_DATABASE_URL'])}; "
               f"{sizes['candidates']:,} candidates per job. The 1-minute load average before and after each job's "
               f"rounds (a shared 2-core machine: compare within one job): {loads}.")
    text_ = section(results, rows=max(r.rows for r in results), rounds=min(len(r.samples[ALONE]) for r in results),
                    rate=args.rate, context=context)
    print(text_)
    if args.output:
        path = Path(args.output)
        path.write_text(with_section(path.read_text() if path.is_file() else "# Benchmarks\n", text_))
        print(f"\nWritten to {args.output}")
