"""``ci-cleanup bench``: every job as the daemon runs it against its true floor, and each job's service at two
table sizes.

One run, one database: background rows at ``small_rows`` (ci_builds / ci_job_artifacts; the other
tables a tenth), then grown to ``big_rows``. Part 1, the services (no Dagster): at each size every job and its
raw SQL loop alternate, each run on ``work`` fresh candidates (:func:`alternate`); per-batch latency is the median
time between the service's batch callbacks. Throughput is measured at the big size for the service, a SQLAlchemy
raw SQL loop (same batch size) and the per-row loop (on ``work // 10`` candidates: it is the slow one). Peak memory
is the Python heap (tracemalloc) and RSS of a subprocess running the service at 1 k and at ``memory_candidates``
candidates. Part 2 (:mod:`ci_cleanup_dev.bench.launched`), on the big tables: every Dagster job launched as
operators run it against its psycopg2 floor, in alternating rounds from one reset state; then each job
launched with nothing to do, and a scheduled run through dagster-daemon with nothing to do.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from ci_cleanup.gitlab.release import KNOWN
from ci_cleanup.gitlab.schema import gitlab_schema
from ci_cleanup_dev.ddl import RELEASES, create_schema, truncate_all

from ..batches import BY_NAME, JOBS
from . import launched, seed
from .jobs import BenchJob
from .server import machine, postgres_settings

if TYPE_CHECKING:
    pass

LABEL = {"job": "service", "raw": "raw SQL", "per_row": "per-row"}  # part 1 times the services, not the jobs


@dataclass
class Figures:
    job: str
    rows_per_s: dict[str, float] = field(default_factory=dict)  # job, raw, per_row
    # small, big: the job's; raw_small, raw_big: the raw SQL loop's
    batch_ms: dict[str, float] = field(default_factory=dict)
    peak_kib: dict[str, float] = field(default_factory=dict)  # small, big: Python heap (tracemalloc)
    rss_mib: dict[str, float] = field(default_factory=dict)  # small, big: the process's peak resident memory

    @property
    def vs_raw(self) -> float:
        return self.rows_per_s["raw"] / self.rows_per_s["job"]

    @property
    def vs_per_row(self) -> float:
        return self.rows_per_s["job"] / self.rows_per_s["per_row"]


def add_candidates(engine: Engine, job: BenchJob, n: int) -> None:
    seed.insert(engine, job.table, n, every=1)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"ANALYZE {seed.PARENT.get(job.table, job.table)}"))


def timed(engine, client, runner) -> tuple[int, float, list[float]]:
    """Rows processed, seconds, and each batch's seconds."""
    marks = [time.perf_counter()]
    rows = runner(engine, client, lambda: marks.append(time.perf_counter()))
    end = time.perf_counter()
    return rows, end - marks[0], [b - a for a, b in zip(marks, marks[1:])]


def alternate(engine: Engine, client, job: BenchJob, runs: list[tuple[str, int]], log
              ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each run's rows per second and every batch's seconds, by way of doing it (``job``, ``raw``, ``per_row``).

    At both table sizes ``runs`` alternates the job and its raw SQL loop ``repeats`` times, and each keeps its median:
    on a shared machine one measurement can land on a busy moment (another process). Every run starts as the
    launched part's do: its table vacuumed (the dead rows of the run before gone, and autovacuum, with nothing left
    to do, not started in the middle of a run: a run's candidates pass its insert threshold at 100 k rows, not at
    10 M), then checkpointed (the writes before it on disk, not in a checkpoint that falls inside some runs).
    """
    speeds: dict[str, list[float]] = {how: [] for how, _ in runs}
    batches_of: dict[str, list[float]] = {how: [] for how, _ in runs}
    for how, n in runs:
        add_candidates(engine, job, n)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f"VACUUM ANALYZE {seed.PARENT.get(job.table, job.table)}"))
            conn.execute(text("CHECKPOINT"))
        rows, seconds, batches = timed(engine, client, getattr(job, how))
        speeds[how].append(rows / seconds)
        batches_of[how] += batches
        log(f"  {job.name} {LABEL[how]}: {rows:,} rows in {seconds:.2f} s")
    return speeds, batches_of


def peak_memory(figures: Figures, size: str, url: str, redis_url: str) -> None:
    """The peak Python heap (KiB) and peak RSS (MiB) of a run of the job, in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, "-m", "ci_cleanup_dev.bench.memory", url, redis_url, figures.job],
        check=True, capture_output=True, text=True,
    ).stdout
    peak = json.loads(out.strip().splitlines()[-1])
    figures.peak_kib[size], figures.rss_mib[size] = peak["peak_kib"], peak["maxrss_kib"] / 1024


