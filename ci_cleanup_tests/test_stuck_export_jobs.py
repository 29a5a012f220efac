"""``StuckExportJobsWorker``: export jobs whose Sidekiq job is gone are failed; everything else is left as is."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
import redis
from dagster import DagsterInstance
from sqlalchemy import text, update

from ci_cleanup.gitlab.schema import utc_now
from ci_cleanup.gitlab.sidekiq_status import status_key
from ci_cleanup.resources import job_resources
from ci_cleanup.runs import DRY_RUN_TAG, ROWS_CHANGED_TAG
from ci_cleanup.stuck_export_jobs import service
from ci_cleanup.stuck_export_jobs.job import stuck_export_jobs, stuck_export_jobs_schedule

from .factories import (
    S,
    ago,
    backend_waiting_on_lock,
    create,
    ids,
    row,
    rows_read,
    statistics_say_empty,
    updates_refused,
    updates_skipped,
)
from .harness import gitlab_database, on, statements_sent
from .runner import failure_messages, op_metadata, run_job

pytestmark = pytest.mark.layouts  # on one database and on GitLab as deployed (main + ci, PgBouncer)

QUEUED, STARTED, FINISHED, FAILED = 0, 1, 2, 3
REPORT = "report_stuck_export_jobs"
J = S.project_export_jobs


def export_job(engine, jid: str, status: int = QUEUED, **values) -> int:
    values = {"created_at": ago(hours=1), "updated_at": ago(hours=1), **values}
    return create(engine, "project_export_jobs", jid=jid, status=status, **values)


def in_sidekiq(redis_client, *jids: str) -> None:
    """GitLab's SidekiqStatus.set: the key lives while the job is enqueued or running."""
    for jid in jids:
        redis_client.set(status_key(jid), 1, ex=30 * 60)


def assert_failed(engine, job_id: int) -> None:
    job = row(engine, "project_export_jobs", job_id)
    assert job.status == FAILED
    assert abs(job.updated_at - utc_now()) < dt.timedelta(minutes=1)


def run_with_redis(stack, redis_url: str, queues_url: str | None = None, **kwargs):
    return stuck_export_jobs.execute_in_process(
        resources=job_resources(stack.url(), redis_url, ci_database_url=stack.ci_url(), queues_url=queues_url),
        instance=DagsterInstance.ephemeral(),
        raise_on_error=False,
        **kwargs,
    )


def test_queued_and_started_jobs_with_no_status_key_are_failed(stack, engine, redis_client):
    queued = export_job(engine, "jid-queued", QUEUED)
    started = export_job(engine, "jid-started", STARTED)
    instance = DagsterInstance.ephemeral()

    result = run_job(stuck_export_jobs, stack, instance=instance)

    assert_failed(engine, queued)
    assert_failed(engine, started)
    report = op_metadata(result, REPORT)
    assert (report["status"], report["failed_jobs_count"], report["rows_changed"]) == ("success", 2, 2)
    assert report["job_ids"] == ["jid-queued", "jid-started"]
    assert report["failed_export_job_ids"] == [queued, started]
    observations = [e.event_specific_data.asset_observation for e in result.all_events
                    if e.event_type_value == "ASSET_OBSERVATION"]
    # The chunks (one here), observed as the run works, then the run's stuck_export_jobs event.
    assert [o.asset_key.path for o in observations] == [["gitlab", "project_export_jobs"]] * 2
    assert observations[0].metadata["per_batch"].value == {"enqueued": [2], "running": [0], "failed": [2]}
    assert [row.data["jid"] for row in observations[0].metadata["failed_export_jobs"].value.records] == [
        "jid-queued", "jid-started"]
    assert observations[1].metadata["stuck_export_jobs"].value == 2
    assert instance.get_run_by_id(result.run_id).tags[ROWS_CHANGED_TAG] == "2"


