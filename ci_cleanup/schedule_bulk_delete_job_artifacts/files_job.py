"""``Ci::DeleteObjectsWorker`` on Dagster: ``delete_expired_artifact_files`` drains ``ci_deleted_objects``, the
stored files of the artifacts the bulk delete removed (seed 004), local or in the artifacts' object store.

plan (schema, storages, due rows) -> remove files and rows in batches -> report (files, objects, rows left and why).
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from dagster import OpExecutionContext, op
from pydantic import Field

from ..batch import RunMode, Start, batch_job, find_process_report, finish, paced, start
from ..gitlab import object_storage
from ..gitlab.config_files import ENV_CONFIG_DIR
from ..gitlab.loop_helpers import Hooks
from ..gitlab.schema import FILE_STORE_REMOTE, utc_now
from ..resources import GitLabDatabase, RunOptions
from ..runs import MAX_IDS_REPORTED, ROWS_CHANGED, ROWS_WITH_ERRORS, BatchObserver, track_exception
from ..settings import BoundedConfig
from . import files
from .job import DELETED_OBJECTS
from .uses import FILES_USES

ARTIFACTS_ROOT_ENV = "CI_CLEANUP_ARTIFACTS_ROOT"
# The files job runs every 10 minutes: a run still going when the next is due is failed (and alerted) by
# run monitoring rather than left to hold the run queue.
FILES_MAX_RUNTIME_SECONDS = 10 * 60


class DeleteExpiredArtifactFilesConfig(BoundedConfig):
    artifacts_root: str | None = Field(
        default=None,
        description=f"Local artifacts storage (GitLab's artifacts path); default env {ARTIFACTS_ROOT_ENV}. "
        "Unset: local files are reported and left",
    )
    batch_size: int = Field(default=files.BATCH_SIZE, ge=1, le=1000, description="Rows per batch (GitLab's 100)")
    max_batches: int = Field(default=files.MAX_BATCHES, ge=1, le=10_000, description="Batches per run")
    object_store: bool = Field(
        default=True, description="Remove object-storage files through the artifacts' object store (gitlab.yml in "
        f"{ENV_CONFIG_DIR}, or {object_storage.ENV_PREFIX}*); false: leave those rows (the demo's, never the "
        "operator's store)",
    )


@dataclass(frozen=True)
class FilesPlan:
    start: Start
    root: str | None
    limits: files.Limits
    due_by_store: dict[int, int]
    object_store: dict  # what the run shows of the object store (no secret); empty: none configured
    object_storage_left: str  # why object-storage rows are left, or "" when the run removes them
    would: dict = field(default_factory=dict)  # dry run: what a run would remove, leave and refuse


def _object_store_left(store: object_storage.ObjectStore | None, wanted: bool) -> str:
    """One line: why this run leaves the object-storage rows ("" when it removes them)."""
    if not wanted:
        return "object_store is false in this run's config"
    if store is None:
        return (f"no object store is configured for artifacts (gitlab.yml in {ENV_CONFIG_DIR}, or "
                f"{object_storage.ENV_BUCKET})")
    if not store.supported:
        return f"object storage provider {store.provider or '(none)'!r} is not supported (only AWS and S3-compatible)"
    return ""


@contextmanager
def _storages(root: str | None, store: object_storage.ObjectStore | None) -> Iterator[files.Storages]:
    """The run's storages: the local root, and a client of the object store when its provider is supported."""
    if store is None or not store.supported:
        yield files.Storages(Path(root) if root else None)
        return
    with object_storage.S3Objects(store) as objects:
        yield files.Storages(Path(root) if root else None, objects)


@op
def plan_artifact_file_removal(
    context: OpExecutionContext, config: DeleteExpiredArtifactFilesConfig, gitlab_db: GitLabDatabase,
    run_options: RunOptions,
) -> FilesPlan:
    """Check the schema, the artifacts root and the object store, and count the due rows by storage."""
    schema = gitlab_db.schema
    root = config.artifacts_root or os.environ.get(ARTIFACTS_ROOT_ENV) or None
    if root is not None and not (os.path.isabs(root) and os.path.isdir(root)):
        # A wrong root would make every file look "already gone" and drop its row: refuse to start.
        raise ValueError(f"artifacts_root {root!r} is not an absolute path to an existing directory")
    # A bad gitlab.yml fails the run here, in one line, before anything is changed.
    store = object_storage.artifacts_object_store() if config.object_store else None
    begun = start(context, run_options)
    would = {}
    gitlab_tables = gitlab_db.require(FILES_USES)
    with gitlab_db.engine_for(schema.ci_deleted_objects).connect() as conn:
        due_by_store = files.count_due(conn, schema, utc_now())
        if begun.mode is RunMode.DRY_RUN:
            with _storages(root, store) as storages:
                preview = files.preview(conn, schema, storages, utc_now(), MAX_IDS_REPORTED)
            would = _would(preview)
    if begun.mode is RunMode.DRY_RUN:
        context.log.info("Counting the rows queued now: those schedule_bulk_delete_job_artifacts queues before the "
                         "next run are not in the would_… counts (its dry run queues nothing)")
    if root is None:
        context.log.warning(f"No artifacts root ({ARTIFACTS_ROOT_ENV} or artifacts_root): local files are left")
    left = _object_store_left(store, config.object_store)
    if left and due_by_store.get(FILE_STORE_REMOTE):
        context.log.warning(f"{due_by_store[FILE_STORE_REMOTE]} due rows in object storage are left: {left}")
    described = store.describe() if store is not None else {}
    context.add_output_metadata(
        {"due_count": sum(due_by_store.values()), "artifacts_root": root, "object_store": described or "none",
         **gitlab_tables, **begun.metadata}
    )
    limits = files.Limits(config.batch_size, config.max_batches)
    return FilesPlan(begun, root, limits, due_by_store, described, left, would)


