"""PostgreSQL's part of a batch, statement by statement: the job's batches against its floor's, alternating on one
connection.

A whole run's PostgreSQL CPU moves from run to run on a shared machine by more than the per-batch budget (the same
1,000 statements of 6-7 ms each: ±0.5 ms a batch). Here each side's statements are recorded as it sends them: the job
run in process with its own resources (its ``SET LOCAL`` prefix, its transactions), in a subprocess
(``python -m ci_cleanup_dev.bench.statements job|floor JOB OUT``), and the floor.
Then, from the same reset state, on one
new connection, the batches are sent again: batch i as the job sent it, batch i + 1 as the floor did, the other way
round in the next round, the backend's CPU read from ``/proc/<pid>/schedstat`` around each. A batch of either side does
the same work (the same rows: the tables after each replay are the rounds', asserted), so each batch's two costs, one
from each round of a pair, differ by what the job's statements cost PostgreSQL beyond the floor's; the median over the
batches is the figure. Half the batches have the job's run in the pair's first round, half in its second: a slower
moment of the machine weighs on both sides alike. A run's one-off statements (schema check, first reads) ride with
its first batch, which the median leaves out.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psycopg2
import psycopg2.extensions

from ci_cleanup.resources.run_options import THROTTLE_ENV
from ci_cleanup_dev.devstack import REPO_ROOT

from . import floor

WRITES = re.compile(r"\b(UPDATE|DELETE|INSERT)\b")  # a batch statement changes rows; a read is never one


@dataclass(frozen=True)
class Sent:
    backend: int  # the pid of the backend it went to: one connection's statements, in order
    kind: str  # the statement before its parameters: what tells a batch statement (one that writes) from a read
    text: str  # as sent, parameters in
    bucket: int | None = None  # a bucket worker's ``bucket`` parameter: the batches of each bucket pair up


def _bucket(parameters) -> int | None:
    return parameters.get("bucket") if isinstance(parameters, dict) else None


def batches(sent: list[Sent]) -> dict[int | None, list[list[str]]]:
    """Per bucket (None for a job without), each batch's statements in order: its batch statement (one that writes:
    on one database each job's batch is one, whatever its variant) and what the same connection sent before it since
    the last one (a transaction's BEGIN and COMMIT, a read before each batch, a first op's reads); what a connection
    sent after its last batch statement goes with that batch. Connections that sent no batch statement (a
    scheduler's flags read) are left out."""
    pending: dict[int, list[str]] = defaultdict(list)
    last: dict[int, list[str]] = {}
    found: dict[int | None, list[list[str]]] = defaultdict(list)
    for s in sent:
        pending[s.backend].append(s.text)
        if WRITES.search(s.kind):
            last[s.backend] = pending.pop(s.backend)
            found[s.bucket].append(last[s.backend])
    for backend, batch in last.items():
        batch += pending.pop(backend, [])
    return dict(found)


def pairs(job: dict[int | None, list[list[str]]], floor_: dict[int | None, list[list[str]]]
          ) -> list[tuple[list[str], list[str]]]:
    """The job's batches and the floor's, paired from the last (both end on the batch that finds nothing more, or the
    last short one), bucket after bucket. A side may have one batch more at its start (stuck_export_jobs' floor reads
    its first page in a batch statement that fails nothing; the job reads it apart): that batch is left out."""
    if job.keys() != floor_.keys():
        raise AssertionError(f"the job's batches are of buckets {sorted(job, key=str)}, the floor's of "
                             f"{sorted(floor_, key=str)}")
    paired = []
    for bucket in sorted(job, key=str):
        mine, theirs = job[bucket], floor_[bucket]
        if abs(len(mine) - len(theirs)) > 1:
            raise AssertionError(f"bucket {bucket}: the job sent {len(mine)} batches, the floor {len(theirs)}")
        n = min(len(mine), len(theirs))
        paired += zip(mine[len(mine) - n:], theirs[len(theirs) - n:], strict=True)
    return paired


def _cpu_ns(pid: int) -> int:
    """The CPU time a process has used, in nanoseconds (the scheduler's, not the clock ticks of ``stat``)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def alternate(url: str, paired: list[tuple[list[str], list[str]]], turn: int) -> list[int]:
    """The batches sent again on one new connection, batch i the job's when ``i + turn`` is even, else the floor's:
    the backend's CPU for each batch, ns."""
    used = []
    with contextlib.closing(floor.connect(url)) as conn:
        cur, pid = conn.cursor(), conn.info.backend_pid
        for i, batch in enumerate(paired):
            before = _cpu_ns(pid)
            for text in batch[(i + turn) % 2]:
                cur.execute(text)  # no parameters: sent as recorded
            used.append(_cpu_ns(pid) - before)
    return used


def over_floor_ms(first: list[int], second: list[int]) -> float:
    """Of two replays (turns 0 and 1, or 2 and 3), the median over the batches of the job's cost less the floor's."""
    return statistics.median((a - b) if i % 2 == 0 else (b - a) for i, (a, b) in enumerate(zip(first, second))) / 1e6


@dataclass
class PostgresPart:
    over_floor_ms: list[float]  # per pair of replays
    statements: tuple[float, float]  # statements per batch (median), the job's and the floor's

    @property
    def ms(self) -> float:
        return statistics.median(self.over_floor_ms)


def measure(env: dict[str, str], job: str, pairs_of_replays: int, reset: Callable[[], None],
            state: Callable[[], dict], expected: dict, log_dir: Path, log=print) -> PostgresPart | None:
    """Each side recorded once, then ``2 * pairs_of_replays`` replays, each from ``reset()`` and checked against
    ``expected`` (the rounds' ``state()``); None where the server's processes cannot be read (a server of another
    machine)."""
    url = env["CI_CLEANUP_DATABASE_URL"]
    with contextlib.closing(floor.connect(url)) as conn:
        if not os.access(f"/proc/{conn.info.backend_pid}/schedstat", os.R_OK):
            return None
    recorded = {}
    for side in ("job", "floor"):
        reset()
        out = log_dir / f"{job}.{side}.statements.json"
        log_file = log_dir / f"{job}.{side}.statements.log"
        with log_file.open("w") as output:
            # Pacing off: a paced run may resize its batches, and the pairs need the floor's batches one for one.
            code = subprocess.run([sys.executable, "-m", __name__, side, job, str(out)],
                                  env={**os.environ, **env, THROTTLE_ENV: "off"},
                                  cwd=REPO_ROOT, stdout=output, stderr=subprocess.STDOUT).returncode
        if code:
            raise RuntimeError(f"recording {job}'s {side} statements failed (exit {code}):\n"
                               f"{log_file.read_text()[-3000:]}")
        if state() != expected:
            raise AssertionError(f"{job}: the recorded {side} run left other tables than the rounds")
        recorded[side] = batches([Sent(*s) for s in json.loads(out.read_text())])
    paired = pairs(recorded["job"], recorded["floor"])
    over = []
    for _ in range(pairs_of_replays):
        replays = []
        for turn in (0, 1):
            reset()
            replays.append(alternate(url, paired, turn))
            if state() != expected:
                raise AssertionError(f"{job}: the statements sent again left other tables than the rounds")
        over.append(over_floor_ms(*replays))
        log(f"  {job} statements: PostgreSQL {over[-1]:+.3f} ms a batch over the floor's")
    return PostgresPart(over, tuple(statistics.median(map(len, side)) for side in zip(*paired, strict=True)))


# -- the recording, in its own process ---------------------------------------------------------------------------


class Recording(psycopg2.extensions.cursor):
    """A cursor that records what it sends (``SENT``), with the BEGIN psycopg2 sends before a transaction's first
    statement."""

    SENT: list[Sent] = []

    def execute(self, query, vars=None):
        info = self.connection.info
        if not self.connection.autocommit and info.transaction_status == psycopg2.extensions.TRANSACTION_STATUS_IDLE:
            self.SENT.append(Sent(info.backend_pid, "BEGIN", "BEGIN"))
        super().execute(query, vars)
        self.SENT.append(Sent(info.backend_pid, query, self.query.decode(), _bucket(vars)))


def record_job(job: str) -> None:
    """The job run in this process with its own resources, as a launch runs it; every statement its GitLab
    connections send recorded, through SQLAlchemy or on their own cursors, with
    the BEGIN and COMMIT psycopg2 sends around a transaction's."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine
    from sqlalchemy.pool import Pool

    from ci_cleanup.definitions import defs

    from ..batches import RUN_CONFIG

    # While a connection is checked out: not the pool's own statements (a new connection's first reads, in a
    # transaction whose rollback SQLAlchemy sends on the connection itself, unseen), which the job's work never sends.
    @event.listens_for(Pool, "checkout")
    def recorded(dbapi_connection, _record, _proxy):
        if isinstance(dbapi_connection, psycopg2.extensions.connection):
            dbapi_connection.cursor_factory = Recording

    @event.listens_for(Pool, "checkin")
    def unrecorded(dbapi_connection, _record):
        if isinstance(dbapi_connection, psycopg2.extensions.connection):
            dbapi_connection.cursor_factory = None

    def end(word: str):
        def ended(conn):
            dbapi_connection = conn.connection.dbapi_connection
            if isinstance(dbapi_connection, psycopg2.extensions.connection) \
                    and dbapi_connection.info.transaction_status != psycopg2.extensions.TRANSACTION_STATUS_IDLE:
                Recording.SENT.append(Sent(dbapi_connection.info.backend_pid, word, word))
        return ended

    event.listen(Engine, "commit", end("COMMIT"))
    event.listen(Engine, "rollback", end("ROLLBACK"))
    result = defs.get_job_def(job).execute_in_process(run_config=json.loads(RUN_CONFIG.get(job, "{}")))
    if not result.success:
        raise SystemExit(f"{job} failed in process")


def record_floor(job: str) -> None:
    import redis

    from ..batches import FLOORS

    floor.CURSOR = Recording
    FLOORS[job](os.environ["CI_CLEANUP_DATABASE_URL"], redis.Redis.from_url(os.environ["CI_CLEANUP_REDIS_URL"]))


def main(argv: list[str]) -> None:
    side, job, out = argv
    (record_job if side == "job" else record_floor)(job)
    Path(out).write_text(json.dumps([[s.backend, s.kind, s.text, s.bucket] for s in Recording.SENT]))


if __name__ == "__main__":
    main(sys.argv[1:])
