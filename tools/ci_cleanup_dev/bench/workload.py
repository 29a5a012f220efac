"""A synthetic GitLab workload for the traffic scenario (:mod:`ci_cleanup_dev.bench.traffic`), in a process of its
own so that a job run in the bench's process never holds its interpreter lock:
``python -m ci_cleanup_dev.bench.workload SPEC``.

GitLab's own traffic on the tables the jobs change, at a fixed rate over a few connections (GitLab's many Puma and
Sidekiq processes): a runner's update of its build by id (as optimistic locking writes it: ``lock_version + 1``), an
artifact inserted for a new job, reads by id of builds and artifacts; a share of the updates and reads on the job's own
candidate rows. Bounded twice: it stops after ``count`` transactions or ``seconds``, or sooner when its standard input
closes (the bench's end of a run). It prints ``ready`` and its backends' pids once connected, then one JSON line: every
transaction's kind, wall-clock start and seconds (BEGIN to COMMIT).
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
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


@dataclass
class Spec:
    url: str
    rate: float  # transactions per second, all connections together
    count: int  # at most this many transactions
    seconds: float  # and for at most this long
    clients: int
    builds: list[list[int]]  # (id, partition_id) of background builds
    artifacts: list[list[int]]  # the same of background artifacts
    hot_table: str = ""  # the job's table, when its candidates are read (or, builds, updated) by id
    hot: list[list[int]] = field(default_factory=list)  # its candidates: (id, partition_id or 0)
    lock_log_ms: int = 5  # deadlock_timeout of the workload's sessions: waits longer than this are logged
    hot_share: float = HOT_SHARE


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


def client(spec: Spec, conn, index: int, start: float, stop: threading.Event, out: list) -> None:
    """Connection ``index``'s share of the schedule: transaction n at ``start + n / rate`` for n = index, index +
    clients, ...; one that falls behind starts the next at once."""
    rng, cur = random.Random(index), conn.cursor()
    for n in range(index, spec.count, spec.clients):
        due = start + n / spec.rate
        if due - start > spec.seconds:
            return
        wait = due - time.time()
        if wait > 0 and stop.wait(wait):
            return
        if stop.is_set():
            return
        kind = pick_kind(rng.randrange(100))
        sql, params = statement(spec, kind, rng)
        began = time.time()
        cur.execute(sql, params)
        conn.commit()
        out.append((kind, began, time.time() - began))


def run(spec: Spec, stop: threading.Event, ready=lambda pids: None) -> list[tuple[str, float, float]]:
    """Every transaction ``(kind, started, seconds)``, in the order they ended."""
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
        ready(pids)
        out: list[tuple[str, float, float]] = []
        start = time.time()
        threads = [threading.Thread(target=client, args=(spec, conn, i, start, stop, out))
                   for i, conn in enumerate(conns)]
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
    done = run(spec, stop, lambda pids: print("ready " + json.dumps(pids), flush=True))
    print(json.dumps(done), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
