"""A consistent, read-only picture of a running engine, as data only: ``Engine.snapshot``
assembles it from the query methods of the engine's parts, and the status API and the probes
(``_web/views.py``, ``_web/health.py``) build everything from it.

Taken synchronously on the event loop, so it never mixes state from before and after a
leadership change.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from .._outcomes import JobStats

__all__ = ["EngineSnapshot", "EngineState", "JobSnapshot", "StoreSnapshot"]


class EngineState(str, enum.Enum):
    """Where an engine is in its life cycle."""

    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"
    """Stopping: no new run starts; runs in flight finish and their leases are still renewed."""
    STOPPED = "stopped"


@dataclass(frozen=True)
class JobSnapshot:
    """One job on this node."""

    leads: bool
    holder: str | None
    """Node id of the lock's holder (this node's when it leads), if known."""
    token: int | None
    """Fencing token of the holder's term, if known."""
    time_left_s: float | None
    """Lease time left: this node's deadline when it leads, else the holder's, as observed."""
    running: bool
    stats: JobStats
    """A copy of the job's counters and last run."""
    error: BaseException | None
    """Why the job's schedule stopped on this node, if it did."""
    paused: bool = False
    """Paused by an operator, as this node's last election reply said."""
    let_go: str | None = None
    """Why this node let the job go (``Terms.let_go``), until it leads it again."""


@dataclass(frozen=True)
class StoreSnapshot:
    """The election's view of the store."""

    last_success_s_ago: float | None
    round_trip_s: float | None
    failures: int
    last_error: str | None
    refused: str | None = None
    """What Redis refused in the last round, and the fix, when no retry mends it (a
    password, a database index, an ACL permission)."""


@dataclass(frozen=True)
class EngineSnapshot:
    """The whole engine at one instant."""

    state: EngineState
    election_alive: bool
    timer_alive: bool
    last_round_s_ago: float
    """Since the election loop last finished a round (or since startup)."""
    longest_lease_s: float
    store: StoreSnapshot
    jobs: dict[str, JobSnapshot]
    failed_tasks: Mapping[str, str] = field(default_factory=dict)
    """Background tasks of the library that died (by task name: what they raised), which
    only a restart brings back; liveness reports them."""
    overdue: Mapping[str, datetime | None] = field(default_factory=dict)
    """The jobs this node watches for being overdue, each with its open spell's start (None:
    not overdue), as its last check found them in the store."""
