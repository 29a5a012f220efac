"""GitLab's ``Gitlab::ExclusiveLease`` on its Redis keys, so a live GitLab and ci_cleanup exclude each other.

``SET gitlab:exclusive_lease:<key> <uuid> NX EX <ttl>``; release and renew only act while the
value is still our uuid (GitLab's compare-and-delete / compare-and-expire Lua scripts).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import redis

PREFIX = "gitlab:exclusive_lease:"
# GitLab's store for leases (Gitlab::Redis::ClusterSharedState; it falls back to SharedState, then resque.yml).
STORE = "cluster_shared_state"

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
        """``SET NX EX``; a key that already holds our uuid is ours too: a SET whose reply was lost (a failover, a
        dropped connection) and that the client sent again."""
        if self.client.set(self.redis_key, self.uuid, nx=True, ex=self.ttl_seconds):
            return True
        try:
            return self.client.get(self.redis_key) == self.uuid.encode()
        except redis.ResponseError:  # WRONGTYPE: a key of another type is never ours, and is left as it is
            return False

    def renew(self) -> bool:
        return bool(self.client.eval(_RENEW, 1, self.redis_key, self.uuid, self.ttl_seconds))

    def cancel(self) -> bool:
        """Release the lease if it is still ours; a lease taken over after expiry is left alone."""
        return bool(self.client.eval(_RELEASE, 1, self.redis_key, self.uuid))