# A dry run's names for _files_counts' keys, read as what a run would do to each row.
WOULD = {
    "removed": "would_remove_files", "missing": "would_drop_rows_of_missing_files",
    "objects_removed": "would_delete_objects", "objects_missing": "would_drop_rows_of_missing_objects",
    "objects_failed": "would_fail_objects",
    "object_storage": "would_leave_in_object_storage", "no_root": "would_leave_without_root",
    "refused": "would_refuse_count",
}


def _files_counts(batch: files.FilesBatch) -> dict:
    return {key: len(getattr(batch, key)) for key in WOULD}


def _would(preview: files.FilesBatch) -> dict:
    return {
        **{WOULD[k]: v for k, v in _files_counts(preview).items()},
        "would_delete_row_ids": preview.gone[:MAX_IDS_REPORTED],
        "would_delete_object_keys": preview.objects[:MAX_IDS_REPORTED],
        "object_storage_ids": preview.object_storage[:MAX_IDS_REPORTED],
        "refused": _ids_and_reasons(preview.refused),
        "objects_failures": _ids_and_reasons(preview.objects_failed),
    }


@dataclass(frozen=True)
class FilesRemoved:
    plan: FilesPlan
    result: files.FilesResult


@op
def remove_expired_artifact_files(
    context: OpExecutionContext, plan: FilesPlan, gitlab_db: GitLabDatabase
) -> FilesRemoved:
    """Remove the due files (local and in object storage) and their rows, 100 at a time, each batch observed on
    ci_deleted_objects. The object store's settings are read again here: its secrets never pass between ops."""
    if not plan.start.runs:
        return FilesRemoved(plan, files.FilesResult())

    def report_error(row_id: int, error: BaseException) -> None:
        track_exception(context, error, ci_deleted_object_id=row_id)

    store = object_storage.artifacts_object_store() if plan.object_store else None
    with (BatchObserver(context, DELETED_OBJECTS, keys=list(WOULD), brake=plan.start.brake) as observer,
          _storages(plan.root, store) as storages,
          paced(context, plan.start, gitlab_db, gitlab_db.schema.ci_deleted_objects)):
        return FilesRemoved(plan, files.delete_expired_artifact_files(
            gitlab_db.engine_for(gitlab_db.schema.ci_deleted_objects), gitlab_db.schema, storages, plan.limits,
            Hooks(lambda batch: observer.add(_files_counts(batch)), report_error, plan.start.brake),
        ))


def _ids_and_reasons(rows: list[tuple[int, str]]) -> list[str]:
    return [f"row {i}: {why}" for i, why in rows[:MAX_IDS_REPORTED]]


@op
def report_removed_artifact_files(context: OpExecutionContext, removed: FilesRemoved) -> None:
    """The run's totals: files and objects removed, rows left and why (a dry run's: what a run would remove, leave
    and refuse)."""
    plan, result = removed.plan, removed.result
    left = result.object_storage or plan.would.get(WOULD["object_storage"])  # a dry run's: would be left
    finish(
        context, plan.start,
        {
            ROWS_CHANGED: result.rows_deleted,
            "files_removed": result.removed,
            "files_missing": result.missing,
            "objects_removed": len(result.objects_removed),
            "objects_missing": len(result.objects_missing),
            "objects_failed": len(result.objects_failed),
            "object_storage_left": result.object_storage,
            "local_left_without_root": result.no_root,
            "refused_count": len(result.refused),
            ROWS_WITH_ERRORS: len(result.refused) + len(result.objects_failed),
            "refused": _ids_and_reasons(result.refused),
            "objects_removed_ids": result.objects_removed[:MAX_IDS_REPORTED],
            "objects_missing_ids": result.objects_missing[:MAX_IDS_REPORTED],
            "objects_failed_ids": [i for i, _ in result.objects_failed[:MAX_IDS_REPORTED]],
            "objects_failures": _ids_and_reasons(result.objects_failed),
            "object_storage_left_why": plan.object_storage_left if left else "",
            "batches": result.batches,
            "due_count": sum(plan.due_by_store.values()),
            "due_object_storage": plan.due_by_store.get(FILE_STORE_REMOTE, 0),
        },
        would=plan.would,
    )


delete_expired_artifact_files, delete_expired_artifact_files_schedule = batch_job(
    "delete_expired_artifact_files",
    find_process_report(plan_artifact_file_removal, remove_expired_artifact_files, report_removed_artifact_files),
    description="Remove the stored files of deleted artifacts (ci_deleted_objects, GitLab's Ci::DeleteObjectsWorker)",
    seed="004", max_runtime_seconds=FILES_MAX_RUNTIME_SECONDS, cron="*/10 * * * *",
)
