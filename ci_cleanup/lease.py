"""GitLab's ``ExclusiveLeaseGuard`` for a job: declared once, where the job is made
(``batch_job(..., lease=Lease(KEY, TTL))``), and never handled by its ops.

The first op takes it (:func:`ci_cleanup.batch.start`; a held lease skips the run, as GitLab's workers skip), the
run's loop renews it between batches (its brake calls :meth:`Lease.keeper`'s renewal), and the last op gives it back
(:func:`ci_cleanup.batch.finish`). After a failed step the run's Redis resource gives it back when it closes. A
run's lease value is its Dagster run id (a uuid, as GitLab's leases hold), so nothing ever releases another run's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .gitlab.exclusive_lease import ExclusiveLease


@dataclass(frozen=True)
class Lease:
    """A job's ``Gitlab::ExclusiveLease``: its key, TTL and ``in_lock``'s retries."""

    key: str
    ttl_seconds: int
    retries: int = 0
    retry_sleep_seconds: float = 1.0  # ExclusiveLeaseHelpers sleeps between tries
    renew_every_seconds: float | None = None  # unset: a tenth of the TTL

    def of_run(self, run_id: str, client) -> ExclusiveLease:
        return ExclusiveLease(client, self.key, self.ttl_seconds, uuid=run_id)

    def obtain(self, lease: ExclusiveLease) -> bool:
        for attempt in range(self.retries + 1):
            if lease.try_obtain():
                return True
            if attempt < self.retries:
                time.sleep(self.retry_sleep_seconds)
        return False

    def keeper(self, lease: ExclusiveLease, clock: Callable[[], float] = time.monotonic) -> Callable[[], None]:
        """Called after each batch: once a tenth of the TTL has passed since the lease was last taken or renewed,
        renews it, or stops the run if another process has it now.

        GitLab's workers never renew (``in_lock`` holds the lease for its TTL, longer than the run may last: run
        monitoring fails a run that outlives it). Renewing still finds a lease deleted or taken by hand, within a
        tenth of the TTL, and keeps it held whatever a batch costs; a Redis round trip per batch would not.
        """
        where = getattr(lease.client, "server", None) or "Redis"
        every = self.ttl_seconds / 10 if self.renew_every_seconds is None else self.renew_every_seconds
        last = clock()

        def renew() -> None:
            nonlocal last
            if clock() - last < every:
                return
            if not lease.renew():
                raise RuntimeError(
                    f"Lost lease {self.key} in {where} mid-run; stopping so that two runs never work at once"
                )
            last = clock()

        return renew


DECLARED: dict[str, Lease] = {}  # job name -> its lease; a test may set one with monkeypatch.setitem


def declare(job_name: str, lease: Lease) -> None:
    """The lease ``job_name``'s runs take (:func:`ci_cleanup.batch.batch_job` declares it with the job)."""
    DECLARED[job_name] = lease


def of_job(job_name: str) -> Lease | None:
    return DECLARED.get(job_name)


@dataclass(frozen=True)
class RunLease:
    """The lease a run holds (renewed by the run's brake after each batch: :meth:`Lease.keeper`), given back once."""

    held: ExclusiveLease
    resource: object  # the run's GitLabRedis: gives the lease back when it closes, unless the run did

    def give_back(self) -> None:
        self.held.cancel()
        self.resource.given_back(self.held)
