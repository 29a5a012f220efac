"""Real PostgreSQL and Redis for every test: the embedded stack, started once per session and stopped after;
and a real HTTP receiver for the alerts."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import redis
from sqlalchemy import create_engine

from ci_cleanup.alerts import WEBHOOK_ENV
from ci_cleanup.resources.run_options import THROTTLE_ENV

from .harness import Databases, DeployedStack, deployed_stack, gitlab_stack, reset, scratch_database_of
from .redis_servers import (  # noqa: F401  (fixtures: the Sentinel set and the cluster, for every module)
    LAYOUTS_AND_REDIS_SHAPES,
    REDIS_SHAPES,
    RedisStores,
    layouts_and_shapes_ids,
    redis_cluster,
    redis_topologies_dir,
    sentinel_set,
)

try:  # pytest 9; on pytest 8 pytest-xdist names the groups itself
    from _pytest.nodeid import coerce_node_id
except ImportError:
    coerce_node_id = None


@pytest.hookimpl(tryfirst=True)  # the marks added before pytest-xdist reads them (pytest 8)
def pytest_collection_modifyitems(config, items):
    """With ``--dist loadgroup`` (Makefile), the tests of an ``xdist_group`` run on one worker, which sets up their
    module's fixtures once: here a module's tests on a Sentinel set or a Redis Cluster are one group too.

    pytest-xdist (3.8) names a grouped test ``<node id>@<group>`` for its scheduler through ``item._nodeid``, which
    pytest 9 no longer reads (a node's id is ``item._id``), so every group was split over the workers: named here."""
    for item in items:
        shape = getattr(item, "callspec", None) and item.callspec.params.get("redis_shape")
        if shape in ("sentinel", "cluster"):
            item.add_marker(pytest.mark.xdist_group(f"redis_topologies:{item.module.__name__}"))
    if not getattr(config.option, "loadgroup", False):  # set on the workers of --dist loadgroup
        return
    for item in items:
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                         for m in item.iter_markers("xdist_group")})
        suffix = "@" + "_".join(groups)
        if groups and coerce_node_id and not item.nodeid.endswith(suffix):
            item._id = coerce_node_id(item.nodeid + suffix)


@pytest.fixture(autouse=True)
def unpaced(monkeypatch):
    """Runs at the batch sizes their test sets: the adaptive pacer (on by default) shortens a batch when this
    machine's load slows one, and a loaded CI machine is not what these tests assert. test_pacing's own overrides it."""
    monkeypatch.setenv(THROTTLE_ENV, "off")


@pytest.fixture(scope="session")
def servers_dir():
    """Where this session's embedded servers keep their data: not under pytest's ``/tmp/pytest-of-<user>``.

    As root, pgserver runs PostgreSQL as another user, which must traverse the data folder's parents;
    any other pytest run on the machine resets ``/tmp/pytest-of-root`` to 0700 and would stop it.
    """
    path = Path(tempfile.mkdtemp(prefix="ci_cleanup_tests_"))
    os.chmod(path, 0o755)
    # pgserver's exit handler, registered later and so run earlier, makes its lock folder again in the stack's
    # runtime folder (XDG_RUNTIME_DIR, inside this one) after the teardown below: removed once more at the very end.
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


LAYOUTS = ("direct", "deployed")


def pytest_generate_tests(metafunc):
    """Modules marked ``layouts`` run each test on one database and on GitLab as deployed (main + ci behind
    PgBouncer): the ``stack`` (and ``engine``) of each. A test that takes ``redis_stores`` runs on
    :data:`~redis_servers.LAYOUTS_AND_REDIS_SHAPES` (``stack`` and ``redis_shape``), unless it parametrizes
    them itself."""
    if not (metafunc.definition.get_closest_marker("layouts") and "stack" in metafunc.fixturenames):
        return
    if "redis_shape" not in metafunc.fixturenames:
        metafunc.parametrize("stack", LAYOUTS, indirect=True, scope="session")
    elif not any("stack" in m.args[0] for m in metafunc.definition.iter_markers("parametrize")):
        metafunc.parametrize(("stack", "redis_shape"), LAYOUTS_AND_REDIS_SHAPES, indirect=True, scope="session",
                             ids=layouts_and_shapes_ids(LAYOUTS_AND_REDIS_SHAPES))


@pytest.fixture(scope="session")
def embedded(servers_dir):
    """The embedded PostgreSQL and Redis, GitLab's tables in its one GitLab database."""
    with gitlab_stack(servers_dir / "stack") as stack:
        yield stack


@pytest.fixture(scope="session")
def deployed(embedded, servers_dir):
    """GitLab as deployed: main and ci databases behind Debian's PgBouncer (:class:`harness.DeployedStack`).
    Without pgbouncer installed it skips, except under CI, where it must not."""
    if shutil.which("pgbouncer") is None and not os.path.exists("/usr/sbin/pgbouncer"):
        if os.environ.get("CI") == "true":
            pytest.fail("pgbouncer is not installed: .ci/run installs Debian's pgbouncer")
        pytest.skip("pgbouncer is not installed (apt-get install pgbouncer)")
    with deployed_stack(embedded, servers_dir / "pgbouncer") as stack:
        yield stack


@pytest.fixture(scope="session")
def stack(request, embedded):
    """What a job runs against: the embedded stack, or (``layouts`` modules, ``deployed``) GitLab as deployed."""
    if getattr(request, "param", "direct") == "deployed":
        return request.getfixturevalue("deployed")
    return embedded


@pytest.fixture(scope="session")
def _engine(stack):
    """Direct connections to the GitLab database(s) of ``stack``: one engine, or main and ci's."""
    if isinstance(stack, DeployedStack):
        engine = Databases(create_engine(stack.direct_url(stack.MAIN), pool_size=5),
                           create_engine(stack.direct_url(stack.CI), pool_size=5))
    else:
        engine = create_engine(stack.url(), pool_size=5)
    yield engine
    engine.dispose()


@pytest.fixture
def engine(_engine):
    """The GitLab database, emptied before the test."""
    reset(_engine)
    return _engine


@pytest.fixture
def redis_client(stack):
    """The stack's Redis, every db flushed before the test."""
    client = redis.Redis.from_url(stack.redis_url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="session")
def redis_shape(request) -> str:
    """Which of :data:`redis_servers.REDIS_SHAPES` ``redis_stores`` is: the embedded Redis unless parametrized."""
    return getattr(request, "param", REDIS_SHAPES[0])


@pytest.fixture
def redis_stores(request, stack, redis_shape) -> RedisStores:
    """GitLab's Redis stores for the test's runs (:class:`redis_servers.RedisStores`), every one emptied: all on
    the stack's Redis, or (``redis_shape``) all on a Sentinel set, or the leases on a Redis Cluster."""
    stores = RedisStores(
        redis_shape, stack.redis_url,
        sentinel_set=request.getfixturevalue("sentinel_set") if redis_shape == "sentinel" else None,
        cluster=request.getfixturevalue("redis_cluster") if redis_shape == "cluster" else None,
    )
    stores.flush()
    return stores


@pytest.fixture
def scratch_database(embedded):
    """A database of its own, for tests that break or reshape the schema; returns its URL."""
    with scratch_database_of(embedded) as url:
        yield url


@pytest.fixture
def webhook(monkeypatch):
    """A local HTTP receiver; yields the list of JSON bodies it got."""
    received = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv(WEBHOOK_ENV, f"http://127.0.0.1:{server.server_port}/hook")
    yield received
    server.shutdown()
