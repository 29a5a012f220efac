"""``ci-cleanup bench``: every job against its raw-SQL floor and a per-row loop, at two table sizes.

One run, one database: background rows at ``small_rows`` (ci_builds / ci_job_artifacts; the other
tables a tenth), then grown to ``big_rows``. At each size every job gets ``work`` fresh candidates;
per-batch latency is the median time between the job's batch callbacks. Throughput is measured at
the big size for the job, the raw SQL loop (same batch size) and the per-row loop (on
``work // 10`` candidates: it is the slow one). Peak memory is the Python heap (tracemalloc) of a
subprocess running the job at 1 k and at ``memory_candidates`` candidates. Finally each Dagster
job runs in process with nothing to do.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from ..gitlab.schema import create_schema, gitlab_schema, truncate_all
from . import seed
from .jobs import BY_NAME, JOBS, BenchJob

SMALL_TABLES = ("ci_builds", "ci_job_artifacts")  # the other tables are a tenth of these (GitLab.com's mix)


@dataclass
class Figures:
    job: str
    rows_per_s: dict[str, float] = field(default_factory=dict)  # job, raw, per_row
    batch_ms: dict[str, float] = field(default_factory=dict)  # small, big: the job's; raw_small, raw_big: the raw SQL loop's
    peak_kib: dict[str, float] = field(default_factory=dict)  # small, big: Python heap (tracemalloc)
    rss_mib: dict[str, float] = field(default_factory=dict)  # small, big: the process's peak resident memory
    idle_s: float = 0.0

    @property
    def vs_raw(self) -> float:
        return self.rows_per_s["raw"] / self.rows_per_s["job"]

    @property
    def vs_per_row(self) -> float:
        return self.rows_per_s["job"] / self.rows_per_s["per_row"]


def _rows(table: str, rows: int) -> int:
    return rows if table in SMALL_TABLES else rows // 10


def grow(engine: Engine, rows: int, log) -> None:
    """Background rows (no candidates) up to ``rows`` in the two big tables, a tenth in the others."""
    with engine.connect() as conn:
        for table in seed.INSERTS:
            have = conn.scalar(text(f"SELECT count(*) FROM {seed.PARENT.get(table, table)}"))
            started = time.monotonic()
            seed.insert(engine, table, max(0, _rows(table, rows) - have))
            log(f"  {table}: {_rows(table, rows):,} rows ({time.monotonic() - started:.1f} s)")
    seed.analyze(engine)


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


def peak_memory(figures: Figures, size: str, url: str, redis_url: str) -> None:
    """The peak Python heap (KiB) and peak RSS (MiB) of a run of the job, in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, "-m", "ci_cleanup.bench.memory", url, redis_url, figures.job], check=True, capture_output=True, text=True
    ).stdout
    peak = json.loads(out.strip().splitlines()[-1])
    figures.peak_kib[size], figures.rss_mib[size] = peak["peak_kib"], peak["maxrss_kib"] / 1024


def idle_run_seconds(env: dict[str, str]) -> dict[str, float]:
    """Each Dagster job in process, on the big tables with nothing to do."""
    from dagster import DagsterInstance

    from ..definitions import defs
    from ..resources import GitLabDatabase, GitLabRedis, RunOptions

    resources = {
        "gitlab_db": GitLabDatabase(url=env["CI_CLEANUP_DATABASE_URL"]),
        "gitlab_redis": GitLabRedis(url=env["CI_CLEANUP_REDIS_URL"]),
        "run_options": RunOptions(),
    }
    seconds = {}
    with DagsterInstance.ephemeral() as instance:
        for job in JOBS:
            definition = defs.resolve_job_def(job.name)
            started = time.perf_counter()
            result = definition.execute_in_process(
                run_config={"loggers": {"console": {"config": {"log_level": "WARNING"}}}},
                resources=resources, instance=instance, raise_on_error=False,
            )
            seconds[job.name] = time.perf_counter() - started
            assert result.success, f"{job.name} failed with nothing to do"
    return seconds