def bench(
    env: dict[str, str], *, small_rows: int, big_rows: int, work: int, memory_candidates: int, jobs: list[str],
    repeats: int = 3, log=print,
) -> list[Figures]:
    url, redis_url = env["CI_CLEANUP_DATABASE_URL"], env["CI_CLEANUP_REDIS_URL"]
    engine, client = create_engine(url), redis.Redis.from_url(redis_url)
    create_schema(engine)
    with engine.begin() as conn:  # one run starts from empty tables
        truncate_all(conn, gitlab_schema())
    selected = [BY_NAME[name] for name in jobs]
    figures = {job.name: Figures(job.name) for job in selected}

    log(f"Tables at {small_rows:,} rows")
    seed.grow(engine, small_rows, log)
    for job in selected:
        _, batches_of = alternate(engine, client, job, [("job", work), ("raw", work)] * repeats, log)
        figures[job.name].batch_ms["small"], figures[job.name].batch_ms["raw_small"] = (
            statistics.median(batches_of[how]) * 1000 for how in ("job", "raw"))
    for job in selected:  # memory at 1 k candidates, on the small tables
        add_candidates(engine, job, 1000)
        peak_memory(figures[job.name], "small", url, redis_url)

    log(f"Tables at {big_rows:,} rows")
    seed.grow(engine, big_rows, log)
    for job in selected:
        f = figures[job.name]
        runs = [("job", work), ("raw", work)] * repeats + [("per_row", max(1000, work // 10))]
        speeds, batches_of = alternate(engine, client, job, runs, log)
        f.rows_per_s = {how: statistics.median(values) for how, values in speeds.items()}
        f.batch_ms["big"], f.batch_ms["raw_big"] = (statistics.median(batches_of[how]) * 1000 for how in ("job", "raw"))
        add_candidates(engine, job, memory_candidates)
        peak_memory(f, "big", url, redis_url)
        log(f"  {job.name} memory at {memory_candidates:,} candidates: heap {f.peak_kib['big']:.0f} KiB, "
            f"RSS {f.rss_mib['big']:.1f} MiB")

    # The memory runs changed a million rows of each table minutes ago: ANALYZE, as autovacuum would
    # after such a change, before the launched jobs' part runs on the same tables.
    seed.analyze(engine)
    engine.dispose()
    return list(figures.values())


def table(figures: list[Figures], small_rows: int, big_rows: int, memory_candidates: int) -> str:
    head = (
        "| job | rows/s service | rows/s raw SQL | rows/s per-row | service vs raw (≤1.5) "
        "| service vs per-row (≥10) "
        f"| batch ms @{small_rows:,} | batch ms @{big_rows:,} | ratio (≤1.5) | raw SQL's ratio "
        f"| RSS MiB @1k | RSS MiB @{memory_candidates:,} | ratio (≤1.2) "
        f"| heap KiB @1k | heap KiB @{memory_candidates:,} "
        "| ratio |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for f in figures:
        lines.append(
            f"| {f.job} | {f.rows_per_s['job']:,.0f} | {f.rows_per_s['raw']:,.0f} | {f.rows_per_s['per_row']:,.0f} "
            f"| {f.vs_raw:.2f} | {f.vs_per_row:.1f} | {f.batch_ms['small']:.2f} | {f.batch_ms['big']:.2f} "
            f"| {f.batch_ms['big'] / f.batch_ms['small']:.2f} | {f.batch_ms['raw_big'] / f.batch_ms['raw_small']:.2f} "
            f"| {f.rss_mib['small']:.1f} | {f.rss_mib['big']:.1f} "
            f"| {f.rss_mib['big'] / f.rss_mib['small']:.2f} | {f.peak_kib['small']:,.0f} | {f.peak_kib['big']:,.0f} "
            f"| {f.peak_kib['big'] / f.peak_kib['small']:.2f} |"
        )
    return "\n".join(lines)


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def launched_table(results: list[launched.Launched], bare: list[float]) -> str:
    head = (
        "| job | candidates | batches | job s: launch → RUN_SUCCESS, min / median / max | run record start → end s "
        "| floor s, min / median / max | service s (no Dagster) | job vs floor, start-up included "
        "| job − idle run, vs floor (≤1.15); of medians "
        "| floor rows/s | Dagster ms/batch (job − service) | same, idle run subtracted "
        "| idle `dagster job execute` s, min / median / max (≤2.5) | idle − bare s (≤0.4) "
        "| CPU ms/batch over floor: job − idle run / service | the client's part: job − idle run / service "
        "| PostgreSQL's part, statement by statement; statements a batch, job / floor "
        "| a batch over the floor's: client + PostgreSQL ms (≤0.3) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for f in results:
        lines.append(
            f"| {f.job} | {f.candidates:,} | {f.batches:,} | {_spread(f.seconds['job'])} "
            f"| {f.median('run_record'):.2f} "
            f"| {_spread(f.seconds['floor'])} | {_spread(f.seconds['service'])} | {f.vs_floor:.2f} "
            f"| {f.work_vs_floor:.2f}; {f.work_vs_floor_of_medians:.2f} | {f.rows / f.median('floor'):,.0f} "
            f"| {f.dagster_ms_per_batch:.2f} | {f.dagster_ms_per_batch_after_startup:.2f} | {_spread(f.idle)} "
            f"| {f.idle_over_bare:.2f} "
            f"| {_cpu_over_floor(f)} | {_cpu_over_floor(f, client_only=True)} | {_postgres_part(f)} "
            f"| {'not measured' if _batch_cost(f) is None else f'{_batch_cost(f):.2f}'} |"
        )
    return "\n".join(lines)


def _cpu_over_floor(f: launched.Launched, client_only: bool = False) -> str:
    over = [f.cpu_ms_per_batch_over_floor(contender, client_only=client_only) for contender in ("job", "service")]
    return "not measured" if None in over else " / ".join(f"{ms:.2f}" for ms in over)


def _postgres_part(f: launched.Launched) -> str:
    if f.postgres is None:
        return "not measured"
    job, floor = f.postgres.statements
    return (f"{f.postgres.ms:.2f} ({', '.join(f'{ms:.2f}' for ms in f.postgres.over_floor_ms)}); "
            f"{job:g} / {floor:g}")


def _batch_cost(f: launched.Launched) -> float | None:
    """A 100-row batch's cost beyond the floor's: the client's part of the launched job's CPU and PostgreSQL's part
    measured statement by statement; per 100 rows for a job of bigger batches (stuck_export_jobs' 1,000-row chunks)."""
    client = f.cpu_ms_per_batch_over_floor("job", client_only=True)
    if client is None or f.postgres is None:
        return None
    return (client + f.postgres.ms) / max(1.0, f.rows / max(1, f.batches) / 100)


def launched_figures(results: list[launched.Launched], bare: list[float]) -> str:
    """The figure lines that end the launched jobs' section, each the worst job's: its idle run, its work against
    its floor (the idle run taken off), its idle run over the bare Dagster job's, and (where PostgreSQL's processes
    can be read) its CPU per batch beyond the floor's, and the client's part of it."""
    cpu = [f.cpu_ms_per_batch_over_floor("job") for f in results]
    client = [f.cpu_ms_per_batch_over_floor("job", client_only=True) for f in results]
    cost = [_batch_cost(f) for f in results]
    return (f"cli_idle_s={max(f.idle_s for f in results):.2f}\n"
            f"work_vs_floor_max={max(f.work_vs_floor for f in results):.2f}\n"
            f"startup_over_bare_s={max(f.idle_over_bare for f in results):.2f}"
            + ("" if None in cpu else f"\nbatch_cpu_over_floor_ms_max={max(cpu):.2f}"
               f"\nbatch_client_cpu_over_floor_ms_max={max(client):.2f}")
            + ("" if None in cost else f"\nbatch_cost_over_floor_ms_max={max(cost):.2f}"))


def deployed_table(results: list[launched.Launched]) -> str:
    lines = ["| job | direct s, min / median / max | deployed s, min / median / max | deployed / direct (≤1.1) |",
             "|---|---|---|---|"]
    for f in results:
        lines.append(f"| {f.job} | {_spread(f.seconds['job'])} | {_spread(f.seconds[launched.DEPLOYED])} "
                     f"| {f.deployed_vs_direct:.2f} |")
    return "\n".join(lines)


DEPLOYED_HEADING = "## GitLab as deployed: two database URLs through PgBouncer"


def deployed_section(results: list[launched.Launched], separate_run: str = "") -> str:
    """BENCHMARKS.md's "GitLab as deployed" section, ending with its figure line; empty when not measured.
    ``separate_run``: how it was measured when not in the headline's run (``ci-cleanup bench --deployed``)."""
    measured = [f for f in results if f.deployed_vs_direct is not None]
    if not measured:
        return ""
    return f"""
{DEPLOYED_HEADING}
{separate_run}
The jobs launched as in the table above ("job", direct), alternating in each round with "deployed":
`CI_CLEANUP_DATABASE_URL` and `CI_CLEANUP_CI_DATABASE_URL` each through Debian's PgBouncer in transaction
pooling ({launched.DEPLOYED_POOL} server connections per database), as GitLab.com and the reference
architectures run. Both aliases reach the bench's one database, so both layouts work on identical rows and
leave identical digests (asserted): the ratio is what the deployed path costs (a connection and a transaction
per database, PgBouncer in between), start-up included. "deployed / direct" is the median of the rounds'
ratios (the two launches of a round run back to back).

{deployed_table(measured)}

deployed_vs_direct_max={max(f.deployed_vs_direct for f in measured):.2f}
"""


def _load(values: tuple[float, float, float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


LAUNCHED_HEADING = "## The jobs as the daemon runs them, against their floor"


# How the headline section is measured, before its table (launched_section fills it in).
LAUNCHED_METHOD = """\
{candidates:,} candidates per job in the {big_rows:,}-row tables, {rounds} rounds after an untimed one
(warm caches from the first counted round on); in each round the job, its floor, its service and its idle run each start
from the same reset state (the idle run's without the candidates; the others' with them: the candidates deleted and
vacuumed, then restored from a template with triggers off: in the same pages every time; then every table a run may
change vacuumed and analyzed: no dead rows of the run before; autovacuum off for those tables while the rounds run, so
that it takes none of them inside one run and not another; then checkpointed: the reset's writes on disk before the
run, not in a checkpoint that falls inside some runs), in an order that changes between rounds (rotated, and reversed
every other cycle: each contender takes every place in turn); every run must leave the tables exactly as the first one
did (digest of the changed tables, asserted), and no idle run may change anything.

- "job": `dagster job execute -m ci_cleanup -j JOB` in a subprocess on `deploy/dagster.yaml` (PostgreSQL
  storage, the job's own executor), from launch to the run's RUN_SUCCESS, start-up included; "run record": the
  run's own start → end.
- "floor": plain psycopg2, one database round trip per batch (stuck_export_jobs: one more to Redis per chunk), the
  job's guards and side rows (`tools/ci_cleanup_dev/bench/floor.py`);
  schedule_bulk_delete_job_artifacts' five bucket workers
  at once, each on a connection of its own, as its job runs them. It sends its statement text each batch: no
  session-level PREPARE, the jobs' rule, since GitLab reaches PostgreSQL through PgBouncer in transaction pooling
  (`prepared_statements: false`), where a prepared statement does not outlive its transaction.
- "service": the job's service function in process, without Dagster (bulk delete's bucket workers one after the
  other, on one connection). The floor and the service each open a new connection per run, as each launched job's
  process does (a new PostgreSQL backend maps the shared buffers it touches anew: 0.3-0.4 s of environments' 8.5 s).
  "Dagster ms/batch": (job − service) / batches (median of the rounds'); "idle run subtracted" takes the round's idle
  run off first.
- "idle": the same `dagster job execute` with nothing to do, a contender of each round like the others, timed as the
  job is (launch → RUN_SUCCESS), on the big tables as they were before the candidates, vacuumed (as autovacuum keeps
  them between runs) and checkpointed. "job − idle run, vs floor": (job − idle) / floor of each round, the median of
  the rounds': the job's work against the floor's, without the start-up (target ≤ 1.15); the figure after it, from
  the three contenders' medians (each from whichever round), shows how much the pairing moves it. After the rounds,
  the idle run again, whole process, {idle_runs} times: "idle `dagster job execute`" (target ≤ 2.5 s).
- "CPU ms/batch over floor": the CPU of every run above, the client's processes (the launch and its children, or this
  process for the floor and the service) and PostgreSQL's (its postmaster and every child, read from `/proc`) together,
  per round, medians of the rounds': the launched job's with its round's idle run's taken off, and the service's, each
  less the round's floor's, per batch. CPU leaves out the waits that wall time counts, not a slower
  moment of the machine: on this shared 2-core machine, PostgreSQL's CPU for stale_runner_machines_cleanup's service ran
  1.73-2.39 s in 7 runs of the same 100 k deletions. "The client's part" is the same figure for the client's processes
  alone: what ci_cleanup and Dagster spend per batch in Python (statements built, results read, events and observations
  written). The whole figure is kept as a check; it cannot resolve the budget: the same run's PostgreSQL CPU moves by
  about ±0.5 ms a batch from one run to the next.
- "PostgreSQL's part, statement by statement" (`tools/ci_cleanup_dev/bench/statements.py`): after the rounds,
  the job run once in
  process with its own resources (its statement timeout, its transactions) and the floor once, every statement each
  sends recorded; then, {replay_pairs} pairs of times from the same reset state, on one new connection, the
  batches sent again alternating, batch i as the job sent it and batch i + 1 as the floor did, the other way round in
  the pair's second replay; the backend's CPU around each batch from `/proc/<pid>/schedstat`. Each batch's two costs
  (job, floor) come from the pair's two replays; the figure is the median over the batches of the difference, the
  median over the pairs (each pair's in brackets). Batches of either side do the same work: the tables after every
  replay are the rounds' (asserted). "statements a batch": what each side sends a batch (median), all of it replayed.
  "A batch over the floor's" is the client's part plus this, per 100 rows for stuck_export_jobs' 1,000-row chunks
  (target ≤ 0.3 ms).
- Dagster's own cost per launched run: a bare Dagster job (one op that does nothing, a code location importing only
  Dagster, `tools/ci_cleanup_dev/bench/bare_job.py`) launched the same way, beside each idle run (the two in alternating
  order): {bare} s over all jobs. It exits as the jobs' processes do (`gc.freeze()` at exit, no final
  garbage collection). "idle − bare" (the median of a job's {idle_runs} pairs) is what a job's own
  start-up adds to Dagster's: its imports, resources, schema check, lease, run start and end (target ≤ 0.4 s).
- A scheduled run through dagster-daemon with nothing to do, from the run its tick created to RUN_SUCCESS:
  {daemon} (target ≤ 6 s).
- The last lines, each the worst job's: `cli_idle_s=` its idle run, `work_vs_floor_max=` its work against its
  floor, `startup_over_bare_s=` its idle run over the bare job's, `batch_cpu_over_floor_ms_max=` its launched
  CPU per batch over the floor's, `batch_client_cpu_over_floor_ms_max=` the client's part of it,
  `batch_cost_over_floor_ms_max=` a batch's cost beyond the floor's (client + PostgreSQL's statements).
"""


def launched_section(results: list[launched.Launched], bare: list[float], args, daemon_s: float | None,
                     separate_run: str = "") -> str:
    """BENCHMARKS.md's headline section, ending with its figure lines. ``separate_run``: how it was measured when
    not in the services' run (``ci-cleanup bench --launched``)."""
    daemon = f"{daemon_s:.2f} s" if daemon_s is not None else "not measured (--no-daemon)"
    method = LAUNCHED_METHOD.format(
        candidates=args.candidates, big_rows=args.big_rows, rounds=args.rounds, idle_runs=launched.IDLE_RUNS,
        replay_pairs=launched.REPLAY_PAIRS, bare=_spread(bare), daemon=daemon)
    return f"""{LAUNCHED_HEADING}
{separate_run}
{method}
{launched_table(results, bare)}

{launched_figures(results, bare)}
"""


def write_markdown(path: Path, services: str, results: list[launched.Launched], *, args, server: str, load: dict,
                   daemon_s: float | None, bare: list[float]) -> None:
    now = dt.datetime.now(dt.UTC)
    headline = args.big_rows >= 10_000_000 and args.candidates >= 100_000
    small = ("\n- Smaller than the headline's 100 k candidates in 10 M rows: the jobs' times are mostly start-up, so"
             "\n  ratios to the floor say little about the targets.") if not headline else ""
    path.write_text(f"""# Benchmarks

Written by `ci-cleanup bench{' --small' if args.small else ''}` on {now:%Y-%m-%d %H:%M} UTC.

- Machine: {machine()}; PostgreSQL: {server}. Embedded (pgserver) unless CI_CLEANUP_DATABASE_URL was set,
  with Omnibus GitLab's memory and planner settings (`omnibus_postgres` in `tools/ci_cleanup_dev/bench/server.py`),
  and its
  backends' heap held (glibc's `MALLOC_*` in its environment, `HELD_HEAP` there): with glibc's defaults, which
  statement a new connection ran first decided whether every later one's planning memory was faulted in again:
  environments' statement cost PostgreSQL 0.5-0.7 ms a batch more than its floor's, each on its own connection,
  and the same when the two alternated on one.
- Load average (1 / 5 / 15 min): {_load(load['before'])} before, {_load(load['after'])} after. On a shared
  2-core machine the figures are noisy: compare ratios within one run, and the min / median / max spread.{small}
- Table sizes: `ci_builds` and `ci_job_artifacts` at {args.small_rows:,} then {args.big_rows:,} rows (builds and
  artifacts over partitions 100, 101, 102); runner machines, export jobs and environments a tenth of that
  (GitLab.com's mix, `tools/ci_cleanup_dev/bench/seed.py`), on GitLab's real DDL and its indexes only.

{launched_section(results, bare, args, daemon_s)}{deployed_section(results)}
## The services: throughput, batch latency, memory

{args.work:,} candidates per service and per way of doing it ({max(1000, args.work // 10):,} for the per-row loop);
at both sizes the service and the raw SQL loop alternate {args.repeats} times, each run on its table vacuumed and
checkpointed, each figure the median; peak memory at 1,000 and {args.memory_candidates:,} candidates, of a
subprocess running the service: its peak resident set and the peak of the Python heap traced by tracemalloc (no
collection forced between batches).

- "raw SQL": a SQLAlchemy loop of one set-based statement per batch of the same size (not the floor above);
  "per-row": read each row, then write it guarded by what was read, one transaction per row (GitLab's `drop!`).
- "batch ms": the median time of a batch on the small and the big tables; "raw SQL's ratio" is the same ratio
  for the raw SQL loop, which shows how much of the growth is PostgreSQL's own work.

{services}
""")


SMALL = dict(small_rows=10_000, big_rows=200_000, work=2_000, memory_candidates=10_000, candidates=5_000, repeats=1)


def deployed_only(env: dict[str, str], args, jobs: list[str]) -> None:
    """``--deployed``: the launched jobs direct and as deployed, alternating, on the tables as they are, grown to
    ``big_rows`` (a candidate left by an earlier run would change a later round's digest: the run fails); the
    "GitLab as deployed" section of ``args.output`` replaced by this run's (or added before the services')."""
    if not launched.has_pgbouncer():
        raise SystemExit("bench --deployed needs Debian's pgbouncer (apt-get install pgbouncer)")
    engine = create_engine(env["CI_CLEANUP_DATABASE_URL"])
    create_schema(engine)
    load = {"before": os.getloadavg()}
    log = print
    log(f"Tables at {args.big_rows:,} rows")
    seed.grow(engine, args.big_rows, log)
    engine.dispose()
    results = launched.bench_launched(env, candidates=args.candidates, rounds=args.rounds, jobs=jobs,
                                      contenders=("job",))
    load["after"] = os.getloadavg()
    now = dt.datetime.now(dt.UTC)
    section = deployed_section(results, separate_run=f"""
Written by `ci-cleanup bench --deployed` on {now:%Y-%m-%d %H:%M} UTC, a run of its own after the headline's:
{machine()}; PostgreSQL: {postgres_settings(env["CI_CLEANUP_DATABASE_URL"])}; {args.candidates:,} candidates
per job in {args.big_rows:,}-row tables, {args.rounds} rounds; load average {_load(load['before'])} before,
{_load(load['after'])} after.
""")
    print(section)
    if args.output:
        path = Path(args.output)
        path.write_text(with_deployed_section(path.read_text(), section))
        print(f"\nWritten to {args.output}")


def launched_only(env: dict[str, str], args, jobs: list[str]) -> None:
    """``--launched``: the headline (each job launched, against its floor and its service, with its idle runs, the
    bare Dagster job and the daemon's scheduled run) on the tables as they are, grown to ``big_rows``; its section
    of ``args.output`` replaced by this run's, the others kept."""
    engine = create_engine(env["CI_CLEANUP_DATABASE_URL"])
    create_schema(engine, release=args.release)
    if args.release:
        require_release(engine, args.release)
        seed.borrow_indexes(engine, args.release)
    load = {"before": os.getloadavg()}
    print(f"Tables at {args.big_rows:,} rows")
    seed.grow(engine, args.big_rows, print)
    engine.dispose()
    results = launched.bench_launched(env, candidates=args.candidates, rounds=args.rounds, jobs=jobs, deployed=False)
    daemon_s = None if args.no_daemon else launched.daemon_idle_seconds(env)
    bare = [seconds for f in results for seconds in f.bare]
    load["after"] = os.getloadavg()
    now = dt.datetime.now(dt.UTC)
    section = launched_section(results, bare, args, daemon_s, separate_run=f"""
Written by `ci-cleanup bench --launched` on {now:%Y-%m-%d %H:%M} UTC, a run of its own (the services' section below
is from the run the heading names): {machine()}; PostgreSQL:
{postgres_settings(env["CI_CLEANUP_DATABASE_URL"])}; load average {_load(load['before'])} before,
{_load(load['after'])} after.
""")
    print(section)
    if args.output:
        path = Path(args.output)
        if args.release:
            line = release_line(args.release, results, bare, args, now)
            path.write_text(with_release_line(path.read_text(), args.release, line))
        else:
            path.write_text(with_launched_section(path.read_text(), section))
        print(f"\nWritten to {args.output}")


def require_release(engine: Engine, release: str) -> None:
    """Stop unless the database's GitLab tables are ``release``'s (create_schema leaves tables already there)."""
    with engine.connect() as conn:
        found = seed.detected_release(conn)
    if found != KNOWN[release]:
        raise SystemExit(f"--release {release}: the database holds another GitLab schema (like "
                         f"{', '.join(found.metadata()['gitlab_release_like']) or 'none vendored'}): bench into a "
                         "database of its own")


RELEASES_HEADING = "## The same jobs on other GitLab releases' schemas"


def release_line(release: str, results: list[launched.Launched], bare: list[float], args, now: dt.datetime) -> str:
    """One line of :data:`RELEASES_HEADING`: the headline's figures, measured the same way on ``release``'s DDL."""
    figures = launched_figures(results, bare).replace("\n", ", ")
    return (f"- GitLab {release} (`{RELEASES[release]}`), `ci-cleanup bench --launched --release {release}` on "
            f"{now:%Y-%m-%d %H:%M} UTC, {args.candidates:,} candidates per job in {args.big_rows:,}-row tables, "
            f"{args.rounds} rounds: {figures}")


def with_release_line(markdown: str, release: str, line: str) -> str:
    """BENCHMARKS.md with ``release``'s line of :data:`RELEASES_HEADING` replaced by ``line``; the section, when
    missing, goes after the headline's (which ``--launched`` replaces up to the next section: it keeps this one)."""
    if RELEASES_HEADING not in markdown:
        headline_end = markdown.index("\n## ", markdown.index(LAUNCHED_HEADING) + 1)
        markdown = (f"{markdown[:headline_end]}\n{RELEASES_HEADING}\n\n{RELEASES_NOTE}\n"
                    f"{markdown[headline_end:]}")
    before, heading, after = markdown.partition(RELEASES_HEADING)
    section, rest = after.split("\n## ", 1) if "\n## " in after else (after, None)
    note, _, lines = section.strip("\n").partition("\n\n- GitLab ")
    lines = [f"- GitLab {kept}" for kept in lines.split("\n- GitLab ") if kept]
    ours = [i for i, kept in enumerate(lines) if kept.startswith(f"- GitLab {release} ")]
    if ours:
        lines[ours[0]] = line
    else:
        lines.append(line)
    section = "\n".join([note, "", *lines])
    return f"{before}{heading}\n\n{section}\n" + (f"\n## {rest}" if rest is not None else "")


RELEASES_NOTE = """The headline's figures on a vendored release's DDL (`tools/ci_cleanup_dev/ddl/versions/`), seeded and
run as above; a release whose DDL ships no non-unique index gets 0016ea05's on its tables, where its columns
allow."""


def with_launched_section(markdown: str, section: str) -> str:
    """BENCHMARKS.md with its headline section (up to the next section: every figure line goes with it) replaced by
    ``section``."""
    before, found, after = markdown.partition(LAUNCHED_HEADING)
    if not found:
        raise SystemExit(f"{LAUNCHED_HEADING!r} not found: run the whole benchmark first")
    return before + section + "\n## " + after.split("\n## ", 1)[1]


def with_deployed_section(markdown: str, section: str) -> str:
    """BENCHMARKS.md with its "GitLab as deployed" section (up to its figure line) replaced by ``section``, or
    ``section`` put before the services' section when it has none."""
    before, found, after = markdown.partition("\n" + DEPLOYED_HEADING)
    if found:
        return before + section + after.split("\ndeployed_vs_direct_max=", 1)[1].split("\n", 1)[1]
    before, found, after = markdown.partition("\n## The services")
    return before + section + found + after


def check_output(args) -> None:
    """``--launched`` and ``--deployed`` replace their section of a file the whole benchmark wrote: checked before
    the minutes of measuring, not after."""
    if args.release and not args.launched:
        raise SystemExit("--release measures the headline only: add --launched")
    if not args.output or not (args.launched or args.deployed):
        return
    path = Path(args.output)
    if not path.is_file():
        raise SystemExit(f"--output {path}: no such file. --launched and --deployed replace their section of a "
                         "BENCHMARKS.md the whole benchmark wrote (--output '' prints the section only)")
    if args.launched:
        with_launched_section(path.read_text(), "")  # exits naming the heading when the file has none


def main(env: dict[str, str], args) -> None:
    if getattr(args, "traffic", False):
        from . import traffic

        traffic.main(env, args)
        return
    check_output(args)
    if args.small:  # a development run of a few minutes; the figures are not the headline's
        for name, value in SMALL.items():
            setattr(args, name, value)
    jobs = args.jobs.split(",") if args.jobs else [job.name for job in JOBS]
    if args.deployed:
        deployed_only(env, args, jobs)
        return
    if args.launched:
        launched_only(env, args, jobs)
        return
    load = {"before": os.getloadavg()}
    figures = bench(env, small_rows=args.small_rows, big_rows=args.big_rows, work=args.work,
                    memory_candidates=args.memory_candidates, jobs=jobs, repeats=args.repeats)
    services = table(figures, args.small_rows, args.big_rows, args.memory_candidates)
    print()
    print(services)
    results = launched.bench_launched(env, candidates=args.candidates, rounds=args.rounds, jobs=jobs)
    daemon_s = None if args.no_daemon else launched.daemon_idle_seconds(env)
    bare = [seconds for f in results for seconds in f.bare]
    load["after"] = os.getloadavg()
    print()
    print(launched_table(results, bare))
    server = postgres_settings(env["CI_CLEANUP_DATABASE_URL"])
    if args.output:
        write_markdown(Path(args.output), services, results, args=args, server=server, load=load, daemon_s=daemon_s,
                       bare=bare)
        print(f"\nWritten to {args.output}")
    print(launched_figures(results, bare))
