"""GitLab's cron entries as the sidekiq-cron gem (``~> 1.12.0`` in GitLab's Gemfile) keeps them in Sidekiq's Redis.

``Sidekiq::Cron::Job#save`` (lib/sidekiq/cron/job.rb, 1.12.0) does ``SADD cron_jobs cron_job:<name>`` and one
``HSET cron_job:<name>`` of its fields (``nil`` written as ``""``); ``disable!`` / ``enable!`` set ``status`` and
save. A hash without ``status`` counts as enabled (``status_from_redis``). The poller enqueues only entries whose
status is ``enabled``, and GitLab's boot (``load_from_hash!``) keeps the status Redis holds, so a disabled entry
stays disabled; a deleted one comes back enabled. sidekiq-cron 2.x namespaces both keys (``cron_jobs:<namespace>``,
``cron_job:<namespace>:<name>``): that layout is refused here, never half-read.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

STORE = "queues"  # Sidekiq's Redis: Gitlab::Redis::Queues, which falls back to resque.yml
JOBS_KEY = "cron_jobs"  # Sidekiq::Cron::Job.jobs_key
NAMESPACED_JOBS = "cron_jobs:*"  # 2.x: Sidekiq::Cron::Namespace.all reads KEYS cron_jobs:*
ENABLED, DISABLED = "enabled", "disabled"
# Sidekiq::Cron::Job#to_hash: what save writes, every field of it.
FIELDS = ("name", "klass", "cron", "description", "source", "args", "message", "status", "active_job",
          "queue_name_prefix", "queue_name_delimiter", "last_enqueue_time", "symbolize_args")

# KEYS[1] the entry; ARGV[1] the status. Set it only while the key is still a hash with a cron (what was checked):
# an HSET on a key deleted meanwhile would create a hash of one field that sidekiq-cron cannot load.
_SET_STATUS = """
if redis.call('TYPE', KEYS[1])['ok'] ~= 'hash' or redis.call('HEXISTS', KEYS[1], 'cron') == 0 then
  return 0
end
redis.call('HSET', KEYS[1], 'status', ARGV[1])
return 1
"""


class UnrecognisedEntry(ValueError):
    """A key sidekiq-cron 1.12 would not have written this way: named, and never changed."""


class NamespacedLayout(ValueError):
    """sidekiq-cron 2.x's keys: this module reads 1.12's only."""


def job_key(name: str) -> str:
    return f"cron_job:{name}"  # Sidekiq::Cron::Job.redis_key


@dataclass(frozen=True)
class Entry:
    """One ``cron_job:<name>`` hash, its fields decoded."""

    name: str
    fields: dict[str, str]

    @property
    def key(self) -> str:
        return job_key(self.name)

    @property
    def cron(self) -> str:
        return self.fields["cron"]

    @property
    def status_field(self) -> str | None:
        return self.fields.get("status")

    @property
    def status(self) -> str:
        """As sidekiq-cron reads it: the field, or ``enabled`` without one."""
        return ENABLED if self.status_field is None else self.status_field

    @property
    def enabled(self) -> bool:
        return self.status == ENABLED  # should_enque?: status == "enabled", nothing else

    @property
    def last_enqueue_time(self) -> str | None:
        return self.fields.get("last_enqueue_time") or None  # "" is save's nil: never enqueued


def refuse_namespaced(client: redis.Redis) -> None:
    """Refuse sidekiq-cron 2.x's layout, naming one of its sets (SCAN: never a blocking KEYS on Sidekiq's Redis)."""
    found = next(client.scan_iter(match=NAMESPACED_JOBS, count=1000), None)
    if found is not None:
        raise NamespacedLayout(
            f"{found.decode(errors='replace')} is sidekiq-cron 2.x's namespaced layout: only 1.12's "
            f"({JOBS_KEY}, {job_key('<name>')}), which GitLab uses, is read and changed here"
        )


def registered(client: redis.Redis) -> set[str] | None:
    """The names in ``cron_jobs``; None without the set (no sidekiq-cron data)."""
    kind = client.type(JOBS_KEY).decode()
    if kind == "none":
        return None
    if kind != "set":
        raise UnrecognisedEntry(f"{JOBS_KEY} is a {kind}, not the set sidekiq-cron writes")
    prefix = job_key("").encode()
    return {m[len(prefix):].decode(errors="replace") for m in client.smembers(JOBS_KEY) if m.startswith(prefix)}


def read(client: redis.Redis, name: str, klass: str | None = None) -> Entry | None:
    """The entry ``name``; None when its key does not exist. ``klass``: the class it must run, when known."""
    key = job_key(name)
    kind = client.type(key).decode()
    if kind == "none":
        return None
    if kind != "hash":
        raise UnrecognisedEntry(f"{key} is a {kind}, not the hash sidekiq-cron writes")
    entry = Entry(name, {k.decode(errors="replace"): v.decode(errors="replace")
                         for k, v in client.hgetall(key).items()})
    if not entry.fields.get("cron"):
        raise UnrecognisedEntry(f"{key} has no cron field: not an entry sidekiq-cron 1.12 saved")
    if klass is not None and entry.fields.get("klass") != klass:
        raise UnrecognisedEntry(f"{key} runs {entry.fields.get('klass') or 'no class'}, not GitLab's {klass}")
    return entry


def set_status(client: redis.Redis, entry: Entry, status: str) -> None:
    """``disable!`` / ``enable!``'s change to the entry: its ``status`` field, nothing else of it or of any key."""
    if not client.eval(_SET_STATUS, 1, entry.key, status):
        raise UnrecognisedEntry(f"{entry.key} changed while being read (no longer a hash with a cron): not changed")
