"""Every response model of the routers, as typed (pydantic) models: this node and its jobs,
the health probes' answer, the cluster view and the admin actions' result.

``SingletonJobs.status()`` and ``cluster_status()`` return these too. Nothing here holds a
secret: the store is shown by its redacted URL, a checkpoint without its state.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from .._checkpoint import Checkpoint
from .._history import MISSED_REASONS, Occurrence
from .._outcomes import DropReason, Outcome

__all__ = [
    "Action",
    "ActionResult",
    "CheckpointStatus",
    "ClusterJob",
    "ClusterNode",
    "ClusterStatus",
    "Health",
    "HealthStatus",
    "JobHealth",
    "JobReport",
    "JobStatus",
    "JobsHealth",
    "LastRun",
    "NodeStatus",
    "StoreStatus",
]


# -- this node ------------------------------------------------------------------------------


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


class HistoryEntry(BaseModel):
    """One occurrence of a job: a run, or an instant its leader did not run, and why."""

    scheduled_at: datetime = Field(description="The run's tick or cron instant.")
    kind: Literal["run", "missed"]
    node_id: str = Field(description="The node that ran it, or did not.")
    fencing_token: int = Field(description="The leadership term it belongs to.")
    recorded_at: datetime = Field(description="When Redis recorded it (Redis's clock).")
    started_at: datetime | None = Field(None, description="When the run's code began.")
    duration_s: float | None = Field(None, description="How long the run took.")
    outcome: Outcome | None = Field(None, description="How the run ended.")
    reason: DropReason | None = Field(None, description="Why the instant did not run.")
    reason_text: str | None = Field(None, description="That reason, in a line.")
    error: str | None = Field(None, description="The run's error, shortened.")
    count: int | None = Field(
        1,
        description="How many instants a missed entry stands for, from scheduled_at on "
        "(a gap too long for one entry each); null: more than were counted.",
    )
    last_at: datetime | None = Field(
        None, description="With a count above 1: the last instant it stands for."
    )

    @classmethod
    def of(cls, occurrence: Occurrence) -> HistoryEntry:
        """The response form of ``occurrence``."""
        reason = occurrence.reason
        return cls(
            scheduled_at=occurrence.scheduled_at,
            kind="missed" if occurrence.missed else "run",
            node_id=occurrence.node_id,
            fencing_token=occurrence.fencing_token,
            recorded_at=occurrence.recorded_at,
            started_at=occurrence.started_at,
            duration_s=occurrence.duration_s,
            outcome=None if occurrence.outcome is None else Outcome(occurrence.outcome),
            reason=None if reason is None else DropReason(reason),
            reason_text=None if reason is None else MISSED_REASONS.get(reason),
            error=occurrence.error,
            count=occurrence.count,
            last_at=occurrence.last_at,
        )


class JobHistory(BaseModel):
    """A job's last occurrences as stored in Redis, newest first: the same from every
    replica (``GET {prefix}/jobs/{name}/history``)."""

    job: str
    entries: list[HistoryEntry]


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
    unrecorded_runs: int = Field(
        0,
        description="Runs whose checkpoint record Redis did not answer in time, or refused "
        "with an error (whether it was written is unknown); each is logged as a WARNING. The "
        "runs themselves went on.",
    )
    error: str | None = Field(None, description="Why the job stopped on this node, if it did.")
    let_go: str | None = Field(
        None,
        description="Why this node let the job go for another node to run (its runs could "
        "not start for a lock expiry: claims or checkpoint calls to Redis failing or timing "
        "out), until it leads the job again; null otherwise.",
    )
    overdue_since: datetime | None = Field(
        default=None,
        description="Since when the job is overdue (no run started within its period plus a "
        "grace), as stored in Redis: the same on every replica that watches it, as of its "
        "last check (every lock expiry); null when it is not, or this node does not watch it.",
    )
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
    refused: str | None = Field(
        default=None,
        description="While Redis refuses this node (a password missing or wrong, a database "
        "index out of range, an ACL permission missing): what it refused and the fix. No "
        "retry mends it; the node retries slowly until it is fixed.",
    )


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


# -- the probes -----------------------------------------------------------------------------

Health = Literal["ok", "degraded", "unavailable"]
"""A probe's verdict (``_web.health``)."""


