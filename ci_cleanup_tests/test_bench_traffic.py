"""The traffic scenario: its percentiles, ratios, targets, lock-wait reading and section text; the workload's
schedule and transactions as the database sees them, each latency from its scheduled start; the contenders' brakes as
the jobs build them; and one tiny run of the whole scenario (a scratch database)."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace

import pytest

from ci_cleanup_dev.bench import launched, traffic, traffic_report, workload
from ci_cleanup_dev.bench.floor import connect
from ci_cleanup_dev.bench.traffic_report import (
    ADAPTIVE,
    ALONE,
    CONTENDERS,
    QUIET_ADAPTIVE,
    QUIET_UNTHROTTLED,
    STEP,
    UNTHROTTLED,
    JobTraffic,
    Sample,
)
from ci_cleanup_dev.bench.workload import Done

from .test_bench_floor import _rows
from .test_bench_floor import bench_db as bench_db  # noqa: F401 (a fixture: a scratch database, seeded)


def test_percentile_is_the_nearest_rank():
    values = [float(v) for v in range(100, 0, -1)]  # 1..100, unordered
    assert traffic_report.percentile(values, 50) == 50 and traffic_report.percentile(values, 99) == 99
    assert traffic_report.percentile(values, 100) == 100 and traffic_report.percentile(values, 0) == 1
    assert traffic_report.percentile([3.0], 99) == 3.0
    assert traffic_report.percentile([1.0, 2.0, 3.0, 4.0], 99) == 4.0  # ceil(3.96) = 4th value
    with pytest.raises(ValueError):
        traffic_report.percentile([], 50)


def test_sample_takes_each_latency_from_the_scheduled_start_in_ms():
    done = [Done("update", 10.0, 0.002, 0.001), Done("insert", 10.5, 0.004, 0.004), Done("read", 11.0, 0.010, 0.003)]
    run = traffic.Run(10.0, 11.0, None, stopped=False, pacing={"pacing_paused_share": 0.25})
    sample = Sample.of(done, (7.5, 0.0), run, rows=100)
    assert (sample.latencies_ms, sample.service_p99_ms) == ([2.0, 4.0, 10.0], 4.0)
    assert (sample.transactions, sample.p(50), sample.p(99)) == (3, 4.0, 10.0)
    assert (sample.lock_ms, sample.job_lock_ms, sample.seconds, sample.rows, sample.stopped) == (7.5, 0.0, 1.0, 100,
                                                                                              False)
    assert sample.slow_share(3.0) == 2 / 3 and sample.pacing == {"pacing_paused_share": 0.25}


def _sample(p99: float, rows: int = 0, seconds: float = 1.0, job_lock_ms: float = 0.0, pacing=None) -> Sample:
    """A window of 100 transactions: 98 at 1 ms, two at ``p99``."""
    return Sample([1.0] * 98 + [p99] * 2, p99, job_lock_ms, job_lock_ms, seconds, rows, True, pacing or {})


def _traffic(p99s: dict[str, list[float]], rows_per_s: dict[str, float] | None = None,
             job_lock_ms: float = 0.0) -> JobTraffic:
    figures = JobTraffic("drop_canceling_builds", 1000)
    for contender, values in p99s.items():
        rows = 0 if contender == ALONE else int((rows_per_s or {}).get(contender, 10_000))
        figures.samples[contender] = [_sample(v, rows, job_lock_ms=job_lock_ms) for v in values]
    return figures


def test_ratio_and_slowed_share_are_the_medians_of_each_rounds_own_pair():
    figures = _traffic({ALONE: [2.0, 10.0, 4.0], ADAPTIVE: [4.0, 11.0, 12.0]})
    assert figures.ratio(ADAPTIVE) == 2.0  # rounds 2.0, 1.1, 3.0; the medians' ratio would be 11 / 4
    # Over 1.5 × the round's alone p99: round 1 (> 3 ms) two of 100, round 2 (> 15 ms) none, round 3 (> 6 ms) two.
    assert figures.slow_share(ADAPTIVE) == 0.02


def _step(light: float, heavy: float) -> dict[str, Sample]:
    return {name: _sample(5.0, rows=int(light if share < 1 else heavy), seconds=1.0) for name, share in STEP}


def test_targets_against_the_best_fixed_duty_cycle_that_keeps_the_ratio():
    p99s = {ALONE: [10.0], UNTHROTTLED: [30.0], "duty 0.5": [14.0], "duty 0.25": [12.0], ADAPTIVE: [14.0],
            QUIET_UNTHROTTLED: [0.0], QUIET_ADAPTIVE: [0.0]}
    pace = {UNTHROTTLED: 20_000, "duty 0.5": 9_000, "duty 0.25": 5_000, ADAPTIVE: 8_500, QUIET_UNTHROTTLED: 20_000,
            QUIET_ADAPTIVE: 19_000}
    figures = _traffic(p99s, pace)
    figures.step = _step(light=6_000, heavy=3_000)
    assert figures.best_fixed() == "duty 0.5"  # unthrottled is faster, over 1.5
    assert figures.vs_best_fixed() == 8_500 / 9_000 and figures.no_traffic() == 0.95
    assert figures.light_over_heavy() == 2.0
    assert figures.met() == {"ratio": True, "lock_ms": True, "vs_best_fixed": True, "step": True, "no_traffic": True}
    slower = _traffic(p99s, {**pace, ADAPTIVE: 8_000, QUIET_ADAPTIVE: 17_000}, job_lock_ms=250)
    slower.step = _step(light=3_000, heavy=3_000)
    assert slower.met() == {"ratio": True, "lock_ms": False, "vs_best_fixed": False, "step": False,
                            "no_traffic": False}
    none_keeps = _traffic({**p99s, "duty 0.5": [20.0], "duty 0.25": [16.0]}, pace)
    none_keeps.step = _step(light=1, heavy=1)
    assert none_keeps.best_fixed() is None and none_keeps.met()["vs_best_fixed"] is None
    none_keeps.step["heavy"].stopped = False  # ran out of candidates: the step says nothing
    assert none_keeps.met()["step"] is None


def test_lock_waits_are_read_from_the_log_with_their_holder():
    log = [
        "2026-12-01 22:40:00.100 UTC [41] LOG:  process 41 still waiting for ShareLock on transaction 9 after 5.1 ms",
        "2026-12-01 22:40:00.100 UTC [41] DETAIL:  Process holding the lock: 77. Wait queue: 41.",
        "2026-12-01 22:40:00.300 UTC [41] LOG:  process 41 acquired ShareLock on transaction 9 after 205.3 ms",
        "2026-12-01 22:40:01.000 UTC [42] LOG:  process 42 still waiting for ShareLock on transaction 8 after 5.0 ms",
        "2026-12-01 22:40:01.000 UTC [42] DETAIL:  Processes holding the lock: 41, 43. Wait queue: 42.",
        "2026-12-01 22:40:01.300 UTC [42] LOG:  process 42 acquired ShareLock on transaction 8 after 310.0 ms",
        "2026-12-01 22:40:02.000 UTC [77] LOG:  process 77 acquired ShareLock on transaction 5 after 900.0 ms",
    ]
    # 41 waited on 77 (the job's backend); 42 on the workload's own 41 and 43; 77 is not the workload's.
    assert traffic_report.lock_waits(log, {41, 42, 43}) == (310.0, 205.3)
    assert traffic_report.lock_waits(log[3:6], {41, 42, 43}) == (310.0, 0.0)
    assert traffic_report.lock_waits([], {41}) == (0.0, 0.0)


def test_the_contenders_brakes_are_the_ones_the_jobs_build(monkeypatch):
    monkeypatch.setenv("CI_CLEANUP_THROTTLE", "off")
    monkeypatch.setenv("CI_CLEANUP_DUTY_CYCLE", "0.5")
    said: list[str] = []
    traffic.no_settings(said.append)  # the adaptive contender is the job with no setting
    assert len(said) == 2
    adaptive = traffic.brake_of(ADAPTIVE)
    assert adaptive.duty_cycle == 1.0 and adaptive.pacer is not None
    assert traffic.brake_of(QUIET_ADAPTIVE).pacer is not None
    for contender, duty in ((UNTHROTTLED, 1.0), (QUIET_UNTHROTTLED, 1.0), ("duty 0.5", 0.5), ("duty 0.25", 0.25)):
        brake = traffic.brake_of(contender)
        assert (brake.duty_cycle, brake.pacer) == (duty, None)


def test_a_tally_counts_each_batchs_rows_and_ends_the_run_past_the_window():
    stop = threading.Event()
    tally = traffic.Tally("stale_runner_machines_cleanup", stop)
    tally([1, 2, 3])
    middle = time.time()
    tally([4])
    assert (tally.rows(), tally.rows(end=middle), tally.rows(start=middle)) == (4, 3, 1)
    stop.set()
    with pytest.raises(traffic.WindowEnd):
        tally([5, 6])
    assert tally.rows() == 6  # the batch that ended past the window still counts: the window is the run
    workers = traffic.Tally(traffic.BULK, stop)
    workers(0, SimpleNamespace(count=100))  # the bucket workers stop on Hooks.stop themselves
    assert workers.rows() == 100


def test_the_schedule_is_evenly_spaced_in_each_phase():
    assert workload.schedule([[1.0, 4], [0.5, 2]]) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert workload.schedule([[2.0, 0.5]]) == [0.0]


def test_workload_mix_covers_every_kind():
    assert [workload.pick_kind(d) for d in (0, 39, 40, 59, 60, 99)] == [
        "update", "update", "insert", "insert", "read", "read"]
    assert sum(share for _, share in workload.MIX) == 100
    with pytest.raises(ValueError):
        workload.pick_kind(100)


def _figures(samples_per_contender: int) -> JobTraffic:
    figures = JobTraffic("drop_canceling_builds", 100_000)
    for contender in CONTENDERS:
        figures.samples[contender] = [
            _sample(10.0 if contender == ALONE else 12.0, 0 if contender == ALONE else 50_000)
        ] * samples_per_contender
    figures.step = _step(light=40_000, heavy=20_000)
    return figures


def test_section_states_the_figures_and_replaces_itself_only():
    [figures] = results = [_figures(3)]
    figures.rows = 1_000_000
    text_ = traffic_report.section(results, rate=150, window_s=7.2, context="Written by a test.")
    assert text_.startswith(traffic_report.HEADING + "\n\nWritten by a test.\n")
    assert "| drop_canceling_builds | adaptive | 100 | 1.0 / 12.0 | 1.20 | 0.0% | 0 | 50,000 | 0%; nothing |" in text_
    assert "| drop_canceling_builds | alone | 100 | 1.0 / 10.0 |  |  |  |  |  |" in text_
    assert "| drop_canceling_builds | heavy | 150 | 100 | 1.0 / 5.0 | 20,000 | 0 |" in text_
    assert ("| drop_canceling_builds | 1.20: met | 0: met | unthrottled, 50,000 rows/s | 1.00: met "
            "| 40,000 / 20,000: met | 1.00: met |") in text_
    assert "\nadaptive_p99_ratio_max=1.20\n" in text_ and "\nstep_light_over_heavy_min=2.00\n" in text_
    assert "\ntargets_met_drop_canceling_builds=ratio,lock_ms,vs_best_fixed,step,no_traffic\n" in text_
    assert "at\n150 transactions/s:" in text_ and "`ci_builds` and `ci_job_artifacts` at 1,000,000 rows" in text_
    original = "# Benchmarks\n\n## The jobs\n\n| headline |\n\n## The services\n\n| services |\n"
    once = traffic_report.with_section(original, text_)
    assert once.startswith(original) and once.count(traffic_report.HEADING) == 1
    again = traffic_report.with_section(once, text_.replace("1.20", "1.30"))
    assert again.count(traffic_report.HEADING) == 1 and "adaptive_p99_ratio_max=1.30" in again
    middle = original.replace("## The services", text_ + "\n## The services")
    assert traffic_report.with_section(middle, traffic_report.HEADING + "\n\nnew\n") == (
        original.replace("## The services", traffic_report.HEADING + "\n\nnew\n\n## The services"))


def test_results_of_separate_runs_are_merged_each_job_once(tmp_path):
    path = tmp_path / "traffic.json"
    first = _figures(3)
    first.load, first.rows = [1.5, 2.0], 1_000_000
    assert traffic_report.merged(path, [first]) == [first]
    bulk = _figures(3)
    bulk.job = "schedule_bulk_delete_job_artifacts"
    again = _figures(1)
    assert [(r.job, len(r.samples[ALONE])) for r in traffic_report.merged(path, [bulk])] == [
        ("drop_canceling_builds", 3), ("schedule_bulk_delete_job_artifacts", 3)]
    merged = traffic_report.merged(path, [again])
    assert [(r.job, len(r.samples[ALONE])) for r in merged] == [
        ("drop_canceling_builds", 1), ("schedule_bulk_delete_job_artifacts", 3)]
    assert traffic_report.merged(path, []) == merged and traffic_report.merged(None, [bulk]) == [bulk]


def _prepare_workload(url: str, engine) -> tuple[list, list]:
    admin = connect(url)
    try:
        cur = admin.cursor()
        cur.execute(f"CREATE SCHEMA IF NOT EXISTS {launched.TEMPLATE}")
        cur.execute(f"CREATE SEQUENCE IF NOT EXISTS {workload.JOB_IDS} START 1000000000000")
    finally:
        admin.close()
    builds = _rows(engine, "SELECT id, partition_id FROM p_ci_builds ORDER BY id LIMIT 50")
    artifacts = _rows(engine, "SELECT id, partition_id FROM p_ci_job_artifacts ORDER BY id LIMIT 50")
    return [list(b) for b in builds], [list(a) for a in artifacts]


def test_workload_runs_its_schedule_and_waits_on_a_row_another_session_holds(bench_db):
    """Bounded by its schedule; every update and insert reached the database; a row lock another session holds is
    logged as the workload's wait, with that session as its holder."""
    url, engine = bench_db
    builds, artifacts = _prepare_workload(url, engine)
    admin, holder = connect(url), connect(url)
    locked = [builds[0]]
    lock_versions = _rows(engine, "SELECT sum(lock_version) FROM p_ci_builds")[0][0]
    spec = workload.Spec(url=url, phases=[[0.4, 200], [0.2, 100]], clients=3, builds=builds[1:],
                         artifacts=artifacts, hot_table="p_ci_builds", hot=locked, hot_share=1.0)
    log = traffic.server_log(admin.cursor())
    offset = log.stat().st_size
    holder.autocommit = False
    holder.cursor().execute("SELECT 1 FROM p_ci_builds WHERE id = %s FOR UPDATE", (locked[0][0],))
    holder_pid = holder.get_backend_pid()
    release = threading.Timer(0.5, holder.rollback)
    pids: list[int] = []
    release.start()
    try:
        done = workload.run(spec, threading.Event(), lambda backends, start: pids.extend(backends))
    finally:
        release.join()
        holder.close()
        admin.close()
    kinds = [d.kind for d in done]
    assert len(done) == 100 and set(kinds) == {"update", "insert", "read"} and len(pids) == 3
    assert _rows(engine, "SELECT sum(lock_version) FROM p_ci_builds")[0][0] - lock_versions == kinds.count("update")
    assert _rows(engine, "SELECT count(*) FROM p_ci_job_artifacts WHERE job_id >= 1000000000000") == [
        (kinds.count("insert"),)]
    lines = log.read_text(errors="replace")[offset:].splitlines()
    longest, by_others = traffic_report.lock_waits(lines, set(pids))
    assert by_others >= traffic.LOCK_LOG_MS and longest >= by_others
    assert any(f"holding the lock: {holder_pid}." in line for line in lines)