def chunk_statements_sent(engine, redis_client, dry_run: bool = False) -> list[str]:
    """The service's statements, as psycopg2 was handed each, run over chunks of 2."""
    main = on(engine, "project_export_jobs")
    with statements_sent(main) as sent:
        limits = service.Limits(ago(hours=6), chunk_size=2)
        if dry_run:
            service.find_stuck_jobs(main, S, redis_client, limits)
        else:
            service.mark_stuck_jobs_as_failed(main, S, redis_client, limits)
    return [sql for _, sql, _ in sent]


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry run"])
def test_each_chunk_statement_sent_is_its_sql_file(stack, engine, redis_client, dry_run):
    stuck = [export_job(engine, f"jid-{i}", STARTED) for i in range(3)]
    running = export_job(engine, "jid-running", QUEUED)
    in_sidekiq(redis_client, "jid-running")

    sent = chunk_statements_sent(engine, redis_client, dry_run)

    page, dialect = service.ENQUEUED_PAGE, on(engine, "project_export_jobs").dialect
    chunk = (service.REREAD_COMPLETED if dry_run else service.FAIL_STUCK).sent(S, dialect)
    assert sent == [page.sent(S, dialect), chunk, page.sent(S, dialect), chunk, page.sent(S, dialect)]
    assert ids(engine, "project_export_jobs", J.c.status == FAILED) == ([] if dry_run else stuck)
    assert row(engine, "project_export_jobs", running).status == QUEUED


def test_a_refused_chunk_is_failed_job_by_job_with_the_same_sql_files(stack, engine, redis_client):
    good, bad = export_job(engine, "jid-good", STARTED), export_job(engine, "jid-bad", STARTED)

    with updates_refused(engine, "project_export_jobs", f"NEW.id = {bad} AND NEW.status = 3"):
        sent = chunk_statements_sent(engine, redis_client)

    dialect = on(engine, "project_export_jobs").dialect
    page, fail, reread = (f.sent(S, dialect) for f in (service.ENQUEUED_PAGE, service.FAIL_STUCK,
                                                         service.REREAD_COMPLETED))
    # The chunk refused, re-read, then each of its stuck jobs failed alone (the bad one refused again).
    assert sent == [page, fail, reread, fail, fail, page]
    assert ids(engine, "project_export_jobs", J.c.status == FAILED) == [good]
    assert row(engine, "project_export_jobs", bad).status == STARTED


def test_job_with_status_key_present_is_kept(stack, engine, redis_client):
    queued = export_job(engine, "jid-queued", QUEUED)
    started = export_job(engine, "jid-started", STARTED)
    in_sidekiq(redis_client, "jid-queued", "jid-started")
    before = [row(engine, "project_export_jobs", i) for i in (queued, started)]

    result = run_job(stuck_export_jobs, stack)

    assert [row(engine, "project_export_jobs", i) for i in (queued, started)] == before
    report = op_metadata(result, REPORT)
    assert (report["failed_jobs_count"], report["job_ids"], report["running_count"]) == (0, [], 2)
    assert redis_client.exists(status_key("jid-queued"), status_key("jid-started")) == 2


STATUS_KEY_KINDS = {
    "hash": lambda c, key: c.hset(key, "status", "1"),
    "list": lambda c, key: c.rpush(key, "1"),
    "set": lambda c, key: c.sadd(key, "1"),
    "zset": lambda c, key: c.zadd(key, {"1": 1.0}),
}


def test_status_key_of_any_type_means_the_sidekiq_job_is_alive(stack, engine, redis_client):
    """GitLab checks presence (EXISTS): a hash, list, set or zset status key is a running job, not a gone one."""
    jobs = {kind: export_job(engine, f"jid-{kind}", STARTED) for kind in STATUS_KEY_KINDS}
    gone = export_job(engine, "jid-gone", STARTED)
    for kind, make in STATUS_KEY_KINDS.items():
        make(redis_client, status_key(f"jid-{kind}"))
    before = {kind: row(engine, "project_export_jobs", job_id) for kind, job_id in jobs.items()}
    dumps = {kind: redis_client.dump(status_key(f"jid-{kind}")) for kind in STATUS_KEY_KINDS}

    result = run_job(stuck_export_jobs, stack)

    assert {kind: row(engine, "project_export_jobs", job_id) for kind, job_id in jobs.items()} == before
    assert_failed(engine, gone)
    report = op_metadata(result, REPORT)
    assert (report["failed_jobs_count"], report["job_ids"], report["running_count"]) == (1, ["jid-gone"], 4)
    assert {kind: redis_client.dump(status_key(f"jid-{kind}")) for kind in STATUS_KEY_KINDS} == dumps


