"""GitLab's ``LimitedCapacity::Worker`` (``app/workers/concerns/limited_capacity/worker.rb``), written once.

What is mirrored: ``perform_with_capacity`` starts ``max_running_jobs`` workers at once, each doing its
``perform_work``; a worker that raises is reported and disabled until the next schedule run, and the others go
on (GitLab's ``retry: 0``: the cron worker is the retry). Here the workers are threads of the caller, because
only the caller's thread may report (Dagster's context): the workers hand it what they do through a queue. An
interrupted caller (a terminated run) tells them to stop, and waits until each has ended the unit of work it
is in.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from sqlalchemy.exc import DBAPIError

R = TypeVar("R")
# A worker: perform_work(slot, hand_over, stop) -> its result. ``hand_over(item)`` passes an item of progress to the
# caller's thread; ``stop`` is set when the caller is interrupted: the worker then ends what it is doing and returns.
Work = Callable[[int, Callable[[object], None], threading.Event], R]
Outcome = object  # a worker's result, or the error it raised


def cause(error: BaseException) -> str:
    """A worker's error as its type and message: a database error's own, without SQLAlchemy's copy of the
    statement."""
    if isinstance(error, DBAPIError) and error.orig is not None:
        error = error.orig
    return f"{type(error).__name__}: {str(error).strip()}"


class WorkersFailed(RuntimeError):
    """Some workers raised and the others finished: each slot with its cause, a cause shared by several named once.

    A subclass names its workers (``what``) and says what a failure leaves behind (``note``).
    """

    what = "worker"
    note = ""

    @classmethod
    def of(cls, failed: dict[int, BaseException]) -> WorkersFailed:
        by_cause: dict[str, list[str]] = {}  # workers that lost the same server fail alike
        for slot, error in sorted(failed.items()):
            by_cause.setdefault(cause(error), []).append(str(slot))
        return cls("; ".join(
            f"{cls.what}{'s' * (len(slots) > 1)} {', '.join(slots)} failed: {why}" for why, slots in by_cause.items()
        ) + cls.note)


@dataclass(frozen=True)
class Hooks:
    """What the caller's thread does with the workers' news, in the order it comes."""

    on_progress: Callable[[int, object], None]  # an item a worker handed over: (slot, item)
    on_ended: Callable[[dict[int, Outcome]], None]  # the workers that ended together: slot -> result or error
    on_stopping: Callable[[], None] = lambda: None  # the caller was interrupted; the workers are told to stop


def perform_with_capacity(
    capacity: int, perform_work: Work[R], hooks: Hooks, failed: type[WorkersFailed] = WorkersFailed
) -> list[R]:
    """Run workers ``0 .. capacity - 1`` at once, each ``perform_work(slot, hand_over, stop)`` in a thread, and
    return their results by slot. A worker that raises does not stop the others: once all have ended, ``failed``
    is raised naming every failure (from the first one). Interrupted, the caller sets ``stop``, waits for the
    workers, hands on what they reported meanwhile, and raises the interruption."""
    handed_over: queue.Queue[tuple[int, bool, object]] = queue.Queue()  # (slot, ended, item or outcome)
    stop = threading.Event()
    ended: dict[int, Outcome] = {}

    def run(slot: int) -> None:
        try:
            handed_over.put((slot, True, perform_work(slot, lambda item: handed_over.put((slot, False, item)), stop)))
        except BaseException as error:  # reported on the caller's thread; the other workers go on
            handed_over.put((slot, True, error))

    def take(news: tuple[int, bool, object]) -> None:
        """One piece of news and every other one already there: workers that ended together are reported at once."""
        together: dict[int, Outcome] = {}
        while True:
            slot, done, item = news
            if done:
                together[slot] = item
            else:
                hooks.on_progress(slot, item)
            try:
                news = handed_over.get_nowait()
            except queue.Empty:
                break
        ended.update(together)
        if together:
            hooks.on_ended(together)

    with ThreadPoolExecutor(capacity, thread_name_prefix="limited_capacity_worker") as pool:
        try:
            for slot in range(capacity):
                pool.submit(run, slot)
            while len(ended) < capacity:
                take(handed_over.get())
        except BaseException:  # the caller is interrupted (a terminated run)
            stop.set()
            hooks.on_stopping()
            pool.shutdown(cancel_futures=True)  # each worker ends what it is doing; none starts again
            if not handed_over.empty():
                take(handed_over.get_nowait())  # where each one stopped
            raise
    errors = {slot: outcome for slot, outcome in ended.items() if isinstance(outcome, BaseException)}
    if errors:
        raise failed.of(errors) from errors[min(errors)]
    return [ended[slot] for slot in range(capacity)]
