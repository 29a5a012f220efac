"""The five jobs (and delete_expired_artifact_files) under concurrency,
SIGKILL at random points, and concurrent writers.

- Concurrency: 2 runs through ``dagster job execute`` and 4 forked in-process runs started at once over
  thousands of candidates: each row changed exactly once (a row trigger audits every UPDATE/DELETE),
  the runs' reported counts add up, a lease is never held by two runs.
- Crash: 6 seeded trials per job, a run SIGKILLed after a random 0-1.5 s (one kill in each sixth of that window):
  every row untouched or fully processed; no bucket lost; the dead run's lease expires after its (short) TTL, a
  killed bucket worker's bucket is handed out only after stale recovery, and the next run finishes the work.
- Concurrent writers: while a job runs, another process changes candidates as GitLab would; each
  change the writer made is still there afterwards.

Each test runs on one database and on GitLab as deployed (main + ci, the runs through PgBouncer; the crash
series on a main + ci pair of their own per job). The runs started at once and the crash series run, on one
database, on GitLab's Redis as deployed too: every store on a Sentinel set, and the leases on a Redis Cluster
(``redis_stores``; the jobs that use Redis, there). After the runs each store holds exactly the keys it must.

The figures (trials, kills that hit mid-work, rows checked, violations) go to
``test-artifacts/reliability_concurrency.json`` and the test output.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import redis
from sqlalchemy import create_engine, text

from ci_cleanup.gitlab import artifact_buckets
from ci_cleanup_dev.ddl import create_schema
from ci_cleanup_dev.devstack import lay_out_decomposed

from .harness import DeployedStack, on, reset
from .redis_servers import LAYOUTS_AND_REDIS_SHAPES, layouts_and_shapes_ids
from .reliability import (
    FORK,
    SCENARIOS,
    CrashSettings,
    LeaseWatch,
    changed_more_than_once,
    connections,
    direct_urls,
    engine_of,
    engines,
    fork_run,
    install_audit,
    remove_audit,
    start_cli,
    start_crash_series,
    start_writer,
)
from .runner import op_metadata, run_job

pytestmark = pytest.mark.layouts  # on one database and on GitLab as deployed (main + ci, PgBouncer)

N_CONCURRENT = 2400  # candidates for runs started at once
CONCURRENT_BATCH = 20  # small batches: each run lasts long enough for the others to overlap it
N_CRASH = 300
CRASH_BATCH = 5  # many commits per run: many points to be killed between (or inside), and a longer run to hit
# Each trial's kill lands at a random point of its own slice of the window (stratified): the first 1.5 s, then no
# longer than a trial's run that ended before its kill, and the series of a job asserts that some landed while the run
# was at work. From 20 (and 8) uniform draws: the series were a fifth of the suite's CPU, and stratified draws spread
# 6 (and 3) over the whole window as well as 20 did.
TRIALS = 6
SHAPE_TRIALS = 3  # per job on the Sentinel set and the cluster: their leases and buckets
KILL_WITHIN = 1.5  # seconds
CRASH_LEASE_TTL = 2  # seconds, in the killed run only; a test of GitLab's 30/50 minutes would never end
N_WRITER = 2000
WRITER_BATCH = 20

JOBS = sorted(SCENARIOS)
# The jobs that use Redis (a lease, buckets, Sidekiq statuses): the ones to run on each shape of GitLab's Redis.
REDIS_JOBS = [name for name in JOBS if SCENARIOS[name].uses_redis]
# delete_expired_artifact_files drains the ci_deleted_objects rows schedule_bulk_delete_job_artifacts writes:
# side by side in one database, neither's rows could be told apart. Its CLI runs are a group of their own.
CLI_GROUPS = [[name for name in JOBS if name != "delete_expired_artifact_files"], ["delete_expired_artifact_files"]]
FIGURES: dict[str, dict] = {}  # keys: <layout>/<test>/<job>
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"


@pytest.fixture(scope="module", autouse=True)
def figures():
    yield FIGURES
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "reliability_concurrency.json").write_text(json.dumps(FIGURES, indent=2, sort_keys=True))
    for name, numbers in sorted(FIGURES.items()):
        print(f"{name}: {numbers}")


@pytest.fixture(scope="module")
def audit(_engine):
    install_audit(_engine)
    yield
    remove_audit(_engine)


def extra_totals(job_name: str, results: list[dict], n: int) -> dict:
    """Totals besides the rows changed that must add up too: stop actions played, deleted-object rows written."""
    if job_name == "environments_auto_stop":
        return {"stop_actions_started": (sum(r["metadata"]["stop_actions_started"] for r in results), (n + 1) // 2)}
    if job_name == "schedule_bulk_delete_job_artifacts":
        return {"deleted_objects_created": (sum(r["metadata"]["deleted_objects_created"] for r in results), n)}
    return {}


def assert_each_row_changed_once(scenario, seeded, results, holders, engine, redis_client) -> dict:
    """Every candidate done, no row changed twice (audit), counts adding up, the lease held by one run at a time."""
    job_name = scenario.name
    assert [r["success"] for r in results] == [True] * len(results), [r.get("log") or r.get("error") for r in results]
    state = scenario.check(engine, redis_client, seeded)
    assert state.violations == []
    assert state.done == set(seeded.candidates)
    counts = [scenario.done_count(r["metadata"]) for r in results]
    assert sum(counts) == len(seeded.candidates), counts
    for name, (total, expected) in extra_totals(job_name, results, len(seeded.candidates)).items():
        assert total == expected, name
    statuses = [r["metadata"]["status"] for r in results]
    if scenario.lease:
        held = [h for h in holders if h is not None]
        assert len(held) == len(set(held)), f"the lease went back and forth: {holders}"
        working = {r["run_id"] for r, count in zip(results, counts) if count}
        assert working <= set(held), "a run changed rows without holding the lease"
        skipped = [count for r, count in zip(results, counts) if r["metadata"]["status"] == "skipped: lease held"]
        assert skipped == [0] * len(skipped)
        assert set(statuses) <= {"success", "skipped: lease held"}
    else:
        assert set(statuses) == {"success"}
    if job_name == "schedule_bulk_delete_job_artifacts":
        buckets = artifact_buckets.read_state(redis_client)
        assert (buckets.available, buckets.occupied) == (frozenset(range(5)), {})
    return {
        "rows_checked": len(seeded.candidates) + sum(len(k) for k in seeded.keepers.values()),
        "counts_per_run": counts,
        "statuses": statuses,
        "runs_that_changed_rows": sum(1 for c in counts if c),
        "lease_holders_seen": len([h for h in holders if h is not None]),
        "violations": 0,
    }


def layout(stack) -> str:
    return "deployed" if isinstance(stack, DeployedStack) else "direct"


def shapes(stack, redis_stores) -> str:
    """The figures' key: the layout, and the Redis shape unless it is the embedded Redis."""
    return layout(stack) + ("" if redis_stores.shape == "embedded" else f"+{redis_stores.shape}")


