"""The two external systems a batch touches: GitLab's PostgreSQL and GitLab's Redis, as Dagster resources.

Engines and clients are built in ``setup_for_execution`` (once per step process, never at import) with small
pools, and checked there, so an unreachable server fails the step with a message that names the server, without
its password. One module per concern: :mod:`.errors`, :mod:`.gitlab_database`, :mod:`.redis_clients`,
:mod:`.gitlab_redis`, :mod:`.run_options`.
"""

from ..gitlab.redis_stores import UNSHOWN_URL, redact_redis_url
from .errors import (
    AuthenticationFailed,
    DatabaseUnavailable,
    NotConfigured,
    RedisRefused,
    RedisUnavailable,
    ServiceUnavailable,
    StatementTimeout,
    UnusableSetting,
    starting,
    unreachable,
)
from .gitlab_database import CI_DATABASE_ENV, GitLabDatabase, WrongDatabase, database_url
from .gitlab_redis import GitLabRedis
from .redis_clients import FAILOVER_SECONDS, close_client, redis_client, store_client
from .run_options import DUTY_CYCLE_ENV, RunOptions, job_resources

__all__ = [
    "AuthenticationFailed", "CI_DATABASE_ENV", "DUTY_CYCLE_ENV", "DatabaseUnavailable", "FAILOVER_SECONDS",
    "GitLabDatabase", "GitLabRedis", "NotConfigured", "RedisRefused", "RedisUnavailable", "RunOptions",
    "ServiceUnavailable", "StatementTimeout", "UNSHOWN_URL", "UnusableSetting", "WrongDatabase", "close_client",
    "database_url", "job_resources", "redact_redis_url", "redis_client", "starting", "store_client", "unreachable",
]
