"""Pacing by the database's health: after each batch, the next pause and the next batch's size (issue 70).

GitLab's crons have none. Its batched background migrations and Sidekiq deferral stop on health signals
(``Gitlab::Database::HealthStatus``) and back off with jitter while one lasts; its Sidekiq throttling cuts a worker's
concurrency by 0.8 or 0.5 and recovers by +10 %; gh-ost and pt-online-schema-change throttle on replica lag and on
running threads over their start-up level. :class:`Pacer` is that controller, once, for every job's loop
(:class:`~ci_cleanup.gitlab.loop_helpers.Brake` holds it); :class:`Watch` reads the signals it judges, beside the
run, on a connection of its own. With no signal firing it adds no pause and keeps the seed's batch size.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
import urllib.request
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from sqlalchemy import Table, func, select, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from .sql_files import SqlFile

# Thresholds, each named after where it comes from (docs/configuration.md, "Pacing").
BATCH_TIME_TOLERANCE = 1.5  # Netflix Gradient2's default tolerance: short-term latency over long-term
BATCH_TIME_SLACK_SECONDS = 0.01  # a batch this little over its expected time is noise, not contention
READ_TOLERANCE = 1.5  # Gradient2 again, for the cheap read while working against while paused
READ_SLACK_SECONDS = 0.001  # the read's noise on an idle server
ACTIVE_SESSIONS_RATIO = 1.2  # pt-online-schema-change's --max-load: 20 % over the level at start
ACTIVE_SESSIONS_SLACK = 2  # and at least this many more sessions, so a near-idle server is not judged by one
# GitLab's WriteAheadLog indicator (its LIMIT): WAL segments waiting for the archiver. Not the WAL's rate: the job's
# own writes are WAL; what they cost GitLab is a backlog the archive (or a replica: replica_lag) cannot keep up with.
WAL_ARCHIVE_QUEUE_SEGMENTS = 42
REPLICA_LAG_SECONDS = 1.5  # gh-ost's --max-lag-millis default
APDEX_SLO = 0.99  # GitLab's SQL apdex below this: its Prometheus alert indicator's condition (below the SLO)

# What a firing signal does.
AT_ONCE = frozenset({"locks_caused", "lock_waited"})  # a lock wait: halve the batch at once (Vitess, Sidekiq 0.5)
LATENCY = frozenset({"batch_time", "read_latency"})  # contention: cut the batch by Sidekiq throttling's 0.8
# Pause while it lasts:
HEALTH = frozenset({"active_sessions", "wal_archive_queue", "replica_lag", "autovacuum", "apdex"})
CUT_AT_ONCE, CUT_ON_LATENCY, GROW = 0.5, 0.8, 1.1  # Sidekiq throttling's hard and soft cuts, its +10 % recovery
MIN_SIZE_SHARE = 0.01  # the smallest batch, a share of the seed's (at least one row)
BACKOFF_FIRST_SECONDS = 0.1  # the first pause after a signal; doubled while signals keep firing
BACKOFF_MAX_SECONDS = 30.0  # the longest pause, well inside every lease's renewal and the bucket workers' 5 minutes
JITTER = 0.5  # each pause is cut by up to this share at random, so workers and runs do not retry in step
RECENT_BATCHES = 50  # the long-term window of the batches' time (Gradient2 compares a short-term one against it)
SHORT_TERM_BATCHES = 3  # the short-term window: one batch slow by chance fires nothing
LONG_TERM_MIN_BATCHES = 5  # no judgement on fewer batches than this

# How often the watch reads (one cheap statement each).
SAMPLE_EVERY_SECONDS = 0.2  # lock waits and the cheap read: inside a lock wait worth noticing
HEALTH_EVERY_SECONDS = 1.0  # sessions, WAL, replicas, autovacuum
APDEX_EVERY_SECONDS = 15.0  # Prometheus' usual scrape interval
BASELINE_READS = 5  # cheap reads before the first batch: the read's level with the job idle
READ_WINDOW = 5  # the cheap reads while working that are judged together (the middle one)


@dataclass
class Readings:
    """What the watch saw since the last batch ended; None: not read (or unreadable)."""

    locks_caused: int = 0  # other sessions waiting on a lock a session of the job holds
    lock_waited: int = 0  # the job's sessions waiting on a lock another holds
    read_seconds: float | None = None  # the cheap read while the job worked (the middle one of its window)
    read_baseline: float | None = None  # the same read before the run and while it paused (the middle one)
    active_sessions: int | None = None
    sessions_before: int | None = None  # active sessions before the run
    wal_archive_queue: int | None = None  # WAL segments not yet archived
    replica_lag_seconds: float | None = None
    autovacuum: bool | None = None  # autovacuum working on the job's table (or one of its partitions)
    apdex: float | None = None


def judge(readings: Readings) -> set[str]:
    """The signals that fire on ``readings``, by the thresholds above."""
    r, fired = readings, set()
    if r.locks_caused:
        fired.add("locks_caused")
    if r.lock_waited:
        fired.add("lock_waited")
    if r.read_seconds is not None and r.read_baseline is not None:
        if r.read_seconds > READ_TOLERANCE * r.read_baseline + READ_SLACK_SECONDS:
            fired.add("read_latency")
    if r.active_sessions is not None and r.sessions_before is not None:
        before = r.sessions_before
        if r.active_sessions > max(before * ACTIVE_SESSIONS_RATIO, before + ACTIVE_SESSIONS_SLACK):
            fired.add("active_sessions")
    if r.wal_archive_queue is not None and r.wal_archive_queue > WAL_ARCHIVE_QUEUE_SEGMENTS:
        fired.add("wal_archive_queue")
    if r.replica_lag_seconds is not None and r.replica_lag_seconds > REPLICA_LAG_SECONDS:
        fired.add("replica_lag")
    if r.autovacuum:
        fired.add("autovacuum")
    if r.apdex is not None and r.apdex < APDEX_SLO:
        fired.add("apdex")
    return fired


@dataclass
class Pacer:
    """The controller, one a run (the bulk delete's bucket workers share it: one budget). After each batch it
    judges the signals and the batch's time against its recent best: one firing pauses the whole run, with
    exponential backoff and jitter while signals keep firing, and shrinks the next batches (halved on a lock
    wait, by 0.8 on latency, kept on the other health signals); none firing ends the pause and grows the batch
    back by a tenth, up to the seed's size. Only a batch begun after the last back-off decides: the other workers'
    batches that ran into that pause saw the same contention, and must not double it once each."""

    clock: Callable[[], float] = time.monotonic
    jitter: Callable[[], float] = random.random
    watch: Watch | None = None  # the signals from the database; None: the batch's own time alone
    share: float = 1.0  # the next batch's size, a share of the seed's
    backoff: int = 0  # consecutive batches after which a signal fired
    resume_at: float = float("-inf")  # no batch of the run starts before
    backed_off_at: float = float("-inf")  # when the last pause was decided
    paused_seconds: float = 0.0  # the run's time paused (the workers pause together: counted once)
    batches: int = 0
    slowed_batches: int = 0
    slowed_by: Counter = field(default_factory=Counter)
    share_sum: float = 0.0  # the batches' shares added up, and the least: the pace over the run
    share_min: float = 1.0
    started: float | None = None
    _recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_BATCHES))
    _sized: threading.local = field(default_factory=threading.local)
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _window: tuple[int, int, float, float] = (0, 0, 0.0, 0.0)  # batches, slowed, paused, share_sum at the last

    def next_batch_size(self, default: int) -> int:
        """The size of the next batch: the seed's ``default`` (the most) times the run's share, at least one."""
        with self._lock:
            if self.started is None:
                self.started = self.clock()
            size = max(1, round(default * self.share))
            self._sized.began = self.clock()
        self._sized.size = size
        return size

    def after_batch(self, batch_seconds: float) -> float:
        """Judge the batch that took ``batch_seconds`` and the signals read meanwhile; the pause to make now."""
        readings = self.watch.take() if self.watch is not None else Readings()
        size = getattr(self._sized, "size", None)
        with self._lock:
            now = self.clock()
            fired = judge(readings)
            if size is not None:
                self._recent.append((size, batch_seconds))
                if self._slow(size):
                    fired.add("batch_time")
            self.batches += 1
            self.share_sum += self.share
            self.share_min = min(self.share_min, self.share)
            if getattr(self._sized, "began", now) < self.backed_off_at:  # it ran into the last pause
                return max(0.0, self.resume_at - now)
            if fired:
                self._back_off(fired, now)
            else:
                self.backoff, self.share = 0, min(1.0, self.share * GROW)
            return max(0.0, self.resume_at - now)

    def _slow(self, size: int) -> bool:
        """The last batches' time (their middle one, per row, at ``size``) over ``BATCH_TIME_TOLERANCE`` × the recent
        batches' (Gradient2's short-term against long-term). A middle, not a best: a run's last batch finds fewer rows
        than it asked for and is fast. The long term only of batches no larger: a smaller batch spends more per row,
        and comparing it with larger ones would shrink it for being small."""
        long_term = [seconds / n for n, seconds in self._recent if n <= size]
        if len(long_term) < LONG_TERM_MIN_BATCHES:
            return False
        short_term = [seconds / n for n, seconds in list(self._recent)[-SHORT_TERM_BATCHES:]]
        return (statistics.median(short_term) * size
                > BATCH_TIME_TOLERANCE * statistics.median(long_term) * size + BATCH_TIME_SLACK_SECONDS)

    def _back_off(self, fired: set[str], now: float) -> None:
        self.slowed_batches += 1
        self.slowed_by.update(fired)
        cut = CUT_AT_ONCE if fired & AT_ONCE else CUT_ON_LATENCY if fired & LATENCY else 1.0
        self.share = max(MIN_SIZE_SHARE, self.share * cut)
        self.backoff += 1
        self.backed_off_at = now
        pause = min(BACKOFF_MAX_SECONDS, BACKOFF_FIRST_SECONDS * 2 ** (self.backoff - 1))
        resume_at = now + pause * (1 - JITTER * self.jitter())
        if resume_at > self.resume_at:
            self.paused_seconds += resume_at - max(self.resume_at, now)
            self.resume_at = resume_at

    def paused(self) -> bool:
        return self.resume_at > self.clock()

    def window(self) -> dict[str, float | int]:
        """Since the last call: batches slowed, seconds paused and the mean batch share (an observation's point)."""
        with self._lock:
            batches, slowed, paused, share_sum = self._window
            self._window = (self.batches, self.slowed_batches, self.paused_seconds, self.share_sum)
            return {"pacing_slowed_batches": self.slowed_batches - slowed,
                    "pacing_paused_seconds": round(self.paused_seconds - paused, 3),
                    "pacing_batch_size_share": round((self.share_sum - share_sum) / (self.batches - batches), 3)
                    if self.batches > batches else 1.0}

    @property
    def metadata(self) -> dict[str, object]:
        """How the run was paced: its share of time paused, its pace (each batch's size as a share of the seed's),
        and which signal slowed it, how often; with any signal that could not be read."""
        with self._lock:
            elapsed = self.clock() - self.started if self.started is not None else 0.0
            paused = min(self.paused_seconds, elapsed)
            meta: dict[str, object] = {
                "pacing": "adaptive",
                "pacing_paused_seconds": round(paused, 3),
                "pacing_paused_share": round(paused / elapsed, 3) if elapsed > 0 else 0.0,
                "pacing_batch_size_share_mean": round(self.share_sum / self.batches, 3) if self.batches else 1.0,
                "pacing_batch_size_share_min": round(self.share_min, 3),
                "pacing_slowed_batches": self.slowed_batches,
                "pacing_slowed_by": dict(sorted(self.slowed_by.items())),
                **{f"pacing_slowed_by_{signal}": n for signal, n in sorted(self.slowed_by.items())},
            }
        if self.watch is not None and self.watch.unreadable:
            meta["pacing_unreadable"] = dict(self.watch.unreadable)
        return meta


# The signals' statements: each one cheap, autocommit, with no session state (PgBouncer's transaction pooling).
LOCKS = text("""
SELECT count(*) FILTER (WHERE NOT coalesce(starts_with(waiter.query, :job), false)
                          AND starts_with(blocker.query, :job)),
       count(*) FILTER (WHERE starts_with(waiter.query, :job))
FROM pg_stat_activity AS waiter
CROSS JOIN LATERAL unnest(pg_blocking_pids(waiter.pid)) AS blocking(pid)
JOIN pg_stat_activity AS blocker ON blocker.pid = blocking.pid
WHERE waiter.wait_event_type = 'Lock' AND waiter.pid <> pg_backend_pid()""")
ACTIVE_SESSIONS = text("""
SELECT count(*) FROM pg_stat_activity
WHERE state = 'active' AND backend_type = 'client backend' AND pid <> pg_backend_pid()
  AND NOT coalesce(starts_with(query, :job), false)""")
WAL_ARCHIVE_QUEUE = text(SqlFile(__package__, "wal_archive_queue.sql").source)
REPLICA_LAG = text("SELECT coalesce(max(extract(epoch FROM replay_lag)), 0) FROM pg_stat_replication")
AUTOVACUUM = text("SELECT count(*) FROM pg_stat_progress_vacuum WHERE relid = ANY(CAST(:relids AS oid[]))")
RELIDS = text("SELECT array_agg(relid::oid::bigint) FROM pg_partition_tree(CAST(:table AS regclass))")


class Watch:
    """The signals of one run's database, read beside the run on a connection of its own (a thread), so that a
    lock wait the job causes is seen while its batch holds the lock, and the cheap read is timed both while the job
    works and while it pauses. A signal that cannot be read is reported once (``report``) and left out."""

    def __init__(self, engine: Engine, table: Table, job: str, report: Callable[[str], None] = print,
                 apdex_url: str | None = None, clock: Callable[[], float] = time.monotonic):
        """``job``: what the job's statements start with (``JOB_MARK``), which tells its sessions from others'."""
        self.engine, self.job, self.report, self.apdex_url, self.clock = engine, job, report, apdex_url, clock
        self.table, self.quoted = table, engine.dialect.identifier_preparer.format_table(table)
        self.unreadable: dict[str, str] = {}
        self.paused: Callable[[], bool] = lambda: False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen = Readings()
        # The last cheap reads while the job worked: a window, so that one read slow by chance fires nothing; emptied
        # when the run pauses, so that a pause is ended by fresh reads, not by those that caused it.
        self._working: deque = deque(maxlen=READ_WINDOW)
        self._idle: deque = deque(maxlen=RECENT_BATCHES)  # cheap reads before the run and while it paused
        self._probe_id = 0
        self._relids: list[int] = []
        self._next_health = self._next_apdex = float("-inf")

    def _read(self, signal: str, conn: Connection, statement, params: dict | None = None):
        """One signal's statement; None, reported once, when it cannot be read (no permission, a pooler)."""
        if signal in self.unreadable:
            return None
        try:
            return conn.execute(statement, params or {}).first()
        except DBAPIError as error:  # a lost connection is no signal's fault: the watch reconnects (_run)
            if error.connection_invalidated:
                raise
            self._unreadable(signal, error)
            return None

    def _unreadable(self, signal: str, error: BaseException) -> None:
        reason = str(getattr(error, "orig", None) or error).strip().splitlines()[0][:200] or type(error).__name__
        self.unreadable[signal] = reason
        self.report(f"Pacing: cannot read {signal} ({reason}); pacing without it")

    def start(self) -> None:
        """The levels before the run (the read, active sessions, the WAL position), then the thread."""
        try:
            self._levels_before()
        except Exception as error:  # noqa: BLE001 (no connection for the watch: the run goes on unwatched)
            self._unreadable("connection", error)
            return
        self._thread = threading.Thread(target=self._run, name="ci_cleanup pacing watch", daemon=True)
        self._thread.start()

    def _levels_before(self) -> None:
        with self._connect() as conn:
            row = self._read("read_latency", conn, select(func.max(self.table.c.id)))
            self._probe_id = (row[0] or 0) if row else 0
            row = self._read("autovacuum", conn, RELIDS, {"table": self.quoted})
            self._relids = list(row[0] or []) if row else []
            for _ in range(BASELINE_READS):
                self._time_read(conn, idle=True)
            row = self._read("active_sessions", conn, ACTIVE_SESSIONS, {"job": self.job})
            with self._lock:
                self._seen.sessions_before = row[0] if row else None
            self._sample_health(conn)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @contextmanager
    def _connect(self) -> Iterator[Connection]:
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            yield conn

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self._connect() as conn:
                    while not self._stop.wait(SAMPLE_EVERY_SECONDS):
                        self.sample(conn)
            except Exception as error:  # noqa: BLE001 (a lost connection: try again at the next sample)
                if "connection" not in self.unreadable:
                    self._unreadable("connection", error)
                self._stop.wait(SAMPLE_EVERY_SECONDS)

    def sample(self, conn: Connection) -> None:
        """One round of the readings the thread takes every SAMPLE_EVERY_SECONDS."""
        row = self._read("locks", conn, LOCKS, {"job": self.job})
        if row is not None:
            with self._lock:
                self._seen.locks_caused = max(self._seen.locks_caused, row[0])
                self._seen.lock_waited = max(self._seen.lock_waited, row[1])
        self._time_read(conn, idle=self.paused())
        if self.clock() >= self._next_health:
            self._sample_health(conn)

    def _time_read(self, conn: Connection, idle: bool) -> None:
        began = time.perf_counter()
        read_by_id = select(self.table.c.id).where(self.table.c.id == self._probe_id)  # as GitLab reads a row
        if self._read("read_latency", conn, read_by_id) is None and "read_latency" in self.unreadable:
            return
        seconds = time.perf_counter() - began
        with self._lock:
            if idle:
                self._idle.append(seconds)
                self._working.clear()
            else:
                self._working.append(seconds)

    def _sample_health(self, conn: Connection) -> None:
        self._next_health = self.clock() + HEALTH_EVERY_SECONDS
        sessions = self._read("active_sessions", conn, ACTIVE_SESSIONS, {"job": self.job})
        wal = self._read("wal_archive_queue", conn, WAL_ARCHIVE_QUEUE)
        if wal is not None and wal[0] is None:
            self._unreadable("wal_archive_queue", RuntimeError("archive_mode is on and no WAL was archived yet"))
        lag = self._read("replica_lag", conn, REPLICA_LAG)
        vacuum = self._read("autovacuum", conn, AUTOVACUUM, {"relids": self._relids}) if self._relids else None
        apdex = self._apdex()
        with self._lock:
            seen = self._seen
            seen.active_sessions = sessions[0] if sessions else None
            seen.wal_archive_queue = wal[0] if wal else None
            seen.replica_lag_seconds = float(lag[0]) if lag else None
            seen.autovacuum = bool(vacuum[0]) if vacuum else None
            if apdex is not None:
                seen.apdex = apdex

    def _apdex(self) -> float | None:
        """GitLab's SQL apdex from its Prometheus: ``apdex_url`` is a query URL (``…/api/v1/query?query=…``) whose
        first result is the apdex. The URL is never reported: it may hold credentials."""
        if not self.apdex_url or "apdex" in self.unreadable or self.clock() < self._next_apdex:
            return None
        self._next_apdex = self.clock() + APDEX_EVERY_SECONDS
        try:
            with urllib.request.urlopen(self.apdex_url, timeout=2) as response:  # noqa: S310 (the operator's URL)
                return float(json.load(response)["data"]["result"][0]["value"][1])
        except Exception as error:  # noqa: BLE001
            self._unreadable("apdex", RuntimeError(f"Prometheus query failed: {type(error).__name__}"))
            return None

    def lock_waits(self) -> tuple[int, int]:
        """Lock waits seen since the last batch ended: (the job caused, the job waited)."""
        with self._lock:
            return self._seen.locks_caused, self._seen.lock_waited

    def take(self) -> Readings:
        """What was seen since the last call; the lock waits start again from nothing."""
        with self._lock:
            seen, working, idle = self._seen, list(self._working), list(self._idle)
            self._seen = Readings(sessions_before=seen.sessions_before, active_sessions=seen.active_sessions,
                                  wal_archive_queue=seen.wal_archive_queue,
                                  replica_lag_seconds=seen.replica_lag_seconds, autovacuum=seen.autovacuum,
                                  apdex=seen.apdex)
        seen.read_seconds = statistics.median(working) if len(working) == READ_WINDOW else None
        seen.read_baseline = statistics.median(idle) if idle else None
        return seen
