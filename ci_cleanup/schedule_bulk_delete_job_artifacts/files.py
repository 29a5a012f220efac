"""The stored files of deleted artifacts: GitLab's ``Ci::DeleteObjectsService`` over ``ci_deleted_objects``.

Beyond ``Ci::BulkDeleteExpiredJobArtifactsWorker``, which only records the stored files: rows whose
``pick_up_at`` has passed are taken 100 at a time (``FOR UPDATE SKIP LOCKED``, each batch one
transaction); a local file (``file_store = 1``) is removed from ``<root>/<store_dir>/<file>`` and its
row deleted. A file already gone counts as removed. Object-storage rows (``file_store = 2``) need a
storage backend: they are counted and left. A path that would leave the root (``..``, absolute, or
through a symbolic link anywhere below the root), or a local row with no root configured, is
reported and left, never guessed at. A dry run takes the same path, looking at each file instead.
"""

from __future__ import annotations

import datetime as dt
import errno
import os
import posixpath
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import ColumnElement, Select, Text, cast, delete, func, select, tuple_
from sqlalchemy.engine import Connection, Engine

from ..gitlab.schema import FILE_STORE_LOCAL, GitLabSchema, utc_now

BATCH_SIZE = 100  # GitLab's Ci::DeleteObjectsService::BATCH_SIZE
MAX_BATCHES = 500


class UnsafePath(ValueError):
    """A ``ci_deleted_objects`` row whose path would leave the artifacts root."""


def path_parts(store_dir: str, file: str) -> list[str]:
    """The folders of ``<store_dir>``, refusing absolute parts and ``..`` (a bad row must not delete elsewhere)."""
    if not file or "/" in file or file in (".", ".."):
        raise UnsafePath(f"file {file!r} is not a plain file name")
    if posixpath.isabs(store_dir) or ".." in store_dir.split("/"):
        raise UnsafePath(f"store_dir {store_dir!r} leaves the artifacts root")
    return [part for part in store_dir.split("/") if part not in ("", ".")]


@contextmanager
def folder_of(root: Path, store_dir: str, file: str) -> Iterator[int]:
    """A descriptor of ``<root>/<store_dir>``, opened folder by folder with ``O_NOFOLLOW``.

    The text of a path says nothing of where it leads: ``root/evil -> /elsewhere`` (or ``ab`` of a hashed
    path made a link) would take an unlink outside the root. No symbolic link below the root is followed;
    the root itself may be one (a mount moved elsewhere). A missing folder raises FileNotFoundError.
    """
    parts = path_parts(store_dir, file)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for depth, part in enumerate(parts):
            try:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(part, fd):
                    link = "/".join(parts[: depth + 1])
                    raise UnsafePath(f"{link!r} is a symbolic link: it may leave the artifacts root") from None
                raise
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def remove_file(root: Path, store_dir: str, file: str) -> None:
    """Unlink ``<root>/<store_dir>/<file>`` without following any link below the root (FileNotFoundError if gone)."""
    with _stored_file(root, store_dir, file) as fd:
        os.unlink(file, dir_fd=fd)


def find_file(root: Path, store_dir: str, file: str) -> None:
    """:func:`remove_file` touching nothing (a dry run): FileNotFoundError if gone, UnsafePath if it would refuse."""
    with _stored_file(root, store_dir, file) as fd:
        os.stat(file, dir_fd=fd, follow_symlinks=False)


@contextmanager
def _stored_file(root: Path, store_dir: str, file: str) -> Iterator[int]:
    """The folder of a stored file (:func:`folder_of`), refusing a file that is a symbolic link."""
    with folder_of(root, store_dir, file) as fd:
        if _is_link(file, fd):  # the link itself would go, but a row naming a link is not GitLab's
            raise UnsafePath(f"{store_dir}/{file} is a symbolic link, not a stored file")
        yield fd


def due(schema: GitLabSchema, now: dt.datetime) -> ColumnElement[bool]:
    """``Ci::DeletedObject.ready_for_destruction``: ``pick_up_at < now``."""
    return schema.ci_deleted_objects.c.pick_up_at < now


@dataclass
class FilesBatch:
    removed: list[int] = field(default_factory=list)  # row ids whose file was removed
    missing: list[int] = field(default_factory=list)  # file already gone: counts as removed
    object_storage: list[int] = field(default_factory=list)  # left for a storage backend
    no_root: list[int] = field(default_factory=list)  # local, but no artifacts root configured
    refused: list[tuple[int, str]] = field(default_factory=list)  # (row id, why): path unsafe or removal failed

    @property
    def rows_deleted(self) -> int:
        return len(self.removed) + len(self.missing)


