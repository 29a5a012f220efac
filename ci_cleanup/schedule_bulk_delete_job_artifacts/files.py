"""The stored files of deleted artifacts: GitLab's ``Ci::DeleteObjectsService`` over ``ci_deleted_objects``.

Beyond ``Ci::BulkDeleteExpiredJobArtifactsWorker``, which only records the stored files: rows whose ``pick_up_at``
has passed are taken 100 at a time (``FOR UPDATE SKIP LOCKED``, each batch one transaction); a local file
(``file_store = 1``) is removed from ``<root>/<store_dir>/<file>``, an object (``file_store = 2``) from
``<prefix>/<store_dir>/<file>`` in the artifacts bucket (:mod:`ci_cleanup.gitlab.object_storage`), and the rows
whose file is gone are deleted. A file already gone counts as gone. A failure (a store's error, a path that would
leave the root or the prefix: ``..``, absolute, a symbolic link below the root) is reported and its row put off to
now + ``RETRY_IN``, as GitLab's service leaves it. Rows of a storage the run cannot reach (no root, no object store,
a provider not supported) are counted and left as they are. A dry run looks at each file instead.

Unlike GitLab's service, which claims a batch and removes its files outside any transaction, the batch's rows stay
locked while their files are removed: a run killed mid-batch changes no row (the next run finds those files gone).
The object store's part of a batch is bounded (``OBJECT_STORE_SECONDS``) so the transaction stays short.
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

from ..gitlab.loop_helpers import NO_HOOKS, Hooks, loop_until
from ..gitlab.object_storage import ObjectFailed, S3Objects
from ..gitlab.schema import FILE_STORE_LOCAL, GitLabSchema, utc_now
from ..gitlab.sql_files import SqlFile

BATCH_SIZE = 100  # GitLab's Ci::DeleteObjectsService::BATCH_SIZE
MAX_BATCHES = 500
RETRY_IN = dt.timedelta(minutes=10)  # GitLab's Ci::DeleteObjectsService::RETRY_IN
# A batch's object-store requests stop being started after this long (the keys left fail, retried after RETRY_IN):
# its rows are locked meanwhile, well under the idle_in_transaction_session_timeout GitLab's PostgreSQL may set (60 s).
OBJECT_STORE_SECONDS = 30


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
    removed: list[int] = field(default_factory=list)  # row ids whose local file was removed
    missing: list[int] = field(default_factory=list)  # local file already gone: the row goes too
    objects_removed: list[int] = field(default_factory=list)  # row ids whose object was deleted
    objects_missing: list[int] = field(default_factory=list)  # object already gone: the row goes too
    objects_failed: list[tuple[int, str]] = field(default_factory=list)  # (row id, why): retried after RETRY_IN
    refused: list[tuple[int, str]] = field(default_factory=list)  # (row id, why): local path unsafe or removal failed
    object_storage: list[int] = field(default_factory=list)  # left: no usable object store
    no_root: list[int] = field(default_factory=list)  # left: local, but no artifacts root configured
    objects: list[str] = field(default_factory=list)  # the keys deleted (a dry run: it would delete)

    @property
    def gone(self) -> list[int]:
        """The rows whose file is gone: the rows to delete."""
        return self.removed + self.missing + self.objects_removed + self.objects_missing

    @property
    def failed(self) -> list[int]:
        """The rows whose file could not be removed: retried later."""
        return [row_id for row_id, _ in self.refused + self.objects_failed]


@dataclass
class FilesResult:
    batches: int = 0
    removed: int = 0
    missing: int = 0
    object_storage: int = 0
    no_root: int = 0
    objects_removed: list[int] = field(default_factory=list)
    objects_missing: list[int] = field(default_factory=list)
    objects_failed: list[tuple[int, str]] = field(default_factory=list)
    refused: list[tuple[int, str]] = field(default_factory=list)

    @property
    def rows_deleted(self) -> int:
        return self.removed + self.missing + len(self.objects_removed) + len(self.objects_missing)

    def add(self, batch: FilesBatch) -> None:
        self.batches += 1
        self.removed += len(batch.removed)
        self.missing += len(batch.missing)
        self.object_storage += len(batch.object_storage)
        self.no_root += len(batch.no_root)
        self.objects_removed += batch.objects_removed
        self.objects_missing += batch.objects_missing
        self.objects_failed += batch.objects_failed
        self.refused += batch.refused


@dataclass(frozen=True)
class Storages:
    """Where a run reaches the files: the local root and the object store's client (None: those rows are left)."""

    root: Path | None = None
    objects: S3Objects | None = None


def _local_file(
    root: Path | None, obj, batch: FilesBatch, handle: Callable[[Path, str, str], None],
    report_error: Callable[[int, BaseException], None],
) -> None:
    """One local row's file, through ``handle`` (:func:`remove_file`, or :func:`find_file` in a dry run), sorted
    into ``batch``."""
    if root is None:
        batch.no_root.append(obj.id)
        return
    try:
        handle(root, obj.store_dir, obj.file)
    except FileNotFoundError:
        batch.missing.append(obj.id)
    except (UnsafePath, OSError) as e:
        report_error(obj.id, e)
        batch.refused.append((obj.id, str(e)))
    else:
        batch.removed.append(obj.id)


def object_key(objects: S3Objects, obj) -> str:
    """The row's key in the bucket, under the prefix: refused (UnsafePath) where ``..`` or an absolute part would
    take it elsewhere, as GitLab's ``check_path_traversal!`` refuses the file's name."""
    path_parts(obj.store_dir, obj.file)
    return objects.store.key(obj.store_dir, obj.file)