@pytest.mark.parametrize("group", CLI_GROUPS, ids=["the five seeds' jobs", "delete_expired_artifact_files"])
def test_two_runs_of_every_job_through_the_dagster_cli_at_once_change_each_row_exactly_once(
    stack, engine, redis_client, audit, tmp_path, group
):
    """``dagster job execute`` processes at once: two per job, the five seeds' jobs side by side (ten processes)."""
    reset(engine, redis_client, also=("reliability_audit",))
    seeded = {name: SCENARIOS[name].seed_and_snapshot(engine, redis_client, N_CONCURRENT) for name in group}
    watches = {name: LeaseWatch(redis.Redis.from_url(stack.redis_url), SCENARIOS[name].lease)
               for name in group if SCENARIOS[name].lease}
    for watch in watches.values():
        watch.start()
    started = {}
    for name in group:
        # Each job as operators run it: in process (the bulk delete's workers as threads of one op).
        config = SCENARIOS[name].run_config(CONCURRENT_BATCH)
        started[name] = [start_cli(SCENARIOS[name], stack, tmp_path / f"{name}-{i}", config) for i in range(2)]
    results = {name: [run.result(SCENARIOS[name].report_op) for run in runs] for name, runs in started.items()}
    holders = {name: watch.stop() for name, watch in watches.items()}

    assert changed_more_than_once(engine) == []
    for name in group:
        FIGURES[f"{layout(stack)}/concurrency/{name}/2 runs via dagster CLI"] = assert_each_row_changed_once(
            SCENARIOS[name], seeded[name], results[name], holders.get(name, []), engine, redis_client
        )
    assert set(redis_client.keys("*")) == set().union(*(SCENARIOS[name].keys_when_done for name in group))


