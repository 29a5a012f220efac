"""``Ci::StuckBuilds::DropCancelingService``: builds stuck in canceling for over an hour are dropped,
nothing else is touched."""

from __future__ import annotations

import datetime as dt

import pytest
from dagster import AssetKey, DagsterInstance, DagsterInvalidConfigError
from sqlalchemy import text, update

from ci_cleanup.drop_canceling_builds import service
from ci_cleanup.drop_canceling_builds.job import LEASE_KEY, drop_canceling_builds, drop_canceling_builds_schedule
from ci_cleanup.gitlab.batching import autocommit
from ci_cleanup.gitlab.exclusive_lease import PREFIX
from ci_cleanup.gitlab.schema import utc_now
from ci_cleanup.resources import GitLabDatabase, job_resources
from ci_cleanup.runs import DRY_RUN_TAG

from .factories import (
    S,
    create,
    ids,
    naive_ago,
    row,
    rows_read,
    statistics_say_empty,
    updates_refused,
    updates_skipped,
)
from .harness import gitlab_database, on, statements_sent
from .runner import observed_per_batch, op_metadata, run_in_time_zone, run_job, step_failure_message

pytestmark = pytest.mark.layouts  # on one database and on GitLab as deployed (main + ci, PgBouncer)

LEASE = PREFIX + LEASE_KEY


def outdated(engine, **values) -> int:
    return create(engine, "ci_builds", created_at=naive_ago(hours=2), updated_at=naive_ago(hours=2), **values)


def assert_dropped(engine, build_id: int, *, lock_version: int = 1) -> None:
    build = row(engine, "ci_builds", build_id)
    assert (build.status, build.failure_reason, build.lock_version) == ("failed", 3, lock_version)
    assert abs(build.finished_at - naive_ago()) < dt.timedelta(minutes=1)
    assert abs(build.updated_at - naive_ago()) < dt.timedelta(minutes=1)


def assert_untouched(engine, build_id: int, before) -> None:
    assert row(engine, "ci_builds", build_id) == before



def test_outdated_canceling_build_is_dropped(stack, engine, redis_client):
    build_id = outdated(engine)
    create(engine, "ci_running_builds", build_id=build_id)
    create(engine, "ci_pending_builds", build_id=build_id)

    result = run_job(drop_canceling_builds, stack)

    assert_dropped(engine, build_id)
    assert ids(engine, "ci_running_builds") == [] and ids(engine, "ci_pending_builds") == []
    report = op_metadata(result, "report_dropped_builds")
    assert (report["status"], report["rows_changed"], report["dropped_count"], report["batches"]) == (
        "success", 1, 1, 1)
    assert redis_client.exists(LEASE) == 0


def test_existing_finished_at_is_kept(stack, engine, redis_client):
    finished_at = naive_ago(hours=1, minutes=30)
    build_id = outdated(engine, finished_at=finished_at)
    run_job(drop_canceling_builds, stack)
    assert row(engine, "ci_builds", build_id).finished_at == finished_at


@pytest.mark.parametrize(
    "created, updated",
    [
        pytest.param(dict(minutes=1), dict(minutes=1), id="fresh"),
        pytest.param(dict(hours=3), dict(minutes=10), id="created long ago, updated recently"),
        pytest.param(dict(minutes=10), dict(hours=3), id="created recently, updated long ago"),
        pytest.param(dict(minutes=59), dict(minutes=59), id="59 minutes old"),
    ],
)
def test_build_not_outdated_is_kept(stack, engine, redis_client, created, updated):
    build_id = create(engine, "ci_builds", created_at=naive_ago(**created), updated_at=naive_ago(**updated))
    before = row(engine, "ci_builds", build_id)
    run_job(drop_canceling_builds, stack)
    assert_untouched(engine, build_id, before)


