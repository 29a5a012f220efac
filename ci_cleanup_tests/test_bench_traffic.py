"""The traffic scenario: its percentiles, ratios, lock-wait reading and section text; the workload's transactions as
the database sees them; and one tiny run of the whole scenario (a scratch database)."""

from __future__ import annotations

import shutil
import threading

import pytest

from ci_cleanup_dev.bench import launched, traffic, workload
from ci_cleanup_dev.bench.floor import connect
from ci_cleanup_dev.bench.traffic import ALONE, CONTENDERS, LAUNCHED, JobTraffic, Sample
from ci_cleanup_dev.devstack import DAGSTER_YAML

from .test_bench_floor import _rows
from .test_bench_floor import bench_db as bench_db  # noqa: F401 (a fixture: a scratch database, seeded)


def test_percentile_is_the_nearest_rank():
    values = [float(v) for v in range(100, 0, -1)]  # 1..100, unordered
    assert traffic.percentile(values, 50) == 50 and traffic.percentile(values, 99) == 99
    assert traffic.percentile(values, 100) == 100 and traffic.percentile(values, 0) == 1
    assert traffic.percentile([3.0], 99) == 3.0
    assert traffic.percentile([1.0, 2.0, 3.0, 4.0], 99) == 4.0  # ceil(3.96) = 4th value
    with pytest.raises(ValueError):
        traffic.percentile([], 50)


def test_sample_takes_the_latencies_inside_the_window_in_ms():
    done = [("read", 9.0, 0.5), ("update", 10.0, 0.002), ("insert", 10.5, 0.004), ("read", 11.0, 0.010),
            ("read", 11.5, 0.9)]
    inside = traffic.in_window(done, 10.0, 11.0)
    assert inside == [0.002, 0.004, 0.010]
    sample = Sample.of(inside, (7.5, 0.0), 1.0, rows=100, wal_bytes=5000)
    assert (sample.transactions, sample.p50_ms, sample.p99_ms, sample.max_ms) == (3, 4.0, 10.0, 10.0)
    assert (sample.lock_ms, sample.job_lock_ms, sample.rows, sample.wal_bytes) == (7.5, 0.0, 100, 5000)


def _sample(p99: float, rows: int = 0, seconds: float = 1.0, job_lock_ms: float = 0.0, wal: int = 0) -> Sample:
    return Sample(100, 1.0, p99, p99 * 2, job_lock_ms, job_lock_ms, seconds, rows, wal)


def _traffic(p99s: dict[str, list[float]], rows_per_s: float = 10_000, job_lock_ms: float = 0.0) -> JobTraffic:
    figures = JobTraffic("drop_canceling_builds", 1000)
    for contender, values in p99s.items():
        rows = 0 if contender == ALONE else int(rows_per_s)
        figures.samples[contender] = [_sample(v, rows, job_lock_ms=job_lock_ms) for v in values]
    return figures


def test_ratio_is_the_median_of_each_rounds_own_pair():
    figures = _traffic({ALONE: [2.0, 10.0, 4.0], LAUNCHED: [4.0, 11.0, 12.0]})
    assert figures.ratio(LAUNCHED) == 2.0  # rounds 2.0, 1.1, 3.0; the medians' ratio would be 11 / 4
    other = _traffic({ALONE: [2.0], LAUNCHED: [3.0]})
    other.job = "schedule_bulk_delete_job_artifacts"
    assert traffic.p99_ratio_max([figures, other]) == 2.0


def test_wal_per_row_takes_off_the_workloads_own_rate():
    figures = JobTraffic("drop_canceling_builds", 1000)
    figures.samples[ALONE] = [_sample(1.0, seconds=10.0, wal=100_000)]  # 10 kB/s of the workload's own
    figures.samples["duty 0.5"] = [_sample(1.0, rows=1000, seconds=4.0, wal=2_040_000)]
    assert figures.wal_per_row("duty 0.5") == 2000.0


def test_widest_duty_cycle_meeting_every_target():
    alone = [10.0]
    p99s = {ALONE: alone, LAUNCHED: [30.0], "duty 1": [20.0], "duty 0.5": [16.0], "duty 0.25": [14.0],
            "duty 0.1": [11.0]}
    assert _traffic(p99s).best_duty() == "0.25"  # 1.6 over the target at 0.5
    assert _traffic(p99s, rows_per_s=4_000).best_duty() == "none"  # too slow at every duty cycle
    assert _traffic(p99s, job_lock_ms=250).best_duty() == "none"  # a lock wait over 200 ms
    assert _traffic({**p99s, "duty 1": [15.0]}).best_duty() == "1"


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
    assert traffic.lock_waits(log, {41, 42, 43}) == (310.0, 205.3)
    assert traffic.lock_waits(log[3:6], {41, 42, 43}) == (310.0, 0.0)
    assert traffic.lock_waits([], {41}) == (0.0, 0.0)


