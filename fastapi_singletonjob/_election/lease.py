"""A job's lease as this node sees it (``Lease``), and the read-only view of it that the
rest of the package gets (``LeaseView``); ``Terms`` changes it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

__all__ = ["Lease", "LeaseView"]


class LeaseView(Protocol):
    """A lease as everything but the election sees it: read-only (``Terms`` writes it)."""

    @property
    def job(self) -> str: ...
    @property
    def ttl_s(self) -> float: ...
    @property
    def token(self) -> int | None:
        """Fencing token of this node's current term; None while it does not lead."""

    @property
    def holder(self) -> str | None:
        """Node id of the lock's holder, as last observed."""

    @property
    def holder_token(self) -> int | None: ...
    @property
    def paused(self) -> bool:
        """Whether an operator paused the job (as the last election reply said)."""

    @property
    def let_go(self) -> str | None:
        """Why this node let the job go, until it leads it again (``Terms.let_go``)."""

    def lost_of(self, token: int) -> asyncio.Event:
        """The "leadership lost" signal of the term ``token``."""


@dataclass(eq=False, slots=True)
class Lease:
    """This node's view of one job's lock; changed only by ``Terms`` (``_election/terms.py``),
    which the election asks for what it changes."""

    job: str
    ttl_s: float
    retention_s: float | None = None
    """How long the job's checkpoint outlives this node's last renewal; None: no checkpoint."""
    token: int | None = None
    """Fencing token of this node's current term; None while it does not lead."""
    value: str | None = None
    """The lock value this node last held, for a compare-and-delete release."""
    deadline: float = float("-inf")
    """Monotonic instant until which this node may act as leader."""
    holder: str | None = None
    holder_token: int | None = None
    holder_ttl_s: float | None = None
    observed_at: float | None = None
    """Monotonic time of the request that last reported on this lock."""
    terms: int = 0
    wanted: bool = True
    acquire_error: str | None = None
    """Why the last attempt to acquire the free lock failed, if it did."""
    lost_event: asyncio.Event | None = None
    """The current term's "leadership lost" signal, made when first asked for (``lost``)."""
    running: bool = False
    """True while a run of the job is in flight on this node (reported by the runner)."""
    ended_token: int | None = None
    """Token of the last term this node ended: a late reply renewing that term's value does
    not start it again (a term, once ended, stays ended; the lock then expires)."""
    last_started: datetime | None = None
    """Instant of the last run this node started (reported by the runner);
    recorded in the store on release, so that a successor never runs it again."""
    paused: bool = False
    """Paused by an operator (``jobs.pause``), as the last election reply said: no new run."""
    stepping_down: bool = False
    """An operator asked this node to hand the job over: released once no run is in flight."""
    let_go: str | None = None
    """Why this node let the job go (its runs could not start: claims or checkpoint calls
    failing for a lock expiry), until it leads the job again; None otherwise."""
    rest_until: float = float("-inf")
    """Monotonic instant until which this node does not compete for the job (after a
    step-down, so that another node takes it over)."""

    def lost_of(self, token: int) -> asyncio.Event:
        """The "leadership lost" signal of the term ``token``: this term's, or a set one when
        that term has ended (a later term has a signal of its own)."""
        if self.token == token:
            return self.lost
        ended = asyncio.Event()  # asked for rarely: a run that outlived its term
        ended.set()
        return ended

    @property
    def lost(self) -> asyncio.Event:
        """The current term's "leadership lost" signal: a fresh event per term, set when the
        term ends (and already set while the node leads no term). Made on first use: an
        ``asyncio.Event`` costs ~0.7 KB, and most terms of most jobs never need one."""
        if self.lost_event is None:
            self.lost_event = asyncio.Event()
            if self.token is None:
                self.lost_event.set()
        return self.lost_event
