"""GitLab's ``Gitlab::ExclusiveLease`` on its Redis keys, so a live GitLab and ci_cleanup exclude each other.

``SET gitlab:exclusive_lease:<key> <uuid> NX EX <ttl>``; release and renew only act while the
value is still our uuid (GitLab's compare-and-delete / compare-and-expire Lua scripts).
"""

from __future__ import annotations

import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import redis

PREFIX = "gitlab:exclusive_lease:"

_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('expire', KEYS[1], ARGV[2])
end
return 0
"""


@dataclass
class ExclusiveLease:
    client: redis.Redis
    key: str
    ttl_seconds: int
    uuid: str = field(default_factory=lambda: str(uuid.uuid4()))

    @property
    def redis_key(self) -> str:
        return PREFIX + self.key

    def try_obtain(self) -> bool:
        return bool(self.client.set(self.redis_key, self.uuid, nx=True, ex=self.ttl_seconds))

    def renew(self) -> bool:
        return bool(self.client.eval(_RENEW, 1, self.redis_key, self.uuid, self.ttl_seconds))

    def cancel(self) -> bool:
        """Release the lease if it is still ours; a lease taken over after expiry is left alone."""
        return bool(self.client.eval(_RELEASE, 1, self.redis_key, self.uuid))

    def holder(self) -> str | None:
        value = self.client.get(self.redis_key)
        return value.decode() if isinstance(value, bytes) else value


class LeaseHeld(Exception):
    """Another process holds the lease: the seeds skip the run."""


@contextmanager
def exclusive_lease(
    client: redis.Redis, key: str, ttl_seconds: int, *, uuid_value: str | None = None,
    retries: int = 0, retry_sleep_seconds: float = 1.0,
) -> Iterator[ExclusiveLease]:
    """Hold ``key`` for the block, trying ``1 + retries`` times (GitLab's ``in_lock(retries:)``).

    Raises :class:`LeaseHeld` if another holder has it; releases by compare-and-delete on exit,
    whether the block succeeded or raised.
    """
    lease = ExclusiveLease(client, key, ttl_seconds, **({"uuid": uuid_value} if uuid_value else {}))
    for attempt in range(retries + 1):
        if lease.try_obtain():
            break
        if attempt < retries:
            time.sleep(retry_sleep_seconds)
    else:
        raise LeaseHeld(f"lease {key!r} is held by another process")
    try:
        yield lease
    finally:
        lease.cancel()
