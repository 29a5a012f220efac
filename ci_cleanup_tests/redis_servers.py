"""Real Redis topologies for the store tests, from Debian's ``redis-server`` and ``redis-sentinel``: a Sentinel set
(one primary, one replica, three sentinels) and a three-master Redis Cluster, on 127.0.0.1 ports, their data in a
temporary folder removed afterwards. Each needs a password, as GitLab's reference architectures do.

Without the binaries the tests that need them skip, saying so; under ``CI=true`` they fail instead (``.ci/run``
installs the packages).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import redis

from ci_cleanup.gitlab.redis_stores import USES, resolve
from ci_cleanup.resources import close_client, store_client

MASTER_NAME = "gitlab-redis"
# Passwords the tests look for in every output: none may ever appear.
SENTINEL_SET_PASSWORD = "Pw-sentinelset-7Hq2"
SENTINELS_PASSWORD = "Pw-sentinels-4Kd9"
CLUSTER_PASSWORD = "Pw-cluster-9Zt5"
BINARIES = ("redis-server", "redis-sentinel", "redis-cli")
WAIT_SECONDS = 60  # for a server to answer, a failover to settle, a cluster to agree; a bound, never asserted


def require_binaries() -> None:
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if not missing:
        return
    reason = f"{', '.join(missing)} not installed (apt-get install redis-server redis-sentinel)"
    if os.environ.get("CI"):
        pytest.fail(f"{reason}: under CI these tests may not skip")
    pytest.skip(reason)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int, *, bus: bool = False) -> list[int]:
    """``count`` free ports; with ``bus``, each port + 10000 free too (a cluster node's bus port)."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port in ports or (bus and (port + 10000 > 65535 or not _bindable(port + 10000))):
            continue
        ports.append(port)
    return ports


def wait_until(what: str, check, seconds: float = WAIT_SECONDS):
    deadline = time.monotonic() + seconds
    while True:
        try:
            value = check()
        except (redis.RedisError, OSError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {seconds:.0f} s")
        time.sleep(0.1)


@dataclass
class Server:
    """One redis-server or redis-sentinel process and its config file."""

    binary: str
    port: int
    folder: Path
    lines: list[str]
    process: subprocess.Popen | None = None

    def start(self, password: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        conf = self.folder / "redis.conf"
        conf.write_text("\n".join([
            f"port {self.port}", "bind 127.0.0.1", "daemonize no", f"dir {self.folder}", 'save ""',
            "appendonly no", f"logfile {self.folder / 'log'}", *self.lines,
        ]) + "\n")
        self.process = subprocess.Popen([self.binary, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, password=password, socket_timeout=2)
        try:
            wait_until(f"{self.binary} on port {self.port}", client.ping)
        finally:
            client.close()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def _node_lines(password: str) -> list[str]:
    return [f"requirepass {password}", f"masterauth {password}"]


@dataclass
class SentinelSet:
    """A primary, its replica and three sentinels watching them (quorum 2), failing over within seconds."""

    folder: Path
    nodes: list[Server] = field(default_factory=list)
    sentinels: list[Server] = field(default_factory=list)

    def start(self) -> None:
        primary, replica, *sentinel_ports = free_ports(5)
        self.nodes = [Server("redis-server", port, self.folder / f"node{port}", _node_lines(SENTINEL_SET_PASSWORD))
                      for port in (primary, replica)]
        self.nodes[0].start(SENTINEL_SET_PASSWORD)
        self.nodes[1].lines.append(f"replicaof 127.0.0.1 {primary}")
        self.nodes[1].start(SENTINEL_SET_PASSWORD)
        self.sentinels = [
            Server("redis-sentinel", port, self.folder / f"sentinel{port}", [
                f"requirepass {SENTINELS_PASSWORD}",
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {primary} 2",
                f"sentinel auth-pass {MASTER_NAME} {SENTINEL_SET_PASSWORD}",
                f"sentinel down-after-milliseconds {MASTER_NAME} 1000",
                f"sentinel failover-timeout {MASTER_NAME} 3000",
                f"sentinel parallel-syncs {MASTER_NAME} 1",
            ])
            for port in sentinel_ports
        ]
        for sentinel in self.sentinels:
            sentinel.start(SENTINELS_PASSWORD)
        self.wait_healthy()

    def stop(self) -> None:
        for server in self.sentinels + self.nodes:
            server.stop()

    def _sentinel(self, server: Server) -> redis.Redis:
        return redis.Redis(port=server.port, password=SENTINELS_PASSWORD, socket_timeout=2, decode_responses=True)

    def _node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, password=SENTINEL_SET_PASSWORD, socket_timeout=2)

    def primary_port(self) -> int | None:
        """The primary every sentinel names, when they agree and it says it is one; else None."""
        named = set()
        for server in self.sentinels:
            client = self._sentinel(server)
            try:
                named.add(int(client.sentinel_get_master_addr_by_name(MASTER_NAME)[1]))
            finally:
                client.close()
        if len(named) != 1:
            return None
        port = named.pop()
        node = self._node(port)
        try:
            return port if node.info("replication")["role"] == "master" else None
        finally:
            node.close()

    def wait_healthy(self) -> int:
        """Until the sentinels agree on a primary whose replica is linked and caught up, and they see it; the
        primary's port."""

        def healthy():
            port = self.primary_port()
            if port is None:
                return None
            node = self._node(port)
            try:
                info = node.info("replication")
            finally:
                node.close()
            replicas = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
            if len(replicas) != 1 or replicas[0]["state"] != "online" or replicas[0]["offset"] != info[
                    "master_repl_offset"]:
                return None
            for server in self.sentinels:
                client = self._sentinel(server)
                try:
                    seen = client.sentinel_slaves(MASTER_NAME)
                    others = client.sentinel_master(MASTER_NAME)["num-other-sentinels"]
                finally:
                    client.close()
                linked = [r for r in seen if r["is_slave"] and not r["is_sdown"] and r["master-link-status"] == "ok"]
                if others != 2 or len(linked) != 1:
                    return None
            return port

        return wait_until("a healthy Sentinel set", healthy)

    def kill_primary(self) -> int:
        """SIGKILL the primary (no shutdown, no last save); its port."""
        port = self.wait_healthy() if self.primary_port() is None else self.primary_port()
        next(n for n in self.nodes if n.port == port).kill()
        return port

    def wait_promoted(self, old: int) -> int:
        return wait_until("a replica promoted", lambda: (p := self.primary_port()) is not None and p != old and p)

    def restore(self) -> int:
        """The killed node back, as the promoted primary's replica; the set healthy again. The primary's port."""
        primary = wait_until("a primary", self.primary_port)
        for node in self.nodes:
            if node.process is None or node.process.poll() is not None:
                node.lines = [line for line in node.lines if not line.startswith("replicaof")]
                node.lines.append(f"replicaof 127.0.0.1 {primary}")
                node.start(SENTINEL_SET_PASSWORD)
        return self.wait_healthy()

    def entry(self) -> dict:
        """As GitLab's files write it: the master name as the URL's host, the sentinels, their password."""
        return {
            "url": f"redis://:{SENTINEL_SET_PASSWORD}@{MASTER_NAME}/0",
            "sentinels": [{"host": "127.0.0.1", "port": s.port} for s in self.sentinels],
            "sentinel_password": SENTINELS_PASSWORD,
        }

    def env(self, prefix: str, db: int = 0) -> dict[str, str]:
        return {
            f"{prefix}_URL": f"redis://:{SENTINEL_SET_PASSWORD}@{MASTER_NAME}/{db}",
            f"{prefix}_SENTINELS": ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels),
            f"{prefix}_SENTINEL_PASSWORD": SENTINELS_PASSWORD,
        }

    def direct(self) -> redis.Redis:
        """A plain client of the current primary (as a GitLab process would reach it), for checks."""
        return self._node(self.wait_healthy())


@dataclass
class ClusterSet:
    """Three masters, every slot assigned (``redis-cli --cluster create``), no replicas."""

    folder: Path
    nodes: list[Server] = field(default_factory=list)

    def start(self) -> None:
        self.nodes = [
            Server("redis-server", port, self.folder / f"cluster{port}", [
                *_node_lines(CLUSTER_PASSWORD), "cluster-enabled yes", "cluster-config-file nodes.conf",
                "cluster-node-timeout 5000",
            ])
            for port in free_ports(3, bus=True)
        ]
        for node in self.nodes:
            node.start(CLUSTER_PASSWORD)
        subprocess.run(
            ["redis-cli", "-a", CLUSTER_PASSWORD, "--no-auth-warning", "--cluster", "create",
             *(f"127.0.0.1:{n.port}" for n in self.nodes), "--cluster-replicas", "0", "--cluster-yes"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

        def agreed():
            for node in self.nodes:
                client = redis.Redis(port=node.port, password=CLUSTER_PASSWORD, socket_timeout=2)
                try:
                    info = client.cluster("info")
                finally:
                    client.close()
                if info["cluster_state"] != "ok" or int(info["cluster_known_nodes"]) != 3:
                    return False
            return True

        wait_until("the cluster's nodes agreeing", agreed)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def entry(self) -> dict:
        return {"password": CLUSTER_PASSWORD, "cluster": [{"host": "127.0.0.1", "port": n.port} for n in self.nodes]}

    def env(self, prefix: str) -> dict[str, str]:
        return {f"{prefix}_CLUSTER": ",".join(f"127.0.0.1:{n.port}" for n in self.nodes),
                f"{prefix}_PASSWORD": CLUSTER_PASSWORD}

    def direct(self) -> redis.cluster.RedisCluster:
        return redis.cluster.RedisCluster(host="127.0.0.1", port=self.nodes[0].port, password=CLUSTER_PASSWORD)


# What each shape of RedisStores holds: every store on the embedded Redis, every store on the Sentinel set, or the
# leases on the cluster (GitLab.com's ClusterSharedState) and the other stores on the embedded Redis.
REDIS_SHAPES = ("embedded", "sentinel", "cluster")
# The (database layout, Redis shape) pairs a test that takes ``redis_stores`` runs on: both layouts (conftest's
# LAYOUTS) with the embedded Redis, one database with each other shape. The two are apart: not every pair.
LAYOUTS_AND_REDIS_SHAPES = (("direct", "embedded"), ("deployed", "embedded"), ("direct", "sentinel"),
                            ("direct", "cluster"))


def layouts_and_shapes_ids(params) -> list[str]:
    """Test ids for ``(layout, shape, *rest)`` params: the layout, or the Redis shape when it is not the embedded
    Redis, then the rest (``direct``, ``sentinel-drop_canceling_builds``)."""
    return ["-".join([layout if shape == REDIS_SHAPES[0] else shape, *rest]) for layout, shape, *rest in params]


@dataclass(frozen=True)
class RedisStores:
    """GitLab's Redis stores as a run is given them: :attr:`env`, its ``CI_CLEANUP_REDIS*`` variables (as an
    operator sets them), for one shape of :data:`REDIS_SHAPES`. ``db`` keeps apart runs that share the servers (a
    cluster has db 0 only: there each job's lease is a key of its own)."""

    shape: str
    redis_url: str  # the embedded Redis
    sentinel_set: SentinelSet | None = None
    cluster: ClusterSet | None = None
    db: int = 0

    @property
    def env(self) -> dict[str, str]:
        if self.shape == "sentinel":
            return self.sentinel_set.env("CI_CLEANUP_REDIS", self.db)
        embedded = {"CI_CLEANUP_REDIS_URL": f"{self.redis_url}?db={self.db}"}
        if self.shape == "cluster":
            return {**embedded, **self.cluster.env("CI_CLEANUP_REDIS_CLUSTER_SHARED_STATE")}
        return embedded

    def with_db(self, db: int) -> RedisStores:
        return replace(self, db=db)

    def client(self, use: str):
        """A client of the store of ``use`` (``leases``, ``artifact_buckets``, ``sidekiq_status``), resolved and
        connected as a run's :class:`~ci_cleanup.resources.GitLabRedis` does it."""
        return store_client(resolve(USES[use], self.env))

    @contextlib.contextmanager
    def clients(self):
        """A client of each store: ``leases``, and ``others`` (the buckets' and the Sidekiq statuses', one store in
        every shape); closed afterwards."""
        uses = {"leases": self.client("leases"), "others": self.client("artifact_buckets")}
        try:
            yield uses
        finally:
            for client in uses.values():
                close_client(client)

    def keys(self) -> set[bytes]:
        """Every key in the stores (on every master of the cluster: KEYS alone asks one node)."""
        with self.clients() as uses:
            return {key for client in uses.values() for key in client.keys(
                "*", **({"target_nodes": client.PRIMARIES} if isinstance(client, redis.cluster.RedisCluster) else {}))}

    def flush(self) -> None:
        """Every store emptied: this db of it, or every master of the cluster."""
        with self.clients() as uses:
            for client in uses.values():
                client.flushdb()


@pytest.fixture(scope="module")
def redis_topologies_dir():
    require_binaries()
    path = Path(tempfile.mkdtemp(prefix="ci_cleanup_redis_"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def sentinel_set(redis_topologies_dir):
    servers = SentinelSet(redis_topologies_dir / "sentinel_set")
    try:
        servers.start()
        yield servers
    finally:
        servers.stop()


@pytest.fixture(scope="module")
def redis_cluster(redis_topologies_dir):
    servers = ClusterSet(redis_topologies_dir / "cluster")
    try:
        servers.start()
        yield servers
    finally:
        servers.stop()
