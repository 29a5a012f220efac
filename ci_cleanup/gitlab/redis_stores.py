"""GitLab's Redis stores (``Gitlab::Redis::<Store>``): which store holds what, how each one falls back, and
where its configuration comes from (the environment, or GitLab's own files with GitLab's precedence).

A store's configuration is one of three shapes, as in GitLab's files:

- a URL: ``redis://…``, ``rediss://…``, ``unix://…``;
- a Sentinel set: ``url:`` whose host is the master name (``redis://:password@gitlab-redis/0``) plus
  ``sentinels:`` (``host``/``port``; ``sentinel_password:``, or a ``password`` on the sentinels);
- a Redis Cluster: ``cluster:`` (nodes as ``host``/``port`` or ``redis://`` URLs) and ``password:``.

Nothing here connects: :mod:`ci_cleanup.resources` builds the clients. Nothing here shows a password:
:meth:`StoreConfig.shown` is what errors and run metadata print.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from . import artifact_buckets, exclusive_lease, sidekiq_status
from .config_files import ENV_CONFIG_DIR, SECTION, ConfigFileError, production

DEFAULT = "default"  # GitLab's resque.yml: the store every other one ends its fallback on

# Gitlab::Redis::<Store>.config_fallback (lib/gitlab/redis/*.rb); None: straight to resque.yml.
FALLBACK: dict[str, str | None] = {
    "shared_state": None,
    "cluster_shared_state": "shared_state",
    "queues": None,
    "queues_metadata": "queues",
}
STORES = (DEFAULT, *FALLBACK)

# Each Redis use and its store, as each use's module declares it (GitLabRedis maps them to clients).
USES = {
    "leases": exclusive_lease.STORE,  # Gitlab::ExclusiveLease
    "artifact_buckets": artifact_buckets.STORE,  # Ci::ScheduleBulkDeleteJobArtifactCronWorker's buckets
    "sidekiq_status": sidekiq_status.STORE,  # Gitlab::SidekiqStatus
}

ENV_PREFIX = {store: "CI_CLEANUP_REDIS" + ("" if store == DEFAULT else f"_{store.upper()}") for store in STORES}
# Each store's variables: <prefix>_URL, _SENTINELS, _SENTINEL_PASSWORD, _SENTINEL_USERNAME, _CLUSTER, _PASSWORD.
ENV_SUFFIXES = ("URL", "SENTINELS", "SENTINEL_USERNAME", "SENTINEL_PASSWORD", "CLUSTER", "PASSWORD")

# How the two stores that predate this module were named in errors (tests and runbooks grep for them).
_LABELS = {DEFAULT: "Redis", "queues": "Sidekiq's Redis"}

_REDIS_SCHEMES = ("redis", "rediss", "unix")
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]*)(:[0-9]+)?")
UNSHOWN_URL = "<URL not shown: it cannot be parsed safely>"


def redact_redis_url(url: str) -> str:
    """The URL as it can be shown: any user or password as ``***``, query values other than ``db`` hidden.

    A URL whose shape leaves any doubt where the credentials end (no ``scheme://``, an ``@`` or
    ``#`` outside the user part, a host that is not a host name) is never echoed: a password
    with a raw ``/``, ``?`` or ``#`` in it would land in the path, query or fragment.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return UNSHOWN_URL
    if parts.scheme not in _REDIS_SCHEMES or not url.startswith(f"{parts.scheme}://") or "#" in url:
        return UNSHOWN_URL
    _, at, host = parts.netloc.rpartition("@")
    if "@" in parts.path + parts.query or not _HOST_PORT.fullmatch(host):
        return UNSHOWN_URL
    if parts.scheme != "unix" and not re.fullmatch(r"(/[0-9]*)?", parts.path):
        return UNSHOWN_URL
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    query = "&".join(f"{quote(k)}={v if k == 'db' and v.isdigit() else '***'}" for k, v in pairs)
    return f"{parts.scheme}://{'***@' if at else ''}{host}{parts.path}{'?' if query else ''}{query}"


class StoreConfigError(ConfigFileError):
    """A store's settings cannot be used; names the variable or file and key, never a value."""


class StoreNotSet(StoreConfigError):
    """Nothing says where a store is: no variable, no resource field, no GitLab config folder."""


@dataclass(frozen=True)
class StoreConfig:
    """One store's connection settings, and where they were read (``source``: a variable, or a file and key).

    ``store`` is the store whose settings these are: for a store without settings of its own, the one it fell
    back to.
    """

    store: str
    source: str
    url: str | None = None  # the URL shape, as given (the client parses it)
    master_name: str | None = None  # the Sentinel shape
    sentinels: tuple[tuple[str, int], ...] = ()
    cluster: tuple[tuple[str, int], ...] = ()  # the Cluster shape
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    db: int = 0
    ssl: bool = False
    sentinel_username: str | None = field(default=None, repr=False)
    sentinel_password: str | None = field(default=None, repr=False)
    named: str | None = None  # what errors call it, when the caller knows better (the CLI's "the embedded Redis")

    @property
    def shape(self) -> str:
        return "sentinel" if self.sentinels else "cluster" if self.cluster else "url"

    @property
    def label(self) -> str:
        """What errors call it: ``Redis (CI_CLEANUP_REDIS_URL)``, ``GitLab's shared_state Redis (<file> …)``."""
        if self.named is not None:
            return self.named
        kind = {"sentinel": ", Sentinel", "cluster": ", Cluster"}.get(self.shape, "")
        name = _LABELS.get(self.store, f"GitLab's {self.store} Redis")
        return f"{name} ({self.source}{kind})"

    def shown(self) -> str:
        """Where it connects, without user or password."""
        if self.shape == "sentinel":
            hosts = ",".join(_host_port(h, p) for h, p in self.sentinels)
            return f"master {self.master_name} db {self.db} via sentinels {hosts}"
        if self.shape == "cluster":
            return "nodes " + ",".join(_host_port(h, p) for h, p in self.cluster)
        return redact_redis_url(self.url or "")

    @property
    def where(self) -> str:
        return f"{self.label} at {self.shown()}"

    @property
    def identity(self) -> tuple:
        """Equal for two stores that are one server (they then share one client), whatever their sources."""
        return (self.url, self.master_name, self.sentinels, self.cluster, self.username, self.password, self.db,
                self.ssl, self.sentinel_username, self.sentinel_password)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def chain(store: str) -> list[str]:
    """The store, then each store it falls back to, ending on the default (resque.yml)."""
    stores = [store]
    while stores[-1] != DEFAULT:
        stores.append(FALLBACK[stores[-1]] or DEFAULT)
    return stores


# The environment


def from_env(store: str, env: Mapping[str, str]) -> StoreConfig | None:
    """The store's settings from its variables (``CI_CLEANUP_REDIS_SHARED_STATE_URL`` …); None when none is set."""
    prefix = ENV_PREFIX[store]
    values = {s: env.get(f"{prefix}_{s}") or None for s in ENV_SUFFIXES}
    if values["URL"] is None and values["CLUSTER"] is None:
        if values["SENTINELS"] is not None:
            raise StoreConfigError(
                f"{prefix}_SENTINELS is set without {prefix}_URL: give the master as the URL's host "
                "(redis://:password@<master name>/0)"
            )
        return None
    source = f"{prefix}_URL" if values["URL"] is not None else f"{prefix}_CLUSTER"
    entry: dict[str, object] = {"url": values["URL"], "password": values["PASSWORD"],
                                "sentinel_username": values["SENTINEL_USERNAME"],
                                "sentinel_password": values["SENTINEL_PASSWORD"]}
    if values["SENTINELS"] is not None:
        entry["sentinels"] = _node_list(values["SENTINELS"], f"{prefix}_SENTINELS")
    if values["CLUSTER"] is not None:
        entry["cluster"] = _node_list(values["CLUSTER"], f"{prefix}_CLUSTER")
    return parse_entry(store, {k: v for k, v in entry.items() if v is not None}, source, f"{prefix}_*")


def _node_list(text: str, name: str) -> list[dict]:
    """``host:port,host:port`` as GitLab's ``host``/``port`` entries."""
    nodes = []
    for number, item in enumerate(text.split(",")):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise StoreConfigError(f"{name}: entry {number + 1} is not host:port")
        nodes.append({"host": host.strip("[]"), "port": int(port)})
    return nodes


# GitLab's files


def file_candidates(store: str, config_dir: Path) -> list[tuple[str, object]]:
    """The store's entries in GitLab's files, best first, as ``Gitlab::Redis::Wrapper#fetch_config`` orders them:
    ``redis.yml``'s key for the store, ``redis.<store>.yml``, the fallback's ``redis.<fallback>.yml``, ``redis.yml``'s
    key for the fallback, then ``resque.yml``. Absent files and keys are left out."""
    redis_yml_path = config_dir / "redis.yml"
    redis_yml = production(redis_yml_path)
    if redis_yml is not None and not isinstance(redis_yml, dict):
        raise StoreConfigError(f"{redis_yml_path}: {SECTION} is not a mapping of stores")
    redis_yml = redis_yml or {}
    order: list[tuple[str, object]] = []
    if store != DEFAULT:
        fallback = FALLBACK[store]
        order.append((f"{redis_yml_path} {SECTION}.{store}", redis_yml.get(store)))
        order.append((_file_source(config_dir / f"redis.{store}.yml"), production(config_dir / f"redis.{store}.yml")))
        if fallback is not None:
            fallback_file = config_dir / f"redis.{fallback}.yml"
            order.append((_file_source(fallback_file), production(fallback_file)))
            order.append((f"{redis_yml_path} {SECTION}.{fallback}", redis_yml.get(fallback)))
    order.append((_file_source(config_dir / "resque.yml"), production(config_dir / "resque.yml")))
    return [(source, entry) for source, entry in order if entry is not None]


def _file_source(path: Path) -> str:
    return f"{path} {SECTION}"


def _store_of_source(source: str, config_dir: Path) -> str:
    """The store whose settings a file entry holds (``redis.yml production.shared_state`` → shared_state)."""
    for store in FALLBACK:
        if source in (f"{config_dir / 'redis.yml'} {SECTION}.{store}", _file_source(config_dir / f"redis.{store}.yml")):
            return store
    return DEFAULT


# Resolution


def resolve(store: str, env: Mapping[str, str], config_dir: str | Path | None = None,
            overrides: Mapping[str, str | None] | None = None) -> StoreConfig:
    """The settings ``store`` uses: for each store of its :func:`chain`, an explicit URL (``overrides``, the
    resource's fields), then its variables, then GitLab's files for it, in GitLab's order.

    Variables override the files store by store: ``CI_CLEANUP_REDIS_SHARED_STATE_URL`` replaces what the files say
    of shared_state, and is used by cluster_shared_state only where GitLab would fall back to shared_state.
    """
    overrides = overrides or {}
    files: dict[str, list[tuple[str, object]]] = {}
    if config_dir:
        config_dir = Path(config_dir)
        if not config_dir.is_dir():
            raise StoreConfigError(f"{ENV_CONFIG_DIR}={config_dir} is not a folder")
        for source, entry in file_candidates(store, config_dir):
            files.setdefault(_store_of_source(source, config_dir), []).append((source, entry))
    for candidate in chain(store):
        if overrides.get(candidate):
            name = f"{ENV_PREFIX[candidate]}_URL"
            return parse_entry(candidate, {"url": overrides[candidate]}, name, name)
        configured = from_env(candidate, env)
        if configured is not None:
            return configured
        if files.get(candidate):
            source, entry = files[candidate][0]
            return parse_entry(candidate, entry, source, source)
    searched = [f"{ENV_PREFIX[s]}_URL" for s in chain(store)]
    where = f" nor in {config_dir}" if config_dir else f", and {ENV_CONFIG_DIR} is not set"
    raise StoreNotSet(f"No Redis for GitLab's {store} store: none of {', '.join(searched)} is set{where}")


def parse_entry(store: str, entry: object, source: str, name: str) -> StoreConfig:
    """One store entry (a URL string, or GitLab's mapping: ``url``, ``sentinels``, ``cluster``, ``password``, …)."""
    if isinstance(entry, str):
        entry = {"url": entry}
    if not isinstance(entry, dict):
        raise StoreConfigError(f"{name}: expected a URL or a mapping with url:, sentinels: or cluster:")
    for unsupported in ("config_command", "secret_file"):
        if entry.get(unsupported):
            raise StoreConfigError(
                f"{name}: {unsupported} is not supported (it needs GitLab's Ruby to decrypt or run it); "
                "put the password in the file, or in the store's variables"
            )
    password = _optional_text(entry, "password", name)
    username = _optional_text(entry, "username", name)
    common = dict(store=store, source=source, username=username, password=password)
    if entry.get("cluster"):
        return _cluster(entry, name, common)
    url = _optional_text(entry, "url", name)
    if url is None:
        raise StoreConfigError(f"{name}: url is missing")
    if url.startswith("unix:/") and not url.startswith("unix://"):
        url = "unix://" + url.removeprefix("unix:")  # Omnibus writes unix:/var/opt/gitlab/redis/redis.socket
    if entry.get("sentinels"):
        return _sentinel(entry, url, name, common)
    if password is not None or username is not None:  # GitLab's password: key beside a URL without one
        url = _with_credentials(url, username, password, name)
    return StoreConfig(url=url, **common | {"username": None, "password": None})


def _optional_text(entry: dict, key: str, name: str) -> str | None:
    value = entry.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str | int):
        raise StoreConfigError(f"{name}: {key} is a {type(value).__name__}, expected a string")
    return str(value)


