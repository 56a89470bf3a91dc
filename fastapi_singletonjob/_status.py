"""What this node knows about its jobs, as typed (pydantic) snapshots, and its health.

The status router serves these models; ``SingletonJobs.status()`` returns them too. Nothing
here holds a secret: the store is shown by its redacted URL.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from ._state import DropReason, Outcome, RunRecord

if TYPE_CHECKING:
    from ._jobs import SingletonJobs

__all__ = [
    "HealthStatus",
    "JobReport",
    "JobStatus",
    "LastRun",
    "NodeStatus",
    "StoreStatus",
    "liveness",
    "node_status",
    "readiness",
]


class LastRun(BaseModel):
    """The last finished run of a job on this node."""

    scheduled_at: datetime = Field(description="The tick or cron instant it ran for.")
    started_at: datetime
    finished_at: datetime
    duration_s: float
    outcome: Outcome
    error: str | None = Field(None, description="`Type: message` of a failed run, shortened.")


class JobStatus(BaseModel):
    """One job as this node sees it."""

    name: str
    schedule: str = Field(description='For example "fixed rate every 500ms".')
    kind: Literal["interval", "fixed_rate", "cron", "custom"]
    enabled: bool
    leader: str | None = Field(description="Node id of the node holding the lock, if known.")
    is_leader: bool = Field(description="Whether this node leads the job now.")
    fencing_token: int | None = Field(description="Token of the leader's current term.")
    lease_time_left_s: float | None = Field(
        description="Time left on the leader's lease (this node's deadline when it leads)."
    )
    running: bool
    running_since: datetime | None
    last_run: LastRun | None
    next_run: datetime | None
    runs: int = Field(description="Runs finished on this node since it started.")
    failures: int
    timeouts: int
    cancelled: int
    dropped_ticks: int = Field(description="Ticks this node dropped while leading.")
    dropped: dict[DropReason, int]
    not_leader_ticks: int = Field(description="Ticks that came while another node led.")
    error: str | None = Field(None, description="Why the job stopped on this node, if it did.")


class StoreStatus(BaseModel):
    """Whether the lease store (Redis) answers this node."""

    url: str = Field(description="The store, without credentials.")
    reachable: bool
    last_contact_s_ago: float | None
    round_trip_ms: float | None
    consecutive_failures: int
    error: str | None


class NodeStatus(BaseModel):
    """This node, its store and all its jobs."""

    project: str
    node_id: str
    started: bool
    store: StoreStatus
    jobs: list[JobStatus]


class JobReport(BaseModel):
    """This node, its store and one job."""

    project: str
    node_id: str
    started: bool
    store: StoreStatus
    job: JobStatus


class HealthStatus(BaseModel):
    """A probe's answer."""

    status: Literal["ok", "unavailable"]
    reason: str | None = None
    node_id: str


def _store_status(jobs: SingletonJobs) -> StoreStatus:
    engine = jobs.engine
    url = jobs.store_description
    if engine is None:
        return StoreStatus(
            url=url,
            reachable=False,
            last_contact_s_ago=None,
            round_trip_ms=None,
            consecutive_failures=0,
            error="not started",
        )
    elector = engine.elector
    now = jobs.clock.monotonic()
    last = elector.last_success_at
    round_trip = elector.round_trip_s
    return StoreStatus(
        url=url,
        reachable=last is not None and elector.failures == 0,
        last_contact_s_ago=None if last is None else round(now - last, 3),
        round_trip_ms=None if round_trip is None else round(round_trip * 1e3, 3),
        consecutive_failures=elector.failures,
        error=elector.last_error,
    )


