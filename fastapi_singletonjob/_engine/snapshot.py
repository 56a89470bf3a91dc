"""A consistent, read-only picture of a running engine: the only place that reads its
internals for the status API and the probes (``_web/status.py`` builds everything from it).

Taken synchronously on the event loop, so it never mixes state from before and after a
leadership change.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .._outcomes import JobStats

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["EngineSnapshot", "EngineState", "JobSnapshot", "StoreSnapshot", "take"]


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


@dataclass(frozen=True)
class StoreSnapshot:
    """The election's view of the store."""

    last_success_s_ago: float | None
    round_trip_s: float | None
    failures: int
    last_error: str | None


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


def take(engine: Engine) -> EngineSnapshot:
    """Snapshot ``engine`` now."""
    elector = engine.elector
    now = engine.clock.monotonic()
    jobs = {}
    for name, runner in engine.runners.items():
        lease = elector.terms.view(name)
        leads = elector.is_leader(name)
        stats = copy.copy(runner.stats)
        stats.dropped = stats.dropped.copy()
        jobs[name] = JobSnapshot(
            leads=leads,
            holder=engine.settings.node_id if leads else lease.holder,
            token=lease.token if leads else lease.holder_token,
            time_left_s=elector.terms.holder_time_left(name),
            running=runner.current is not None,
            stats=stats,
            error=runner.crashed,
            paused=lease.paused,
        )
    last_ok = elector.last_success_at
    election, timer = engine.election_task, engine.timer_task
    return EngineSnapshot(
        state=engine.state,
        election_alive=election is not None and not election.done(),
        timer_alive=timer is not None and not timer.done(),
        last_round_s_ago=now - (elector.last_round_at or engine.started_at),
        longest_lease_s=max(
            (lease.ttl_s for lease in elector.leases.values()),
            default=engine.settings.lock_expiry_s,
        ),
        store=StoreSnapshot(
            last_success_s_ago=None if last_ok is None else now - last_ok,
            round_trip_s=elector.round_trip_s,
            failures=elector.failures,
            last_error=elector.last_error,
        ),
        jobs=jobs,
        failed_tasks=engine.supervisor.failed,
    )