@pytest.mark.parametrize("status", [FINISHED, FAILED])
def test_finished_and_failed_jobs_are_untouched(stack, engine, redis_client, status):
    job_id = export_job(engine, "jid-done", status)
    before = row(engine, "project_export_jobs", job_id)

    result = run_job(stuck_export_jobs, stack)

    assert row(engine, "project_export_jobs", job_id) == before
    assert op_metadata(result, REPORT)["candidates"] == 0


def asked_sidekiq(engine, redis_client):
    """The run's first read and Redis check for one chunk: the chunk so far and its completed jobs."""
    with engine.connect() as conn:
        return service.ask_sidekiq(redis_client, service.enqueued_exports(conn, S, 0, service.CHUNK_SIZE))


def fail_completed(engine, chunk, completed):
    """The run's statement for one chunk: re-read and fail its completed jobs."""
    with engine.begin() as conn:
        return service.fail_completed(conn, S, chunk, completed, utc_now() - service.EXPORT_JOBS_EXPIRATION, utc_now())


def test_job_that_finishes_between_the_redis_check_and_the_update_is_not_failed(stack, engine, redis_client):
    finishing = export_job(engine, "jid-finishing", STARTED)
    stuck = export_job(engine, "jid-stuck", STARTED)
    chunk, completed = asked_sidekiq(engine, redis_client)
    assert [job.id for job in completed] == [finishing, stuck]
    with engine.begin() as conn:  # ProjectExportWorker finishes the export after our Redis check
        conn.execute(update(J).where(J.c.id == finishing).values(status=FINISHED, updated_at=utc_now()))
    finished_row = row(engine, "project_export_jobs", finishing)

    outcome = fail_completed(engine, chunk, completed)

    assert row(engine, "project_export_jobs", finishing) == finished_row
    assert_failed(engine, stuck)
    assert chunk.left_meanwhile == [finishing]
    assert [job.id for job in outcome.failed] == [stuck]


def test_job_that_finishes_before_the_re_read_is_not_failed(stack, engine, redis_client):
    finishing = export_job(engine, "jid-finishing", STARTED)
    with engine.connect() as conn:
        candidates = service.enqueued_exports(conn, S, 0, 100)
    with engine.begin() as conn:
        conn.execute(update(J).where(J.c.id == finishing).values(status=FINISHED))
    with engine.connect() as conn:
        chunk = service.find_stuck(conn, S, redis_client, candidates, utc_now() - service.EXPORT_JOBS_EXPIRATION)
    assert (chunk.stuck, chunk.left_meanwhile) == ([], [finishing])


def test_job_re_enqueued_under_a_new_jid_is_kept(stack, engine, redis_client):
    job_id = export_job(engine, "jid-old", STARTED)
    chunk, completed = asked_sidekiq(engine, redis_client)
    with engine.begin() as conn:  # the export was enqueued again; the old jid's key is gone, the new one's not yet set
        conn.execute(update(J).where(J.c.id == job_id).values(jid="jid-new", status=QUEUED))
    before = row(engine, "project_export_jobs", job_id)

    outcome = fail_completed(engine, chunk, completed)

    assert chunk.reenqueued == [job_id] and chunk.stuck == [] and outcome.failed == []
    assert row(engine, "project_export_jobs", job_id) == before


