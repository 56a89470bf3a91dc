"""What this node knows about its jobs, as typed (pydantic) snapshots, and its health.

The status router serves these models; ``SingletonJobs.status()`` returns them too. Nothing
here holds a secret: the store is shown by its redacted URL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from datetime import datetime
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from .._checkpoint import Checkpoint
from .._engine.engine import Engine
from .._engine.snapshot import EngineSnapshot, EngineState
from .._outcomes import DropReason, JobStats, Outcome, RunRecord

if TYPE_CHECKING:
    from .._singletonjobs import SingletonJobs

__all__ = [
    "CheckpointStatus",
    "HealthStatus",
    "JobReport",
    "JobStatus",
    "LastRun",
    "NodeStatus",
    "StoreStatus",
    "add_checkpoints",
    "liveness",
    "node_status",
    "readiness",
]


CHECKPOINT_READ_S = 1.0
"""Longest the status waits for the checkpoints from Redis."""
PROBE_WAIT_S = 1.0
"""Longest a readiness probe waits for the store, and then the election, to answer again."""
_PROBE_POLL_S = 0.01


class LastRun(BaseModel):
    """The last finished run of a job on this node."""

    scheduled_at: datetime = Field(description="The tick or cron instant it ran for.")
    started_at: datetime
    finished_at: datetime
    duration_s: float
    outcome: Outcome
    error: str | None = Field(None, description="`Type: message` of a failed run, shortened.")


class CheckpointStatus(BaseModel):
    """A job's checkpoint as stored in Redis (its ``state`` is never shown)."""

    iteration: int = Field(description="Successful runs, cluster-wide.")
    last_completed_at: datetime | None
    last_scheduled_at: datetime | None
    last_outcome: str | None
    last_error: str | None
    node_id: str | None = Field(description="The node that wrote it last.")
    fencing_token: int | None = Field(description="The term that wrote it last.")
    has_state: bool = Field(description="Whether a state is saved (its value is not shown).")

    @classmethod
    def of(cls, checkpoint: Checkpoint) -> CheckpointStatus:
        """The status form of ``checkpoint``."""
        fields = {f.name: getattr(checkpoint, f.name) for f in dataclasses.fields(checkpoint)}
        return cls(**{**fields, "has_state": fields.pop("state") is not None})


