"""GitLab's ``Gitlab::SidekiqStatus``: a ``gitlab-sidekiq-status:<jid>`` key exists while a job is
enqueued or running; an absent key means completed (finished, expired, or never tracked)."""

from __future__ import annotations

from collections.abc import Sequence

import redis

PREFIX = "gitlab-sidekiq-status:"
# GitLab's store for the status keys: Gitlab::Redis::QueuesMetadata (falls back to Queues, then resque.yml). Older
# GitLab kept them in Sidekiq's Redis (Queues), then in SharedState: see docs/redis.md.
STORE = "queues_metadata"


def status_key(jid: str) -> str:
    return PREFIX + jid


def completed_jids(client: redis.Redis, jids: Sequence[str]) -> set[str]:
    """The jids whose status key is absent (GitLab's ``completed_jids``), in one round trip.

    GitLab asks ``EXISTS`` per key: a key of any type means the job is alive. MGET would answer
    nil for a hash, list, set or zset key and fail an export whose job is still running.
    """
    if not jids:
        return set()
    pipe = client.pipeline(transaction=False)
    for jid in jids:
        pipe.exists(status_key(jid))
    return {jid for jid, present in zip(jids, pipe.execute()) if not present}
