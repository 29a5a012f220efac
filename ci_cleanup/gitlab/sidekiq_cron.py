"""GitLab's cron entries as the sidekiq-cron gem keeps them in Sidekiq's Redis, in both layouts GitLab has used.

1.x (``~> 1.12.0`` until 18.8; earlier 1.8, 1.10): ``Sidekiq::Cron::Job#save`` does ``SADD cron_jobs
cron_job:<name>`` and one ``HSET cron_job:<name>`` of its fields (``nil`` written as ``""``).
2.x (``~> 2.3.0`` from 18.9): the same under a namespace, ``cron_jobs:<namespace>`` and
``cron_job:<namespace>:<name>``, with a ``namespace`` field; GitLab configures none, so it is ``default``. Its
poller first runs ``migrate_old_jobs_if_needed!``: each hash in ``cron_jobs`` is saved under the namespace with its
status and taken out of ``cron_jobs``; the old hash stays behind, read by nothing.

Both: ``disable!`` / ``enable!`` set ``status`` and save; a hash without ``status`` counts as enabled; the poller
enqueues only entries whose status is ``enabled``; GitLab's boot (``load_from_hash!``) keeps the status Redis holds
at the key it writes, so a disabled entry stays disabled and a deleted one comes back enabled.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

STORE = "queues"  # Sidekiq's Redis: Gitlab::Redis::Queues, which falls back to resque.yml
JOBS_KEY = "cron_jobs"  # 1.x's Sidekiq::Cron::Job.jobs_key
NAMESPACED_PREFIX = "cron_jobs:"  # 2.x: Namespace.all reads the namespaces from these keys
ENABLED, DISABLED = "enabled", "disabled"

# KEYS the entries; ARGV[1] the status, ARGV[i + 1] the status field KEYS[i] had when read ('' for none). All or
# none: each must still be a hash with a cron and the status read (an HSET on a key deleted meanwhile would make a
# hash sidekiq-cron cannot load; two layouts changed apart would disagree).
_SET_STATUS = """
for i, key in ipairs(KEYS) do
  if redis.call('TYPE', key)['ok'] ~= 'hash' or redis.call('HEXISTS', key, 'cron') == 0
     or (redis.call('HGET', key, 'status') or '') ~= ARGV[i + 1] then
    return 0
  end
end
for i, key in ipairs(KEYS) do
  redis.call('HSET', key, 'status', ARGV[1])
end
return 1
"""


class UnrecognisedEntry(ValueError):
    """Keys sidekiq-cron would not have written this way, or that do not say which status holds: named, never
    changed."""


def job_key(name: str, namespace: str | None = None) -> str:
    """Sidekiq::Cron::Job.redis_key: 1.x's without a namespace, 2.x's with one."""
    return f"cron_job:{name}" if namespace is None else f"cron_job:{namespace}:{name}"


def jobs_key(namespace: str | None = None) -> str:
    return JOBS_KEY if namespace is None else f"{NAMESPACED_PREFIX}{namespace}"


@dataclass(frozen=True)
class Entry:
    """One entry's hash, its fields decoded; ``namespace`` None for 1.x's."""

    name: str
    fields: dict[str, str]
    namespace: str | None = None

    @property
    def key(self) -> str:
        return job_key(self.name, self.namespace)

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
    def last_enqueue_time(self) -> str | None:
        return self.fields.get("last_enqueue_time") or None  # "" is save's nil: never enqueued


@dataclass(frozen=True)
class Layout:
    """The sets sidekiq-cron keeps: 1.x's names (None without ``cron_jobs``) and each 2.x namespace found."""

    legacy: frozenset[str] | None
    namespaces: dict[str, frozenset[str]]

    @property
    def empty(self) -> bool:
        return self.legacy is None and not self.namespaces


def layout(client: redis.Redis) -> Layout:
    """Both layouts' sets; the namespaces are the ``cron_jobs:*`` keys found (SCAN: never a blocking KEYS)."""
    namespaces = {}
    for found in sorted(client.scan_iter(match=f"{NAMESPACED_PREFIX}*", count=1000)):
        namespace = found.decode(errors="replace")[len(NAMESPACED_PREFIX):]
        namespaces[namespace] = _names(client, namespace)
    return Layout(_names(client, None), namespaces)


