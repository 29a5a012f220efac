"""GitLab's Redis stores on real servers: the embedded Redis, a Sentinel set and a Redis Cluster
(:mod:`ci_cleanup_tests.redis_servers`).

Leases, buckets and Sidekiq statuses work alike on the three shapes and are seen by a GitLab-style client of the
same store; the cluster follows MOVED; a config folder alone runs the jobs on the stores GitLab uses; the primary
SIGKILLed mid-run leaves no lease without a TTL and no bucket lost, and the next run completes; no password shows.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import redis
import yaml
from dagster import DagsterInstance, build_init_resource_context
from sqlalchemy import func, insert, select

from ci_cleanup.drop_canceling_builds.job import LEASE_KEY as DROP_LEASE_KEY
from ci_cleanup.drop_canceling_builds.job import drop_canceling_builds
from ci_cleanup.environments_auto_stop.job import environments_auto_stop
from ci_cleanup.gitlab import artifact_buckets, sidekiq_status
from ci_cleanup.gitlab.config_files import database_urls
from ci_cleanup.gitlab.exclusive_lease import PREFIX, ExclusiveLease
from ci_cleanup.gitlab.redis_stores import parse_entry, resolve
from ci_cleanup.resources import GitLabDatabase, GitLabRedis, RunOptions, ServiceUnavailable, store_client
from ci_cleanup.schedule_bulk_delete_job_artifacts import service as bulk_service
from ci_cleanup.schedule_bulk_delete_job_artifacts.job import schedule_bulk_delete_job_artifacts
from ci_cleanup.stuck_export_jobs.job import stuck_export_jobs

from .factories import S, ago, create, naive_ago, row
from .harness import clean_env
from .redis_servers import CLUSTER_PASSWORD, MASTER_NAME, SENTINEL_SET_PASSWORD, SENTINELS_PASSWORD, wait_until
from .runner import failure_messages, op_metadata

# On one xdist worker (``--dist loadgroup``, Makefile): split over two, each would start its own Sentinel set and
# cluster, several seconds of CPU each.
pytestmark = pytest.mark.xdist_group("redis_stores")

SHAPES = ("plain", "sentinel", "cluster")
PASSWORDS = (SENTINEL_SET_PASSWORD, SENTINELS_PASSWORD, CLUSTER_PASSWORD)


@pytest.fixture(autouse=True)
def no_settings(monkeypatch):
    """No ci_cleanup setting from the outer environment: each test says where every store is."""
    for name in [n for n in os.environ if n.startswith("CI_CLEANUP_")]:
        monkeypatch.delenv(name)


@contextlib.contextmanager
def gitlab_redis(**fields):
    """The resource as a run sets it up (clients connected and checked), torn down afterwards."""
    resource, context = GitLabRedis(**fields), build_init_resource_context()
    resource.setup_for_execution(context)
    try:
        yield resource
    finally:
        resource.teardown_after_execution(context)


@pytest.fixture(params=SHAPES)
def shape(request, monkeypatch, stack, sentinel_set, redis_cluster):
    """Every store on one shape (the default store's variables); yields (shape, a GitLab-style direct client)."""
    if request.param == "plain":
        monkeypatch.setenv("CI_CLEANUP_REDIS_URL", stack.redis_url)
        direct = redis.Redis.from_url(stack.redis_url)
    elif request.param == "sentinel":
        for name, value in sentinel_set.env("CI_CLEANUP_REDIS").items():
            monkeypatch.setenv(name, value)
        direct = sentinel_set.direct()
    else:
        for name, value in redis_cluster.env("CI_CLEANUP_REDIS").items():
            monkeypatch.setenv(name, value)
        direct = redis_cluster.direct()
    direct.flushall()
    yield request.param, direct
    direct.flushall()
    direct.close()


def test_the_resource_says_which_shape_each_store_is(shape):
    name, _ = shape
    with gitlab_redis() as resource:
        where = resource.store_used("leases")["redis_leases"]
        assert type(resource.leases) is type(resource.artifact_buckets) is type(resource.sidekiq_status)
        assert resource.leases is resource.artifact_buckets is resource.sidekiq_status  # one server, one client
    expected_kind = {"plain": "(CI_CLEANUP_REDIS_URL)", "sentinel": "(CI_CLEANUP_REDIS_URL, Sentinel)",
                     "cluster": "(CI_CLEANUP_REDIS_CLUSTER, Cluster)"}[name]
    assert where.startswith(f"default: Redis {expected_kind} at ")
    assert [p for p in PASSWORDS if p in where] == []


def test_a_lease_is_taken_renewed_and_released(shape):
    _, direct = shape
    key = PREFIX + "ci_cleanup:test"
    with gitlab_redis() as resource:
        ours, theirs = ExclusiveLease(resource.leases, "ci_cleanup:test", 60), ExclusiveLease(
            resource.leases, "ci_cleanup:test", 60)
        assert ours.try_obtain() and not theirs.try_obtain()
        assert direct.get(key) == ours.uuid.encode() and 0 < direct.ttl(key) <= 60
        assert ExclusiveLease(resource.leases, "ci_cleanup:test", 600, uuid=ours.uuid).renew()
        assert 60 < direct.ttl(key) <= 600
        assert not theirs.renew() and not theirs.cancel() and direct.get(key) == ours.uuid.encode()
        assert ours.try_obtain()  # our own uuid already there: ours (a SET sent again after a lost reply)
        assert ours.cancel() and direct.exists(key) == 0


def test_a_lease_taken_by_the_job_is_seen_by_a_gitlab_style_set_nx_ex_and_the_reverse(shape):
    _, direct = shape
    key, gitlab_uuid = PREFIX + "ci/stuck_builds/drop_canceling_worker", str(uuid.uuid4())
    with gitlab_redis() as resource:
        ours = ExclusiveLease(resource.leases, "ci/stuck_builds/drop_canceling_worker", 1800)
        assert ours.try_obtain()
        assert direct.set(key, gitlab_uuid, nx=True, ex=1800) is None  # GitLab's worker: held
        assert ours.cancel()
        assert direct.set(key, gitlab_uuid, nx=True, ex=1800) is True  # GitLab's worker takes it
        assert not ours.try_obtain() and not ours.renew() and not ours.cancel()  # ours sees it held
        assert direct.get(key) == gitlab_uuid.encode() and 0 < direct.ttl(key) <= 1800


def test_buckets_are_scheduled_claimed_released_and_recovered(shape):
    _, direct = shape
    now = dt.datetime.now(dt.UTC)
    with gitlab_redis() as resource:
        client = resource.artifact_buckets
        assert artifact_buckets.schedule(client, 5, now).missing_count == 5
        assert artifact_buckets.claim(client, now, 3) == 3
        assert artifact_buckets.claim(client, now - dt.timedelta(minutes=11), 1) == 1
        assert {int(b) for b in direct.smembers(artifact_buckets.AVAILABLE_KEY)} == {0, 2, 4}
        assert artifact_buckets.release(client, 3, 5)
        scheduled = artifact_buckets.schedule(client, 5, now)  # bucket 1's worker died 11 minutes ago
        assert (scheduled.stale_count, scheduled.missing_count, scheduled.occupied_count) == (1, 0, 0)
        assert artifact_buckets.read_state(client).available == frozenset(range(5))
        assert {int(b) for b in direct.smembers(artifact_buckets.AVAILABLE_KEY)} == set(range(5))
        assert direct.zcard(artifact_buckets.OCCUPIED_KEY) == 0


def test_sidekiq_statuses_are_read_as_gitlab_writes_them(shape):
    _, direct = shape
    jids = [f"jid{n:04d}" for n in range(50)]  # spread over the cluster's slots
    for jid in jids[::2]:
        direct.set(sidekiq_status.status_key(jid), 1, ex=1800)  # Gitlab::SidekiqStatus.set
    with gitlab_redis() as resource:
        assert sidekiq_status.completed_jids(resource.sidekiq_status, jids) == set(jids[1::2])


def test_the_cluster_lease_follows_a_moved_redirection(monkeypatch, redis_cluster):
    for name, value in redis_cluster.env("CI_CLEANUP_REDIS_CLUSTER_SHARED_STATE").items():
        monkeypatch.setenv(name, value)
    direct = redis_cluster.direct()
    direct.flushall()
    key = PREFIX + "ci_cleanup:moved"
    client = store_client(resolve("cluster_shared_state", os.environ))  # GitLabRedis' client of the lease store
    try:
        lease = ExclusiveLease(client, "ci_cleanup:moved", 60)
        assert lease.try_obtain()
        slot = client.keyslot(key)
        source = client.nodes_manager.get_node_from_slot(slot)
        target = next(n for n in redis_cluster.nodes if n.port != source.port)
        _move_slot(redis_cluster, slot, key, source.port, target.port)
        assert client.nodes_manager.get_node_from_slot(slot).port == source.port  # the client's map: stale
        assert lease.renew()  # sent to the old owner, MOVED, sent again to the new one
        assert client.nodes_manager.get_node_from_slot(slot).port == target.port
        assert 0 < direct.ttl(key) <= 60 and direct.get(key) == lease.uuid.encode()
        assert lease.cancel() and direct.exists(key) == 0
    finally:
        client.close()
        direct.close()


def _move_slot(cluster, slot: int, key: str, source: int, target: int) -> None:
    """CLUSTER SETSLOT … MIGRATING/IMPORTING, MIGRATE the key, then give the slot to ``target`` on every node."""
    clients = {n.port: redis.Redis(port=n.port, password=CLUSTER_PASSWORD, decode_responses=True)
               for n in cluster.nodes}
    ids = {port: c.execute_command("CLUSTER", "MYID") for port, c in clients.items()}
    clients[target].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
    clients[source].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
    clients[source].execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "AUTH", CLUSTER_PASSWORD,
                                    "KEYS", key)
    for client in clients.values():
        client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])
    for client in clients.values():
        client.close()


