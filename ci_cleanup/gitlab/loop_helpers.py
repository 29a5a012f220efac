"""GitLab's ``LoopHelpers#loop_until``: the loop limits every batch job shares, written once, with a brake; and the
:class:`Hooks` every batch service takes."""

from __future__ import annotations

import datetime as dt
import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .pacing import Pacer
from .schema import utc_now


class LoopEnd(enum.Enum):
    """How :func:`loop_until` ended: the body said it was done, or a limit stopped it first."""

    DONE = "done"
    LIMIT = "limit"
    TIMEOUT = "timeout"

    @property
    def limit_reached(self) -> bool:
        return self is not LoopEnd.DONE


@dataclass
class Brake:
    """A pause after each batch in proportion to the batch's own time, so that a job works ``duty_cycle`` of the
    time and leaves the rest to GitLab's own traffic. GitLab's crons have none; its batched background migrations
    pace themselves to the database the same way (their batch optimizer aims at a time per batch). A slower
    database makes longer batches, hence longer pauses. ``duty_cycle=1``: no pause.

    One brake serves a whole run (the bulk delete's bucket workers share it): it adds up the pauses it made. It also
    keeps what a run holds between its batches: ``keep`` (the run's lease, renewed) is called after each batch.
    ``pacer``: the run's pacing by the database's health (:mod:`~ci_cleanup.gitlab.pacing`), which also sizes the
    batches; the pause after a batch is the longer of the two. ``cut_short``: how often a loop of the run ended on
    a seed's limit (time or loops) with work left."""

    duty_cycle: float = 1.0
    paused_seconds: float = 0.0
    keep: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    pacer: Pacer | None = field(default=None, repr=False, compare=False)
    cut_short: dict[str, int] = field(default_factory=dict, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 < self.duty_cycle <= 1:
            raise ValueError(f"duty_cycle must be in (0, 1], not {self.duty_cycle}")

    def pause_after(self, batch_seconds: float) -> float:
        return batch_seconds * (1 - self.duty_cycle) / self.duty_cycle

    def hold(self, batch_seconds: float, sleep: Callable[[float], None] = time.sleep) -> float:
        """Pause after a batch of ``batch_seconds``; returns the pause."""
        if self.keep is not None:
            self.keep()
        pause = self.pause_after(batch_seconds)
        if self.pacer is not None:
            pause = max(pause, self.pacer.after_batch(batch_seconds))
        if pause > 0:
            sleep(pause)
            with self._lock:
                self.paused_seconds += pause
        return pause

    def next_batch_size(self, default: int) -> int:
        """The next batch's size: the seed's ``default``, or less while the run's pacing says so."""
        return default if self.pacer is None else self.pacer.next_batch_size(default)

    def ended(self, end: LoopEnd) -> None:
        if end.limit_reached:
            with self._lock:
                self.cut_short[end.value] = self.cut_short.get(end.value, 0) + 1

    def window(self) -> dict[str, float | int]:
        """The pacing since the last call, for a run's observation (:class:`~ci_cleanup.runs.BatchObserver`)."""
        return {} if self.pacer is None else self.pacer.window()

    @property
    def metadata(self) -> dict[str, object]:
        """What a braked run reports in its totals: the duty cycle and all the run's pauses, and a seed's limit that
        cut the run short (the next run goes on from there); nothing for a run with neither."""
        meta: dict[str, object] = {}
        if self.duty_cycle != 1:
            meta.update(duty_cycle=self.duty_cycle, paused_seconds=round(self.paused_seconds, 3))
        if self.cut_short:
            meta["cut_short_by_seed_limit"] = dict(self.cut_short)
        return meta

    @property
    def pacing_metadata(self) -> dict[str, object]:
        """How the run was paced (:attr:`Pacer.metadata`); nothing when pacing is off."""
        return {} if self.pacer is None else self.pacer.metadata


def loop_until(
    body: Callable[[], bool], *, timeout: float | None = None, limit: int = 1_000_000, brake: Brake | None = None,
    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
) -> LoopEnd:
    """Call ``body`` until it returns False (done), at most ``limit`` times or until ``timeout`` seconds have passed,
    pausing after each call as ``brake`` says.

    As GitLab's: the time is checked after each call, so a call is never cut short, and a slow first one still runs.
    """
    end = _loop(body, timeout, limit, brake, clock, sleep)
    if brake is not None:
        brake.ended(end)
    return end


def _loop(
    body: Callable[[], bool], timeout: float | None, limit: int, brake: Brake | None, clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> LoopEnd:
    started = began = clock()
    for _ in range(limit):
        if not body():
            return LoopEnd.DONE
        now = clock()  # once a call, as GitLab's: the batch's end is the next one's start, but for the pause
        if timeout is not None and now - started > timeout:
            return LoopEnd.TIMEOUT
        pause = brake.hold(now - began, sleep) if brake is not None else 0
        began = now + pause
    return LoopEnd.LIMIT


@dataclass(frozen=True)
class Hooks:
    """What a batch service calls back and reads the time from: the same object for every service, built by its job's
    process op. Each service is ``service(<its stores>, limits, hooks)``: ``limits`` are its seed's numbers and
    cut-offs, built by the job's find op; these are the run's."""

    on_batch: Callable[..., None] = lambda *batch: None  # after each batch, with what it did
    report_error: Callable[[int, BaseException], None] = lambda row_id, error: None  # GitLab's error tracking
    brake: Brake | None = None  # the run's pause after each batch (RunOptions.duty_cycle), which keeps its lease
    now: Callable[[], dt.datetime] = utc_now
    clock: Callable[[], float] = time.monotonic
    stop: threading.Event | None = None  # set: the run is being terminated; no batch starts after it

    def sleep(self, seconds: float) -> None:
        """The pause after a batch, cut short when the run is terminated: a worker's thread gets no signal."""
        if self.stop is None:
            time.sleep(seconds)
        else:
            self.stop.wait(seconds)

    def batch_size(self, default: int) -> int:
        """The size of the next batch: the seed's ``default`` (the most), or less while the run's pacing says so."""
        return default if self.brake is None else self.brake.next_batch_size(default)


NO_HOOKS = Hooks()  # a service called with nothing to call back (tests, the benchmark)
