"""``python -m ci_cleanup_dev.bench.prune``: how fast prune_dagster_history deletes the history of 10 k old runs.

On the embedded stack (or CI_CLEANUP_DATABASE_URL / CI_CLEANUP_REDIS_URL / CI_CLEANUP_DAGSTER_PG_URL):
one real run of ``stale_runner_machines_cleanup`` on the PostgreSQL instance storage is the template;
``clone_runs`` copies its rows (``runs``, ``run_tags``, ``event_logs``) in SQL, with new run ids and
timestamps moved back 31 to 60 days. Creating them through ``DagsterInstance.handle_new_event``
takes 70 ms a run (10 k runs: 12 minutes); the copy takes seconds and yields the same rows.
Then the prune job runs in process while ``stale_runner_machines_cleanup`` runs on GitLab's tables
beside it, in another process, and must still finish.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from dagster import DagsterInstance, DagsterRunStatus
from sqlalchemy import MetaData, Table, create_engine, func, insert, literal, select, text, true
from sqlalchemy.engine import Engine

from ci_cleanup.gitlab.schema import utc_now
from ci_cleanup.resources import GitLabDatabase, GitLabRedis, RunOptions
from ci_cleanup_dev.ddl import create_schema
from ci_cleanup_dev.devstack import DAGSTER_YAML, EmbeddedStack


def clone_runs(
    dagster_db: Engine, template_run_id: str, finished_at: Sequence[dt.datetime], status: DagsterRunStatus | None = None
) -> list[str]:
    """Copies of a finished run, one per ``finished_at`` (aware UTC), with all its tags and events.

    Every timestamp of the copy is moved by the same amount (the template's end -> ``finished_at``);
    ``status`` replaces the run's status (in its column and its serialized body), not its events.
    The serialized events keep the template's timestamps: Dagster filters and deletes by the columns.
    """
    run_ids = [str(uuid.uuid4()) for _ in finished_at]
    meta = MetaData()
    runs, tags, events = (Table(name, meta, autoload_with=dagster_db) for name in ("runs", "run_tags", "event_logs"))
    with dagster_db.begin() as conn:
        template = conn.execute(select(runs).where(runs.c.run_id == template_run_id)).mappings().one()
        end = dt.datetime.fromtimestamp(template["end_time"], dt.UTC)
        conn.execute(text("CREATE TEMP TABLE clones (run_id text, shift interval) ON COMMIT DROP"))
        conn.execute(
            text("INSERT INTO clones SELECT * FROM unnest(CAST(:ids AS text[]), CAST(:shifts AS interval[]))"),
            {"ids": run_ids, "shifts": [f"{(end - at).total_seconds()} seconds" for at in finished_at]},
        )
        clones = Table("clones", meta, autoload_with=conn)
        old_status = template["status"]
        new_status = status.value if status else old_status
        body = func.replace(
            func.replace(runs.c.run_body, template_run_id, clones.c.run_id),
            f"DagsterRunStatus.{old_status}", f"DagsterRunStatus.{new_status}",
        )
        seconds = func.extract("epoch", clones.c.shift)
        moved = {
            "run_id": clones.c.run_id, "run_body": body, "status": literal(new_status),
            "create_timestamp": runs.c.create_timestamp - clones.c.shift,
            "update_timestamp": runs.c.update_timestamp - clones.c.shift,
            "start_time": runs.c.start_time - seconds, "end_time": runs.c.end_time - seconds,
        }
        columns = [c.name for c in runs.columns if c.name != "id"]
        conn.execute(insert(runs).from_select(
            columns,
            select(*(moved.get(c, runs.c[c]) for c in columns)).select_from(runs.join(clones, true()))
            .where(runs.c.run_id == template_run_id),
        ))
        conn.execute(insert(tags).from_select(
            ["run_id", "key", "value"],
            select(clones.c.run_id, tags.c.key, tags.c.value).select_from(tags.join(clones, true()))
            .where(tags.c.run_id == template_run_id),
        ))
        conn.execute(insert(events).from_select(
            ["run_id", "event", "dagster_event_type", "timestamp", "step_key", "asset_key", "partition"],
            select(
                clones.c.run_id, func.replace(events.c.event, template_run_id, clones.c.run_id),
                events.c.dagster_event_type, events.c.timestamp - clones.c.shift, events.c.step_key,
                events.c.asset_key, events.c.partition,
            ).select_from(events.join(clones, true())).where(events.c.run_id == template_run_id),
        ))
    return run_ids


def _gitlab_job(env: dict[str, str], workdir: Path) -> subprocess.Popen:
    """stale_runner_machines_cleanup from the CLI on the same instance: its events land while the prune deletes."""
    config = workdir / "stale.yaml"
    config.write_text(
        "ops: {find_stale_runner_machines: {config: {sub_batch_size: 1000, max_deletions: 100000}}}\n"
    )
    return subprocess.Popen(
        [Path(sys.executable).parent / "dagster", "job", "execute", "-m", "ci_cleanup", "-j",
         "stale_runner_machines_cleanup", "-c", str(config)],
        env={**os.environ, **env}, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


def _stale_machines(gitlab_db: Engine, count: int) -> None:
    with gitlab_db.begin() as conn:
        conn.execute(text(
            "INSERT INTO ci_runner_machines (runner_id, system_xid, runner_type, created_at, updated_at)"
            " SELECT 1, 'bench' || g || '-' || md5(random()::text), 1 + g % 3, now() - interval '30 days', now()"
            " FROM generate_series(1, :n) g"
        ), {"n": count})


def _count(engine: Engine, sql: str) -> int:
    with engine.connect() as conn:
        return conn.scalar(text(sql))


def _prune_beside_gitlab_job(
    stack_env: dict[str, str], workdir: Path, resources: dict, instance: DagsterInstance, figures: dict[str, float]
) -> dict:
    """The prune in this process while the GitLab job runs in its own; its times in ``figures``, the prune's totals
    returned (its report op's metadata)."""
    from ci_cleanup.batches import BY_NAME
    from ci_cleanup.prune_dagster_history.job import prune_dagster_history

    gitlab_started = time.monotonic()
    beside = _gitlab_job(stack_env, workdir)
    gitlab_ended = []  # when the GitLab job's process exits, seen by a thread while the prune runs here
    waiter = threading.Thread(target=lambda: gitlab_ended.append((beside.wait(), time.monotonic())))
    waiter.start()
    started = time.monotonic()
    result = prune_dagster_history.execute_in_process(resources=resources, instance=instance)
    prune_ended = time.monotonic()
    figures["prune_s"] = prune_ended - started
    waiter.join()
    gitlab_returncode, ended = gitlab_ended[0]
    figures["gitlab_job_beside_s"] = ended - gitlab_started
    figures["gitlab_job_ended_before_prune"] = float(ended < prune_ended)
    if gitlab_returncode != 0:
        raise RuntimeError(f"stale_runner_machines_cleanup failed beside the prune: {beside.stderr.read()[-2000:]}")
    report_op = BY_NAME["prune_dagster_history"].report_op
    return next(
        e.step_output_data.metadata for e in result.all_events
        if e.event_type_value == "STEP_OUTPUT" and e.step_key == report_op
    )


def bench(stack_env: dict[str, str], workdir: Path, runs: int, machines: int) -> dict[str, float]:
    from ci_cleanup.stale_runner_machines_cleanup.job import stale_runner_machines_cleanup

    gitlab_db = create_engine(stack_env["CI_CLEANUP_DATABASE_URL"])
    dagster_db = create_engine(stack_env["CI_CLEANUP_DAGSTER_PG_URL"])
    create_schema(gitlab_db)
    home = Path(stack_env["DAGSTER_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(DAGSTER_YAML, home / "dagster.yaml")
    os.environ.update(stack_env)
    resources = {
        "gitlab_db": GitLabDatabase(url=stack_env["CI_CLEANUP_DATABASE_URL"]),
        "gitlab_redis": GitLabRedis(url=stack_env["CI_CLEANUP_REDIS_URL"]), "run_options": RunOptions(),
    }
    figures: dict[str, float] = {"runs": runs}
    with DagsterInstance.from_config(str(home)) as instance:
        _stale_machines(gitlab_db, 250)
        template = stale_runner_machines_cleanup.execute_in_process(
            run_config={"ops": {"find_stale_runner_machines": {"config": {"sub_batch_size": 50}}}},
            resources=resources, instance=instance,
        ).run_id
        now = utc_now()
        started = time.monotonic()
        clone_runs(dagster_db, template, [now - dt.timedelta(days=31 + 29 * i / runs) for i in range(runs)])
        figures["clone_s"] = time.monotonic() - started
        figures["events"] = _count(dagster_db, "SELECT count(*) FROM event_logs")

        _stale_machines(gitlab_db, machines)  # the GitLab job alone first: its time without the prune
        started = time.monotonic()
        alone = _gitlab_job(stack_env, workdir)
        if alone.wait() != 0:
            raise RuntimeError(f"stale_runner_machines_cleanup failed alone: {alone.stderr.read()[-2000:]}")
        figures["gitlab_job_alone_s"] = time.monotonic() - started

        _stale_machines(gitlab_db, machines)
        report = _prune_beside_gitlab_job(stack_env, workdir, resources, instance, figures)
        figures["runs_deleted"] = report["runs_deleted"].value
        figures["events_deleted"] = report["events_deleted"].value
        figures["runs_per_s"] = figures["runs_deleted"] / figures["prune_s"]
        figures["stale_machines_left"] = _count(gitlab_db, "SELECT count(*) FROM ci_runner_machines")
        figures["orphan_events"] = _count(
            dagster_db, "SELECT count(*) FROM event_logs WHERE run_id <> '' AND run_id NOT IN (SELECT run_id FROM runs)"
        )
    gitlab_db.dispose()
    dagster_db.dispose()
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ci_cleanup_dev.bench.prune", description=__doc__)
    parser.add_argument("--runs", type=int, default=10_000, help="old runs to delete")
    parser.add_argument("--machines", type=int, default=100_000, help="stale runner machines for the GitLab job")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="ci_cleanup_bench_prune_"))
    os.chmod(workdir, 0o755)  # pgserver's PostgreSQL runs as another user when we are root
    try:
        with EmbeddedStack(workdir / "stack") as stack:
            # A Dagster database of its own: the prune must not touch the dev stack's history.
            env = {**stack.env(), "DAGSTER_HOME": str(workdir / "dagster_home")}
            figures = bench(env, workdir, args.runs, args.machines)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    f = figures
    print(
        f"created {f['runs']:,} old runs ({f['events']:,} events) by copying rows in {f['clone_s']:.1f} s\n"
        f"prune_dagster_history: {f['runs_deleted']:,} runs and {f['events_deleted']:,} events deleted "
        f"in {f['prune_s']:.1f} s = {f['runs_per_s']:.0f} runs/s; orphan events left: {f['orphan_events']}\n"
        f"stale_runner_machines_cleanup ({args.machines:,} rows): {f['gitlab_job_alone_s']:.1f} s alone, "
        f"{f['gitlab_job_beside_s']:.1f} s beside the prune, "
        f"{'within' if f['gitlab_job_ended_before_prune'] else 'past'} the prune's {f['prune_s']:.1f} s "
        f"(succeeded; rows left {f['stale_machines_left']})"
    )


if __name__ == "__main__":
    main()
