"""The cluster view: every live node and every job of a project, as stored in Redis.

Built only from what the store holds (membership records, locks, controls, checkpoints), so
every replica, and the CLI, which has no job definitions, see the same thing.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from pydantic import BaseModel, Field

from .._lock_value import node_of, parse_lock_value, shown_lock_value
from .._store import keys as _keys
from .._store.base import ClusterData, JobData
from .status import CheckpointStatus

__all__ = ["ClusterJob", "ClusterNode", "ClusterStatus", "cluster_status"]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


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


class ClusterJob(BaseModel):
    """One job, as stored."""

    name: str
    schedule: str | None = Field(description="As the nodes that registered it announce it.")
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
    checkpoint: CheckpointStatus | None = Field(
        None, description="The stored checkpoint (jobs with checkpoint=True)."
    )


class ClusterStatus(BaseModel):
    """``jobs.cluster_status()`` and ``GET /cluster``: the same from every replica."""

    project: str
    observed_at: datetime = Field(description="The Redis server's time of the read.")
    nodes: list[ClusterNode]
    jobs: list[ClusterJob]


def _paused_at(text: str | None) -> datetime | None:
    try:
        return datetime.fromisoformat(json.loads(text or "")["at"])
    except (ValueError, TypeError, KeyError):
        return None


def _job(data: ClusterData, job: JobData) -> ClusterJob:
    token, holder = parse_lock_value(job.value)
    registered = [
        (record.node_id, record.jobs[job.name])
        for record, _ in data.members
        if job.name in record.jobs
    ]
    paused = data.controls.get(_keys.control_field("paused", job.name))
    pending = [
        control
        for control in ("trigger", "step-down")
        if _keys.control_field(control, job.name) in data.controls
    ]
    return ClusterJob(
        name=job.name,
        schedule=registered[0][1] if registered else None,
        nodes=sorted({node for node, _ in registered}),
        leader=node_of(holder) if token is not None else (holder and shown_lock_value(holder)),
        fencing_token=token,
        lease_time_left_s=None if job.ttl_s is None else round(job.ttl_s, 3),
        paused=paused is not None,
        paused_at=_paused_at(paused),
        pending=pending,
        last_instant=None if job.last_us is None else _EPOCH + timedelta(microseconds=job.last_us),
        checkpoint=None if job.checkpoint is None else CheckpointStatus.of(job.checkpoint),
    )


def cluster_status(project: str, data: ClusterData) -> ClusterStatus:
    """The view of ``data``, read from ``project``'s keys."""
    holders = {name: parse_lock_value(job.value)[1] for name, job in data.jobs.items() if job.value}
    nodes = [
        ClusterNode(
            node_id=record.node_id,
            owner=record.owner,
            version=record.version,
            started_at=record.started_at,
            last_seen=expiry - timedelta(seconds=record.ttl_s),
            expires_in_s=round(max(0.0, (expiry - data.now).total_seconds()), 3),
            jobs=sorted(record.jobs),
            leads=sorted(name for name, owner in holders.items() if owner == record.owner),
        )
        for record, expiry in sorted(data.members, key=lambda x: (x[0].node_id, x[0].owner))
    ]
    return ClusterStatus(
        project=project,
        observed_at=data.now,
        nodes=nodes,
        jobs=[_job(data, data.jobs[name]) for name in sorted(data.jobs)],
    )
