"""The store's interface: ``Store``, everything the election, the runs and the operators need
of a backend, with its data types (requests, replies, the cluster read), the claim replies,
the notice format and what a failed store call raises.

Two implementations run through the same behavioural tests, and import this module but
nothing of each other: the Redis store (``_store.redis.store``, with ``RedisLeaseStore``,
``ClusterLeaseStore`` and ``SentinelLeaseStore``) for real deployments, and
``MemoryLeaseStore`` (``_store.memory``), which coordinates the ``SingletonJobs`` instances of
one process (``memory://``) and runs on the injected clock, so that users' unit tests and the
library's own timing tests need no server.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from redis.exceptions import RedisError

from .._checkpoint import (
    DEFAULT_CHECKPOINT_TIMEOUT_S,
    Checkpoint,
    FinishedRun,
    Recorded,
    StateSave,
)
from .._history import Occurrence
from .._lock_value import (
    parse_lock_value,
    shown_lock_value,
)
from .._overdue import Anchor
from .membership import MemberRecord, Membership

__all__ = [
    "STORE_ERRORS",
    "ClaimResult",
    "DEFAULT_CLAIM_TIMEOUT_S",
    "DEFAULT_KEEPALIVE_S",
    "DEFAULT_MAX_AHEAD_US",
    "LeaseReply",
    "LeaseRequest",
    "DEFAULT_CONTROL_TIMEOUT_S",
    "ClusterData",
    "JobData",
    "OverdueCheck",
    "OverdueReply",
    "OverdueState",
    "Store",
    "ReleaseListener",
    "parse_notice",
]

STORE_ERRORS: tuple[type[Exception], ...] = (RedisError, OSError)
"""What a store call raises when the store fails (``TimeoutError`` and ``ConnectionError``,
the library's own ``StoreReadOnly`` and ``StoreMismatch`` included, are ``OSError``s):
callers that report a failed call catch these, and let anything else (a bug) through."""

DEFAULT_MAX_AHEAD_US = 1_000_000
"""How far (µs) a claimed instant may lie ahead of the store's clock: a node whose wall clock
runs further ahead must not record an instant that the other nodes reach only much later."""

DEFAULT_CLAIM_TIMEOUT_S = 5.0
"""Bound of a claim when the caller gives none (the runner gives the time left on its lease);
then ``ConnectionError``."""

DEFAULT_KEEPALIVE_S = 5.0
"""Silence after which the release listener checks its connection (callers pass the heartbeat)."""


class ClaimResult(enum.IntEnum):
    """What a store says to a claim of an instant (``Store.claim``); the values are those the
    ``CLAIM`` script returns."""

    CLAIMED = 1
    """Recorded: the caller runs the instant (also this very term's claim, retried)."""
    ALREADY_RUN = 0
    """That instant, or a later one, was claimed before: another leader ran it."""
    NOT_HOLDER = -1
    """The lock value no longer holds the lock: the caller's term is over."""
    CLOCK_AHEAD = -2
    """The instant lies ahead of the store's clock by more than allowed: the caller's wall
    clock runs ahead; nothing is recorded, so the instant does not silence the others."""


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
    node for the job; see ``_election.placement``)."""


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
    checkpoint_reset: bool = False
    """An operator reset the job's checkpoint (``reset_checkpoint``): the holder forgets the
    copy it keeps, and its next run reads the store; reported once, to the holder only."""

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


DEFAULT_CONTROL_TIMEOUT_S = 5.0
"""How long an operator's call waits for the store."""


@dataclass(frozen=True)
class JobData:
    """One job as stored: its lock, last claimed instant and checkpoint."""

    name: str
    value: str | None
    """The lock's value, None when nobody holds it."""
    ttl_s: float | None
    """Time the lock has left; None without a lock or without expiry."""
    last_us: int | None
    """The latest instant a leader claimed, µs since the epoch."""
    checkpoint: Checkpoint | None
    overdue_since: datetime | None = None
    """Since when the job is overdue (its open spell, ``_overdue``), None when it is not."""


@dataclass(frozen=True)
class ClusterData:
    """Everything stored about one project, read at the store's time ``now``."""

    now: datetime
    members: list[tuple[MemberRecord, datetime]]
    """Live nodes' records, each with when it expires."""
    controls: dict[str, str]
    jobs: dict[str, JobData] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class OverdueCheck:
    """One job of an overdue check (``Store.check_overdue``): the anchor the caller judged it
    by (``Anchor.text``, "" before its first check) and when it is overdue by that anchor, on
    the store's clock (None: not watched here, or never overdue)."""

    job: str
    anchor: str
    deadline: datetime | None
    can_tell: bool = False
    """The caller has an ``on_overdue`` for the job: it may take the telling of a spell."""


@dataclass(frozen=True, slots=True)
class OverdueState:
    """One job as an overdue check found it."""

    anchor: Anchor
    paused: bool
    spell: tuple[datetime, bool, str] | None
    """The job's open spell: since when, whether a node took its telling, and its anchor's
    text (``_overdue.parse_spell``)."""
    opened: bool
    """This call opened the spell (its caller counts it)."""
    tell: bool = False
    """This call took the telling of the spell: its caller is the one node to call
    ``on_overdue``."""


@dataclass(frozen=True, slots=True)
class OverdueReply:
    """An overdue check's answer: the store's clock, and each job's state, in order."""

    now: datetime
    jobs: list[OverdueState]


class Store(Protocol):
    """Everything the library needs of a backend, for all jobs of one project: the leases
    (elect, release, claims, the release notices), the fenced checkpoints, the membership
    record the election keeps, and the operators' controls and reads. One implementation
    per backend (``memory``, ``redis``); the same behavioural tests run on each."""

    membership: Membership | None
    """The record ``announce`` gave, kept by every ``elect`` call; None before."""

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
        self,
        job: str,
        value: str,
        instant_us: int,
        *,
        max_ahead_us: int = DEFAULT_MAX_AHEAD_US,
        timeout_s: float = DEFAULT_CLAIM_TIMEOUT_S,
    ) -> ClaimResult:
        """Record that the holder of lock value ``value`` starts ``job``'s instant
        ``instant_us`` (see ``ClaimResult``); an instant more than ``max_ahead_us`` ahead of
        the store's clock is refused (``CLOCK_AHEAD``) and nothing is recorded.
        ``ConnectionError`` when the store does not answer within ``timeout_s`` (whether the
        claim was made is then unknown; a retry by the same term is recognised as its own)."""
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

    async def record_runs(
        self, runs: Sequence[FinishedRun], *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> Recorded:
        """Record each of ``runs``, in order, in its job's checkpoint, if the lock still holds
        a value of the run's term (checked inside the store, run by run): a success adds one
        to ``iteration`` and clears ``last_error``, another outcome keeps ``iteration`` and
        stores the error (cut to ``MAX_ERROR_CHARS``); ``state`` is kept. Sets each record's
        expiry to its run's ``retention_s`` from now. One call however many runs (and jobs:
        a job may come more than once, its runs in the order they ended). Returns the store's
        clock at the writes and each run's ``iteration`` after its write (None: its term is
        over, nothing written). ``ConnectionError`` past ``timeout_s``: then whether the
        writes happened is unknown."""
        ...

    async def check_overdue(
        self,
        checks: Sequence[OverdueCheck],
        *,
        retention_s: float,
        timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S,
    ) -> OverdueReply:
        """The overdue check of ``checks``, in one call (``_store.redis.scripts.OVERDUE``):
        each job's anchor, whether it is paused and its spell; a spell ends (is deleted) when
        the job is paused or its anchor changed, and opens when the job is not paused, has
        none, its anchor is still the check's and the store's clock has passed the check's
        deadline; an open spell lives ``retention_s``. The telling of a spell goes to the
        first check that ``can_tell`` it, once."""
        ...

    async def read_history(
        self, job: str, *, limit: int, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> list[Occurrence]:
        """The last ``limit`` entries of ``job``'s history (``_history``), newest first: its
        runs and the instants its leaders did not run, as ``record_runs`` added them; an
        entry that is not one is left out (and said once)."""
        ...

    async def save_state(
        self, save: StateSave, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> bool:
        """Replace the ``state`` of the job's checkpoint by ``save.state_json``, fenced as
        ``record_runs``; other fields stay. False when the term is
        over (nothing written)."""
        ...

    async def read_checkpoint(
        self, job: str, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> Checkpoint | None:
        """``job``'s checkpoint, or None when there is none (or what is stored is not a
        record, which is logged; see ``_checkpoint``)."""
        ...

    async def load_checkpoint(
        self, job: str, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> tuple[Checkpoint | None, datetime, str | None]:
        """``read_checkpoint``, and the store's clock at the read (Redis ``TIME``, in the
        same round trip): the clock the record's ``last_completed_at`` is on, so that a new
        leader measures the time since the last run without trusting any node's clock; and
        where the history stands, the record's ``history`` field as stored (``_history``:
        a new leader's ``cursor_of``), or None."""
        ...

    async def reset_checkpoint(
        self, job: str, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> bool:
        """Delete ``job``'s checkpoint, unfenced (an operator's action); True if there was
        one. In the same call, while a node holds the job's lock, leave its holder a one-shot
        ``reset`` control (reported by its next ``elect`` as ``LeaseReply.checkpoint_reset``,
        so that it forgets the copy it keeps) and wake every node's election, as
        ``set_control`` does."""
        ...

    def announce(self, membership: Membership) -> None:
        """Keep ``membership``'s record with each election call from now on."""
        ...

    async def set_control(
        self, field: str, value: str | None, *, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S
    ) -> bool:
        """Set (or with None delete) one field of the controls hash and wake every node's
        election; True when it changed."""
        ...

    async def leave(self) -> None:
        """Delete this node's membership record (a graceful shutdown): it leaves the cluster
        view at once instead of one lock expiry later."""
        ...

    async def read_cluster(
        self, jobs: Iterable[str] = (), *, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S
    ) -> ClusterData:
        """The members, the controls, and every job that a live member registered, that a
        control names, or that ``jobs`` lists: two round trips."""
        ...

    async def read_members(
        self, owners: Sequence[str], *, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S
    ) -> dict[str, MemberRecord]:
        """The membership records of ``owners`` that the store holds (one round trip), by
        owner id: what a node reads, outside its election round, of the members whose jobs
        digest says they define their jobs otherwise (``_election.definitions``)."""
        ...