def bench(
    env: dict[str, str], *, small_rows: int, big_rows: int, work: int, memory_candidates: int, jobs: list[str], repeats: int = 3, log=print
) -> list[Figures]:
    url, redis_url = env["CI_CLEANUP_DATABASE_URL"], env["CI_CLEANUP_REDIS_URL"]
    engine, client = create_engine(url), redis.Redis.from_url(redis_url)
    create_schema(engine)
    with engine.begin() as conn:  # one run starts from empty tables
        truncate_all(conn, gitlab_schema())
    selected = [BY_NAME[name] for name in jobs]
    figures = {job.name: Figures(job.name) for job in selected}

    log(f"Tables at {small_rows:,} rows")
    grow(engine, small_rows, log)
    for job in selected:
        for how, size in (("job", "small"), ("raw", "raw_small")):
            add_candidates(engine, job, work)
            rows, seconds, batches = timed(engine, client, getattr(job, how))
            figures[job.name].batch_ms[size] = statistics.median(batches) * 1000
            log(f"  {job.name} {how}: {rows:,} rows in {seconds:.2f} s")
    for job in selected:  # memory at 1 k candidates, on the small tables
        add_candidates(engine, job, 1000)
        peak_memory(figures[job.name], "small", url, redis_url)

    log(f"Tables at {big_rows:,} rows")
    grow(engine, big_rows, log)
    for job in selected:
        f = figures[job.name]
        # Job and raw SQL alternate ``repeats`` times and each keeps its median: on a shared machine one
        # measurement can land on a busy moment (autovacuum, another process).
        speeds: dict[str, list[float]] = {"job": [], "raw": [], "per_row": []}
        batches_of: dict[str, list[float]] = {"job": [], "raw": [], "per_row": []}
        runs = [("job", work), ("raw", work)] * repeats + [("per_row", max(1000, work // 10))]
        for how, n in runs:
            add_candidates(engine, job, n)
            rows, seconds, batches = timed(engine, client, getattr(job, how))
            speeds[how].append(rows / seconds)
            batches_of[how] += batches
            log(f"  {job.name} {how}: {rows:,} rows in {seconds:.2f} s")
        f.rows_per_s = {how: statistics.median(values) for how, values in speeds.items()}
        f.batch_ms["big"], f.batch_ms["raw_big"] = (statistics.median(batches_of[how]) * 1000 for how in ("job", "raw"))
        add_candidates(engine, job, memory_candidates)
        peak_memory(f, "big", url, redis_url)
        log(f"  {job.name} memory at {memory_candidates:,} candidates: heap {f.peak_kib['big']:.0f} KiB, RSS {f.rss_mib['big']:.1f} MiB")

    # The memory runs changed a million rows of each table minutes ago: ANALYZE, as autovacuum would
    # after such a change. With statistics still saying a tenth of ci_builds is canceling, PostgreSQL
    # counts the (now none) candidates by a sequential scan of the whole table.
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ANALYZE " + ", ".join(sorted({seed.PARENT.get(job.table, job.table) for job in selected}))))
    for name, seconds in idle_run_seconds(env).items():
        if name in figures:
            figures[name].idle_s = seconds
    engine.dispose()
    return list(figures.values())


def table(figures: list[Figures], small_rows: int, big_rows: int, memory_candidates: int) -> str:
    head = (
        "| job | rows/s job | rows/s raw SQL | rows/s per-row | job vs raw (≤1.5) | job vs per-row (≥10) "
        f"| batch ms @{small_rows:,} | batch ms @{big_rows:,} | ratio (≤1.5) | raw SQL's ratio "
        f"| RSS MiB @1k | RSS MiB @{memory_candidates:,} | ratio (≤1.2) | heap KiB @1k | heap KiB @{memory_candidates:,} | ratio "
        "| idle run s (<2) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for f in figures:
        lines.append(
            f"| {f.job} | {f.rows_per_s['job']:,.0f} | {f.rows_per_s['raw']:,.0f} | {f.rows_per_s['per_row']:,.0f} "
            f"| {f.vs_raw:.2f} | {f.vs_per_row:.1f} | {f.batch_ms['small']:.2f} | {f.batch_ms['big']:.2f} "
            f"| {f.batch_ms['big'] / f.batch_ms['small']:.2f} | {f.batch_ms['raw_big'] / f.batch_ms['raw_small']:.2f} "
            f"| {f.rss_mib['small']:.1f} | {f.rss_mib['big']:.1f} "
            f"| {f.rss_mib['big'] / f.rss_mib['small']:.2f} | {f.peak_kib['small']:,.0f} | {f.peak_kib['big']:,.0f} "
            f"| {f.peak_kib['big'] / f.peak_kib['small']:.2f} | {f.idle_s:.2f} |"
        )
    return "\n".join(lines)


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.machine()}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, Python {platform.python_version()}"


def write_markdown(
    path: Path, body: str, *, small_rows: int, big_rows: int, work: int, memory_candidates: int, repeats: int, ratio: float, server: str
) -> None:
    path.write_text(f"""# Benchmarks

Written by `ci-cleanup bench` on {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC.

- Machine: {machine()}; PostgreSQL {server}, embedded (pgserver) unless CI_CLEANUP_DATABASE_URL was set.
- Table sizes: `ci_builds` and `ci_job_artifacts` at {small_rows:,} then {big_rows:,} rows; runner machines,
  export jobs and environments a tenth of that (GitLab.com's mix, `ci_cleanup/bench/seed.py`).
- Work: {work:,} candidates per job and per way of doing it ({max(1000, work // 10):,} for the per-row loop); on the big
  tables the job and the raw SQL loop alternate {repeats} times, each figure the median;
  peak memory at 1,000 and {memory_candidates:,} candidates, of a subprocess running the job's service: its peak
  resident set (what the operator's machine sees; the process has Dagster, SQLAlchemy and the drivers loaded) and
  the peak of the Python heap traced by tracemalloc (no collection forced between batches).
- "raw SQL": a hand-written loop of one set-based statement per batch of the same size; "per-row": read
  each row, then write it guarded by what was read, one transaction per row (GitLab's `drop!` style).
- "batch ms": the median time of a batch on the small and the big tables; "raw SQL's ratio" is the same
  ratio for the raw SQL loop, which shows how much of the growth is PostgreSQL's own work (index probes and
  index updates on larger, less cached indexes).
- "idle run": the Dagster job executed in process on the big tables with nothing to do, once they are analyzed.

{body}

ratio_vs_raw_sql={ratio:.2f}
""")


def main(env: dict[str, str], args) -> None:
    jobs = args.jobs.split(",") if args.jobs else [job.name for job in JOBS]
    figures = bench(env, small_rows=args.small_rows, big_rows=args.big_rows, work=args.work,
                    memory_candidates=args.memory_candidates, jobs=jobs, repeats=args.repeats)
    body = table(figures, args.small_rows, args.big_rows, args.memory_candidates)
    ratio = statistics.median(f.vs_raw for f in figures)
    print()
    print(body)
    engine = create_engine(env["CI_CLEANUP_DATABASE_URL"])
    with engine.connect() as conn:
        server = conn.scalar(text("SHOW server_version"))
    engine.dispose()
    if args.output:
        write_markdown(Path(args.output), body, small_rows=args.small_rows, big_rows=args.big_rows, work=args.work,
                       memory_candidates=args.memory_candidates, repeats=args.repeats, ratio=ratio, server=server)
        print(f"\nWritten to {args.output}")
    print(f"ratio_vs_raw_sql={ratio:.2f}")
