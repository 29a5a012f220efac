"""GitLab's loop_until, and the brake between batches, on a clock the test moves."""

import pytest

from ci_cleanup.gitlab.loop_helpers import Brake, LoopEnd, loop_until


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def batches(clock: Clock, seconds: list[float]):
    """A body whose calls take these times, then says it is done."""
    left = list(seconds)

    def body() -> bool:
        if not left:
            return False
        clock.now += left.pop(0)
        return True

    return body


def test_the_body_saying_it_is_done_ends_the_loop():
    clock = Clock()
    assert loop_until(batches(clock, [1, 1]), clock=clock, sleep=clock.sleep) is LoopEnd.DONE
    assert clock.slept == []


def test_the_limit_stops_after_that_many_calls():
    clock, calls = Clock(), []
    assert loop_until(lambda: calls.append(1) or True, limit=3, clock=clock) is LoopEnd.LIMIT
    assert len(calls) == 3


def test_the_timeout_is_checked_after_each_call_so_a_slow_first_call_still_runs():
    clock = Clock()
    end = loop_until(batches(clock, [10, 10, 10]), timeout=5, clock=clock, sleep=clock.sleep)
    assert end is LoopEnd.TIMEOUT and end.limit_reached
    assert clock.now == 10


def test_a_brake_pauses_in_proportion_to_each_batch():
    clock = Clock()
    loop_until(batches(clock, [2, 4]), brake=Brake(duty_cycle=0.5), clock=clock, sleep=clock.sleep)
    assert clock.slept == [2, 4]


def test_the_pauses_count_against_the_timeout():
    clock = Clock()
    end = loop_until(batches(clock, [2, 2, 2]), timeout=5, brake=Brake(duty_cycle=0.5), clock=clock,
                     sleep=clock.sleep)
    assert end is LoopEnd.TIMEOUT
    assert clock.slept == [2]


@pytest.mark.parametrize("duty_cycle", [0, -0.5, 1.5])
def test_a_brake_outside_0_to_1_is_refused(duty_cycle):
    with pytest.raises(ValueError, match="duty_cycle must be in"):
        Brake(duty_cycle=duty_cycle)
