"""The context a job run receives: who runs it, under which lease term, for which tick, and
the job's checkpoint as it stood when the run began."""

from __future__ import annotations

import asyncio
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

    @property
    def leadership_lost(self) -> asyncio.Event:
        """Set as soon as this node's lease ends (expired, taken over, released)."""
        return self._run.lost_of(self.fencing_token)

    @property
    def is_leader(self) -> bool:
        """True while this node's lease for this term is still valid (safe from any thread)."""
        return self._run.is_leader_of(self.fencing_token)

    async def save_state(self, value: object) -> None:
        """Store ``value`` (any JSON value, up to 64 KiB of JSON text) as the job's state,
        durably when this returns; the next run (on any node) finds it in
        ``checkpoint.state``.

        The write is fenced: it is made only while this run's term still holds the lock,
        checked inside Redis. Raises ``LeadershipLost`` when the term is over (the stored
        state is unchanged), ``ConfigurationError`` for a value that is not JSON or too large
        (before any Redis traffic), ``UsageError`` for a job with ``checkpoint=False``, and
        ``ConnectionError`` when Redis does not answer (whether it was written is unknown).
        """
        await self._run.save_state_of(self, value)
