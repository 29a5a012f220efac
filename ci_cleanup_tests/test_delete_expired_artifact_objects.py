"""``delete_expired_artifact_files`` on object storage: GitLab's ``Ci::DeleteObjectsService`` removing
``<prefix>/<store_dir>/<file>`` from the artifacts bucket, against a real S3 API (moto's server) over HTTP on
loopback, started and stopped here. Every test asserts the exact rows and the exact keys left."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import urllib.request

import boto3
import pytest
import yaml
from dagster import DagsterInstance
from moto.server import ThreadedMotoServer
from sqlalchemy.engine import make_url

from ci_cleanup.gitlab.config_files import ENV_CONFIG_DIR
from ci_cleanup.gitlab.object_storage import ENV_PREFIX
from ci_cleanup.gitlab.schema import utc_now
from ci_cleanup.schedule_bulk_delete_job_artifacts.files_job import ARTIFACTS_ROOT_ENV, delete_expired_artifact_files
from ci_cleanup.schedule_bulk_delete_job_artifacts.job import schedule_bulk_delete_job_artifacts
from ci_cleanup.schedule_bulk_delete_job_artifacts.service import FEATURE_FLAG

from .factories import S, ago, create, ids, row
from .harness import free_port
from .runner import op_metadata, run_job, step_failure_message
from .test_schedule_bulk_delete_job_artifacts import artifact, enable

REPORT, PLAN = "report_removed_artifact_files", "plan_artifact_file_removal"
KEY_ID, SECRET = "AKIAIOSFODNN7CICLEAN", "wJalrXUtnFEMI-ci-cleanup-secret-never-shown"
BUCKET, OTHER = "gitlab-artifacts", "gitlab-lfs"


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server on a free loopback port, for this module."""
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3(s3_endpoint, monkeypatch):
    """A client of the server, every bucket gone before the test; the job's environment without any object store,
    artifacts root or GitLab config folder of the caller's."""
    request = urllib.request.Request(f"{s3_endpoint}/moto-api/reset", method="POST")
    urllib.request.urlopen(request).close()
    for name in ("PROVIDER", "BUCKET", "REGION", "ENDPOINT", "PATH_STYLE", "ACCESS_KEY_ID", "SECRET_ACCESS_KEY",
                 "SESSION_TOKEN"):
        monkeypatch.delenv(ENV_PREFIX + name, raising=False)
    for name in (ENV_CONFIG_DIR, ARTIFACTS_ROOT_ENV):
        monkeypatch.delenv(name, raising=False)
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id=KEY_ID,
                          aws_secret_access_key=SECRET)
    for bucket in (BUCKET, OTHER):
        client.create_bucket(Bucket=bucket)
    yield client
    client.close()


def connection(endpoint: str, **extra) -> dict:
    return {"provider": "AWS", "aws_access_key_id": KEY_ID, "aws_secret_access_key": SECRET, "region": "us-east-1",
            "endpoint": endpoint, "path_style": True, **extra}


def gitlab_yml(stack, folder, monkeypatch, production: dict) -> None:
    """GitLab's config folder, named by CI_CLEANUP_GITLAB_CONFIG_DIR: its gitlab.yml, and a database.yml of the
    stack's database (the folder is where the jobs read GitLab's database from too)."""
    url = make_url(stack.url())
    database = {"adapter": "postgresql", "database": url.database, "username": url.username,
                "host": url.query.get("host") or url.host, "port": url.port}
    (folder / "database.yml").write_text(yaml.safe_dump({"production": {"main": database}}))
    (folder / "gitlab.yml").write_text(yaml.safe_dump({"production": production}))
    monkeypatch.setenv(ENV_CONFIG_DIR, str(folder))


def consolidated(endpoint: str, bucket: str) -> dict:
    """The consolidated form: object_store with its connection, and the artifacts' bucket among its objects."""
    return {"object_store": {"enabled": True, "connection": connection(endpoint),
                             "objects": {"artifacts": {"bucket": bucket}, "lfs": {"bucket": OTHER}}},
            "artifacts": {"enabled": True}}


def per_type(endpoint: str, remote_directory: str) -> dict:
    """The artifacts' own form: artifacts.object_store with remote_directory and its connection."""
    return {"artifacts": {"enabled": True, "object_store": {
        "enabled": True, "remote_directory": remote_directory, "connection": connection(endpoint)}}}