# A config folder and nothing else


def _write(folder, name: str, production: object) -> None:
    (folder / name).write_text(yaml.safe_dump({"production": production}))


@pytest.fixture
def config_dir(tmp_path, monkeypatch, stack, sentinel_set, redis_cluster):
    """GitLab's files as Omnibus writes them: database.yml (main + ci on one database), resque.yml (the embedded
    Redis), redis.shared_state.yml (the Sentinel set), redis.cluster_shared_state.yml (the cluster); the only
    setting is CI_CLEANUP_GITLAB_CONFIG_DIR."""
    main = {"adapter": "postgresql", "database": "gitlab", "username": "postgres", "host": str(stack.socket_dir),
            "prepared_statements": False, "database_tasks": True}
    _write(tmp_path, "database.yml", {"main": main, "ci": {**main, "database_tasks": False}})
    _write(tmp_path, "resque.yml", stack.redis_url)
    _write(tmp_path, "redis.shared_state.yml", sentinel_set.entry())
    _write(tmp_path, "redis.cluster_shared_state.yml", redis_cluster.entry())
    monkeypatch.setenv("CI_CLEANUP_GITLAB_CONFIG_DIR", str(tmp_path))
    clients = [redis.Redis.from_url(stack.redis_url), sentinel_set.direct(), redis_cluster.direct()]
    for client in clients:
        client.flushall()
    yield tmp_path, clients
    for client in clients:
        client.close()


