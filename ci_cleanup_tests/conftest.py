"""Real PostgreSQL and Redis for every test: the embedded stack, started once per session and stopped after."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from ci_cleanup.devstack import EmbeddedStack
from ci_cleanup.gitlab.schema import create_schema, gitlab_schema, truncate_all


@pytest.fixture(scope="session")
def servers_dir():
    """Where this session's embedded servers keep their data: not under pytest's ``/tmp/pytest-of-<user>``.

    As root, pgserver runs PostgreSQL as another user, which must traverse the data folder's parents;
    any other pytest run on the machine resets ``/tmp/pytest-of-root`` to 0700 and would stop it.
    """
    path = Path(tempfile.mkdtemp(prefix="ci_cleanup_tests_"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def stack(servers_dir):
    with EmbeddedStack(servers_dir / "stack") as stack:
        engine = create_engine(stack.url())
        create_schema(engine)
        engine.dispose()
        yield stack


@pytest.fixture(scope="session")
def _engine(stack):
    engine = create_engine(stack.url(), pool_size=5)
    yield engine
    engine.dispose()


@pytest.fixture
def engine(_engine):
    """The GitLab database, emptied before the test."""
    with _engine.begin() as conn:
        truncate_all(conn, gitlab_schema())
    return _engine


@pytest.fixture
def redis_client(stack):
    import redis

    client = redis.Redis.from_url(stack.redis_url)
    client.flushall()
    yield client
    client.close()


@contextlib.contextmanager
def scratch_database_of(stack):
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


@pytest.fixture
def scratch_database(stack):
    """A database of its own, for tests that break or reshape the schema; returns its URL."""
    with scratch_database_of(stack) as url:
        yield url
