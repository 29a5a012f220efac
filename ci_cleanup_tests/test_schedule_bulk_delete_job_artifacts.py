"""``Ci::ScheduleBulkDeleteJobArtifactCronWorker`` and ``Ci::BulkDeleteExpiredJobArtifactsWorker``: expired,
unlocked, non-trace artifacts are deleted bucket by bucket; nothing else is."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import itertools
import logging
import os
import posixpath
import signal
import subprocess
import sys
import threading
import time

import pytest
from dagster import DagsterInstance
from sqlalchemy import TIMESTAMP, cast, create_engine, delete, insert, literal, select, text

from ci_cleanup.definitions import defs
from ci_cleanup.gitlab import artifact_buckets, feature_flags
from ci_cleanup.gitlab.artifact_buckets import AVAILABLE_KEY, OCCUPIED_KEY
from ci_cleanup.gitlab.loop_helpers import Brake
from ci_cleanup.gitlab.schema import utc_now
from ci_cleanup.runs import DRY_RUN_TAG, ROWS_CHANGED, ROWS_WITH_ERRORS
from ci_cleanup.schedule_bulk_delete_job_artifacts import files, service
from ci_cleanup.schedule_bulk_delete_job_artifacts.files_job import (
    ARTIFACTS_ROOT_ENV,
    delete_expired_artifact_files,
    delete_expired_artifact_files_schedule,
)
from ci_cleanup.schedule_bulk_delete_job_artifacts.job import (
    STOPPING,
    schedule_bulk_delete_job_artifacts,
    schedule_bulk_delete_job_artifacts_schedule,
)

from .factories import S, ago, create, ids, row
from .harness import DeployedStack, clean_env, gitlab_database, on, statements_sent
from .runner import op_metadata, run_job, step_failure_message

pytestmark = pytest.mark.layouts  # on one database and on GitLab as deployed (main + ci, PgBouncer)

WORKERS, REPORT = "run_bucket_workers", "report_destroyed_job_artifacts"  # its per-worker table; the run's totals


def run_worker(engine, redis_client, *, batch_size: int = service.BATCH_SIZE,
               max_batches: int = service.MAX_BATCHES, on_batch=None, stop=None, brake=None) -> service.WorkerResult:
    """A bucket worker as the job runs it: deleting in the artifacts' database, reading GitLab's flags in theirs when
    decomposed (on one database, the batch's own statement reads them)."""
    artifacts, flags = on(engine, "ci_job_artifacts"), on(engine, "feature_gates")
    hooks = service.Hooks(stop=stop, brake=brake)
    hooks = hooks if on_batch is None else dataclasses.replace(hooks, on_batch=on_batch)
    return service.run_bucket_worker(
        artifacts, redis_client, S, limits=service.Limits(batch_size=batch_size, max_batches=max_batches),
        hooks=hooks, flags_engine=None if flags is artifacts else flags)


def enable(engine, *flags: str) -> None:
    for flag in flags:
        create(engine, "feature_gates", feature_key=flag)


_jobs = itertools.count()


def artifact(engine, *, bucket: int = 0, max_buckets: int = 5, project_id: int = 10, **values) -> int:
    """An expired, unlocked archive artifact whose MOD(project_id + job_id, max_buckets) is ``bucket``."""
    job_id = values.pop("job_id", None)
    if job_id is None:  # a job of its own (GitLab allows one artifact per job, file type and partition)
        job_id = 1000 + max_buckets * next(_jobs) + (bucket - project_id - 1000) % max_buckets
    assert (project_id + job_id) % max_buckets == bucket
    values = {"expire_at": ago(hours=2), **values}
    return create(engine, "ci_job_artifacts", project_id=project_id, job_id=job_id, **values)


def redis_state(client) -> tuple[set[int], dict[int, float]]:
    return (
        {int(b) for b in client.smembers(AVAILABLE_KEY)},
        {int(b): score for b, score in client.zrange(OCCUPIED_KEY, 0, -1, withscores=True)},
    )


def deleted_objects(engine) -> list:
    d = S.ci_deleted_objects
    with on(engine, "ci_deleted_objects").connect() as conn:
        return conn.execute(select(d).order_by(d.c.id)).all()


def ci_url(stack) -> str:
    """What a job is given for the artifacts' database: ci when GitLab is decomposed, else the one database."""
    return stack.ci_url() or stack.url()


def direct_ci_url(stack) -> str:
    """The artifacts' database, never through PgBouncer."""
    return stack.direct_url(stack.CI) if isinstance(stack, DeployedStack) else stack.url()


def direct_database_env(stack) -> dict[str, str]:
    """The GitLab database variables of a job's process, never through PgBouncer: main's, and ci's when GitLab is
    decomposed."""
    if isinstance(stack, DeployedStack):
        return {"CI_CLEANUP_DATABASE_URL": stack.direct_url(stack.MAIN),
                "CI_CLEANUP_CI_DATABASE_URL": stack.direct_url(stack.CI)}
    return {"CI_CLEANUP_DATABASE_URL": stack.url()}


def worker_metadata(result) -> list[dict]:
    """run_bucket_workers' table, one row per worker by bucket (none when the run had no workers to run)."""
    workers = op_metadata(result, WORKERS).get("bucket_workers")
    return [] if workers is None else [record.data for record in workers.records]


def log_lines(instance: DagsterInstance, result, starting: str) -> list[str]:
    """The run's log lines starting so; a failed worker's line with the rest of its message (PostgreSQL's CONTEXT)."""
    found = []
    for event in instance.all_logs(result.run_id):
        if event.is_dagster_event:
            continue
        if event.level >= logging.ERROR:
            found += [event.user_message] if event.user_message.startswith(starting) else []
        else:  # workers that ended together: a line each in one event
            found += [line for line in event.user_message.splitlines() if line.startswith(starting)]
    return found


def expected_hashed_store_dir(project_id: int, created_at: dt.datetime, job_id: int, artifact_id: int) -> str:
    digest = hashlib.sha256(str(project_id).encode("ascii")).hexdigest()
    day = created_at.astimezone(dt.UTC).strftime("%Y_%m_%d")
    return "/".join([digest[:2], digest[2:4], digest, day, str(job_id), str(artifact_id)])


def expected_deleted_object(artifact, now: dt.datetime) -> dict | None:
    """``Ci::JobArtifact#to_deleted_object_attrs`` in Python, to check the service's SQL; None: no stored file."""
    if artifact.file_final_path:
        store_dir, file = posixpath.dirname(artifact.file_final_path), posixpath.basename(artifact.file_final_path)
    elif artifact.file and artifact.created_at is not None:
        store_dir = expected_hashed_store_dir(artifact.project_id, artifact.created_at, artifact.job_id, artifact.id)
        file = artifact.file
    else:
        return None
    pick_up_at = min(max(artifact.expire_at, now - service.PICK_UP_AT_EARLIEST), now + service.PICK_UP_AT_LATEST)
    return dict(
        file_store=artifact.file_store if artifact.file_store is not None else 1,
        store_dir=store_dir, file=file, project_id=artifact.project_id, pick_up_at=pick_up_at,
    )


def test_flag_off_touches_nothing(stack, engine, redis_client):
    expired = artifact(engine)
    redis_client.sadd(AVAILABLE_KEY, "1")
    redis_client.zadd(OCCUPIED_KEY, {"3": ago(hours=1).timestamp()})
    enable(engine, service.HIGH_CONCURRENCY_FLAG)  # the high-concurrency flag alone turns nothing on
    before = redis_state(redis_client)

    result = run_job(schedule_bulk_delete_job_artifacts, stack)

    assert ids(engine, "ci_job_artifacts") == [expired]
    assert deleted_objects(engine) == []
    assert redis_state(redis_client) == before
    assert sorted(redis_client.keys("*")) == sorted([AVAILABLE_KEY.encode(), OCCUPIED_KEY.encode()])
    report = op_metadata(result, REPORT)
    assert (report["status"], report["rows_changed"], report["workers"]) == (
        "skipped: bulk_delete_job_artifacts disabled", 0, 0)
    assert worker_metadata(result) == []


def test_expired_unlocked_artifacts_go_and_the_rest_are_kept(stack, engine, redis_client):
    enable(engine, service.FEATURE_FLAG)
    created_at = dt.datetime(2024, 3, 9, 23, 30, tzinfo=dt.timezone(dt.timedelta(hours=-5)))  # 2024-03-10 in UTC
    gone = [
        artifact(engine, bucket=b, project_id=p, size=100 * (b + 1), created_at=created_at, file_store=store)
        for b, p, store in [(0, 7, 1), (1, 8, 2), (2, 9, 1), (3, 123456, 1), (4, 10, 1), (0, 11, 1)]
    ]
    kept = [
        artifact(engine, file_type=3),  # trace
        artifact(engine, locked=1),  # artifacts_locked
        artifact(engine, locked=2),  # unknown
        artifact(engine, expire_at=None),  # never expires
        artifact(engine, expire_at=utc_now() + dt.timedelta(minutes=5)),  # not yet expired
    ]
    before = {i: row(engine, "ci_job_artifacts", i) for i in gone}
    instance = DagsterInstance.ephemeral()

    result = run_job(schedule_bulk_delete_job_artifacts, stack, instance=instance)

    assert ids(engine, "ci_job_artifacts") == kept
    objects = deleted_objects(engine)
    assert sorted((o.file_store, o.store_dir, o.file, o.project_id) for o in objects) == sorted(
        (before[i].file_store, expected_hashed_store_dir(before[i].project_id, created_at, before[i].job_id, i),
         "artifacts.zip", before[i].project_id)
        for i in gone
    )
    assert {o.store_dir.split("/")[3] for o in objects} == {"2024_03_10"}
    # within [now-1d, now+1h]
    assert sorted(o.pick_up_at for o in objects) == sorted(before[i].expire_at for i in gone)
    report = op_metadata(result, REPORT)
    assert (report["status"], report["rows_changed"], report["destroyed_job_artifacts_count"], report["size"]) == (
        "success", 6, 6, 1600)
    assert (report["max_buckets"], report["available_count"], report["occupied_count"], report["stale_count"],
            report["missing_count"]) == (5, 0, 0, 0, 5)
    assert report["buckets_processed"] == [0, 1, 2, 3, 4]
    workers = worker_metadata(result)
    assert [(w["mod_bucket"], w["destroyed_job_artifacts_count"], w["artifacts_empty"],
             w["terminated_early_due_to_scale_down"]) for w in workers] == [
        (0, 2, True, False), (1, 1, True, False), (2, 1, True, False), (3, 1, True, False), (4, 1, True, False)
    ]
    assert [(w["claimed"], w["stopped_by_feature_flag"], w["batches"]) for w in workers] == [(True, False, 1)] * 5
    assert [w["size"] for w in workers] == [200, 200, 300, 400, 500]
    # The seed's log line of each worker, in the order they ended.
    assert sorted(log_lines(instance, result, "Bucket worker")) == [
        f"Bucket worker {b} done: mod_bucket={b}, destroyed_job_artifacts_count={n}, artifacts_empty=True, "
        "terminated_early_due_to_scale_down=False" for b, n in [(0, 2), (1, 1), (2, 1), (3, 1), (4, 1)]
    ]
    assert redis_state(redis_client) == ({0, 1, 2, 3, 4}, {})


def test_hashed_path_of_one_artifact_is_exact(stack, engine, redis_client):
    enable(engine, service.FEATURE_FLAG)
    gone = artifact(engine, project_id=42, job_id=58, file="job.log.gz",
                    created_at=dt.datetime(2023, 12, 31, 23, 59, tzinfo=dt.UTC))
    run_job(schedule_bulk_delete_job_artifacts, stack)
    (obj,) = deleted_objects(engine)
    digest = hashlib.sha256(b"42").hexdigest()
    assert digest.startswith("73475cb4")
    assert (obj.store_dir, obj.file, obj.project_id) == (
        f"{digest[:2]}/{digest[2:4]}/{digest}/2023_12_31/58/{gone}", "job.log.gz", 42)


def test_file_final_path_gives_store_dir_and_file(stack, engine, redis_client):
    enable(engine, service.FEATURE_FLAG)
    artifact(engine, file_store=2, file_final_path="@final/1a/2b/5f8e2c7d0a1b/artifacts.zip", project_id=3)
    run_job(schedule_bulk_delete_job_artifacts, stack)
    (obj,) = deleted_objects(engine)
    assert (obj.file_store, obj.store_dir, obj.file, obj.project_id) == (
        2, "@final/1a/2b/5f8e2c7d0a1b", "artifacts.zip", 3)


def test_pick_up_at_is_expire_at_clamped_to_a_day_back(stack, engine, redis_client):
    enable(engine, service.FEATURE_FLAG)
    recent = ago(hours=3)
    artifact(engine, expire_at=ago(days=30), file="old.zip")
    artifact(engine, expire_at=recent, file="recent.zip")
    started = utc_now()
    run_job(schedule_bulk_delete_job_artifacts, stack)
    objects = {o.file: o.pick_up_at for o in deleted_objects(engine)}
    assert objects["recent.zip"] == recent
    assert started - dt.timedelta(days=1) <= objects["old.zip"] <= utc_now() - dt.timedelta(days=1)


def test_pick_up_at_clamp_bounds():
    now = dt.datetime(2024, 5, 1, 12, tzinfo=dt.UTC)

    def pick_up_at(expire_at):
        values = dict(id=1, project_id=1, job_id=1, file="a.zip", file_store=1, file_final_path=None, created_at=now,
                      expire_at=expire_at)
        return expected_deleted_object(type("Row", (), values), now)["pick_up_at"]

    assert pick_up_at(now - dt.timedelta(days=3)) == now - dt.timedelta(days=1)
    assert pick_up_at(now + dt.timedelta(days=3)) == now + dt.timedelta(hours=1)
    assert pick_up_at(now - dt.timedelta(minutes=5)) == now - dt.timedelta(minutes=5)


# Edge cases of the deleted-object rule, for the batch file's SQL and its Python reference
# (expected_deleted_object).
RULE_NOW = dt.datetime(2024, 3, 10, 12, tzinfo=dt.UTC)  # Los Angeles moved to DST 2 hours before
SESSION_TIME_ZONE = "America/Los_Angeles"
HASHED_CASES = [
    dict(created_at=dt.datetime(2024, 3, 9, 23, 59, 59, 999999, tzinfo=dt.UTC)),
    dict(created_at=dt.datetime(2024, 3, 10, 0, 0, tzinfo=dt.UTC)),  # 2024-03-09 in Los Angeles
    dict(created_at=dt.datetime(2024, 3, 10, 7, 59, tzinfo=dt.UTC), project_id=2**62),
    # 2024-03-09 UTC
    dict(created_at=dt.datetime(2024, 3, 10, 1, tzinfo=dt.timezone(dt.timedelta(hours=14))), file="job.log.gz"),
    dict(created_at=dt.datetime(1999, 12, 31, 23, 59, tzinfo=dt.UTC), file_store=2),
    dict(file_final_path=None, file_store=2),
]
FINAL_PATHS = ["@final/1a/2b/5f8e/artifacts.zip", "noslash.zip", "/root.zip", "//x.zip", "a//b.zip", "a/b/", "///",
               "dir/ü ñ/файл.zip", "a/b\nc/d.zip", "a/b c/.hidden"]
NO_OBJECT_CASES = [dict(file=None), dict(file=""), dict(file=None, file_final_path="")]
EXPIRE_AT = [RULE_NOW - dt.timedelta(days=3650), RULE_NOW - dt.timedelta(hours=23, minutes=30),
             RULE_NOW - dt.timedelta(seconds=1)]


def _rule_cases(expire_at: list[dt.datetime]) -> list[dict]:
    cases = HASHED_CASES + [dict(file_final_path=p) for p in FINAL_PATHS] + NO_OBJECT_CASES
    return [{"expire_at": expire_at[i % len(expire_at)], **case} for i, case in enumerate(cases)]


def _object(o) -> tuple:
    return (o["file_store"], o["store_dir"], o["file"], o["project_id"], o["pick_up_at"])


def test_deleted_object_sql_matches_the_python_rule(engine):
    """The batch file's ci_deleted_objects rows, in a session west of UTC, against the Python rule: every artifact is
    taken (a ``now`` past all of them, one bucket) and the pick_up_at bounds are RULE_NOW's, so both are reached."""
    expire_at = EXPIRE_AT + [RULE_NOW + dt.timedelta(minutes=30), RULE_NOW + dt.timedelta(days=400)]
    made = [create(engine, "ci_job_artifacts", project_id=case.pop("project_id", 42), job_id=58, **case)
            for case in _rule_cases(expire_at)]
    a, d = S.ci_job_artifacts, S.ci_deleted_objects
    with on(engine, "ci_job_artifacts").connect() as conn:  # rolled back at the end: the rows stay for the test
        conn.execute(text(f"SET TIME ZONE '{SESSION_TIME_ZONE}'"))
        artifacts = {r.id: r for r in conn.execute(select(a))}
        batch = conn.execute(service.BATCH_FLAGS_FROM_MAIN.on(S, conn.dialect), {
            "enabled": True, "max_buckets": 1, "bucket": 0, "now": RULE_NOW + dt.timedelta(days=3650),
            "after": service.START, "limit": len(made), **service.pick_up_at_bounds(RULE_NOW)}).one()
        in_sql = conn.execute(select(d)).mappings().all()
    assert sorted(artifacts) == made and (batch.ids, batch.deleted_objects) == (made, len(in_sql))
    in_python = [expected_deleted_object(r, RULE_NOW) for r in artifacts.values()]
    assert sorted(map(_object, in_sql)) == sorted(_object(o) for o in in_python if o is not None)
    assert sum(o is None for o in in_python) == len(NO_OBJECT_CASES)
    pick_up = sorted(r["pick_up_at"] for r in in_sql)  # both bounds reached, and values in between
    assert pick_up[0] == RULE_NOW - dt.timedelta(days=1) and pick_up[-1] == RULE_NOW + dt.timedelta(hours=1)
    assert RULE_NOW - dt.timedelta(hours=23, minutes=30) in pick_up and RULE_NOW + dt.timedelta(minutes=30) in pick_up


def test_batch_statement_records_what_the_python_rule_gives_in_any_session_time_zone(stack, engine, redis_client):
    enable(engine, service.FEATURE_FLAG)
    made = [artifact(engine, project_id=case.pop("project_id", 10), **case) for case in _rule_cases(EXPIRE_AT)]
    redis_client.sadd(AVAILABLE_KEY, "0")
    a = S.ci_job_artifacts
    with on(engine, "ci_job_artifacts").connect() as conn:
        before = conn.execute(select(a).order_by(a.c.id)).all()
    expected = [o for o in (expected_deleted_object(r, RULE_NOW) for r in before) if o is not None]
    # Straight to the artifacts' database: PgBouncer refuses the ``options`` startup parameter.
    in_los_angeles = create_engine(direct_ci_url(stack), connect_args={"options": f"-c TimeZone={SESSION_TIME_ZONE}"})
    try:
        result = service.run_bucket_worker(in_los_angeles, redis_client, S, hooks=service.Hooks(now=lambda: RULE_NOW),
                                           bucket=0, flags_engine=on(engine, "feature_gates"))
    finally:
        in_los_angeles.dispose()
    assert ids(engine, "ci_job_artifacts") == [] and len(made) == len(before)
    assert (result.destroyed_job_artifacts_count, result.deleted_objects, result.size) == (
        len(made), len(expected), 1024 * len(made))
    assert sorted(_object(o._mapping) for o in deleted_objects(engine)) == sorted(_object(o) for o in expected)


def test_artifact_without_a_stored_file_is_deleted_without_a_deleted_object(stack, engine, redis_client):
    # GitLab's Ci::DeletedObject.bulk_import skips an artifact whose store_dir or file is nil.
    enable(engine, service.FEATURE_FLAG)
    artifact(engine, file=None)
    result = run_job(schedule_bulk_delete_job_artifacts, stack)
    assert ids(engine, "ci_job_artifacts") == [] and deleted_objects(engine) == []
    assert op_metadata(result, REPORT)["deleted_objects_created"] == 0


def test_high_concurrency_flag_runs_10_buckets(stack, engine, redis_client):
    enable(engine, service.FEATURE_FLAG, service.HIGH_CONCURRENCY_FLAG)
    for b in range(10):
        artifact(engine, bucket=b, max_buckets=10)

    result = run_job(schedule_bulk_delete_job_artifacts, stack)

    assert ids(engine, "ci_job_artifacts") == []
    assert len(deleted_objects(engine)) == 10
    report = op_metadata(result, REPORT)
    assert (report["max_buckets"], report["missing_count"], report["workers"], report["buckets_processed"]) == (
        10, 10, 10, list(range(10)))
    assert [w["destroyed_job_artifacts_count"] for w in worker_metadata(result)] == [1] * 10
    assert redis_state(redis_client) == (set(range(10)), {})


def test_stale_bucket_is_recovered_and_a_live_one_left_alone(stack, engine, redis_client):
    enable(engine, service.FEATURE_FLAG)
    in_bucket = {b: artifact(engine, bucket=b) for b in range(5)}
    live_since = ago(minutes=1).timestamp()
    redis_client.sadd(AVAILABLE_KEY, "0", "3", "4")
    redis_client.zadd(OCCUPIED_KEY, {"1": ago(minutes=11).timestamp(), "2": live_since})
    instance = DagsterInstance.ephemeral()

    result = run_job(schedule_bulk_delete_job_artifacts, stack, instance=instance)

    assert ids(engine, "ci_job_artifacts") == [in_bucket[2]]  # its worker is still running elsewhere
    report = op_metadata(result, REPORT)
    assert (report["available_count"], report["occupied_count"], report["stale_count"], report["missing_count"]) == (
        4, 1, 1, 0)
    assert report["buckets_processed"] == [0, 1, 3, 4]
    workers = worker_metadata(result)
    assert [(w["mod_bucket"], w["claimed"], w["destroyed_job_artifacts_count"]) for w in workers] == [
        (0, True, 1), (1, True, 1), (2, False, 0), (3, True, 1), (4, True, 1)
    ]
    assert log_lines(instance, result, "Bucket 2 ") == [
        "Bucket 2 is not available (occupied by another worker); nothing to do"]
    assert redis_state(redis_client) == ({0, 1, 3, 4}, {2: live_since})


def test_stale_means_claimed_ten_minutes_ago_or_more(redis_client):
    now = utc_now()
    redis_client.zadd(OCCUPIED_KEY, {"0": (now - dt.timedelta(minutes=10)).timestamp(),
                                     "1": (now - dt.timedelta(minutes=9, seconds=59)).timestamp()})
    assert artifact_buckets.recover_stale(redis_client, now) == 1
    assert redis_state(redis_client) == ({0}, {1: (now - dt.timedelta(minutes=9, seconds=59)).timestamp()})


def test_bucket_at_or_above_max_buckets_is_retired(stack, engine, redis_client):
    enable(engine, service.FEATURE_FLAG)  # 5 buckets now; bucket 7 is left from a high-concurrency run
    live_since = ago(minutes=2).timestamp()
    redis_client.sadd(AVAILABLE_KEY, "7")
    redis_client.zadd(OCCUPIED_KEY, {str(b): live_since for b in range(4)})
    in_bucket_4 = artifact(engine, bucket=4)
    in_bucket_1 = artifact(engine, bucket=1)

    result = run_job(schedule_bulk_delete_job_artifacts, stack)

    assert ids(engine, "ci_job_artifacts") == [in_bucket_1]
    assert row(engine, "ci_job_artifacts", in_bucket_4) is None
    workers = worker_metadata(result)
    # Retired by the scheduler, not by a worker of its own: the run has max_buckets workers.
    assert [(w["mod_bucket"], w["claimed"], w["destroyed_job_artifacts_count"], w["terminated_early_due_to_scale_down"])
            for w in workers] == [
        (0, False, 0, False), (1, False, 0, False), (2, False, 0, False), (3, False, 0, False), (4, True, 1, False)
    ]
    assert (op_metadata(result, REPORT)["stray_count"], op_metadata(result, REPORT)["strays"]) == (1, ["7"])
    assert redis_state(redis_client) == ({4}, {b: live_since for b in range(4)})


def test_a_bucket_number_not_written_as_gitlab_writes_it_is_retired_and_the_bucket_is_claimed_again(
    stack, engine, redis_client
):
    """``"00001"`` passes a digit check, but ``SREM "1"`` misses it: bucket 1 would never be claimed again."""
    enable(engine, service.FEATURE_FLAG)
    redis_client.sadd(AVAILABLE_KEY, "0", "00001", "2", "3", "4")
    in_bucket_1 = artifact(engine, bucket=1)

    result = run_job(schedule_bulk_delete_job_artifacts, stack)

    assert row(engine, "ci_job_artifacts", in_bucket_1) is None
    report = op_metadata(result, REPORT)
    assert (report["stray_count"], report["strays"], report["missing_count"], report["buckets_processed"]) == (
        1, ["00001"], 1, [0, 1, 2, 3, 4]
    )
    assert redis_client.smembers(AVAILABLE_KEY) == {b"0", b"1", b"2", b"3", b"4"}
    assert redis_client.zcard(OCCUPIED_KEY) == 0


def test_thousands_of_stray_members_are_retired_in_one_step_and_the_run_keeps_max_buckets_workers(
    stack, engine, redis_client
):
    enable(engine, service.FEATURE_FLAG)
    strays = [str(b) for b in range(5, 2005)] + ["00", "01", "000003", "0042", "0007"]
    redis_client.sadd(AVAILABLE_KEY, *strays)
    artifacts = [artifact(engine, bucket=b) for b in range(5)]

    result = run_job(schedule_bulk_delete_job_artifacts, stack)

    assert [row(engine, "ci_job_artifacts", a) for a in artifacts] == [None] * 5
    assert [w["mod_bucket"] for w in worker_metadata(result)] == [0, 1, 2, 3, 4]
    report = op_metadata(result, REPORT)
    assert (report["workers"], report["stray_count"], report["missing_count"]) == (5, 2005, 5)
    assert report["strays"] == ["5", "6", "7", "8", "9", "00", "01"] + [str(b) for b in range(10, 23)]  # the first 20
    assert redis_state(redis_client) == ({0, 1, 2, 3, 4}, {})


def test_a_dry_run_reports_the_strays_and_leaves_them(stack, engine, redis_client):
    enable(engine, service.FEATURE_FLAG)
    redis_client.sadd(AVAILABLE_KEY, "0", "00001", "9")

    result = run_job(schedule_bulk_delete_job_artifacts, stack, dry_run=True)

    report = op_metadata(result, REPORT)
    assert (report["stray_count"], report["strays"]) == (2, ["9", "00001"])
    assert redis_client.smembers(AVAILABLE_KEY) == {b"0", b"00001", b"9"}


def test_worker_notices_a_scale_down_mid_run_and_retires_its_bucket(stack, engine, redis_client):
    enable(engine, service.FEATURE_FLAG, service.HIGH_CONCURRENCY_FLAG)
    kept = [artifact(engine, bucket=7, max_buckets=10, project_id=p) for p in range(1, 6)]
    redis_client.sadd(AVAILABLE_KEY, "7")

    def scale_down(bucket, batch):
        with engine.begin() as conn:
            conn.execute(delete(S.feature_gates).where(S.feature_gates.c.feature_key == service.HIGH_CONCURRENCY_FLAG))

    result = run_worker(engine, redis_client, batch_size=2,
                                       on_batch=scale_down)

    assert (result.mod_bucket, result.destroyed_job_artifacts_count, result.batches) == (7, 2, 1)
    assert result.terminated_early_due_to_scale_down and not result.artifacts_empty and not result.released
    assert ids(engine, "ci_job_artifacts") == kept[2:]
    assert redis_state(redis_client) == (set(), {})


def test_worker_stops_when_the_feature_is_turned_off_mid_run_deleting_nothing_more(stack, engine, redis_client):
    enable(engine, service.FEATURE_FLAG)
    for p in range(1, 6):
        artifact(engine, bucket=0, project_id=p * 5)
    redis_client.sadd(AVAILABLE_KEY, "0")

    def turn_off(bucket, batch):
        with engine.begin() as conn:
            conn.execute(delete(S.feature_gates).where(S.feature_gates.c.feature_key == service.FEATURE_FLAG))

    result = run_worker(engine, redis_client, batch_size=2,
                                       on_batch=turn_off)

    assert (result.destroyed_job_artifacts_count, result.batches, result.stopped_by_feature_flag) == (2, 1, True)
    assert not result.terminated_early_due_to_scale_down and not result.artifacts_empty and result.released
    assert len(ids(engine, "ci_job_artifacts")) == 3 and len(deleted_objects(engine)) == 2
    assert redis_state(redis_client) == ({0}, {})


def test_a_batch_is_one_statement_that_reads_the_flags_or_main_is_read_before_it(stack, engine, redis_client):
    """GitLab's worker reads the flags before each batch. On one database the batch's own statement reads them
    (delete_expired_batch.sql): one round trip a batch. Decomposed, the flags are main's: read_flags.sql there, then
    the batch with them bound. What is sent is the files' text."""
    enable(engine, service.FEATURE_FLAG)
    for p in range(1, 6):
        artifact(engine, bucket=0, project_id=p * 5)
    redis_client.sadd(AVAILABLE_KEY, "0")
    artifacts, flags = on(engine, "ci_job_artifacts"), on(engine, "feature_gates")
    with statements_sent(artifacts, flags) as statements:
        result = run_worker(engine, redis_client, batch_size=2)
    sent = [(watched, sql) for watched, sql, _ in statements]

    assert (result.batches, result.destroyed_job_artifacts_count, result.artifacts_empty) == (3, 5, True)
    read_flags = service.READ_FLAGS.sent(S, flags.dialect)
    if flags is artifacts:
        assert sent == [(artifacts, service.BATCH.sent(S, artifacts.dialect))] * 3
    else:
        assert sent == [(flags, read_flags), (artifacts, service.BATCH_FLAGS_FROM_MAIN.sent(S, artifacts.dialect))] * 3
    assert ids(engine, "ci_job_artifacts") == [] and len(deleted_objects(engine)) == 5


def test_a_dry_run_counts_each_bucket_with_its_file(stack, engine, redis_client):
    in_bucket = {b: [artifact(engine, bucket=b, project_id=p) for p in (10, 20)[: 1 + b % 2]] for b in range(5)}
    artifact(engine, locked=1)
    artifacts = on(engine, "ci_job_artifacts")
    with statements_sent(artifacts) as statements, artifacts.connect() as conn:
        found = service.count_expired_by_bucket(conn, S, utc_now(), service.MAX_BUCKETS, 1)
    assert found == {b: (len(made), made[:1]) for b, made in in_bucket.items()}
    assert [sql for _, sql, _ in statements] == [service.WOULD_DELETE.sent(S, artifacts.dialect)] * 5


def test_worker_stops_after_max_batches_and_releases_its_bucket(stack, engine, redis_client):
    enable(engine, service.FEATURE_FLAG)
    created = [artifact(engine, bucket=0, project_id=p * 5) for p in range(1, 8)]
    redis_client.sadd(AVAILABLE_KEY, "0")

    result = run_worker(engine, redis_client, batch_size=2, max_batches=3)

    assert (result.destroyed_job_artifacts_count, result.batches, result.artifacts_empty, result.released) == (
        6, 3, False, True)
    assert len(ids(engine, "ci_job_artifacts")) == 1 and set(ids(engine, "ci_job_artifacts")) < set(created)
    assert redis_state(redis_client) == ({0}, {})


def test_each_batch_hands_on_its_ids_count_size_and_the_worker_goes_on_from_its_cursor(
    stack, engine, redis_client
):
    """Oldest expire_at first, each batch after the last one's: ids in order, count and bytes freed exact."""
    enable(engine, service.FEATURE_FLAG)
    created = [artifact(engine, bucket=0, project_id=p * 5, expire_at=ago(hours=10 - p), size=p) for p in range(1, 6)]
    redis_client.sadd(AVAILABLE_KEY, "0")
    batches = []

    result = run_worker(engine, redis_client, batch_size=2, on_batch=lambda bucket, batch: batches.append(batch))

    assert [(b.count, b.ids, b.size) for b in batches] == [
        (2, created[:2], 3), (2, created[2:4], 7), (1, created[4:], 5)]
    assert (result.destroyed_job_artifacts_count, result.batches, result.size, result.artifacts_empty) == (
        5, 3, 15, True)
    assert ids(engine, "ci_job_artifacts") == [] and len(deleted_objects(engine)) == 5


def test_worker_told_to_stop_deletes_nothing_more_and_releases_its_bucket(stack, engine, redis_client):
    """The run was terminated: the worker ends the batch it is in (one statement), starts no other, and gives its
    bucket back (no transaction of it can linger)."""
    enable(engine, service.FEATURE_FLAG)
    created = [artifact(engine, bucket=0, project_id=p * 5) for p in range(1, 6)]
    redis_client.sadd(AVAILABLE_KEY, "0")
    stop = threading.Event()

    result = run_worker(engine, redis_client, batch_size=2, on_batch=lambda bucket, batch: stop.set(),
        stop=stop,
    )

    assert (result.mod_bucket, result.destroyed_job_artifacts_count, result.batches, result.deleted_objects) == (
        0, 2, 1, 2)
    assert result.stopped and result.released and not result.artifacts_empty
    assert not result.terminated_early_due_to_scale_down and not result.stopped_by_feature_flag
    assert ids(engine, "ci_job_artifacts") == created[2:]  # oldest first: the first two expired at once
    assert len(deleted_objects(engine)) == 2
    assert redis_state(redis_client) == ({0}, {})

    already = run_worker(engine, redis_client, batch_size=2, stop=stop)

    assert (already.mod_bucket, already.batches, already.stopped, already.released) == (0, 0, True, True)
    assert ids(engine, "ci_job_artifacts") == created[2:] and len(deleted_objects(engine)) == 2
    assert redis_state(redis_client) == ({0}, {})


def test_a_worker_paused_by_its_brake_stops_when_told_without_waiting_out_the_pause(stack, engine, redis_client):
    """A terminated run's workers are told to stop in their threads (no signal reaches them): one in its pause after a
    batch ends it then, and gives its bucket back, however long the pause."""
    enable(engine, service.FEATURE_FLAG)
    created = [artifact(engine, bucket=0, project_id=p * 5) for p in range(1, 6)]
    redis_client.sadd(AVAILABLE_KEY, "0")
    stop, paused = threading.Event(), threading.Event()

    class Told(Brake):  # the brake's own pause (days at this duty cycle), with the moment it begins made visible
        def pause_after(self, batch_seconds: float) -> float:
            paused.set()
            return super().pause_after(batch_seconds)

    outcome: list[service.WorkerResult] = []
    worker = threading.Thread(target=lambda: outcome.append(
        run_worker(engine, redis_client, batch_size=2, stop=stop, brake=Told(1e-9))), daemon=True)
    worker.start()
    assert paused.wait(60)
    stop.set()
    worker.join(60)

    assert not worker.is_alive(), "the worker slept through its stop"
    (result,) = outcome
    assert (result.batches, result.destroyed_job_artifacts_count, result.stopped, result.released) == (1, 2, True, True)
    assert ids(engine, "ci_job_artifacts") == created[2:]
    assert redis_state(redis_client) == ({0}, {})


def test_claim_with_no_bucket_available_writes_nothing(redis_client):
    assert artifact_buckets.claim(redis_client, utc_now()) is None
    assert artifact_buckets.claim(redis_client, utc_now(), 3) is None
    assert redis_client.keys("*") == []


def test_claim_takes_one_bucket_atomically_into_occupied(redis_client):
    now = utc_now()
    redis_client.sadd(AVAILABLE_KEY, "2", "4")
    assert artifact_buckets.claim(redis_client, now, 4) == 4
    assert artifact_buckets.claim(redis_client, now, 4) is None
    assert artifact_buckets.claim(redis_client, now) == 2
    assert artifact_buckets.claim(redis_client, now) is None
    assert redis_state(redis_client) == (set(), {2: now.timestamp(), 4: now.timestamp()})
    assert artifact_buckets.release(redis_client, 2, 5) is True
    assert artifact_buckets.release(redis_client, 4, 4) is False  # at or above max_buckets: retired
    assert redis_state(redis_client) == ({2}, {})


def test_6000_artifacts_over_many_projects_are_all_deleted_in_one_run(stack, engine, redis_client):
    enable(engine, service.FEATURE_FLAG)
    expired = ago(days=2)
    with on(engine, "ci_job_artifacts").begin() as conn:
        conn.execute(
            insert(S.ci_job_artifacts),
            [dict(partition_id=100 + i % 3, project_id=1 + i % 397, job_id=10_000 + i // 3, file_type=1 + i % 2,
                  size=10, file="artifacts.zip", file_store=1, locked=0, expire_at=expired, created_at=expired,
                  updated_at=expired)
             for i in range(6000)],
        )

    result = run_job(schedule_bulk_delete_job_artifacts, stack)

    assert ids(engine, "ci_job_artifacts") == []
    assert len(deleted_objects(engine)) == 6000
    report = op_metadata(result, REPORT)
    assert (report["destroyed_job_artifacts_count"], report["size"], report["buckets_processed"]) == (
        6000, 60_000, [0, 1, 2, 3, 4])
    assert all(w["artifacts_empty"] for w in worker_metadata(result))
    observations = [e for e in result.all_events if e.event_type_value == "ASSET_OBSERVATION"]
    assert sum(o.event_specific_data.asset_observation.metadata["destroyed_job_artifacts_count"].value
               for o in observations) == 6000


_WORKER_SCRIPT = """
import sys, redis
from sqlalchemy import create_engine
from ci_cleanup.gitlab.schema import gitlab_schema
from ci_cleanup.schedule_bulk_delete_job_artifacts import service
from ci_cleanup.schedule_bulk_delete_job_artifacts.job import STOPPING
service.run_bucket_worker(create_engine(sys.argv[1]), redis.Redis.from_url(sys.argv[2]), gitlab_schema(),
                          flags_engine=create_engine(sys.argv[3]))
"""


@contextlib.contextmanager
def held_batches(engine, lock: int):
    """Every batch statement held at its end (its rows deleted and recorded, its transaction open) by a statement
    trigger on ci_deleted_objects that waits for the advisory lock ``lock``. The connection given holds the lock
    until it rolls back; the trigger is dropped afterwards."""
    with engine.begin() as conn:
        conn.execute(text(
            "CREATE FUNCTION hold_batch() RETURNS trigger LANGUAGE plpgsql AS $$ "
            f"BEGIN PERFORM pg_advisory_xact_lock({int(lock)}); RETURN NULL; END $$"
        ))
        conn.execute(text(
            "CREATE TRIGGER hold_batch AFTER INSERT ON ci_deleted_objects "
            "FOR EACH STATEMENT EXECUTE FUNCTION hold_batch()"
        ))
    try:
        with engine.connect() as blocker:
            blocker.execute(text("SELECT pg_advisory_xact_lock(:lock)"), {"lock": lock})
            yield blocker
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP TRIGGER IF EXISTS hold_batch ON ci_deleted_objects"))
            conn.execute(text("DROP FUNCTION IF EXISTS hold_batch()"))


def test_worker_killed_mid_batch_leaves_no_partial_batch_and_keeps_its_bucket(stack, engine, redis_client):
    enable(engine, service.FEATURE_FLAG)
    created = [artifact(engine, bucket=0, project_id=5 * p) for p in range(1, 151)]
    redis_client.sadd(AVAILABLE_KEY, "0")
    with held_batches(on(engine, "ci_deleted_objects"), 4004) as blocker:
        worker = subprocess.Popen([sys.executable, "-c", _WORKER_SCRIPT, ci_url(stack), stack.redis_url, stack.url()],
                                  cwd=os.getcwd())
        try:
            backend = None
            deadline = time.monotonic() + 60
            while backend is None and time.monotonic() < deadline and worker.poll() is None:
                with engine.connect() as conn:
                    backend = conn.scalar(text(
                        "SELECT pid FROM pg_stat_activity "
                        "WHERE wait_event_type = 'Lock' AND wait_event = 'advisory'"
                    ))
                time.sleep(0.05)
            assert backend is not None, "the worker never reached the end of its batch statement"
            # the batch did delete: its 100 rows are held by its open transaction
            with on(engine, "ci_job_artifacts").connect() as conn:
                a = S.ci_job_artifacts
                free = conn.scalars(
                    select(a.c.id).where(a.c.id.in_(created)).with_for_update(skip_locked=True)).all()
                assert len(free) == 50
                conn.rollback()
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait()
            with engine.connect() as conn:
                conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": backend})
                deadline = time.monotonic() + 60
                # pg_stat_activity is a snapshot per transaction: clear it each time to see the backend go.
                while conn.execute(text("SELECT pg_stat_clear_snapshot()")) and conn.scalar(
                    text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid"), {"pid": backend}
                ):
                    assert time.monotonic() < deadline, "the killed worker's backend did not exit"
                    time.sleep(0.05)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        blocker.rollback()

    remaining = set(ids(engine, "ci_job_artifacts"))
    objects = deleted_objects(engine)
    for artifact_id in created:
        hashed = [o for o in objects if o.store_dir.endswith(f"/{artifact_id}")]
        assert (artifact_id in remaining) != (len(hashed) == 1)
    assert remaining == set(created) and objects == []  # the killed batch rolled back entirely
    available, occupied = redis_state(redis_client)
    assert available == set() and list(occupied) == [0]  # left for stale recovery


def test_a_failing_worker_keeps_its_bucket_the_others_finish_and_the_run_fails_naming_it(
    stack, engine, redis_client
):
    enable(engine, service.FEATURE_FLAG)
    refused = artifact(engine, bucket=2, project_id=7)
    for b in (0, 1, 3, 4):
        for p in (10, 20, 30):
            artifact(engine, bucket=b, project_id=p)
    # Bucket 2's batch statement fails (the artifact of project 7 cannot be recorded); the others take 4 batches
    # each, so a worker stopped by the failure would leave rows behind.
    with on(engine, "ci_deleted_objects").begin() as conn:
        conn.execute(text(
            "CREATE FUNCTION refuse_project_7() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF NEW.project_id = 7 THEN RAISE EXCEPTION 'refused for project 7'; END IF; RETURN NEW; END $$"
        ))
        conn.execute(text(
            "CREATE TRIGGER refuse_project_7 BEFORE INSERT ON ci_deleted_objects "
            "FOR EACH ROW EXECUTE FUNCTION refuse_project_7()"
        ))
    instance = DagsterInstance.ephemeral()
    try:
        result = run_job(
            schedule_bulk_delete_job_artifacts, stack, instance=instance, raise_on_error=False,
            run_config={"ops": {"schedule_buckets": {"config": {"batch_size": 1}}}},
        )
    finally:
        with on(engine, "ci_deleted_objects").begin() as conn:
            conn.execute(text("DROP TRIGGER IF EXISTS refuse_project_7 ON ci_deleted_objects"))
            conn.execute(text("DROP FUNCTION IF EXISTS refuse_project_7()"))

    assert not result.success
    message = step_failure_message(result)
    assert message.startswith(
        "ci_cleanup.schedule_bulk_delete_job_artifacts.job.BucketWorkerFailed: "
        "bucket worker 2 failed: RaiseException: refused for project 7"
    ), message
    assert "stays occupied until stale recovery" in message and "SELECT" not in message
    # The failed batch rolled back whole; every other bucket was emptied.
    assert ids(engine, "ci_job_artifacts") == [refused]
    assert sorted(o.project_id for o in deleted_objects(engine)) == sorted([10, 20, 30] * 4)
    available, occupied = redis_state(redis_client)
    assert available == {0, 1, 3, 4} and list(occupied) == [2]  # left for stale recovery, as GitLab's would be
    done = [
        f"Bucket worker {b} done: mod_bucket={b}, destroyed_job_artifacts_count=3, artifacts_empty=True, "
        "terminated_early_due_to_scale_down=False" for b in (0, 1, 3, 4)
    ]
    failed = "Bucket worker 2 failed: RaiseException: refused for project 7"  # then PostgreSQL's CONTEXT lines
    assert sorted(line.splitlines()[0] for line in log_lines(instance, result, "Bucket worker")) == [
        *done[:2], failed, *done[2:]]
    assert [e.step_key for e in result.all_events if e.event_type_value == "STEP_OUTPUT"] == ["schedule_buckets"]


def test_a_terminated_run_stops_its_workers_between_batches_and_gives_the_buckets_back(
    stack, engine, redis_client, tmp_path
):
    """``dagster job execute`` interrupted (SIGINT, as a run's termination is) while every worker is inside its
    first batch: each batch ends whole, no worker starts another, every bucket goes back, the run fails."""
    enable(engine, service.FEATURE_FLAG)
    created = [artifact(engine, bucket=0, project_id=5 * p) for p in range(1, 151)]
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    log = tmp_path / "run.log"
    with held_batches(on(engine, "ci_deleted_objects"), 4005) as blocker, log.open("w") as out:
        # Direct connections: the five workers are inside their batches at once, which the deployed PgBouncer's pool
        # of two server connections per database would not let them be (three would wait in its queue, not in a batch).
        run = subprocess.Popen(
            [os.path.join(os.path.dirname(sys.executable), "dagster"), "job", "execute", "-m", "ci_cleanup",
             "-j", "schedule_bulk_delete_job_artifacts"],
            env=clean_env(**direct_database_env(stack), CI_CLEANUP_REDIS_URL=stack.redis_url,
                          DAGSTER_HOME=str(tmp_path)),
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
        )
        try:
            deadline, waiting = time.monotonic() + 120, 0
            while waiting < 5 and run.poll() is None:
                assert time.monotonic() < deadline, "the five workers never reached the end of their batch"
                time.sleep(0.1)
                with engine.connect() as conn:
                    waiting = conn.scalar(text(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND wait_event = 'advisory'"
                    ))
            assert waiting == 5, log.read_text()
            run.send_signal(signal.SIGINT)
            while STOPPING not in log.read_text():  # the op's thread took the interrupt: stop is set
                assert run.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            blocker.rollback()  # the five batches end
            assert run.wait(120) != 0
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()

    output = log.read_text()
    # Bucket 0's first batch (its 100 oldest) committed whole and no other began.
    assert ids(engine, "ci_job_artifacts") == created[100:], output
    assert len(deleted_objects(engine)) == 100
    assert redis_state(redis_client) == ({0, 1, 2, 3, 4}, {})
    assert ("Bucket worker 0 done: mod_bucket=0, destroyed_job_artifacts_count=100, artifacts_empty=False, "
            "terminated_early_due_to_scale_down=False, stopped: the run was terminated") in output
    assert "RUN_FAILURE" in output


def test_dry_run_reports_what_would_happen_and_writes_nothing(stack, engine, redis_client):
    enable(engine, service.FEATURE_FLAG)
    in_bucket_0 = [artifact(engine, bucket=0, project_id=p) for p in (10, 20)]
    in_bucket_3 = [artifact(engine, bucket=3, project_id=21)]
    kept = artifact(engine, locked=1)
    stale_since = ago(minutes=30).timestamp()
    redis_client.zadd(OCCUPIED_KEY, {"1": stale_since})
    redis_client.sadd(AVAILABLE_KEY, "0")
    before = ids(engine, "ci_job_artifacts")

    result = run_job(schedule_bulk_delete_job_artifacts, stack, dry_run=True)

    assert ids(engine, "ci_job_artifacts") == before == sorted(in_bucket_0 + in_bucket_3 + [kept])
    assert deleted_objects(engine) == []
    assert redis_state(redis_client) == ({0}, {1: stale_since})
    report = op_metadata(result, REPORT)
    assert (report["status"], report["rows_changed"], report["would_delete_count"]) == ("dry run", 0, 3)
    assert report["would_delete_ids"] == {"0": in_bucket_0, "1": [], "2": [], "3": in_bucket_3, "4": []}
    assert (report["max_buckets"], report["available_count"], report["occupied_count"], report["stale_count"],
            report["missing_count"]) == (5, 2, 0, 1, 3)
    assert worker_metadata(result) == []
    assert result.dagster_run.tags.get(DRY_RUN_TAG) == "true"


FIND = "schedule_buckets"


def gitlab_rails(tmp_path, text: str, name: str = service.FEATURE_FLAG):
    """A GitLab Rails folder holding the flag's definition file (``config/feature_flags/<type>/<name>.yml``)."""
    path = tmp_path / "gitlab-rails" / "config" / "feature_flags" / "gitlab_com_derisk" / f"{name}.yml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def definition(default: bool) -> str:
    """A definition as GitLab ships it (gitlabhq config/feature_flags/gitlab_com_derisk/<name>.yml at 8b516878)."""
    return (f"---\nname: {service.FEATURE_FLAG}\nmilestone: '18.8'\ngroup: group::pipeline execution\n"
            f"type: gitlab_com_derisk\ndefault_enabled: {str(default).lower()}\n")


@pytest.fixture
def no_rails(monkeypatch, tmp_path):
    """No GitLab Rails folder to read: neither the setting nor Omnibus' folder."""
    monkeypatch.delenv(feature_flags.RAILS_DIR_ENV, raising=False)
    monkeypatch.delenv(feature_flags.FLAGS_ON_ENV, raising=False)
    monkeypatch.setattr(feature_flags, "OMNIBUS_RAILS_DIR", tmp_path / "no-omnibus")


def flag_decision(result) -> tuple:
    found = op_metadata(result, FIND)
    return found["flag_enabled"], found["flag_decided_by"], found["flag_default_enabled"], found["flag_default_from"]


def test_a_flag_without_a_gate_is_its_definitions_default_enabled_until_gitlab_stores_it(
        stack, engine, redis_client, monkeypatch, tmp_path, no_rails):
    path = gitlab_rails(tmp_path, definition(True))
    monkeypatch.setenv(feature_flags.RAILS_DIR_ENV, str(path.parents[3]))
    gone = artifact(engine)

    result = run_job(schedule_bulk_delete_job_artifacts, stack)

    assert ids(engine, "ci_job_artifacts") == [] and [o.project_id for o in deleted_objects(engine)] == [10]
    assert flag_decision(result) == (True, "definition", True, "definition")
    assert op_metadata(result, FIND)["flag_definition"] == str(path) and gone
    # Feature.disable(:bulk_delete_job_artifacts): the flag is stored, with no gate: off, by its gates.
    create(engine, "features", key=service.FEATURE_FLAG)
    kept = artifact(engine)
    result = run_job(schedule_bulk_delete_job_artifacts, stack)
    assert ids(engine, "ci_job_artifacts") == [kept]
    assert flag_decision(result) == (False, "gate", True, "definition")
    assert op_metadata(result, REPORT)["status"] == "skipped: bulk_delete_job_artifacts disabled"


def test_a_definition_false_or_missing_leaves_the_flag_to_its_gates(
        stack, engine, redis_client, monkeypatch, tmp_path, no_rails):
    path = gitlab_rails(tmp_path, definition(False))
    monkeypatch.setenv(feature_flags.RAILS_DIR_ENV, str(path.parents[3]))
    kept = artifact(engine)
    assert flag_decision(run_job(schedule_bulk_delete_job_artifacts, stack)) == (False, "definition", False,
                                                                                 "definition")
    assert ids(engine, "ci_job_artifacts") == [kept]
    path.unlink()  # a GitLab before 18.8: no such flag, off (Feature::Definition's default in production)
    result = run_job(schedule_bulk_delete_job_artifacts, stack)
    assert flag_decision(result) == (False, "definition", False, "definition")
    assert "flag_definition" not in op_metadata(result, FIND)
    enable(engine, service.FEATURE_FLAG)
    assert flag_decision(run_job(schedule_bulk_delete_job_artifacts, stack)) == (True, "gate", False, "definition")
    assert ids(engine, "ci_job_artifacts") == []


def test_without_gitlabs_rails_folder_the_releases_known_default_decides(stack, engine, redis_client, no_rails):
    kept = artifact(engine)
    result = run_job(schedule_bulk_delete_job_artifacts, stack)
    # bulk_delete_job_artifacts is default_enabled: false at every vendored release (RELEASE_DEFAULTS).
    assert flag_decision(result) == (False, "release_default", False, "release_default")
    assert ids(engine, "ci_job_artifacts") == [kept] and redis_client.keys("*") == []


def test_the_instance_as_an_actor_turns_the_flag_on_and_its_opt_out_off(stack, engine, redis_client, no_rails):
    """Feature.enabled?(:bulk_delete_job_artifacts, :instance): Feature.enable(name, :instance) writes the actor
    FlipperGitlabInstance:<host>; Feature.opt_out(name, :instance) its <actor>:opt_out, which wins."""
    gates = on(engine, "feature_gates")

    def flags() -> service.Flags:
        with gates.connect() as conn:
            return service.read_flags(conn, S)

    actor = "FlipperGitlabInstance:gitlab.example.com"
    create(engine, "feature_gates", feature_key=service.FEATURE_FLAG, key="actors", value=actor)
    create(engine, "feature_gates", feature_key=service.HIGH_CONCURRENCY_FLAG, key="actors", value=actor)
    assert (flags().enabled, flags().max_buckets, flags().gated) == (True, 10, True)
    create(engine, "feature_gates", feature_key=service.FEATURE_FLAG, key="actors", value=actor + ":opt_out")
    create(engine, "feature_gates", feature_key=service.FEATURE_FLAG, key="actors", value="User:7")
    assert (flags().enabled, flags().max_buckets) == (False, 10)


def test_an_operator_turns_the_flag_on_for_ci_cleanup_alone(stack, engine, redis_client, monkeypatch, no_rails):
    monkeypatch.setenv(feature_flags.FLAGS_ON_ENV, f"other_flag, {service.FEATURE_FLAG}")
    artifact(engine)
    result = run_job(schedule_bulk_delete_job_artifacts, stack)
    assert ids(engine, "ci_job_artifacts") == []
    assert flag_decision(result) == (True, "ci_cleanup", False, "release_default")
    # GitLab's own worker reads the flag off still: no gate, default false.
    with on(engine, "feature_gates").connect() as conn:
        assert service.read_flags(conn, S).enabled is False
    # The op config overrides the environment either way.
    kept = artifact(engine)
    as_gitlab = {"ops": {FIND: {"config": {"feature_flag": "as_gitlab"}}}}
    assert flag_decision(run_job(schedule_bulk_delete_job_artifacts, stack, run_config=as_gitlab))[:2] == (
        False, "release_default")
    assert ids(engine, "ci_job_artifacts") == [kept]
    monkeypatch.delenv(feature_flags.FLAGS_ON_ENV)
    on_alone = {"ops": {FIND: {"config": {"feature_flag": "on"}}}}
    assert flag_decision(run_job(schedule_bulk_delete_job_artifacts, stack, run_config=on_alone))[:2] == (
        True, "ci_cleanup")
    assert ids(engine, "ci_job_artifacts") == []


@pytest.mark.parametrize("text, line", [
    pytest.param("---\nname: bulk_delete_job_artifacts\ndefault_enabled: [true\n", "does not parse as YAML (line 4)",
                 id="not YAML"),
    pytest.param("---\nname: bulk_delete_job_artifacts\ndefault_enabled: 'yes'\n",
                 "default_enabled is not true or false", id="not a boolean"),
])
def test_a_definition_that_cannot_be_used_fails_the_run_in_one_line_naming_it_and_nothing_changes(
        stack, engine, redis_client, monkeypatch, tmp_path, no_rails, text, line):
    path = gitlab_rails(tmp_path, text)
    monkeypatch.setenv(feature_flags.RAILS_DIR_ENV, str(path.parents[3]))
    enable(engine, service.FEATURE_FLAG)  # on by its gate: the file is still read, as GitLab reads it at boot
    kept = artifact(engine)
    message = step_failure_message(run_job(schedule_bulk_delete_job_artifacts, stack, raise_on_error=False))
    assert message == f"ci_cleanup.gitlab.feature_flags.FlagDefinitionError: {path}: {line}\n"
    assert ids(engine, "ci_job_artifacts") == [kept] and deleted_objects(engine) == []
    assert redis_client.keys("*") == []


def test_a_rails_folder_setting_that_is_no_folder_is_named(stack, engine, redis_client, monkeypatch, tmp_path):
    monkeypatch.setenv(feature_flags.RAILS_DIR_ENV, str(tmp_path / "missing"))
    kept = artifact(engine)
    message = step_failure_message(run_job(schedule_bulk_delete_job_artifacts, stack, raise_on_error=False))
    assert message == ("ci_cleanup.gitlab.feature_flags.FlagDefinitionError: "
                       f"CI_CLEANUP_GITLAB_RAILS_DIR={tmp_path / 'missing'} is not a folder that can be read\n")
    assert ids(engine, "ci_job_artifacts") == [kept] and redis_client.keys("*") == []


def test_a_batch_reads_the_flags_with_read_flags_text():
    """Each mechanism once: the one-database batch's flags are read_flags.sql's, line for line (both name flags.sql)."""
    assert "WITH {{ flags }}" in service.READ_FLAGS.source and "WITH {{ flags }}," in service.BATCH.source
    read = service.READ_FLAGS.expanded
    shared = read[read.index("WITH gates AS"):read.index("SELECT enabled, max_buckets, persisted, gated FROM flags")]
    assert shared.rstrip("\n") + ",\n" in service.BATCH.expanded


def test_dry_run_with_the_flag_off_is_skipped(stack, engine, redis_client):
    expired = artifact(engine)
    result = run_job(schedule_bulk_delete_job_artifacts, stack, dry_run=True)
    assert ids(engine, "ci_job_artifacts") == [expired]
    assert redis_client.keys("*") == []
    assert op_metadata(result, REPORT)["status"] == "skipped: bulk_delete_job_artifacts disabled"
    assert result.dagster_run.tags.get(DRY_RUN_TAG) == "true"


# pick_up_at as GitLab may have written it (unclamped before 17.5), each out of Python's datetime range but the last:
# -infinity, BC, year 1 and a leap second (stored as the next minute's first).
EXTREME_PICK_UP_AT = ("-infinity", "4713-01-01 00:00:00+00 BC", "0044-03-15 12:00:00+00 BC", "0001-01-01 00:00:00+00",
                      "2016-12-31 23:59:60+00")


@pytest.mark.parametrize("zone", ["UTC", "America/New_York", "Pacific/Kiritimati", "Asia/Kolkata"])
def test_due_rows_with_extreme_pick_up_at_are_done_in_the_same_run_as_the_rest_in_any_session_time_zone(
    stack, redis_client, scratch_database, tmp_path, no_root_env, zone
):
    """One row a batch, so each batch pages on from the last row's pick_up_at: ordered by the column, not by its
    text (which put year 1 before 44 BC, and left the BC rows for a later run)."""
    scratch = gitlab_database(scratch_database)
    in_zone = scratch_database + ("&" if "?" in scratch_database else "?") + f"options=-c%20TimeZone%3D{zone}"
    paths, rows = [], []
    for i, value in enumerate((*EXTREME_PICK_UP_AT, None)):
        paths.append(stored_file(tmp_path, f"ab/cd/{i}"))
        pick_up_at = cast(literal(value), TIMESTAMP(timezone=True)) if value else ago(hours=1)
        rows.append(create(scratch, "ci_deleted_objects", store_dir=f"ab/cd/{i}", file="artifacts.zip", file_store=1,
                           project_id=1, pick_up_at=pick_up_at))
    config = files_run_config(tmp_path, batch_size=1)

    dry = run_job(delete_expired_artifact_files, stack, database_url=in_zone, run_config=config, dry_run=True)
    result = run_job(delete_expired_artifact_files, stack, database_url=in_zone, run_config=config)

    assert op_metadata(dry, FILES_REPORT)["would_delete_row_ids"] == rows  # in pick_up_at order
    report = op_metadata(result, FILES_REPORT)
    assert (report["files_removed"], report["batches"], report[ROWS_WITH_ERRORS]) == (6, 6, 0)
    assert ids(scratch, "ci_deleted_objects") == [] and not any(path.exists() for path in paths)
    scratch.dispose()


def test_an_out_of_range_setting_fails_the_run_in_one_line_naming_it_and_its_bound(
    stack, engine, redis_client, tmp_path, no_root_env
):
    """Dagster's config schema has no bounds: the Launchpad accepts batch_size 0, and the op's config refuses it as it
    is built, before the op reads or writes anything (ci_cleanup.settings)."""
    path = stored_file(tmp_path, "ab/cd/z")
    row_id = deleted_object_row(engine, store_dir="ab/cd/z")

    results = [run_job(delete_expired_artifact_files, stack, raise_on_error=False,
                       run_config=files_run_config(tmp_path, **config))
               for config in ({"batch_size": 0}, {"max_batches": 10_001, "batch_size": 1001})]

    assert [step_failure_message(result) for result in results] == [
        "ValueError: batch_size must be at least 1, not 0\n",
        "ValueError: batch_size must be at most 1000, not 1001; max_batches must be at most 10000, not 10001\n",
    ]
    assert path.exists() and ids(engine, "ci_deleted_objects") == [row_id]


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({"batch_size": 0}, id="batch size 0"),
        pytest.param({"max_runtime_seconds": -1}, id="negative timeout"),
        pytest.param({"max_batches": 1_000_000}, id="cap above the maximum"),
    ],
)
def test_invalid_config_is_refused_before_anything_is_written(stack, engine, redis_client, config):
    enable(engine, service.FEATURE_FLAG)
    expired = artifact(engine)
    result = run_job(
        schedule_bulk_delete_job_artifacts, stack, run_config={"ops": {"schedule_buckets": {"config": config}}},
        raise_on_error=False
    )
    assert not result.success
    assert ids(engine, "ci_job_artifacts") == [expired]
    assert redis_client.keys("*") == []