def _run_configured(job, config_folder, capfd, **kwargs):
    assert database_urls(config_folder)[1] is None  # Omnibus' ci: entry on main's database: one database
    result = job.execute_in_process(
        resources={"gitlab_db": GitLabDatabase(), "gitlab_redis": GitLabRedis(), "run_options": RunOptions()},
        instance=DagsterInstance.ephemeral(), raise_on_error=False, **kwargs,
    )
    captured = capfd.readouterr()
    shown = repr(result.all_events) + captured.out + captured.err
    assert [p for p in PASSWORDS if p in shown] == []
    return result


def test_a_config_folder_alone_runs_each_job_on_the_stores_gitlab_uses(
    config_dir, engine, capfd, stack, sentinel_set, redis_cluster
):
    folder, (plain, sentinel, cluster) = config_dir
    lease = PREFIX + DROP_LEASE_KEY
    build = create(engine, "ci_builds", created_at=naive_ago(hours=2), updated_at=naive_ago(hours=2))
    cluster.set(lease, "gitlab-worker-uuid", nx=True, ex=1800)  # GitLab's worker holds it, in ClusterSharedState

    held = _run_configured(drop_canceling_builds, folder, capfd)
    assert op_metadata(held, "find_canceling_builds")["status"] == "skipped: lease held"
    assert row(engine, "ci_builds", build).status == "canceling"
    cluster.delete(lease)
    done = _run_configured(drop_canceling_builds, folder, capfd)
    find = op_metadata(done, "find_canceling_builds")
    assert (find["status"], row(engine, "ci_builds", build).status) == ("run", "failed")
    nodes = ",".join(f"127.0.0.1:{n.port}" for n in redis_cluster.nodes)
    assert find["redis_leases"] == (
        f"cluster_shared_state: GitLab's cluster_shared_state Redis ({folder}/redis.cluster_shared_state.yml "
        f"production, Cluster) at nodes {nodes}")

    create(engine, "feature_gates", feature_key=bulk_service.FEATURE_FLAG)
    create(engine, "ci_job_artifacts", project_id=10, job_id=5, expire_at=ago(hours=2))
    bulk = _run_configured(schedule_bulk_delete_job_artifacts, folder, capfd)
    assert bulk.success
    sentinels = ",".join(f"127.0.0.1:{s.port}" for s in sentinel_set.sentinels)
    assert op_metadata(bulk, "schedule_buckets")["redis_artifact_buckets"] == (
        f"shared_state: GitLab's shared_state Redis ({folder}/redis.shared_state.yml production, Sentinel) at "
        f"master {MASTER_NAME} db 0 via sentinels {sentinels}")
    assert {int(b) for b in sentinel.smembers(artifact_buckets.AVAILABLE_KEY)} == set(range(5))
    assert plain.exists(artifact_buckets.AVAILABLE_KEY) == cluster.exists(artifact_buckets.AVAILABLE_KEY) == 0

    running, finished = (create(engine, "project_export_jobs", jid=jid) for jid in ("running-jid", "finished-jid"))
    plain.set(sidekiq_status.status_key("running-jid"), 1, ex=1800)  # queues_metadata → queues → resque.yml
    exports = _run_configured(stuck_export_jobs, folder, capfd)
    assert (row(engine, "project_export_jobs", running).status, row(engine, "project_export_jobs", finished).status) \
        == (0, 3)
    assert op_metadata(exports, "fail_stuck_export_jobs_in_chunks")["redis_sidekiq_status"] == (
        f"default: Redis ({folder}/resque.yml production) at {stack.redis_url}")
    environment = create(engine, "environments", auto_stop_at=ago(hours=1))
    stopped = _run_configured(environments_auto_stop, folder, capfd)
    assert op_metadata(stopped, "find_auto_stoppable_environments")["redis_leases"] == find["redis_leases"]
    assert row(engine, "environments", environment).state == "stopped"
    for client in (plain, sentinel):
        assert client.keys(PREFIX + "*") == []  # every lease given back
    assert cluster.keys(PREFIX + "*", target_nodes=cluster.PRIMARIES) == []  # on every master (KEYS asks one)