def _release_when_waiting(url: str, holder, started: dict, last_due: float) -> None:
    """Roll ``holder`` back once the workload's backend waits on its lock and every transaction is past due."""
    watcher = connect(url)
    try:
        cur, deadline = watcher.cursor(), time.monotonic() + 60
        while time.monotonic() < deadline:
            cur.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s) AND wait_event_type = 'Lock'",
                        (started.get("pids", []),))
            if cur.fetchone()[0] and time.time() > started["start"] + last_due:
                break
            time.sleep(0.01)
    finally:
        holder.rollback()
        watcher.close()


def test_a_transaction_held_up_behind_another_counts_from_its_scheduled_start(bench_db):
    """One connection, its first update waiting on a row lock until every later transaction is past due: those are
    sent late, and each one's latency counts from its scheduled start, not from when it was sent."""
    url, engine = bench_db
    builds, artifacts = _prepare_workload(url, engine)
    phases = [[0.5, 20]]  # ten transactions
    kinds = [workload.pick_kind(random.Random(n).randrange(100)) for n in range(10)]
    first_update = kinds.index("update")
    assert first_update < 9  # transactions after it (each one's kind comes from its number)
    holder = connect(url)
    holder.autocommit = False
    holder.cursor().execute("SELECT 1 FROM p_ci_builds WHERE id = %s FOR UPDATE", (builds[0][0],))
    started: dict = {}
    release = threading.Thread(target=_release_when_waiting,
                               args=(url, holder, started, workload.schedule(phases)[-1]))
    spec = workload.Spec(url=url, phases=phases, clients=1, builds=builds[1:], artifacts=artifacts,
                         hot_table="p_ci_builds", hot=[builds[0]], hot_share=1.0)
    try:
        done = workload.run(spec, threading.Event(),
                            lambda pids, start: (started.update(pids=pids, start=start), release.start()))
    finally:
        release.join()
        holder.close()
    by_due = sorted(done, key=lambda d: d.due)
    assert [d.kind for d in by_due] == kinds
    blocked = by_due[first_update]
    blocked_end = blocked.due + blocked.latency
    for later in by_due[first_update + 1:]:
        sent = later.due + later.latency - later.service
        assert sent >= blocked_end - 1e-6 > later.due  # sent only once the blocked one ended, after it was due
        assert later.latency == pytest.approx(sent - later.due + later.service)
        assert later.latency > later.service


