"""``Ci::Runners::StaleManagersCleanupService``: runner machines created and last contacted 7 days ago or more
are deleted, 100 at a time, 1000 a run."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from dagster import DagsterInstance
from sqlalchemy import insert, text

from ci_cleanup.gitlab.schema import utc_now
from ci_cleanup.runs import DRY_RUN_TAG
from ci_cleanup.stale_runner_machines_cleanup import service
from ci_cleanup.stale_runner_machines_cleanup.job import (
    stale_runner_machines_cleanup,
    stale_runner_machines_cleanup_schedule,
)

from .factories import S, ago, create, ids, row
from .harness import gitlab_database, on, statements_sent
from .runner import observed_per_batch, op_metadata, run_in_time_zone, run_job, step_failure_message

pytestmark = pytest.mark.layouts  # on one database and on GitLab as deployed (main + ci, PgBouncer)

NOW = dt.datetime(2024, 5, 6, 12, 0, tzinfo=dt.UTC)
WEEK = dt.timedelta(days=7)
REPORT = "report_deleted_runner_machines"


def machines(engine, count: int, *, created_at: dt.datetime, contacted_at: dt.datetime | None = None) -> None:
    with on(engine, "ci_runner_machines").begin() as conn:
        conn.execute(
            insert(S.ci_runner_machines),
            [dict(runner_id=1 + i % 5, system_xid=f"xid-{i}", runner_type=1, created_at=created_at,
                  updated_at=created_at, contacted_at=contacted_at) for i in range(count)],
        )


def stale_machines(engine, count: int) -> None:
    machines(engine, count, created_at=ago(days=30), contacted_at=ago(days=10))


def run_config(**config) -> dict:
    return {"ops": {"find_stale_runner_machines": {"config": config}}}


def observed_deletes(result) -> list[int]:
    return observed_per_batch(result, "deleted")



@pytest.mark.parametrize(
    "created_at, contacted_at, deleted",
    [
        pytest.param(NOW - WEEK, NOW - WEEK, True, id="created and contacted exactly 7 days ago: deleted"),
        pytest.param(NOW - WEEK, None, True, id="created exactly 7 days ago, never contacted: deleted"),
        pytest.param(NOW - dt.timedelta(days=90), None, True, id="never contacted and old: deleted"),
        pytest.param(NOW - dt.timedelta(days=90), NOW - dt.timedelta(days=8), True, id="contacted long ago: deleted"),
        pytest.param(NOW - WEEK + dt.timedelta(minutes=1), None, False, id="created 7 days minus a minute ago: kept"),
        pytest.param(NOW - dt.timedelta(days=90), NOW - WEEK + dt.timedelta(minutes=1), False,
                     id="contacted 7 days minus a minute ago: kept"),
        pytest.param(NOW - dt.timedelta(hours=1), None, False, id="never contacted and new: kept"),
        pytest.param(NOW - dt.timedelta(days=90), NOW - dt.timedelta(minutes=5), False,
                     id="contacted recently but created long ago: kept"),
    ],
)
def test_stale_boundaries(engine, created_at, contacted_at, deleted):
    machine = create(engine, "ci_runner_machines", created_at=created_at, updated_at=created_at,
                     contacted_at=contacted_at)
    fresh = create(engine, "ci_runner_machines", created_at=NOW, updated_at=NOW, contacted_at=NOW)

    limits = service.Limits(service.stale_deadline(NOW))
    result = service.delete_stale_runner_managers(on(engine, "ci_runner_machines"), S, limits)

    assert ids(engine, "ci_runner_machines") == ([fresh] if deleted else [machine, fresh])
    assert (result.total_deleted, result.batch_counts) == ((1, [1, 0]) if deleted else (0, [0]))


def test_now_in_another_zone_is_the_same_moment(engine):
    machine = create(engine, "ci_runner_machines", created_at=NOW - WEEK, updated_at=NOW - WEEK)
    tokyo = NOW.astimezone(dt.timezone(dt.timedelta(hours=9)))
    assert service.delete_stale_runner_managers(
        on(engine, "ci_runner_machines"), S, service.Limits(service.stale_deadline(tokyo))).total_deleted == 1
    assert row(engine, "ci_runner_machines", machine) is None


def test_stale_machines_are_deleted_and_active_ones_kept(stack, engine, redis_client):
    stale_never_contacted = create(engine, "ci_runner_machines", created_at=ago(days=8), updated_at=ago(days=8))
    stale_contacted = create(engine, "ci_runner_machines", created_at=ago(days=40), updated_at=ago(days=9),
                             contacted_at=ago(days=9))
    active = create(engine, "ci_runner_machines", created_at=ago(days=40), updated_at=ago(minutes=1),
                    contacted_at=ago(minutes=1))
    new = create(engine, "ci_runner_machines", created_at=ago(days=6), updated_at=ago(days=6))
    before = {m: row(engine, "ci_runner_machines", m) for m in (active, new)}

    result = run_job(stale_runner_machines_cleanup, stack)

    assert row(engine, "ci_runner_machines", stale_never_contacted) is None
    assert row(engine, "ci_runner_machines", stale_contacted) is None
    assert {m: row(engine, "ci_runner_machines", m) for m in (active, new)} == before
    report = op_metadata(result, REPORT)
    assert report == {
        "status": "success", "rows_changed": 2, "total_deleted": 2, "batch_counts": [2, 0],
        "max_deletions_reached": False, "stale_runner_machines_left": 0,
    }
    assert observed_deletes(result) == [2, 0]
    assert redis_client.keys("*") == []  # no lease: the seed relies on idempotence


def test_nothing_stale_deletes_nothing(stack, engine, redis_client):
    kept = create(engine, "ci_runner_machines", created_at=ago(days=1), updated_at=ago(days=1))
    result = run_job(stale_runner_machines_cleanup, stack)
    assert ids(engine, "ci_runner_machines") == [kept]
    report = op_metadata(result, REPORT)
    assert (report["status"], report["total_deleted"], report["batch_counts"], report["rows_changed"]) == (
        "success", 0, [0], 0)
    assert report["max_deletions_reached"] is False


def test_max_deletions_leaves_the_rest_for_the_next_run(stack, engine, redis_client):
    stale_machines(engine, 1250)
    active = create(engine, "ci_runner_machines", created_at=ago(days=30), updated_at=ago(hours=1),
                    contacted_at=ago(hours=1))

    first = run_job(stale_runner_machines_cleanup, stack)

    report = op_metadata(first, REPORT)
    assert (report["total_deleted"], report["batch_counts"], report["max_deletions_reached"],
            report["stale_runner_machines_left"]) == (1000, [100] * 10, True, 250)
    assert len(ids(engine, "ci_runner_machines")) == 251  # 250 stale left, and the active one

    second = run_job(stale_runner_machines_cleanup, stack)

    report = op_metadata(second, REPORT)
    assert (report["total_deleted"], report["batch_counts"], report["max_deletions_reached"],
            report["stale_runner_machines_left"]) == (250, [100, 100, 50, 0], False, 0)
    assert observed_deletes(second) == [100, 100, 50, 0]
    assert ids(engine, "ci_runner_machines") == [active]


def test_last_sub_batch_does_not_overshoot_the_cap(engine):
    stale_machines(engine, 30)
    result = service.delete_stale_runner_managers(
        on(engine, "ci_runner_machines"), S,
        service.Limits(service.stale_deadline(utc_now()), sub_batch_limit=7, max_deletions=25))
    assert (result.total_deleted, result.batch_counts, result.max_deletions_reached, result.left) == (
        25, [7, 7, 7, 4], True, 5)
    assert len(ids(engine, "ci_runner_machines")) == 5


def test_sub_batch_size_and_cap_are_config(stack, engine, redis_client):
    stale_machines(engine, 12)
    result = run_job(stale_runner_machines_cleanup, stack, run_config=run_config(sub_batch_size=5, max_deletions=11))
    report = op_metadata(result, REPORT)
    assert (report["total_deleted"], report["batch_counts"], report["max_deletions_reached"],
            report["stale_runner_machines_left"]) == (11, [5, 5, 1], True, 1)
    assert len(ids(engine, "ci_runner_machines")) == 1


def test_stale_after_is_config(stack, engine, redis_client):
    old = create(engine, "ci_runner_machines", created_at=ago(days=3), updated_at=ago(days=3), contacted_at=ago(days=3))
    young = create(engine, "ci_runner_machines", created_at=ago(days=1), updated_at=ago(days=1))
    run_job(stale_runner_machines_cleanup, stack, run_config=run_config(stale_after_days=2))
    assert ids(engine, "ci_runner_machines") == [young]
    assert row(engine, "ci_runner_machines", old) is None


@pytest.mark.parametrize(
    "bad",
    [
        {"sub_batch_size": 0}, {"max_deletions": 0}, {"stale_after_days": 0}, {"stale_after_days": -7},
        {"sub_batch_size": 1_000_000}, {"max_deletions": 10_000_000},
        {"sub_batch_size": 1, "max_deletions": 100_000},  # 100,000 one-row sub-batches in one run
    ],
)
def test_invalid_config_is_refused_before_any_delete(stack, engine, redis_client, bad):
    stale_machines(engine, 3)
    before = ids(engine, "ci_runner_machines")

    result = run_job(stale_runner_machines_cleanup, stack, run_config=run_config(**bad), raise_on_error=False)

    assert not result.success
    assert ids(engine, "ci_runner_machines") == before


def test_dry_run_reports_and_deletes_nothing(stack, engine, redis_client):
    stale_machines(engine, 5)
    kept = create(engine, "ci_runner_machines", created_at=ago(days=1), updated_at=ago(days=1))
    instance = DagsterInstance.ephemeral()

    result = run_job(stale_runner_machines_cleanup, stack, dry_run=True, instance=instance,
                     run_config=run_config(max_deletions=3))

    assert ids(engine, "ci_runner_machines") == [1, 2, 3, 4, 5, kept]
    plan = op_metadata(result, REPORT)
    assert (plan["would_delete_count"], plan["would_delete_ids"]) == (3, [1, 2, 3])  # capped as a real run would be
    report = op_metadata(result, REPORT)
    assert (report["status"], report["rows_changed"], report["total_deleted"], report["batch_counts"]) == (
        "dry run", 0, 0, [])
    assert observed_deletes(result) == []
    assert redis_client.keys("*") == []
    assert instance.get_run_by_id(result.run_id).tags[DRY_RUN_TAG] == "true"


def test_two_runs_at_once_delete_each_row_once_with_honest_counts(engine):
    stale_machines(engine, 600)
    all_ids = ids(engine, "ci_runner_machines")
    start = threading.Barrier(2)
    deleted: list[list[int]] = [[], []]
    results: list[service.CleanupResult | None] = [None, None]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            start.wait()
            results[i] = service.delete_stale_runner_managers(
                on(engine, "ci_runner_machines"), S,
                service.Limits(service.stale_deadline(utc_now()), sub_batch_limit=20), service.Hooks(deleted[i].extend),
            )
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert errors == []
    assert ids(engine, "ci_runner_machines") == []
    assert sorted(deleted[0] + deleted[1]) == all_ids  # every row deleted exactly once
    for result, own in zip(results, deleted):
        assert result.total_deleted == sum(result.batch_counts) == len(own)
    assert results[0].total_deleted + results[1].total_deleted == 600


@pytest.mark.parametrize("zone", ["Pacific/Kiritimati", "America/Los_Angeles"])
def test_session_time_zone_does_not_change_the_result(stack, engine, redis_client, zone):
    kept = create(engine, "ci_runner_machines", created_at=ago(days=7) + dt.timedelta(minutes=2),
                  updated_at=ago(days=7))
    deleted = create(engine, "ci_runner_machines", created_at=ago(days=7, minutes=2), updated_at=ago(days=7))

    run_in_time_zone(stale_runner_machines_cleanup, stack, zone)

    assert ids(engine, "ci_runner_machines") == [kept]
    assert row(engine, "ci_runner_machines", deleted) is None


def test_missing_column_fails_clearly_and_deletes_nothing(stack, scratch_database, redis_client):
    scratch = gitlab_database(
        scratch_database,
        "INSERT INTO ci_runner_machines (runner_id, system_xid, runner_type, created_at, updated_at) "
        "VALUES (1, 'x', 1, now() - interval '30 days', now() - interval '30 days')",
        # GitLab's sync trigger copies contacted_at into ci_runner_machines_archived: it goes with the column.
        "DROP TRIGGER table_sync_trigger_bc3e7b56bd ON ci_runner_machines",
        "ALTER TABLE ci_runner_machines DROP COLUMN contacted_at",
    )

    result = run_job(stale_runner_machines_cleanup, stack, database_url=scratch_database, raise_on_error=False)

    assert not result.success
    assert "column ci_runner_machines.contacted_at" in step_failure_message(result)
    with scratch.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM ci_runner_machines")).scalar_one() == 1
    scratch.dispose()


def test_the_sub_batch_statements_sent_are_the_packages_sql_file(engine):
    """The rule a reviewer reads in delete_stale_runner_machines.sql is what runs, sub-batch after sub-batch; the
    stale rows left are counted by count_stale_runner_machines.sql once the cap stopped the run."""
    stale_machines(engine, 5)
    machines_db = on(engine, "ci_runner_machines")
    files = {f.sent(S, machines_db.dialect): f.name for f in (service.SUB_BATCH, service.COUNT, service.STALE_IDS)}
    with statements_sent(machines_db) as sent:
        result = service.delete_stale_runner_managers(
            machines_db, S, service.Limits(service.stale_deadline(utc_now()), sub_batch_limit=2, max_deletions=4),
        )

    assert [(files.get(sql, sql), parameters["limit"]) for _, sql, parameters in sent] == [
        ("delete_stale_runner_machines.sql", 2), ("delete_stale_runner_machines.sql", 2),
        ("count_stale_runner_machines.sql", None)]
    assert (result.batch_counts, result.left, len(ids(engine, "ci_runner_machines"))) == ([2, 2], 1, 1)


def test_schedule_runs_at_36_past_every_hour_utc():
    assert stale_runner_machines_cleanup_schedule.cron_schedule == "36 * * * *"
    assert stale_runner_machines_cleanup_schedule.execution_timezone == "UTC"
    assert stale_runner_machines_cleanup_schedule.job_name == "stale_runner_machines_cleanup"
