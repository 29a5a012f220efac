"""``python -m ci_cleanup.bench.prune``: how fast prune_dagster_history deletes the history of 10 k old runs.

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
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from dagster import DagsterInstance, DagsterRunStatus
from sqlalchemy import MetaData, Table, create_engine, func, insert, literal, select, text, true
from sqlalchemy.engine import Engine

from ..devstack import REPO_ROOT, EmbeddedStack
from ..gitlab.schema import create_schema, utc_now
from ..resources import GitLabDatabase, GitLabRedis, RunOptions


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
        end = dt.datetime.fromtimestamp(template["end_time"], dt.timezone.utc)
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