def test_missing_table_fails_naming_it(stack, redis_client, scratch_database):
    gitlab_database(scratch_database, "DROP TABLE ci_deleted_objects").dispose()
    result = run_job(schedule_bulk_delete_job_artifacts, stack, database_url=scratch_database, raise_on_error=False)
    assert not result.success
    assert "table ci_deleted_objects" in step_failure_message(result)
    assert redis_client.keys("*") == []


def test_job_runs_its_workers_in_one_op_in_process_every_7_minutes():
    job = defs.get_job_def("schedule_bulk_delete_job_artifacts")
    assert job.executor_def.name == "in_process"
    assert [node.name for node in job.graph.nodes_in_topological_order] == [
        "schedule_buckets", WORKERS, REPORT]
    assert schedule_bulk_delete_job_artifacts_schedule.cron_schedule == "*/7 * * * *"
    assert schedule_bulk_delete_job_artifacts_schedule.execution_timezone == "UTC"
    assert schedule_bulk_delete_job_artifacts.tags["ci_cleanup/seed"] == "004"


# --- delete_expired_artifact_files: the stored files of deleted artifacts --------------------------------------

FILES_REPORT = "report_removed_artifact_files"


def deleted_object_row(engine, *, store_dir: str, file: str = "artifacts.zip", file_store: int = 1,
                       pick_up_at=None) -> int:
    return create(engine, "ci_deleted_objects", store_dir=store_dir, file=file, file_store=file_store, project_id=1,
                  pick_up_at=pick_up_at or ago(hours=1))


