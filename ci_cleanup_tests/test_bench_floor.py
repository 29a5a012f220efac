"""The benchmark's floors do exactly what the jobs do, its reset restores the state exactly, and its digest
sees a difference; one job launched as operators run it, against its floor (a scratch database each)."""

from __future__ import annotations

import datetime as dt
import itertools
import os
import shutil
import threading

import pytest
from sqlalchemy import create_engine, text

from ci_cleanup.gitlab import sidekiq_status
from ci_cleanup.gitlab.schema import utc_now
from ci_cleanup_dev.batches import BY_NAME, FLOORS
from ci_cleanup_dev.bench import launched, seed, statements
from ci_cleanup_dev.bench.floor import connect
from ci_cleanup_dev.ddl import create_schema
from ci_cleanup_dev.devstack import DAGSTER_YAML, EmbeddedStack

from .harness import gitlab_database

CANDIDATES = 300


@pytest.fixture
def bench_db(scratch_database, redis_client):
    engine = gitlab_database(scratch_database)
    for table in seed.INSERTS:  # background rows the jobs must leave alone
        seed.insert(engine, table, 500)
    yield scratch_database, engine
    engine.dispose()


def _rows(engine, query: str, **params) -> list[tuple]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(query), params)]


def _state(cur, job, before):
    return launched.digest(cur, job, before, utc_now() - dt.timedelta(days=2))


def _layout(cur, job, before) -> list[tuple]:
    """Where the candidates are: (table, ctid, id) in id order."""
    found = []
    for table in before:
        cur.execute(f"SELECT tableoid::regclass::text, ctid::text, id FROM {table} WHERE id > %s ORDER BY id",
                    (before[table],))
        found += cur.fetchall()
    return found


def _floor_then_service(url, engine, client, job):
    """(digest before, after the floor, after the reset, after the service), and ``before``; asserts that each reset
    puts the candidates back where the one before did (the runs after them meet the same table)."""
    before = launched.add_candidates(engine, client, job, CANDIDATES)
    admin = connect(url)
    try:
        cur = admin.cursor()
        launched.snapshot(cur, job, before)
        initial = _state(cur, job, before)
        FLOORS[job](url, client)
        after_floor = _state(cur, job, before)
        launched.reset(cur, job, before)
        after_reset, layout = _state(cur, job, before), _layout(cur, job, before)
        BY_NAME[job].job(engine, client, lambda: None)
        after_service = _state(cur, job, before)
        launched.reset(cur, job, before)
        assert _layout(cur, job, before) == layout and len(layout) >= CANDIDATES
        FLOORS[job](url, client)  # the floor's own end state stays for the test's assertions
    finally:
        admin.close()
    return (initial, after_floor, after_reset, after_service), before


@pytest.mark.parametrize("job", list(FLOORS))
def test_floor_leaves_the_tables_as_the_service_and_reset_restores_them(bench_db, redis_client, job):
    url, engine = bench_db
    (initial, after_floor, after_reset, after_service), before = _floor_then_service(url, engine, redis_client, job)
    assert after_floor == after_service
    assert after_reset == initial
    assert after_floor != initial


def test_a_release_without_a_scoped_table_is_benched_on_the_tables_it_has(scratch_database, redis_client):
    """18.y has no ci_runner_machines_archived: the snapshot, reset and digest leave it out, not fail on it."""
    engine = create_engine(scratch_database)
    create_schema(engine, release="18.y")
    seed.borrow_indexes(engine, "18.y", log=lambda line: None)
    for table in seed.INSERTS:
        seed.insert(engine, table, 500)
    states, before = _floor_then_service(scratch_database, engine, redis_client, "stale_runner_machines_cleanup")
    initial, after_floor, after_reset, after_service = states
    assert list(before) == ["ci_runner_machines"]
    assert list(initial) == ["ci_runner_machines", *launched.SIDE_TABLES]
    assert after_floor == after_service and after_reset == initial
    assert after_floor["ci_runner_machines"][0] == initial["ci_runner_machines"][0] - CANDIDATES
    engine.dispose()