# Every job on both layouts with the embedded Redis; the jobs that use Redis on the other shapes too.
FOUR_RUNS = [(layout, shape, name) for layout, shape in LAYOUTS_AND_REDIS_SHAPES
             for name in (JOBS if shape == "embedded" else REDIS_JOBS)]


@pytest.mark.parametrize(("stack", "redis_shape", "job_name"), FOUR_RUNS, indirect=["stack", "redis_shape"],
                         scope="session", ids=layouts_and_shapes_ids(FOUR_RUNS))
def test_four_runs_started_at_once_change_each_row_exactly_once(
    stack, engine, _engine, redis_stores, audit, job_name
):
    scenario = SCENARIOS[job_name]
    with redis_stores.clients() as uses:
        seeded = scenario.reset_and_seed(engine, uses["others"], N_CONCURRENT)
        barrier = FORK.Barrier(5)
        forked = [fork_run(scenario, stack, redis_stores, scenario.run_config(CONCURRENT_BATCH), engines(_engine),
                           barrier=barrier) for _ in range(4)]
        watch = LeaseWatch(redis_stores.client("leases"), scenario.lease) if scenario.lease else None
        if watch:
            watch.start()
        barrier.wait(60)
        results = [run.result() for run in forked]
        holders = watch.stop() if watch else []

        assert changed_more_than_once(engine) == []
        FIGURES[f"{shapes(stack, redis_stores)}/concurrency/{job_name}/4 forked runs"] = assert_each_row_changed_once(
            scenario, seeded, results, holders, engine, uses["others"]
        )
    assert redis_stores.keys() == scenario.keys_when_done


@pytest.fixture
def crash_targets(stack, redis_stores):
    """Per job, a database (deployed: a main and a ci database, ``crash_<job>`` and ``crash_<job>_ci``, laid out as
    GitLab does) and a Redis db of ``redis_stores``, so the series of trials run side by side without meeting: every
    job's on the embedded Redis, the jobs that use Redis on its other shapes. The runs reach the databases straight,
    not through PgBouncer: a killed run's sessions must end (and roll back) in PostgreSQL."""
    embedded = stack.embedded if isinstance(stack, DeployedStack) else stack
    admin = create_engine(embedded.url("postgres"), isolation_level="AUTOCOMMIT")
    decomposed = isinstance(stack, DeployedStack)
    jobs = JOBS if redis_stores.shape == "embedded" else REDIS_JOBS
    names = {name: [f"crash_{name}", *([f"crash_{name}_ci"] if decomposed else [])] for name in jobs}
    targets = {}
    for number, name in enumerate(jobs, start=1):
        with admin.connect() as conn:
            for database in names[name]:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
                conn.execute(text(f'CREATE DATABASE "{database}"'))
        urls = (embedded.url(names[name][0]), embedded.url(names[name][1]) if decomposed else None)
        if decomposed:
            lay_out_decomposed(*urls)
        else:
            engine = create_engine(urls[0])
            create_schema(engine)
            engine.dispose()
        engine = engine_of(urls)
        install_audit(engine)
        engine.dispose()
        targets[name] = (urls, redis_stores.with_db(number))
    yield targets
    with admin.connect() as conn:
        for name in jobs:
            for database in names[name]:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
    admin.dispose()