def _job_status(jobs: SingletonJobs, name: str) -> JobStatus:
    spec = jobs.jobs[name]
    engine = jobs.engine
    runner = engine.runners.get(name) if engine is not None else None
    lease = engine.elector.leases.get(name) if engine is not None else None
    stats = runner.stats if runner is not None else None
    leads = engine is not None and engine.elector.is_leader(name)
    last = stats.last_run if stats is not None else None
    return JobStatus(
        name=name,
        schedule=str(spec.schedule),
        kind=spec.kind,
        enabled=spec.enabled,
        leader=(jobs.node_id if leads else lease.holder) if lease is not None else None,
        is_leader=leads,
        fencing_token=(lease.token if leads else lease.holder_token) if lease else None,
        lease_time_left_s=(
            None
            if engine is None or lease is None
            else _round(engine.elector.holder_time_left(name))
        ),
        running=runner is not None and runner.current is not None,
        running_since=stats.running_since if stats else None,
        last_run=None
        if last is None
        else LastRun(**{**vars(last), "duration_s": round(last.duration_s, 6)}),
        next_run=stats.next_run if stats else None,
        runs=stats.runs if stats else 0,
        failures=stats.failures if stats else 0,
        timeouts=stats.timeouts if stats else 0,
        cancelled=stats.cancelled if stats else 0,
        dropped_ticks=stats.dropped_total if stats else 0,
        dropped=dict(stats.dropped) if stats else dict.fromkeys(DropReason, 0),
        not_leader_ticks=stats.not_leader if stats else 0,
        error=None if runner is None or runner.crashed is None else repr(runner.crashed),
    )


def _last_run(run: RunRecord) -> LastRun:
    return LastRun(**{**vars(run), "duration_s": round(run.duration_s, 6)})


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def node_status(jobs: SingletonJobs, only: str | None = None) -> NodeStatus:
    """A snapshot of this node; with ``only``, of that job alone."""
    names = [only] if only is not None else list(jobs.jobs)
    return NodeStatus(
        project=jobs.project,
        node_id=jobs.node_id,
        started=jobs.engine is not None,
        store=_store_status(jobs),
        jobs=[_job_status(jobs, name) for name in names],
    )


def readiness(jobs: SingletonJobs) -> str | None:
    """None when ready: the election loop runs and reached the store within one lock
    expiry; else the reason. Followers are ready too: readiness never depends on leading."""
    engine = jobs.engine
    if engine is None:
        return "not started"
    task = engine.election_task
    if task is None or task.done():
        return "the election loop is not running"
    elector = engine.elector
    if elector.last_success_at is None:
        return f"the lease store has not answered yet ({elector.last_error or 'connecting'})"
    age = jobs.clock.monotonic() - elector.last_success_at
    if age > jobs.settings.lock_expiry_s:
        return (
            f"the lease store last answered {age:.1f}s ago, more than lock_expiry="
            f"{jobs.settings.lock_expiry_s:g}s ({elector.last_error or 'no answer'})"
        )
    return None


def liveness(jobs: SingletonJobs) -> str | None:
    """None when alive; else why a loop of the library is dead or wedged. An unreachable
    store is *not* a liveness failure: restarting the process would not fix it."""
    engine = jobs.engine
    if engine is None:
        return "not started"
    task = engine.election_task
    if task is None or task.done():
        return "the election loop has stopped"
    settings = jobs.settings
    # The longest a healthy loop can take between rounds is one call (bounded by the longest
    # lease) and one full backoff; twice that leaves room.
    longest_lease_s = max(
        (lease.ttl_s for lease in engine.elector.leases.values()), default=settings.lock_expiry_s
    )
    wedged_after_s = 2 * (max(longest_lease_s, settings.lock_expiry_s) + settings.max_backoff_s)
    last = engine.elector.last_round_at or engine.started_at
    age = jobs.clock.monotonic() - last
    if age > wedged_after_s:
        return f"the election loop has not completed a round for {age:.1f}s"
    for name, runner in engine.runners.items():
        # A custom schedule that raised is the user's code failing: a restart would fail
        # again (and disturb the node's other jobs), so only /jobs reports it.
        if runner.crashed is not None and runner.spec.kind != "custom":
            return f"the schedule loop of job {name!r} died: {runner.crashed!r}"
    return None
