"""Helpers for testing code that uses fastapi-singletonjob, in zero real time.

``FakeClock`` replaces the system clock: sleeps wait until the test advances time, so a test
can walk through hours of schedule and lease timing in milliseconds::

    clock = FakeClock()
    jobs = SingletonJobs("memory://", project="test", clock=clock)
    ...
    async with jobs:
        await clock.advance(10)  # ten seconds of ticks, instantly
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from datetime import UTC, datetime, timedelta

__all__ = ["FakeClock"]

_SETTLE_ROUNDS = 50
"""At most this many turns of the event loop per settle (fewer once nothing is ready)."""


class FakeClock:
    """A clock that moves only when told to; implements the library's ``Clock`` protocol.

    :param start: the wall-clock time at the start (aware).
    :param thread_wait_s: how long (real seconds) ``advance`` and ``settle`` wait for a sync
        (``def``) job's run in a thread to return; a run still going then goes on, as a run
        longer than the time advanced would (0: do not wait for threads).
    """

    def __init__(self, start: datetime | None = None, *, thread_wait_s: float = 5.0) -> None:
        self.thread_wait_s = thread_wait_s
        self._wall_start = start or datetime(2026, 1, 1, tzinfo=UTC)
        if self._wall_start.tzinfo is None:
            raise ValueError("FakeClock(start=...) must be timezone-aware")
        self._monotonic = 1000.0
        self._monotonic_start = self._monotonic
        self._wall_shift = timedelta()
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._threads: set[asyncio.Future[object]] = set()

    def monotonic(self) -> float:
        """Monotonic seconds; moves only in ``advance``."""
        return self._monotonic

    def now(self) -> datetime:
        """Wall-clock time: the start, plus the time advanced, plus any ``jump_wall``."""
        elapsed = timedelta(seconds=self._monotonic - self._monotonic_start)
        return self._wall_start + elapsed + self._wall_shift

    async def sleep(self, seconds: float) -> None:
        """Wait until the clock has been advanced by ``seconds``."""
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Strictly later, even for a sleep below the float's resolution at this time: else a
        # caller that sleeps what is left to an instant could wait forever without time moving.
        when = max(self._monotonic + seconds, math.nextafter(self._monotonic, math.inf))
        heapq.heappush(self._sleepers, (when, next(self._order), future))
        await future

    def jump_wall(self, seconds: float) -> None:
        """Step the wall clock (as an NTP step would) without moving monotonic time."""
        self._wall_shift += timedelta(seconds=seconds)

    def stall(self, seconds: float) -> None:
        """Move time forward without waking anyone, as when the event loop is blocked (a
        sync call inside ``async def``, a GC pause, SIGSTOP): sleepers that are now due wake
        at the next ``advance``, late, all at once."""
        if seconds < 0:
            raise ValueError("time cannot go backwards")
        self._monotonic += seconds

    def suspend(self, seconds: float) -> None:
        """Move time forward as a system suspend does: the library's clock (CLOCK_BOOTTIME)
        and the wall clock count the suspended time, but the event loop's timers
        (CLOCK_MONOTONIC) do not, so every pending sleep still has its whole delay to go."""
        if seconds < 0:
            raise ValueError("time cannot go backwards")
        self._monotonic += seconds
        self._sleepers = [(when + seconds, order, fut) for when, order, fut in self._sleepers]
        heapq.heapify(self._sleepers)

    @property
    def sleepers(self) -> int:
        """How many tasks are sleeping on this clock."""
        return sum(1 for _, _, future in self._sleepers if not future.done())

    async def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds``, waking each sleeper at its own instant in order
        and letting the woken tasks run before going on."""
        if seconds < 0:
            raise ValueError("time cannot go backwards")
        target = self._monotonic + seconds
        await self.settle()
        while self._sleepers and self._sleepers[0][0] <= target:
            when, _, future = heapq.heappop(self._sleepers)
            if future.done():
                continue
            self._monotonic = max(self._monotonic, when)
            future.set_result(None)
            await self.settle()
        self._monotonic = target
        await self.settle()

    def thread_started(self, thread: asyncio.Future[object]) -> None:
        """A sync (``def``) job's run started in a thread: ``advance`` and ``settle`` wait
        for it to return, so a test sees every run that the time it advanced started."""
        self._threads.add(thread)
        thread.add_done_callback(self._threads.discard)

    async def settle(self) -> None:
        """Let every task that is ready run until it waits again, and every sync job's run
        in a thread return (for up to ``thread_wait_s`` of real time)."""
        await _turns()
        deadline = time.monotonic() + self.thread_wait_s
        while self._threads and (left := deadline - time.monotonic()) > 0:
            await asyncio.wait(set(self._threads), timeout=left)
            await _turns()

    def __repr__(self) -> str:
        return f"FakeClock(now={self.now().isoformat()})"


async def _turns() -> None:
    """Turns of the event loop until no callback is ready (at most ``_SETTLE_ROUNDS``): every
    task that can go on has run up to its next wait. Two turns in a row with nothing ready,
    since a callback of the first may schedule one for the second."""
    ready = getattr(asyncio.get_running_loop(), "_ready", None)  # CPython's run queue
    idle = 0
    for _ in range(_SETTLE_ROUNDS):
        await asyncio.sleep(0)
        idle = idle + 1 if ready is not None and not ready else 0
        if idle >= 2:
            return