def queued(engine, store_dir: str, *, file_store: int = 2, pick_up_at=None, file: str = "artifacts.zip") -> int:
    return create(engine, "ci_deleted_objects", store_dir=store_dir, file=file, file_store=file_store, project_id=1,
                  pick_up_at=pick_up_at or ago(hours=1))


def put(client, bucket: str, key: str) -> str:
    client.put_object(Bucket=bucket, Key=key, Body=b"zip")
    return key


def keys(client, bucket: str) -> set[str]:
    return {o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])}


def pick_up_at(engine, row_id: int) -> dt.datetime:
    return row(engine, "ci_deleted_objects", row_id).pick_up_at


def run(stack, **kwargs):
    """The job's run and everything it wrote (log lines, events with their metadata, tags), as one text: where a
    secret must never be."""
    instance = DagsterInstance.ephemeral()
    result = run_job(delete_expired_artifact_files, stack, instance=instance, **kwargs)
    shown = [entry.user_message + " " + json.dumps(str(entry.dagster_event), default=str)
             for entry in instance.all_logs(result.run_id)]
    shown += [json.dumps(instance.get_run_by_id(result.run_id).tags)]
    return result, "\n".join(shown)


def test_consolidated_form_with_a_prefix_removes_due_objects_and_local_files_in_one_run(
    stack, engine, redis_client, s3, s3_endpoint, tmp_path, monkeypatch
):
    gitlab_yml(stack, tmp_path, monkeypatch, consolidated(s3_endpoint, f"{BUCKET}/tenant/artifacts"))
    root = tmp_path / "artifacts"
    (root / "ab/cd/1").mkdir(parents=True)
    (root / "ab/cd/1/artifacts.zip").write_bytes(b"zip")
    removed = [queued(engine, f"aa/bb/aabb/2024_01_0{i}/7/{i}") for i in (1, 2)]
    for i in (1, 2):
        put(s3, BUCKET, f"tenant/artifacts/aa/bb/aabb/2024_01_0{i}/7/{i}/artifacts.zip")
    missing = queued(engine, "aa/bb/aabb/2024_01_03/7/3")
    not_due = queued(engine, "aa/bb/aabb/2024_01_04/7/4", pick_up_at=utc_now() + dt.timedelta(minutes=30))
    kept = put(s3, BUCKET, "tenant/artifacts/aa/bb/aabb/2024_01_04/7/4/artifacts.zip")
    # The same store_dir/file outside the prefix, and in another bucket: neither is the artifact's object.
    decoys = {put(s3, BUCKET, "aa/bb/aabb/2024_01_01/7/1/artifacts.zip"),
              put(s3, BUCKET, "tenant/aa/bb/aabb/2024_01_02/7/2/artifacts.zip")}
    other = put(s3, OTHER, "tenant/artifacts/aa/bb/aabb/2024_01_01/7/1/artifacts.zip")
    local = queued(engine, "ab/cd/1", file_store=1)

    result, shown = run(stack, run_config={"ops": {PLAN: {"config": {"artifacts_root": str(root)}}}})

    assert ids(engine, "ci_deleted_objects") == [not_due]
    assert keys(s3, BUCKET) == {kept} | decoys and keys(s3, OTHER) == {other}
    assert not (root / "ab/cd/1/artifacts.zip").exists()
    report = op_metadata(result, REPORT)
    assert (report["status"], report["rows_changed"], report["files_removed"], report["objects_removed"],
            report["objects_missing"], report["objects_failed"], report["object_storage_left"]) == (
        "success", 4, 1, 2, 1, 0, 0)
    assert (report["objects_removed_ids"], report["objects_missing_ids"], report["objects_failed_ids"]) == (
        removed, [missing], [])
    store = op_metadata(result, PLAN)["object_store"]
    assert (store["bucket"], store["prefix"], store["endpoint"], store["path_style"]) == (
        BUCKET, "tenant/artifacts", s3_endpoint, True)
    assert local not in ids(engine, "ci_deleted_objects")
    assert SECRET not in shown and KEY_ID not in shown


