"""Pacing by the database's health (issue 70): the controller's decisions on a clock the test moves, and on real
PostgreSQL, a lock the job would wait on, or one it makes others wait on, backs it off."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from sqlalchemy import create_engine, func, select, text, update

from ci_cleanup.drop_canceling_builds.job import drop_canceling_builds
from ci_cleanup.environments_auto_stop.job import environments_auto_stop
from ci_cleanup.gitlab import pacing
from ci_cleanup.gitlab.loop_helpers import Brake, Hooks, loop_until
from ci_cleanup.gitlab.pacing import Pacer, Readings, Watch, judge
from ci_cleanup.resources import RunOptions
from ci_cleanup.resources.gitlab_database import JOB_MARK
from ci_cleanup.resources.run_options import THROTTLE_ENV

from .factories import S, backend_waiting_on_lock, create, naive_ago, row
from .harness import on
from .runner import op_metadata, run_job
from .test_loop_helpers import Clock  # the fake clock the loop's own tests use

approx = pytest.approx


@pytest.fixture(autouse=True)
def unpaced(monkeypatch):
    """Pacing as a run gets it with nothing set (adaptive): this module's subject (conftest's turns it off)."""
    monkeypatch.delenv(THROTTLE_ENV, raising=False)


class Signals:
    """A watch whose readings the test sets, one per batch."""

    def __init__(self) -> None:
        self.next = Readings()
        self.unreadable: dict[str, str] = {}

    def take(self) -> Readings:
        taken, self.next = self.next, Readings()
        return taken


def paced(jitter: float = 0.0) -> tuple[Clock, Signals, Pacer]:
    clock, signals = Clock(), Signals()
    return clock, signals, Pacer(clock=clock, jitter=lambda: jitter, watch=signals)


def batch(clock: Clock, pacer: Pacer, seconds: float, default: int = 100) -> tuple[int, float]:
    """One batch of ``seconds`` at the pacer's size; the size it had and the pause the pacer asked for after it."""
    size = pacer.next_batch_size(default)
    clock.now += seconds
    pause = pacer.after_batch(seconds)
    clock.now += pause
    return size, pause


def test_with_no_signal_there_is_no_pause_and_the_seeds_size():
    clock, _, pacer = paced()
    assert [batch(clock, pacer, 0.02) for _ in range(5)] == [(100, 0.0)] * 5
    assert pacer.metadata == {
        "pacing": "adaptive", "pacing_paused_seconds": 0.0, "pacing_paused_share": 0.0,
        "pacing_batch_size_share_mean": 1.0, "pacing_batch_size_share_min": 1.0, "pacing_slowed_batches": 0,
        "pacing_slowed_by": {},
    }


def test_batches_slower_than_the_recent_ones_pause_and_shrink_the_next():
    clock, _, pacer = paced()
    assert [batch(clock, pacer, seconds) for seconds in [0.1] * 5 + [0.14, 0.14]] == [(100, 0.0)] * 7  # within 1.5 ×
    assert batch(clock, pacer, 0.2) == (100, 0.0)  # one slower batch: the last three's middle is still 0.14
    assert batch(clock, pacer, 0.2) == (100, approx(pacing.BACKOFF_FIRST_SECONDS))  # two: over 1.5 × 0.1 + 0.01
    assert pacer.next_batch_size(100) == 80  # Sidekiq throttling's soft cut
    assert dict(pacer.slowed_by) == {"batch_time": 1}


def test_one_slow_batch_or_a_short_run_fires_nothing():
    clock, _, pacer = paced()
    assert [batch(clock, pacer, seconds) for seconds in [0.1, 1.0, 1.0]] == [(100, 0.0)] * 3  # too few to judge
    clock, _, pacer = paced()
    assert [batch(clock, pacer, seconds) for seconds in [0.1] * 5 + [1.0, 0.1]] == [(100, 0.0)] * 7


def test_a_smaller_batch_is_judged_against_batches_no_larger():
    clock, _, pacer = paced()
    for _ in range(5):
        batch(clock, pacer, 0.1)  # 100 rows
    pacer.share = 0.5
    # 50 rows in 0.1 s is twice the time per row, but no batch of 50 or fewer has been seen: no signal
    assert [batch(clock, pacer, 0.1) for _ in range(3)] == [(50, 0.0), (55, 0.0), (61, 0.0)]