def _objects(
    objects: S3Objects | None, rows: list, batch: FilesBatch, report_error: Callable[[int, BaseException], None],
    *, dry_run: bool = False,
) -> None:
    """The batch's object-storage rows, all at once: deleted (a dry run: looked at), sorted into ``batch``."""
    if objects is None:
        batch.object_storage += [obj.id for obj in rows]
        return
    keyed = []
    for obj in rows:
        try:
            keyed.append((obj, object_key(objects, obj)))
        except UnsafePath as e:
            report_error(obj.id, e)
            batch.objects_failed.append((obj.id, str(e)))
    work = objects.exists if dry_run else objects.remove
    for (obj, key), outcome in zip(keyed, objects.map(work, [key for _, key in keyed], OBJECT_STORE_SECONDS)):
        if isinstance(outcome, ObjectFailed):
            report_error(obj.id, outcome)
            batch.objects_failed.append((obj.id, str(outcome)))
        elif outcome:
            batch.objects_removed.append(obj.id)
            batch.objects.append(key)
        else:
            batch.objects_missing.append(obj.id)


def _sort(storages: Storages, rows: list, batch: FilesBatch, report_error, *, dry_run: bool = False) -> None:
    """Each row's file removed (a dry run: looked at), local ones one by one, objects all at once."""
    handle = find_file if dry_run else remove_file
    for obj in rows:
        if obj.file_store == FILE_STORE_LOCAL:
            _local_file(storages.root, obj, batch, handle, report_error)
    remote = [obj for obj in rows if obj.file_store != FILE_STORE_LOCAL]
    if remote:
        _objects(storages.objects, remote, batch, report_error, dry_run=dry_run)


NEXT_DUE = SqlFile(__package__, "next_due_deleted_objects.sql")
PREVIEW_DUE = SqlFile(__package__, "preview_due_deleted_objects.sql")
DELETE_REMOVED = SqlFile(__package__, "delete_removed_deleted_objects.sql")
RETRY_LATER = SqlFile(__package__, "retry_deleted_objects_later.sql")
COUNT_DUE = SqlFile(__package__, "count_due_deleted_objects.sql")
FIRST_PAGE = ("-infinity", 0)  # before every (pick_up_at, id)


def destroy_batch(
    conn: Connection, schema: GitLabSchema, storages: Storages, now: dt.datetime, after: tuple[str, int],
    batch_size: int, report_error: Callable[[int, BaseException], None],
) -> tuple[FilesBatch, tuple[str, int] | None]:
    """One transaction: lock the next due rows after the page key ``after``, remove their files, delete the rows
    whose file is gone and put off those whose removal failed. Returns the batch and the page key to continue after
    (None when no row was left to take)."""
    batch = FilesBatch()
    with conn.begin():
        page = {"now": now, "after_pick_up_at": after[0], "after_id": after[1], "limit": batch_size}
        objects = conn.execute(NEXT_DUE.on(schema, conn.dialect), page).all()
        if not objects:
            return batch, None
        _sort(storages, objects, batch, report_error)
        if batch.gone:
            conn.execute(DELETE_REMOVED.on(schema, conn.dialect), {"ids": batch.gone})
        if batch.failed:
            conn.execute(RETRY_LATER.on(schema, conn.dialect), {"ids": batch.failed, "retry_at": utc_now() + RETRY_IN})
    last = objects[-1]
    return batch, (last.pick_up_at, last.id)


def count_due(conn: Connection, schema: GitLabSchema, now: dt.datetime) -> dict[int, int]:
    """Due rows per ``file_store`` (dry run and planning)."""
    return dict(conn.execute(COUNT_DUE.on(schema, conn.dialect), {"now": now}).all())


def preview(conn: Connection, schema: GitLabSchema, storages: Storages, now: dt.datetime, limit: int) -> FilesBatch:
    """Dry run: what a run would do with the first ``limit`` due rows, touching nothing (objects are only looked
    at; a bucket that cannot be reached fails them all, as it would fail their DELETEs)."""
    batch = FilesBatch()
    rows = conn.execute(PREVIEW_DUE.on(schema, conn.dialect), {"now": now, "limit": limit}).all()
    remote = [obj for obj in rows if obj.file_store != FILE_STORE_LOCAL]
    if remote and storages.objects is not None:
        try:
            storages.objects.check_bucket()
        except ObjectFailed as e:
            batch.objects_failed += [(obj.id, str(e)) for obj in remote]
            rows = [obj for obj in rows if obj.file_store == FILE_STORE_LOCAL]
    _sort(storages, rows, batch, lambda row_id, error: None, dry_run=True)
    return batch


@dataclass(frozen=True)
class Limits:
    batch_size: int = BATCH_SIZE
    max_batches: int = MAX_BATCHES


DEFAULT_LIMITS = Limits()  # GitLab's


def delete_expired_artifact_files(
    engine: Engine, schema: GitLabSchema, storages: Storages, limits: Limits = DEFAULT_LIMITS,
    hooks: Hooks = NO_HOOKS,
) -> FilesResult:
    """Drain the due rows, batch after batch, until none is left or ``max_batches`` is reached, on the run's one
    connection. Not an autocommit one: a batch is a transaction of several statements (its rows stay locked while
    their files are removed). ``hooks.on_batch`` gets each batch."""
    result = FilesResult()
    started = hooks.now()  # one cut-off for the run, so paging by pick_up_at ends
    after: tuple[str, int] | None = FIRST_PAGE

    def batch() -> bool:
        nonlocal after
        done, after = destroy_batch(
            conn, schema, storages, started, after, hooks.batch_size(limits.batch_size), hooks.report_error)
        if after is None:
            return False
        result.add(done)
        hooks.on_batch(done)
        return True

    with engine.connect() as conn:
        loop_until(batch, limit=limits.max_batches, brake=hooks.brake)
    return result
