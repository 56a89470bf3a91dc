"""Time sources, injected everywhere instead of read from globals.

Deadlines (lease validity, timeouts) live on a monotonic clock; wall time is used only for
schedule anchors and for display. Tests pass ``fastapi_singletonjob.testing.FakeClock``.

No wall-clock step moves a deadline: an NTP step (or ``date -s``) sets ``CLOCK_REALTIME``
only, while ``CLOCK_BOOTTIME`` (``monotonic``) and ``CLOCK_MONOTONIC`` (asyncio's timers,
behind ``sleep``) are at most slewed, within NTP's 500 ppm, which the lease margin covers
(``_timing.CLOCK_RATE_ERROR``). Where there is no ``CLOCK_BOOTTIME``, ``time.monotonic`` is
used, which system clock updates do not affect either (Python's guarantee, on every
platform). A step changes ``now()`` alone, so wall-clock schedules follow it
(docs/reliability.md, rows 23-25).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Protocol, runtime_checkable

__all__ = ["SYSTEM_CLOCK", "Clock", "SystemClock", "WaitsForThreads"]


@runtime_checkable
class Clock(Protocol):
    """What the library needs to know about time."""

    def monotonic(self) -> float:
        """Seconds on a clock that never jumps; only differences are meaningful."""
        ...

    def now(self) -> datetime:
        """The current wall-clock time, timezone-aware (UTC)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Suspend the calling task for ``seconds`` of monotonic time."""
        ...


@runtime_checkable
class WaitsForThreads(Protocol):
    """A clock that a test advances (``testing.FakeClock``), told of each thread a sync job
    runs in, so that advancing time waits for the runs it starts, sync ones included."""

    def thread_started(self, thread: asyncio.Future[object]) -> None:
        """A sync job's run started in a thread; ``thread`` resolves when it returns."""
        ...


def _monotonic_source() -> int | None:
    # CLOCK_BOOTTIME also counts time spent suspended (a paused VM, a laptop lid), so a
    # lease deadline measured on it expires during a suspend, as the lock in Redis does.
    clock_id = getattr(time, "CLOCK_BOOTTIME", None)
    if clock_id is None:
        return None
    try:
        time.clock_gettime(clock_id)
    except OSError:
        return None
    return int(clock_id)


class SystemClock:
    """The real clock: ``CLOCK_BOOTTIME`` where the OS has it, else ``time.monotonic``.

    ``monotonic`` and ``now`` are the C functions themselves, bound once: a read costs no
    Python frame (a run reads them several times, hundreds of runs share an instant)."""

    monotonic: Callable[[], float]
    """See ``Clock.monotonic``."""
    now: Callable[[], datetime]
    """See ``Clock.now``."""

    def __init__(self) -> None:
        self._clock_id = clock_id = _monotonic_source()
        self.monotonic = (
            time.monotonic if clock_id is None else functools.partial(time.clock_gettime, clock_id)
        )
        self.now = functools.partial(datetime.now, UTC)

    async def sleep(self, seconds: float) -> None:
        """See ``Clock.sleep``."""
        await asyncio.sleep(max(seconds, 0.0))

    def __repr__(self) -> str:
        return "SystemClock()"


SYSTEM_CLOCK = SystemClock()
"""The one system clock instance (``memory://`` stores coordinate per clock and URL)."""
