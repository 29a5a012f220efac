"""What the tests share: an embedded stack with GitLab's tables, resetting it, scratch databases, and the
processes of ``ci-cleanup dev`` (its port, its servers, its UI coming up)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from ci_cleanup.devstack import EmbeddedStack
from ci_cleanup.gitlab.schema import create_schema, gitlab_schema, truncate_all


@contextlib.contextmanager
def gitlab_stack(data_dir: Path) -> Iterator[EmbeddedStack]:
    """An embedded stack in ``data_dir`` whose GitLab database has GitLab's tables; stopped afterwards."""
    with EmbeddedStack(data_dir) as stack:
        gitlab_database(stack.url()).dispose()
        yield stack


def gitlab_database(url: str, *statements: str) -> Engine:
    """An engine on ``url`` whose database has GitLab's tables, after ``statements`` (to break or fill it)."""
    engine = create_engine(url)
    create_schema(engine)
    with engine.begin() as conn:
        for statement in statements:
            conn.execute(text(statement))
    return engine


def reset(engine: Engine, redis_client=None, *, also: tuple[str, ...] = ()) -> None:
    """Every GitLab table emptied (with ``also``), and the client's Redis db flushed (that db only: tests and
    series that use other dbs of the same server flush their own)."""
    with engine.begin() as conn:
        truncate_all(conn, gitlab_schema(), also=also)
    if redis_client is not None:
        redis_client.flushdb()


@contextlib.contextmanager
def scratch_database_of(stack: EmbeddedStack) -> Iterator[str]:
    """A database of its own on ``stack``, dropped afterwards; yields its URL."""
    name = f"scratch_{uuid.uuid4().hex[:12]}"
    admin = create_engine(stack.url("postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield stack.url(name)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
        admin.dispose()


def clean_env(**extra) -> dict[str, str]:
    """The process environment without any ci_cleanup or Dagster setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CI_CLEANUP_", "DAGSTER_"))}
    return {**env, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servers_of(data_dir: Path) -> list:
    """PostgreSQL processes of the stack in ``data_dir``, and its Redis if its socket still answers."""
    procs = [p for p in psutil.process_iter(["cmdline"]) if str(data_dir) in " ".join(p.info["cmdline"] or [])]
    settings = data_dir / "redis" / "dump.rdb.settings"
    if settings.exists():
        try:
            redis.Redis(unix_socket_path=json.loads(settings.read_text())["unixsocket"]).ping()
            procs.append("redis")
        except (redis.ConnectionError, FileNotFoundError):
            pass
    return procs


def wait_for_ui(base_url: str, process: subprocess.Popen, seconds: float = 180) -> None:
    """Until the Dagster webserver at ``base_url`` answers; fails with the process's output if it exits first."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(base_url + "/server_info", timeout=2)
            return
        except OSError:
            assert process.poll() is None, process.stdout.read()[-3000:]
            assert time.monotonic() < deadline, f"the UI did not come up in {seconds:.0f} s"
            time.sleep(1)
