"""Redis clients that name their server in every error, of each shape GitLab's stores take: one server, the
primary of a Sentinel set, or a Redis Cluster."""

from __future__ import annotations

import re
import threading
import time

import redis
import redis.backoff
import redis.cluster
import redis.retry
import redis.sentinel

from ..gitlab.redis_stores import DEFAULT, UNSHOWN_URL, StoreConfig
from .errors import RedisRefused, RedisUnavailable, ServiceUnavailable, unreachable


def _refusal(error: redis.ResponseError) -> str | None:
    """What to do about a write Redis refused; None for any other error. A Lua script's refusal is a plain
    ResponseError carrying ``-READONLY`` / ``-OOM`` in its text."""
    text = str(error)
    if isinstance(error, redis.ReadOnlyError) or "-READONLY " in text:
        return "it is a read-only replica; point the URL at the primary (GitLab writes there too)"
    if isinstance(error, redis.exceptions.OutOfMemoryError) or "-OOM " in text:
        return "it is out of memory (maxmemory reached, no eviction); free memory or raise maxmemory"
    return None


def _named(server: str | None, error: Exception) -> Exception:
    if server is None or isinstance(error, ServiceUnavailable):
        return error
    if isinstance(error, redis.ResponseError) and not isinstance(error, redis.exceptions.ClusterError):
        advice = _refusal(error)
        return RedisRefused(f"{server} refused a write: {advice} ({error})") if advice else error
    return RedisUnavailable(f"Lost {server}: {_reason(error)}")


def _reason(error: Exception) -> str:
    """redis-py's text, but a Sentinel's "No master found" without the repr of every sentinel's client."""
    text = str(error)
    if isinstance(error, redis.sentinel.MasterNotFoundError) and " : " in text:
        kinds = re.findall(r" - \w+:(\w+)", text)
        return text.split(" : ", 1)[0] + (f" (the sentinels answered: {', '.join(kinds)})" if kinds else "")
    return text


# What a client names in its errors: a connection lost, a server that refused, a cluster that cannot answer.
_NAMED_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.ResponseError, redis.exceptions.ClusterError,
                 redis.exceptions.RedisClusterException)


def _naming(server: str | None, call, *args, **kwargs):
    """``call``'s result; its Redis error named after ``server`` (:func:`_named`). redis-py says "Error 111
    connecting to unix socket: …": the server, never its password, is named instead."""
    try:
        return call(*args, **kwargs)
    except _NAMED_ERRORS as e:
        raise _named(server, e) from None


class _NamedPipeline(redis.client.Pipeline):
    server: str | None = None

    def execute(self, raise_on_error: bool = True):
        return _naming(self.server, super().execute, raise_on_error)


class _NamedRedis(redis.Redis):
    """A Redis client whose errors name the server (:func:`_naming`)."""

    server: str | None = None  # e.g. "Redis (CI_CLEANUP_REDIS_URL) at unix://…", set once the first PING went through
    sentinel: redis.sentinel.Sentinel | None = None  # a Sentinel set's: its connections to the sentinels

    def execute_command(self, *args, **options):
        return _naming(self.server, super().execute_command, *args, **options)

    def pipeline(self, transaction=True, shard_hint=None) -> redis.client.Pipeline:
        pipe = _NamedPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.server = self.server
        return pipe


class _NamedClusterPipeline(redis.cluster.ClusterPipeline):
    server: str | None = None

    def execute(self, raise_on_error: bool = True):
        return _naming(self.server, super().execute, raise_on_error)


class _NamedRedisCluster(redis.cluster.RedisCluster):
    """A Redis Cluster (GitLab.com's ClusterSharedState): commands go to the slot's master, MOVED and ASK
    redirections are followed by redis-py; errors name the cluster as :class:`_NamedRedis` names a server."""

    server: str | None = None

    def execute_command(self, *args, **kwargs):
        return _naming(self.server, super().execute_command, *args, **kwargs)

    def pipeline(self, transaction=None, shard_hint=None):
        pipe = super().pipeline(transaction=transaction, shard_hint=shard_hint)
        pipe.__class__ = _NamedClusterPipeline
        pipe.server = self.server
        return pipe


