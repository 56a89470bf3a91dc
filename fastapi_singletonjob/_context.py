"""The context a job run receives: who runs it, under which lease term, for which tick."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

__all__ = ["JobContext"]


@dataclass(frozen=True, slots=True)
class JobContext:
    """Facts about one run of a job, passed to a parameter annotated ``JobContext``.

    Use ``fencing_token`` to make downstream writes reject a stale leader (store it with
    the write and refuse writes that carry a smaller token), and check ``is_leader`` or
    ``leadership_lost`` in long runs to stop early once the lease is gone.
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
    """How many runs of this job this node has started, this one included (1-based)."""
    _is_leader: Callable[[], bool] = field(repr=False, compare=False)
    _lost: Callable[[], asyncio.Event] = field(repr=False, compare=False)

    @property
    def leadership_lost(self) -> asyncio.Event:
        """Set as soon as this node's lease ends (expired, taken over, released)."""
        return self._lost()

    @property
    def is_leader(self) -> bool:
        """True while this node's lease for this term is still valid (safe from any thread)."""
        return self._is_leader()