def test_drop_floor_fails_every_candidate_and_empties_their_queues(bench_db, redis_client):
    url, engine = bench_db
    _, before = _floor_then_service(url, engine, redis_client, "drop_canceling_builds")
    b = before["p_ci_builds"]
    dropped = "SELECT status, failure_reason, count(*) FROM p_ci_builds WHERE id > :b GROUP BY 1, 2"
    assert _rows(engine, dropped, b=b) == [
        ("failed", 3, CANDIDATES)
    ]
    assert _rows(engine, "SELECT count(*) FROM ci_pending_builds") == [(0,)]
    assert _rows(engine, "SELECT count(*) FROM ci_running_builds") == [(0,)]
    assert _rows(engine, "SELECT count(*) FROM p_ci_builds WHERE status = 'canceling'") == [(0,)]


def test_exports_floor_spares_running_jobs_and_parallel_exports_in_their_grace(bench_db, redis_client):
    url, engine = bench_db
    _, before = _floor_then_service(url, engine, redis_client, "stuck_export_jobs")
    b = before["project_export_jobs"]
    # Left enqueued: exactly the ones whose Sidekiq job still runs (a seventh) or parallel exports in their grace.
    left = _rows(engine, "SELECT id, jid FROM project_export_jobs WHERE id > :b AND status IN (0, 1) ORDER BY id", b=b)
    expected_left = _rows(engine, "SELECT id, jid FROM project_export_jobs "
                                  "WHERE id > :b AND (id % 7 = 0 OR id % 20 = 0) ORDER BY id", b=b)
    assert left == expected_left
    assert all(redis_client.exists(sidekiq_status.status_key(jid)) == (i % 7 == 0) for i, jid in left)
    assert _rows(engine, "SELECT count(*) FROM project_export_jobs WHERE id > :b AND status = 3", b=b) == [
        (CANDIDATES - len(expected_left),)
    ]


def test_environments_floor_plays_stop_actions_and_queues_them_with_their_partition(bench_db, redis_client):
    url, engine = bench_db
    _, before = _floor_then_service(url, engine, redis_client, "environments_auto_stop")
    actions = _rows(engine, "SELECT b.status, p.partition_id = b.partition_id, p.project_id = b.project_id "
                            "FROM p_ci_builds b LEFT JOIN ci_pending_builds p ON p.build_id = b.id WHERE b.id > :b",
                    b=before["p_ci_builds"])
    assert actions and set(actions) == {("pending", True, True)}
    states = dict(_rows(engine, "SELECT state, count(*) FROM environments WHERE id > :b GROUP BY 1",
                        b=before["environments"]))
    assert states["stopping"] > 0 and states["stopped"] > 0
    assert sum(states.values()) == states["stopping"] + states["stopped"] == CANDIDATES
    stopped_with_a_time = "SELECT count(*) FROM environments WHERE state = 'stopped' AND auto_stop_at IS NOT NULL"
    assert _rows(engine, stopped_with_a_time) == [(0,)]


def test_environments_candidates_find_only_the_stop_actions_their_snapshot_holds(bench_db, redis_client):
    """A second bench on the same tables: its candidates deploy from the pipelines where the first added stop
    actions. Those are gone; the first run alone would have played them (pending for the next)."""
    url, engine = bench_db
    launched.add_candidates(engine, redis_client, "environments_auto_stop", CANDIDATES)
    before = launched.add_candidates(engine, redis_client, "environments_auto_stop", CANDIDATES)
    actions = _rows(engine, """
        SELECT action.id > :b, count(DISTINCT action.id) FROM environments e
        JOIN deployments d ON d.environment_id = e.id
        JOIN p_ci_builds deployable ON deployable.id = d.deployable_id
        JOIN p_ci_builds action ON action.commit_id = deployable.commit_id AND action.name = d.on_stop
        WHERE e.id > :e GROUP BY 1""", b=before["p_ci_builds"], e=before["environments"])
    new = _rows(engine, "SELECT count(*) FROM p_ci_builds WHERE id > :b", b=before["p_ci_builds"])
    assert actions == [(True, new[0][0])] and new[0][0] > 0


def test_exports_an_earlier_bench_spared_are_not_the_next_benchs_idle_work(bench_db, redis_client):
    url, engine = bench_db
    _floor_then_service(url, engine, redis_client, "stuck_export_jobs")  # leaves running and in-grace jobs enqueued
    spared = "SELECT count(*) FROM project_export_jobs WHERE id <= :b AND status IN (0, 1)"
    before = launched.add_candidates(engine, redis_client, "stuck_export_jobs", CANDIDATES)
    assert _rows(engine, spared, b=before["project_export_jobs"]) == [(0,)]
    assert _rows(engine, spared.replace("<=", ">"), b=before["project_export_jobs"]) == [(CANDIDATES,)]