def test_a_lock_wait_the_job_causes_halves_the_batch_at_once():
    clock, signals, pacer = paced()
    batch(clock, pacer, 0.02)
    signals.next = Readings(locks_caused=1)
    assert batch(clock, pacer, 0.02) == (100, approx(pacing.BACKOFF_FIRST_SECONDS))
    assert pacer.next_batch_size(100) == 50
    signals.next = Readings(lock_waited=2, read_seconds=0.1, read_baseline=0.001)  # with latency too: halved
    assert batch(clock, pacer, 0.02) == (50, approx(2 * pacing.BACKOFF_FIRST_SECONDS))
    assert pacer.next_batch_size(100) == 25
    assert dict(pacer.slowed_by) == {"locks_caused": 1, "lock_waited": 1, "read_latency": 1}


def test_a_health_signal_pauses_with_exponential_backoff_while_it_lasts_and_keeps_the_size():
    clock, signals, pacer = paced()
    pauses = []
    for _ in range(12):
        signals.next = Readings(autovacuum=True)
        size, pause = batch(clock, pacer, 0.02)
        assert size == 100
        pauses.append(pause)
    first = pacing.BACKOFF_FIRST_SECONDS
    assert pauses == approx([min(pacing.BACKOFF_MAX_SECONDS, first * 2**n) for n in range(12)])
    assert batch(clock, pacer, 0.02) == (100, 0.0)  # it ended: no pause, the backoff starts again from the first
    signals.next = Readings(replica_lag_seconds=2.0)
    assert batch(clock, pacer, 0.02) == (100, approx(first))


def test_jitter_shortens_each_pause_by_up_to_half():
    clock, signals, pacer = paced(jitter=1.0)
    signals.next = Readings(wal_archive_queue=pacing.WAL_ARCHIVE_QUEUE_SEGMENTS + 1)
    assert batch(clock, pacer, 0.02) == (100, approx(pacing.BACKOFF_FIRST_SECONDS * (1 - pacing.JITTER)))


def test_the_size_grows_back_by_a_tenth_a_healthy_batch_up_to_the_seeds():
    clock, signals, pacer = paced()
    signals.next = Readings(locks_caused=1)
    batch(clock, pacer, 0.02)
    sizes = [batch(clock, pacer, 0.01)[0] for _ in range(10)]
    assert sizes == [50, 55, 61, 67, 73, 81, 89, 97, 100, 100]
    assert pacer.metadata["pacing_batch_size_share_min"] == 0.5


def test_the_size_never_drops_under_one_row():
    clock, signals, pacer = paced()
    for _ in range(20):
        signals.next = Readings(locks_caused=1)
        batch(clock, pacer, 0.01, default=10)
    assert pacer.next_batch_size(10) == 1
    assert pacer.share == pacing.MIN_SIZE_SHARE


def test_workers_share_one_budget_a_pause_holds_every_worker():
    """The bulk delete's workers: a signal after one worker's batch pauses the others until the same moment."""
    clock, signals, pacer = paced()
    pacer.next_batch_size(100)
    signals.next = Readings(locks_caused=1)
    first = pacer.after_batch(0.02)
    clock.now += 0.05  # another worker ends its batch meanwhile, with no signal of its own
    assert pacer.after_batch(0.02) == approx(first - 0.05)
    assert pacer.paused_seconds == first  # the run was paused once, not once a worker


