"""A new operator's first hour with ``ci-cleanup``: which servers each command uses, what it refuses, what it prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import redis
from sqlalchemy import create_engine, inspect, text

from ci_cleanup.devstack import EmbeddedStack

from .test_code_location import _servers_of, clean_env

BIN = Path(sys.executable).parent


def cli(*args: str, data_dir: Path, cwd: Path | None = None, timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [BIN / "ci-cleanup", "--data-dir", str(data_dir), *args],
        env=clean_env(**env), capture_output=True, text=True, cwd=cwd, timeout=timeout,
    )


def tables_of(url: str) -> list[str]:
    engine = create_engine(url)
    try:
        return sorted(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_a_command_run_beside_a_running_stack_leaves_its_servers_running(servers_dir):
    """`make dev` holds the stack; any other command on the same folder uses it and must not stop it."""
    data_dir = servers_dir / "shared"
    with EmbeddedStack(data_dir) as running:
        done = cli("schema", "create", data_dir=data_dir)

        assert done.returncode == 0, done.stdout + done.stderr
        assert redis.Redis.from_url(running.redis_url).ping()
        assert tables_of(running.url())  # the command created the schema in the shared PostgreSQL, still up
    assert _servers_of(data_dir) == []  # and the stack's owner stopped both