@pytest.mark.parametrize(
    "change, counted_as",
    [
        ({"status": FINISHED}, "left_meanwhile"),  # ProjectExportWorker finishes it
        ({"jid": "jid-new", "status": QUEUED}, "reenqueued"),  # it is enqueued again
    ],
    ids=["finished", "re-enqueued"],
)
def test_job_changed_while_the_update_waits_for_its_row_is_not_failed(stack, engine, redis_client, change, counted_as):
    """The change is committed after the statement's snapshot, which still shows the job stuck: PostgreSQL re-checks
    the guard."""
    changing = export_job(engine, "jid-changing", STARTED)
    stuck = export_job(engine, "jid-stuck", STARTED)
    chunk, completed = asked_sidekiq(engine, redis_client)
    out = []
    with engine.connect() as other:
        with other.begin():  # holds the row lock until the run's statement waits for it
            other.execute(update(J).where(J.c.id == changing).values(updated_at=utc_now(), **change))
            thread = threading.Thread(target=lambda: out.append(fail_completed(engine, chunk, completed)))
            thread.start()
            backend_waiting_on_lock(engine)
        thread.join(60)
    changed_row = row(engine, "project_export_jobs", changing)
    [outcome] = out

    assert (changed_row.status, changed_row.jid) == (change["status"], change.get("jid", "jid-changing"))
    assert_failed(engine, stuck)
    assert [job.id for job in outcome.failed] == [stuck]
    assert getattr(chunk, counted_as) == [changing]  # the job not failed is re-read to say why


def test_job_still_stuck_when_re_read_but_not_failed_is_reported_changed_meanwhile(stack, engine, redis_client):
    """A job the update passes over (here a trigger skips its row, as a change and its undoing while we waited would)
    is not failed."""
    skipped = export_job(engine, "jid-skipped", STARTED)
    stuck = export_job(engine, "jid-stuck", STARTED)
    chunk, completed = asked_sidekiq(engine, redis_client)
    before = row(engine, "project_export_jobs", skipped)
    with updates_skipped(engine, "project_export_jobs", f"NEW.id = {skipped}"):
        outcome = fail_completed(engine, chunk, completed)

    assert row(engine, "project_export_jobs", skipped) == before
    assert_failed(engine, stuck)
    assert outcome.changed_meanwhile == [skipped]
    assert [job.id for job in outcome.failed] == [stuck]
    assert [job.id for job in chunk.stuck] == [stuck, skipped]


def test_jids_with_quotes_backslashes_commas_and_braces_are_matched_exactly(stack, engine, redis_client):
    odd = ['a"b', "c\\d", "e,f", "{g}", " h ", "NULL", ""]
    jobs = [export_job(engine, jid, STARTED) for jid in odd]
    running = export_job(engine, 'i"j', STARTED)
    in_sidekiq(redis_client, 'i"j')

    with engine.connect() as conn:  # the dry run's re-read reads them back as they are
        chunk = service.find_stuck(conn, S, redis_client, service.enqueued_exports(conn, S, 0, 100), utc_now())
    assert [(job.id, job.jid) for job in chunk.stuck] == list(zip(jobs, odd))

    result = run_job(stuck_export_jobs, stack)

    for job_id in jobs:
        assert_failed(engine, job_id)
    assert row(engine, "project_export_jobs", running).status == STARTED
    assert op_metadata(result, REPORT)["job_ids"] == odd


def test_parallel_export_younger_than_6_hours_is_kept_and_older_is_failed(stack, engine, redis_client):
    young = export_job(engine, "jid-young", STARTED, created_at=ago(hours=5, minutes=50))
    old = export_job(engine, "jid-old", STARTED, created_at=ago(hours=6, minutes=10))
    old_plain = export_job(engine, "jid-old-plain", STARTED, created_at=ago(hours=6, minutes=10))
    young_plain = export_job(engine, "jid-young-plain", STARTED, created_at=ago(minutes=10))
    for job_id in (young, old):
        create(engine, "project_relation_exports", project_export_job_id=job_id, relation="issues")
        create(engine, "project_relation_exports", project_export_job_id=job_id, relation="merge_requests")
    before = row(engine, "project_export_jobs", young)

    result = run_job(stuck_export_jobs, stack)

    assert row(engine, "project_export_jobs", young) == before
    for job_id in (old, old_plain, young_plain):  # without relation exports there is no grace
        assert_failed(engine, job_id)
    report = op_metadata(result, REPORT)
    assert (report["failed_jobs_count"], report["parallel_in_grace_count"]) == (3, 1)
    assert report["failed_export_job_ids"] == [old, old_plain, young_plain]