def stored_file(root, store_dir: str, file: str = "artifacts.zip"):
    path = root.joinpath(*store_dir.split("/"), file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"zip")
    return path


def files_run_config(root, **config) -> dict:
    return {"ops": {"plan_artifact_file_removal": {"config": {"artifacts_root": str(root), **config}}}}


@pytest.fixture
def no_root_env(monkeypatch):
    monkeypatch.delenv(ARTIFACTS_ROOT_ENV, raising=False)


def test_files_job_removes_due_local_files_and_their_rows_and_reports_the_rest(
    stack, engine, redis_client, tmp_path, no_root_env
):
    present = [stored_file(tmp_path, f"ab/cd/abcd/2024_01_0{i}/7/{i}") for i in (1, 2)]
    removed_rows = [deleted_object_row(engine, store_dir=f"ab/cd/abcd/2024_01_0{i}/7/{i}") for i in (1, 2)]
    missing_row = deleted_object_row(engine, store_dir="ab/cd/abcd/2024_01_03/7/3")
    remote_row = deleted_object_row(engine, store_dir="ab/cd/abcd/2024_01_04/7/4", file_store=2)
    not_due_file = stored_file(tmp_path, "ab/cd/abcd/2024_01_05/7/5")
    not_due_row = deleted_object_row(engine, store_dir="ab/cd/abcd/2024_01_05/7/5",
                                     pick_up_at=utc_now() + dt.timedelta(minutes=30))

    result = run_job(delete_expired_artifact_files, stack, run_config=files_run_config(tmp_path))

    assert [p.exists() for p in present] == [False, False] and not_due_file.exists()
    assert ids(engine, "ci_deleted_objects") == [remote_row, not_due_row]
    assert set(removed_rows + [missing_row]).isdisjoint(ids(engine, "ci_deleted_objects"))
    report = op_metadata(result, FILES_REPORT)
    assert (report["status"], report["rows_changed"], report["files_removed"], report["files_missing"],
            report["object_storage_left"]) == ("success", 3, 2, 1, 1)
    assert (report["refused_count"], report["local_left_without_root"], report["due_count"],
            report["due_object_storage"]) == (0, 0, 4, 1)