def test_pacer_pauses_in_proportion_to_the_time_since_the_last_batch():
    now, pauses = [0.0], []

    def sleep(seconds):
        pauses.append(seconds)
        now[0] += seconds

    pacer = traffic.Pacer(0.25, clock=lambda: now[0], sleep=sleep)
    for batch in (0.010, 0.020):
        now[0] += batch
        pacer()
    assert [round(p, 6) for p in pauses] == [0.03, 0.06]  # batch × (1 − 0.25) / 0.25, the pause not counted
    unbraked = traffic.Pacer(1.0, clock=lambda: now[0], sleep=sleep)
    now[0] += 1.0
    unbraked()
    assert len(pauses) == 2


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
    return figures


def test_section_states_the_figures_and_replaces_itself_only():
    text_ = traffic.section([_figures(3)], rows=1_000_000, rounds=3, rate=150, context="Written by a test.")
    assert text_.startswith(traffic.HEADING + "\n\nWritten by a test.\n")
    assert "| drop_canceling_builds | launched | 1.0 / 12.0 / 24.0 | 1.20 | 0 / 0 | 50,000 | 0 | yes |" in text_
    assert "| drop_canceling_builds | alone | 1.0 / 10.0 / 20.0 | | 0 / 0 | | | |" in text_
    assert "\ngitlab_p99_ratio_max=1.20\n" in text_
    assert "\nduty_cycle_meeting_targets_drop_canceling_builds=1\n" in text_
    assert "at 150 transactions/s:" in text_ and "`ci_builds` and `ci_job_artifacts` at 1,000,000 rows" in text_
    original = "# Benchmarks\n\n## The jobs\n\n| headline |\n\n## The services\n\n| services |\n"
    once = traffic.with_section(original, text_)
    assert once.startswith(original) and once.count(traffic.HEADING) == 1
    again = traffic.with_section(once, text_.replace("1.20", "1.30"))
    assert again.count(traffic.HEADING) == 1 and "gitlab_p99_ratio_max=1.30" in again and again.startswith(original)
    middle = original.replace("## The services", text_ + "\n## The services")
    assert traffic.with_section(middle, "## GitLab's traffic: a synthetic workload beside each job\n\nnew\n") == (
        original.replace("## The services", traffic.HEADING + "\n\nnew\n\n## The services"))


def test_results_of_separate_runs_are_merged_each_job_once(tmp_path):
    path = tmp_path / "traffic.json"
    first = _figures(3)
    first.load, first.rows = [1.5, 2.0], 1_000_000
    assert traffic.merged(path, [first]) == [first]
    bulk = _figures(3)
    bulk.job = "schedule_bulk_delete_job_artifacts"
    again = _figures(1)
    assert [(r.job, len(r.samples[ALONE])) for r in traffic.merged(path, [bulk])] == [
        ("drop_canceling_builds", 3), ("schedule_bulk_delete_job_artifacts", 3)]
    merged = traffic.merged(path, [again])
    assert [(r.job, len(r.samples[ALONE])) for r in merged] == [
        ("drop_canceling_builds", 1), ("schedule_bulk_delete_job_artifacts", 3)]
    assert traffic.merged(path, []) == merged and traffic.merged(None, [bulk]) == [bulk]


