"""A synthetic GitLab workload for the traffic scenario (:mod:`ci_cleanup_dev.bench.traffic`), in a process of its
own so that a job run in the bench's process never holds its interpreter lock:
``python -m ci_cleanup_dev.bench.workload SPEC``.

GitLab's own traffic on the tables the jobs change, over a few connections (GitLab's many Puma and Sidekiq
processes): a runner's update of its build by id (as optimistic locking writes it: ``lock_version + 1``), an artifact
inserted for a new job, reads by id of builds and artifacts; a share of the updates and reads on the job's own
candidate rows.

Open loop: every transaction has a scheduled start, from a schedule of phases (seconds at a rate each), whatever
happened to the ones before it. The connections take the next scheduled transaction in turn, as a pool of GitLab's
processes takes requests: one that waits on a lock holds up only its own connection, and when every connection is
busy the next transactions start late. A transaction's latency counts from its scheduled start, so a generator
that falls behind (its connections held up, or its process short of CPU) shows as latency, as a user's request that
waits in a queue does. Bounded by its schedule, or sooner when its standard input closes (the bench's end of a
window). It prints ``ready`` with its backends' pids and the schedule's start (Unix seconds) once connected, then
one JSON line: every transaction's kind, scheduled start, latency from the scheduled start and service time (BEGIN to
COMMIT), in seconds.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .floor import connect

# The mix, in percent of the transactions; the updates and reads pick the job's candidate rows HOT_SHARE of the time.
MIX = (("update", 40), ("insert", 20), ("read", 40))
HOT_SHARE = 0.2
JOB_IDS = "bench_template.traffic_job_ids"  # the inserted artifacts' job ids: (job_id, file_type, partition) is unique

UPDATE = "UPDATE p_ci_builds SET lock_version = coalesce(lock_version, 0) + 1 WHERE id = %s AND partition_id = %s"
INSERT = f"""INSERT INTO p_ci_job_artifacts (partition_id, project_id, job_id, file_type, size, file, file_store,
                                             expire_at, locked, created_at, updated_at)
             VALUES (%s, %s, nextval('{JOB_IDS}'), 1, 1000, 'artifacts.zip', 2, now() + interval '30 days', 0,
                     now(), now())"""  # unexpired: never a candidate of the bulk delete
READ = {"p_ci_builds": "SELECT * FROM p_ci_builds WHERE id = %s AND partition_id = %s",
        "p_ci_job_artifacts": "SELECT * FROM p_ci_job_artifacts WHERE id = %s AND partition_id = %s"}


Take = Callable[[], "tuple[int, float] | None"]  # the next transaction's number and scheduled start; None: no more


@dataclass
class Spec:
    url: str
    phases: list[list[float]]  # the schedule: [seconds, transactions per second], one phase after the other
    clients: int
    builds: list[list[int]]  # (id, partition_id) of background builds
    artifacts: list[list[int]]  # the same of background artifacts
    hot_table: str = ""  # the job's table, when its candidates are read (or, builds, updated) by id
    hot: list[list[int]] = field(default_factory=list)  # its candidates: (id, partition_id or 0)
    lock_log_ms: int = 5  # deadlock_timeout of the workload's sessions: waits longer than this are logged
    hot_share: float = HOT_SHARE


@dataclass(frozen=True)
class Done:
    """One transaction: its kind, scheduled start (Unix seconds), latency from then and its own BEGIN to COMMIT."""

    kind: str
    due: float
    latency: float
    service: float


def schedule(phases: list[list[float]]) -> list[float]:
    """Each transaction's scheduled start, in seconds from the schedule's start: evenly spaced at each phase's
    rate, the phases one after the other."""
    offsets, at = [], 0.0
    for seconds, rate in phases:
        offsets += [at + i / rate for i in range(round(seconds * rate))]
        at += seconds
    return offsets


def pick_kind(draw: int) -> str:
    """The kind of transaction a draw in [0, 100) selects from :data:`MIX`."""
    for kind, share in MIX:
        if draw < share:
            return kind
        draw -= share
    raise ValueError(f"a draw in [0, 100), not {draw}")


def statement(spec: Spec, kind: str, rng: random.Random) -> tuple[str, tuple]:
    """The SQL and parameters of one transaction of ``kind``."""
    hot = bool(spec.hot) and rng.random() < spec.hot_share
    if kind == "update":
        row = rng.choice(spec.hot if hot and spec.hot_table == "p_ci_builds" else spec.builds)
        return UPDATE, tuple(row)
    if kind == "insert":
        return INSERT, (100 + rng.randrange(3), 1 + rng.randrange(50_000))
    if hot:
        row = rng.choice(spec.hot)
        if spec.hot_table in READ:
            return READ[spec.hot_table], tuple(row)
        return f"SELECT * FROM {spec.hot_table} WHERE id = %s", (row[0],)  # hot_table: one of the bench's tables
    table = rng.choice(("p_ci_builds", "p_ci_job_artifacts"))
    return READ[table], tuple(rng.choice(spec.builds if table == "p_ci_builds" else spec.artifacts))


def client(spec: Spec, conn, due: Take, stop: threading.Event, out: list[Done]) -> None:
    """One connection: the next scheduled transaction, at its time or at once when it is late, until the schedule
    ends or ``stop`` is set. Each transaction's kind and rows come from its own number, the same in every run."""
    cur = conn.cursor()
    while (at := due()) is not None:
        n, scheduled = at
        wait = scheduled - time.time()
        if (wait > 0 and stop.wait(wait)) or stop.is_set():
            return
        rng = random.Random(n)
        kind = pick_kind(rng.randrange(100))
        sql, params = statement(spec, kind, rng)
        began = time.time()
        cur.execute(sql, params)
        conn.commit()
        ended = time.time()
        out.append(Done(kind, scheduled, ended - scheduled, ended - began))