def test_files_job_refuses_paths_that_leave_the_root(stack, engine, redis_client, tmp_path, no_root_env):
    root = tmp_path / "artifacts"
    root.mkdir()
    outside = stored_file(tmp_path, "outside", "secret")
    refused = [
        deleted_object_row(engine, store_dir="../outside", file="secret"),
        deleted_object_row(engine, store_dir=str(tmp_path / "outside"), file="secret"),
        deleted_object_row(engine, store_dir="ab/cd", file="../../../outside/secret"),
    ]
    result = run_job(delete_expired_artifact_files, stack, run_config=files_run_config(root))
    assert outside.exists()
    assert ids(engine, "ci_deleted_objects") == refused
    report = op_metadata(result, FILES_REPORT)
    assert (report["status"], report["rows_changed"], report["refused_count"]) == ("success", 0, 3)
    assert all(line.startswith(f"row {i}: ") for line, i in zip(report["refused"], refused))


def test_files_job_without_a_root_leaves_local_rows(stack, engine, redis_client, tmp_path, no_root_env):
    local = deleted_object_row(engine, store_dir="ab/cd/x")
    result = run_job(delete_expired_artifact_files, stack)
    assert ids(engine, "ci_deleted_objects") == [local]
    report = op_metadata(result, FILES_REPORT)
    assert (report["rows_changed"], report["local_left_without_root"]) == (0, 1)


