"""An interval job's handover on a real redis-server, from a leader whose wall clock is a day
off (issue 27): the successor spaces its first run by ``every`` from the last run's end on the
server's clock (``RECORD_RUN`` stamps it, ``load_checkpoint`` reads ``TIME`` with the record),
so no node's wall clock enters. The same on the memory store, on a fake clock:
``tests/test_checkpoints.py``."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

import pytest
from waiting import wait_until

from fastapi_singletonjob import JobContext, SingletonJobs
from fastapi_singletonjob._clock import SystemClock

pytestmark = pytest.mark.redis

EVERY_S = 1.0
EARLY_S = 0.05
"""How much earlier than ``every`` after the last run's end the successor may start: the
server stamps the end after the body returned, so only the clocks' resolution."""
LATE_S = 0.9
"""How much later it may start on a busy machine: its election, read and timer, under load,
and still less than a whole extra period (the successor waiting twice)."""


class SkewedClock(SystemClock):
    """The system clock with a wall clock ``offset_s`` off (its monotonic clock is right)."""

    def __init__(self, offset_s: float) -> None:
        super().__init__()
        self._offset = timedelta(seconds=offset_s)

    def now(self) -> datetime:
        return super().now() + self._offset


@pytest.mark.parametrize("offset_s", [86400.0, -86400.0], ids=["a-day-ahead", "a-day-behind"])
async def test_an_interval_handover_spaces_runs_by_every_on_the_servers_clock(
    redis_url: str, unique_project: str, offset_s: float
) -> None:
    starts: dict[str, list[float]] = {"a": [], "b": []}
    ends: dict[str, list[float]] = {"a": [], "b": []}

    def node(name: str, clock: SystemClock) -> SingletonJobs:
        jobs = SingletonJobs(
            redis_url,
            project=unique_project,
            node_id=name,
            heartbeat_interval=0.1,
            lock_expiry=1.0,
            placement="first",
            clock=clock,
        )

        @jobs.interval("sweep", every=EVERY_S)
        async def sweep(ctx: JobContext) -> None:
            starts[name].append(time.monotonic())
            await asyncio.sleep(0.01)
            ends[name].append(time.monotonic())

        return jobs

    a, b = node("a", SkewedClock(offset_s)), node("b", SystemClock())
    await a.start()
    try:
        await wait_until(lambda: len(ends["a"]) >= 1, 10, "a's first run")
        await b.start()
        ran = len(ends["a"])
        await wait_until(lambda: len(ends["a"]) > ran, 10, "a run of a after b started")
    finally:
        await a.stop()  # right after a run ended: a graceful handover to b
    try:
        last_end = ends["a"][-1]
        assert starts["a"][-1] < last_end, "a's last run was still going at its stop"
        await wait_until(lambda: len(starts["b"]) >= 2, 10, "two runs of b after the handover")
        gap_s = starts["b"][0] - last_end
        assert EVERY_S - EARLY_S <= gap_s <= EVERY_S + LATE_S, f"b ran {gap_s:.3f}s after a"
        checkpoint = await b.checkpoint("sweep")
        assert checkpoint is not None and checkpoint.last_completed_at is not None
        assert abs(checkpoint.last_completed_at - datetime.now(UTC)) < timedelta(seconds=5)
    finally:
        await b.stop()