@pytest.mark.parametrize(
    "status",
    ["created", "waiting_for_resource", "preparing", "pending", "running", "success", "failed", "canceled",
     "skipped", "manual", "scheduled", "waiting_for_callback"],
)
def test_build_in_other_status_is_kept(stack, engine, redis_client, status):
    build_id = outdated(engine, status=status)
    before = row(engine, "ci_builds", build_id)
    run_job(drop_canceling_builds, stack)
    assert_untouched(engine, build_id, before)


def test_bridge_is_kept(stack, engine, redis_client):
    bridge = outdated(engine, type="Ci::Bridge")
    before = row(engine, "ci_builds", bridge)
    run_job(drop_canceling_builds, stack)
    assert_untouched(engine, bridge, before)


def test_more_than_one_batch_is_all_dropped_in_one_run(stack, engine, redis_client):
    with on(engine, "ci_builds").begin() as conn:
        conn.execute(
            S.ci_builds.insert(),
            [dict(project_id=i % 7, type="Ci::Build", status="canceling", lock_version=0, partition_id=100,
                  created_at=naive_ago(hours=2, seconds=i), updated_at=naive_ago(hours=2)) for i in range(250)],
        )
    result = run_job(drop_canceling_builds, stack)
    assert ids(engine, "ci_builds", S.ci_builds.c.status != "failed") == []
    assert ids(engine, "ci_builds", S.ci_builds.c.failure_reason == 3, S.ci_builds.c.lock_version == 1) == list(
        range(1, 251))
    report = op_metadata(result, "report_dropped_builds")
    assert (report["dropped_count"], report["batches"]) == (250, 3)
    assert observed_per_batch(result, "dropped") == [100, 100, 50]


def test_batches_are_observed_at_a_bounded_rate_with_each_batchs_counts_and_rows(
    stack, engine, redis_client, monkeypatch
):
    builds = [outdated(engine) for _ in range(5)]
    config = {"ops": {"find_canceling_builds": {"config": {"batch_size": 2}}}}

    def observations(result):
        return [e.event_specific_data.asset_observation.metadata for e in result.all_events
                if e.event_type_value == "ASSET_OBSERVATION"]

    gathered = observations(run_job(drop_canceling_builds, stack, run_config=config))  # a run shorter than 5 s
    assert [(o["dropped"].value, o["batches"].value) for o in gathered] == [(5, 3)]
    assert gathered[0]["per_batch"].value == {
        "dropped": [2, 2, 1], "doomed": [0, 0, 0], "changed_concurrently": [0, 0, 0]}
    assert sorted(r.data["build_id"] for r in gathered[0]["dropping_outdated_builds"].value.records) == builds

    more = [outdated(engine) for _ in range(3)]
    monkeypatch.setattr("ci_cleanup.runs.OBSERVE_EVERY_SECONDS", 0)  # every batch is past the interval
    each = observations(run_job(drop_canceling_builds, stack, run_config=config))
    assert [(o["dropped"].value, o["batches"].value) for o in each] == [(2, 1), (1, 1)]
    assert sorted(r.data["build_id"] for o in each for r in o["dropping_outdated_builds"].value.records) == more