def _names(client: redis.Redis, namespace: str | None) -> frozenset[str] | None:
    key = jobs_key(namespace)
    kind = client.type(key).decode()
    if kind == "none":
        return None
    if kind != "set":
        raise UnrecognisedEntry(f"{key} is a {kind}, not the set sidekiq-cron writes")
    prefix = job_key("", namespace).encode()
    return frozenset(m[len(prefix):].decode(errors="replace") for m in client.smembers(key) if m.startswith(prefix))


@dataclass(frozen=True)
class Found:
    """A cron's entries as the poller that runs reads them. ``entries``: the namespaced one first; with it, 1.x's
    while still in ``cron_jobs`` (2.x's poller copies it over the namespaced one when it starts): a change makes
    both. ``orphan``: 1.x's hash a migration left, read by nothing."""

    entries: tuple[Entry, ...]
    orphan: str | None = None

    @property
    def entry(self) -> Entry | None:
        return self.entries[0] if self.entries else None


def find(client: redis.Redis, found: Layout, name: str, klass: str | None = None) -> Found:
    """The entries of ``name`` in both layouts; :class:`UnrecognisedEntry` for any that cannot be trusted."""
    entries = list(_namespaced(client, found, name, klass))
    if name in (found.legacy or ()):
        old = read(client, name, klass)
        if old is not None and entries and old.status != entries[0].status:
            raise UnrecognisedEntry(
                f"{old.key} ({old.status}, still in {JOBS_KEY}) and {entries[0].key} ({entries[0].status}) "
                f"disagree: sidekiq-cron 2.x's poller reads the second and, when it starts, copies the first over it")
        return Found(tuple(entries) + ((old,) if old else ()))
    if not client.exists(job_key(name)):
        return Found(tuple(entries))
    if found.namespaces:
        return Found(tuple(entries), orphan=job_key(name))
    raise UnrecognisedEntry(f"{job_key(name)} is not in {JOBS_KEY}: sidekiq-cron's poller never runs it")


def _namespaced(client: redis.Redis, found: Layout, name: str, klass: str | None) -> tuple[Entry, ...]:
    listed = [namespace for namespace, names in found.namespaces.items() if name in (names or ())]
    if len(listed) > 1:
        raise UnrecognisedEntry(f"{name} is in {' and '.join(jobs_key(n) for n in listed)}: which namespace "
                                "GitLab's poller reads is not known here")
    entries = []
    for namespace in found.namespaces:
        entry = read(client, name, klass, namespace)
        if namespace in listed and entry is None:
            raise UnrecognisedEntry(f"{jobs_key(namespace)} lists {job_key(name, namespace)}, which does not exist")
        if entry is not None and namespace not in listed:
            raise UnrecognisedEntry(f"{entry.key} is not in {jobs_key(namespace)}: sidekiq-cron's poller never runs it")
        entries += [entry] if entry is not None else []
    return tuple(entries)


def read(client: redis.Redis, name: str, klass: str | None = None, namespace: str | None = None) -> Entry | None:
    """The entry ``name``; None when its key does not exist. ``klass``: the class it must run, when known."""
    key = job_key(name, namespace)
    kind = client.type(key).decode()
    if kind == "none":
        return None
    if kind != "hash":
        raise UnrecognisedEntry(f"{key} is a {kind}, not the hash sidekiq-cron writes")
    entry = Entry(name, {k.decode(errors="replace"): v.decode(errors="replace")
                         for k, v in client.hgetall(key).items()}, namespace)
    if not entry.fields.get("cron"):
        raise UnrecognisedEntry(f"{key} has no cron field: not an entry sidekiq-cron saved")
    if klass is not None and entry.fields.get("klass") != klass:
        raise UnrecognisedEntry(f"{key} runs {entry.fields.get('klass') or 'no class'}, not GitLab's {klass}")
    if namespace is not None and entry.fields.get("namespace") != namespace:
        raise UnrecognisedEntry(f"{key} has namespace {entry.fields.get('namespace')!r}, not {namespace!r}: not an "
                                "entry sidekiq-cron 2.x saved there")
    return entry


def set_status(client: redis.Redis, entries: tuple[Entry, ...], status: str) -> None:
    """``disable!`` / ``enable!``'s change to each entry: its ``status`` field, nothing else of it or of any key;
    all of them or none."""
    keys = [entry.key for entry in entries]
    if not client.eval(_SET_STATUS, len(keys), *keys, status, *(entry.status_field or "" for entry in entries)):
        raise UnrecognisedEntry(f"{' or '.join(keys)} changed while being read: not changed")
