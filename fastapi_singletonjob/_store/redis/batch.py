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
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

__all__ = ["Batcher"]

Item = TypeVar("Item")
Reply = TypeVar("Reply")

Send = Callable[[Sequence[Item], float], Awaitable[Sequence[Reply]]]
"""Sends a batch bounded by a timeout in seconds; one reply per item, in order."""


class Batcher(Generic[Item, Reply]):
    """One call in flight at a time; the items submitted meanwhile go in the next one."""

    __slots__ = ("_flusher", "_pending", "_send")

    def __init__(self, send: Send[Item, Reply]) -> None:
        self._send = send
        self._pending: list[tuple[Item, float, asyncio.Future[Reply]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def submit(self, item: Item, timeout_s: float) -> Reply:
        """``item``'s reply, sent at once or with the next batch; the batch is bounded by the
        shortest time left of its items, and its error is each item's. A caller cancelled
        before its batch is sent is left out of it."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Reply] = loop.create_future()
        self._pending.append((item, loop.time() + timeout_s, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush(), name="singletonjob-batch")
        return await future

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            batch = [entry for entry in self._pending if not entry[2].done()]
            self._pending = []
            now = loop.time()
            _fail([entry for entry in batch if entry[1] <= now], _late())
            batch = [entry for entry in batch if entry[1] > now]
            if not batch:
                continue
            timeout_s = min(deadline for _, deadline, _ in batch) - now
            try:
                replies = await self._send([item for item, _, _ in batch], timeout_s)
            except asyncio.CancelledError:
                _fail(batch, ConnectionError("the store was closed before the call ended"))
                raise
            except Exception as exc:  # each caller reports it
                _fail(batch, exc)
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
        _fail(self._pending, ConnectionError("the store was closed before the call was sent"))
        self._pending = []


def _late() -> ConnectionError:
    return ConnectionError("its time ran out while the previous call was in flight; not sent")


def _fail(batch: Sequence[tuple[object, float, asyncio.Future[Reply]]], exc: Exception) -> None:
    for _, _, future in batch:
        if not future.done():
            future.set_exception(exc)
