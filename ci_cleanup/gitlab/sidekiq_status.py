"""GitLab's ``Gitlab::SidekiqStatus``: a ``gitlab-sidekiq-status:<jid>`` key exists while a job is
enqueued or running; an absent key means completed (finished, expired, or never tracked)."""

from __future__ import annotations

from collections.abc import Sequence

import redis

PREFIX = "gitlab-sidekiq-status:"


def status_key(jid: str) -> str:
    return PREFIX + jid


def completed_jids(client: redis.Redis, jids: Sequence[str]) -> set[str]:
    """The jids whose status key is absent, in one MGET (GitLab's ``completed_jids``)."""
    if not jids:
        return set()
    values = client.mget([status_key(jid) for jid in jids])
    return {jid for jid, value in zip(jids, values) if value is None}