def dispatcher(offsets: list[float], start: float) -> Take:
    """The next transaction's number and scheduled start, each handed out once across the connections; None at
    the schedule's end."""
    numbers, lock = itertools.count(), threading.Lock()

    def take() -> tuple[int, float] | None:
        with lock:
            n = next(numbers)
        return (n, start + offsets[n]) if n < len(offsets) else None

    return take


def run(spec: Spec, stop: threading.Event, ready: Callable[[list[int], float], None] = lambda pids, start: None,
        ) -> list[Done]:
    """Every transaction of the schedule (or up to ``stop``), in the order they ended."""
    conns = [connect(spec.url) for _ in range(spec.clients)]
    try:
        pids = []
        for conn in conns:
            conn.autocommit = False
            with conn.cursor() as cur:  # lock waits over lock_log_ms logged with their holder (superuser only)
                cur.execute("SET application_name = 'gitlab_traffic'")
                cur.execute("SET log_lock_waits = on")
                cur.execute("SET deadlock_timeout = %s", (f"{spec.lock_log_ms}ms",))
                cur.execute("SELECT pg_backend_pid()")
                pids.append(cur.fetchone()[0])
            conn.commit()
        out: list[Done] = []
        start = time.time()
        ready(pids, start)
        take = dispatcher(schedule(spec.phases), start)
        threads = [threading.Thread(target=client, args=(spec, conn, take, stop, out)) for conn in conns]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return out
    finally:
        for conn in conns:
            conn.close()


def main(path: str) -> None:
    with open(path) as f:
        spec = Spec(**json.load(f))
    stop = threading.Event()

    def until_stdin_closes() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=until_stdin_closes, daemon=True).start()
    done = run(spec, stop, lambda pids, start: print("ready " + json.dumps({"pids": pids, "start": start}),
                                                      flush=True))
    print(json.dumps([[d.kind, d.due, d.latency, d.service] for d in done]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
