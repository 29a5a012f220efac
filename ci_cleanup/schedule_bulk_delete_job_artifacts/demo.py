"""The demo dataset's rows for schedule_bulk_delete_job_artifacts and delete_expired_artifact_files
(``ci-cleanup demo``): some they must change, more they must not."""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import random
from pathlib import Path

import redis
from sqlalchemy import func, insert, literal, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Connection

from ..gitlab.schema import FILE_STORE_LOCAL, GitLabSchema, naive_utc


def seed(
    conn: Connection, queues: redis.Redis, schema: GitLabSchema, rng: random.Random, now: dt.datetime
) -> None:
    """schedule_bulk_delete_job_artifacts: the feature flag on, 300 expired unlocked artifacts over 40 projects
    (to delete), and traces, locked, unknown-lock, never-expiring and not-yet-expired ones it must keep.
    delete_expired_artifact_files: stored files of earlier deletions, due and not yet due, local and remote."""
    # The flag may be on already (a second demo on the same data): seeding adds rows, never fails.
    stamp = dict(created_at=naive_utc(now), updated_at=naive_utc(now))
    conn.execute(pg_insert(schema.features).on_conflict_do_nothing(), [dict(key="bulk_delete_job_artifacts", **stamp)])
    conn.execute(
        pg_insert(schema.feature_gates).on_conflict_do_nothing(),
        [dict(feature_key="bulk_delete_job_artifacts", key="boolean", value="true", **stamp)],
    )
    first_job = 1 + conn.scalar(select(func.coalesce(func.max(schema.ci_job_artifacts.c.job_id), 5000)))
    kinds = ["expired"] * 300 + ["trace", "locked", "unknown", "never_expires", "not_yet_expired"] * 12
    rows = []
    for i, kind in enumerate(kinds):
        created = now - dt.timedelta(days=rng.randint(8, 90))
        expire_at = {"never_expires": None, "not_yet_expired": now + dt.timedelta(days=rng.randint(1, 30))}.get(
            kind, now - dt.timedelta(hours=rng.randint(1, 72))
        )
        rows.append(dict(
            partition_id=100 + i % 3, project_id=rng.randint(1, 40), job_id=first_job + i,
            file_type=3 if kind == "trace" else rng.choice([1, 2, 4]),
            size=rng.randint(1_000, 5_000_000), file="artifacts.zip", file_store=rng.choice([1, 2]),
            locked={"locked": 1, "unknown": 2}.get(kind, 0), expire_at=expire_at, created_at=created,
            updated_at=created,
        ))
    conn.execute(insert(schema.ci_job_artifacts), rows)
    conn.execute(insert(schema.ci_deleted_objects), [
        dict(file_store=store, store_dir=f"{i:02x}/{i + 16:02x}/demo/{i}", file="artifacts.zip",
             project_id=rng.randint(1, 40),
             pick_up_at=now + dt.timedelta(hours=-rng.randint(1, 24) if due else rng.randint(1, 24)))
        for i, (store, due) in enumerate([(1, True), (2, True), (1, False)] * 10)
    ])


def hashed_store_dir(project_id: int, created_at: dt.datetime, job_id: int, artifact_id: int) -> str:
    """Where GitLab keeps an artifact without a final path (``JobArtifactUploader#hashed_path``), as
    delete_expired_batch.sql records it."""
    digest = hashlib.sha256(str(project_id).encode()).hexdigest()
    day = created_at.astimezone(dt.UTC).strftime("%Y_%m_%d")
    return "/".join([digest[:2], digest[2:4], digest, day, str(job_id), str(artifact_id)])


def write_stored_files(conn: Connection, schema: GitLabSchema, root: Path) -> int:
    """The stored files of the demo's local artifacts and ``ci_deleted_objects`` rows, under ``root`` where GitLab
    keeps them, so that delete_expired_artifact_files has files to remove. Each is a sparse file of its artifact's
    size (no disk used); returns how many were written. The demo's artifacts have no final path."""
    a, queued = schema.ci_job_artifacts.c, schema.ci_deleted_objects.c
    artifacts = conn.execute(select(a.id, a.project_id, a.job_id, a.created_at, a.file, a.size).where(
        a.file_store == FILE_STORE_LOCAL, a.file_final_path.is_(None), a.file.is_not(None))).all()
    stored = [(hashed_store_dir(r.project_id, r.created_at, r.job_id, r.id), r.file, r.size) for r in artifacts]
    stored += conn.execute(select(queued.store_dir, queued.file, literal(0)).where(
        queued.file_store == FILE_STORE_LOCAL)).all()
    for store_dir, file, size in stored:
        folder = root / store_dir
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / file, "wb") as f:
            os.truncate(f.fileno(), size or 0)
    return len(stored)