def test_the_grace_check_probes_each_young_job_whatever_the_relation_exports_statistics_say(stack, engine):
    """project_relation_exports as autovacuum may last have seen it, empty (its pages, no live row), then filled
    again: a chunk's statement still looks up the relation exports of its young jobs only (a hashed subplan read the
    whole table for every chunk there), and its outcome is the rule's."""
    main = on(engine, "project_export_jobs")
    others = text("""
        INSERT INTO project_relation_exports (project_export_job_id, project_id, relation, created_at, updated_at)
        SELECT 100000 + g, 1, 'issues', now(), now() FROM generate_series(1, 2000) g""")
    young = [export_job(engine, f"jid-{i}", STARTED) for i in range(20)]
    with statistics_say_empty(main, others, "project_relation_exports"):
        for job_id in young[::2]:
            create(engine, "project_relation_exports", project_export_job_id=job_id, relation="issues")
        params = {**service.completed_params([service.Export(job_id, f"jid-{i}") for i, job_id in enumerate(young)],
                                             ago(hours=6)), "now": utc_now()}
        outcomes, read = rows_read(
            main, lambda conn: dict(conn.execute(service.FAIL_STUCK.on(S, conn.dialect), params).all()),
            "project_relation_exports")
    # The young jobs' own 10 relation exports, each read once (the re-read's rule, which the UPDATE follows).
    assert sorted(job_id for job_id, outcome in outcomes.items() if outcome == "failed") == young[1::2]
    assert {job_id: outcome for job_id, outcome in outcomes.items() if outcome != "failed"} == dict.fromkeys(
        young[::2], "parallel_in_grace")
    assert read["project_relation_exports"] == 10
    assert ids(engine, "project_export_jobs", J.c.status == FAILED) == young[1::2]


def test_grace_period_is_config(stack, engine, redis_client):
    parallel = export_job(engine, "jid-parallel", STARTED, created_at=ago(hours=2))
    create(engine, "project_relation_exports", project_export_job_id=parallel)

    run_job(stuck_export_jobs, stack,
            run_config={"ops": {"find_enqueued_export_jobs": {"config": {"relation_exports_grace_hours": 1}}}})

    assert_failed(engine, parallel)


def test_300_mixed_jobs_with_every_third_key_present_fail_exactly_the_right_200(stack, engine, redis_client):
    with engine.begin() as conn:
        conn.execute(
            J.insert(),
            [dict(project_id=i % 11, status=i % 2, jid=f"jid-{i:03}", created_at=ago(hours=1), updated_at=ago(hours=1))
             for i in range(300)],
        )
    in_sidekiq(redis_client, *[f"jid-{i:03}" for i in range(0, 300, 3)])
    running = [i + 1 for i in range(0, 300, 3)]
    stuck = [i + 1 for i in range(300) if i % 3]

    result = run_job(stuck_export_jobs, stack,
                     run_config={"ops": {"find_enqueued_export_jobs": {"config": {"chunk_size": 64}}}})

    assert ids(engine, "project_export_jobs", J.c.status == FAILED) == stuck
    assert ids(engine, "project_export_jobs", J.c.status.in_([QUEUED, STARTED])) == running
    report = op_metadata(result, REPORT)
    assert (report["failed_jobs_count"], report["rows_changed"], report["running_count"], report["chunks"]) == (
        200, 200, 100, 5)
    assert report["failed_export_job_ids"] == stuck
    assert report["job_ids"] == [f"jid-{i - 1:03}" for i in stuck]