class HealthStatus(BaseModel):
    """A probe's answer: ``ok`` and ``degraded`` are 200, ``unavailable`` is 503."""

    status: Health
    reason: str | None = Field(None, description="Why it is not ok.")
    node_id: str


class JobHealth(BaseModel):
    """Whether this node can run one job."""

    name: str
    status: Literal["ok", "let_go", "stopped", "disabled"] = Field(
        description="`ok`: this node runs it when it leads, or can take it over; `let_go`: "
        "this node let it go for another node to run (`cause` says why); `stopped`: its "
        "schedule stopped on this node; `disabled`: defined with `enabled=False`."
    )
    cause: str | None = Field(None, description="Why it is not ok.")
    is_leader: bool


class JobsHealth(HealthStatus):
    """The strict readiness probe's answer, with whether this node can run each job."""

    jobs: list[JobHealth] = Field(default_factory=list)


# -- the cluster, as stored ---------------------------------------------------------------


class ClusterNode(BaseModel):
    """One live node, as its membership record says."""

    node_id: str
    owner: str = Field(description="The id in its locks: node id, '#', a per-instance nonce.")
    version: str = Field(description="The library's version on the node.")
    started_at: datetime
    last_seen: datetime = Field(description="Its last election round that reached Redis.")
    expires_in_s: float = Field(description="Dropped from the view after this, unless seen.")
    jobs: list[str] = Field(description="The jobs it has registered (enabled).")
    leads: list[str] = Field(description="The jobs whose lock it holds now.")


class ScheduleVariant(BaseModel):
    """One of the schedules that the live nodes announce for a job they do not agree on."""

    schedule: str
    nodes: list[str] = Field(description="The live nodes that announce this schedule.")


class ClusterJob(BaseModel):
    """One job, as stored."""

    name: str
    schedule: str | None = Field(
        description="As the nodes that registered it announce it; when they differ "
        "(conflicts), the leader's, which is the one that runs."
    )
    conflicts: list[ScheduleVariant] = Field(
        default_factory=list,
        description="Empty while every live node that registered the job announces one "
        "schedule; else each schedule with its nodes: two services on one project (give "
        "each its own project=, or make the definitions match), or a rolling deploy that "
        "changes it. Only the leader's schedule runs.",
    )
    nodes: list[str] = Field(description="Live nodes that registered it.")
    leader: str | None = Field(description="Node id of the lock's holder, if any.")
    fencing_token: int | None
    lease_time_left_s: float | None = Field(description="Time the lock has left, per Redis.")
    paused: bool
    paused_at: datetime | None = None
    pending: list[str] = Field(
        default_factory=list,
        description="Operators' requests its leader has not consumed: 'trigger', 'step-down'.",
    )
    last_instant: datetime | None = Field(
        None, description="The latest cron/custom instant a leader claimed (started)."
    )
    overdue_since: datetime | None = Field(
        default=None,
        description="Since when the job is overdue (its open spell as stored: no run started "
        "within its period plus a grace); null when it is not.",
    )
    checkpoint: CheckpointStatus | None = Field(
        None, description="The stored checkpoint (jobs with checkpoint=True)."
    )


class ClusterStatus(BaseModel):
    """``jobs.cluster_status()`` and ``GET /cluster``: the same from every replica."""

    project: str
    observed_at: datetime = Field(description="The Redis server's time of the read.")
    nodes: list[ClusterNode]
    jobs: list[ClusterJob]


# -- the admin actions ----------------------------------------------------------------------

Action = Literal["pause", "resume", "trigger", "step-down"]
"""The operators' actions of the admin router (``POST /jobs/{name}/<action>``)."""


class ActionResult(BaseModel):
    """What an admin action did."""

    job: str
    action: Action
    accepted: bool = Field(
        description="Stored in Redis and pushed to every node; the leader acts on it at its "
        "next election round."
    )