@dataclass
class FilesResult:
    batches: int = 0
    removed: int = 0
    missing: int = 0
    object_storage: int = 0
    no_root: int = 0
    refused: list[tuple[int, str]] = field(default_factory=list)

    @property
    def rows_deleted(self) -> int:
        return self.removed + self.missing

    def add(self, batch: FilesBatch) -> None:
        self.batches += 1
        self.removed += len(batch.removed)
        self.missing += len(batch.missing)
        self.object_storage += len(batch.object_storage)
        self.no_root += len(batch.no_root)
        self.refused += batch.refused


def _file_of(
    root: Path | None, obj, batch: FilesBatch, handle: Callable[[Path, str, str], None],
    report_error: Callable[[int, BaseException], None],
) -> bool:
    """One row's file, through ``handle`` (:func:`remove_file`, or :func:`find_file` in a dry run), sorted into
    ``batch``; True when the row may go."""
    if obj.file_store != FILE_STORE_LOCAL:
        batch.object_storage.append(obj.id)
        return False
    if root is None:
        batch.no_root.append(obj.id)
        return False
    try:
        handle(root, obj.store_dir, obj.file)
    except FileNotFoundError:
        batch.missing.append(obj.id)
        return True
    except (UnsafePath, OSError) as e:
        report_error(obj.id, e)
        batch.refused.append((obj.id, str(e)))
        return False
    batch.removed.append(obj.id)
    return True


def due_query(schema: GitLabSchema, now: dt.datetime, limit: int) -> Select:
    """The first ``limit`` due rows, oldest ``pick_up_at`` first.

    pick_up_at comes as PostgreSQL's text: a row GitLab wrote with a year-1 or BC pick_up_at has no
    Python datetime, and must not stop every run.
    """
    d = schema.ci_deleted_objects
    pick_up_at = cast(d.c.pick_up_at, Text).label("pick_up_at")
    return (
        select(d.c.id, d.c.file_store, d.c.store_dir, d.c.file, pick_up_at)
        .where(due(schema, now)).order_by(d.c.pick_up_at, d.c.id).limit(limit)
    )


def destroy_batch(
    engine: Engine, schema: GitLabSchema, root: Path | None, now: dt.datetime, after: tuple | None, batch_size: int,
    report_error: Callable[[int, BaseException], None],
) -> tuple[FilesBatch, tuple | None]:
    """One transaction: lock the next due rows, remove their files, delete the rows whose file is gone.

    Rows are paged by ``(pick_up_at, id)`` so a row that is left is not taken again in the same run.
    Returns the batch and the page key to continue after (None when no row was left to take).
    """
    d = schema.ci_deleted_objects
    query = due_query(schema, now, batch_size).with_for_update(skip_locked=True)
    if after is not None:
        query = query.where(tuple_(d.c.pick_up_at, d.c.id) > after)
    batch = FilesBatch()
    with engine.begin() as conn:
        objects = conn.execute(query).all()
        if not objects:
            return batch, None
        gone = [obj.id for obj in objects if _file_of(root, obj, batch, remove_file, report_error)]
        if gone:
            conn.execute(delete(d).where(d.c.id.in_(gone)))
    last = objects[-1]
    return batch, (last.pick_up_at, last.id)


def count_due(conn: Connection, schema: GitLabSchema, now: dt.datetime) -> dict[int, int]:
    """Due rows per ``file_store`` (dry run and planning)."""
    d = schema.ci_deleted_objects
    counts = select(d.c.file_store, func.count()).where(due(schema, now)).group_by(d.c.file_store)
    return dict(conn.execute(counts).all())


def preview(conn: Connection, schema: GitLabSchema, root: Path | None, now: dt.datetime, limit: int) -> FilesBatch:
    """Dry run: what a run would do with the first ``limit`` due rows, touching nothing."""
    batch = FilesBatch()
    for obj in conn.execute(due_query(schema, now, limit)):
        _file_of(root, obj, batch, find_file, lambda row_id, error: None)
    return batch


def delete_expired_artifact_files(
    engine: Engine,
    schema: GitLabSchema,
    root: Path | None,
    *,
    batch_size: int = BATCH_SIZE,
    max_batches: int = MAX_BATCHES,
    on_batch: Callable[[FilesBatch], None] = lambda batch: None,
    report_error: Callable[[int, BaseException], None] = lambda row_id, error: None,
    now: Callable[[], dt.datetime] = utc_now,
) -> FilesResult:
    """Drain the due rows, batch after batch, until none is left or ``max_batches`` is reached."""
    result = FilesResult()
    started = now()  # one cut-off for the run, so paging by pick_up_at ends
    after = None
    while result.batches < max_batches:
        batch, after = destroy_batch(engine, schema, root, started, after, batch_size, report_error)
        if after is None:
            return result
        result.add(batch)
        on_batch(batch)
    return result