def test_unreachable_redis_fails_the_run_naming_redis_and_changes_nothing(stack, engine, tmp_path):
    job_id = export_job(engine, "jid-stuck", STARTED)
    before = row(engine, "project_export_jobs", job_id)

    result = run_with_redis(stack, stack.redis_url, queues_url=f"unix://{tmp_path}/no-redis.sock")

    assert not result.success
    assert "Sidekiq's Redis (CI_CLEANUP_REDIS_QUEUES_URL)" in failure_messages(result)
    assert row(engine, "project_export_jobs", job_id) == before

    result = run_with_redis(stack, f"unix://{tmp_path}/no-redis.sock")

    assert not result.success
    assert "Cannot reach Redis" in failure_messages(result)
    assert row(engine, "project_export_jobs", job_id) == before


def test_redis_lost_mid_run_raises_and_changes_nothing(stack, engine, tmp_path):
    job_id = export_job(engine, "jid-stuck", STARTED)
    before = row(engine, "project_export_jobs", job_id)
    gone = redis.Redis(unix_socket_path=str(tmp_path / "gone.sock"))

    with pytest.raises(redis.ConnectionError):
        service.mark_stuck_jobs_as_failed(engine, S, gone, service.Limits(utc_now() - service.EXPORT_JOBS_EXPIRATION))

    assert row(engine, "project_export_jobs", job_id) == before


def test_bad_row_is_reported_and_the_others_are_failed(stack, engine, redis_client):
    good_before = export_job(engine, "jid-a", STARTED)
    bad = export_job(engine, "jid-bad", STARTED)
    good_after = export_job(engine, "jid-b", QUEUED)
    bad_before = row(engine, "project_export_jobs", bad)
    # Failing `bad` is refused by the database, as a broken row would be.
    with updates_refused(engine, "project_export_jobs", f"NEW.id = {bad} AND NEW.status = 3"):
        result = run_job(stuck_export_jobs, stack)

    assert result.success
    assert_failed(engine, good_before)
    assert_failed(engine, good_after)
    assert row(engine, "project_export_jobs", bad) == bad_before
    report = op_metadata(result, REPORT)
    assert (report["failed_jobs_count"], report["errors_count"]) == (2, 1)
    assert report["errors"] == [f"export job {bad}: row is broken"]
    assert report["job_ids"] == ["jid-a", "jid-b"]


def test_chunks_after_a_refused_chunk_and_after_one_with_nothing_to_fail_are_read_and_failed(
    stack, engine, redis_client
):
    """A chunk's statement reads the next page; a refused chunk (failed job by job) and a chunk with no completed
    job send no such statement, and the page after each is read on its own."""
    good, bad = export_job(engine, "jid-good", STARTED), export_job(engine, "jid-bad", STARTED)
    running = [export_job(engine, f"jid-running-{i}", QUEUED) for i in range(2)]
    in_sidekiq(redis_client, "jid-running-0", "jid-running-1")
    later = [export_job(engine, f"jid-later-{i}", STARTED) for i in range(3)]
    bad_before = row(engine, "project_export_jobs", bad)

    with updates_refused(engine, "project_export_jobs", f"NEW.id = {bad} AND NEW.status = 3"):
        result = service.mark_stuck_jobs_as_failed(on(engine, "project_export_jobs"), S, redis_client,
                                                   service.Limits(utc_now() - service.EXPORT_JOBS_EXPIRATION, 2))

    assert ids(engine, "project_export_jobs", J.c.status == FAILED) == [good, *later]
    assert ids(engine, "project_export_jobs", J.c.status.in_(service.ENQUEUED)) == [bad, *running]
    assert row(engine, "project_export_jobs", bad) == bad_before
    assert (result.chunks, result.candidates, result.stuck, result.running, result.errors_count) == (4, 7, 4, 2, 1)


