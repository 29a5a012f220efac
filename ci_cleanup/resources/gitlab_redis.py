"""GitLab's Redis stores as one resource: each use (leases, artifact buckets, Sidekiq statuses) on its store."""

from __future__ import annotations

import os

import redis
from dagster import ConfigurableResource, InitResourceContext
from pydantic import Field, PrivateAttr

from ..gitlab.redis_stores import DEFAULT, USES, StoreConfig, StoreNotSet, config_dir_from, resolve
from .errors import NotConfigured, UnusableSetting, starting
from .redis_clients import close_client, store_client


class GitLabRedis(ConfigurableResource):
    """GitLab's Redis stores, each use on the store GitLab keeps it in, falling back as GitLab's stores do:
    leases in cluster_shared_state → shared_state → default, artifact buckets in shared_state → default, Sidekiq
    statuses in queues_metadata → queues → default (the default store is GitLab's ``resque.yml``).

    Each store is read from its variables (``CI_CLEANUP_REDIS_<STORE>_URL`` …), else from GitLab's files in
    ``config_dir`` (``CI_CLEANUP_GITLAB_CONFIG_DIR``); see :mod:`ci_cleanup.gitlab.redis_stores`. Variables are
    read when a run starts, never copied into run config. Stores that are one server share one client.
    """

    url: str | None = Field(
        default=None,
        description="The default store (GitLab's resque.yml), redis://… or unix://…; unset: env CI_CLEANUP_REDIS_URL, "
        "else the config folder's files",
    )
    queues_url: str | None = Field(
        default=None, description="GitLab's queues store (Sidekiq's Redis); unset: env CI_CLEANUP_REDIS_QUEUES_URL, "
        "else the config folder's files, else the default store",
    )
    config_dir: str | None = Field(
        default=None, description="GitLab's config folder (resque.yml, redis.yml, redis.<store>.yml); unset: env "
        "CI_CLEANUP_GITLAB_CONFIG_DIR",
    )

    _configs: dict[str, StoreConfig] = PrivateAttr(default_factory=dict)
    _clients: dict[str, object] = PrivateAttr(default_factory=dict)
    _held: dict[str, object] = PrivateAttr(default_factory=dict)  # key -> the ExclusiveLease the run holds

    def setup_for_execution(self, context: InitResourceContext) -> None:
        with starting(context, self) as connect:
            if connect:
                self._connect()

    def check_configured(self) -> None:
        """Raise :class:`NotConfigured` when a store's whereabouts are set nowhere, without connecting."""
        self.store_configs()

    def _connect(self) -> None:
        self._configs = self.store_configs()
        shared: dict[tuple, object] = {}
        try:
            for use, config in self._configs.items():
                if config.identity not in shared:
                    shared[config.identity] = store_client(config)
                self._clients[use] = shared[config.identity]
        except BaseException:
            for client in shared.values():
                close_client(client)
            raise

    def store_configs(self) -> dict[str, StoreConfig]:
        """Each use's store settings (``USES``), resolved as a run would, without connecting."""
        env = os.environ
        overrides = {DEFAULT: self.url, "queues": self.queues_url}
        config_dir = self.config_dir or config_dir_from(env)
        try:
            return {use: resolve(store, env, config_dir, overrides) for use, store in USES.items()}
        except StoreNotSet as e:
            raise NotConfigured(str(e)) from None
        except ValueError as e:  # ConfigFileError: one line naming the variable or the file and key
            raise UnusableSetting(str(e)) from None

    def hold_until_teardown(self, lease) -> None:
        """A lease the run took (an ``ExclusiveLease`` of its uuid): given back when the run's resources close
        unless the run gave it back itself (:meth:`given_back`), e.g. after a failed step, instead of held for its
        TTL. Every job runs its steps in the run's one process, whose resources close once, after the last step."""
        self._held[lease.redis_key] = lease

    def given_back(self, lease) -> None:
        self._held.pop(lease.redis_key, None)

    def teardown_after_execution(self, context: InitResourceContext) -> None:
        for key, lease in self._held.items():
            try:
                if lease.cancel():  # compare-and-delete: never a lease another process took since
                    context.log.info(f"Released lease {key}: the run ended without giving it back (a step failed)")
            except redis.RedisError as e:
                context.log.warning(f"Could not release lease {key} (it expires with its TTL): {e}")
        self._held = {}
        for client in {id(c): c for c in self._clients.values()}.values():
            close_client(client)

    def _client(self, use: str):
        assert use in self._clients, "GitLabRedis used outside a run"
        return self._clients[use]

    @property
    def leases(self) -> redis.Redis:
        """``Gitlab::ExclusiveLease``'s store: cluster_shared_state, falling back to shared_state, then default."""
        return self._client("leases")

    @property
    def artifact_buckets(self) -> redis.Redis:
        """The artifact buckets' store: shared_state, falling back to default."""
        return self._client("artifact_buckets")

    @property
    def sidekiq_status(self) -> redis.Redis:
        """``Gitlab::SidekiqStatus``' store: queues_metadata, falling back to queues, then default."""
        return self._client("sidekiq_status")

    def store_used(self, use: str) -> dict[str, str]:
        """For a run's metadata: ``{"redis_<use>": "<store> (<source>) at <where, no password>"}``."""
        config = self._configs[use]
        return {f"redis_{use}": f"{config.store}: {config.label} at {config.shown()}"}
