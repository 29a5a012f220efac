"""GitLab's buckets for bulk-deleting expired job artifacts, in SharedState Redis.

Artifacts are split into ``max_buckets`` buckets by ``MOD(project_id + job_id, max_buckets)``; a worker
owns one bucket at a time, so parallel workers never fight over the same rows. Free buckets are a SET,
taken ones a ZSET scored with the claim time (unix seconds). A worker that dies keeps its bucket
occupied until the scheduler's stale recovery, 10 minutes later, puts it back.

Every state change is one atomic Redis step (a Lua script or one MULTI), so concurrent schedulers
and workers, ours or a live GitLab's, never lose or duplicate a bucket.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import redis

STORE = "shared_state"  # GitLab's store for the buckets (Gitlab::Redis::SharedState; falls back to resque.yml)
AVAILABLE_KEY = "{bulk_delete_expired_job_artifacts}:available_buckets"
OCCUPIED_KEY = "{bulk_delete_expired_job_artifacts}:occupied_buckets"
STALE_AFTER = dt.timedelta(minutes=10)

# KEYS[1] occupied, KEYS[2] available; ARGV[1] stale cut-off: move every bucket claimed at or before it.
_RECOVER_STALE = """
local stale = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
for _, bucket in ipairs(stale) do
  redis.call('ZREM', KEYS[1], bucket)
  redis.call('SADD', KEYS[2], bucket)
end
return #stale
"""

# KEYS[1] available, KEYS[2] occupied; ARGV[1] claim time, ARGV[2] the bucket wanted, or '' for any.
# Take (SPOP, or SREM of the one wanted) + ZADD as one step: a bucket is never in neither set, nor in both.
_CLAIM = """
local bucket = false
if ARGV[2] == '' then
  bucket = redis.call('SPOP', KEYS[1])
elseif redis.call('SREM', KEYS[1], ARGV[2]) == 1 then
  bucket = ARGV[2]
end
if not bucket then
  return false