def test_dry_run_reports_the_stuck_jobs_and_writes_nothing(stack, engine, redis_client):
    stuck = [export_job(engine, f"jid-{i}", STARTED) for i in range(3)]
    running = export_job(engine, "jid-running", QUEUED)
    in_sidekiq(redis_client, "jid-running")
    before = [row(engine, "project_export_jobs", i) for i in (*stuck, running)]
    keys_before = sorted(redis_client.keys("*"))
    instance = DagsterInstance.ephemeral()

    result = run_job(stuck_export_jobs, stack, dry_run=True, instance=instance)

    assert [row(engine, "project_export_jobs", i) for i in (*stuck, running)] == before
    assert sorted(redis_client.keys("*")) == keys_before
    report = op_metadata(result, REPORT)
    assert (report["status"], report["rows_changed"], report["would_fail_count"]) == ("dry run", 0, 3)
    assert report["would_fail_job_ids"] == ["jid-0", "jid-1", "jid-2"]
    assert report["would_fail_export_job_ids"] == stuck
    assert instance.get_run_by_id(result.run_id).tags[DRY_RUN_TAG] == "true"


@pytest.mark.parametrize(
    "bad", [{"chunk_size": 0}, {"chunk_size": 1_000_000}, {"relation_exports_grace_hours": -1},
            {"relation_exports_grace_hours": 100_000}]
)
def test_invalid_config_is_refused_before_anything_is_written(stack, engine, redis_client, bad):
    job_id = export_job(engine, "jid-stuck", STARTED)
    before = row(engine, "project_export_jobs", job_id)

    result = run_job(stuck_export_jobs, stack, run_config={"ops": {"find_enqueued_export_jobs": {"config": bad}}},
                     raise_on_error=False)

    assert not result.success
    assert row(engine, "project_export_jobs", job_id) == before


def test_missing_table_fails_clearly_and_changes_nothing(stack, scratch_database, redis_client):
    scratch = gitlab_database(
        scratch_database,
        "DROP TABLE project_relation_exports",
        "INSERT INTO project_export_jobs (id, project_id, status, jid, created_at, updated_at) "
        "VALUES (1, 1, 1, 'j', now(), now())",
    )

    result = run_job(stuck_export_jobs, stack, database_url=scratch_database, raise_on_error=False)

    assert not result.success
    assert "table project_relation_exports" in failure_messages(result)
    with scratch.connect() as conn:
        assert conn.execute(text("SELECT status FROM project_export_jobs")).scalar_one() == STARTED
    scratch.dispose()


def test_schedule_runs_at_30_past_every_hour_utc():
    assert stuck_export_jobs_schedule.cron_schedule == "30 * * * *"
    assert stuck_export_jobs_schedule.execution_timezone == "UTC"
    assert stuck_export_jobs_schedule.job_name == "stuck_export_jobs"


def many_export_jobs(conn, rows: int, status_sql: str) -> None:
    """``rows`` export jobs, job g's status ``status_sql`` (g, a number from 1); the planner's statistics then
    theirs, not the ones an earlier test's rows left (emptying a table keeps them)."""
    conn.execute(text(
        "INSERT INTO project_export_jobs (project_id, created_at, updated_at, status, jid) "
        f"SELECT g, now(), now(), {status_sql}, 'jid-' || g FROM generate_series(1, {rows}) g"
    ))
    conn.execute(text("ANALYZE project_export_jobs"))


def plan(conn, sql_file, **params) -> str:
    """PostgreSQL's plan for ``sql_file`` with these parameters."""
    return "\n".join(conn.execute(text("EXPLAIN " + sql_file.on(S, conn.dialect).text), params).scalars())


def test_candidate_chunk_is_read_through_gitlabs_status_index(stack, engine):
    # GitLab's mix: nearly every export finished, a few queued or started (with many enqueued rows the primary key
    # wins).
    with engine.begin() as conn:
        many_export_jobs(conn, 20000, "CASE WHEN g % 1000 = 0 THEN g % 2 ELSE 2 END")

    with engine.connect() as conn:
        # The first op's count and first id: the status index, never min(id) read on the primary key.
        counted = plan(conn, service.COUNT_ENQUEUED)
        conn.execute(text("SET enable_seqscan = off"))  # an empty table would be scanned anyway
        page = plan(conn, service.ENQUEUED_PAGE, after_id=0, limit=1000)
    assert "index_project_export_jobs_on_status" in page
    assert "index_project_export_jobs_on_status" in counted and "pkey" not in counted


