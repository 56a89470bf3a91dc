"""The context a job run receives: who runs it, under which lease term, for which tick, and
the job's checkpoint as it stood when the run began.

A context is made on the event loop, and a sync job uses it in a worker thread: what it asks
of the runner (``save_state``) is sent back to that loop, and the thread waits for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Generator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from .._checkpoint import Checkpoint

__all__ = ["JobContext"]


class _Run(Protocol):
    """What a context asks of the runner that made it (``JobRunner``)."""

    def is_leader_of(self, token: int) -> bool: ...
    def lost_of(self, token: int) -> asyncio.Event: ...
    async def save_state_of(self, ctx: JobContext, value: object) -> None: ...


@dataclass(frozen=True, slots=True)
class JobContext:
    """Facts about one run of a job, passed to a parameter annotated ``JobContext``.

    Use ``fencing_token`` to make downstream writes reject a stale leader (store it with
    the write and refuse writes that carry a smaller token), check ``is_leader`` or
    ``leadership_lost`` in long runs to stop early once the lease is gone, and keep a cursor
    in ``checkpoint.state`` with ``save_state``.
    """

    job: str
    """The job's name."""
    node_id: str
    """The id of the node (replica) running it."""
    fencing_token: int
    """The token of this node's leadership term: strictly greater than any earlier term's."""
    scheduled_at: datetime
    """The tick or cron instant this run is for (aware); the start time for interval jobs."""
    started_at: datetime
    """When the run started (aware, UTC)."""
    iteration: int
    """The number of this run: the stored checkpoint's ``iteration`` (successful runs,
    cluster-wide) plus one; with ``checkpoint=False``, the runs this node has started."""
    checkpoint: Checkpoint | None
    """The job's checkpoint as it stood when the run began; None before the first run, and
    always with ``checkpoint=False``."""
    _run: _Run = field(repr=False, compare=False)
    _loop: asyncio.AbstractEventLoop | None = field(
        init=False, default=None, repr=False, compare=False
    )
    """The event loop the context was made on: the runner's, where its store calls run."""

    def __post_init__(self) -> None:
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # made outside a loop (a test's own context): no thread hop
            loop = None
        object.__setattr__(self, "_loop", loop)

    @property
    def leadership_lost(self) -> asyncio.Event:
        """Set as soon as this node's lease ends (expired, taken over, released)."""
        return self._run.lost_of(self.fencing_token)

    @property
    def is_leader(self) -> bool:
        """True while this node's lease for this term is still valid (safe from any thread)."""
        return self._run.is_leader_of(self.fencing_token)

    def save_state(self, value: object) -> Awaitable[None]:
        """Store ``value`` (any JSON value, up to 64 KiB of JSON text) as the job's state,
        durably once the save is done; the next run (on any node) finds it in
        ``checkpoint.state``.

        In an async job, ``await ctx.save_state(value)``: the state is durable when the await
        returns. In a sync job (``def``, run in a worker thread), call ``ctx.save_state(value)``
        without ``await``: it blocks the thread until the state is durable (the store call
        runs on the event loop) and returns an awaitable that is already done, so there is
        nothing left to wait for. Both raise the same errors.

        The write is fenced: it is made only while this run's term still holds the lock,
        checked inside Redis. Raises ``LeadershipLost`` when the term is over (the stored
        state is unchanged), ``ConfigurationError`` for a value that is not JSON or too large
        (before any Redis traffic), ``UsageError`` for a job with ``checkpoint=False``, and
        ``ConnectionError`` when Redis does not answer (whether it was written is unknown).
        """
        home = self._loop
        try:
            here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        call = self._run.save_state_of(self, value)
        if home is None or here is home:
            return call  # on the run's own loop (an async job): to be awaited, as always
        # From another thread: a sync job's worker thread (no loop there), or a loop of the
        # job's own. The store's connections belong to the run's loop, so the save runs there.
        try:
            saving = asyncio.run_coroutine_threadsafe(call, home)
        except RuntimeError:  # that loop is closed: the run is long over
            call.close()
            raise
        if here is not None:
            return asyncio.wrap_future(saving)  # a loop of the job's own: awaited there
        # Bounded: the store call is timed out by the lease time left.
        saving.result()
        return _DONE


class _Done:
    """The awaitable a sync job's ``save_state`` returns: the save is already durable."""

    __slots__ = ()

    def __await__(self) -> Generator[None, None, None]:
        return
        yield  # a generator with nothing to wait for

    def __repr__(self) -> str:
        return "<save_state: done>"


_DONE = _Done()
