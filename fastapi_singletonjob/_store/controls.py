"""The operators' methods of the Redis store: controls (pause, trigger, step-down) and the
one read of the whole cluster. The election reads the controls and keeps the membership
inside its own ``ELECT`` call (``_store.redis.scripts``); these are the calls of operators and
of the cluster view."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from .._checkpoint import checked
from . import keys as _keys
from .base import DEFAULT_CONTROL_TIMEOUT_S, ClusterData, JobData
from .membership import MemberRecord, Membership
from .records import job_names, last_us
from .redis import scripts as _scripts

__all__ = ["RedisControls"]


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, Exception):
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class RedisControls:
    """The operators' methods of ``RedisLeaseStore``, on the claims' pool."""

    _claims: Redis
    _redis: Redis
    _project: str
    _channel: str
    membership: Membership | None = None

    def announce(self, membership: Membership) -> None:
        """See ``Store.announce``."""
        self.membership = membership

    @functools.cached_property
    def _control_script(self) -> AsyncScript:
        return self._claims.register_script(_scripts.CONTROL)

    async def set_control(
        self, field: str, value: str | None, *, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S
    ) -> bool:
        """See ``Store.set_control``: one ``CONTROL`` script call."""
        keys = [_keys.project_key(self._project, "controls")]
        call = self._control_script(keys=keys, args=[self._channel, field, value or ""])
        return int(await asyncio.wait_for(call, timeout_s)) == 1

    async def leave(self) -> None:
        """See ``Store.leave``: one pipeline, on the election's connections."""
        if self.membership is None:
            return
        owner = self.membership.record.owner
        self.membership.left = True  # before the deletion: no election call writes it back
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hdel(_keys.project_key(self._project, "nodes"), owner)
            pipe.zrem(_keys.project_key(self._project, "nodes:expiry"), owner)
            pipe.hdel(_keys.project_key(self._project, "nodes:placement"), owner)
            pipe.hincrby(_keys.project_key(self._project, "nodes:placement"), "#epoch", 1)
            await pipe.execute()
        self.membership.confirmed(False)

    async def read_cluster(
        self, jobs: Iterable[str] = (), *, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S
    ) -> ClusterData:
        """See ``Store.read_cluster``: two pipelines."""
        return await asyncio.wait_for(self._read_cluster(list(jobs)), timeout_s)

    async def _read_cluster(self, extra: list[str]) -> ClusterData:
        project = self._project
        async with self._claims.pipeline(transaction=False) as pipe:
            pipe.time()
            pipe.hgetall(_keys.project_key(project, "nodes"))
            pipe.zrange(_keys.project_key(project, "nodes:expiry"), 0, -1, withscores=True)
            pipe.hgetall(_keys.project_key(project, "controls"))
            (seconds, micros), records, expiries, raw_controls = await pipe.execute()
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
        async with self._claims.pipeline(transaction=False) as pipe:
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
