"""The in-process store of ``memory://`` URLs: the whole ``Store`` interface in Python,
on the injected clock, for one process (tests, a single replica)."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .._checkpoint import (
    to_unix_us,
)
from .._clock import Clock
from .._lock_value import (
    is_lock_value,
    lock_value,
    parse_lock_value,
)
from .base import (
    DEFAULT_KEEPALIVE_S,
    DEFAULT_MAX_AHEAD_US,
    ClaimResult,
    LeaseReply,
    LeaseRequest,
    ReleaseListener,
)
from .checkpoints import MemoryCheckpoints
from .controls import MemoryControls

__all__ = ["MemoryLeaseStore"]


@dataclass
class _MemoryData:
    locks: dict[str, tuple[str, float]] = field(default_factory=dict)  # job key -> value, expiry
    fences: dict[str, int] = field(default_factory=dict)
    claimed: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per job key: the last instant claimed (µs) and the token of the term that claimed it."""
    listeners: set[ReleaseListener] = field(default_factory=set)
    checkpoints: dict[str, tuple[dict[str, str], float]] = field(default_factory=dict)
    """Per job key: the checkpoint's fields (as the Redis hash holds them) and its expiry."""
    members: dict[str, tuple[str, float]] = field(default_factory=dict)
    """Per project and owner id: the membership record (JSON) and its expiry."""
    controls: dict[str, str] = field(default_factory=dict)
    """Per project and field of the controls hash (``_store.keys.control_field``): its value."""
    joined: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Per project and owner id: when it joined (ms) and its jobs digest (placement)."""
    epochs: dict[str, int] = field(default_factory=dict)
    """Per project: the placement epoch, raised at each join and leave."""


# One data set per (clock, URL): instances of one process that share both see each other.
_SHARED: weakref.WeakKeyDictionary[Clock, dict[str, _MemoryData]] = weakref.WeakKeyDictionary()


class MemoryLeaseStore(MemoryCheckpoints, MemoryControls):
    """In-process lease store for ``memory://`` URLs: one process only, no persistence.

    Locks expire on the injected clock. Instances created with the same clock and URL share
    their locks, so several ``SingletonJobs`` in one test process elect one leader.
    """

    def __init__(self, project: str, clock: Clock, url: str = "memory://") -> None:
        self._project = project
        self._clock = clock
        self._data = _SHARED.setdefault(clock, {}).setdefault(url, _MemoryData())

    def _key(self, job: str) -> str:
        return f"{self._project}\x00{job}"

    async def elect(self, node_id: str, requests: Sequence[LeaseRequest]) -> list[LeaseReply]:
        """See ``Store.elect``."""
        now = self._clock.monotonic()
        self._keep_member(node_id)
        replies = []
        for request in requests:
            key = self._key(request.job)
            current = self._data.locks.get(key)
            if current is not None and current[1] <= now:
                current = None
            held = False
            if current is None and not request.take:
                replies.append(LeaseReply(request.job, False, None, None))
                continue
            if current is None:
                token = self._data.fences.get(key, 0) + 1
                self._data.fences[key] = token
                current = (lock_value(token, node_id), now + request.ttl_s)
                self._data.locks[key] = current
                held = True
            elif is_lock_value(request.held) and current[0] == request.held:
                current = (current[0], now + request.ttl_s)
                self._data.locks[key] = current
                held = True
            record = self._data.checkpoints.get(key)
            if held and request.retention_s is not None and record and record[1] > now:
                self._data.checkpoints[key] = (record[0], now + request.retention_s)
            paused, triggered, step_down = self._flags(request.job, held)
            replies.append(
                LeaseReply(
                    request.job,
                    held,
                    current[0],
                    max(current[1] - now, 0.0),
                    paused=paused,
                    triggered=triggered,
                    step_down=step_down,
                )
            )
        await asyncio.sleep(0)  # a real store is a suspension point too
        return replies

    async def release(
        self, node_id: str, values: dict[str, str], last_us: Mapping[str, int] | None = None
    ) -> int:
        """See ``Store.release``."""
        released = 0
        now_us = to_unix_us(self._clock.now())
        for job, value in values.items():
            key = self._key(job)
            current = self._data.locks.get(key)
            if current is not None and is_lock_value(value) and current[0] == value:
                del self._data.locks[key]
                released += 1
                instant = (last_us or {}).get(job)
                if instant is not None and instant <= now_us + DEFAULT_MAX_AHEAD_US:
                    token = parse_lock_value(value)[0] or 0
                    if instant > self._data.claimed.get(key, (-1, 0))[0]:
                        self._data.claimed[key] = (instant, token)
        if released:
            names = frozenset(job for job in values if self._key(job) not in self._data.locks)
            for listener in list(self._data.listeners):
                listener(names)
        return released

    async def claim(
        self, job: str, value: str, instant_us: int, *, max_ahead_us: int = DEFAULT_MAX_AHEAD_US
    ) -> ClaimResult:
        """See ``Store.claim``; the injected clock's ``now()`` is the store's clock."""
        key = self._key(job)
        current = self._data.locks.get(key)
        await asyncio.sleep(0)
        if (
            current is None
            or not is_lock_value(value)
            or current[0] != value
            or current[1] <= self._clock.monotonic()
        ):
            return ClaimResult.NOT_HOLDER
        last, by = self._data.claimed.get(key, (-1, 0))
        token = parse_lock_value(value)[0]
        if instant_us == last and by == token:
            return ClaimResult.CLAIMED  # this very term's claim, retried after its reply was lost
        if instant_us <= last:
            return ClaimResult.ALREADY_RUN
        if instant_us > to_unix_us(self._clock.now()) + max_ahead_us:
            return ClaimResult.CLOCK_AHEAD
        self._data.claimed[key] = (instant_us, token or 0)
        return ClaimResult.CLAIMED

    async def listen_releases(
        self, on_release: ReleaseListener, *, keepalive_s: float = DEFAULT_KEEPALIVE_S
    ) -> None:
        """See ``Store.listen_releases``; in one process there is no connection to
        check, so ``keepalive_s`` is not used."""
        self._data.listeners.add(on_release)
        try:
            await asyncio.Event().wait()
        finally:
            self._data.listeners.discard(on_release)

    async def ping(self) -> None:
        """See ``Store.ping``."""

    async def aclose(self) -> None:
        """See ``Store.aclose``."""

    def delete_lock(self, job: str) -> None:
        """Drop ``job``'s lock as an operator's ``DEL`` would (for tests)."""
        self._data.locks.pop(self._key(job), None)

    def set_lock(self, job: str, value: str, ttl_s: float) -> None:
        """Write ``job``'s lock as an operator's ``SET ... PX`` would (for tests), with any
        value, also one this library would never write."""
        self._data.locks[self._key(job)] = (value, self._clock.monotonic() + ttl_s)

    def __repr__(self) -> str:
        return f"MemoryLeaseStore(project={self._project!r})"
