"""The overdue check on Redis: one ``OVERDUE`` script call for all the jobs a node watches
(``Store.check_overdue``; the spell's rules are in the script's header)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from ..._checkpoint import to_unix_us
from ..._overdue import parse_anchor, parse_spell
from .. import keys as _keys
from ..base import OverdueCheck, OverdueReply, OverdueState
from ..records import retention_ms
from . import scripts as _scripts
from .connect import bounded
from .topology import Topology

__all__ = ["RedisOverdue"]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class RedisOverdue:
    """``check_overdue`` on the topology's calls client (never the election's)."""

    def __init__(self, topology: Topology, project: str) -> None:
        self._topology = topology
        self._project = project
        self._script = topology.calls.register_script(_scripts.OVERDUE)
        self._job_keys: dict[str, list[str]] = {}

    def _keys(self, job: str) -> list[str]:
        keys = self._job_keys.get(job)
        if keys is None:
            keys = self._job_keys[job] = [
                _keys.job_key(self._project, job, "checkpoint"),
                _keys.job_key(self._project, job, "last"),
                _keys.job_key(self._project, job, "overdue"),
            ]
        return keys

    async def check_overdue(
        self, checks: Sequence[OverdueCheck], *, retention_s: float, timeout_s: float
    ) -> OverdueReply:
        """See ``Store.check_overdue``: one ``OVERDUE`` call."""
        keys = [_keys.project_key(self._project, "controls")]
        args: list[Any] = [retention_ms(retention_s)]
        for check in checks:
            keys.extend(self._keys(check.job))
            deadline = "" if check.deadline is None else str(to_unix_us(check.deadline))
            args.extend((check.job, check.anchor, deadline, int(check.can_tell)))
        reply = await bounded(self._script(keys=keys, args=args), timeout_s, self._topology)
        seconds, micros, *rest = reply
        now = _EPOCH + timedelta(seconds=int(seconds), microseconds=int(micros))
        jobs = [
            OverdueState(
                anchor=parse_anchor(_text(rest[i])),
                paused=int(rest[i + 1]) == 1,
                spell=parse_spell(_text(rest[i + 2])),
                opened=int(rest[i + 3]) & 1 == 1,
                tell=int(rest[i + 3]) & 2 == 2,
            )
            for i in range(0, len(rest), 4)
        ]
        return OverdueReply(now=now, jobs=jobs)