def test_the_workers_batches_that_ran_into_a_pause_do_not_deepen_it():
    """The bulk delete's workers: batches slowed by the same contention back the run off once, not once a worker."""
    clock, signals, pacer = paced()
    assert pacer.next_batch_size(100) == 100  # this thread's worker begins a batch

    def other_worker(readings: Readings) -> float:
        """Another worker's whole batch, on a thread of its own; the pause it gets."""
        pauses = []

        def batch_ending_with(readings: Readings) -> None:
            pacer.next_batch_size(100)
            clock.now += 0.02
            signals.next = readings
            pauses.append(pacer.after_batch(0.02))

        thread = threading.Thread(target=batch_ending_with, args=(readings,))
        thread.start()
        thread.join()
        return pauses[0]

    first = other_worker(Readings(locks_caused=1))
    assert first == approx(pacing.BACKOFF_FIRST_SECONDS)
    signals.next = Readings(locks_caused=1)  # this worker's batch ran into that pause, with a lock wait of its own
    assert pacer.after_batch(0.04) == approx(first)
    assert (pacer.backoff, pacer.share, pacer.slowed_batches) == (1, 0.5, 1)
    clock.now += first
    assert other_worker(Readings(locks_caused=1)) == approx(2 * first)  # begun after the pause: it deepens it
    assert (pacer.backoff, pacer.share, dict(pacer.slowed_by)) == (2, 0.25, {"locks_caused": 2})


def test_the_metadata_says_how_the_run_was_paced():
    clock, signals, pacer = paced()
    batch(clock, pacer, 0.1)
    signals.next = Readings(autovacuum=True)
    batch(clock, pacer, 0.1)
    signals.next = Readings(autovacuum=True, locks_caused=1)
    batch(clock, pacer, 0.1)
    assert pacer.metadata == {
        "pacing": "adaptive", "pacing_paused_seconds": 0.3, "pacing_paused_share": 0.5,
        "pacing_batch_size_share_mean": 1.0, "pacing_batch_size_share_min": 1.0, "pacing_slowed_batches": 2,
        "pacing_slowed_by": {"autovacuum": 2, "locks_caused": 1},
        "pacing_slowed_by_autovacuum": 2, "pacing_slowed_by_locks_caused": 1,
    }
    assert pacer.window() == {"pacing_slowed_batches": 2, "pacing_paused_seconds": 0.3,
                              "pacing_batch_size_share": 1.0}
    batch(clock, pacer, 0.1)
    assert pacer.window() == {"pacing_slowed_batches": 0, "pacing_paused_seconds": 0.0,
                              "pacing_batch_size_share": 0.5}


@pytest.mark.parametrize(("readings", "fired"), [
    (Readings(read_seconds=0.0024, read_baseline=0.001), set()),  # under 1.5 × its baseline + the slack
    (Readings(read_seconds=0.0026, read_baseline=0.001), {"read_latency"}),
    (Readings(active_sessions=12, sessions_before=10), set()),  # 20 % over 10: 12 is not over it
    (Readings(active_sessions=13, sessions_before=10), {"active_sessions"}),
    (Readings(active_sessions=2, sessions_before=0), set()),  # at least 2 more than before
    (Readings(active_sessions=3, sessions_before=0), {"active_sessions"}),
    (Readings(wal_archive_queue=pacing.WAL_ARCHIVE_QUEUE_SEGMENTS), set()),  # GitLab's limit: over it, not at it
    (Readings(wal_archive_queue=pacing.WAL_ARCHIVE_QUEUE_SEGMENTS + 1), {"wal_archive_queue"}),
    (Readings(replica_lag_seconds=1.5), set()),
    (Readings(replica_lag_seconds=1.6), {"replica_lag"}),
    (Readings(autovacuum=False), set()),
    (Readings(apdex=0.99), set()),
    (Readings(apdex=0.98), {"apdex"}),
    (Readings(), set()),  # nothing read (every signal unreadable): nothing fires
])
def test_each_signal_fires_only_over_its_threshold(readings, fired):
    assert judge(readings) == fired


def test_the_loop_pauses_as_the_pacer_says_and_hands_its_size_to_the_batches():
    clock, signals, pacer = paced()
    brake, sizes = Brake(pacer=pacer), []
    hooks = Hooks(brake=brake)
    readings = [Readings(), Readings(locks_caused=1), Readings(), Readings()]

    def body() -> bool:
        if not readings:
            return False
        sizes.append(hooks.batch_size(100))
        signals.next = readings.pop(0)
        clock.now += 0.01
        return True

    loop_until(body, brake=brake, clock=clock, sleep=clock.sleep)
    assert sizes == [100, 100, 50, 55]
    assert clock.slept == approx([pacing.BACKOFF_FIRST_SECONDS])
    assert brake.paused_seconds == approx(pacing.BACKOFF_FIRST_SECONDS)


