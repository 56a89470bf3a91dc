"""Calls to Redis that coalesce: while one is in flight, the next ones wait and then go
together, as one call.

Many jobs can end on one instant (a hundred jobs every second, a cron minute), and each
writes its checkpoint. One script call per write costs each a round trip and, mostly, the
client's own work per command (about a millisecond of redis-py CPU), all on the event loop
that also times the ticks. Here a write goes at the next turn of the event loop, with those
made in the same turn; those that come while it is in flight go together in the next call,
and so on: no added delay when writes are rare, one call per round trip when they are not.
"""

from __future__ import annotations

import asyncio
import copy
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from ..._clock import SYSTEM_CLOCK, Clock

__all__ = ["Batcher"]

Item = TypeVar("Item")
Reply = TypeVar("Reply")

Send = Callable[[Sequence[Item], float], Awaitable[Sequence[Reply]]]
"""Sends a batch bounded by a timeout in seconds; one reply per item, in order."""


class Batcher(Generic[Item, Reply]):
    """One call in flight at a time; the items submitted meanwhile go in the next one.

    :param send: makes one call for a batch.
    :param clock: whose ``monotonic()`` the items' deadlines are on.
    """

    __slots__ = ("_clock", "_flusher", "_pending", "_send")

    def __init__(self, send: Send[Item, Reply], *, clock: Clock = SYSTEM_CLOCK) -> None:
        self._send = send
        self._clock = clock
        self._pending: list[tuple[Item, float, asyncio.Future[Reply]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def submit(self, item: Item, timeout_s: float) -> Reply:
        """``item``'s reply, sent at once or with the next batch; the batch is bounded by the
        shortest time left of its items, and its error is each item's. A caller cancelled
        before its batch is sent is left out of it."""
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending.append((item, self._clock.monotonic() + timeout_s, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush(), name="singletonjob-batch")
        return await future

    async def _flush(self) -> None:
        while self._pending:
            batch = [entry for entry in self._pending if not entry[2].done()]
            self._pending = []
            now = self._clock.monotonic()
            _fail([entry for entry in batch if entry[1] <= now], _late)
            batch = [entry for entry in batch if entry[1] > now]
            if not batch:
                continue
            timeout_s = min(deadline for _, deadline, _ in batch) - now
            try:
                replies = await self._send([item for item, _, _ in batch], timeout_s)
            except asyncio.CancelledError:
                _fail(batch, _closed_in_flight)
                raise
            except Exception as exc:  # each caller reports it
                _fail(batch, functools.partial(_own_copy, exc))
                continue
            for (_, _, future), reply in zip(batch, replies, strict=True):
                if not future.done():
                    future.set_result(reply)

    async def aclose(self) -> None:
        """Stop; the calls not answered yet fail with ``ConnectionError``."""
        flusher, self._flusher = self._flusher, None
        if flusher is not None and not flusher.done():
            flusher.cancel()
            await asyncio.gather(flusher, return_exceptions=True)
        _fail(self._pending, _closed_before)
        self._pending = []


def _late() -> ConnectionError:
    return ConnectionError("its time ran out while the previous call was in flight; not sent")


def _closed_in_flight() -> ConnectionError:
    return ConnectionError("the store was closed before the call ended")


def _closed_before() -> ConnectionError:
    return ConnectionError("the store was closed before the call was sent")


def _fail(
    batch: Sequence[tuple[object, float, asyncio.Future[Reply]]], error: Callable[[], Exception]
) -> None:
    """Fail each waiter of ``batch`` that still waits with an exception of its own, made by
    ``error``: each waiter re-raises its own, so no traceback grows with every waiter."""
    for _, _, future in batch:
        if not future.done():
            future.set_exception(error())


def _own_copy(exc: Exception) -> Exception:
    """An exception of ``exc``'s type, with its arguments and attributes, for one waiter,
    caused by ``exc`` (whose traceback shows where the call failed); ``exc`` itself when its
    type cannot be rebuilt from its arguments (a custom ``__init__``)."""
    try:
        own = copy.copy(exc)
    except Exception:
        return exc
    if own is exc or type(own) is not type(exc):
        return exc
    own.__cause__ = exc  # also hides the context: the cause is the same failure
    return own