def test_files_batches_send_their_files_text_and_page_past_the_rows_they_leave(stack, engine, redis_client, tmp_path):
    """Each batch: next_due_deleted_objects.sql (locked), then delete_removed_deleted_objects.sql for the rows whose
    file is gone; the object-storage row is left and not taken again. A dry run: count_due_ and preview_due_. A row
    whose removal failed is put off by retry_deleted_objects_later.sql, in its batch's transaction."""
    paths = [stored_file(tmp_path, f"ab/cd/{i}") for i in range(3)]
    local = [deleted_object_row(engine, store_dir=f"ab/cd/{i}", pick_up_at=ago(hours=3 - i)) for i in range(3)]
    remote = deleted_object_row(engine, store_dir="ab/cd/r", file_store=2, pick_up_at=ago(hours=2, minutes=30))
    refused = deleted_object_row(engine, store_dir="../x", pick_up_at=ago(minutes=30))
    remote_pick_up_at = row(engine, "ci_deleted_objects", remote).pick_up_at
    deleted = on(engine, "ci_deleted_objects")
    sent = {name: sql.sent(S, deleted.dialect) for name, sql in [
        ("next", files.NEXT_DUE), ("delete", files.DELETE_REMOVED), ("count", files.COUNT_DUE),
        ("preview", files.PREVIEW_DUE), ("retry", files.RETRY_LATER)]}
    with statements_sent(deleted) as statements:
        with deleted.connect() as conn:
            due = files.count_due(conn, S, utc_now())
            would = files.preview(conn, S, files.Storages(tmp_path), utc_now(), 10)
        before = utc_now()
        result = files.delete_expired_artifact_files(deleted, S, files.Storages(tmp_path), files.Limits(batch_size=2))

    assert (due, would.removed, would.object_storage) == ({1: 4, 2: 1}, local, [remote])
    assert (result.batches, result.removed, result.object_storage, len(result.refused)) == (3, 3, 1, 1)
    assert not any(p.exists() for p in paths) and ids(engine, "ci_deleted_objects") == [remote, refused]
    assert row(engine, "ci_deleted_objects", remote).pick_up_at == remote_pick_up_at
    assert row(engine, "ci_deleted_objects", refused).pick_up_at >= before + files.RETRY_IN  # GitLab's RETRY_IN
    names = {sql: name for name, sql in sent.items()}
    assert [names.get(sql, sql) for _, sql, _ in statements] == [
        "count", "preview", "next", "delete", "next", "delete", "next", "retry", "next"]
    assert [params["ids"] for _, sql, params in statements if sql == sent["delete"]] == [local[:1], local[1:]]