def test_a_batch_reads_only_its_own_builds_rows_of_the_queues_whatever_their_statistics_say(stack, engine):
    """The queues as autovacuum may last have seen them, drained (their pages, no live row), then filled again: a
    batch still reads, of each queue, only the rows of the builds it drops (a semi-join read the whole queue for every
    batch there), and leaves every other row."""
    ci, queues = on(engine, "ci_builds"), ("ci_pending_builds", "ci_running_builds")
    queued = [dict(project_id=i % 7, type="Ci::Build", status="running", runner_id=1, lock_version=0,
                   partition_id=100, created_at=naive_ago(minutes=5), updated_at=naive_ago(minutes=5))
              for i in range(2000)]
    stuck = [dict(queued[0], status="canceling", created_at=naive_ago(hours=2, seconds=i),
                  updated_at=naive_ago(hours=2)) for i in range(100)]
    enqueue = text("""
        INSERT INTO ci_pending_builds (build_id, project_id, partition_id) SELECT id, project_id, partition_id
        FROM ci_builds;
        INSERT INTO ci_running_builds (build_id, project_id, runner_id, runner_type, partition_id)
        SELECT id, project_id, runner_id, 1, partition_id FROM ci_builds""")
    with ci.begin() as conn:
        conn.execute(S.ci_builds.insert(), queued + stuck)
    limits = service.Limits(utc_now() - service.TIMEOUT)
    params = {"cutoff": naive_ago(hours=1), "now": naive_ago(), "batch_size": 100, "passed_over": [],
              "failure_reason": 3}
    with statistics_say_empty(ci, enqueue, *queues):
        with ci.connect() as conn:
            [plan] = conn.exec_driver_sql(
                "EXPLAIN (FORMAT JSON) " + service.NEXT_BATCH.sent(S, ci.dialect), params).scalar()
        batch, read = rows_read(ci, lambda conn: service.drop_next_batch(conn, S, limits, utc_now()), *queues)
    # Of each queue, the batch's 100 rows, each read twice: found in GitLab's build_id index, then deleted by its id.
    assert (sorted(b.id for b in batch.dropped), batch.changed_concurrently, read) == (
        list(range(2001, 2101)), [], {"ci_pending_builds": 200, "ci_running_builds": 200})
    # Neither queue is scanned whole. Which index the planner takes for a queue its statistics call empty varies
    # between runs (build_id's, or (partition_id, build_id)'s): the rows read above are what must hold.
    nodes = list(plan_nodes(plan["Plan"]))
    assert [n for n in nodes if n["Node Type"] == "Seq Scan" and n.get("Relation Name") in queues] == []
    with ci.connect() as conn:
        assert [conn.scalar(text(f"SELECT array_agg(build_id ORDER BY build_id) FROM {queue}")) for queue in queues] \
            == [list(range(1, 2001))] * 2


def plan_nodes(plan: dict):
    yield plan
    for child in plan.get("Plans", []):
        yield from plan_nodes(child)


def test_batches_follow_the_seeds_order(stack, engine, redis_client):
    same_moment = naive_ago(hours=5)
    late = create(engine, "ci_builds", project_id=1, created_at=naive_ago(hours=2), updated_at=naive_ago(hours=2))
    early_project_2 = create(engine, "ci_builds", project_id=2, created_at=same_moment, updated_at=naive_ago(hours=2))
    early_project_1 = create(engine, "ci_builds", project_id=1, created_at=same_moment, updated_at=naive_ago(hours=2))
    with on(engine, "ci_builds").connect() as conn:
        batch = service.find_batch(conn, S, utc_now() - service.TIMEOUT, 100)
    assert batch == [early_project_1, early_project_2, late]


def test_lease_held_elsewhere_changes_nothing(stack, engine, redis_client):
    build_id = outdated(engine)
    before = row(engine, "ci_builds", build_id)
    redis_client.set(LEASE, "someone-else", ex=1200)

    result = run_job(drop_canceling_builds, stack)

    assert result.success
    assert_untouched(engine, build_id, before)
    assert redis_client.get(LEASE) == b"someone-else"
    assert 1190 <= redis_client.ttl(LEASE) <= 1200
    assert op_metadata(result, "report_dropped_builds")["status"] == "skipped: lease held"


def test_lease_is_released_when_the_run_fails(stack, engine, redis_client, monkeypatch):
    build_id = outdated(engine)
    taken = []

    def crash(*args, **kwargs):
        taken.append(redis_client.get(LEASE))
        raise RuntimeError("boom")

    monkeypatch.setattr(service, "drop_canceling_builds", crash)
    result = run_job(drop_canceling_builds, stack, raise_on_error=False)

    assert not result.success
    assert taken == [result.run_id.encode()]  # held by this run while it worked
    assert redis_client.exists(LEASE) == 0
    assert row(engine, "ci_builds", build_id).status == "canceling"


