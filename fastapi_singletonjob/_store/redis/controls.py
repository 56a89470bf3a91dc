"""The operators' calls on Redis: the ``CONTROL`` script (pause, trigger, step-down, and the
wake-up notice it publishes), a node's leaving, and the one read of the whole cluster. The
election reads the controls and keeps the membership inside its own ``ELECT`` call
(``_store.redis.store``)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from ..._checkpoint import checked
from .. import keys as _keys
from ..base import DEFAULT_CONTROL_TIMEOUT_S, ClusterData, JobData
from ..membership import MemberRecord, Membership
from ..records import job_names, last_us
from . import scripts as _scripts
from .connect import bounded
from .topology import Topology, server_time

__all__ = ["RedisControls"]


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, Exception):
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class RedisControls:
    """The operators' methods of the Redis store: controls and the cluster read on the
    topology's calls client, leaving on the election's."""

    def __init__(self, topology: Topology, project: str, channel: str) -> None:
        self._topology = topology
        self._project = project
        self._channel = channel
        # The wake-up goes by the pub/sub of the releases (sharded on a cluster).
        script = _scripts.CONTROL_SHARDED if topology.sharded else _scripts.CONTROL
        self._script = topology.calls.register_script(script)

    async def set_control(
        self, field: str, value: str | None, *, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S
    ) -> bool:
        """See ``Store.set_control``: one ``CONTROL`` script call."""
        keys = [_keys.project_key(self._project, "controls")]
        changed = await bounded(
            self._script(keys=keys, args=[self._channel, field, value or ""]),
            timeout_s,
            self._topology.calls,
        )
        return int(changed) == 1

    async def leave(self, membership: Membership) -> None:
        """See ``Store.leave``: one pipeline, on the election's connections."""
        owner = membership.record.owner
        membership.left = True  # before the deletion: no election call writes it back
        async with self._topology.election.pipeline(transaction=False) as pipe:
            pipe.hdel(_keys.project_key(self._project, "nodes"), owner)
            pipe.zrem(_keys.project_key(self._project, "nodes:expiry"), owner)
            pipe.hdel(_keys.project_key(self._project, "nodes:placement"), owner)
            pipe.hincrby(_keys.project_key(self._project, "nodes:placement"), "#epoch", 1)
            await pipe.execute()
        membership.confirmed(False)

    async def read_cluster(
        self, jobs: Iterable[str] = (), *, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S
    ) -> ClusterData:
        """See ``Store.read_cluster``: two pipelines."""
        return await bounded(self._read_cluster(list(jobs)), timeout_s, self._topology.calls)

    async def _read_cluster(self, extra: list[str]) -> ClusterData:
        project, client = self._project, self._topology.calls
        nodes = _keys.project_key(project, "nodes")
        async with client.pipeline(transaction=False) as pipe:
            if not self._topology.sharded:  # a cluster refuses TIME in a pipeline
                pipe.time()
            pipe.hgetall(nodes)
            pipe.zrange(_keys.project_key(project, "nodes:expiry"), 0, -1, withscores=True)
            pipe.hgetall(_keys.project_key(project, "controls"))
            replies = await pipe.execute()
        if self._topology.sharded:
            replies = [await server_time(client, nodes), *replies]
        (seconds, micros), records, expiries, raw_controls = replies
        now_ms = seconds * 1000 + micros // 1000
        now = datetime.fromtimestamp(now_ms / 1000, UTC)
        members = []
        for owner_raw, score in expiries:
            owner = _text(owner_raw) or ""
            text = _text(records.get(owner_raw))
            record = MemberRecord.from_json(owner, text) if text and score > now_ms else None
            if record is not None:
                members.append((record, datetime.fromtimestamp(score / 1000, UTC)))
        controls = {_text(k) or "": _text(v) or "" for k, v in raw_controls.items()}
        names = sorted(job_names(members, controls).union(extra))
        async with client.pipeline(transaction=False) as pipe:
            for name in names:
                lock = _keys.job_key(project, name, "lock")
                pipe.get(lock)
                pipe.pttl(lock)
                pipe.get(_keys.job_key(project, name, "last"))
                pipe.hgetall(_keys.job_key(project, name, "checkpoint"))
            raw = await pipe.execute(raise_on_error=False)
        data = {}
        for i, name in enumerate(names):
            value, pttl, last, fields = raw[4 * i : 4 * i + 4]
            stored = fields if isinstance(fields, dict) else None
            data[name] = JobData(
                name=name,
                value=_text(value),
                ttl_s=pttl / 1000 if isinstance(pttl, int) and pttl >= 0 else None,
                last_us=last_us(_text(last)),
                checkpoint=checked(
                    name, {_text(k) or "": v for k, v in stored.items()} if stored else None
                ),
            )
        return ClusterData(now=now, members=members, controls=controls, jobs=data)