def test_files_job_takes_the_root_from_the_environment(stack, engine, redis_client, tmp_path, monkeypatch):
    monkeypatch.setenv(ARTIFACTS_ROOT_ENV, str(tmp_path))
    path = stored_file(tmp_path, "ab/cd/y")
    deleted_object_row(engine, store_dir="ab/cd/y")
    run_job(delete_expired_artifact_files, stack)
    assert not path.exists() and ids(engine, "ci_deleted_objects") == []


def test_files_job_drains_more_than_one_batch(stack, engine, redis_client, tmp_path, no_root_env):
    with on(engine, "ci_deleted_objects").begin() as conn:
        conn.execute(insert(S.ci_deleted_objects), [
            dict(file_store=1, store_dir=f"aa/bb/{i}", file="a.zip", project_id=1, pick_up_at=ago(hours=1, seconds=i))
            for i in range(250)
        ] + [dict(file_store=2, store_dir=f"cc/dd/{i}", file="a.zip", project_id=1, pick_up_at=ago(hours=1))
             for i in range(150)])
    result = run_job(delete_expired_artifact_files, stack, run_config=files_run_config(tmp_path))
    assert len(ids(engine, "ci_deleted_objects")) == 150
    report = op_metadata(result, FILES_REPORT)
    assert (report["rows_changed"], report["files_missing"], report["object_storage_left"], report["batches"]) == (
        250, 250, 150, 4)


