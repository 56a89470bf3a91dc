"""Small asyncio helpers that the engine needs in several places, written once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence

from ._clock import Clock, SystemClock

__all__ = ["Alarm", "abort_all", "cancel_and_wait", "sleep_or_event", "wait_all"]

logger = logging.getLogger("fastapi_singletonjob")


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Alarm:
    """A sleep that another task can cut short with ``ring``: the ticker's one timer.

    On the system clock a wait costs one future and one timer handle, no task; on any other
    clock (a test's ``FakeClock``) it sleeps on that clock. A ``ring`` while nobody waits
    makes the next wait return at once, so no ring is ever lost.
    """

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._native = isinstance(clock, SystemClock)
        self._future: asyncio.Future[None] | None = None
        self._rung = False

    async def wait(self, seconds: float) -> None:
        """Sleep ``seconds`` on the clock, or until ``ring``."""
        if self._rung:
            self._rung = False
            return
        loop = asyncio.get_running_loop()
        future = self._future = loop.create_future()
        if self._native:
            handle = loop.call_later(max(seconds, 0.0), _resolve, future)
            try:
                await future
            finally:
                handle.cancel()
                self._future = None
            return
        sleeper = asyncio.ensure_future(self._clock.sleep(seconds))
        sleeper.add_done_callback(lambda _: _resolve(future))
        try:
            await future
        finally:
            sleeper.cancel()
            self._future = None

    def ring(self) -> None:
        """End the current wait now, or the next one as soon as it begins."""
        if self._future is not None:
            _resolve(self._future)
        else:
            self._rung = True


async def sleep_or_event(clock: Clock, seconds: float, event: asyncio.Event) -> bool:
    """Sleep ``seconds`` on ``clock`` or until ``event`` is set; True if the event woke us.

    The event is not cleared: the caller decides what it means.
    """
    if event.is_set():
        return True
    sleeper = asyncio.ensure_future(clock.sleep(seconds))
    waker = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeper.cancel()
        waker.cancel()
    return event.is_set()


async def wait_all(
    tasks: Collection[asyncio.Future[None]], timeout_s: float, clock: Clock, *, first: bool = False
) -> set[asyncio.Future[None]]:
    """Wait for ``tasks`` (with ``first``, for the first of them) up to ``timeout_s`` on
    ``clock``; return those still pending."""
    pending = {task for task in tasks if not task.done()}
    if not pending or timeout_s <= 0:
        return pending
    timer = asyncio.ensure_future(clock.sleep(timeout_s))
    try:
        while pending and not timer.done():
            await asyncio.wait({*pending, timer}, return_when=asyncio.FIRST_COMPLETED)
            before = len(pending)
            pending = {task for task in pending if not task.done()}
            if first and len(pending) < before:
                break
    finally:
        timer.cancel()
    return pending


async def cancel_and_wait(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait until it has ended; log it if it had failed.

    The cancel is repeated: on Python < 3.12, ``asyncio.wait_for`` can swallow a cancel that
    lands just as the awaited call completes, and the task would go on. Waiting with
    ``asyncio.wait`` never raises, so a cancel aimed at the caller itself is not swallowed.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    if not task.cancelled() and task.exception() is not None:
        logger.error("task %s had failed", task.get_name(), exc_info=task.exception())


async def abort_all(tasks: Sequence[asyncio.Future[None] | None], grace_s: float) -> None:
    """Cancel every task still running and wait for them up to ``grace_s`` (real time)."""
    pending = [task for task in tasks if task is not None and not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=grace_s)