def _url_parts(url: str, name: str):
    shown = redact_redis_url(url)
    if shown == UNSHOWN_URL:
        raise StoreConfigError(
            f"{name}: the URL cannot be parsed safely (not shown); percent-encode any '@', ':', '/', '?' or '#' "
            "in its password"
        )
    return urlsplit(url)


def _with_credentials(url: str, username: str | None, password: str | None, name: str) -> str:
    parts = _url_parts(url, name)
    if parts.password is not None or parts.username:
        return url
    userinfo = f"{quote(username or '', safe='')}:{quote(password or '', safe='')}@"
    return parts._replace(netloc=userinfo + parts.netloc).geturl()


def _nodes(items: object, key: str, name: str) -> tuple[list[tuple[str, int]], list[dict]]:
    """``host``/``port`` entries (or ``redis://`` URLs) as (host, port), with each entry's own credentials."""
    if not isinstance(items, list):
        raise StoreConfigError(f"{name}: {key} is not a list")
    nodes, credentials = [], []
    for number, item in enumerate(items):
        where = f"{name}: {key}[{number}]"
        if isinstance(item, str):
            parts = _url_parts(item, where)
            if parts.hostname is None or parts.port is None:
                raise StoreConfigError(f"{where} has no host:port")
            nodes.append((parts.hostname, parts.port))
            credentials.append({"username": unquote(parts.username) if parts.username else None,
                                "password": unquote(parts.password) if parts.password is not None else None})
            continue
        if not isinstance(item, dict) or not item.get("host"):
            raise StoreConfigError(f"{where} has no host")
        port = item.get("port", 26379 if key == "sentinels" else 6379)
        if not isinstance(port, int) or not 0 < port < 65536:
            raise StoreConfigError(f"{where}.port is not a port number")
        nodes.append((str(item["host"]), port))
        credentials.append({"username": _optional_text(item, "username", where),
                            "password": _optional_text(item, "password", where)})
    if not nodes:
        raise StoreConfigError(f"{name}: {key} is empty")
    return nodes, credentials


