"""The operators' half of both stores: controls (pause, trigger, step-down) and the one read
of the whole cluster, on Redis (``RedisControls``) or in Python for ``memory://``
(``MemoryControls``). The election reads the controls and keeps the membership inside its own
``ELECT`` call (``_store.redis.scripts``); these are the calls of operators and of the
cluster view."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from .._checkpoint import checked
from . import keys as _keys
from .base import DEFAULT_CONTROL_TIMEOUT_S, ClusterData, JobData
from .membership import MemberRecord, Membership
from .redis import scripts as _scripts

if TYPE_CHECKING:
    from .._clock import Clock
    from .memory import _MemoryData

__all__ = [
    "MemoryControls",
    "RedisControls",
]


def _job_names(members: list[tuple[MemberRecord, datetime]], controls: dict[str, str]) -> set[str]:
    names = {job for record, _ in members for job in record.jobs}
    names.update(key.partition(":")[2] for key in controls)
    names.discard("")
    return names


def _last_us(raw: str | None) -> int | None:
    if not raw:
        return None
    head = raw.partition(":")[0]
    return int(head) if head.isdigit() else None


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
        names = sorted(_job_names(members, controls).union(extra))
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
                last_us=_last_us(_text(last)),
                checkpoint=checked(
                    name, {_text(k) or "": v for k, v in stored.items()} if stored else None
                ),
            )
        return ClusterData(now=now, members=members, controls=controls, jobs=data)


class MemoryControls:
    """The operators' methods of ``MemoryLeaseStore``, and the membership and controls half
    of its ``elect``, as ``ELECT`` does them, on the injected clock."""

    _data: _MemoryData
    _clock: Clock
    _key: Callable[[str], str]
    _project: str
    membership: Membership | None = None

    def announce(self, membership: Membership) -> None:
        """See ``Store.announce``."""
        self.membership = membership

    def _control_key(self, field: str) -> str:
        return f"{self._project}\x00{field}"

    async def set_control(
        self, field: str, value: str | None, *, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S
    ) -> bool:
        """See ``Store.set_control``."""
        await asyncio.sleep(0)
        key = self._control_key(field)
        if value is None:
            changed = self._data.controls.pop(key, None) is not None
        else:
            changed = key not in self._data.controls
            self._data.controls[key] = value
        job = frozenset({field.partition(":")[2]})  # as CONTROL's "control <job>" notice
        for listener in list(self._data.listeners):
            listener(job)
        return changed

    async def leave(self) -> None:
        """See ``Store.leave``."""
        await asyncio.sleep(0)
        if self.membership is not None:
            self.membership.left = True
            key = self._control_key(self.membership.record.owner)
            self._data.members.pop(key, None)
            if self._data.joined.pop(key, None) is not None:
                epochs = self._data.epochs
                epochs[self._project] = epochs.get(self._project, 0) + 1
            self.membership.confirmed(False)

    def _keep_member(self, owner: str) -> None:
        """The membership part of one ``elect`` call, placement included."""
        member = self.membership
        if member is None or member.left:
            return
        now = self._clock.monotonic()
        now_ms = round(self._clock.now().timestamp() * 1000)
        members, joined = self._data.members, self._data.joined
        epochs = self._data.epochs
        key = self._control_key(owner)
        for other, (_, expiry) in list(members.items()):
            if expiry <= now:
                del members[other]
                joined.pop(other, None)
                epochs[self._project] = epochs.get(self._project, 0) + 1
        if member.payload() or key not in members:
            members[key] = (member.record.to_json(), now + member.ttl_ms / 1000)
        else:
            members[key] = (members[key][0], now + member.ttl_ms / 1000)
        if key not in joined:
            joined[key] = (now_ms, member.digest)
            epochs[self._project] = epochs.get(self._project, 0) + 1
        member.confirmed(True)
        epoch = str(epochs.get(self._project, 0))
        prefix = self._control_key("")
        flat = [
            item
            for other, (at, digest) in joined.items()
            if other.startswith(prefix)
            for item in (other[len(prefix) :], f"{at}|{digest}")
        ]
        member.placed(now_ms, epoch, flat if epoch != member.epoch else [])

    def _flags(self, job: str, held: bool) -> tuple[bool, bool, bool]:
        """The job's controls for one ``elect`` reply: paused, triggered, step-down; the
        requests are consumed by the holder only."""
        controls = self._data.controls
        paused = self._control_key(_keys.control_field("paused", job)) in controls
        if not held:
            return paused, False, False

        def take(control: _keys.Control) -> bool:
            key = self._control_key(_keys.control_field(control, job))
            return controls.pop(key, None) is not None

        return paused, take("trigger"), take("step-down")

    async def read_cluster(
        self, jobs: Iterable[str] = (), *, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S
    ) -> ClusterData:
        """See ``Store.read_cluster``."""
        await asyncio.sleep(0)
        mono, now = self._clock.monotonic(), self._clock.now()
        prefix = f"{self._project}\x00"
        members = []
        for key, (text, expiry) in self._data.members.items():
            owner = key.removeprefix(prefix)
            record = MemberRecord.from_json(owner, text) if key.startswith(prefix) else None
            if record is not None and expiry > mono:
                members.append((record, now + timedelta(seconds=expiry - mono)))
        controls = {
            key.removeprefix(prefix): value
            for key, value in self._data.controls.items()
            if key.startswith(prefix)
        }
        data = {}
        for name in sorted(_job_names(members, controls).union(jobs)):
            lock = self._data.locks.get(self._key(name))
            live = lock is not None and lock[1] > mono
            claimed = self._data.claimed.get(self._key(name))
            fields, expiry = self._data.checkpoints.get(self._key(name), (None, 0.0))
            data[name] = JobData(
                name=name,
                value=lock[0] if lock is not None and live else None,
                ttl_s=lock[1] - mono if lock is not None and live else None,
                last_us=claimed[0] if claimed else None,
                checkpoint=checked(name, fields if fields and expiry > mono else None),
            )
        return ClusterData(now=now, members=members, controls=controls, jobs=data)
