"""The node's write-behind of run records: a run ends when its code returns, and its
checkpoint record goes to the store after it, off the run path.

A hundred jobs may end on one instant, and each has a record to write. Here a record waits for
the next turn of the event loop and goes with every other record put in the same turn, as one
``Store.record_runs`` call (one script call on Redis, however many jobs); the records put while
that call is in flight go together in the next one. So with records rare nothing waits, and
with many there is one call per round trip, never one per run. One call at a time keeps each
job's records in the order its runs ended, and the answers come in that order too.

Nothing here waits for a record on behalf of a run: each record carries a callback, told how its
write went (``Written``), and its job's runner counts the records still on their way, so that
a handover of the job waits for them (the successor reads them) while the next run does not.
Each record has a deadline, the time its term had left when it was put (a write after that is
refused anyway); a call takes the shortest deadline of its records, which the store keeps
(``Store.record_runs``: ``ConnectionError`` past it), and a call still out ``OVERRUN_S`` after
it is abandoned, its records told so: nothing waits for good behind a call that may never
return (then a job's handover would wait for good too). A record whose deadline passed while
it waited is not sent.

A record costs a run no more than it must, as hundreds end together: one tuple while it waits
(the garbage collector's work grows with what is alive at once), and no object of its own for
its callback, which is told the record itself. Each answer carries the store's clock; a node
whose wall clock is far from it says so here, once per spell (the node's clock is wrong, not
a job's): the stamp lies between the call's sending and its answer on a clock in sync.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from .._aio import OVERRUN_S, wait_all
from .._checkpoint import FinishedRun
from .._clock import Clock
from .._store.base import Store

__all__ = ["SKEW_WARNING_S", "Recorder", "Written"]

logger = logging.getLogger("fastapi_singletonjob.checkpoint")

SKEW_WARNING_S = 5.0
"""How far this node's wall clock may lie from the store's before it says so: far more than a
slow write takes (the store stamps a record a moment after it was put)."""

Written = Callable[[FinishedRun, float, int | None | Exception, datetime | None], None]
"""Told how a record's write went: the record, the monotonic time it was put, then the job's
``iteration`` after the write and the store's clock at it; None and that clock when its term
no longer held the lock (nothing written); or the error, and None, when the store did not
answer in time or failed (whether it wrote is unknown)."""

_Entry = tuple[FinishedRun, float, float, Written]
"""A record waiting or in flight: the run, when it was put, its deadline (monotonic), and who
is told."""


class Recorder:
    """Sends the records put in one turn of the event loop, and those put while a call is in
    flight, as one call each (see the module docstring)."""

    __slots__ = ("_clock", "_flusher", "_node_id", "_pending", "_skewed", "_store")

    def __init__(self, store: Store, *, clock: Clock, node_id: str = "") -> None:
        self._store = store
        self._clock = clock
        self._node_id = node_id
        self._pending: list[_Entry] = []
        self._flusher: asyncio.Task[None] | None = None
        self._skewed = False
        """The last answer's clock was more than ``SKEW_WARNING_S`` from this node's."""

    def put(self, run: FinishedRun, timeout_s: float, written: Written) -> None:
        """Write ``run``'s record within ``timeout_s``, with the records put in this turn of
        the event loop (or after the call in flight); ``written`` is told how it went."""
        now = self._clock.monotonic()
        self._pending.append((run, now, now + timeout_s, written))
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush(), name="singletonjob records")

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                now = self._clock.monotonic()
                first = min([entry[2] for entry in batch])
                if first <= now:
                    _tell(
                        [entry for entry in batch if entry[2] <= now],
                        ConnectionError("its time ran out before it could be sent"),
                    )
                    batch = [entry for entry in batch if entry[2] > now]
                    if not batch:
                        continue
                    first = min(entry[2] for entry in batch)
                timeout_s = first - now
                sent_at = self._clock.now()
                call = asyncio.ensure_future(
                    self._store.record_runs([entry[0] for entry in batch], timeout_s=timeout_s)
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
                at = recorded.at
                self._check_skew(sent_at, at)
                _answer(batch, recorded.iterations, at)
        finally:
            self._flusher = None

    def _check_skew(self, sent_at: datetime, stamped_at: datetime) -> None:
        """Say so when this node's wall clock is far from the store's: the records show the
        store's time (``RECORD_RUN`` stamps them), which lies between the call's sending and
        its answer on a clock in sync (``sent_at`` and now, this node's clock); the node's
        own log lines and status show its clock's."""
        if stamped_at < sent_at:  # this node's clock is ahead
            skew_s = (sent_at - stamped_at).total_seconds()
        else:
            skew_s = min(0.0, (self._clock.now() - stamped_at).total_seconds())
        skewed = abs(skew_s) > SKEW_WARNING_S
        warned, self._skewed = self._skewed, skewed
        if skewed and not warned:  # once per spell, not at every call
            logger.warning(
                "node %s's wall clock is %.3fs %s the store's (fix its time sync): its jobs' "
                "checkpoints show the store's time, its log lines and status its own",
                self._node_id,
                abs(skew_s),
                "ahead of" if skew_s > 0 else "behind",
            )

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


def _tell(batch: list[_Entry], error: Exception) -> None:
    """Tell every record of ``batch`` that its write failed with ``error``."""
    _answer(batch, [error] * len(batch), None)


def _answer(
    batch: list[_Entry], outcomes: Sequence[int | None | Exception], at: datetime | None
) -> None:
    """Tell each record of ``batch`` its outcome, in order; a callback that raises never keeps
    the others from hearing. (A loop that is resumed after a failure, rather than a ``try``
    per record: hundreds of records per call.)"""
    if len(outcomes) != len(batch):
        _tell(batch, ConnectionError(f"{len(outcomes)} answers to {len(batch)} records"))
        return
    answers = iter(zip(batch, outcomes, strict=True))
    while True:
        try:
            for (run, put_at, _, written), outcome in answers:
                written(run, put_at, outcome, at)
            return
        except Exception:  # the iterator goes on with the record after the failed one
            logger.exception("a run record's callback failed")
