"""The lease store: the one small interface the election needs from a backend.

Two implementations run through the same behavioural tests: ``RedisLeaseStore`` (in
``_redis_store.py``) for real deployments, and ``MemoryLeaseStore`` here, which coordinates
the ``SingletonJobs`` instances of one process (``memory://``) and runs on the injected
clock, so that users' unit tests and the library's own timing tests need no server.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ._checkpoint import (
    DEFAULT_CHECKPOINT_TIMEOUT_S,
    Checkpoint,
    FinishedRun,
    StateSave,
    to_unix_us,
)
from ._checkpoint_store import MemoryCheckpoints
from ._clock import Clock
from ._control_store import MemoryControls
from ._lease import (
    MAX_TOKEN,
    SHOWN_VALUE_CHARS,
    is_lock_value,
    lock_value,
    parse_lock_value,
    shown_lock_value,
)

__all__ = [  # lock values live in _lease; re-exported for the stores' callers
    "DEFAULT_KEEPALIVE_S",
    "MAX_TOKEN",
    "SHOWN_VALUE_CHARS",
    "DEFAULT_MAX_AHEAD_US",
    "LeaseReply",
    "LeaseRequest",
    "CheckpointStore",
    "LeaseStore",
    "MemoryLeaseStore",
    "ReleaseListener",
    "StoreMismatch",
    "StoreReadOnly",
    "is_lock_value",
    "parse_lock_value",
    "parse_notice",
    "shown_lock_value",
]

DEFAULT_MAX_AHEAD_US = 1_000_000
"""How far (µs) a claimed instant may lie ahead of the store's clock: a node whose wall clock
runs further ahead must not record an instant that the other nodes reach only much later."""

DEFAULT_KEEPALIVE_S = 5.0
"""Silence after which the release listener checks its connection (callers pass the heartbeat)."""


ReleaseListener = Callable[[frozenset[str] | None], None]
"""What a release listener calls: with the names of the jobs whose locks a node released
(ask about those), or None when a notice names none (an operator's control, a node of an
older version): ask about every job."""


def parse_notice(data: str | bytes) -> frozenset[str] | None:
    """The jobs a notice names (``RELEASE`` publishes "jobs <name> <name> ...", ``CONTROL``
    "control <name>"), or None for any other message (a bare "control")."""
    text = data.decode(errors="replace") if isinstance(data, bytes) else str(data)
    kind, _, names = text.partition(" ")
    return frozenset(names.split()) if kind == "jobs" or (kind == "control" and names) else None


class StoreReadOnly(ConnectionError):
    """The store refuses the writes an election needs: it is a replica, not the primary.

    A ``ConnectionError``, so that callers that retry connection failures retry this too; a
    type of its own, so that they can say what to fix.
    """


class StoreMismatch(ConnectionError):
    """The server is not the kind the store was set up for: a Redis Cluster node reached
    through a single-Redis URL or client, or the reverse. A ``ConnectionError`` like
    ``StoreReadOnly``: the election retries it, readiness shows it."""


@dataclass(frozen=True)
class LeaseRequest:
    """Acquire or renew the lease of ``job`` for ``ttl_s`` seconds.

    ``held`` is the exact lock value of the caller's current term, if it has one: only that
    value is renewed, so a lock the caller kept from a term it already ended expires. While
    the caller holds the lock, the job's checkpoint (if any) is kept for ``retention_s`` more.
    """

    job: str
    ttl_s: float
    held: str | None = None
    retention_s: float | None = None
    take: bool = True
    """False: look at the lock without taking it when it is free (placement prefers another
    node for the job; see ``_placement``)."""


@dataclass(frozen=True)
class LeaseReply:
    """What the store said about one job's lock after an acquire-or-renew."""

    job: str
    held: bool
    """True when the calling node holds the lock now (acquired or renewed)."""
    value: str | None
    """The lock's value, ``"<token>|<owner id>"``, or None when nobody holds it; a value that
    this library did not write (see ``is_lock_value``) is never held."""
    ttl_s: float | None
    """Time the lock has left per the store, None when it has no expiry."""
    error: str | None = None
    """Why a free lock could not be acquired (for example Redis out of memory)."""
    paused: bool = False
    """An operator paused the job (``jobs.pause``): its leader starts no new run."""
    triggered: bool = False
    """An operator asked for one extra run now; reported once, to the holder only."""
    step_down: bool = False
    """An operator asked the holder to hand the job over; reported once, to the holder only."""

    @property
    def token(self) -> int | None:
        """The fencing token of the holder's term, when the value has one."""
        return parse_lock_value(self.value)[0]

    @property
    def holder(self) -> str | None:
        """The owner id of the holder (``<node id>#<nonce>`` when written by this library);
        for a value written by something else, that value made safe to show."""
        token, holder = parse_lock_value(self.value)
        if token is None and holder is not None:
            return shown_lock_value(holder)
        return holder