def test_bulk_delete_then_files_job_removes_the_artifacts_stored_file(
    stack, engine, redis_client, tmp_path, no_root_env
):
    enable(engine, service.FEATURE_FLAG)
    created_at = dt.datetime(2024, 6, 1, 8, tzinfo=dt.UTC)
    artifact_id = artifact(engine, bucket=2, project_id=5, job_id=77, created_at=created_at, file="artifacts.zip")
    path = stored_file(tmp_path, expected_hashed_store_dir(5, created_at, 77, artifact_id))

    run_job(schedule_bulk_delete_job_artifacts, stack)
    run_job(delete_expired_artifact_files, stack, run_config=files_run_config(tmp_path))

    assert not path.exists()
    assert ids(engine, "ci_job_artifacts") == [] and ids(engine, "ci_deleted_objects") == []


def test_files_job_dry_run_removes_nothing(stack, engine, redis_client, tmp_path, no_root_env):
    path = stored_file(tmp_path, "ab/cd/z")
    rows = [deleted_object_row(engine, store_dir="ab/cd/z"), deleted_object_row(engine, store_dir="ab/cd/gone"),
            deleted_object_row(engine, store_dir="ab/cd/r", file_store=2), deleted_object_row(engine, store_dir="../x")]
    result = run_job(delete_expired_artifact_files, stack, run_config=files_run_config(tmp_path), dry_run=True)
    assert path.exists() and ids(engine, "ci_deleted_objects") == rows
    would = op_metadata(result, FILES_REPORT)
    assert {k: v for k, v in would.items() if isinstance(v, int)} == {  # what would change, first, read as words
        "would_remove_files": 1, "would_drop_rows_of_missing_files": 1, "would_delete_objects": 0,
        "would_drop_rows_of_missing_objects": 0, "would_fail_objects": 0, "would_leave_in_object_storage": 1,
        "would_leave_without_root": 0, "would_refuse_count": 1, ROWS_CHANGED: 0, "files_removed": 0,
        "files_missing": 0, "objects_removed": 0, "objects_missing": 0, "objects_failed": 0,
        "object_storage_left": 0, "local_left_without_root": 0, "refused_count": 0,
        ROWS_WITH_ERRORS: 0, "batches": 0, "due_count": 4, "due_object_storage": 1,
    }
    assert list(would)[:10] == [
        "would_remove_files", "would_drop_rows_of_missing_files", "would_delete_objects",
        "would_drop_rows_of_missing_objects", "would_fail_objects", "would_leave_in_object_storage",
        "would_leave_without_root", "would_refuse_count", "would_delete_row_ids", "would_delete_object_keys",
    ]
    assert would["would_delete_row_ids"] == rows[:2]
    assert op_metadata(result, FILES_REPORT)["status"] == "dry run"


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({"batch_size": 0}, id="batch size 0"),
        pytest.param({"max_batches": 1_000_000}, id="cap above the maximum"),
        pytest.param({"artifacts_root": "relative/path"}, id="relative root"),
        pytest.param({"artifacts_root": "/nonexistent/artifacts/root"}, id="root that does not exist"),
    ],
)
def test_files_job_invalid_config_is_refused_before_anything_is_removed(
    stack, engine, redis_client, tmp_path, no_root_env, config
):
    path = stored_file(tmp_path, "ab/cd/z")
    row_id = deleted_object_row(engine, store_dir="ab/cd/z")
    result = run_job(delete_expired_artifact_files, stack, run_config=files_run_config(tmp_path, **config),
                     raise_on_error=False)
    assert not result.success
    assert path.exists() and ids(engine, "ci_deleted_objects") == [row_id]