# A Sentinel set's client waits this long for a failover (Sentinel's down-after-milliseconds, then the election
# and promotion: 10-20 s on Omnibus' defaults) before a command fails naming the store: the work carries on
# against the promoted replica.
FAILOVER_SECONDS = 35.0
_TIMEOUTS = dict(socket_timeout=10, socket_connect_timeout=5)


class _FailoverRetry(redis.retry.Retry):
    """Connection errors tried again for ``seconds`` (0.1 s doubling up to 1 s apart), once per command.

    redis-py calls the same retry for the command and, inside it, for the (re)connection that asks the sentinels
    where the primary is: the inner call tries once, so the waits do not multiply. A refused password is never
    tried again.
    """

    def __init__(self, seconds: float):
        super().__init__(redis.backoff.ExponentialBackoff(cap=1.0, base=0.1), -1)
        self.seconds, self._active = seconds, threading.local()

    def __deepcopy__(self, memo):
        return _FailoverRetry(self.seconds)

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        if getattr(self._active, "on", False):
            return do()
        self._active.on, failures, deadline = True, 0, time.monotonic() + self.seconds
        try:
            while True:
                try:
                    return do()
                except self._supported_errors as error:
                    if isinstance(error, redis.AuthenticationError) or (is_retryable and not is_retryable(error)):
                        raise
                    failures += 1
                    fail(error, failures) if with_failure_count else fail(error)
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(self._backoff.compute(failures))
        finally:
            self._active.on = False


def _unparsable(what: str) -> ServiceUnavailable:
    # redis-py's own errors for such a URL quote the piece it choked on, which may be part of the password.
    return ServiceUnavailable(
        f"{what}: the URL cannot be parsed safely (not shown); percent-encode any '@', ':', '/', '?' or '#' "
        "in its password"
    )


def _connect(config: StoreConfig, failover_seconds: float):
    """A client of the store's shape: one server, the master of a Sentinel set, or a Redis Cluster."""
    if config.shape == "cluster":
        nodes = [redis.cluster.ClusterNode(host, port) for host, port in config.cluster]
        return _NamedRedisCluster(startup_nodes=nodes, username=config.username, password=config.password,
                                  ssl=config.ssl, **_TIMEOUTS)
    if config.shape == "sentinel":
        sentinel = redis.sentinel.Sentinel(
            config.sentinels,
            sentinel_kwargs=dict(username=config.sentinel_username, password=config.sentinel_password, **_TIMEOUTS,
                                 retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0)),  # the failover retry's job
        )
        retry = _FailoverRetry(failover_seconds)
        client = sentinel.master_for(
            config.master_name, redis_class=_NamedRedis, username=config.username, password=config.password,
            db=config.db, ssl=config.ssl, retry=retry, health_check_interval=30, **_TIMEOUTS,
        )
        client.sentinel = sentinel
        return client
    return _NamedRedis.from_url(config.url, health_check_interval=30, **_TIMEOUTS)


def store_client(config: StoreConfig, failover_seconds: float = FAILOVER_SECONDS):
    """The store's client, checked with a PING; errors name the store and where it is, never a password.

    A Sentinel set's client waits up to ``failover_seconds`` for a primary (:class:`_FailoverRetry`).
    """
    if config.shape == "url" and config.shown() == UNSHOWN_URL:
        raise _unparsable(config.label)
    try:
        client = _connect(config, failover_seconds)
    except ValueError:
        raise _unparsable(config.label) from None
    except (redis.RedisError, redis.exceptions.RedisClusterException) as e:  # a cluster asks its nodes at once
        raise unreachable(config.where, _reason(e)) from None
    try:
        client.ping()
    except (redis.RedisError, redis.exceptions.RedisClusterException, ValueError) as e:
        close_client(client)
        raise unreachable(config.where, _reason(e)) from None
    client.server = config.where
    return client


def close_client(client) -> None:
    client.close()
    for sentinel in getattr(getattr(client, "sentinel", None), "sentinels", ()):
        sentinel.close()


def redis_client(url: str, what: str) -> redis.Redis:
    """A client of one Redis URL, named ``what`` in its errors (the CLI's seed and start-up checks)."""
    return store_client(StoreConfig(store=DEFAULT, source=what, url=url, named=what))
