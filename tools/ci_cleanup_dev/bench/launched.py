"""Every job as operators and the daemon run it, against its true floor (:mod:`ci_cleanup_dev.bench.floor`).

For each job: ``candidates`` fresh candidates are added to the big tables (with the cases its guards
decide: queued builds, relation exports in their grace, running Sidekiq jobs, environments with stop
actions), and the rows the job may change are copied to templates (schema ``bench_template``). Each
round then runs three contenders, each from the same reset state (the candidates restored from the
templates with triggers off, ``session_replication_role = replica``, so ids and side tables are exactly
as before), in an order that changes from round to round (:func:`round_order`):

- ``job``: ``dagster job execute -m ci_cleanup -j JOB`` in a subprocess, on ``deploy/dagster.yaml``
  (PostgreSQL storage, the job's own executor), timed from launch to the run's ``RUN_SUCCESS``
  (start-up included); the run record's own start -> end beside it;
- ``floor``: the raw psycopg2 loop;
- ``service``: the job's service function in this process (no Dagster), labelled as such;
- ``deployed`` (when Debian's ``pgbouncer`` is installed and the database URL has no password): the same launch
  with GitLab's two database URLs (``CI_CLEANUP_DATABASE_URL`` and ``CI_CLEANUP_CI_DATABASE_URL``) each through
  PgBouncer in transaction pooling, as GitLab.com and the reference architectures run. Both aliases reach the
  bench's one database, so the two layouts run on identical rows: the figure is what the deployed path (two
  engines, a transaction per database, PgBouncer in between) costs over the direct one.

After each run the changed tables are digested (timestamps the run sets are compared as "recent", and
ids the database assigns to inserted side rows are left out); every run of every round must leave the
digests the first floor run left, or the benchmark stops.
"""

from __future__ import annotations

import compileall
import contextlib
import datetime as dt
import os
import pwd
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg2
import redis
from psycopg2 import sql
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError

from ci_cleanup_dev.devstack import REPO_ROOT, PgBouncer

from ..batches import BY_NAME, CASES, FLOORS, RUN_CONFIG, SCOPED
from . import bare_job, seed, statements
from .floor import connect
from .jobs import max_id

BIN = Path(sys.executable).parent
TEMPLATE = "bench_template"
# Small tables written by some job (inserted or deleted rows): restored whole, digested without their ids.
SIDE_TABLES = ("ci_pending_builds", "ci_running_builds", "ci_deleted_objects", "loose_foreign_keys_deleted_records")
CONTENDERS = ("job", "floor", "service", "idle")  # "idle": the job launched with nothing to do, in each round
DEPLOYED = "deployed"
DEPLOYED_POOL = 10  # server connections per database: the bucket workers' 5 (10 with the high-concurrency flag)
IDLE_RUNS = 7  # whole-process idle launches per job after the rounds, each beside one of the bare job
REPLAY_PAIRS = 2  # pairs of replays of the job's statements against the floor's (statements.measure)