class LeaseStore(Protocol):
    """Atomic lease operations on a shared store, for all jobs of one project."""

    async def elect(self, node_id: str, requests: Sequence[LeaseRequest]) -> list[LeaseReply]:
        """Acquire free locks and renew held ones, all in one round trip; one reply each.

        A lock is renewed only when its value is exactly the request's ``held`` value and that
        is a value this library writes (``is_lock_value``): a foreign value, ``""`` included,
        is nobody's to renew. Raises ``StoreReadOnly`` when the store is a replica.
        """
        ...

    async def release(
        self, node_id: str, values: dict[str, str], last_us: Mapping[str, int] | None = None
    ) -> int:
        """Delete each job's lock that still holds the given value, and announce it.
        Values this library does not write are skipped (nobody's to delete). For each lock
        deleted, raise the job's last claimed instant to ``last_us[job]`` (the last run this
        node started), unless it lies ahead of the store's clock by more than
        ``DEFAULT_MAX_AHEAD_US``: a successor never runs that instant again."""
        ...

    async def claim(
        self, job: str, value: str, instant_us: int, *, max_ahead_us: int = DEFAULT_MAX_AHEAD_US
    ) -> int:
        """Record that the holder of lock value ``value`` starts ``job``'s instant
        ``instant_us``: 1 if recorded, 0 if that instant (or a later one) was already
        claimed, -1 if ``value`` no longer holds the lock, -2 if the instant is ahead of the
        store's clock by more than ``max_ahead_us`` (the caller's wall clock runs ahead;
        nothing is recorded, so the instant does not silence the other nodes)."""
        ...

    async def listen_releases(
        self, on_release: ReleaseListener, *, keepalive_s: float = DEFAULT_KEEPALIVE_S
    ) -> None:
        """Call ``on_release`` whenever a node releases locks (with the names of the jobs, see
        ``ReleaseListener``) or an operator changes a control (with None); runs until
        cancelled or broken.

        After ``keepalive_s`` of silence it checks its connection (on Redis: an echo published
        by the next ``elect``, or a PING) and raises ``ConnectionError`` when nothing comes
        within another ``keepalive_s``: a silently dead connection ends in an error the caller
        retries, never in a listener that hears nothing.
        """
        ...

    async def ping(self) -> None:
        """Raise unless the store answers."""
        ...

    async def aclose(self) -> None:
        """Close what this store opened (never a client the user passed in)."""
        ...


class CheckpointStore(Protocol):
    """Fenced checkpoint records (``_checkpoint``), kept next to the locks; both stores
    implement it. Apart from ``LeaseStore`` until the engine uses it, so that the test doubles
    of ``LeaseStore`` need not implement it before then."""

    async def record_run(
        self, run: FinishedRun, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> Checkpoint | None:
        """Record ``run`` in its job's checkpoint, if the lock still holds a value of the run's
        term (checked inside the store): a success adds one to ``iteration`` and clears
        ``last_error``, another outcome keeps ``iteration`` and stores the error (cut to
        ``MAX_ERROR_CHARS``); ``state`` is kept. Sets the record's expiry to the run's
        ``retention_s`` from now. Returns the record as written, without its ``state`` (None
        there: it may be 64 KiB, and the caller knows it), or None when the term is over
        (nothing written). ``ConnectionError`` past ``timeout_s``: then whether the
        write happened is unknown."""
        ...

    async def save_state(
        self, save: StateSave, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> bool:
        """Replace the ``state`` of the job's checkpoint by ``save.state_json``, fenced as
        ``record_run``; other fields stay. False when the term is
        over (nothing written)."""
        ...

    async def read_checkpoint(
        self, job: str, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> Checkpoint | None:
        """``job``'s checkpoint, or None when there is none (or what is stored is not a
        record, which is logged; see ``_checkpoint``)."""
        ...

    async def reset_checkpoint(
        self, job: str, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> bool:
        """Delete ``job``'s checkpoint, unfenced (an operator's action); True if there was
        one."""
        ...


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
    """Per project and field of the controls hash (``_keys.control_field``): its value."""
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
        """See ``LeaseStore.elect``."""
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
        """See ``LeaseStore.release``."""
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
    ) -> int:
        """See ``LeaseStore.claim``; the injected clock's ``now()`` is the store's clock."""
        key = self._key(job)
        current = self._data.locks.get(key)
        await asyncio.sleep(0)
        if (
            current is None
            or not is_lock_value(value)
            or current[0] != value
            or current[1] <= self._clock.monotonic()
        ):
            return -1
        last, by = self._data.claimed.get(key, (-1, 0))
        token = parse_lock_value(value)[0]
        if instant_us == last and by == token:
            return 1  # this very term's claim, retried after its reply was lost
        if instant_us <= last:
            return 0
        if instant_us > to_unix_us(self._clock.now()) + max_ahead_us:
            return -2
        self._data.claimed[key] = (instant_us, token or 0)
        return 1

    async def listen_releases(
        self, on_release: ReleaseListener, *, keepalive_s: float = DEFAULT_KEEPALIVE_S
    ) -> None:
        """See ``LeaseStore.listen_releases``; in one process there is no connection to
        check, so ``keepalive_s`` is not used."""
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

    def set_lock(self, job: str, value: str, ttl_s: float) -> None:
        """Write ``job``'s lock as an operator's ``SET ... PX`` would (for tests), with any
        value, also one this library would never write."""
        self._data.locks[self._key(job)] = (value, self._clock.monotonic() + ttl_s)

    def __repr__(self) -> str:
        return f"MemoryLeaseStore(project={self._project!r})"