def test_build_changed_by_someone_else_mid_run_is_not_overwritten(stack, engine):
    canceled = outdated(engine)
    touched = outdated(engine)
    retried = outdated(engine)
    cutoff = utc_now() - service.TIMEOUT
    with on(engine, "ci_builds").connect() as conn:
        read = service.find_batch(conn, S, cutoff, 100)
    with on(engine, "ci_builds").begin() as conn:  # another process, after we read the batch
        b = S.ci_builds.c
        conn.execute(
            update(S.ci_builds).where(b.id == canceled).values(status="canceled", lock_version=b.lock_version + 1))
        conn.execute(
            update(S.ci_builds).where(b.id == touched).values(updated_at=naive_ago(), lock_version=b.lock_version + 1))
        conn.execute(update(S.ci_builds).where(b.id == retried).values(runner_id=99, lock_version=b.lock_version + 1))
    canceled_row, touched_row = row(engine, "ci_builds", canceled), row(engine, "ci_builds", touched)

    with autocommit(on(engine, "ci_builds")) as conn:
        outcome = service.drop_builds(conn, S, read, cutoff, utc_now())

    assert_untouched(engine, canceled, canceled_row)
    assert_untouched(engine, touched, touched_row)
    assert_dropped(engine, retried, lock_version=2)  # still outdated and canceling: retried, as GitLab does
    assert sorted(outcome.changed_concurrently) == [canceled, touched]
    assert [(b.id, b.runner_id, b.status) for b in outcome.dropped] == [(retried, 99, "canceling")]  # as read back


def test_build_its_update_passes_over_is_reported_changed_concurrently_and_not_picked_again(stack, engine):
    """A build the batch picks and its UPDATE passes over (here a trigger skips its row, as a change and its undoing
    while we waited would) is left as it is, reported changed concurrently, and not picked again in the run."""
    skipped = outdated(engine, runner_id=7)
    dropped = outdated(engine, runner_id=8)
    no_runner = outdated(engine, runner_id=None)  # read back from the statement's array text as None
    ci = on(engine, "ci_builds")
    before = row(engine, "ci_builds", skipped)
    batches = []
    with updates_skipped(engine, "p_ci_builds", f"NEW.id = {skipped}"):
        result = service.drop_canceling_builds(ci, S, service.Limits(utc_now() - service.TIMEOUT),
                                               service.Hooks(on_batch=batches.append))

    assert row(engine, "ci_builds", skipped) == before
    assert_dropped(engine, dropped)
    assert_dropped(engine, no_runner)
    assert [(len(b.dropped), [(d.id, d.runner_id) for d in b.dropped], b.changed_concurrently) for b in batches] == [
        (2, [(dropped, 8), (no_runner, None)], [skipped])]
    assert (result.batches, result.dropped, result.changed_concurrently) == (1, 2, 1)


def test_build_passed_over_is_not_picked_again_by_the_runs_later_batches(stack, engine):
    skipped = outdated(engine, runner_id=7)
    dropped = [outdated(engine, runner_id=8) for _ in range(3)]
    before = row(engine, "ci_builds", skipped)
    batches = []
    with updates_skipped(engine, "p_ci_builds", f"NEW.id = {skipped}"):
        result = service.drop_canceling_builds(
            on(engine, "ci_builds"), S, service.Limits(utc_now() - service.TIMEOUT, batch_size=2),
            service.Hooks(on_batch=batches.append))

    assert row(engine, "ci_builds", skipped) == before
    for build in dropped:
        assert_dropped(engine, build)
    assert [([d.id for d in b.dropped], b.changed_concurrently) for b in batches] == [
        ([dropped[0]], [skipped]), (dropped[1:], [])]
    assert (result.batches, result.dropped, result.changed_concurrently) == (2, 3, 1)


