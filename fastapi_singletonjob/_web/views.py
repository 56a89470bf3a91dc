"""From what the library knows to the response models: this node from its engine's snapshot,
each job's stored checkpoint, and the cluster from what the store holds.

The cluster view is built only from the store's data (membership records, locks, controls,
checkpoints), so every replica, and the CLI, which has no job definitions, see the same thing.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Literal

from .._aio import within
from .._checkpoint import Checkpoint
from .._engine.snapshot import EngineSnapshot
from .._lock_value import node_of, parse_lock_value, shown_lock_value
from .._outcomes import DropReason, JobStats, RunRecord
from .._store import keys as _keys
from .._store.base import ClusterData, JobData
from .models import (
    CheckpointStatus,
    ClusterJob,
    ClusterNode,
    ClusterStatus,
    JobHealth,
    JobReport,
    JobStatus,
    LastRun,
    NodeStatus,
    ScheduleVariant,
    StoreStatus,
)
from .source import StatusSource

__all__ = [
    "jobs_health",
    "CHECKPOINT_READ_S",
    "add_checkpoints",
    "cluster_view",
    "job_report",
    "node_status",
]

CHECKPOINT_READ_S = 1.0
"""Longest the status waits for the checkpoints from Redis."""

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


# -- this node ------------------------------------------------------------------------------


def node_status(
    source: StatusSource, only: str | None = None, kept: Mapping[str, JobStats] | None = None
) -> NodeStatus:
    """A snapshot of this node; with ``only``, of that job alone. ``kept``: each job's
    counters and last run as a stopped node left them, shown while it is not started."""
    snap = source.snapshot()
    names = [only] if only is not None else list(source.jobs)
    return NodeStatus(
        project=source.settings.project,
        node_id=source.settings.node_id,
        started=snap is not None,
        state=snap.state.value if snap is not None else "stopped",
        store=_store_status(source, snap),
        jobs=[_job_status(source, name, snap, kept) for name in names],
    )


def job_report(node: NodeStatus) -> JobReport:
    """The one-job form of ``node``, taken with ``only``."""
    (job,) = node.jobs
    return JobReport(
        project=node.project,
        node_id=node.node_id,
        started=node.started,
        state=node.state,
        store=node.store,
        job=job,
    )


async def add_checkpoints(source: StatusSource, statuses: list[JobStatus]) -> None:
    """Fill in the stored checkpoint of each job in ``statuses`` while the engine runs: one
    read each, together, bounded by ``CHECKPOINT_READ_S``; a job whose read fails shows none."""
    if source.snapshot() is None:
        return
    specs = source.jobs
    wanted = [status for status in statuses if specs[status.name].checkpoint]
    reads = [_read_checkpoint(source, status.name) for status in wanted]
    # Whatever a read raises (STORE_ERRORS, or a cluster client's own RedisClusterException)
    # leaves that job without a checkpoint: the status answers all the same.
    results = await asyncio.gather(*reads, return_exceptions=True)
    for status, read in zip(wanted, results, strict=True):
        if isinstance(read, Checkpoint):
            status.checkpoint = CheckpointStatus.of(read)


async def _read_checkpoint(source: StatusSource, job: str) -> Checkpoint | None:
    return await within(source.checkpoint(job), CHECKPOINT_READ_S)


def _store_status(source: StatusSource, snap: EngineSnapshot | None) -> StoreStatus:
    if snap is None:
        return StoreStatus(
            url=source.store_description,
            reachable=False,
            last_contact_s_ago=None,
            round_trip_ms=None,
            consecutive_failures=0,
            error="not started",
        )
    store = snap.store
    return StoreStatus(
        url=source.store_description,
        reachable=store.last_success_s_ago is not None and store.failures == 0,
        last_contact_s_ago=_round(store.last_success_s_ago),
        round_trip_ms=None if store.round_trip_s is None else round(store.round_trip_s * 1e3, 3),
        consecutive_failures=store.failures,
        error=store.last_error,
        refused=store.refused,
    )


def _job_status(
    source: StatusSource,
    name: str,
    snap: EngineSnapshot | None,
    kept: Mapping[str, JobStats] | None = None,
) -> JobStatus:
    spec = source.jobs[name]
    job = snap.jobs.get(name) if snap is not None else None
    if job is not None:
        stats = job.stats
    elif snap is None and kept is not None and name in kept:
        stats = dataclasses.replace(kept[name], running_since=None, next_run=None)
    else:
        stats = JobStats()
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
        unrecorded_runs=stats.unrecorded,
        error=None if job is None or job.error is None else repr(job.error),
        let_go=job.let_go if job else None,
        overdue_since=None if snap is None or (job and job.paused) else snap.overdue.get(name),
        checkpoint=None,
    )


def jobs_health(source: StatusSource) -> list[JobHealth]:
    """Whether this node can run each job, from the snapshot."""
    snap = source.snapshot()
    health = []
    for name, spec in sorted(source.jobs.items()):
        job = snap.jobs.get(name) if snap is not None else None
        status: Literal["ok", "let_go", "stopped", "disabled"] = "ok"
        cause = None
        if not spec.enabled:
            status = "disabled"
        elif job is not None and job.error is not None:
            status, cause = "stopped", repr(job.error)
        elif job is not None and job.let_go is not None:
            status, cause = "let_go", job.let_go
        leads = job.leads if job is not None else False
        health.append(JobHealth(name=name, status=status, cause=cause, is_leader=leads))
    return health


def _last_run(run: RunRecord) -> LastRun:
    return LastRun(**{**dataclasses.asdict(run), "duration_s": round(run.duration_s, 6)})


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


# -- the cluster, as stored ---------------------------------------------------------------


def cluster_view(project: str, data: ClusterData) -> ClusterStatus:
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
        jobs=[_cluster_job(data, data.jobs[name]) for name in sorted(data.jobs)],
    )


def _cluster_job(data: ClusterData, job: JobData) -> ClusterJob:
    token, holder = parse_lock_value(job.value)
    registered = sorted(
        (record.node_id, record.jobs[job.name])
        for record, _ in data.members
        if job.name in record.jobs
    )
    paused = data.controls.get(_keys.control_field("paused", job.name))
    pending = [
        control
        for control in ("trigger", "step-down")
        if _keys.control_field(control, job.name) in data.controls
    ]
    leader = node_of(holder) if token is not None else None
    variants: dict[str, set[str]] = {}
    for node, schedule in registered:
        variants.setdefault(schedule, set()).add(node)
    led = [schedule for node, schedule in registered if node == leader]
    return ClusterJob(
        name=job.name,
        schedule=led[0] if led else (registered[0][1] if registered else None),
        conflicts=[
            ScheduleVariant(schedule=schedule, nodes=sorted(nodes))
            for schedule, nodes in sorted(variants.items())
        ]
        if len(variants) > 1
        else [],
        nodes=sorted({node for node, _ in registered}),
        leader=node_of(holder) if token is not None else (holder and shown_lock_value(holder)),
        fencing_token=token,
        lease_time_left_s=None if job.ttl_s is None else round(job.ttl_s, 3),
        paused=paused is not None,
        paused_at=_keys.parse_paused(job.name, paused),
        pending=pending,
        last_instant=None if job.last_us is None else _EPOCH + timedelta(microseconds=job.last_us),
        # A paused job is never overdue: its spell is over, even before a check deletes it.
        overdue_since=None if paused is not None else job.overdue_since,
        checkpoint=None if job.checkpoint is None else CheckpointStatus.of(job.checkpoint),
    )
