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

from sqlalchemy.engine import Connection, Engine

from ..gitlab.loop_helpers import Brake, loop_until
from ..gitlab.schema import FILE_STORE_LOCAL, GitLabSchema, utc_now
from ..gitlab.sql_files import SqlFile

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


NEXT_DUE = SqlFile(__package__, "next_due_deleted_objects.sql")
PREVIEW_DUE = SqlFile(__package__, "preview_due_deleted_objects.sql")
DELETE_REMOVED = SqlFile(__package__, "delete_removed_deleted_objects.sql")
COUNT_DUE = SqlFile(__package__, "count_due_deleted_objects.sql")
FIRST_PAGE = ("-infinity", 0)  # before every (pick_up_at, id)


def destroy_batch(
    conn: Connection, schema: GitLabSchema, root: Path | None, now: dt.datetime, after: tuple[str, int],
    batch_size: int, report_error: Callable[[int, BaseException], None],
) -> tuple[FilesBatch, tuple[str, int] | None]:
    """One transaction: lock the next due rows after the page key ``after``, remove their files, delete the rows
    whose file is gone. Returns the batch and the page key to continue after (None when no row was left to take)."""
    batch = FilesBatch()
    with conn.begin():
        page = {"now": now, "after_pick_up_at": after[0], "after_id": after[1], "limit": batch_size}
        objects = conn.execute(NEXT_DUE.on(schema, conn.dialect), page).all()
        if not objects:
            return batch, None
        gone = [obj.id for obj in objects if _file_of(root, obj, batch, remove_file, report_error)]
        if gone:
            conn.execute(DELETE_REMOVED.on(schema, conn.dialect), {"ids": gone})
    last = objects[-1]
    return batch, (last.pick_up_at, last.id)


def count_due(conn: Connection, schema: GitLabSchema, now: dt.datetime) -> dict[int, int]:
    """Due rows per ``file_store`` (dry run and planning)."""
    return dict(conn.execute(COUNT_DUE.on(schema, conn.dialect), {"now": now}).all())


def preview(conn: Connection, schema: GitLabSchema, root: Path | None, now: dt.datetime, limit: int) -> FilesBatch:
    """Dry run: what a run would do with the first ``limit`` due rows, touching nothing."""
    batch = FilesBatch()
    for obj in conn.execute(PREVIEW_DUE.on(schema, conn.dialect), {"now": now, "limit": limit}):
        _file_of(root, obj, batch, find_file, lambda row_id, error: None)
    return batch


def delete_expired_artifact_files(
    engine: Engine,
    schema: GitLabSchema,
    root: Path | None,
    *,
    batch_size: int = BATCH_SIZE,
    max_batches: int = MAX_BATCHES,
    brake: Brake | None = None,
    on_batch: Callable[[FilesBatch], None] = lambda batch: None,
    report_error: Callable[[int, BaseException], None] = lambda row_id, error: None,
) -> FilesResult:
    """Drain the due rows, batch after batch, until none is left or ``max_batches`` is reached, on the run's one
    connection. Not an autocommit one: a batch is a transaction of several statements (its rows stay locked while
    their files are removed)."""
    result = FilesResult()
    started = utc_now()  # one cut-off for the run, so paging by pick_up_at ends
    after: tuple[str, int] | None = FIRST_PAGE

    def batch() -> bool:
        nonlocal after
        done, after = destroy_batch(conn, schema, root, started, after, batch_size, report_error)
        if after is None:
            return False
        result.add(done)
        on_batch(done)
        return True

    with engine.connect() as conn:
        loop_until(batch, limit=max_batches, brake=brake)
    return result