def test_artifacts_floor_records_every_deleted_file(bench_db, redis_client):
    url, engine = bench_db
    _, before = _floor_then_service(url, engine, redis_client, "schedule_bulk_delete_job_artifacts")
    left = _rows(engine, "SELECT count(*) FROM p_ci_job_artifacts WHERE id > :b", b=before["p_ci_job_artifacts"])
    assert left == [(0,)]
    # Every candidate has a file: half with a final path (its directory), half GitLab's hashed path (6 parts).
    paths = _rows(engine, "SELECT store_dir LIKE '@final/%', cardinality(string_to_array(store_dir, '/')), count(*) "
                          "FROM ci_deleted_objects GROUP BY 1, 2 ORDER BY 1, 2")
    assert paths == [(False, 6, CANDIDATES // 2), (True, 2, CANDIDATES // 2)]


def test_digest_sees_one_changed_value(bench_db, redis_client):
    url, engine = bench_db
    before = launched.add_candidates(engine, redis_client, "drop_canceling_builds", 10)
    admin = connect(url)
    try:
        cur = admin.cursor()
        first = _state(cur, "drop_canceling_builds", before)
        cur.execute("UPDATE p_ci_builds SET lock_version = 7 WHERE id = (SELECT max(id) FROM p_ci_builds)")
        assert _state(cur, "drop_canceling_builds", before) != first
    finally:
        admin.close()


def test_autovacuum_is_off_for_each_partition_the_rounds_meet_and_back_after(bench_db):
    url, engine = bench_db
    options = """SELECT c.relname, c.reloptions FROM pg_partition_tree('p_ci_builds') t
                 JOIN pg_class c ON c.oid = t.relid WHERE t.isleaf
                 UNION ALL SELECT relname, reloptions FROM pg_class WHERE oid = 'ci_pending_builds'::regclass
                 ORDER BY 1"""
    admin = connect(url)
    try:
        with launched._no_autovacuum(admin.cursor(), ("p_ci_builds", "ci_pending_builds")):
            during = _rows(engine, options)
        after = _rows(engine, options)
    finally:
        admin.close()
    assert len(during) == len(after) > 2 and "ci_pending_builds" in {name for name, _ in during}
    assert {tuple(reloptions or ()) for _, reloptions in during} == {("autovacuum_enabled=off",)}
    assert {reloptions for _, reloptions in after} == {None}


def test_postgres_cpu_clock_counts_a_backends_work_and_a_server_it_cannot_read_is_none(scratch_database):
    """The bench's PostgreSQL CPU: a query's work shows in it, the backend's once it has ended too (its postmaster
    reaped it); a server whose processes this machine cannot see has no clock, not a wrong one."""
    admin, worker = connect(scratch_database), connect(scratch_database)
    try:
        clock = launched.postgres_cpu_clock(admin.cursor())
        started = clock()
        worker.cursor().execute("SELECT count(*) FROM generate_series(1, 3000000)")
        worked = clock()
        worker.close()
        assert worked > started and clock() >= worked
    finally:
        admin.close()
        worker.close()

    class ElsewhereCursor:  # a server on another machine: its data directory is not here
        def execute(self, query):
            assert query == "SHOW data_directory"

        def fetchone(self):
            return ("/nonexistent/postgres/data",)

    assert launched.postgres_cpu_clock(ElsewhereCursor()) is None


def test_postgres_cpu_clock_never_runs_back_while_backends_come_and_go(scratch_database):
    """Backends that end while the clock reads /proc are counted once, either alive or reaped: with connections
    opened, worked and closed all the while, no reading is below the one before (the old reading missed those reaped
    mid-read: 80 of 6,168 readings ran back in 20 s of this churn; the launched test's CPU split failed in CI)."""
    admin = connect(scratch_database)
    clock = launched.postgres_cpu_clock(admin.cursor())
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            conn = connect(scratch_database)
            conn.cursor().execute("SELECT sum(g) FROM generate_series(1, 200000) g")
            conn.close()

    workers = [threading.Thread(target=churn) for _ in range(3)]
    for worker in workers:
        worker.start()
    try:
        readings = [clock() for _ in range(1500)]
    finally:
        stop.set()
        for worker in workers:
            worker.join()
        admin.close()
    assert [(a, b) for a, b in itertools.pairwise(readings) if b < a] == [] and readings[-1] > readings[0]


def test_launched_job_leaves_the_tables_its_floor_leaves(bench_db, redis_client, stack, tmp_path, monkeypatch):
    """``dagster job execute`` on deploy/dagster.yaml (PostgreSQL instance), two rounds against the floor."""
    # Two idle and two bare launches, not the bench's seven: each is a Dagster process of a few CPU-seconds, and
    # the count the figures take their median of is the bench's setting, not what this test checks.
    monkeypatch.setattr(launched, "IDLE_RUNS", 2)
    url, engine = bench_db
    shutil.copy(DAGSTER_YAML, tmp_path / "dagster.yaml")
    env = {"CI_CLEANUP_DATABASE_URL": url, "CI_CLEANUP_REDIS_URL": stack.redis_url,
           "CI_CLEANUP_DAGSTER_PG_URL": stack.url("dagster"), "DAGSTER_HOME": str(tmp_path)}
    for name in ("CI_CLEANUP_DAGSTER_PG_URL", "DAGSTER_HOME"):
        monkeypatch.setenv(name, env[name])
    builds = _rows(engine, "SELECT count(*), max(id) FROM p_ci_builds")
    logged = []
    figures = launched.bench_job(launched.Bench(env, engine, redis_client, tmp_path, log=logged.append),
                                 "drop_canceling_builds", 350, 2)
    assert figures.rows == 350 and figures.batches == 4
    # Each contender once untimed first (the warm-up), then the two rounds counted, the idle run among them.
    assert [line.split(":")[0] for line in logged[:5]] == [
        f"  drop_canceling_builds warm-up {c}" for c in launched.CONTENDERS] + ["  drop_canceling_builds round 1 job"]
    assert [len(figures.seconds[c]) for c in (*launched.CONTENDERS, "run_record")] == [2, 2, 2, 2, 2]
    # The rounds' idle runs (timed to RUN_SUCCESS, as the job is) changed nothing.
    assert [line.split(": ")[1].split(" in ")[0] for line in logged if " round " in line and " idle: " in line] == [
        "0 rows", "0 rows"]
    # After the rounds, the whole-process idle runs, each beside a bare one.
    assert len(figures.idle) == len(figures.bare) == launched.IDLE_RUNS and figures.idle_s > 0
    assert 0 < max(figures.seconds["idle"]) and min(figures.idle) > 0
    # The CPU of every counted run (the fixture's PostgreSQL runs on this machine): a launch spends more than the
    # floor's one batch, in its own process.
    assert {c: len(cpu) for c, cpu in figures.cpu.items()} == {"job": 2, "floor": 2, "service": 2, "idle": 2}
    assert min(figures.cpu["job"]) > max(figures.cpu["floor"]) > 0
    # The client's part of each run: in the launch's own processes, more than the floor's loop in this one.
    assert {c: len(cpu) for c, cpu in figures.client_cpu.items()} == {c: len(cpu) for c, cpu in figures.cpu.items()}
    assert min(figures.client_cpu["job"]) > max(figures.client_cpu["floor"]) > 0
    assert all(client <= total for c in figures.cpu for client, total in zip(figures.client_cpu[c], figures.cpu[c]))
    # PostgreSQL's part statement by statement: the job's batches (one statement each, and the empty one that ends
    # the run) and the floor's, sent again in pairs of replays, each replay leaving the rounds' tables (asserted there).
    assert figures.postgres is not None and figures.postgres.statements == (1, 1)
    assert len(figures.postgres.over_floor_ms) == launched.REPLAY_PAIRS
    assert [line.split(":")[0] for line in logged if "statements" in line] == [
        "  drop_canceling_builds statements"] * launched.REPLAY_PAIRS
    # After the idle runs (on the tables without the candidates: they changed nothing, below), the candidates are
    # back, done as a round does them: failed, out of the queues.
    assert _rows(engine, "SELECT count(*) - 350, max(id) - 350 FROM p_ci_builds") == builds
    assert _rows(engine, "SELECT status, count(*) FROM p_ci_builds WHERE id > :b GROUP BY 1", b=builds[0][1]) == [
        ("failed", 350)]
    assert _rows(engine, "SELECT count(*) FROM ci_pending_builds") == [(0,)]
    from dagster import DagsterInstance, DagsterRunStatus, RunsFilter

    from ci_cleanup_dev.bench.bare_job import NAME

    with DagsterInstance.get() as instance:  # this test's runs leave the shared Dagster database as they found it
        bare = instance.get_run_records(RunsFilter(job_name=NAME))
        assert [r.dagster_run.status for r in bare] == [DagsterRunStatus.SUCCESS] * launched.IDLE_RUNS
        jobs = instance.get_run_records(RunsFilter(job_name="drop_canceling_builds"))
        changed = sorted(r.dagster_run.tags["ci_cleanup/rows_changed"] for r in jobs)
        assert changed == ["0"] * (launched.IDLE_RUNS + 3) + ["350"] * 3  # warm-up and two rounds: job's, idle run's
        for record in [*bare, *jobs]:
            instance.delete_run(record.dagster_run.run_id)


def test_deployed_section_is_replaced_not_repeated():
    """``bench --deployed`` rewrites only its own section: the paired rounds' median ratio and the figure line."""
    from ci_cleanup_dev.bench import run

    figures = launched.Launched("drop_canceling_builds", 100)
    figures.seconds["job"], figures.seconds[launched.DEPLOYED] = [10.0, 20.0, 10.0], [11.0, 20.0, 15.0]
    assert figures.deployed_vs_direct == 1.1  # rounds 1.1, 1.0, 1.5; the medians' ratio would be 15 / 10
    headline = "# Benchmarks\n\n| headline |\n\nwork_vs_floor_max=1.00\n\n## The services\n\n| services |\n"
    once = run.with_deployed_section(headline, run.deployed_section([figures]))
    assert once.count(run.DEPLOYED_HEADING) == 1 and "\ndeployed_vs_direct_max=1.10\n" in once
    assert once.index("| headline |") < once.index(run.DEPLOYED_HEADING) < once.index("## The services")
    figures.seconds[launched.DEPLOYED] = [10.5, 21.0, 10.5]
    twice = run.with_deployed_section(once, run.deployed_section([figures]))
    assert twice.count(run.DEPLOYED_HEADING) == 1 and "\ndeployed_vs_direct_max=1.05\n" in twice
    assert "1.10" not in twice and twice.endswith("## The services\n\n| services |\n")


def test_headline_section_ends_with_the_worst_jobs_work_against_its_floor_and_start_up_over_the_bare_job(tmp_path):
    """Work = (job − the round's idle run) / floor, the median of the rounds'; start-up = the job's idle run − the
    bare job's."""
    from argparse import Namespace

    from ci_cleanup_dev.bench import run

    quick = launched.Launched("stuck_export_jobs", 100, rows=100, batches=1)
    # Work, round by round: 9 / 6, 10 / 8, 12 / 9 -> 1.33; from the medians, (12 − 2) / 8 = 1.25.
    quick.seconds.update(job=[10.0, 12.0, 14.0], idle=[1.0, 2.0, 2.0], floor=[6.0, 8.0, 9.0],
                         service=[8.0, 8.0, 8.0], run_record=[9.0, 9.0, 9.0])
    quick.idle = [1.0, 2.0, 2.0, 3.0, 2.0]  # whole process, after the rounds
    # CPU, job − idle run − floor: 0.8, 0.5, 1.2 -> 0.8 s over 1 batch; service − floor: 0.4, 0.6, 0.3 -> 0.4
    quick.cpu.update(job=[7.5, 7.0, 8.0], floor=[5.2, 5.0, 5.3], service=[5.6, 5.6, 5.6], idle=[1.5] * 3)
    # The client's part: job − idle run − floor: 1.6 − 1.2 − 0.1 = 0.3 s over 1 batch; service 0.25 − 0.1
    quick.client_cpu.update(job=[1.6] * 3, floor=[0.1] * 3, service=[0.25] * 3, idle=[1.2] * 3)
    quick.bare = [0.8, 1.7, 1.6, 2.6, 1.9]  # idle − bare, pair by pair: 0.2 0.3 0.4 0.4 0.1 -> 0.30
    slow_start = launched.Launched("drop_canceling_builds", 100, rows=100, batches=1)
    slow_start.seconds.update(job=[20.0, 20.0, 21.0], idle=[3.0] * 3, floor=[17.0, 17.0, 16.0],
                              service=[18.0, 18.0, 18.0], run_record=[18.0, 18.0, 18.0])  # work 1.00, 1.00, 1.125
    slow_start.idle = [3.0, 3.0, 3.0, 2.9, 3.1]
    slow_start.cpu.update(job=[9.0] * 3, floor=[7.0] * 3, service=[7.1] * 3, idle=[2.0] * 3)  # 0.0 / 0.1 s
    slow_start.client_cpu.update(job=[1.6] * 3, floor=[0.2] * 3, service=[0.2] * 3, idle=[1.3] * 3)  # 0.1 / 0.0 s
    slow_start.bare = [1.5, 1.6, 1.7, 1.8, 1.9]  # idle − bare: 1.5 1.4 1.3 1.1 1.2 -> 1.30
    bare = quick.bare + slow_start.bare
    # PostgreSQL's part, statement by statement: quick's 0.20 (pairs 0.10, 0.30) + its client's 300 ms = 300.20.
    quick.postgres = statements.PostgresPart([0.1, 0.3], (1, 1))
    slow_start.postgres = statements.PostgresPart([0.05, 0.05], (2, 1))
    args = Namespace(small=False, small_rows=100_000, big_rows=10_000_000, candidates=100_000, rounds=5, work=20_000,
                     repeats=3, memory_candidates=1_000_000)
    path = tmp_path / "BENCHMARKS.md"
    run.write_markdown(path, "| services |", [quick, slow_start], args=args, server="16.2",
                       load={"before": (1, 1, 1), "after": (1, 1, 1)}, daemon_s=None, bare=bare)
    markdown = path.read_text()
    headline = markdown.split("## The jobs as the daemon runs them, against their floor\n")[1].split("\n## ")[0]
    assert headline.rstrip().endswith("\ncli_idle_s=3.00\nwork_vs_floor_max=1.33\nstartup_over_bare_s=1.30"
                                      "\nbatch_cpu_over_floor_ms_max=800.00\nbatch_client_cpu_over_floor_ms_max=300.00"
                                      "\nbatch_cost_over_floor_ms_max=300.20")
    assert "| 0.20 (0.10, 0.30); 1 / 1 | 300.20 |" in headline and "| 0.05 (0.05, 0.05); 2 / 1 | 100.05 |" in headline
    assert "| 1.33; 1.25 |" in headline and "| 1.00; 1.00 |" in headline
    assert "| 0.30 |" in headline and "| 1.30 |" in headline
    assert "| 800.00 / 400.00 | 300.00 / 150.00 |" in headline and "| 0.00 / 100.00 | 100.00 / 0.00 |" in headline
    assert "PREPARE" in headline and "statement text each batch" in headline
    assert "job_vs_floor_max" not in markdown and markdown.rstrip().endswith("| services |")

    # bench --launched rewrites that section alone, with how it was measured; the services' section stays.
    slow_start.idle = [1.9] * 5  # idle − bare: 0.4 0.3 0.2 0.1 0.0 -> 0.20
    section = run.launched_section([quick, slow_start], bare, args, None, separate_run="\nA run of its own.\n")
    again = run.with_launched_section(markdown, section)
    assert again.count(run.LAUNCHED_HEADING) == 1 and "\nA run of its own.\n" in again
    assert "\nstartup_over_bare_s=0.30\n" in again and "startup_over_bare_s=1.30" not in again
    assert again.count("\nbatch_cpu_over_floor_ms_max=") == 1  # every figure line replaced, none left behind
    assert again.count("\nbatch_client_cpu_over_floor_ms_max=") == 1 and again.count("\nbatch_cost_over_floor") == 1
    assert again.rstrip().endswith("| services |") and again.startswith(markdown.split(run.LAUNCHED_HEADING)[0])


def test_a_release_line_is_replaced_not_repeated_and_outlives_the_headlines_rewrite():
    """``bench --launched --release R`` writes R's line of its section (made after the headline's when missing);
    another release's line stays, and so does the section when ``--launched`` rewrites the headline."""
    from ci_cleanup_dev.bench import run

    markdown = f"# Benchmarks\n\n{run.LAUNCHED_HEADING}\n\n| headline |\n\nwork_vs_floor_max=1.00\n\n## The services\n"
    once = run.with_release_line(markdown, "18.y", "- GitLab 18.y (`18.y.sql`): work_vs_floor_max=1.10")
    assert once == (f"# Benchmarks\n\n{run.LAUNCHED_HEADING}\n\n| headline |\n\nwork_vs_floor_max=1.00\n\n"
                    f"{run.RELEASES_HEADING}\n\n{run.RELEASES_NOTE}\n\n"
                    "- GitLab 18.y (`18.y.sql`): work_vs_floor_max=1.10\n\n## The services\n")
    both = run.with_release_line(once, "16.0", "- GitLab 16.0 (`16.0.sql`): work_vs_floor_max=1.02")
    again = run.with_release_line(both, "18.y", "- GitLab 18.y (`18.y.sql`): work_vs_floor_max=1.05")
    assert again == both.replace("work_vs_floor_max=1.10", "work_vs_floor_max=1.05")
    assert again.count("- GitLab ") == 2 and again.endswith("work_vs_floor_max=1.02\n\n## The services\n")
    rewritten = run.with_launched_section(again, f"{run.LAUNCHED_HEADING}\n\n| new headline |\n")
    assert rewritten.split(run.RELEASES_HEADING)[1] == again.split(run.RELEASES_HEADING)[1]
    assert "| new headline |" in rewritten and "| headline |" not in rewritten


def test_release_measures_the_headline_only(tmp_path):
    from argparse import Namespace

    from ci_cleanup_dev.bench import run

    with pytest.raises(SystemExit, match="--release measures the headline only: add --launched"):
        run.main({}, Namespace(output="", launched=False, deployed=False, small=False, release="18.y"))


@pytest.mark.parametrize("mode", ["launched", "deployed"])
def test_a_section_run_into_a_file_it_cannot_update_stops_before_measuring(tmp_path, mode):
    """--launched / --deployed replace their section of the whole benchmark's file: a missing file (or one without
    the headline) is named at once, not after the minutes of measuring (no database is even reached: env is empty)."""
    from argparse import Namespace

    from ci_cleanup_dev.bench import run

    args = Namespace(output=str(tmp_path / "missing.md"), launched=mode == "launched", deployed=mode == "deployed",
                     small=False, release=None)
    with pytest.raises(SystemExit, match="missing.md: no such file"):
        run.main({}, args)
    if mode == "launched":
        (tmp_path / "other.md").write_text("# Benchmarks\n\n## The services\n")
        with pytest.raises(SystemExit, match="not found: run the whole benchmark first"):
            run.main({}, Namespace(**{**vars(args), "output": str(tmp_path / "other.md")}))


@pytest.mark.parametrize("limit, cap", [("4294967296\n", 4 * 2**30), ("max\n", None)])
def test_the_bench_sets_postgresql_from_the_memory_its_container_may_use(tmp_path, monkeypatch, limit, cap):
    """Omnibus' quarter of RAM for shared_buffers (a half for effective_cache_size), of the container's limit when
    it has one below the machine's RAM: a host's RAM would give a PostgreSQL more than it may touch."""
    from ci_cleanup_dev.bench import server

    (tmp_path / "memory.max").write_text(limit)
    monkeypatch.setattr(server, "MEMORY_LIMITS", (str(tmp_path / "memory.max"), str(tmp_path / "missing")))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    usable = min(ram, cap) if cap else ram

    assert server.memory_bytes() == usable
    mb = usable // 2**20
    assert server.omnibus_postgres() == {"shared_buffers": f"{mb // 4}MB", "effective_cache_size": f"{mb // 2}MB",
                                         "work_mem": "16MB", "random_page_cost": "2",
                                         "max_parallel_workers_per_gather": "0"}


def test_the_bench_holds_its_postgresqls_heap_and_says_so(servers_dir, monkeypatch):
    """Restarted once with glibc's malloc held, not again when it has it; the report names it; the bench's own
    environment is left as it was."""
    from ci_cleanup_dev.bench import server

    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the caller's own, restored after the restart
    with EmbeddedStack(servers_dir / "held_heap") as stack:
        assert server.malloc_settings(stack.postgres_pid) == {"MALLOC_MMAP_THRESHOLD_": "65536"}

        server.hold_heap(stack)
        held = stack.postgres_pid
        server.hold_heap(stack)

        assert stack.postgres_pid == held
        # The postmaster's: a backend is forked from it, with its malloc as set up (a backend's own /proc environ is
        # overwritten by its process title).
        assert server.malloc_settings(held) == server.HELD_HEAP == {
            "MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "268435456"}
        assert server.postgres_settings(stack.url("postgres")).endswith(
            ", MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=268435456")
    assert os.environ["MALLOC_MMAP_THRESHOLD_"] == "65536" and "MALLOC_TRIM_THRESHOLD_" not in os.environ


def test_each_contender_takes_every_place_in_the_rounds_order():
    three = ("job", "floor", "service")
    orders = [launched.round_order(three, r) for r in range(6)]
    assert sorted(orders) == sorted(itertools.permutations(three))  # the middle one is not always in the middle
    assert [launched.round_order(("job", "deployed"), r) for r in range(4)] == [
        ("job", "deployed"), ("deployed", "job"), ("deployed", "job"), ("job", "deployed")]


def test_recorded_statements_make_batches_that_pair_from_the_last():
    """A batch is a writing statement, of whichever variant (a read sent before each batch is not one), with what
    its connection sent since the last one; what follows a connection's last batch goes with it; bucket workers'
    batches pair bucket by bucket, from the last; a side's one extra batch at the start is left out."""
    Sent = statements.Sent
    job = [Sent(1, "SELECT schema", "schema"), Sent(1, "BEGIN", "BEGIN"), Sent(1, "SET; WITH x AS (UPDATE", "b1"),
           Sent(1, "COMMIT", "COMMIT"), Sent(1, "BEGIN", "BEGIN"), Sent(1, "SET; WITH x AS (UPDATE … rows", "b2"),
           Sent(1, "COMMIT", "COMMIT"), Sent(1, "SELECT count", "count")]
    floor = [Sent(9, "WITH x AS (UPDATE", "f0"), Sent(9, "WITH x AS (UPDATE", "f1"), Sent(9, "WITH x AS (UPDATE", "f2")]
    assert statements.batches(job) == {None: [["schema", "BEGIN", "b1"], ["COMMIT", "BEGIN", "b2", "COMMIT", "count"]]}
    assert statements.pairs(statements.batches(job), statements.batches(floor)) == [
        (["schema", "BEGIN", "b1"], ["f1"]), (["COMMIT", "BEGIN", "b2", "COMMIT", "count"], ["f2"])]

    # Bucket workers: flags read before each batch (sent more often than the batches, with the scheduler's), the
    # scheduler's connection with no batch left out; the floor's workers on connections of their own, in any order.
    workers = [Sent(0, "SELECT flags", "flags")] + [
        s for bucket in range(2) for n in range(2) for s in (
            Sent(10 + bucket, "SELECT flags", "flags"),
            Sent(10 + bucket, "WITH d AS (DELETE", f"j{bucket}.{n}", bucket))]
    floor_workers = [Sent(21, "WITH d AS (DELETE", f"f1.{n}", 1) for n in range(2)] + [
        Sent(20, "WITH d AS (DELETE", f"f0.{n}", 0) for n in range(2)]
    assert statements.pairs(statements.batches(workers), statements.batches(floor_workers)) == [
        (["flags", "j0.0"], ["f0.0"]), (["flags", "j0.1"], ["f0.1"]),
        (["flags", "j1.0"], ["f1.0"]), (["flags", "j1.1"], ["f1.1"])]

    with pytest.raises(AssertionError, match="the job sent 2 batches, the floor 4"):
        statements.pairs(statements.batches(job), statements.batches(floor + floor[:1]))
    with pytest.raises(AssertionError, match=r"buckets \[0, 1\], the floor's of \[None\]"):
        statements.pairs(statements.batches(workers), statements.batches(floor))


def test_the_job_over_the_floor_is_each_batchs_difference_across_a_pair_of_replays():
    """Turn 0 sent batch 0 as the job's, 1 as the floor's, …; turn 1 the other way round: each batch's job cost less
    its floor cost, the median over the batches, in ms."""
    first = [7_000_000, 6_000_000, 7_200_000, 6_100_000, 9_000_000]  # job, floor, job, floor, job
    second = [6_500_000, 6_400_000, 6_900_000, 6_500_000, 6_000_000]  # floor, job, floor, job, floor
    # differences: 0.5, 0.4, 0.3, 0.4, 3.0 -> median 0.4
    assert statements.over_floor_ms(first, second) == pytest.approx(0.4)
