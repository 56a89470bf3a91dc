"""What the runs need of the election, as small Protocols: ``_run`` and ``_election`` are
siblings (the engine wires them), so the runner and the ticker never import the election.
``_election.elector.Elector`` satisfies ``Leadership``, and its leases ``TermView``."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Protocol

from .._store.base import ClaimResult

__all__ = ["Leadership", "TermView"]


class TermView(Protocol):
    """A job's lease as the runs read it (``_election.lease.LeaseView`` is one)."""

    @property
    def ttl_s(self) -> float: ...
    @property
    def token(self) -> int | None:
        """Fencing token of this node's current term; None while it does not lead."""

    @property
    def paused(self) -> bool:
        """Whether an operator paused the job (as the last election reply said)."""

    @property
    def let_go(self) -> str | None:
        """Why this node let the job go, until it leads it again (``Leadership.let_go``)."""

    def lost_of(self, token: int) -> asyncio.Event:
        """The "leadership lost" signal of the term ``token``."""


class Leadership(Protocol):
    """The election as the runs of one node see it: who leads, claims, and what the runs
    report back."""

    @property
    def node_id(self) -> str: ...

    def view(self, job: str) -> TermView:
        """The read-only view of ``job``'s lease."""

    def is_leader(self, job: str, token: int | None = None) -> bool:
        """True while this node's lease of ``job`` (of term ``token``, if given) is valid."""

    def time_left(self, job: str) -> float:
        """Seconds left on this node's lease of ``job`` (0 when it does not lead)."""

    async def claim(self, job: str, token: int, instant_us: int) -> ClaimResult | None:
        """Claim ``job``'s instant for the term ``token``; None when the store did not
        answer in time."""

    def let_go(self, job: str, cause: str) -> None:
        """This node cannot do ``job``'s work (``cause``): hand it over to a healthy node."""

    def run_started(self, job: str) -> None:
        """A run of ``job`` started."""

    def instant_started(self, job: str, instant: datetime) -> None:
        """A run for ``instant`` started (recorded on release, for a successor)."""

    def run_ended(self, job: str) -> None:
        """The run of ``job`` in flight has ended."""

    def lost_awaited(self, job: str) -> None:
        """A run of ``job`` may wait on its term's ``leadership_lost``."""
