"""The node's write-behind of run records: a run ends when its code returns, and its
checkpoint record goes to the store after it, off the run path.

A hundred jobs may end on one instant, and each has a record to write. Here a record waits for
the next turn of the event loop and goes with every other record put in the same turn, as one
``Store.record_runs`` call (one script call on Redis, however many jobs); the records put while
that call is in flight go together in the next one. So with records rare nothing waits, and
with many there is one call per round trip, never one per run. One call at a time keeps each
job's records in the order its runs ended.

Nothing here waits for a record on behalf of a run: each record carries a callback, told how its
write went (``Written``), and its job's runner counts the records still on their way, so that
a handover of the job waits for them (the successor reads them) while the next run does not.
Each record has a deadline, the time its term had left when it was put (a write after that is
refused anyway); a call takes the shortest deadline of its records, which the store keeps
(``Store.record_runs``: ``ConnectionError`` past it), and a call still out ``OVERRUN_S`` after
it is abandoned, its records told so: nothing waits for good behind a call that may never
return (then a job's handover would wait for good too). A record whose deadline passed while
it waited is not sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

from .._aio import OVERRUN_S, wait_all
from .._checkpoint import FinishedRun
from .._clock import Clock
from .._store.base import Store

__all__ = ["Recorder", "Written"]

logger = logging.getLogger("fastapi_singletonjob.checkpoint")

Written = Callable[[int | None | Exception, datetime | None], None]
"""Told how a record's write went: the job's ``iteration`` after it and the store's clock at
it; None and that clock when its term no longer held the lock (nothing written); or the
error, and None, when the store did not answer in time or failed (whether it wrote is
unknown)."""


class Recorder:
    """Sends the records put in one turn of the event loop, and those put while a call is in
    flight, as one call each (see the module docstring)."""

    __slots__ = ("_clock", "_flusher", "_pending", "_store")

    def __init__(self, store: Store, *, clock: Clock) -> None:
        self._store = store
        self._clock = clock
        self._pending: list[tuple[FinishedRun, float, Written]] = []
        self._flusher: asyncio.Task[None] | None = None

    def put(self, run: FinishedRun, timeout_s: float, written: Written) -> None:
        """Write ``run``'s record within ``timeout_s``, with the records put in this turn of
        the event loop (or after the call in flight); ``written`` is told how it went."""
        self._pending.append((run, self._clock.monotonic() + timeout_s, written))
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush(), name="singletonjob records")

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                now = self._clock.monotonic()
                late = [entry for entry in batch if entry[1] <= now]
                if late:
                    _tell(late, ConnectionError("its time ran out before it could be sent"))
                    batch = [entry for entry in batch if entry[1] > now]
                if not batch:
                    continue
                timeout_s = min(deadline for _, deadline, _ in batch) - now
                call = asyncio.ensure_future(
                    self._store.record_runs([run for run, _, _ in batch], timeout_s=timeout_s)
                )
                try:
                    if await wait_all({call}, timeout_s + OVERRUN_S, self._clock):
                        call.add_done_callback(_discard)
                        call.cancel()  # abandoned: the next records go without it
                        _tell(batch, ConnectionError(f"no answer within {timeout_s:g}s"))
                        continue
                    recorded = call.result()
                except asyncio.CancelledError:
                    call.add_done_callback(_discard)
                    call.cancel()
                    _tell(batch, ConnectionError("the node stopped before the store answered"))
                    raise
                except Exception as exc:
                    _tell(batch, exc)
                    continue
                for (_, _, written), iteration in zip(batch, recorded.iterations, strict=True):
                    _call(written, iteration, recorded.at)
        finally:
            self._flusher = None

    async def aclose(self) -> None:
        """Stop: the records not written yet are told ``ConnectionError``."""
        flusher = self._flusher
        if flusher is not None:
            flusher.cancel()
            await asyncio.gather(flusher, return_exceptions=True)
        pending, self._pending = self._pending, []
        _tell(pending, ConnectionError("the node stopped before the record was sent"))


def _discard(call: asyncio.Future[Any]) -> None:
    if not call.cancelled():
        call.exception()


def _tell(batch: list[tuple[FinishedRun, float, Written]], error: Exception) -> None:
    for _, _, written in batch:
        _call(written, error, None)


def _call(written: Written, outcome: int | None | Exception, at: datetime | None) -> None:
    """Tell one record's callback; one that raises never keeps the others from hearing."""
    try:
        written(outcome, at)
    except Exception:
        logger.exception("a run record's callback failed")