def test_the_batch_statements_sent_are_the_packages_sql_files(stack, engine):
    """The rule a reviewer reads in the .sql files is what runs: the next batch, and after it failed on a bad row,
    its builds found and dropped one by one, the bad one doomed."""
    bad, good = outdated(engine), outdated(engine)
    ci = on(engine, "ci_builds")
    files = {f.sent(S, ci.dialect): f.name
             for f in (service.NEXT_BATCH, service.THESE_BUILDS, service.CANDIDATES, service.COUNT)}
    with updates_refused(engine, "p_ci_builds", f"NEW.id = {bad} AND NEW.failure_reason = 3"):
        with statements_sent(ci) as sent:
            result = service.drop_canceling_builds(ci, S, service.Limits(utc_now() - service.TIMEOUT))

    assert [files.get(sql, sql) for _, sql, _ in sent] == [
        "drop_canceling_builds.sql", "find_canceling_builds.sql", "drop_builds.sql", "drop_builds.sql",
        "drop_builds.sql", "drop_canceling_builds.sql"]
    assert [parameters.get("failure_reason") for _, sql, parameters in sent if files.get(sql) == "drop_builds.sql"] \
        == [3, 12, 3]  # the bad build (first in the batch's order) dropped, then doomed; then the good one
    assert (result.dropped, result.doomed) == (1, 1)
    assert_dropped(engine, good)
    assert row(engine, "ci_builds", bad).failure_reason == 12


def test_build_that_cannot_be_dropped_is_doomed(stack, engine, redis_client):
    bad = outdated(engine)
    good = outdated(engine)
    create(engine, "ci_running_builds", build_id=bad)
    create(engine, "ci_pending_builds", build_id=bad)
    # The drop of `bad` fails in the database, as a broken row would.
    with updates_refused(engine, "p_ci_builds", f"NEW.id = {bad} AND NEW.failure_reason = 3"):
        result = run_job(drop_canceling_builds, stack)

    doomed = row(engine, "ci_builds", bad)
    assert (doomed.status, doomed.failure_reason, doomed.lock_version) == ("failed", 12, 1)
    assert doomed.finished_at is not None
    assert ids(engine, "ci_running_builds") == [] and ids(engine, "ci_pending_builds") == []
    assert_dropped(engine, good)
    report = op_metadata(result, "report_dropped_builds")
    assert (report["dropped_count"], report["doomed_count"], report["rows_changed"]) == (1, 1, 2)
    assert report["errors"] == [f"build {bad}: row is broken"]


def test_created_at_in_bc_at_minus_infinity_or_in_year_1_is_dropped_or_reported_in_a_run_and_a_dry_run(
    stack, engine, redis_client
):
    """A BC date cannot be a Python datetime: the builds are read by id only, never by their timestamps, also when
    a batch the database refuses is taken build by build, and in a dry run's list."""
    odd = {value: create(engine, "ci_builds", created_at=text(f"'{value}'::timestamp"),
                         updated_at=text(f"'{value}'::timestamp"))
           for value in ("0044-03-15 12:00:00 BC", "-infinity", "0001-01-01 00:00:00")}
    refused = outdated(engine)

    dry = run_job(drop_canceling_builds, stack, dry_run=True)

    in_created_at_order = [odd["-infinity"], odd["0044-03-15 12:00:00 BC"], odd["0001-01-01 00:00:00"], refused]
    assert op_metadata(dry, "report_dropped_builds")["would_drop_ids"] == in_created_at_order
    with updates_refused(engine, "p_ci_builds", f"NEW.id = {refused} AND NEW.failure_reason = 3"):
        result = run_job(drop_canceling_builds, stack)

    with on(engine, "ci_builds").connect() as conn:
        assert conn.execute(text("SELECT id, status, failure_reason FROM p_ci_builds ORDER BY id")).all() == [
            *[(build_id, "failed", 3) for build_id in odd.values()], (refused, "failed", 12)]
    report = op_metadata(result, "report_dropped_builds")
    assert (report["dropped_count"], report["doomed_count"], report["rows_with_errors"]) == (3, 1, 1)
    assert report["errors"] == [f"build {refused}: row is broken"]