def test_a_dense_backlogs_pages_walk_the_primary_key_not_every_enqueued_job_after_the_cursor(
    stack, engine, redis_client
):
    """200 k finished exports, then 2,500 queued ones, the newest (as a backlog is), a tenth of the rows since moved by
    an update (as a live table's are). Through GitLab's status index PostgreSQL would read every enqueued job after
    the cursor and sort them, for each page; walked, a page reads its own 1000 rows."""
    with engine.begin() as conn:
        many_export_jobs(conn, 202500, "CASE WHEN g > 200000 THEN 0 ELSE 2 END")
        conn.execute(text("UPDATE project_export_jobs SET updated_at = now() WHERE id % 10 = 0"))
        conn.execute(text("ANALYZE project_export_jobs"))  # the moved rows' statistics
        enqueued = service.count_enqueued(conn, S)
        walked = plan(conn, service.ENQUEUED_PAGE_WALKED, after_id=enqueued.first_id + 750, limit=1000)
    assert (enqueued.count, enqueued.last_id - enqueued.first_id, enqueued.dense) == (2500, 2499, True)
    assert "Index Scan using project_export_jobs_pkey" in walked and "Sort" not in walked, walked
    assert "index_project_export_jobs_on_status" not in walked, walked
    with statements_sent(on(engine, "project_export_jobs")) as sent:
        result = service.mark_stuck_jobs_as_failed(
            on(engine, "project_export_jobs"), S, redis_client,
            service.Limits(ago(hours=6), first_id=enqueued.first_id, walk=enqueued.dense))
    pages = [(parameters["after_id"], sql) for _, sql, parameters in sent if "after_id" in parameters]

    assert (result.stuck, result.chunks) == (2500, 3)
    assert ids(engine, "project_export_jobs", J.c.status.in_(service.ENQUEUED)) == []
    walked_page = service.ENQUEUED_PAGE_WALKED.sent(S, on(engine, "project_export_jobs").dialect)
    assert pages == [(enqueued.first_id - 1 + n, walked_page) for n in (0, 1000, 2000, 2500)]


def test_enqueued_jobs_spread_over_the_ids_are_paged_through_gitlabs_status_index(stack, engine):
    first, last = export_job(engine, "jid-first", QUEUED), export_job(engine, "jid-last", STARTED, id=1000)
    export_job(engine, "jid-done", FINISHED, id=500)
    with engine.connect() as conn:
        enqueued = service.count_enqueued(conn, S)
    assert enqueued == (2, first, last) and not enqueued.dense
    # One in four ids between the first and the last: dense enough to walk.
    assert service.Enqueued(250, 1, 1000).dense and not service.Enqueued(249, 1, 1000).dense


def test_pages_start_at_the_first_enqueued_job_counted_by_the_first_op(stack, engine, redis_client):
    finished = [export_job(engine, f"jid-done-{i}", FINISHED) for i in range(3)]
    first, second = export_job(engine, "jid-first", QUEUED), export_job(engine, "jid-second", STARTED)
    with engine.connect() as conn:
        assert service.count_enqueued(conn, S) == (2, first, second)
        # Given a later first id (as if the first job had been counted and finished), the pages start there.
        result = service.mark_stuck_jobs_as_failed(engine, S, redis_client,
                                                   service.Limits(ago(hours=6), first_id=second))
    assert (result.stuck_ids, result.candidates) == ([second], 1)
    assert ids(engine, "project_export_jobs", J.c.status == QUEUED) == [first]
    assert ids(engine, "project_export_jobs", J.c.status == FINISHED) == finished
    with engine.connect() as conn:
        assert service.count_enqueued(conn, S) == (1, first, first)

    run_job(stuck_export_jobs, stack)

    assert ids(engine, "project_export_jobs", J.c.status == FAILED) == [first, second]
    with engine.connect() as conn:
        assert service.count_enqueued(conn, S) == (0, None, None)