class JobStatus(BaseModel):
    """One job as this node sees it."""

    name: str
    schedule: str = Field(description='For example "fixed rate every 500ms".')
    kind: Literal["interval", "fixed_rate", "cron", "custom"]
    enabled: bool
    leader: str | None = Field(description="Node id of the node holding the lock, if known.")
    is_leader: bool = Field(description="Whether this node leads the job now.")
    paused: bool = Field(
        False, description="Paused by an operator (`jobs.pause`): its leader starts no run."
    )
    fencing_token: int | None = Field(description="Token of the leader's current term.")
    lease_time_left_s: float | None = Field(
        description="Time left on the leader's lease (this node's deadline when it leads; "
        "a follower's last sight of it, null once that is older than the lease had left).",
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
    checkpoint: CheckpointStatus | None = Field(
        None,
        description="The checkpoint as stored in Redis, the same from every replica; null "
        "before the first run, with checkpoint=False, before startup, or when Redis did not "
        "answer within a second.",
    )


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
    state: Literal["starting", "running", "draining", "stopped"] = "stopped"
    """The engine's life-cycle state; ``draining`` while shutdown waits for runs in flight."""
    store: StoreStatus
    jobs: list[JobStatus]


class JobReport(BaseModel):
    """This node, its store and one job."""

    project: str
    node_id: str
    started: bool
    state: Literal["starting", "running", "draining", "stopped"] = "stopped"
    """The engine's life-cycle state; ``draining`` while shutdown waits for runs in flight."""
    store: StoreStatus
    job: JobStatus


Health = Literal["ok", "degraded", "unavailable"]


class HealthStatus(BaseModel):
    """A probe's answer: ``ok`` and ``degraded`` are 200, ``unavailable`` is 503."""

    status: Health
    reason: str | None = Field(None, description="Why it is not ok.")
    node_id: str


def _store_status(jobs: SingletonJobs, snap: EngineSnapshot | None) -> StoreStatus:
    if snap is None:
        return StoreStatus(
            url=jobs.store_description,
            reachable=False,
            last_contact_s_ago=None,
            round_trip_ms=None,
            consecutive_failures=0,
            error="not started",
        )
    store = snap.store
    return StoreStatus(
        url=jobs.store_description,
        reachable=store.last_success_s_ago is not None and store.failures == 0,
        last_contact_s_ago=_round(store.last_success_s_ago),
        round_trip_ms=None if store.round_trip_s is None else round(store.round_trip_s * 1e3, 3),
        consecutive_failures=store.failures,
        error=store.last_error,
    )


def _job_status(jobs: SingletonJobs, name: str, snap: EngineSnapshot | None) -> JobStatus:
    spec = jobs.jobs[name]
    job = snap.jobs.get(name) if snap is not None else None
    stats = job.stats if job is not None else JobStats()
    last = stats.last_run
    return JobStatus(
        name=name,
        schedule=str(spec.schedule),
        kind=spec.kind,
        enabled=spec.enabled,
        leader=job.holder if job else None,
        is_leader=job.leads if job else False,
        paused=job.paused if job else False,
        fencing_token=job.token if job else None,
        lease_time_left_s=_round(job.time_left_s) if job else None,
        running=job.running if job else False,
        running_since=stats.running_since,
        last_run=None if last is None else _last_run(last),
        next_run=stats.next_run,
        runs=stats.runs,
        failures=stats.failures,
        timeouts=stats.timeouts,
        cancelled=stats.cancelled,
        dropped_ticks=stats.dropped_total,
        dropped={reason: stats.dropped[reason] for reason in DropReason},
        not_leader_ticks=stats.not_leader,
        error=None if job is None or job.error is None else repr(job.error),
        checkpoint=None,
    )


def _last_run(run: RunRecord) -> LastRun:
    return LastRun(**{**dataclasses.asdict(run), "duration_s": round(run.duration_s, 6)})


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _snapshot(jobs: SingletonJobs) -> EngineSnapshot | None:
    engine = jobs.engine
    return None if engine is None else engine.snapshot()


def node_status(jobs: SingletonJobs, only: str | None = None) -> NodeStatus:
    """A snapshot of this node; with ``only``, of that job alone."""
    snap = _snapshot(jobs)
    names = [only] if only is not None else list(jobs.jobs)
    return NodeStatus(
        project=jobs.project,
        node_id=jobs.node_id,
        started=snap is not None,
        state=snap.state.value if snap is not None else "stopped",
        store=_store_status(jobs, snap),
        jobs=[_job_status(jobs, name, snap) for name in names],
    )


async def add_checkpoints(jobs: SingletonJobs, statuses: list[JobStatus]) -> None:
    """Fill in the stored checkpoint of each job in ``statuses``: one read each, together,
    bounded by ``CHECKPOINT_READ_S``; a job whose read fails shows none."""
    engine = jobs.engine
    if engine is None:
        return
    wanted = [status for status in statuses if jobs.jobs[status.name].checkpoint]
    reads = [engine.store.read_checkpoint(s.name, timeout_s=CHECKPOINT_READ_S) for s in wanted]
    results = await asyncio.gather(*reads, return_exceptions=True)
    for status, read in zip(wanted, results, strict=True):
        if isinstance(read, Checkpoint):
            status.checkpoint = CheckpointStatus.of(read)


async def readiness(jobs: SingletonJobs, *, strict: bool) -> tuple[Health, str | None]:
    """Whether this node is ready, and why not: ``unavailable`` before startup, while
    draining, or when the election loop is dead. Trouble with the store (not reached within a
    lock expiry) makes it ``unavailable`` when ``strict``, else ``degraded``. Before saying so,
    a PING checks the store now (the election may be waiting out its backoff) and, when it
    answers, wakes the election: readiness returns with the store, not a backoff later.
    Followers are ready too: readiness never depends on leading."""
    snap = _snapshot(jobs)
    reason = _not_serving(snap)
    if reason is not None:
        return "unavailable", reason
    assert snap is not None and jobs.engine is not None
    reason = _store_trouble(jobs, snap)
    if reason is None:
        return "ok", None
    if await _answers_again(jobs.engine):
        return "ok", None
    return ("unavailable" if strict else "degraded"), reason


async def _answers_again(engine: Engine) -> bool:
    """Whether the store answers a PING now and, woken by it, the election completes a round
    within ``PROBE_WAIT_S``."""
    elector, began = engine.elector, engine.clock.monotonic()
    try:
        await asyncio.wait_for(engine.store.ping(), PROBE_WAIT_S)
    except Exception:
        return False
    elector.retry_now()
    for _ in range(round(PROBE_WAIT_S / _PROBE_POLL_S)):  # in real time, whatever the clock
        if elector.failures == 0 and (elector.last_success_at or -math.inf) >= began:
            return True
        await asyncio.sleep(_PROBE_POLL_S)
    return False


def _not_serving(snap: EngineSnapshot | None) -> str | None:
    if snap is None:
        return "not started"
    if snap.state is EngineState.DRAINING:
        return "draining: the node is shutting down and takes no new runs"
    if snap.state is not EngineState.RUNNING:
        return str(snap.state.value)
    if not snap.election_alive:
        return "the election loop is not running"
    return None


def _store_trouble(jobs: SingletonJobs, snap: EngineSnapshot) -> str | None:
    store = snap.store
    if store.last_success_s_ago is None:
        return f"the lease store has not answered yet ({store.last_error or 'connecting'})"
    expiry_s = jobs.settings.lock_expiry_s
    if store.last_success_s_ago > expiry_s:
        return (
            f"the lease store last answered {store.last_success_s_ago:.1f}s ago, more than "
            f"lock_expiry={expiry_s:g}s ({store.last_error or 'no answer'})"
        )
    return None


async def liveness(jobs: SingletonJobs) -> tuple[Health, str | None]:
    """``ok``, or ``unavailable`` with the reason a loop of the library is dead or wedged.
    An unreachable store is *not* a liveness failure: restarting would not fix it."""
    reason = _dead(jobs)
    return ("ok", None) if reason is None else ("unavailable", reason)


def _dead(jobs: SingletonJobs) -> str | None:
    snap = _snapshot(jobs)
    if snap is None:
        return "not started"
    if not snap.election_alive:
        return "the election loop has stopped"
    if snap.state is EngineState.RUNNING and not snap.timer_alive:
        return "the timer has stopped"
    settings = jobs.settings
    # The longest a healthy loop can take between rounds is one call (bounded by the longest
    # lease) and one full backoff; twice that leaves room.
    wedged_after_s = 2 * (
        max(snap.longest_lease_s, settings.lock_expiry_s) + settings.max_backoff_s
    )
    if snap.last_round_s_ago > wedged_after_s:
        return f"the election loop has not completed a round for {snap.last_round_s_ago:.1f}s"
    for name, job in snap.jobs.items():
        # A schedule that raised is the user's code failing (a custom schedule): a restart
        # would fail again and disturb the node's other jobs, so only /jobs reports it.
        if job.error is not None and jobs.jobs[name].kind != "custom":
            return f"the schedule of job {name!r} failed: {job.error!r}"
    return None