def test_sigkill_at_random_points_leaves_every_row_untouched_or_done_and_the_next_run_finishes(
    stack, _engine, redis_stores, crash_targets
):
    """6 seeded trials per job (3 on the Sentinel set and the cluster; the series at once): kill, check every row,
    no bucket lost, the lease expires, the next run finishes, and Redis holds exactly what it must."""
    trials = TRIALS if redis_stores.shape == "embedded" else SHAPE_TRIALS
    settings = CrashSettings(n=N_CRASH, batch=CRASH_BATCH, trials=trials, kill_within=KILL_WITHIN,
                             lease_ttl=CRASH_LEASE_TTL)
    series = {
        name: start_crash_series(SCENARIOS[name], *crash_targets[name], settings, seed=f"sigkill/{name}",
                                 parent_engines=engines(_engine))
        for name in crash_targets
    }
    outcomes = {name: result() for name, result in series.items()}

    for name, outcome in outcomes.items():
        FIGURES[f"{shapes(stack, redis_stores)}/crash/{name}"] = outcome["figures"]
    assert {name: outcome["violations"] for name, outcome in outcomes.items()} == dict.fromkeys(crash_targets, [])
    for name in crash_targets:
        figures = outcomes[name]["figures"]
        assert figures["trials"] == trials and figures["killed_while_running"] > 0, (name, figures)


@pytest.mark.parametrize("job_name", JOBS)
def test_changes_made_by_a_concurrent_writer_are_never_overwritten(
    stack, engine, _engine, redis_client, audit, job_name
):
    scenario = SCENARIOS[job_name]
    seeded = scenario.reset_and_seed(engine, redis_client, N_WRITER)
    finish_writer = start_writer(scenario, direct_urls(stack), seeded.candidates, seed=9,
                                 parent_engines=engines(_engine))
    time.sleep(0.2)  # the writer is at work before the job starts

    result = run_job(scenario.job, stack, run_config=scenario.run_config(WRITER_BATCH))
    written = finish_writer()

    assert written, "the writer changed nothing"
    with connections(engine) as conn:
        now = scenario.read_written(conn, list(written))
    # a written row is changed by the writer alone, the others by the job alone
    twice = changed_more_than_once(engine)
    overwritten = {row_id: (value, now.get(row_id)) for row_id, value in written.items() if now.get(row_id) != value}
    state = scenario.check(engine, redis_client, seeded, exclude=set(written))
    report = op_metadata(result, scenario.report_op)

    FIGURES[f"{layout(stack)}/writer/{job_name}"] = {
        "rows_changed_by_writer": len(written),
        "rows_done_by_job": len(state.done),
        "rows_checked": N_WRITER + sum(len(k) for k in seeded.keepers.values()),
        "violations": len(overwritten) + len(state.violations) + len(twice),
    }
    assert dict(list(overwritten.items())[:10]) == {}, f"{len(overwritten)} writer changes overwritten"
    assert state.violations == []
    assert twice == []
    assert state.done == set(seeded.candidates) - set(written)
    assert scenario.done_count(report) == len(state.done)


def test_runner_checking_in_while_its_sub_batch_is_being_deleted_is_kept(engine):
    """The race the writer test found: the heartbeat commits after the sub-batch read its ids, before the DELETE locks
    the row."""
    from sqlalchemy import text

    from ci_cleanup.gitlab.batching import autocommit
    from ci_cleanup.gitlab.schema import gitlab_schema, utc_now
    from ci_cleanup.stale_runner_machines_cleanup import service

    engine = on(engine, "ci_runner_machines")  # deployed: ci's
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO ci_runner_machines (runner_id, system_xid, runner_type, created_at, updated_at, "
            "contacted_at) "
            "SELECT g, 'm' || g, 1, now() - interval '30 days', now() - interval '30 days', "
            "now() - interval '8 days' "
            "FROM generate_series(1, 5) g"
        ))
    heartbeat = engine.connect()
    transaction = heartbeat.begin()
    contacted_at = heartbeat.execute(text(
        "UPDATE ci_runner_machines SET contacted_at = now() WHERE id = 3 RETURNING contacted_at"
    )).scalar_one()
    deleted: list[int] = []
    def delete_sub_batch() -> None:
        with autocommit(engine) as conn:
            deleted.extend(service.delete_sub_batch(conn, gitlab_schema(), service.stale_deadline(utc_now()), 100))

    delete = threading.Thread(target=delete_sub_batch)
    delete.start()
    time.sleep(0.3)  # the DELETE has read its ids and now waits for machine 3's row lock
    transaction.commit()
    heartbeat.close()
    delete.join(10)

    assert sorted(deleted) == [1, 2, 4, 5]
    with engine.connect() as conn:
        assert conn.execute(text("SELECT id, contacted_at FROM ci_runner_machines")).all() == [(3, contacted_at)]