@pytest.mark.parametrize("zone", ["Pacific/Kiritimati", "America/Los_Angeles"])
def test_session_time_zone_does_not_change_the_result(stack, engine, redis_client, zone):
    kept = create(engine, "ci_builds", created_at=naive_ago(minutes=50), updated_at=naive_ago(minutes=50))
    dropped = create(engine, "ci_builds", created_at=naive_ago(minutes=70), updated_at=naive_ago(minutes=70))
    before = row(engine, "ci_builds", kept)

    run_in_time_zone(drop_canceling_builds, stack, zone)

    assert_untouched(engine, kept, before)
    assert_dropped(engine, dropped)


def test_missing_column_fails_clearly_and_changes_nothing(stack, scratch_database, redis_client):
    scratch = gitlab_database(
        scratch_database,
        "ALTER TABLE p_ci_builds DROP COLUMN lock_version",
        "DROP TABLE ci_running_builds",
        "INSERT INTO p_ci_builds (partition_id, project_id, type, status, created_at, updated_at) "
        "VALUES (100, 1, 'Ci::Build', 'canceling', now() - interval '3 hours', now() - interval '3 hours')",
    )

    result = run_job(drop_canceling_builds, stack, database_url=scratch_database, raise_on_error=False)

    assert not result.success
    message = step_failure_message(result)
    assert "column p_ci_builds.lock_version" in message and "table ci_running_builds" in message
    with scratch.connect() as conn:
        assert conn.execute(text("SELECT status FROM p_ci_builds")).scalar_one() == "canceling"
    assert redis_client.exists(LEASE) == 0
    scratch.dispose()


def test_limits_are_config_and_validated(stack, engine, redis_client):
    build_id = create(engine, "ci_builds", created_at=naive_ago(minutes=20), updated_at=naive_ago(minutes=20))
    result = run_job(
        drop_canceling_builds, stack,
        run_config={"ops": {"find_canceling_builds": {"config": {"timeout_minutes": 15, "batch_size": 1}}}},
    )
    assert_dropped(engine, build_id)

    other = create(engine, "ci_builds", created_at=naive_ago(hours=2), updated_at=naive_ago(hours=2))
    before = row(engine, "ci_builds", other)
    for bad in ({"batch_size": 0}, {"timeout_minutes": -5}, {"batch_size": 1_000_000}):
        result = run_job(
            drop_canceling_builds, stack,
            run_config={"ops": {"find_canceling_builds": {"config": bad}}}, raise_on_error=False,
        )
        assert not result.success
        assert_untouched(engine, other, before)
    assert redis_client.exists(LEASE) == 0


def test_gitlab_19_1s_rule_is_one_run_config_and_a_failure_reason_outside_the_two_is_refused(
        stack, engine, redis_client):
    # GitLab 19.1+'s DropCancelingService: 30 minutes untouched, failed with no_updates_canceling (28).
    stale = outdated(engine)
    young = create(engine, "ci_builds", created_at=naive_ago(minutes=40), updated_at=naive_ago(minutes=40))
    recent = create(engine, "ci_builds", created_at=naive_ago(minutes=20), updated_at=naive_ago(minutes=20))
    before = row(engine, "ci_builds", recent)
    # Refused by Dagster's config check (the Launchpad's too), before the run starts.
    with pytest.raises(DagsterInvalidConfigError, match="failure_reason not in enum type"):
        run_job(drop_canceling_builds, stack, run_config={"ops": {"find_canceling_builds": {
            "config": {"failure_reason": "data_integrity_failure"}}}})
    assert row(engine, "ci_builds", stale).status == "canceling"

    result = run_job(drop_canceling_builds, stack, run_config={"ops": {"find_canceling_builds": {
        "config": {"timeout_minutes": 30, "failure_reason": "no_updates_canceling"}}}})

    assert [(b, row(engine, "ci_builds", b).status, row(engine, "ci_builds", b).failure_reason)
            for b in (stale, young)] == [(stale, "failed", 28), (young, "failed", 28)]
    assert_untouched(engine, recent, before)
    assert op_metadata(result, "find_canceling_builds")["failure_reason"] == "no_updates_canceling"
    [observed] = [e.event_specific_data.asset_observation.metadata for e in result.all_events
                  if e.event_type_value == "ASSET_OBSERVATION"]
    assert sorted((r.data["build_id"], r.data["failure_reason"])
                  for r in observed["dropping_outdated_builds"].value.records) == [
        (stale, "no_updates_canceling"), (young, "no_updates_canceling")]


