"""ci_cleanup: GitLab's CI/CD housekeeping batches as Dagster jobs."""

from .definitions import defs

__all__ = ["defs"]