def test_workload_runs_its_count_and_waits_on_a_row_another_session_holds(bench_db):
    """Bounded by its count; every update and insert reached the database; a row lock another session holds is
    logged as the workload's wait, with that session as its holder."""
    url, engine = bench_db
    admin, holder = connect(url), connect(url)
    cur = admin.cursor()
    cur.execute(f"CREATE SCHEMA IF NOT EXISTS {launched.TEMPLATE}")
    cur.execute(f"CREATE SEQUENCE IF NOT EXISTS {workload.JOB_IDS} START 1000000000000")
    builds = _rows(engine, "SELECT id, partition_id FROM p_ci_builds ORDER BY id LIMIT 50")
    artifacts = _rows(engine, "SELECT id, partition_id FROM p_ci_job_artifacts ORDER BY id LIMIT 50")
    locked = [list(builds[0])]
    lock_versions = _rows(engine, "SELECT sum(lock_version) FROM p_ci_builds")[0][0]
    spec = workload.Spec(url=url, rate=200, count=120, seconds=60, clients=3, builds=[list(b) for b in builds[1:]],
                         artifacts=[list(a) for a in artifacts], hot_table="p_ci_builds", hot=locked, hot_share=1.0)
    log = traffic.server_log(cur)
    offset = log.stat().st_size
    holder.autocommit = False
    holder.cursor().execute("SELECT 1 FROM p_ci_builds WHERE id = %s FOR UPDATE", (locked[0][0],))
    holder_pid = holder.get_backend_pid()
    release = threading.Timer(0.5, holder.rollback)
    pids: list[int] = []
    release.start()
    try:
        done = workload.run(spec, threading.Event(), pids.extend)
    finally:
        release.join()
        holder.close()
        admin.close()
    kinds = [kind for kind, _, _ in done]
    assert len(done) == 120 and set(kinds) == {"update", "insert", "read"} and len(pids) == 3
    assert _rows(engine, "SELECT sum(lock_version) FROM p_ci_builds")[0][0] - lock_versions == kinds.count("update")
    assert _rows(engine, "SELECT count(*) FROM p_ci_job_artifacts WHERE job_id >= 1000000000000") == [
        (kinds.count("insert"),)]
    lines = log.read_text(errors="replace")[offset:].splitlines()
    longest, by_others = traffic.lock_waits(lines, set(pids))
    assert by_others >= traffic.LOCK_LOG_MS and longest >= by_others
    assert any(f"holding the lock: {holder_pid}." in line for line in lines)


def test_a_tiny_scenario_runs_every_contender_and_changes_every_candidate(bench_db, stack, tmp_path, monkeypatch):
    """One round of drop_canceling_builds: every contender measured once beside the workload, every run changing
    exactly the candidates, and the tables left without them."""
    monkeypatch.setattr(traffic, "ALONE_S", 2)
    url, engine = bench_db
    shutil.copy(DAGSTER_YAML, tmp_path / "dagster.yaml")
    env = {"CI_CLEANUP_DATABASE_URL": url, "CI_CLEANUP_REDIS_URL": stack.redis_url,
           "CI_CLEANUP_DAGSTER_PG_URL": stack.url("dagster"), "DAGSTER_HOME": str(tmp_path)}
    for name in ("CI_CLEANUP_DAGSTER_PG_URL", "DAGSTER_HOME"):
        monkeypatch.setenv(name, env[name])
    builds = _rows(engine, "SELECT count(*), max(id) FROM p_ci_builds")
    logged: list[str] = []
    results = traffic.bench_traffic(env, rows=500, candidates=250, rounds=1, jobs=["drop_canceling_builds"],
                                    rate=100, log=logged.append)
    [figures] = results
    assert {c: [s.rows for s in samples] for c, samples in figures.samples.items()} == {
        c: [0 if c == ALONE else 250] for c in CONTENDERS}
    assert all(s.transactions > 0 and s.p50_ms <= s.p99_ms <= s.max_ms for ss in figures.samples.values() for s in ss)
    assert figures.samples[ALONE][0].seconds >= 2 and figures.samples[LAUNCHED][0].wal_bytes > 0
    assert len([line for line in logged if " round 1 " in line]) == len(CONTENDERS)
    assert _rows(engine, "SELECT count(*), max(id) FROM p_ci_builds WHERE id <= :b", b=builds[0][1]) == builds
    assert _rows(engine, "SELECT count(*) FROM p_ci_builds WHERE id > :b", b=builds[0][1]) == [(0,)]
    assert _rows(engine, "SELECT count(*) FROM feature_gates WHERE feature_key LIKE '%high_concurrency'") == [(0,)]
    assert "gitlab_p99_ratio_max=" in traffic.section(results, rows=300, rounds=1, rate=100, context="")
    from dagster import DagsterInstance, RunsFilter

    with DagsterInstance.get() as instance:  # the shared Dagster database left as found
        records = instance.get_run_records(RunsFilter(job_name="drop_canceling_builds"))
        assert [r.dagster_run.tags["ci_cleanup/rows_changed"] for r in records] == ["250"]
        for record in records:
            instance.delete_run(record.dagster_run.run_id)
