"""The election's deadline watchdog, seen from the runs: it checks the lease deadline every
``WATCH_STEP_S`` only while a run in flight may wait on ``leadership_lost`` (so that a system
suspend cannot delay the signal), and costs the runs that never ask for it no wake-up. On the
fake clock and the memory store."""

from __future__ import annotations

import asyncio

import pytest
from test_runner import Factory, clock, engine, make

from fastapi_singletonjob import JobContext
from fastapi_singletonjob._timing import WATCH_STEP_S
from fastapi_singletonjob.testing import FakeClock

__all__ = ["clock", "make"]  # fixtures


async def test_runs_that_never_ask_for_leadership_lost_do_not_wake_the_watchdog(
    make: Factory, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = make()  # heartbeat 1 s
    runs: list[int] = []

    @jobs.fixed_rate("tick", every=0.25)
    async def tick(ctx: JobContext) -> None:
        runs.append(ctx.iteration)
        await clock.sleep(0.2)

    await jobs.start()
    await clock.advance(2.0)
    terms = engine(jobs).elector.terms
    watchdog_sleep_s = terms.watchdog_sleep_s
    steps: list[float] = []

    def counted(idle_s: float) -> float:
        steps.append(idle_s)
        return watchdog_sleep_s(idle_s)

    monkeypatch.setattr(terms, "watchdog_sleep_s", counted)
    before = len(runs)
    await clock.advance(5.0)
    assert len(runs) - before >= 18
    # One step per election round (each moves the deadlines), not one or more per run (the
    # old watchdog woke at every run's start, then every 100 ms while it ran).
    assert len(steps) <= 7, f"{len(steps)} watchdog steps for {len(runs) - before} runs"
    assert not terms.watchdog_polls


async def test_leadership_lost_asked_during_a_run_is_set_right_after_a_suspend(
    make: Factory, clock: FakeClock
) -> None:
    # Heartbeats far apart: no election round (which also wakes the watchdog) between the
    # ask and the suspend.
    jobs = make(heartbeat_interval=5.0, lock_expiry=15.0)
    asked: asyncio.Future[asyncio.Event] = asyncio.get_running_loop().create_future()

    @jobs.fixed_rate("long", every=60.0)
    async def long(ctx: JobContext) -> None:
        await clock.sleep(0.5)  # the run is in flight, and has not asked yet
        asked.set_result(ctx.leadership_lost)
        await clock.sleep(30.0)

    clock.jump_wall(-0.5)  # the first tick comes 0.5 s after start
    await jobs.start()
    await clock.advance(1.2)
    assert asked.done(), "the run asked for leadership_lost"
    lost = asked.result()
    assert not lost.is_set()
    clock.suspend(60.0)  # the lease is long gone; no timer of the event loop has fired
    await clock.advance(WATCH_STEP_S + 0.01)
    # Watched from the ask on: set within a watchdog step of the resume, not a heartbeat.
    assert lost.is_set()