def test_dry_run_reports_and_writes_nothing(stack, engine, redis_client):
    build_ids = [outdated(engine) for _ in range(3)]
    before = [row(engine, "ci_builds", b) for b in build_ids]
    instance = DagsterInstance.ephemeral()

    result = run_job(drop_canceling_builds, stack, dry_run=True, instance=instance)

    assert [row(engine, "ci_builds", b) for b in build_ids] == before
    drop = op_metadata(result, "report_dropped_builds")
    assert (drop["would_drop_count"], drop["would_drop_ids"]) == (3, build_ids)
    assert op_metadata(result, "report_dropped_builds")["rows_changed"] == 0
    assert redis_client.keys("*") == []
    assert instance.get_run_by_id(result.run_id).tags[DRY_RUN_TAG] == "true"


def test_schedule_runs_at_45_past_every_hour_utc():
    assert drop_canceling_builds_schedule.cron_schedule == "45 * * * *"
    assert drop_canceling_builds_schedule.execution_timezone == "UTC"
    assert drop_canceling_builds_schedule.job_name == "drop_canceling_builds"


def run_on_builds_table(job, stack, builds_table: str, database_url: str | None = None, **kwargs):
    """The job with ``builds_table`` configured (GitLabDatabase's field), on the stack or on ``database_url``."""
    resources = job_resources(database_url or stack.url(), stack.redis_url)
    resources["gitlab_db"] = GitLabDatabase(
        url=database_url or stack.url(), ci_url=None if database_url else stack.ci_url(), builds_table=builds_table)
    return job.execute_in_process(resources=resources, instance=DagsterInstance.ephemeral(), **kwargs)


def queue_rows(engine, build_id: int) -> dict[str, list[int]]:
    with on(engine, "ci_builds").connect() as conn:
        return {queue: list(conn.scalars(text(f"SELECT partition_id FROM {queue} WHERE build_id = :b ORDER BY id"),
                                         {"b": build_id}))
                for queue in ("ci_pending_builds", "ci_running_builds")}


def test_every_queue_row_of_a_dropped_or_doomed_build_goes_whatever_partition_it_claims(stack, engine, redis_client):
    """GitLab removes a build's queue rows by ``build_id`` alone (``Ci::Build#all_queuing_entries``): a row that
    claims another partition than its build's goes too; another build's rows stay."""
    dropped, doomed, kept = outdated(engine, partition_id=100), outdated(engine, partition_id=101), create(
        engine, "ci_builds", status="running", partition_id=100)
    for build, partitions in ((dropped, (101, 102)), (doomed, (100, 102)), (kept, (101, 102))):
        create(engine, "ci_pending_builds", build_id=build, partition_id=partitions[0])
        create(engine, "ci_running_builds", build_id=build, partition_id=partitions[1])
    with updates_refused(engine, "p_ci_builds", f"NEW.id = {doomed} AND NEW.failure_reason = 3"):
        result = run_job(drop_canceling_builds, stack)

    assert [row(engine, "ci_builds", b).failure_reason for b in (dropped, doomed)] == [3, 12]
    assert [queue_rows(engine, b) for b in (dropped, doomed, kept)] == [
        {"ci_pending_builds": [], "ci_running_builds": []}, {"ci_pending_builds": [], "ci_running_builds": []},
        {"ci_pending_builds": [101], "ci_running_builds": [102]}]
    assert op_metadata(result, "report_dropped_builds")["rows_changed"] == 2