# Errors: the store named, never a password


def test_unreachable_or_refusing_stores_are_named_without_a_password(sentinel_set, redis_cluster):
    sentinels = sentinel_set.entry()["sentinels"]
    cases = {
        "a wrong password for the set": {**sentinel_set.entry(), "url": f"redis://:not-{SENTINEL_SET_PASSWORD}@"
                                         f"{MASTER_NAME}/0"},
        "a wrong password for the sentinels": {**sentinel_set.entry(), "sentinel_password": "not-it"},
        "no sentinel answering": {**sentinel_set.entry(), "sentinels": [{"host": "127.0.0.1", "port": 1}]},
        "a wrong password for the cluster": {**redis_cluster.entry(), "password": f"not-{CLUSTER_PASSWORD}"},
    }
    messages = {}
    for case, entry in cases.items():
        with pytest.raises(ServiceUnavailable) as error:
            store_client(parse_entry("shared_state", entry, "test", "test"), failover_seconds=2)
        messages[case] = str(error.value)
    at = "Cannot reach GitLab's shared_state Redis (test, Sentinel) at master gitlab-redis db 0 via sentinels"
    hosts = ",".join(f"127.0.0.1:{s['port']}" for s in sentinels)
    nodes = ",".join(f"127.0.0.1:{n.port}" for n in redis_cluster.nodes)
    refused = "invalid username-password pair or user is disabled."
    assert messages == {
        # The server answered and refused the password: said so, not that it could not be reached.
        "a wrong password for the set": f"{at.replace('Cannot reach', 'Authentication failed for')} {hosts}: "
                                        f"{refused}",
        "a wrong password for the sentinels": f"{at} {hosts}: No master found for 'gitlab-redis' (the sentinels "
                                              f"answered: {', '.join(['AuthenticationError'] * 3)})",
        "no sentinel answering": f"{at} 127.0.0.1:1: No master found for 'gitlab-redis' (the sentinels answered: "
                                 "ConnectionError)",
        "a wrong password for the cluster": f"Authentication failed for GitLab's shared_state Redis (test, Cluster) "
                                            f"at nodes {nodes}: Redis Cluster cannot be connected. Please provide at "
                                            f"least one reachable node: {refused}",
    }
    assert [m for m in messages.values() for p in (*PASSWORDS, "not-") if p in m] == []


