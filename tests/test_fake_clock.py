"""``FakeClock`` as a user's test meets it (issue 29, item 8): advancing time waits for the runs
it starts, sync (``def``) jobs in their threads included, so a count of runs is exact."""

from __future__ import annotations

import time

from fastapi_singletonjob import JobContext, SingletonJobs
from fastapi_singletonjob.testing import FakeClock


async def runs_of_a_sync_interval_job(clock: FakeClock) -> int:
    """Runs of a ``def`` job every 10 s (run, then wait) in 35 s: at 0, 10, 20 and 30 s."""
    jobs = SingletonJobs("memory://", project="fake-clock", clock=clock)
    runs: list[float] = []

    @jobs.interval("work", every=10)
    def work(ctx: JobContext) -> None:
        time.sleep(0.003)  # real work in the thread, as a user's job does
        runs.append(clock.monotonic())

    async with jobs:
        await clock.advance(35)
    return len(runs)


async def test_advance_waits_for_sync_runs_so_the_count_is_exact() -> None:
    counts = [await runs_of_a_sync_interval_job(FakeClock()) for _ in range(10)]
    assert counts == [4] * 10


async def test_a_sync_run_held_past_thread_wait_s_is_left_running() -> None:
    """``thread_wait_s=0``: advance does not wait for threads (the runs then fall behind the
    time advanced, as before the fix: a test can tell the two apart)."""
    counts = [await runs_of_a_sync_interval_job(FakeClock(thread_wait_s=0)) for _ in range(3)]
    assert all(count < 4 for count in counts), counts