def test_every_queue_row_of_a_dropped_build_goes_without_gitlabs_unique_indexes(stack, scratch_database, redis_client):
    """Without GitLab's unique indexes on the queues' ``build_id`` a build may have several rows in each: all go."""
    scratch = gitlab_database(scratch_database, *(
        f"DROP INDEX index_{queue}_on_{key}" for queue in ("ci_pending_builds", "ci_running_builds")
        for key in ("build_id", "partition_id_build_id")))
    build, other = outdated(scratch, partition_id=100), outdated(scratch, status="running", partition_id=100)
    for queued in (build, build, build, other):
        create(scratch, "ci_pending_builds", build_id=queued)
    for queued in (build, build, other):
        create(scratch, "ci_running_builds", build_id=queued)

    run_job(drop_canceling_builds, stack, database_url=scratch_database)

    assert row(scratch, "ci_builds", build).status == "failed"
    assert [queue_rows(scratch, b) for b in (build, other)] == [
        {"ci_pending_builds": [], "ci_running_builds": []},
        {"ci_pending_builds": [100], "ci_running_builds": [100]}]
    scratch.dispose()


# A % is the driver's placeholder sign: doubled in SQL text, and as it is in to_regclass' value.
@pytest.mark.parametrize("name", ["builds 'quoted'", "Builds;Drop", "BUILDS_É", 'builds "x"', "100% builds",
                                  "builds%s"])
def test_a_configured_builds_table_whose_name_needs_quoting_is_used(stack, scratch_database, redis_client, name):
    quoted = '"' + name.replace('"', '""') + '"'
    scratch = gitlab_database(scratch_database, f"ALTER TABLE ci_builds RENAME TO {quoted}")
    build = outdated(scratch, partition_id=100)

    result = run_on_builds_table(drop_canceling_builds, stack, name, database_url=scratch_database)

    assert row(scratch, "ci_builds", build).status == "failed"
    assert op_metadata(result, "find_canceling_builds")["gitlab_tables"][0] == name
    scratch.dispose()


def test_a_schema_qualified_builds_table_is_used(stack, engine, redis_client):
    """``gitlab_partitions_dynamic.ci_builds_101``: that partition's builds only, as a Table in that schema."""
    in_101, in_100 = outdated(engine, partition_id=101), outdated(engine, partition_id=100)
    before = row(engine, "ci_builds", in_100)

    result = run_on_builds_table(drop_canceling_builds, stack, "gitlab_partitions_dynamic.ci_builds_101")

    assert row(engine, "ci_builds", in_101).status == "failed"
    assert_untouched(engine, in_100, before)
    assert op_metadata(result, "report_dropped_builds")["dropped_count"] == 1


def test_every_run_gives_the_plots_a_point_also_one_with_nothing_to_do(stack, engine, redis_client):
    """The UI plots each number of the observations on gitlab/ci_builds across runs: an idle run observes zeros,
    so that 120 -> 0 -> 0 -> 40 reads as it happened, not as 120 -> 40. A dry run changes nothing and observes
    nothing (its would_… are in its report)."""
    instance = DagsterInstance.ephemeral()
    outdated(engine)
    runs = [run_job(drop_canceling_builds, stack, instance=instance) for _ in range(3)]
    run_job(drop_canceling_builds, stack, instance=instance, dry_run=True)

    observed = [
        {k: v.value for k, v in record.asset_observation.metadata.items() if k in ("dropped", "doomed", "batches")}
        for record in instance.fetch_observations(AssetKey(["gitlab", "ci_builds"]), limit=10).records
    ]
    assert observed[::-1] == [
        {"dropped": 1, "doomed": 0, "batches": 1}, {"dropped": 0, "doomed": 0, "batches": 0},
        {"dropped": 0, "doomed": 0, "batches": 0},
    ]
    assert [op_metadata(r, "report_dropped_builds")["dropped_count"] for r in runs] == [1, 0, 0]