@dataclass
class Launched:
    job: str
    candidates: int
    rows: int = 0
    batches: int = 0
    # Per contender, one figure a round, in round order: a round's figures are the same index of each list.
    seconds: dict[str, list[float]] = field(
        default_factory=lambda: {c: [] for c in (*CONTENDERS, DEPLOYED, "run_record")})
    idle: list[float] = field(default_factory=list)  # `dagster job execute` with nothing to do, whole process
    bare: list[float] = field(default_factory=list)  # the bare Dagster job, each launched beside an idle run
    # CPU seconds of the client's processes and PostgreSQL's together, per run of each contender (whole
    # processes); empty where PostgreSQL's processes cannot be read (a server on another machine).
    cpu: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in CONTENDERS})
    # The client's part of the same runs: what ci_cleanup and Dagster spend in Python (statements built, results
    # read, events written), without PostgreSQL's work on the statements, which the floor's plans share.
    client_cpu: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in CONTENDERS})
    # PostgreSQL's part of a batch beyond the floor's, the job's statements and the floor's sent again alternating
    # on one connection (statements.measure); None where the server's processes cannot be read.
    postgres: statements.PostgresPart | None = None

    @property
    def idle_s(self) -> float:
        return statistics.median(self.idle)

    def median(self, contender: str) -> float:
        return statistics.median(self.seconds[contender])

    @staticmethod
    def paired(figure: Callable[..., float], *series: list[float]) -> float:
        """The median over the rounds of ``figure`` of each round's own figures: a busier moment of the machine
        weighs on both sides of a round alike, where a ratio of medians sets one round's job against another's
        floor."""
        return statistics.median(figure(*values) for values in zip(*series, strict=True))

    @property
    def deployed_vs_direct(self) -> float | None:
        """The launched job through PgBouncer with two database URLs over the same launch direct, per round (each
        round's two launches ran back to back)."""
        if not self.seconds[DEPLOYED]:
            return None
        return self.paired(lambda deployed, direct: deployed / direct, self.seconds[DEPLOYED], self.seconds["job"])

    @property
    def vs_floor(self) -> float:
        return self.median("job") / self.median("floor")

    @property
    def work_vs_floor(self) -> float:
        """The job with its idle run (start-up, run start and end) taken off, against the floor, per round: both
        launches timed alike, to their RUN_SUCCESS."""
        return self.paired(lambda job, idle, floor: (job - idle) / floor, *self._series("job", "idle", "floor"))

    @property
    def work_vs_floor_of_medians(self) -> float:
        """The same from the contenders' medians, whichever rounds they came from."""
        return (self.median("job") - self.median("idle")) / self.median("floor")

    @property
    def idle_over_bare(self) -> float:
        """The job's idle run over the bare Dagster job's launched beside it (median of the pairs, whole process):
        what its own start-up (imports, resources, run start and end) adds to Dagster's."""
        return self.paired(lambda idle, bare: idle - bare, self.idle, self.bare)

    @property
    def dagster_ms_per_batch(self) -> float:
        """Job minus service per round, spread over the batches (start-up included)."""
        return self.paired(lambda job, service: job - service, *self._series("job", "service")) * 1000 / max(
            1, self.batches)

    @property
    def dagster_ms_per_batch_after_startup(self) -> float:
        """The same without the idle run's cost (process start, imports, run start and end)."""
        series = self._series("job", "idle", "service")
        return self.paired(lambda job, idle, service: job - idle - service, *series) * 1000 / max(1, self.batches)

    def _series(self, *contenders: str, cpu: dict[str, list[float]] | None = None) -> list[list[float]]:
        """Each contender's figures, a round each (seconds, or those of ``cpu``)."""
        return [(cpu or self.seconds)[c] for c in contenders]

    def cpu_ms_per_batch_over_floor(self, contender: str, *, client_only: bool = False) -> float | None:
        """The CPU per batch (the client's and PostgreSQL's; ``client_only``: the client's) a contender spends
        beyond the floor's, per round; the launched job's with its round's idle run's taken off. CPU leaves out the
        waits that wall time counts (the disk, the machine's other processes), not a slower moment of the machine:
        on a shared one, the same work's CPU still moves by about a tenth from run to run, PostgreSQL's most."""
        cpu = self.client_cpu if client_only else self.cpu
        if not cpu["floor"]:
            return None
        if contender == "job":
            over = self.paired(lambda job, idle, floor: job - idle - floor, *self._series("job", "idle", "floor",
                                                                                         cpu=cpu))
        else:
            over = self.paired(lambda used, floor: used - floor, *self._series(contender, "floor", cpu=cpu))
        return over * 1000 / max(1, self.batches)