def test_a_fixed_duty_cycle_still_pauses_and_the_longer_pause_wins():
    clock, signals, pacer = paced()
    brake = Brake(duty_cycle=0.5, pacer=pacer)
    pacer.next_batch_size(100)
    assert brake.hold(0.5, clock.sleep) == 0.5  # the duty cycle's pause; no signal
    signals.next = Readings(autovacuum=True)
    pacer.next_batch_size(100)
    assert brake.hold(0.01, clock.sleep) == approx(pacing.BACKOFF_FIRST_SECONDS)  # the pacer's, longer
    assert brake.metadata["duty_cycle"] == 0.5 and brake.pacing_metadata["pacing"] == "adaptive"


def test_a_loop_cut_short_by_a_seeds_limit_says_so():
    clock, brake = Clock(), Brake()
    loop_until(lambda: False, timeout=1, brake=brake, clock=clock, sleep=clock.sleep)
    assert brake.metadata == {}  # done: nothing cut short

    def slow() -> bool:
        clock.now += 2
        return True

    loop_until(slow, timeout=1, brake=brake, clock=clock, sleep=clock.sleep)
    loop_until(lambda: True, limit=2, brake=brake, clock=clock, sleep=clock.sleep)
    assert brake.metadata == {"cut_short_by_seed_limit": {"timeout": 1, "limit": 1}}


def test_pacing_is_on_by_default_off_by_setting_and_a_bad_setting_is_one_line(monkeypatch):
    monkeypatch.delenv(THROTTLE_ENV, raising=False)
    assert RunOptions().brake().pacer is not None
    assert RunOptions(throttle="off").brake().pacer is None
    monkeypatch.setenv(THROTTLE_ENV, "OFF")
    assert RunOptions().brake().pacer is None
    assert RunOptions(throttle="adaptive").brake().pacer is not None
    monkeypatch.setenv(THROTTLE_ENV, "slow")
    with pytest.raises(ValueError, match=r"^CI_CLEANUP_THROTTLE must be adaptive or off, not 'slow'$"):
        RunOptions().brake()


# On real PostgreSQL: the watch beside a run, and the locks.

def watch_sampled_since(engine, since, job_pid: int) -> bool:
    """Whether the watch (a session of the job's other than ``job_pid``) began a statement over a second after
    ``since`` (the server's clock): it reads the lock waits first every 0.2 s, so a whole round ran after it."""
    with engine.connect() as conn:
        return bool(conn.scalar(text(
            "SELECT count(*) FROM pg_stat_activity WHERE starts_with(query, :mark) AND pid NOT IN (:job, "
            "pg_backend_pid()) AND query_start > CAST(:since AS timestamptz) + interval '1 second'"),
            {"since": since, "job": job_pid, "mark": JOB_MARK}))


def wait_until(condition, what: str) -> None:
    for _ in range(1200):
        if condition():
            return
        threading.Event().wait(0.05)
    raise AssertionError(f"never: {what}")


@pytest.mark.parametrize("stack", ["direct", "deployed"], indirect=True)  # and through PgBouncer, decomposed
def test_a_lock_the_job_would_wait_on_makes_it_back_off(stack, engine, redis_client):
    builds = [create(engine, "ci_builds", created_at=naive_ago(hours=2), updated_at=naive_ago(hours=2))
              for _ in range(5)]
    ran, b, ci = {}, S.ci_builds, on(engine, "ci_builds")  # the watch reads the ci database, where the builds are
    with ci.connect() as holder, holder.begin():
        holder.execute(select(b.c.id).where(b.c.id == builds[2]).with_for_update())  # a row GitLab holds
        job = threading.Thread(target=lambda: ran.update(result=run_job(drop_canceling_builds, stack)))
        job.start()
        job_pid = backend_waiting_on_lock(ci, "%WITH picked AS%")  # the job's batch waits on it
        since = holder.scalar(text("SELECT clock_timestamp()"))
        wait_until(lambda: watch_sampled_since(ci, since, job_pid), "the watch read the lock waits")
    job.join()

    assert op_metadata(ran["result"], "report_dropped_builds")["dropped_count"] == 5
    assert [row(engine, "ci_builds", i).status for i in builds] == ["failed"] * 5
    paced = op_metadata(ran["result"], "drop_canceling_builds_in_batches")
    assert paced["pacing"] == "adaptive" and paced["pacing_slowed_by"]["lock_waited"] == 1
    assert paced["pacing_slowed_by_lock_waited"] == 1 and paced["pacing_paused_seconds"] > 0
    assert "pacing_unreadable" not in paced