# Failover: the primary SIGKILLed while a job works


def _builds(engine, count: int) -> None:
    now = naive_ago(hours=2)
    with engine.begin() as conn:
        conn.execute(insert(S.ci_builds), [
            {"partition_id": 100, "project_id": 1, "commit_id": 1, "name": "rspec", "type": "Ci::Build",
             "status": "canceling", "lock_version": 0, "created_at": now, "updated_at": now, "runner_id": 7}
            for _ in range(count)
        ])


def _count(engine, table, *where) -> int:
    with engine.connect() as conn:
        return conn.scalar(select(func.count()).select_from(table).where(*where))


def _run(job, db_url: str, run_config: dict | None = None):
    """The job run as the code location runs it (GitLabRedis from the environment)."""
    return job.execute_in_process(
        run_config=run_config or {},
        resources={"gitlab_db": GitLabDatabase(url=db_url), "gitlab_redis": GitLabRedis(), "run_options": RunOptions()},
        instance=DagsterInstance.ephemeral(), raise_on_error=False,
    )


class Killer(threading.Thread):
    """SIGKILLs the Sentinel set's primary once the run in the main thread has done some of its work (``progress``,
    read from the database) and not all of it; records how much was done then and which port it killed."""

    def __init__(self, servers, progress, total: int):
        super().__init__(daemon=True)
        self.servers, self.progress, self.total = servers, progress, total
        self.done: int | None = None
        self.killed: int | None = None

    def run(self) -> None:
        self.done = wait_until("the run working", lambda: (n := self.progress()) >= 20 and n)
        self.killed = self.servers.kill_primary()


@pytest.fixture
def failover(monkeypatch, stack, sentinel_set, engine):
    """Every store on the Sentinel set, healthy and empty; afterwards the killed node is back as a replica."""
    for name, value in sentinel_set.env("CI_CLEANUP_REDIS").items():
        monkeypatch.setenv(name, value)
    direct = sentinel_set.direct()
    direct.flushall()
    direct.close()
    yield sentinel_set
    sentinel_set.restore()


def _assert_named_redis_or_success(result) -> None:
    """The run carried on against the promoted replica, or failed naming Redis (and no password); which one, in the
    output (-s)."""
    assert result.success or "Redis" in failure_messages(result), failure_messages(result)
    assert [p for p in PASSWORDS if p in repr(result.all_events)] == []
    print(f"failover: the run {'carried on' if result.success else 'failed naming Redis'}")


def test_failover_mid_run_of_a_lease_job_keeps_the_lease_with_a_ttl_and_the_next_run_completes(
    failover, engine, stack
):
    total = 1500
    _builds(engine, total)
    failed = S.ci_builds.c.status == "failed"
    killer = Killer(failover, lambda: _count(engine, S.ci_builds, failed), total)
    killer.start()
    result = _run(drop_canceling_builds, stack.url(), {"ops": {"find_canceling_builds": {"config": {"batch_size": 1}}}})
    killer.join()
    assert killer.killed is not None and killer.done < total, "the run ended before the primary was killed"
    _assert_named_redis_or_success(result)
    promoted = failover.wait_promoted(killer.killed)
    new_primary = redis.Redis(port=promoted, password=SENTINEL_SET_PASSWORD)
    lease = PREFIX + DROP_LEASE_KEY
    assert new_primary.exists(lease) == 0 or new_primary.ttl(lease) > 0  # never a lease without a TTL
    if not result.success:  # its failure hook gave the lease back, or it expires: the next run may not wait
        new_primary.delete(lease)
    again = _run(drop_canceling_builds, stack.url())
    assert again.success and op_metadata(again, "report_dropped_builds")["status"] == "success"
    assert _count(engine, S.ci_builds, failed) == total
    assert new_primary.exists(lease) == 0
    new_primary.close()