def _client_cpu() -> float:
    """CPU seconds of this process and of its children that have ended (the launches, once waited for)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def postmaster_pid(cur) -> int | None:
    """The pid of the database's PostgreSQL postmaster; None where its processes cannot be read (a server of another
    machine)."""
    try:
        cur.execute("SHOW data_directory")
        pid = int(Path(cur.fetchone()[0], "postmaster.pid").read_text().split()[0])
        if "(postgres)" not in Path(f"/proc/{pid}/stat").read_text():
            return None
    except (OSError, ValueError, IndexError, psycopg2.Error):
        return None
    return pid


def postgres_cpu_clock(cur) -> Callable[[], float] | None:
    """CPU seconds used so far by the database's PostgreSQL: its postmaster, the children it reaped and those alive
    (backends, checkpointer, autovacuum); None where its processes cannot be read (a server of another machine)."""
    pid = postmaster_pid(cur)
    if pid is None:
        return None
    tick = os.sysconf("SC_CLK_TCK")

    def fields(stat: Path) -> list[str]:  # after "(comm)": state, ppid, ..., utime (11), stime, cutime, cstime (14)
        return stat.read_text().rsplit(")", 1)[1].split()

    def postmaster() -> tuple[int, int]:
        """The postmaster's own ticks, and its reaped children's."""
        own = fields(Path(f"/proc/{pid}/stat"))
        return int(own[11]) + int(own[12]), int(own[13]) + int(own[14])

    def seconds() -> float:
        # A backend that ends and is reaped while /proc is read would be counted in neither its entry nor the
        # postmaster's children's times: read again until no child was reaped during the reading.
        while True:
            _, reaped = postmaster()
            alive = 0
            for entry in os.scandir("/proc"):
                if not entry.name.isdigit() or int(entry.name) == pid:
                    continue
                try:
                    child = fields(Path(entry.path, "stat"))
                except OSError:  # ended meanwhile
                    continue
                if int(child[1]) == pid:
                    alive += int(child[11]) + int(child[12])
            own, reaped_after = postmaster()
            if reaped_after == reaped:
                return (own + reaped + alive) / tick

    return seconds


def add_candidates(engine: Engine, client: redis.Redis, job: str, n: int) -> dict[str, int]:
    """``n`` candidates of the job, with the cases its guards decide; returns the id before them per scoped table."""
    with engine.connect() as conn:
        present = conn.execute(text("SELECT t FROM unnest(:tables) t WHERE to_regclass(t) IS NOT NULL"),
                               {"tables": list(SCOPED[job])}).scalars().all()
        before = {table: max_id(conn, table) for table in present}
    seed.insert(engine, BY_NAME[job].table, n, every=1)
    if job in CASES:
        with engine.begin() as conn:
            CASES[job](conn, client, before)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ANALYZE " + seed.PARENT.get(BY_NAME[job].table, BY_NAME[job].table)))
    return before


def snapshot(cur, job: str, before: dict[str, int]) -> None:
    """Copy the rows the job may change (and the side tables) into ``bench_template``."""
    cur.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(TEMPLATE)))
    for table in _met(before):
        copy = sql.Identifier(TEMPLATE, table)
        cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(copy))
        where = sql.SQL("id > {}").format(sql.Literal(before[table])) if table in before else sql.SQL("true")
        # Only ever read whole by the reset: autovacuum would take it in the first rounds, inside some run.
        cur.execute(sql.SQL("CREATE TABLE {} WITH (autovacuum_enabled = off) AS SELECT * FROM {} WHERE {}").format(
            copy, sql.Identifier(table), where))


def reset(cur, job: str, before: dict[str, int], *, candidates: bool = True) -> None:
    """The state the snapshot saw: candidates deleted, vacuumed and copied back, triggers off (ids, side tables as
    they were), then every table the run meets vacuumed and analyzed, as autovacuum (off for them while the rounds
    run, see :func:`_no_autovacuum`) keeps them: each run starts without the dead rows of the one before; then
    checkpointed: the reset's writes (2.4 GB of WAL for 100 k builds) reach the disk before the run, not in a
    checkpoint inside it (see :func:`_no_checkpoint_mid_run`).

    Without ``candidates``: the tables as they were before them, for the idle runs. The rounds leave behind the
    candidates the job spares (running exports, builds still queued); an idle run paging through those would be
    doing work, not starting up.
    """
    scoped = sql.SQL(", ").join(map(sql.Identifier, before))
    cur.execute("BEGIN")
    cur.execute("SET LOCAL session_replication_role = replica")
    for table in before:
        cur.execute(sql.SQL("DELETE FROM {} WHERE id > %s").format(sql.Identifier(table)), (before[table],))
    cur.execute(sql.SQL("TRUNCATE {}").format(sql.SQL(", ").join(map(sql.Identifier, SIDE_TABLES))))
    cur.execute("COMMIT")
    # Vacuumed before the copy goes back: the copy then fills the space the last run's rows left, every time. Copied
    # first, it went to the space freed the time before, and the candidates took turns between two layouts
    # (ci_runner_machines: pages 5,010-5,876, then 51-5,339): a contender's runs did not all meet the same one.
    cur.execute(sql.SQL("VACUUM {}").format(scoped))
    cur.execute("BEGIN")
    cur.execute("SET LOCAL session_replication_role = replica")
    for table in _met(before) if candidates else ():
        copy = sql.Identifier(TEMPLATE, table)
        cur.execute(sql.SQL("INSERT INTO {} SELECT * FROM {}").format(sql.Identifier(table), copy))
    cur.execute("COMMIT")
    cur.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.SQL(", ").join(map(sql.Identifier, _met(before)))))
    cur.execute("CHECKPOINT")


def _met(before: dict[str, int]) -> tuple[str, ...]:
    """The tables a run may change: the scoped tables :func:`add_candidates` found (``before``'s) and the side
    tables."""
    return (*before, *SIDE_TABLES)


@contextlib.contextmanager
def _no_autovacuum(cur, tables: Iterable[str]) -> Iterator[None]:
    """Autovacuum off for ``tables`` (each partition of a partitioned one) while the rounds run, and back after; the
    reset vacuums and analyzes them itself. Left on, it took the side tables a run or a reset had just filled (100 k
    rows of ci_deleted_objects or loose_foreign_keys_deleted_records) at whatever moment its next round fell: inside
    one run and not another (ci_pending_builds vacuumed 29 times and analyzed 48 times over two headlines' rounds),
    its CPU counted in PostgreSQL's."""
    cur.execute("""SELECT coalesce(tree.relid, t)::regclass::text  -- a table not partitioned has no tree
                   FROM unnest(%s::regclass[]) t LEFT JOIN LATERAL pg_partition_tree(t) tree ON true
                   WHERE coalesce(tree.isleaf, true)""", (list(tables),))
    leaves = [sql.SQL(name) for name, in cur.fetchall()]  # regclass text: quoted and qualified where needed
    for leaf in leaves:
        cur.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = off)").format(leaf))
    try:
        yield
    finally:
        for leaf in leaves:
            cur.execute(sql.SQL("ALTER TABLE {} RESET (autovacuum_enabled)").format(leaf))


def _columns(cur, table: str) -> list[tuple[str, str]]:
    cur.execute("""SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute
                   WHERE attrelid = to_regclass(%s) AND attnum > 0 AND NOT attisdropped ORDER BY attnum""", (table,))
    return cur.fetchall()


def digest(cur, job: str, before: dict[str, int], recent: dt.datetime) -> dict[str, tuple]:
    """Per changed table: (rows in the table, rows digested, md5 of the digested rows in order).

    Candidate rows of the scoped tables with their ids; side tables whole, without their ids (a
    sequence's). A timestamp at or after ``recent`` (a value the run set: now, now - 1 day) is "recent".
    """
    found = {}
    for table in _met(before):
        parts = []
        for name, kind in _columns(cur, table):
            if name == "id" and table not in before:
                continue
            column = sql.Identifier(name)
            if kind.startswith("timestamp"):
                value = sql.SQL("CASE WHEN {c} >= %(recent)s THEN 'recent' ELSE {c}::text END").format(c=column)
            else:
                value = sql.SQL("{}::text").format(column)
            parts.append(sql.SQL("coalesce({}, 'NULL')").format(value))
        where = sql.SQL("id > %(before)s") if table in before else sql.SQL("true")
        row = sql.SQL(" || '|' || ").join(parts)
        cur.execute(sql.SQL("""
            SELECT (SELECT count(*) FROM {t}), count(*), md5(coalesce(string_agg(r, E'\\n' ORDER BY r), ''))
            FROM (SELECT {row} AS r FROM {t} WHERE {where}) s""").format(
            t=sql.Identifier(table), row=row, where=where), {"recent": recent, "before": before.get(table, 0)})
        found[table] = cur.fetchone()
    return found


def _instance():
    from dagster import DagsterInstance

    return DagsterInstance.get()


def launch(env: dict[str, str], job: str, log_dir: Path, location: tuple[str, str] = ("-m", "ci_cleanup")
           ) -> tuple[float, float, float, int]:
    """``dagster job execute`` as an operator runs it: (launch -> RUN_SUCCESS s, run record start -> end s,
    whole process s, rows_changed)."""
    from dagster import DagsterRunStatus, RunsFilter

    command = [str(BIN / "dagster"), "job", "execute", *location, "-j", job]
    if job in RUN_CONFIG:
        config = log_dir / f"{job}.yaml"
        config.write_text(RUN_CONFIG[job])
        command += ["-c", str(config)]
    output = log_dir / f"{job}.log"
    launched = time.time()
    with output.open("w") as out:
        code = subprocess.run(command, env={**os.environ, **env}, cwd=REPO_ROOT, stdout=out,
                              stderr=subprocess.STDOUT).returncode
    exited = time.time()
    records = _instance().get_run_records(RunsFilter(job_name=job), limit=1)
    record = records[0] if records else None
    if code or record is None or record.dagster_run.status != DagsterRunStatus.SUCCESS or record.end_time < launched:
        raise RuntimeError(f"{job} did not succeed (exit {code}); its output: {output}\n{output.read_text()[-3000:]}")
    rows = int(record.dagster_run.tags.get("ci_cleanup/rows_changed", -1))
    return record.end_time - launched, record.end_time - record.start_time, exited - launched, rows


def round_order(contenders: tuple[str, ...], r: int) -> tuple[str, ...]:
    """Round ``r``'s order: the contenders rotated by ``r``, reversed in every other cycle of rotations. Each contender
    takes every place in turn, after each of the others; reversing every other round alone kept the middle one of
    three in the middle in every round."""
    n = len(contenders)
    rotated = contenders[r % n:] + contenders[:r % n]
    return rotated if (r // n) % 2 == 0 else tuple(reversed(rotated))


@dataclass(frozen=True)
class Bench:
    """Where a job is benched: the stack's environment and clients, the runs' log folder and the bench's log."""

    env: dict[str, str]
    engine: Engine
    client: redis.Redis
    log_dir: Path
    log: Callable[[str], None] = print
    deployed_env: dict[str, str] | None = None  # the URLs through PgBouncer: adds the "deployed" contender


class _Contenders:
    """One job's contenders, each run once as a round runs it, its CPU recorded where it is read."""

    def __init__(self, bench: Bench, job: str, figures: Launched, postgres_cpu: Callable[[], float] | None) -> None:
        self.bench, self.job, self.figures, self.postgres_cpu = bench, job, figures, postgres_cpu
        self.digest: Callable[[], dict] = dict  # the changed tables' digest, set once they are snapshotted

    def timed(self, contender: str) -> tuple[float, float | None, int]:
        """``run(contender)``, its CPU (client and PostgreSQL) recorded as ``contender``'s where it is read."""
        if self.postgres_cpu is None or contender not in self.figures.cpu:
            return self.run(contender)
        client, server = _client_cpu(), self.postgres_cpu()
        result = self.run(contender)
        client = _client_cpu() - client
        self.figures.client_cpu[contender].append(client)
        # The server's delta first: in whole ticks, often exactly 0 for a short run, and client + after - before in
        # floating point then came out a hair below the client's own CPU.
        self.figures.cpu[contender].append(client + (self.postgres_cpu() - server))
        return result

    def run(self, contender: str) -> tuple[float, float | None, int]:
        """Seconds, the run record's seconds (launched runs) and rows changed."""
        bench, job = self.bench, self.job
        if contender in ("job", "idle", DEPLOYED):
            env = {**bench.env, **bench.deployed_env} if contender == DEPLOYED else bench.env
            seconds, run_s, _, rows = launch(env, job, bench.log_dir)
            if contender == "idle" and rows:
                raise AssertionError(f"{job}'s idle run changed {rows} rows: it was meant to find nothing to do")
            return seconds, run_s, rows
        # Each run on a connection of its own, as each launched job's process opens one: a new PostgreSQL backend
        # maps the shared buffers it touches anew (docs/performance.md).
        bench.engine.dispose()
        started = time.perf_counter()
        if contender == "floor":
            rows, self.figures.batches = FLOORS[job](bench.env["CI_CLEANUP_DATABASE_URL"], bench.client)
        else:
            rows = BY_NAME[job].job(bench.engine, bench.client, lambda: None)
        return time.perf_counter() - started, None, rows


def _rounds(runs: _Contenders, contenders: tuple[str, ...], rounds: int, reset_to: Callable) -> tuple:
    """One untimed run of every contender (the rounds then all meet warm caches), then ``rounds`` in a changing
    order; each run but the idle ones must leave the tables as the first did. The first run's digest."""
    job, figures, log = runs.job, runs.figures, runs.bench.log
    for contender in contenders:
        reset_to(candidates=contender != "idle")
        log(f"  {job} warm-up {contender}: {runs.run(contender)[0]:.2f} s (not counted)")
    expected = None
    for r in range(rounds):
        for contender in round_order(contenders, r):
            reset_to(candidates=contender != "idle")
            seconds, run_s, rows = runs.timed(contender)
            figures.seconds[contender].append(seconds)
            if contender == "job":
                figures.seconds["run_record"].append(run_s)
            log(f"  {job} round {r + 1} {contender}: {rows:,} rows in {seconds:.2f} s")
            if contender == "idle":
                continue
            state = runs.digest()
            if expected is None:
                expected, figures.rows = state, rows
            if state != expected:
                raise AssertionError(f"{job}: the {contender} run of round {r + 1} left other tables than "
                                     f"the first run:\n{state}\n!=\n{expected}")
    return expected


def _idle_beside_bare(bench: Bench, job: str, figures: Launched) -> None:
    """Each idle run beside a bare Dagster job's, in alternating order."""
    for i in range(IDLE_RUNS):
        for idle in (True, False) if i % 2 == 0 else (False, True):
            if idle:
                figures.idle.append(launch(bench.env, job, bench.log_dir)[2])
            else:
                figures.bare.append(launch(bench.env, bare_job.NAME, bench.log_dir, ("-f", bare_job.__file__))[2])
    bench.log(f"  {job} idle: {', '.join(f'{s:.2f}' for s in figures.idle)} s; "
              f"bare beside them: {', '.join(f'{s:.2f}' for s in figures.bare)} s")


def bench_job(bench: Bench, job: str, n: int, rounds: int, contenders: tuple[str, ...] = CONTENDERS) -> Launched:
    """``contenders`` in a changing order each round (with "deployed" when the bench has a deployed environment),
    then the job's whole-process idle runs beside the bare job's when the floor is among them (they only serve the
    comparison with the floor)."""
    figures = Launched(job, n)
    contenders = (*contenders, DEPLOYED) if bench.deployed_env else contenders
    before = add_candidates(bench.engine, bench.client, job, n)
    recent = dt.datetime.now(dt.UTC) - dt.timedelta(days=2)
    admin = connect(bench.env["CI_CLEANUP_DATABASE_URL"])
    runs = _Contenders(bench, job, figures, postgres_cpu_clock(admin.cursor()))
    with contextlib.closing(admin), _no_autovacuum(admin.cursor(), _met(before)):
        cur = admin.cursor()
        runs.digest = lambda: digest(cur, job, before, recent)
        snapshot(cur, job, before)
        expected = _rounds(runs, contenders, rounds, lambda **kw: reset(cur, job, before, **kw))
        if "floor" in contenders:
            figures.postgres = statements.measure(
                bench.env, job, REPLAY_PAIRS, lambda: reset(cur, job, before), runs.digest, expected, bench.log_dir,
                bench.log)
            reset(cur, job, before, candidates=False)  # checkpointed: the rounds' writes on disk before the idle runs
            _idle_beside_bare(bench, job, figures)
            # The candidates back, done as a round does them: later candidates (an environment's deployments, its
            # stop actions) refer to these rows, and a later bench meets them done, not missing.
            reset(cur, job, before)
            FLOORS[job](bench.env["CI_CLEANUP_DATABASE_URL"], bench.client)
    return figures


def bench_launched(env: dict[str, str], *, candidates: int, rounds: int, jobs: list[str], log=print,
                   contenders: tuple[str, ...] = CONTENDERS, deployed: bool = True) -> list[Launched]:
    """Each job's rounds (:func:`bench_job`); ``deployed``: with the "deployed" contender too, where PgBouncer is."""
    missing = [v for v in ("DAGSTER_HOME", "CI_CLEANUP_DAGSTER_PG_URL") if not env.get(v) and not os.environ.get(v)]
    if missing:
        raise SystemExit(f"The launched-job benchmark needs {' and '.join(missing)} (a folder with this repo's deploy/"
                         "dagster.yaml and its PostgreSQL database), as operators run the jobs")
    # ci_cleanup's bytecode, as an installed package has it: where PYTHONDONTWRITEBYTECODE is set (or the folder is
    # read-only), every launch would otherwise compile the package anew, a cost no deployment pays.
    compileall.compile_dir(REPO_ROOT / "ci_cleanup", quiet=1)
    # This process reads the run records from the instance the jobs are launched on.
    os.environ.update({name: env[name] for name in ("DAGSTER_HOME", "CI_CLEANUP_DAGSTER_PG_URL") if env.get(name)})
    engine, client = create_engine(env["CI_CLEANUP_DATABASE_URL"]), redis.Redis.from_url(env["CI_CLEANUP_REDIS_URL"])
    with engine.begin() as conn:  # earlier parts of the bench left these; each job's rounds start from its own copy
        conn.execute(text("TRUNCATE " + ", ".join(SIDE_TABLES)))
    results = []
    bouncer = _bouncer if deployed else (lambda *_: contextlib.nullcontext())
    with (tempfile.TemporaryDirectory(prefix="ci_cleanup_bench_") as logs, bouncer(env, Path(logs), log) as deployed,
          _no_checkpoint_mid_run(engine, log)):
        for job in jobs:
            log(f"{job}: {candidates:,} candidates, {rounds} rounds of {' / '.join(contenders)}"
                f"{' / deployed' if deployed else ''}")
            results.append(bench_job(Bench(env, engine, client, Path(logs), log, deployed), job, candidates, rounds,
                                     contenders))
    engine.dispose()
    return results


@contextlib.contextmanager
def _no_checkpoint_mid_run(engine: Engine, log) -> Iterator[None]:
    """``max_wal_size`` raised while the rounds run, and reset after: with a CHECKPOINT after every reset, no
    checkpoint then falls inside a measured run. Left to the WAL's volume, one started inside most runs, at a
    different point of each (the floor's and the job's writes are the same: their checkpoints too, but not when).
    Unchanged where the bench's role may not ``ALTER SYSTEM`` (a server of the operator's).

    A 100 k-candidate run writes about 1.2 GB of WAL (GitLab's indexes on every changed row); with the default 1 GB
    PostgreSQL starts a checkpoint at about half of that. 16 GB: more than a reset and a run write together."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        try:
            conn.execute(text("ALTER SYSTEM SET max_wal_size = '16GB'"))
            conn.execute(text("SELECT pg_reload_conf()"))
        except DBAPIError as e:
            log(f"max_wal_size left as it is ({str(e.orig).strip()}): checkpoints may fall inside measured runs")
            yield
            return
    try:
        yield
    finally:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ALTER SYSTEM RESET max_wal_size"))
            conn.execute(text("SELECT pg_reload_conf()"))


def has_pgbouncer() -> bool:
    return bool(shutil.which("pgbouncer")) or os.path.exists("/usr/sbin/pgbouncer")


@contextlib.contextmanager
def _bouncer(env: dict[str, str], data_dir: Path, log) -> Iterator[dict[str, str] | None]:
    """PgBouncer in front of the bench database, as GitLab's main and ci aliases: the deployed launch's URLs;
    None (no deployed contender) without pgbouncer or with a password in the URL."""
    url = make_url(env["CI_CLEANUP_DATABASE_URL"])
    if not has_pgbouncer() or url.password:
        log("No deployed runs: they need Debian's pgbouncer and a database URL without a password")
        yield None
        return
    host = url.query.get("host") or url.host or "localhost"
    server = f"host={host} port={url.port or 5432} dbname={url.database} user={url.username or 'postgres'}"
    # As root, PgBouncer runs as the user PostgreSQL runs as: the owner of its socket.
    sockets = sorted(Path(host).glob(".s.PGSQL.*")) if host.startswith("/") else []
    run_as = pwd.getpwuid(sockets[0].stat().st_uid).pw_name if sockets else "nobody"
    databases = {alias: (server, DEPLOYED_POOL) for alias in ("gitlab_main", "gitlab_ci")}
    with PgBouncer(data_dir / "pgbouncer", databases, run_as) as bouncer:
        yield {"CI_CLEANUP_DATABASE_URL": bouncer.url("gitlab_main"),
               "CI_CLEANUP_CI_DATABASE_URL": bouncer.url("gitlab_ci")}


def _timestamp(moment: dt.datetime) -> float:
    """Unix seconds of a run record's datetime (stored as UTC, with or without its zone)."""
    return (moment if moment.tzinfo else moment.replace(tzinfo=dt.UTC)).timestamp()


def daemon_idle_seconds(env: dict[str, str], log=print) -> float:
    """A scheduled run through dagster-daemon with nothing to do: the run created by the tick -> RUN_SUCCESS."""
    from dagster import DagsterRunStatus, RunsFilter

    from .daemon_location import SCHEDULE

    daemon = subprocess.Popen(
        [str(BIN / "dagster-daemon"), "run", "-m", "ci_cleanup_dev.bench.daemon_location"], env={**os.environ, **env},
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        instance, started = _instance(), dt.datetime.now(dt.UTC)
        deadline = time.monotonic() + 240  # the next minute boundary, the queue, the run
        while True:
            scheduled = RunsFilter(tags={"dagster/schedule_name": SCHEDULE})
            records = [r for r in instance.get_run_records(scheduled, limit=1)
                       if _timestamp(r.create_timestamp) >= started.timestamp()]
            if records and records[0].dagster_run.status in (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE):
                break
            if daemon.poll() is not None or time.monotonic() > deadline:
                daemon.terminate()
                raise RuntimeError(f"no scheduled run finished: {daemon.communicate()[0][-3000:]}")
            time.sleep(1)
        record = records[0]
        if record.dagster_run.status != DagsterRunStatus.SUCCESS:
            raise RuntimeError(f"the scheduled run {record.dagster_run.run_id} failed")
        seconds = record.end_time - _timestamp(record.create_timestamp)
        log(f"  scheduled run with nothing to do: {seconds:.2f} s from the tick's run to RUN_SUCCESS")
        return seconds
    finally:
        daemon.terminate()
        daemon.communicate(timeout=60)