def test_per_type_form_without_a_prefix(stack, engine, redis_client, s3, s3_endpoint, tmp_path, monkeypatch):
    gitlab_yml(stack, tmp_path, monkeypatch, per_type(s3_endpoint, BUCKET))
    gone = queued(engine, "cc/dd/ccdd/2024_02_01/8/5")
    put(s3, BUCKET, "cc/dd/ccdd/2024_02_01/8/5/artifacts.zip")
    other = put(s3, OTHER, "cc/dd/ccdd/2024_02_01/8/5/artifacts.zip")

    result = run_job(delete_expired_artifact_files, stack)

    assert ids(engine, "ci_deleted_objects") == [] and keys(s3, BUCKET) == set() and keys(s3, OTHER) == {other}
    report = op_metadata(result, REPORT)
    assert (report["rows_changed"], report["objects_removed_ids"], report["local_left_without_root"]) == (1, [gone], 0)


def test_a_failing_bucket_keeps_the_rows_for_retry_in_10_minutes_and_the_other_rows_go_on(
    stack, engine, redis_client, s3, s3_endpoint, tmp_path, monkeypatch
):
    """No such bucket: GitLab's delete_file_from_storage fails and its row is left with pick_up_at = now + RETRY_IN,
    so GitLab's own `pick_up_at < now` does not see it due again before then. A local file of the same batch is
    still removed; the line names the bucket and the endpoint, never the secret."""
    gitlab_yml(stack, tmp_path, monkeypatch, per_type(s3_endpoint, "no-such-bucket/prefix"))
    root = tmp_path / "artifacts"
    (root / "ef").mkdir(parents=True)
    (root / "ef/artifacts.zip").write_bytes(b"zip")
    failed = [queued(engine, f"ee/ff/eeff/2024_03_01/9/{i}", pick_up_at=ago(hours=2, minutes=i)) for i in (1, 2)]
    unsafe = queued(engine, "../outside", pick_up_at=ago(hours=1))
    local = queued(engine, "ef", file_store=1)
    other = put(s3, OTHER, "prefix/ee/ff/eeff/2024_03_01/9/1/artifacts.zip")

    before = utc_now()
    result, shown = run(stack, run_config={"ops": {PLAN: {"config": {"artifacts_root": str(root)}}}})
    after = utc_now()

    assert ids(engine, "ci_deleted_objects") == sorted(failed + [unsafe]) and keys(s3, OTHER) == {other}
    assert local not in ids(engine, "ci_deleted_objects") and not (root / "ef/artifacts.zip").exists()
    for row_id in failed + [unsafe]:
        assert before + dt.timedelta(minutes=10) <= pick_up_at(engine, row_id) <= after + dt.timedelta(minutes=10)
    d = S.ci_deleted_objects
    assert ids(engine, "ci_deleted_objects", d.c.pick_up_at < utc_now()) == []  # GitLab's ready_for_destruction
    report = op_metadata(result, REPORT)
    assert (report["status"], report["rows_changed"], report["files_removed"], report["objects_failed"],
            report["rows_with_errors"], sorted(report["objects_failed_ids"])) == (
        "success", 1, 1, 3, 3, sorted(failed + [unsafe]))
    failure = next(line for line in report["objects_failures"] if line.startswith(f"row {failed[0]}: "))
    assert f"bucket 'no-such-bucket' prefix 'prefix' at {s3_endpoint}" in failure and "NoSuchBucket" in failure
    assert next(line for line in report["objects_failures"] if line.startswith(f"row {unsafe}: ")).endswith(
        "store_dir '../outside' leaves the artifacts root")
    assert "NoSuchBucket" in shown and SECRET not in shown and KEY_ID not in shown


def test_dry_run_lists_the_objects_it_would_delete_and_changes_nothing(
    stack, engine, redis_client, s3, s3_endpoint, tmp_path, monkeypatch
):
    gitlab_yml(stack, tmp_path, monkeypatch, consolidated(s3_endpoint, f"{BUCKET}/p"))
    present = queued(engine, "11/22/1122/2024_04_01/3/1", pick_up_at=ago(hours=2))
    key = put(s3, BUCKET, "p/11/22/1122/2024_04_01/3/1/artifacts.zip")
    missing = queued(engine, "11/22/1122/2024_04_01/3/2", pick_up_at=ago(hours=1))
    before = {i: pick_up_at(engine, i) for i in (present, missing)}

    result = run_job(delete_expired_artifact_files, stack, dry_run=True)

    assert ids(engine, "ci_deleted_objects") == [present, missing] and keys(s3, BUCKET) == {key}
    assert {i: pick_up_at(engine, i) for i in (present, missing)} == before
    would = op_metadata(result, REPORT)
    assert (would["status"], would["would_delete_objects"], would["would_drop_rows_of_missing_objects"],
            would["would_fail_objects"], would["would_delete_object_keys"], would["would_delete_row_ids"]) == (
        "dry run", 1, 1, 0, [key], [present, missing])


