"""A blocking ``async def`` job is named, not the jobs it delays (issue 29, item 4): each step of
an async job's code is timed on the real clock; a step that holds the event loop gets a WARNING
naming that job and run, and the slow-run warning of a job it delayed says which run held the
loop. On the real clock and the memory store (the blocking is real)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from waiting import wait_until

from fastapi_singletonjob import JobContext, SingletonJobs
from fastapi_singletonjob._run.holds import HOLD_WARN_S, timed_steps

BLOCK_S = 2 * HOLD_WARN_S


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


async def test_the_job_that_blocks_the_loop_is_named_not_the_one_it_delays(
    caplog: pytest.LogCaptureFixture,
) -> None:
    jobs = SingletonJobs("memory://", project="holds", heartbeat_interval=0.2, lock_expiry=1.0)
    blocked: list[float] = []

    @jobs.fixed_rate("blocker", 1.0)
    async def blocker(ctx: JobContext) -> None:
        await asyncio.sleep(0)
        if not blocked:
            blocked.append(time.perf_counter())
            time.sleep(BLOCK_S)  # noqa: ASYNC251 - the mistake under test

    @jobs.fixed_rate("innocent", 0.1)
    async def innocent(ctx: JobContext) -> None:
        await asyncio.sleep(0.02)

    with caplog.at_level(logging.WARNING, logger="fastapi_singletonjob"):
        async with jobs:
            await wait_until(
                lambda: any("'innocent': a run took" in m for m in messages(caplog)),
                timeout_s=10,
                what="the delayed job's slow-run warning",
            )
    held = [m for m in messages(caplog) if "held the event loop" in m and "run #" in m]
    assert held, messages(caplog)
    assert all(m.startswith("job 'blocker' run #") for m in held if " held the event " in m[:40])
    assert any(m.startswith("job 'blocker' run #1 held the event loop for 0.") for m in held)
    (slow,) = [m for m in messages(caplog) if "'innocent': a run took" in m]
    assert "but job 'blocker' run #1 held the event loop" in slow


async def test_timed_steps_pass_results_errors_and_cancels_through() -> None:
    """The wrapper drives the job's coroutine as its task would: values sent back into it,
    errors raised in it, a cancel thrown into it (its cleanup runs), an error out of it."""
    seen: list[str] = []

    async def job() -> None:
        try:
            await asyncio.sleep(0)
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise
        finally:
            seen.append("cleanup")

    task = asyncio.ensure_future(timed_steps(job(), "j", 1, lambda: True))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cancelled", "cleanup"]

    async def fails() -> None:
        await asyncio.sleep(0)
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await timed_steps(fails(), "j", 2, lambda: True)
