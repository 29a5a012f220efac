"""GitLab's ``LimitedCapacity::Worker`` as threads of the caller: the mechanism alone, without a database."""

from __future__ import annotations

import threading

import pytest

from ci_cleanup.gitlab import limited_capacity


class ShelfWorkersFailed(limited_capacity.WorkersFailed):
    what = "shelf worker"
    note = " (its shelf stays as it was)"


def test_each_worker_runs_at_once_hands_its_progress_to_the_callers_thread_and_results_come_by_slot():
    caller = threading.current_thread()
    started, seen, ended = threading.Barrier(3, timeout=30), [], []

    def perform_work(slot, hand_over, stop):
        started.wait()  # all three at once, or none gets past here
        for step in range(slot + 1):
            hand_over((slot, step))
        return f"done {slot}"

    results = limited_capacity.perform_with_capacity(3, perform_work, limited_capacity.Hooks(
        on_progress=lambda slot, item: seen.append((slot, item, threading.current_thread() is caller)),
        on_ended=lambda together: ended.append(dict(together)),
    ))

    assert results == ["done 0", "done 1", "done 2"]
    assert sorted(seen) == [(0, (0, 0), True), (1, (1, 0), True), (1, (1, 1), True), (2, (2, 0), True),
                            (2, (2, 1), True), (2, (2, 2), True)]
    assert [item for slot, item, _ in seen if slot == 2] == [(2, 0), (2, 1), (2, 2)]  # each worker's in its order
    assert {slot: result for together in ended for slot, result in together.items()} == {
        0: "done 0", 1: "done 1", 2: "done 2"}


def test_a_failing_worker_is_reported_the_others_finish_and_the_cause_is_named_once():
    finished = []

    def perform_work(slot, hand_over, stop):
        if slot in (1, 3):
            raise ConnectionError("shelf server lost")
        if slot == 2:
            raise ValueError("shelf 2 is bent")
        finished.append(slot)
        return slot

    ended = {}
    with pytest.raises(ShelfWorkersFailed) as failure:
        limited_capacity.perform_with_capacity(5, perform_work, limited_capacity.Hooks(
            on_progress=lambda slot, item: None, on_ended=ended.update), ShelfWorkersFailed)

    assert str(failure.value) == (
        "shelf workers 1, 3 failed: ConnectionError: shelf server lost; shelf worker 2 failed: ValueError: shelf 2 is "
        "bent (its shelf stays as it was)")
    assert isinstance(failure.value.__cause__, ConnectionError)  # the first failure's
    assert sorted(finished) == [0, 4]
    assert sorted(ended) == [0, 1, 2, 3, 4] and isinstance(ended[2], ValueError)


def test_an_interrupted_caller_stops_its_workers_and_hands_on_where_they_stopped():
    working, ended, stopping = threading.Barrier(3, timeout=30), {}, []

    def perform_work(slot, hand_over, stop):
        if slot == 2:  # the caller's interruption, once the two others are inside their work
            working.wait()
            raise_in_caller.set()
            return "never reported"
        working.wait()
        stop.wait(30)  # the unit of work in progress ends when told to stop
        hand_over(f"{slot} stopped")
        return f"worker {slot} stopped"

    raise_in_caller = threading.Event()

    def on_ended(together):
        ended.update(together)
        if raise_in_caller.is_set() and 2 in together:
            raise KeyboardInterrupt  # what Dagster raises in the op's thread when its run is terminated

    progress = []
    with pytest.raises(KeyboardInterrupt):
        limited_capacity.perform_with_capacity(3, perform_work, limited_capacity.Hooks(
            on_progress=lambda slot, item: progress.append(item), on_ended=on_ended,
            on_stopping=lambda: stopping.append(True)))

    assert stopping == [True]
    assert sorted(progress) == ["0 stopped", "1 stopped"]
    assert ended == {0: "worker 0 stopped", 1: "worker 1 stopped", 2: "never reported"}