def test_dry_run_says_a_failing_bucket_would_fail(stack, engine, redis_client, s3, s3_endpoint, tmp_path, monkeypatch):
    gitlab_yml(stack, tmp_path, monkeypatch, per_type(s3_endpoint, "no-such-bucket"))
    queued_row = queued(engine, "33/44/x")
    would = op_metadata(run_job(delete_expired_artifact_files, stack, dry_run=True), REPORT)
    assert (would["would_fail_objects"], would["would_drop_rows_of_missing_objects"]) == (1, 0)
    assert would["objects_failures"][0].startswith(f"row {queued_row}: HEAD bucket failed in bucket 'no-such-bucket'")
    assert ids(engine, "ci_deleted_objects") == [queued_row]


def test_environment_variables_without_a_config_folder(stack, engine, redis_client, s3, s3_endpoint, monkeypatch):
    for name, value in {"BUCKET": f"{BUCKET}/env-prefix", "ENDPOINT": s3_endpoint, "PATH_STYLE": "true",
                        "REGION": "us-east-1", "ACCESS_KEY_ID": KEY_ID, "SECRET_ACCESS_KEY": SECRET}.items():
        monkeypatch.setenv(ENV_PREFIX + name, value)
    gone = queued(engine, "55/66/y")
    put(s3, BUCKET, "env-prefix/55/66/y/artifacts.zip")
    decoy = put(s3, BUCKET, "55/66/y/artifacts.zip")

    result, shown = run(stack)

    assert ids(engine, "ci_deleted_objects") == [] and keys(s3, BUCKET) == {decoy}
    assert op_metadata(result, REPORT)["objects_removed_ids"] == [gone]
    assert op_metadata(result, PLAN)["object_store"]["read_from"] == f"environment ({ENV_PREFIX}*)"
    assert SECRET not in shown and KEY_ID not in shown


@pytest.mark.parametrize("provider", ["Google", "AzureRM"])
def test_a_provider_not_supported_is_said_in_one_line_and_its_rows_are_left_untouched(
    stack, engine, redis_client, s3, s3_endpoint, tmp_path, monkeypatch, provider
):
    settings = per_type(s3_endpoint, BUCKET)
    settings["artifacts"]["object_store"]["connection"] = {"provider": provider, "google_project": "p"}
    gitlab_yml(stack, tmp_path, monkeypatch, settings)
    left = queued(engine, "77/88/z")
    key = put(s3, BUCKET, "77/88/z/artifacts.zip")
    before = pick_up_at(engine, left)

    would = op_metadata(run(stack, dry_run=True)[0], REPORT)
    result, shown = run(stack)

    assert (would["would_leave_in_object_storage"], would["object_storage_left_why"]) == (
        1, f"object storage provider {provider!r} is not supported (only AWS and S3-compatible)")
    assert ids(engine, "ci_deleted_objects") == [left] and pick_up_at(engine, left) == before
    assert keys(s3, BUCKET) == {key}
    report = op_metadata(result, REPORT)
    assert (report["rows_changed"], report["object_storage_left"], report["batches"]) == (0, 1, 1)
    assert report["object_storage_left_why"] == (
        f"object storage provider {provider!r} is not supported (only AWS and S3-compatible)")
    assert f"1 due rows in object storage are left: object storage provider {provider!r} is not supported" in shown


def test_no_object_store_configured_leaves_the_rows_and_says_so(stack, engine, redis_client, s3, tmp_path):
    left = queued(engine, "99/00/w")
    result = run_job(delete_expired_artifact_files, stack)
    assert ids(engine, "ci_deleted_objects") == [left]
    report = op_metadata(result, REPORT)
    assert (report["object_storage_left"], report["object_storage_left_why"]) == (
        1, f"no object store is configured for artifacts (gitlab.yml in {ENV_CONFIG_DIR}, or {ENV_PREFIX}BUCKET)")


