"""The ticker's timer (``_aio.Pacer``) on the real event loop: steps come after the delay
the previous one asked for, a ring cuts a long delay short, a failing step ends the drive,
and a run started by a step begins in the very next loop iteration."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from waiting import wait_until

from fastapi_singletonjob._aio import Pacer
from fastapi_singletonjob._clock import SYSTEM_CLOCK
from fastapi_singletonjob.testing import FakeClock

LONG_S = 30.0


def count_iterations() -> Callable[[], int]:
    """The number of event loop iterations from now on (a callback that calls itself soon)."""
    loop = asyncio.get_running_loop()
    count = 0

    def tick() -> None:
        nonlocal count
        count += 1
        loop.call_soon(tick)

    loop.call_soon(tick)
    return lambda: count


async def test_a_ring_cuts_a_long_delay_short_and_a_ring_inside_a_step_adds_no_step() -> None:
    pacer = Pacer(SYSTEM_CLOCK)
    steps: list[float] = []

    def step() -> float:
        steps.append(SYSTEM_CLOCK.monotonic())
        pacer.ring()  # inside a step: the delay returned below stands
        return LONG_S

    driving = asyncio.create_task(pacer.drive(step))
    await wait_until(lambda: len(steps) == 1, 5, "the first step")
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(steps) == 1
    pacer.ring()
    await wait_until(lambda: len(steps) == 2, 5, "a step after the ring")
    driving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await driving
    pacer.ring()  # no longer driving: nothing happens
    await asyncio.sleep(0.01)
    assert len(steps) == 2


async def test_steps_come_after_the_delay_asked_for() -> None:
    pacer = Pacer(SYSTEM_CLOCK)
    steps: list[float] = []

    def step() -> float:
        steps.append(SYSTEM_CLOCK.monotonic())
        return 0.05

    driving = asyncio.create_task(pacer.drive(step))
    await wait_until(lambda: len(steps) >= 3, 5, "three steps")
    driving.cancel()
    assert all(b - a >= 0.049 for a, b in zip(steps, steps[1:], strict=False))


@pytest.mark.parametrize("clock", [SYSTEM_CLOCK, FakeClock()], ids=["system", "fake"])
async def test_a_failing_step_ends_the_drive_with_its_error(clock: object) -> None:
    pacer = Pacer(clock)  # type: ignore[arg-type]
    calls = 0

    def step() -> float:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise ValueError("broken schedule")
        return 0.0

    with pytest.raises(ValueError, match="broken schedule"):
        await asyncio.wait_for(pacer.drive(step), 5)
    assert calls == 3


async def test_steps_run_from_the_loops_timer_with_no_task_to_wake_in_between() -> None:
    """A run that a step starts begins one loop iteration after the timer fires, as the body
    of a bare ``asyncio.sleep`` loop does (the floor of the precision bench)."""
    loop = asyncio.get_running_loop()
    iterations = count_iterations()
    pacer = Pacer(SYSTEM_CLOCK)
    seen: dict[str, object] = {}

    async def run() -> None:
        seen["run"] = iterations()

    def step() -> float:
        if "step" in seen:
            return LONG_S
        seen["step"] = iterations()
        seen["task"] = asyncio.current_task()
        loop.create_task(run())
        return LONG_S

    driving = asyncio.create_task(pacer.drive(step))
    await wait_until(lambda: "run" in seen, 5, "the run to begin")
    driving.cancel()
    assert seen["task"] is None
    assert seen["run"] == seen["step"] + 1  # type: ignore[operator]


async def test_a_delay_within_spin_s_is_waited_by_yielding_and_a_longer_one_by_the_timer() -> None:
    """``precision``'s busy wait: a step asking for at most ``spin_s`` comes again in the
    very next loop iteration (no epoll timeout, which wakes up to a millisecond late), a
    step asking for more waits on the loop's timer."""
    iterations = count_iterations()
    pacer = Pacer(SYSTEM_CLOCK, spin_s=LONG_S)
    at: list[int] = []

    def step() -> float:
        at.append(iterations())
        return LONG_S if len(at) < 5 else 2 * LONG_S

    driving = asyncio.create_task(pacer.drive(step))
    await wait_until(lambda: len(at) == 5, 5, "five steps")
    for _ in range(20):
        await asyncio.sleep(0)
    driving.cancel()
    assert at == list(range(at[0], at[0] + 5)), "one step per loop iteration"