end
redis.call('ZADD', KEYS[2], ARGV[1], bucket)
return bucket
"""


STRAYS_REPORTED = 20  # stray members named in the run's metadata; the count is exact


def is_bucket_number(member: bytes) -> bool:
    """What GitLab writes (``bucket.to_s``): ASCII digits, no leading zero. ``"00001"`` is not bucket 1:
    ``SREM "1"`` would miss it, and bucket 1 would look present while no worker could ever claim it."""
    return member.isdigit() and (member == b"0" or not member.startswith(b"0"))


class MalformedBuckets(RuntimeError):
    """A bucket key holds something GitLab never writes there: the run stops, leaving the keys as they are."""


def check_keys(client: redis.Redis) -> None:
    """Refuse bucket keys that are not a SET and a ZSET of bucket numbers, naming the key and what is wrong.

    Nothing is repaired: the keys are shared with a live GitLab, which may know better.
    """
    problems = []
    for key, expected in ((AVAILABLE_KEY, "set"), (OCCUPIED_KEY, "zset")):
        kind = client.type(key)
        kind = kind.decode() if isinstance(kind, bytes) else kind
        if kind not in ("none", expected):
            problems.append(f"{key} is a {kind}, expected a {expected}")
            continue
        members = client.smembers(key) if expected == "set" else client.zrange(key, 0, -1)
        bad = sorted(m.decode(errors="replace") for m in members if not m.isdigit())
        if bad:
            problems.append(f"{key} has members that are not bucket numbers: {bad[:5]}")
    if problems:
        raise MalformedBuckets("Malformed bucket keys in Redis, left as they are: " + "; ".join(problems))


@dataclass(frozen=True)
class BucketState:
    available: frozenset[int]  # canonical bucket numbers only
    occupied: dict[int, float]  # bucket -> claim time, unix seconds; canonical members only
    not_canonical: frozenset[bytes] = frozenset()  # free members like "007": strays whatever max_buckets is

    def strays(self, max_buckets: int) -> list[str]:
        """Free members no worker may take: not canonical, or at or above ``max_buckets`` (left by a scale-down)."""
        return sorted(
            [m.decode() for m in self.not_canonical] + [str(b) for b in self.available if b >= max_buckets],
            key=lambda m: (len(m), m),
        )


@dataclass(frozen=True)
class ScheduledBuckets:
    """What the scheduler did to the buckets: its end-of-run log line (``ScheduleBulkDeleteJobArtifactCronWorker``)."""

    max_buckets: int
    available_count: int  # as read before the missing buckets were added
    occupied_count: int
    stale_count: int
    missing_count: int
    stray_count: int = 0  # free members retired (or, in a dry run, to be retired) by this run
    strays: tuple[str, ...] = ()  # the first STRAYS_REPORTED of them


def read_state(client: redis.Redis) -> BucketState:
    pipe = client.pipeline(transaction=True)
    pipe.smembers(AVAILABLE_KEY)
    pipe.zrange(OCCUPIED_KEY, 0, -1, withscores=True)
    available, occupied = pipe.execute()
    # A non-canonical occupied member is left alone: stale recovery makes it free, and then a stray.
    return BucketState(
        available=frozenset(int(b) for b in available if is_bucket_number(b)),
        occupied={int(b): score for b, score in occupied if is_bucket_number(b)},
        not_canonical=frozenset(b for b in available if not is_bucket_number(b)),
    )


def stale_cutoff(now: dt.datetime) -> float:
    return (now - STALE_AFTER).timestamp()


def recover_stale(client: redis.Redis, now: dt.datetime) -> int:
    """Occupied for 10 minutes or more (score <= now-10min): its worker died; make it available again."""
    return int(client.eval(_RECOVER_STALE, 2, OCCUPIED_KEY, AVAILABLE_KEY, stale_cutoff(now)))


def missing_buckets(state: BucketState, max_buckets: int) -> set[int]:
    """``{0..max-1} − available − occupied``: buckets never created, or lost (e.g. after a scale-up)."""
    return set(range(max_buckets)) - state.available - set(state.occupied)


def schedule(client: redis.Redis, max_buckets: int, now: dt.datetime) -> ScheduledBuckets:
    """The scheduler's bucket upkeep: stale ones recovered, strays retired (one SREM), then missing ones added.

    GitLab retires a bucket at or above max_buckets when a worker happens to pop it; retiring every
    stray here keeps the workers at max_buckets, however many strays the set holds.
    """
    check_keys(client)
    stale_count = recover_stale(client, now)
    state = read_state(client)
    strays = state.strays(max_buckets)
    if strays:
        client.srem(AVAILABLE_KEY, *strays)
    missing = missing_buckets(state, max_buckets)
    if missing:
        client.sadd(AVAILABLE_KEY, *(str(b) for b in sorted(missing)))
    return ScheduledBuckets(
        max_buckets=max_buckets,
        available_count=len(state.available),
        occupied_count=len(state.occupied),
        stale_count=stale_count,
        missing_count=len(missing),
        stray_count=len(strays),
        strays=tuple(strays[:STRAYS_REPORTED]),
    )


def preview_schedule(client: redis.Redis, max_buckets: int, now: dt.datetime) -> ScheduledBuckets:
    """What :func:`schedule` would do, read only (dry run)."""
    check_keys(client)
    state = read_state(client)
    cutoff = stale_cutoff(now)
    stale = {b for b, score in state.occupied.items() if score <= cutoff}
    after_recovery = BucketState(
        available=state.available | stale, occupied={b: s for b, s in state.occupied.items() if b not in stale},
        not_canonical=state.not_canonical,
    )
    strays = after_recovery.strays(max_buckets)
    return ScheduledBuckets(
        max_buckets=max_buckets,
        available_count=len(after_recovery.available),
        occupied_count=len(after_recovery.occupied),
        stale_count=len(stale),
        missing_count=len(missing_buckets(after_recovery, max_buckets)),
        stray_count=len(strays),
        strays=tuple(strays[:STRAYS_REPORTED]),
    )


def claim(client: redis.Redis, now: dt.datetime, bucket: int | None = None) -> int | None:
    """Take a free bucket and mark it occupied since ``now``: any (GitLab's SPOP), or the one asked for.

    None when no bucket (or not the one asked for) is free.
    """
    wanted = "" if bucket is None else str(bucket)
    bucket = client.eval(_CLAIM, 2, AVAILABLE_KEY, OCCUPIED_KEY, now.timestamp(), wanted)
    return None if bucket is None else int(bucket)


def release(client: redis.Redis, bucket: int, max_buckets: int) -> bool:
    """Give the bucket back; one at or above the current ``max_buckets`` is retired (only removed).

    Returns whether the bucket went back to the available set.
    """
    keep = bucket < max_buckets
    pipe = client.pipeline(transaction=True)
    pipe.zrem(OCCUPIED_KEY, str(bucket))
    if keep:
        pipe.sadd(AVAILABLE_KEY, str(bucket))
    pipe.execute()
    return keep
