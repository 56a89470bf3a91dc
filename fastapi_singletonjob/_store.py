"""The lease store: the one small interface the election needs from a backend.

Two implementations run through the same behavioural tests: ``RedisLeaseStore`` (in
``_redis_store.py``) for real deployments, and ``MemoryLeaseStore`` here, which coordinates
the ``SingletonJobs`` instances of one process (``memory://``) and runs on the injected
clock, so that users' unit tests and the library's own timing tests need no server.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ._clock import Clock

__all__ = ["LeaseReply", "LeaseRequest", "LeaseStore", "MemoryLeaseStore", "parse_lock_value"]


@dataclass(frozen=True)
class LeaseRequest:
    """Acquire or renew the lease of ``job`` for ``ttl_s`` seconds.

    ``held`` is the exact lock value of the caller's current term, if it has one: only that
    value is renewed, so a lock the caller kept from a term it already ended expires.
    """

    job: str
    ttl_s: float
    held: str | None = None


@dataclass(frozen=True)
class LeaseReply:
    """What the store said about one job's lock after an acquire-or-renew."""

    job: str
    held: bool
    """True when the calling node holds the lock now (acquired or renewed)."""
    value: str | None
    """The lock's value, ``"<token>|<owner id>"``, or None when nobody holds it."""
    ttl_s: float | None
    """Time the lock has left per the store, None when it has no expiry."""
    error: str | None = None
    """Why a free lock could not be acquired (for example Redis out of memory)."""

    @property
    def token(self) -> int | None:
        """The fencing token of the holder's term, when the value has one."""
        return parse_lock_value(self.value)[0]

    @property
    def holder(self) -> str | None:
        """The owner id of the holder (``<node id>#<nonce>`` when written by this library)."""
        return parse_lock_value(self.value)[1]


def parse_lock_value(value: str | None) -> tuple[int | None, str | None]:
    """Split ``"<token>|<owner id>"``; a value written by something else has no token."""
    if value is None:
        return None, None
    token, sep, holder = value.partition("|")
    if not sep or not token.isdigit():
        return None, value
    return int(token), holder


class LeaseStore(Protocol):
    """Atomic lease operations on a shared store, for all jobs of one project."""

    async def elect(self, node_id: str, requests: Sequence[LeaseRequest]) -> list[LeaseReply]:
        """Acquire free locks and renew held ones, all in one round trip; one reply each."""
        ...

    async def release(self, node_id: str, values: dict[str, str]) -> int:
        """Delete each job's lock that still holds the given value, and announce it."""
        ...

    async def claim(self, job: str, value: str, instant_us: int) -> int:
        """Record that the holder of lock value ``value`` starts ``job``'s instant
        ``instant_us``: 1 if recorded, 0 if that instant (or a later one) was already
        claimed, -1 if ``value`` no longer holds the lock."""
        ...

    async def listen_releases(self, on_release: Callable[[], None]) -> None:
        """Call ``on_release`` whenever a node releases locks; runs until cancelled or broken."""
        ...

    async def ping(self) -> None:
        """Raise unless the store answers."""
        ...

    async def aclose(self) -> None:
        """Close what this store opened (never a client the user passed in)."""
        ...


@dataclass
class _MemoryData:
    locks: dict[str, tuple[str, float]] = field(default_factory=dict)  # job key -> value, expiry
    fences: dict[str, int] = field(default_factory=dict)
    claimed: dict[str, int] = field(default_factory=dict)
    listeners: set[Callable[[], None]] = field(default_factory=set)


# One data set per (clock, URL): instances of one process that share both see each other.
_SHARED: weakref.WeakKeyDictionary[Clock, dict[str, _MemoryData]] = weakref.WeakKeyDictionary()


class MemoryLeaseStore:
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
        """See ``LeaseStore.elect``."""
        now = self._clock.monotonic()
        replies = []
        for request in requests:
            key = self._key(request.job)
            current = self._data.locks.get(key)
            if current is not None and current[1] <= now:
                current = None
            held = False
            if current is None:
                token = self._data.fences.get(key, 0) + 1
                self._data.fences[key] = token
                current = (f"{token}|{node_id}", now + request.ttl_s)
                self._data.locks[key] = current
                held = True
            elif current[0] == request.held:
                current = (current[0], now + request.ttl_s)
                self._data.locks[key] = current
                held = True
            replies.append(LeaseReply(request.job, held, current[0], max(current[1] - now, 0.0)))
        await asyncio.sleep(0)  # a real store is a suspension point too
        return replies

    async def release(self, node_id: str, values: dict[str, str]) -> int:
        """See ``LeaseStore.release``."""
        released = 0
        for job, value in values.items():
            key = self._key(job)
            current = self._data.locks.get(key)
            if current is not None and current[0] == value:
                del self._data.locks[key]
                released += 1
        if released:
            for listener in list(self._data.listeners):
                listener()
        return released

    async def claim(self, job: str, value: str, instant_us: int) -> int:
        """See ``LeaseStore.claim``."""
        key = self._key(job)
        current = self._data.locks.get(key)
        await asyncio.sleep(0)
        if current is None or current[0] != value or current[1] <= self._clock.monotonic():
            return -1
        if instant_us <= self._data.claimed.get(key, -1):
            return 0
        self._data.claimed[key] = instant_us
        return 1

    async def listen_releases(self, on_release: Callable[[], None]) -> None:
        """See ``LeaseStore.listen_releases``."""
        self._data.listeners.add(on_release)
        try:
            await asyncio.Event().wait()
        finally:
            self._data.listeners.discard(on_release)

    async def ping(self) -> None:
        """See ``LeaseStore.ping``."""

    async def aclose(self) -> None:
        """See ``LeaseStore.aclose``."""

    def delete_lock(self, job: str) -> None:
        """Drop ``job``'s lock as an operator's ``DEL`` would (for tests)."""
        self._data.locks.pop(self._key(job), None)

    def __repr__(self) -> str:
        return f"MemoryLeaseStore(project={self._project!r})"