def test_a_bad_gitlab_yml_fails_the_run_in_one_line_before_anything_changes(
    stack, engine, redis_client, s3, s3_endpoint, tmp_path, monkeypatch
):
    gitlab_yml(stack, tmp_path, monkeypatch, per_type(s3_endpoint, "bucket/../elsewhere"))
    kept = queued(engine, "aa/x")
    result = run_job(delete_expired_artifact_files, stack, raise_on_error=False)
    assert not result.success and ids(engine, "ci_deleted_objects") == [kept]
    message = step_failure_message(result)
    assert "gitlab.yml: production.artifacts.object_store's bucket: invalid bucket" in message
    assert SECRET not in message


def test_object_store_false_in_run_config_leaves_the_rows_and_the_objects(
    stack, engine, redis_client, s3, s3_endpoint, tmp_path, monkeypatch
):
    """The demo's switch: its own rows never reach the operator's configured store."""
    gitlab_yml(stack, tmp_path, monkeypatch, per_type(s3_endpoint, BUCKET))
    left = queued(engine, "12/34/v")
    key = put(s3, BUCKET, "12/34/v/artifacts.zip")
    result, _ = run(stack, run_config={"ops": {PLAN: {"config": {"object_store": False}}}})
    assert ids(engine, "ci_deleted_objects") == [left] and keys(s3, BUCKET) == {key}
    report = op_metadata(result, REPORT)
    assert (report["object_storage_left"], report["object_storage_left_why"]) == (
        1, "object_store is false in this run's config")


def test_an_artifact_on_object_storage_deleted_by_the_bulk_delete_loses_its_object_where_gitlab_stored_it(
    stack, engine, redis_client, s3, s3_endpoint, tmp_path, monkeypatch
):
    """End to end: the expired artifact (file_store 2) is deleted by schedule_bulk_delete_job_artifacts, which queues
    its file; this job removes the object at the key GitLab's JobArtifactUploader stored it under: the bucket
    prefix, then the hashed path sha256(project_id) h[0:2]/h[2:4]/h/<created_at day>/<job_id>/<id>, then its file.
    A direct upload's file_final_path is its key under the prefix as it stands."""
    gitlab_yml(stack, tmp_path, monkeypatch, consolidated(s3_endpoint, f"{BUCKET}/gl"))
    enable(engine, FEATURE_FLAG)
    created_at = dt.datetime(2024, 6, 1, 8, tzinfo=dt.UTC)
    hashed = artifact(engine, bucket=2, project_id=5, job_id=77, created_at=created_at, file="artifacts.zip",
                      file_store=2)
    final = artifact(engine, bucket=3, project_id=5, job_id=78, created_at=created_at, file="artifacts.zip",
                     file_store=2, file_final_path="@final/1a/2b/3c4d5e")
    digest = hashlib.sha256(b"5").hexdigest()
    expected = {put(s3, BUCKET, f"gl/{digest[:2]}/{digest[2:4]}/{digest}/2024_06_01/77/{hashed}/artifacts.zip"),
                put(s3, BUCKET, "gl/@final/1a/2b/3c4d5e")}
    kept = put(s3, BUCKET, f"gl/{digest[:2]}/{digest[2:4]}/{digest}/2024_06_01/79/1/artifacts.zip")

    run_job(schedule_bulk_delete_job_artifacts, stack)
    assert ids(engine, "ci_job_artifacts") == [] and keys(s3, BUCKET) == expected | {kept}
    ids_before = ids(engine, "ci_deleted_objects")
    assert len(ids_before) == 2 and final != hashed
    result, _ = run(stack)

    assert ids(engine, "ci_deleted_objects") == [] and keys(s3, BUCKET) == {kept}
    assert sorted(op_metadata(result, REPORT)["objects_removed_ids"]) == ids_before


def test_an_unreachable_endpoint_fails_each_row_naming_it_and_keeps_them_for_retry(
    stack, engine, redis_client, s3, tmp_path, monkeypatch
):
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    gitlab_yml(stack, tmp_path, monkeypatch, per_type(closed, BUCKET))
    rows = [queued(engine, f"ab/{i}") for i in range(2)]
    result, shown = run(stack)
    assert ids(engine, "ci_deleted_objects") == rows
    assert all(pick_up_at(engine, i) > utc_now() + dt.timedelta(minutes=9) for i in rows)
    report = op_metadata(result, REPORT)
    assert (report["status"], report["objects_failed"], report["rows_changed"]) == ("success", 2, 0)
    assert report["objects_failures"][0].endswith(f"in bucket '{BUCKET}' at {closed}: EndpointConnectionError")
    assert SECRET not in shown
