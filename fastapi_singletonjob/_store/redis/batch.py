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

from ..._aio import OVERRUN_S
from ..._clock import SYSTEM_CLOCK, Clock, SystemClock

__all__ = ["OVERRUN_S", "Batcher"]

Item = TypeVar("Item")
Reply = TypeVar("Reply")

Send = Callable[[Sequence[Item], float], Awaitable[Sequence[Reply]]]
"""Sends a batch bounded by a timeout in seconds; one reply per item, in order."""


class Batcher(Generic[Item, Reply]):
    """One call in flight at a time; the items submitted meanwhile go in the next one.

    Every item has a deadline: its caller gets ``ConnectionError`` once it passes, whether
    the item still waits or its call is in flight; and a call still in flight ``OVERRUN_S``
    after its own deadline is abandoned (cancelled, left to unwind on its own), so that the
    next batch goes, on another connection.

    :param send: makes one call for a batch.
    :param clock: whose ``monotonic()`` and ``sleep`` the items' deadlines are on.
    :param unanswered: the error of an item whose deadline passed (given the item and its
        timeout), so that its caller hears what was not done, whichever deadline fired
        first: the item's own or its call's.
    """

    __slots__ = ("_clock", "_flusher", "_native", "_pending", "_send", "_unanswered")

    def __init__(
        self,
        send: Send[Item, Reply],
        *,
        clock: Clock = SYSTEM_CLOCK,
        unanswered: Callable[[Item, float], Exception] | None = None,
    ) -> None:
        self._send = send
        self._unanswered = unanswered or _unanswered
        self._clock = clock
        self._native = isinstance(clock, SystemClock)
        self._pending: list[tuple[Item, float, asyncio.Future[Reply]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def submit(self, item: Item, timeout_s: float) -> Reply:
        """``item``'s reply, sent at once or with the next batch; the batch is bounded by the
        shortest time left of its items, and its error is each item's. ``ConnectionError``
        once ``timeout_s`` has passed, sent or not. A caller cancelled before its batch is
        sent is left out of it."""
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending.append((item, self._clock.monotonic() + timeout_s, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush(), name="singletonjob-batch")
        entry = [(item, 0.0, future)]
        error = functools.partial(self._unanswered, item, timeout_s)
        alarm = self._after(timeout_s, functools.partial(_fail, entry, error))
        try:
            return await future  # a cancel here cancels it: left out of its batch
        finally:
            alarm.cancel()

    async def _flush(self) -> None:
        me = asyncio.current_task()
        while self._pending and self._flusher is me:
            batch = [entry for entry in self._pending if not entry[2].done()]
            self._pending = []
            now = self._clock.monotonic()
            _fail([entry for entry in batch if entry[1] <= now], _late)
            batch = [entry for entry in batch if entry[1] > now]
            if not batch:
                continue
            timeout_s = min(deadline for _, deadline, _ in batch) - now
            overran: list[bool] = []
            # The call is awaited here, not in a task of its own: it starts in this step.
            overrun = functools.partial(self._overrun, me, overran)
            alarm = self._after(timeout_s + OVERRUN_S, overrun)
            try:
                replies = await self._send([item for item, _, _ in batch], timeout_s)
            except asyncio.CancelledError:
                if not overran:  # closed
                    _fail(batch, _closed_in_flight)
                    raise
                assert me is not None
                me.uncancel()
                for entry in batch:
                    _fail([entry], functools.partial(self._unanswered, entry[0], timeout_s))
                return  # another flusher sends what came meanwhile
            except Exception as exc:  # each caller reports it
                _fail(batch, functools.partial(_own_copy, exc))
                continue
            finally:
                alarm.cancel()
            for (_, _, future), reply in zip(batch, replies, strict=True):
                if not future.done():
                    future.set_result(reply)

    def _overrun(self, flusher: asyncio.Task[None] | None, overran: list[bool]) -> None:
        """The call in flight of ``flusher`` is ``OVERRUN_S`` past its deadline: cancel it,
        and let a new flusher send what waits, whether or not the old one ever unwinds."""
        if flusher is None or flusher.done() or self._flusher is not flusher:
            return
        overran.append(True)
        flusher.cancel()
        self._flusher = None
        if self._pending:
            self._flusher = asyncio.create_task(self._flush(), name="singletonjob-batch")

    def _after(
        self, delay_s: float, callback: Callable[[], None]
    ) -> asyncio.Handle | asyncio.Task[None]:
        """Call ``callback`` after ``delay_s`` on the clock; cancel the result to not."""
        loop = asyncio.get_running_loop()
        if self._native:
            return loop.call_later(max(delay_s, 0.0), callback)

        async def later() -> None:
            await self._clock.sleep(max(delay_s, 0.0))
            callback()

        return asyncio.ensure_future(later())

    async def aclose(self) -> None:
        """Stop; the calls not answered yet fail with ``ConnectionError``."""
        flusher, self._flusher = self._flusher, None
        if flusher is not None and not flusher.done():
            flusher.cancel()
            await asyncio.gather(flusher, return_exceptions=True)
        _fail(self._pending, _closed_before)
        self._pending = []


def _unanswered(item: object, timeout_s: float) -> ConnectionError:
    return ConnectionError(
        f"no answer within {timeout_s:g}s (its time ran out; whether it was done is unknown)"
    )


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