def test_a_tiny_scenario_runs_every_contender_and_the_step_test(bench_db, stack, monkeypatch):
    """One round of drop_canceling_builds: every contender measured once (a job's run changing every candidate where
    it ran out of them), then the step test, and the tables left without the candidates."""
    monkeypatch.setattr(traffic, "MIN_TRANSACTIONS", 20)
    monkeypatch.setattr(traffic, "WARM_S", 0.2)
    url, engine = bench_db
    env = {"CI_CLEANUP_DATABASE_URL": url, "CI_CLEANUP_REDIS_URL": stack.redis_url}
    builds = _rows(engine, "SELECT count(*), max(id) FROM p_ci_builds")
    logged: list[str] = []
    results, cpus = traffic.bench_traffic(env, rows=500, candidates=250, rounds=1, jobs=["drop_canceling_builds"],
                                          rate=100, log=logged.append)
    [figures] = results
    assert cpus.startswith("not pinned")
    assert [len(samples) for samples in figures.samples.values()] == [1] * len(CONTENDERS)
    assert figures.samples[ALONE][0].rows == 0 and figures.candidates >= 250  # more where 250 ran out too soon
    for contender in CONTENDERS[1:]:
        [sample] = figures.samples[contender]
        # Stopped by the window's end, or every candidate changed
        assert 0 < sample.rows <= figures.candidates and (sample.stopped or sample.rows == figures.candidates)
    assert all(s.p(50) <= s.p(99) for c in CONTENDERS if not c.startswith("no traffic")
               for s in figures.samples[c])
    assert [len(figures.samples[c][0].latencies_ms) > 0 for c in (QUIET_ADAPTIVE, ALONE)] == [False, True]
    assert "pacing_paused_share" in figures.samples[ADAPTIVE][0].pacing
    assert list(figures.step) == [name for name, _ in STEP] and figures.step_candidates >= 250
    assert sum(s.rows for s in figures.step.values()) <= figures.step_candidates
    assert len([line for line in logged if " round 1 " in line]) == len(CONTENDERS)
    assert _rows(engine, "SELECT count(*), max(id) FROM p_ci_builds WHERE id <= :b", b=builds[0][1]) == builds
    assert _rows(engine, "SELECT count(*) FROM p_ci_builds WHERE id > :b", b=builds[0][1]) == [(0,)]
    assert _rows(engine, "SELECT count(*) FROM feature_gates WHERE feature_key LIKE '%high_concurrency'") == [(0,)]
    assert "adaptive_p99_ratio_max=" in traffic_report.section(results, rate=100, window_s=0.7, context="")