def _first(values: list[str | None]) -> str | None:
    return next((v for v in values if v is not None), None)


def _sentinel(entry: dict, url: str, name: str, common: dict) -> StoreConfig:
    parts = _url_parts(url, name)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise StoreConfigError(f"{name}: with sentinels:, url must be redis://[:password@]<master name>[/db]")
    sentinels, credentials = _nodes(entry["sentinels"], "sentinels", name)
    db = parts.path.strip("/")
    password = common["password"] or (unquote(parts.password) if parts.password is not None else None)
    username = common["username"] or (unquote(parts.username) if parts.username else None)
    return StoreConfig(
        **common | {"username": username, "password": password},
        master_name=parts.hostname, sentinels=tuple(sentinels), db=int(db) if db.isdigit() else 0,
        ssl=parts.scheme == "rediss",
        sentinel_username=_optional_text(entry, "sentinel_username", name)
        or _first([c["username"] for c in credentials]),
        sentinel_password=_optional_text(entry, "sentinel_password", name)
        or _first([c["password"] for c in credentials]),
    )


def _cluster(entry: dict, name: str, common: dict) -> StoreConfig:
    nodes, credentials = _nodes(entry["cluster"], "cluster", name)
    return StoreConfig(
        **common | {"username": common["username"] or _first([c["username"] for c in credentials]),
                    "password": common["password"] or _first([c["password"] for c in credentials])},
        cluster=tuple(nodes),
    )


def config_dir_from(env: Mapping[str, str]) -> str | None:
    return env.get(ENV_CONFIG_DIR) or None


__all__ = [
    "DEFAULT", "FALLBACK", "STORES", "USES", "ENV_PREFIX", "StoreConfig", "StoreConfigError", "chain", "resolve",
    "redact_redis_url", "UNSHOWN_URL",
]