def test_failover_mid_run_of_the_bucket_workers_loses_no_bucket_and_the_next_run_completes(
    failover, engine, stack
):
    per_bucket, max_buckets = 300, 5
    total = per_bucket * max_buckets
    create(engine, "feature_gates", feature_key=bulk_service.FEATURE_FLAG)
    expired = ago(hours=2)
    with engine.begin() as conn:
        conn.execute(insert(S.ci_job_artifacts), [
            {"partition_id": 100, "file_type": 1, "project_id": 10, "job_id": job, "size": 1, "file": "a.zip",
             "file_store": 1, "locked": 0, "expire_at": expired, "created_at": expired, "updated_at": expired}
            for job in range(total)
        ])
    killer = Killer(failover, lambda: total - _count(engine, S.ci_job_artifacts), total)
    killer.start()
    result = _run(schedule_bulk_delete_job_artifacts, stack.url(),
                  {"ops": {"schedule_buckets": {"config": {"batch_size": 1}}}})
    killer.join()
    assert killer.killed is not None and killer.done < total, "the run ended before the primary was killed"
    _assert_named_redis_or_success(result)
    new_primary = redis.Redis(port=failover.wait_promoted(killer.killed), password=SENTINEL_SET_PASSWORD)
    state = artifact_buckets.read_state(new_primary)
    assert state.available | set(state.occupied) == set(range(max_buckets))  # no bucket lost
    assert state.occupied == {} or not result.success  # a bucket stays occupied only when its worker failed
    again = _run(schedule_bulk_delete_job_artifacts, stack.url())
    assert again.success
    assert _count(engine, S.ci_job_artifacts) == 0
    assert artifact_buckets.read_state(new_primary).available == frozenset(range(max_buckets))
    new_primary.close()


def test_ci_cleanup_run_with_the_default_store_as_a_sentinel_set(stack, engine, sentinel_set, tmp_path):
    """``ci-cleanup run`` with CI_CLEANUP_REDIS_URL naming the master and CI_CLEANUP_REDIS_SENTINELS: the run's
    lease is taken in the Sentinel set's primary (not at a host named after the master), and no password shows."""
    build = create(engine, "ci_builds", created_at=naive_ago(hours=2), updated_at=naive_ago(hours=2))
    direct = sentinel_set.direct()
    direct.flushall()
    taken = []
    watching = threading.Event()

    def watch_lease():  # the run's lease, seen in the primary while the run holds it
        watching.set()
        while not taken and watching.is_set():
            if direct.exists(PREFIX + DROP_LEASE_KEY):
                taken.append(direct.ttl(PREFIX + DROP_LEASE_KEY))
    watcher = threading.Thread(target=watch_lease)
    watcher.start()
    try:
        done = subprocess.run(
            [str(Path(sys.executable).parent / "ci-cleanup"), "--data-dir", str(tmp_path), "run",
             "drop_canceling_builds"],
            env=clean_env(CI_CLEANUP_DATABASE_URL=stack.url(), **sentinel_set.env("CI_CLEANUP_REDIS")),
            capture_output=True, text=True, timeout=300,
        )
    finally:
        watching.clear()
        watcher.join()
    assert done.returncode == 0, done.stdout + done.stderr
    assert row(engine, "ci_builds", build).status == "failed"
    assert taken and 0 < taken[0] <= 30 * 60  # taken in the primary, with the worker's TTL
    assert direct.exists(PREFIX + DROP_LEASE_KEY) == 0  # released at the end
    assert [p for p in PASSWORDS if p in done.stdout + done.stderr] == []
    direct.close()


def test_a_lease_is_renewed_once_a_tenth_of_its_ttl_has_passed_and_a_taken_lease_stops_the_run(redis_client):
    """A run renews its lease every tenth of the TTL, not every batch (a Redis round trip each); a lease deleted or
    taken by hand is found on the next renewal, and left to its holder."""

    from ci_cleanup.lease import Lease

    lease, now = Lease("ci/renewal_test", ttl_seconds=100), [0.0]
    key = PREFIX + lease.key
    held = lease.of_run("run-1", redis_client)
    assert lease.obtain(held)
    renew = lease.keeper(held, clock=lambda: now[0])
    redis_client.expire(key, 50)  # 50 s have passed, on the server's clock
    now[0] = 9.9
    renew()  # a batch before a tenth of the TTL: Redis is not asked
    assert redis_client.ttl(key) <= 50
    now[0] = 10.0
    renew()
    assert 99 <= redis_client.ttl(key) <= 100 and redis_client.get(key) == b"run-1"
    redis_client.set(key, "someone-else", ex=600)
    now[0] = 19.9
    renew()  # not yet seen
    now[0] = 20.0
    with pytest.raises(RuntimeError, match="Lost lease ci/renewal_test in Redis mid-run"):
        renew()
    assert redis_client.get(key) == b"someone-else"
