"""``python -m ci_cleanup_dev.bench.objects``: delete_expired_artifact_files' rate against an S3 API (objects a second).

On an embedded stack of its own and moto's S3 server (``moto[server]``, the test extra) in a process of its own on a
free loopback port: each round writes ``--objects`` due ``ci_deleted_objects`` rows on object storage, each with its
object in the artifacts bucket under a prefix, then runs the job in process as scheduled (no run config; the store
from ``CI_CLEANUP_ARTIFACTS_OBJECT_STORE_*``) and checks that every row and every object is gone. The rate is the
objects removed over the run's wall time; the CPU is this process's (the job's), the store's apart. Over loopback
it measures the job's own cost (a HEAD and a DELETE per key, 16 at a time, and its batches' SQL): a real store adds
its round trips, which the 16 requests in flight hide in part.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dagster import DagsterInstance
from sqlalchemy import create_engine, text

from ci_cleanup.gitlab.object_storage import ENV_PREFIX
from ci_cleanup.resources import job_resources
from ci_cleanup.schedule_bulk_delete_job_artifacts.files_job import delete_expired_artifact_files

from ..ddl import create_schema
from ..devstack import EmbeddedStack

BUCKET, PREFIX = "gitlab-artifacts", "bench"
SEED = (
    "INSERT INTO ci_deleted_objects (file_store, store_dir, file, project_id, pick_up_at) "
    "SELECT 2, 'aa/bb/aabb/2024_01_01/' || g || '/' || g, 'artifacts.zip', 1, now() - interval '1 hour' "
    "FROM generate_series(1, :n) g"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _s3_server(port: int) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/").close()
            return server
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise SystemExit("moto's S3 server did not start (pip install 'moto[server]')")


def _round(stack, client, engine, n: int) -> dict:
    """One run of the job on ``n`` fresh rows and objects: its wall time, CPU and what it reported."""
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE ci_deleted_objects"))
        conn.execute(text(SEED), {"n": n})
    keys = [f"{PREFIX}/aa/bb/aabb/2024_01_01/{g}/{g}/artifacts.zip" for g in range(1, n + 1)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda key: client.put_object(Bucket=BUCKET, Key=key, Body=b"zip"), keys))
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    started = time.monotonic()
    with DagsterInstance.ephemeral() as instance:
        result = delete_expired_artifact_files.execute_in_process(
            resources=job_resources(stack.url(), stack.redis_url), instance=instance,
            run_config={"loggers": {"console": {"config": {"log_level": "ERROR"}}}})
    seconds = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    report = next(e.step_output_data.metadata for e in result.all_events
                  if e.event_type_value == "STEP_OUTPUT" and e.step_key == "report_removed_artifact_files")
    with engine.connect() as conn:
        rows_left = conn.scalar(text("SELECT count(*) FROM ci_deleted_objects"))
    objects_left = client.list_objects_v2(Bucket=BUCKET).get("KeyCount", 0)
    removed = report["objects_removed"].value
    if not result.success or removed != n or rows_left or objects_left:
        raise SystemExit(f"the run left rows or objects: {removed} of {n} removed, {rows_left} rows and "
                         f"{objects_left} objects left")
    return {"seconds": seconds, "cpu": after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime}


def bench(stack, objects: int, rounds: int) -> dict:
    import boto3

    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = _s3_server(port)
    os.environ.update({ENV_PREFIX + "BUCKET": f"{BUCKET}/{PREFIX}", ENV_PREFIX + "ENDPOINT": endpoint,
                       ENV_PREFIX + "PATH_STYLE": "true", ENV_PREFIX + "ACCESS_KEY_ID": "bench",
                       ENV_PREFIX + "SECRET_ACCESS_KEY": "bench"})
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bench",
                          aws_secret_access_key="bench")
    engine = create_engine(stack.url())
    try:
        create_schema(engine)
        client.create_bucket(Bucket=BUCKET)
        runs = [_round(stack, client, engine, objects) for _ in range(rounds)]
    finally:
        engine.dispose()
        client.close()
        server.terminate()
        server.wait(10)
    rates = sorted(objects / r["seconds"] for r in runs)
    return {"rates": rates, "median": statistics.median(rates),
            "cpu_ms_per_object": statistics.median(r["cpu"] for r in runs) * 1000 / objects}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ci_cleanup_dev.bench.objects", description=__doc__)
    parser.add_argument("--objects", type=int, default=2000, help="due object-storage rows (and objects) a round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the figure is their median")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="ci_cleanup_bench_objects_"))
    os.chmod(workdir, 0o755)  # pgserver's PostgreSQL runs as another user when we are root
    try:
        with EmbeddedStack(workdir / "stack") as stack:
            f = bench(stack, args.objects, args.rounds)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"delete_expired_artifact_files, {args.objects:,} objects a round against moto's S3 server over loopback: "
          f"{', '.join(f'{r:.0f}' for r in f['rates'])} objects/s (median {f['median']:.0f}); "
          f"the job's CPU {f['cpu_ms_per_object']:.2f} ms an object\n"
          f"files_job_objects_per_second={f['median']:.0f}")


if __name__ == "__main__":
    main()