def test_a_lock_the_job_causes_others_makes_it_back_off(stack, engine):
    """A batch holding a row lock another session waits on (as a batch's transaction would): the watch sees it
    while the batch holds it, and the pacer halves the next batch and pauses."""
    build = create(engine, "ci_builds")
    table = S.ci_builds
    job_engine, watch_engine = create_engine(stack.url()), create_engine(stack.url(), pool_size=1)
    bump = update(table).values(lock_version=func.coalesce(table.c.lock_version, 0) + 1).where(table.c.id == build)
    # The job's statement as its engine sends it: its mark first.
    job_bump = text(f"{JOB_MARK} UPDATE {table.name} SET lock_version = coalesce(lock_version, 0) + 1 WHERE id = :id")
    watch = Watch(watch_engine, table, JOB_MARK, report=print)
    pacer = Pacer(watch=watch)
    brake, sizes = Brake(pacer=pacer), []
    hooks = Hooks(brake=brake)
    watch.paused = pacer.paused

    def gitlab_update() -> None:
        with engine.begin() as conn:
            conn.execute(bump)

    other = threading.Thread(target=gitlab_update)

    def body() -> bool:
        sizes.append(hooks.batch_size(100))
        if len(sizes) > 2:
            return False
        with job_engine.begin() as conn:
            conn.execute(job_bump, {"id": build})
            if len(sizes) == 1:  # GitLab's update of the same build comes while the batch holds it
                other.start()
                backend_waiting_on_lock(engine, "%SET lock_version%")
                wait_until(lambda: watch.lock_waits()[0] > 0, "the watch saw the wait the batch causes")
        return True

    slept = []
    watch.start()
    try:
        loop_until(body, brake=brake, sleep=lambda seconds: slept.append(seconds) or time.sleep(seconds))
    finally:
        watch.stop()
        other.join()
        job_engine.dispose()
        watch_engine.dispose()
    assert sizes == [100, 50, 55]
    assert pacer.slowed_by["locks_caused"] == 1 and len(slept) == 1 and slept[0] > 0
    assert row(engine, "ci_builds", build).lock_version == 3  # both batches' and GitLab's own update
    assert watch.unreadable == {}
    assert watch.take().wal_archive_queue == 0  # the test server archives nothing (archive_mode off): no queue


def test_a_signal_that_cannot_be_read_is_reported_once_and_left_out(stack, engine):
    """A database role that may not read the job's table: the cheap read is unreadable; the rest still works."""
    with engine.begin() as conn:
        conn.execute(text("DROP ROLE IF EXISTS ci_cleanup_watch_only"))
        conn.execute(text("CREATE ROLE ci_cleanup_watch_only LOGIN"))
    url = stack.url().replace("postgres@", "ci_cleanup_watch_only@")
    watch_engine, reports = create_engine(url, pool_size=1), []
    watch = Watch(watch_engine, S.ci_builds, JOB_MARK, report=reports.append)
    try:
        watch.start()
        with watch_engine.connect() as conn:
            watch.sample(conn)  # a second round: still reported only once
    finally:
        watch.stop()
        watch_engine.dispose()
        with engine.begin() as conn:
            conn.execute(text("DROP ROLE ci_cleanup_watch_only"))
    assert list(watch.unreadable) == ["read_latency"]
    assert watch.unreadable["read_latency"].startswith("permission denied for table")
    assert reports == [f"Pacing: cannot read read_latency ({watch.unreadable['read_latency']}); pacing without it"]
    readings = watch.take()
    assert readings.read_baseline is None and readings.sessions_before is not None
    assert judge(readings) == set()


