"""Helpers for tests of whole ``SingletonJobs`` nodes on a ``FakeClock``: stopping one while
the clock moves, and killing one as the other nodes would see a crash."""

from __future__ import annotations

import asyncio

from fastapi_singletonjob import SingletonJobs
from fastapi_singletonjob.testing import FakeClock


async def stop(jobs: SingletonJobs, clock: FakeClock, step_s: float = 0.05) -> None:
    """Stop ``jobs`` while the fake clock keeps moving (the drain waits on it)."""
    task = asyncio.create_task(jobs.stop())
    while not task.done():
        await clock.advance(step_s)
    await task


def kill(jobs: SingletonJobs) -> None:
    """Stop renewing and ticking, without releasing anything: a hard kill, as the other nodes
    see it (the runs in flight go on)."""
    engine = jobs.engine
    assert engine is not None and engine.election_task is not None
    assert engine.timer_task is not None
    engine.election_task.cancel()
    engine.timer_task.cancel()