def test_files_job_runs_every_10_minutes_in_utc():
    schedule = delete_expired_artifact_files_schedule
    assert (schedule.cron_schedule, schedule.execution_timezone) == ("*/10 * * * *", "UTC")


@pytest.mark.parametrize("link", ["store_dir", "hashed path's first folder", "file"])
def test_files_job_never_follows_a_symbolic_link_below_the_root(
    stack, engine, redis_client, tmp_path, no_root_env, link
):
    """``root/evil -> /outside``: the text of the path stays inside the root, the file it leads to does not."""
    root, outside = tmp_path / "artifacts", tmp_path / "outside"
    root.mkdir()
    victim = stored_file(outside, "ab/cd/abcd/2024_01_01/7/1", "victim")
    if link == "store_dir":
        (root / "evil").symlink_to(outside / "ab/cd/abcd/2024_01_01/7/1")
        store_dir, file = "evil", "victim"
    elif link == "hashed path's first folder":
        (root / "ab").symlink_to(outside / "ab")
        store_dir, file = "ab/cd/abcd/2024_01_01/7/1", "victim"
    else:
        (root / "ab").mkdir()
        (root / "ab" / "victim").symlink_to(victim)
        store_dir, file = "ab", "victim"
    refused = deleted_object_row(engine, store_dir=store_dir, file=file)
    inside = stored_file(root, "cd/ef/cdef/2024_01_01/8/2")
    removed = deleted_object_row(engine, store_dir="cd/ef/cdef/2024_01_01/8/2")

    would = op_metadata(
        run_job(delete_expired_artifact_files, stack, run_config=files_run_config(root), dry_run=True),
        FILES_REPORT,
    )
    result = run_job(delete_expired_artifact_files, stack, run_config=files_run_config(root))

    assert victim.read_bytes() == b"zip" and not inside.exists()
    assert ids(engine, "ci_deleted_objects") == [refused] and removed not in ids(engine, "ci_deleted_objects")
    report = op_metadata(result, FILES_REPORT)
    assert (report["status"], report["rows_changed"], report["files_removed"], report["refused_count"]) == (
        "success", 1, 1, 1
    )
    assert report["refused"][0].startswith(f"row {refused}: ") and "is a symbolic link" in report["refused"][0]
    assert (would["would_refuse_count"], would["would_remove_files"], would["refused"][0]) == (
        1, 1, report["refused"][0])
