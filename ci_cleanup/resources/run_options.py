"""What applies to a whole run (dry run, brake), and the resources a run started in process gets."""

from __future__ import annotations

import os

from dagster import ConfigurableResource
from pydantic import Field

from ..gitlab.loop_helpers import Brake
from ..gitlab.pacing import Pacer
from .gitlab_database import GitLabDatabase
from .gitlab_redis import GitLabRedis

DUTY_CYCLE_ENV = "CI_CLEANUP_DUTY_CYCLE"
THROTTLE_ENV = "CI_CLEANUP_THROTTLE"
THROTTLES = ("adaptive", "off")
APDEX_URL_ENV = "CI_CLEANUP_PROMETHEUS_APDEX_URL"  # only from the environment: a URL may hold credentials


class RunOptions(ConfigurableResource):
    """Settings that apply to the whole run, set once in the Launchpad or a run config file."""

    dry_run: bool = Field(
        default=False,
        description="Find and report exactly what would change, and write nothing: no rows, leases or buckets",
    )
    # Bounds checked by brake() as the first op starts, not by pydantic here: a resource whose config fails to build
    # stops `dagster job execute` with Dagster's own traceback, where the op's check is the run's one-line failure.
    duty_cycle: float | None = Field(
        default=None,
        description="The brake, more than 0 and at most 1: the share of the run's time spent in batches. After each "
                    "batch the run pauses for the batch's time × (1 − duty_cycle) / duty_cycle, leaving the database "
                    f"to GitLab's own traffic. Unset: env {DUTY_CYCLE_ENV}, else 1 (no pause). docs/configuration.md, "
                    "\"The brake\"",
    )

    throttle: str | None = Field(
        default=None,
        description="Pacing by the database's health: 'adaptive' (after each batch a pause and the next batch's "
                    f"size from its signals) or 'off'. Unset: env {THROTTLE_ENV}, else adaptive. "
                    "docs/configuration.md, \"Pacing\"",
    )

    def brake(self) -> Brake:
        """A new brake for one run: ``duty_cycle``, else the environment's (the schedules' runs), else none; with
        the run's pacer unless pacing is off."""
        return Brake(self._duty_cycle(), pacer=Pacer() if self._throttle() == "adaptive" else None)

    def _duty_cycle(self) -> float:
        if self.duty_cycle is not None:
            return Brake(self.duty_cycle).duty_cycle  # refused out of (0, 1], in one line
        raw = os.environ.get(DUTY_CYCLE_ENV, "").strip()
        try:
            return Brake(float(raw) if raw else 1.0).duty_cycle
        except ValueError:  # not a number, or out of (0, 1]
            raise ValueError(f"{DUTY_CYCLE_ENV} must be a number above 0 and at most 1, not {raw!r}") from None

    def _throttle(self) -> str:
        raw = self.throttle if self.throttle is not None else os.environ.get(THROTTLE_ENV, "")
        throttle = raw.strip().lower() or "adaptive"
        if throttle not in THROTTLES:
            where = "run_options.throttle" if self.throttle is not None else THROTTLE_ENV
            raise ValueError(f"{where} must be adaptive or off, not {raw!r}")
        return throttle


def job_resources(
    database_url: str | None, redis_url: str | None, *, ci_database_url: str | None = None,
    queues_url: str | None = None, dry_run: bool = False,
) -> dict[str, ConfigurableResource]:
    """The resources every job runs with, for a run started in process (CLI, tests, benchmark); a URL not given
    is read from its variable or GitLab's config files when the run starts."""
    return {
        "gitlab_db": GitLabDatabase(url=database_url, ci_url=ci_database_url),
        "gitlab_redis": GitLabRedis(url=redis_url, queues_url=queues_url),
        "run_options": RunOptions(dry_run=dry_run),
    }