def test_gitlabs_apdex_from_prometheus_slows_the_run_below_its_slo(stack, engine):
    class Prometheus(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = json.dumps({"status": "success", "data": {"resultType": "vector",
                                                             "result": [{"metric": {}, "value": [0, "0.95"]}]}})
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Prometheus)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    watch_engine = create_engine(stack.url(), pool_size=1)
    url = f"http://127.0.0.1:{server.server_port}/api/v1/query?query=gitlab_sql_apdex"
    watch = Watch(watch_engine, S.ci_builds, JOB_MARK, apdex_url=url)
    try:
        watch.start()
    finally:
        watch.stop()
        watch_engine.dispose()
        server.shutdown()
    readings = watch.take()
    assert readings.apdex == 0.95 and judge(readings) == {"apdex"}


def observed(result) -> list[dict]:
    return [{k: v.value for k, v in e.event_specific_data.asset_observation.metadata.items()}
            for e in result.all_events if e.event_type_value == "ASSET_OBSERVATION"]


def test_a_run_says_how_it_was_paced_and_its_observations_plot_it(stack, engine, redis_client, monkeypatch):
    builds = [create(engine, "ci_builds", created_at=naive_ago(hours=2), updated_at=naive_ago(hours=2))
              for _ in range(3)]
    config = {"ops": {"find_canceling_builds": {"config": {"batch_size": 2}}}}
    result = run_job(drop_canceling_builds, stack, run_config=config)

    assert op_metadata(result, "report_dropped_builds")["dropped_count"] == 3
    assert [row(engine, "ci_builds", i).status for i in builds] == ["failed"] * 3
    paced = op_metadata(result, "drop_canceling_builds_in_batches")  # the op that ran the batches
    assert paced["pacing"] == "adaptive" and "pacing_unreadable" not in paced
    slowed = paced["pacing_slowed_batches"]
    assert sum(paced["pacing_slowed_by"].values()) >= slowed and 0 <= paced["pacing_paused_share"] <= 1
    assert 0 < paced["pacing_batch_size_share_min"] <= paced["pacing_batch_size_share_mean"] <= 1
    (observation,) = observed(result)
    assert observation["dropped"] == 3 and observation["pacing_slowed_batches"] == slowed
    assert {"pacing_paused_seconds", "pacing_batch_size_share"} <= set(observation)

    monkeypatch.setenv(THROTTLE_ENV, "off")
    more = create(engine, "ci_builds", created_at=naive_ago(hours=2), updated_at=naive_ago(hours=2))
    result = run_job(drop_canceling_builds, stack, run_config=config)
    assert op_metadata(result, "report_dropped_builds")["dropped_count"] == 1
    assert row(engine, "ci_builds", more).status == "failed"
    assert [k for op in ("drop_canceling_builds_in_batches", "report_dropped_builds")
            for k in op_metadata(result, op) if k.startswith("pacing")] == []
    assert [k for o in observed(result) for k in o if k.startswith("pacing")] == []


def test_a_run_cut_short_by_a_seeds_limit_says_so_and_the_next_run_goes_on(stack, engine, redis_client):
    environments = [create(engine, "environments", name=f"review/{n}", slug=f"review-{n}",
                           auto_stop_at=naive_ago(hours=1), created_at=naive_ago(days=3),
                           updated_at=naive_ago(days=3)) for n in range(3)]
    config = {"ops": {"find_auto_stoppable_environments": {"config": {"max_loops": 1, "batch_size": 2}}}}
    first = op_metadata(run_job(environments_auto_stop, stack, run_config=config), "report_stopped_environments")
    assert (first["stopped_count"], first["limit_reached"], first["cut_short_by_seed_limit"]) == (2, "loops",
                                                                                                  {"limit": 1})
    second = op_metadata(run_job(environments_auto_stop, stack), "report_stopped_environments")  # the seed's 1000
    assert (second["stopped_count"], second["limit_reached"]) == (1, None) and "cut_short_by_seed_limit" not in second
    assert [row(engine, "environments", i).state for i in environments] == ["stopped"] * 3
