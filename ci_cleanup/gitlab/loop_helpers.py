"""GitLab's ``LoopHelpers#loop_until``: the loop limits every batch job shares, written once."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class LoopEnd(enum.Enum):
    """How :func:`loop_until` ended: the body said it was done, or a limit stopped it first."""

    DONE = "done"
    LIMIT = "limit"
    TIMEOUT = "timeout"

    @property
    def limit_reached(self) -> bool:
        return self is not LoopEnd.DONE


def loop_until(
    body: Callable[[], bool], *, timeout: float | None = None, limit: int = 1_000_000,
    clock: Callable[[], float] = time.monotonic,
) -> LoopEnd:
    """Call ``body`` until it returns False (done), at most ``limit`` times or until ``timeout`` seconds have passed.

    As GitLab's: the time is checked after each call, so a call is never cut short, and a slow first one still runs.
    """
    started = clock()
    for _ in range(limit):
        if not body():
            return LoopEnd.DONE
        if timeout is not None and clock() - started > timeout:
            return LoopEnd.TIMEOUT
    return LoopEnd.LIMIT
