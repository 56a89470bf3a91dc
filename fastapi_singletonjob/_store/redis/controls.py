"""The operators' calls on Redis: the ``CONTROL`` script (pause, trigger, step-down, and the
wake-up notice it publishes), a node's leaving, and the one read of the whole cluster. The
election reads the controls and keeps the membership inside its own ``ELECT`` call
(``_store.redis.store``).

The cluster read never fails for what the keys hold (``_odd``): a key of another type
reads as empty, an expiry that is not a time the record could live to, a record, a control
field or a last instant that this library does not write as absent, each reported once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from redis.exceptions import ResponseError

from ..._checkpoint import checked
from ..._odd import odd_type, odd_value
from ..._overdue import parse_spell
from .. import keys as _keys
from ..base import DEFAULT_CONTROL_TIMEOUT_S, ClusterData, JobData
from ..membership import MAX_RECORD_TTL_S, MemberRecord, Membership
from ..records import job_names, last_us
from . import scripts as _scripts
from .connect import bounded
from .topology import Topology, server_time

__all__ = ["RedisControls"]


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, Exception):
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _typed(reply: Any, key: str, treated: str) -> Any:
    """A pipeline's ``reply`` to a read of ``key``; None, reported, when ``key`` is of another
    type than the read is for (``WRONGTYPE``)."""
    if isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE"):
        odd_type(key, treated)
        return None
    return reply


def _answered(reply: Any, key: str, empty: Any) -> Any:
    """``_typed`` for the cluster read's project keys: ``empty`` for a key of another type;
    any other error raises (the read failed)."""
    reply = _typed(reply, key, "read as empty (the next election round deletes it)")
    if isinstance(reply, Exception):
        raise reply
    return empty if reply is None else reply


def _overdue_since(
    spell: str | None, fields: dict[Any, Any] | None, last: str | None
) -> datetime | None:
    """Since when an ``overdue`` key's spell says the job is overdue, if its anchor is still
    the job's (built from the checkpoint's fields and the last claim as ``OVERDUE`` builds
    it): a spell whose job ran since, not yet deleted by a check, is over."""
    parsed = parse_spell(spell)
    if parsed is None:
        return None
    fields = {_text(k): _text(v) or "" for k, v in (fields or {}).items()}
    parts = [fields.get("last_scheduled_us") or "", fields.get("last_completed_us") or ""]
    anchor = ",".join([*(_digits(p) for p in parts), _digits(last or "")])
    return parsed[0] if parsed[2] == anchor else None


def _digits(text: str) -> str:
    """The leading digits of ``text``, as the ``OVERDUE`` script reads a stored value."""
    end = 0
    while end < len(text) and text[end].isdigit():
        end += 1
    return text[:end]


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
            self._topology,
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

    async def read_members(
        self, owners: Sequence[str], *, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S
    ) -> dict[str, MemberRecord]:
        """See ``Store.read_members``: one ``HMGET`` on the calls client (never on the
        election's connections); a ``nodes`` key of another type reads as empty."""
        if not owners:
            return {}
        nodes = _keys.project_key(self._project, "nodes")
        client = self._topology.calls
        try:
            texts = await bounded(client.hmget(nodes, list(owners)), timeout_s, self._topology)
        except ResponseError as exc:
            if _typed(exc, nodes, "read as empty (the next election round deletes it)") is None:
                return {}
            raise
        found = {}
        for owner, raw in zip(owners, texts, strict=True):
            text = _text(raw)
            record = None if text is None else MemberRecord.from_json(owner, text)
            if record is not None:
                found[owner] = record
        return found

    async def read_cluster(
        self, jobs: Iterable[str] = (), *, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S
    ) -> ClusterData:
        """See ``Store.read_cluster``: two pipelines."""
        return await bounded(self._read_cluster(list(jobs)), timeout_s, self._topology)

    async def _read_cluster(self, extra: list[str]) -> ClusterData:
        project, client = self._project, self._topology.calls
        nodes, expiry, controls_key = (
            _keys.project_key(project, name) for name in ("nodes", "nodes:expiry", "controls")
        )
        async with client.pipeline(transaction=False) as pipe:
            if not self._topology.sharded:  # a cluster refuses TIME in a pipeline
                pipe.time()
            pipe.hgetall(nodes)
            pipe.zrange(expiry, 0, -1, withscores=True)
            pipe.hgetall(controls_key)
            replies = await pipe.execute(raise_on_error=False)
        if self._topology.sharded:
            replies = [await server_time(client, nodes), *replies]
        times, records, expiries, raw_controls = replies
        if isinstance(times, Exception):
            raise times
        seconds, micros = times
        records = _answered(records, nodes, {})
        expiries = _answered(expiries, expiry, [])
        raw_controls = _answered(raw_controls, controls_key, {})
        now_ms = seconds * 1000 + micros // 1000
        now = datetime.fromtimestamp(now_ms / 1000, UTC)
        never_ms = now_ms + MAX_RECORD_TTL_S * 1000
        members = []
        for owner_raw, score in expiries:
            owner = _text(owner_raw) or ""
            text = _text(records.get(owner_raw))
            if score <= now_ms:  # expired: the next election round deletes it
                continue
            if score > never_ms:  # no election round wrote it (inf, 1e300)
                odd_value(
                    f"the expiry of {owner[:100]!r} in nodes:expiry",
                    repr(score),
                    "that node is left out of the cluster view (the next election round "
                    "deletes it)",
                )
                continue
            record = None if text is None else MemberRecord.from_json(owner, text)
            if record is not None:
                members.append((record, datetime.fromtimestamp(score / 1000, UTC)))
        controls = {_text(k) or "": _text(v) or "" for k, v in raw_controls.items()}
        for field in controls:
            if _keys.parse_control_field(field) is None:
                odd_value(
                    "a field of controls", field, "it is ignored (a control of another version?)"
                )
        names = sorted(job_names(members, controls).union(extra))
        async with client.pipeline(transaction=False) as pipe:
            for name in names:
                lock = _keys.job_key(project, name, "lock")
                pipe.get(lock)
                pipe.pttl(lock)
                pipe.get(_keys.job_key(project, name, "last"))
                pipe.hgetall(_keys.job_key(project, name, "checkpoint"))
                pipe.get(_keys.job_key(project, name, "overdue"))
            raw = await pipe.execute(raise_on_error=False)
        data = {}
        for i, name in enumerate(names):
            value, pttl, last, fields, spell = raw[5 * i : 5 * i + 5]
            lock, last_key, checkpoint = (
                _keys.job_key(project, name, kind) for kind in ("lock", "last", "checkpoint")
            )
            value = _typed(value, lock, "foreign: no node takes the job until it is deleted")
            last = _text(_typed(last, last_key, "read as none (the next claim replaces it)"))
            instant = last_us(last)
            if last and instant is None:
                odd_value(last_key, last, "read as none (the next claim replaces it)")
            fields = _typed(fields, checkpoint, "read as none (the next run's record replaces it)")
            stored = fields if isinstance(fields, dict) else None
            data[name] = JobData(
                name=name,
                value=_text(value),
                ttl_s=pttl / 1000 if isinstance(pttl, int) and pttl >= 0 else None,
                last_us=instant,
                checkpoint=checked(
                    name, {_text(k) or "": v for k, v in stored.items()} if stored else None
                ),
                overdue_since=_overdue_since(_text(spell), stored, last),
            )
        return ClusterData(now=now, members=members, controls=controls, jobs=data)
