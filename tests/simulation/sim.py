"""Deterministic simulation of a cluster: the real engine, an emulated Redis, fake time.

Several nodes, each a real ``Engine`` (its ``Elector``, one ``JobRunner`` per job and the one
``Ticker`` that times them all), talk to one emulated Redis server (``Server``, the library's
three Lua scripts written out in Python, atomic like a script). Everything runs on one event
loop whose clock is virtual (``VirtualLoop``): ``loop.time()`` is the true time of the
simulation, and when every task waits, time jumps to the next timer. That matters because the
library bounds its store calls with ``asyncio.wait_for``, which reads the loop's clock, not the
injected one. Each node sees true time through its own ``NodeClock`` (wall offset and steps,
monotonic offset and rate error, pauses and suspends), and talks to the server over its own
``Link``, which adds latency and injects the faults of the schedule.

A schedule is a ``Scenario``: the nodes' clocks, the jobs, and a list of ``Fault`` events at
true times. ``run_scenario`` plays it and returns the violations of the invariants:

- (a) ``overlap``: no two nodes inside a run of the same job at the same true time while the
  store kept the key (pairs near a restart that lost keys, an operator's DEL or a foreign write
  are excused). A "finish" run counts until its ``leadership_lost`` is set, a "cancel" run
  until it ended;
- (b) ``token``: every new term's fencing token is above the token of every term of the job
  that the store granted before it, and no term begins twice;
- (c) ``tick_twice``: no fixed-rate or cron instant (``scheduled_at``) runs twice (pairs near
  a key loss are excused, and by default the known bug ``FAST_TICK_TWICE``);
- (d) ``late_lost``: ``leadership_lost`` is set no later than the lease deadline, and a
  "cancel" run has ended by then (``SLACK_S`` of slack). A node that was paused or suspended
  meanwhile gets what the design allows it: a pause, until it ends; a suspend (the event
  loop's timers stop, the lease clock does not), until the deadline watchdog's next step after
  the resume: ``WATCH_STEP_S`` while a run of the job is in flight, else a heartbeat;
- (e) ``loop_died``: the election loop, its helpers and the timer of a live node never die,
  no job's schedule fails, and no task ends with an exception nobody retrieved;
- (f) ``stale_start``: a job's code starts only while the node's lease of it is valid;
- (g) ``liveness``: while a node is healthy (alive, its calls answered, its loop and clock
  sound), every job runs: a due instant starts within a lock expiry plus two heartbeats (or
  the job's period, if longer), through gray faults too (a flow that goes silent, claims that
  never return while the election is answered). See ``Simulation.check_liveness``.

Everything that touches the library's internals lives in the imports and the adapter section
below, so that a refactoring of them needs changes in one place; the store's side is the
scripts' documented behaviour (``_scripts.py``), emulated in ``Server``.

Not modelled: a pause blocks a node's clock sleeps and store replies, not every callback of
its event loop (``asyncio.wait_for`` timeouts still fire on time while it is "paused"); the
opt-in ``precision`` setting (it busy-waits with ``sleep(0)``, which virtual time never ends);
sync jobs (threads); out-of-memory and read-only replies of Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import heapq
import itertools
import logging
import math
import random
import re
import secrets
import selectors
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, TypeVar

from opentelemetry import metrics, trace

from fastapi_singletonjob._checkpoint import Checkpoint, Recorded
from fastapi_singletonjob._config.settings import Settings
from fastapi_singletonjob._election.lease import Lease
from fastapi_singletonjob._engine.engine import Engine
from fastapi_singletonjob._history import Occurrence
from fastapi_singletonjob._job.context import JobContext
from fastapi_singletonjob._job.spec import JobSpec
from fastapi_singletonjob._lock_value import OWNER_SEPARATOR, is_lock_value
from fastapi_singletonjob._overdue import Anchor
from fastapi_singletonjob._schedule import Cron, FixedRate, Interval, Schedule
from fastapi_singletonjob._store.base import (
    DEFAULT_CLAIM_TIMEOUT_S,
    DEFAULT_KEEPALIVE_S,
    DEFAULT_MAX_AHEAD_US,
    ClaimResult,
    ClusterData,
    LeaseReply,
    LeaseRequest,
    OverdueCheck,
    OverdueReply,
    OverdueState,
    ReleaseListener,
)
from fastapi_singletonjob._store.membership import MemberRecord, Membership
from fastapi_singletonjob._telemetry import Telemetry
from fastapi_singletonjob._timing import WATCH_STEP_S, lease_deadline

# -- timing of the simulated cluster ------------------------------------------------------------

TTL_S = 1.0
"""Lock expiry of every job."""
HEARTBEAT_S = 0.3
MAX_BACKOFF_S = 1.0
SHUTDOWN_TIMEOUT_S = 1.0
LATENCY_S = 0.001
"""One way, every store call."""
SLACK_S = 0.01
"""How late ``leadership_lost`` (and a "cancel" run's end) may come after the deadline."""
QUIET_S = 1.5
"""Simulated time after the last fault has played out (see ``Fault.ends_at``)."""
FIXED_RATE_EVERY_S = 0.25
INTERVAL_EVERY_S = 0.2
CRON_EXPRESSION = "* * * * * *"  # every second (6th field: seconds)
WALL_START = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
LOOP_START = 1000.0
PROJECT = "sim"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_WALL_START_US = (WALL_START - _EPOCH) // timedelta(microseconds=1)
_EPSILON_S = 1e-11
_PAD_S = 1e-9

JobKind = Literal["fixed_rate", "interval", "cron"]
Policy = Literal["finish", "cancel"]
FaultKind = Literal[
    "slow_reply",  # value: delay as a fraction of the call timeout
    "lost_reply",  # the server runs the call, the reply never comes
    "lost_request",  # the call never reaches the server (nor does a reply come)
    "restart",  # flag: "locks", "locks+fences" or "all" (also the claimed instants) lost;
    # value: seconds the server is down (calls fail, subscriptions drop)
    "foreign",  # another program writes flag ("", "garbage", "huge") with TTL value s
    "delete",  # an operator's DEL of job's lock
    "silent",  # value: seconds the node's flow to the store is silent: requests and replies
    # vanish, no error (a NAT or load balancer dropping the flow)
    "claims_down",  # value: seconds the server answers the node's election but not its
    # claims (a claim call never returns: a stuck connection of the claims' pool)
    "wall_step",  # value: seconds added to the node's wall clock
    "pause",  # value: seconds the node's event loop is blocked
    "suspend",  # value: seconds the machine sleeps (monotonic jumps, timers late)
    "stop",  # graceful shutdown of the node
    "crash",  # the process dies: no release
    "start",  # a stopped or crashed node starts again (a new instance)
    "schedule_fails",  # the node's schedule of job fails (a custom schedule's bug): the
    # node retires the job until it starts again
]
_LINK_FAULTS = frozenset({"slow_reply", "lost_reply", "lost_request", "silent", "claims_down"})
LEADER = -1
"""``Fault.node``: the node leading the first job when the fault comes (else node 0)."""
LOST_REQUEST = -1.0
"""In ``SimNode.call_faults``: the call's request is lost."""

T = TypeVar("T")


# -- the schedule ------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeConfig:
    wall_offset_s: float = 0.0
    """The node's wall clock minus true time at the start (NTP skew)."""
    rate_error: float = 0.0
    """Relative rate error of the node's monotonic clock (within the design's 0.1 %)."""


@dataclass(frozen=True)
class JobConfig:
    kind: JobKind = "fixed_rate"
    policy: Policy = "finish"


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: FaultKind
    node: int = LEADER
    value: float = 0.0
    flag: str = ""
    job: int = 0

    @property
    def ends_at(self) -> float:
        """When the fault is over: a block or the server's downtime ended, a foreign value
        expired (a store's restart or an operator's DEL, at once)."""
        lasting = self.kind in ("pause", "suspend", "foreign", "restart", "silent", "claims_down")
        return self.at_s + (max(self.value, 0.0) if lasting else 0.0)


@dataclass(frozen=True)
class Scenario:
    nodes: tuple[NodeConfig, ...]
    jobs: tuple[JobConfig, ...]
    faults: tuple[Fault, ...]
    seed: int = 0
    placement: Literal["first", "spread"] = "first"
    """How the nodes place the jobs (the known schedules were found with "first")."""

    def describe(self) -> str:
        """The schedule, one line per fault, for failure messages."""
        lines = [
            f"seed={self.seed}, placement={self.placement}",
            *(
                f"node n{i}: wall {n.wall_offset_s * 1000:+.1f} ms, rate {n.rate_error:+.1e}"
                for i, n in enumerate(self.nodes)
            ),
            *(
                f"job j{i}: {j.kind}, on_leadership_lost={j.policy}"
                for i, j in enumerate(self.jobs)
            ),
            *(f"  t={f.at_s:8.4f}s  {_describe_fault(f)}" for f in sorted_faults(self.faults)),
            f"as code: {self!r}",
        ]
        return "\n".join(lines)


def sorted_faults(faults: Sequence[Fault]) -> list[Fault]:
    return sorted(faults, key=lambda f: f.at_s)


def _describe_fault(fault: Fault) -> str:
    node = "leader" if fault.node == LEADER else f"n{fault.node}"
    extra = {
        "slow_reply": f"next reply delayed {fault.value:.3f} x call timeout",
        "restart": f"store restarts, loses {fault.flag or 'locks'}, down {fault.value:.3f}s",
        "foreign": f"j{fault.job} lock := {fault.flag!r} for {fault.value:.3f}s",
        "delete": f"DEL lock of j{fault.job}",
        "schedule_fails": f"schedule of j{fault.job} fails",
        "silent": f"flow to the store silent {fault.value:.3f}s",
        "claims_down": f"claims unanswered {fault.value:.3f}s",
        "wall_step": f"wall clock steps {fault.value:+.4f}s",
        "pause": f"event loop blocked {fault.value:.4f}s",
        "suspend": f"suspended {fault.value:.4f}s",
    }.get(fault.kind, "")
    return f"{fault.kind:<10} {node:<6} {extra}"


@dataclass(frozen=True)
class Violation:
    at_s: float
    invariant: str
    message: str

    def __str__(self) -> str:
        return f"t={self.at_s:.4f}s [{self.invariant}] {self.message}"


# -- virtual time --------------------------------------------------------------------------------


class SimulationStuck(RuntimeError):
    """Every task waits and no timer is set: nothing can ever happen again."""


class _VirtualSelector(selectors.SelectSelector):
    """Never blocks: a wait for ``timeout`` seconds moves virtual time instead."""

    def __init__(self) -> None:
        super().__init__()
        self.now = LOOP_START

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise SimulationStuck("every task waits for an event that nothing will set")
        if timeout > 0:
            self.now += timeout
        return []  # nothing real to wait for: no threads, no sockets


class _FifoTimer(asyncio.TimerHandle):
    """A timer that fires after every timer set earlier for the same instant (asyncio's heap
    orders equal instants arbitrarily): two messages sent at once arrive in sending order."""

    __slots__ = ("_seq",)
    _seq: int

    def __lt__(self, other: object) -> bool:
        if isinstance(other, _FifoTimer):
            return (self.when(), self._seq) < (other.when(), other._seq)
        return NotImplemented


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` is virtual: when every task waits, time jumps to the
    next timer. Deterministic and in zero real time (no threads, no real I/O)."""

    def __init__(self) -> None:
        self._virtual = _VirtualSelector()
        self._timers = itertools.count()
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.now

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """Make this loop's time the simulation's true time (``_true_now``)."""
        _CLOCK.append(self._virtual)
        try:
            yield
        finally:
            _CLOCK.pop()

    def call_at(  # type: ignore[override]
        self, when: float, callback: Callable[..., object], *args: Any, context: Any = None
    ) -> asyncio.TimerHandle:
        # As BaseEventLoop.call_at, with timers that keep their order on a tie.
        self._check_closed()  # type: ignore[attr-defined]
        timer = _FifoTimer(when, callback, args, self, context)
        timer._seq = next(self._timers)
        heapq.heappush(self._scheduled, timer)  # type: ignore[attr-defined]
        timer._scheduled = True  # type: ignore[attr-defined]
        return timer


_CLOCK: list[_VirtualSelector] = []
"""The virtual clock of the simulation being played (read on every clock call: kept at hand)."""


def _true_now() -> float:
    """Seconds since the simulation started (the loop's virtual time)."""
    return _CLOCK[-1].now - LOOP_START


# -- per-node view of time ------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """A true-time interval during which a node ran nothing."""

    start: float
    end: float
    suspend: bool
    """A suspend (the event loop's timers stopped too), else a pause (a blocked loop)."""


def merged(blocks: Sequence[Block]) -> list[Block]:
    """``blocks`` with overlapping ones merged (a pause during a suspend, a suspend during a
    pause): a suspend if any of them was."""
    out: list[Block] = []
    for block in sorted(blocks, key=lambda b: b.start):
        if out and block.start <= out[-1].end:
            last = out[-1]
            out[-1] = Block(last.start, max(last.end, block.end), last.suspend or block.suspend)
        else:
            out.append(block)
    return out


class NodeClock:
    """A node's ``Clock``: shared true time, seen with its own offsets, rate, pauses, suspends.

    - ``monotonic()`` is ``offset + (1 + rate_error) * true``: the boot clock, which keeps
      counting through a suspend;
    - ``now()`` is true wall time plus the node's skew and steps;
    - ``sleep`` wakes no earlier than the node's timers allow: never while the node is paused
      (its event loop blocked), and a suspend delays every pending timer by its length (the
      event loop's timers run on CLOCK_MONOTONIC, which stops while suspended).
    """

    def __init__(self, config: NodeConfig, index: int) -> None:
        self.wall_offset_s = config.wall_offset_s
        self.rate = 1.0 + config.rate_error
        self.mono_offset_s = 50_000.0 * (index + 1)  # no code may compare monotonic across nodes
        self.timer_lag_s = 0.0
        self.blocked_until = 0.0
        self.suspended_until = 0.0
        self.blocks: list[Block] = []

    def monotonic(self) -> float:
        return self.mono_offset_s + self.rate * _true_now()

    def true_of(self, monotonic: float) -> float:
        """The true time at which this node's monotonic clock reads ``monotonic``."""
        return (monotonic - self.mono_offset_s) / self.rate

    def now(self) -> datetime:
        return WALL_START + timedelta(seconds=_true_now() + self.wall_offset_s)

    async def sleep(self, seconds: float) -> None:
        # Padded by a nanosecond: the caller reads its own monotonic clock on waking, and float
        # rounding must not leave it a hair short of what it slept for (it would spin).
        pad = _PAD_S if seconds > 0 else 0.0
        target = _true_now() - self.timer_lag_s + max(seconds, 0.0) / self.rate + pad
        slept = False
        while True:
            if self.blocked_until - _true_now() > _EPSILON_S:
                await self.gate()
                slept = True
            left = target - (_true_now() - self.timer_lag_s)
            if left <= _EPSILON_S:  # below the resolution of the loop's float clock
                if not slept:
                    await asyncio.sleep(0)  # a sleep always yields, as asyncio.sleep(0) does
                return
            await asyncio.sleep(left)
            slept = True

    async def gate(self) -> None:
        """Wait while the node is paused or suspended."""
        # The block can be extended while waiting (a pause during a suspend): re-read it.
        while (left := self.blocked_until - _true_now()) > _EPSILON_S:  # noqa: ASYNC110
            await asyncio.sleep(left)

    def block(self, seconds: float, *, suspend: bool) -> None:
        now = _true_now()
        self.blocked_until = max(self.blocked_until, now + seconds)
        self.blocks.append(Block(now, now + seconds, suspend))
        if suspend:  # a suspend during a suspend only lengthens it
            self.timer_lag_s += max(0.0, now + seconds - max(now, self.suspended_until))
            self.suspended_until = max(self.suspended_until, now + seconds)

    def blocked_between(self, start: float, end: float) -> float | None:
        """The end of the latest block that overlaps ``[start, end]``, if any."""
        ends = [b.end for b in merged(self.blocks) if b.start <= end and b.end >= start]
        return max(ends) if ends else None

    def lost_due(self, deadline: float, now: float, step_of: Callable[[float], float]) -> float:
        """The true time by which a term whose deadline is ``deadline`` must have ended, as
        seen at ``now``: ``SLACK_S`` after it, or later when a block delayed the node. After
        a pause the node catches up at once; after a suspend its timers are late by up to the
        sleep they were in, at most ``step_of(block start)``."""
        due = deadline + SLACK_S
        for b in merged(self.blocks):
            if b.start > now:
                continue
            step = step_of(b.start) if b.suspend else 0.0
            if b.end >= deadline - max(step, SLACK_S):
                due = max(due, b.end + step + SLACK_S)
        return due


class ServerClock:
    """The store's clock: true time, no faults."""

    def monotonic(self) -> float:
        return _true_now()

    def now_us(self) -> int:
        """Redis ``TIME``, in µs since the epoch."""
        return _WALL_START_US + math.floor(_true_now() * 1_000_000)


# -- the store: Redis running the library's scripts ----------------------------------------------


class StoreDown(ConnectionError):
    """The server is restarting: connections are refused."""


_LAST_RECORD = re.compile(r"(\d+):?(\d*)")
_TOKEN_PREFIX = re.compile(r"(\d+)\|")


class Server:
    """Redis, with the library's ``ELECT``, ``RELEASE`` and ``CLAIM`` scripts (``_scripts.py``)
    written out in Python, line by line. Each call is atomic, as a script is. Keys expire on
    true time at millisecond resolution (``SET ... PX``); ``PTTL`` answers whole ms.

    Keys per job: ``locks`` (the lock and its expiry), ``fences`` (the last token) and
    ``last`` (``"<instant µs>:<token>"``, the last instant claimed or released). A restart
    loses keys (no persistence), fails calls while the server is down and drops every
    subscription.
    """

    def __init__(self) -> None:
        self.clock = ServerClock()
        self.locks: dict[str, tuple[str, float]] = {}
        self.fences: dict[str, str] = {}
        self.last: dict[str, str] = {}
        self.down_until = -math.inf
        self.granted_at: dict[tuple[str, int], float] = {}
        """True time at which each ``(job, token)`` was granted (its lock acquired), for
        invariant (b)."""
        self.grants: dict[str, list[tuple[float, str]]] = {}
        """Per job: when its lock was granted, and to which owner (known to the owner or not:
        a reply lost leaves a lock its holder does not know it has), for invariant (g)."""
        self.recorded: dict[tuple[str, int], int] = {}
        """``(job, instant µs)`` recorded in a ``last`` key (claimed, or released as the last
        run): the token of the term that recorded it first. For invariant (c)."""
        self.released: dict[tuple[str, str], bool] = {}
        """``(job, lock value)`` deleted by ``RELEASE`` (graceful handovers): False when the
        release refused to record the last instant, as too far ahead of the server's clock.
        (Locks of several jobs acquired at once have the same value.)"""
        self._subscribers: dict[int, tuple[ReleaseListener, asyncio.Future[None]]] = {}
        self._next_subscriber = 0
        self.members: dict[str, tuple[str, float]] = {}
        """Per owner: its membership record (JSON) and its expiry (true time)."""
        self.joined: dict[str, tuple[int, str]] = {}
        """Per owner: the placement entry (joined at, server ms; its jobs' digest)."""
        self.epoch = 0
        """Bumped whenever the placement entries change."""

    @property
    def down(self) -> bool:
        return self.clock.monotonic() < self.down_until

    def _get(self, key: str) -> str | None:
        current = self.locks.get(key)
        if current is None:
            return None
        if current[1] <= self.clock.monotonic():
            del self.locks[key]
            return None
        return current[0]

    def _set_px(self, key: str, value: str, ttl_ms: int) -> None:
        self.locks[key] = (value, self.clock.monotonic() + ttl_ms / 1000)

    def _pttl(self, key: str) -> int:
        return max(0, math.floor((self.locks[key][1] - self.clock.monotonic()) * 1000))

    def elect(
        self, owner: str, jobs: Sequence[tuple[str, int, str, bool]]
    ) -> list[tuple[int, str, int]]:
        """``ELECT``: per ``(job, ttl ms, held value or "", take)``, ``(status, value, ttl
        ms)``: a free lock is taken only if asked to (``take``), else ``(0, "", -1)``."""
        out: list[tuple[int, str, int]] = []
        now_us: int | None = None
        for job, ttl_ms, held, take in jobs:
            value = self._get(job)
            if value is not None:
                if held != "" and value == held:
                    self._set_px(job, value, ttl_ms)
                    out.append((1, value, ttl_ms))
                else:
                    out.append((0, value, self._pttl(job)))
                continue
            if not take:
                out.append((0, "", -1))
                continue
            if now_us is None:
                now_us = self.clock.now_us()
            last = _lua_tonumber(self.fences.get(job)) or 0
            token = max(last + 1, now_us)
            value = f"{token}|{owner}"
            self._set_px(job, value, ttl_ms)
            self.fences[job] = str(token)
            self.granted_at.setdefault((job, token), self.clock.monotonic())
            self.grants.setdefault(job, []).append((self.clock.monotonic(), owner))
            out.append((1, value, ttl_ms))
        return out

    def keep_member(
        self, owner: str, record: tuple[bool, str, str, int]
    ) -> tuple[int, str, list[str]]:
        """The membership part of ``ELECT`` (as ``_store.memory`` keeps it): expire the
        records past their time, write or refresh ``owner``'s (``record``: whether it carries
        a payload, its JSON, its jobs' digest, its TTL in ms), and answer the server's time
        (ms), the placement epoch and the placement entries (owner, ``"<at>|<digest>"``)."""
        payload, text, digest, ttl_ms = record
        now = self.clock.monotonic()
        now_ms = self.clock.now_us() // 1000
        for other, (_, expiry) in list(self.members.items()):
            if expiry <= now:
                del self.members[other]
                self.joined.pop(other, None)
                self.epoch += 1
        if payload or owner not in self.members:
            self.members[owner] = (text, now + ttl_ms / 1000)
            if owner in self.joined and self.joined[owner][1] != digest:
                self.joined[owner] = (self.joined[owner][0], digest)
                self.epoch += 1
        else:
            self.members[owner] = (self.members[owner][0], now + ttl_ms / 1000)
        if owner not in self.joined:
            self.joined[owner] = (now_ms, digest)
            self.epoch += 1
        flat = [item for other, (at, d) in self.joined.items() for item in (other, f"{at}|{d}")]
        return now_ms, str(self.epoch), flat

    def leave(self, owner: str) -> None:
        """A graceful stop deletes the node's membership record."""
        self.members.pop(owner, None)
        if self.joined.pop(owner, None) is not None:
            self.epoch += 1

    def release(self, max_ahead_us: int, jobs: Sequence[tuple[str, str, str]]) -> int:
        """``RELEASE``: per ``(job, value, last instant µs or "")``; publishes the jobs
        released."""
        released = 0
        names: set[str] = set()
        now_us: int | None = None
        for job, value, last in jobs:
            if value == "" or self._get(job) != value:
                continue
            del self.locks[job]
            released += 1
            names.add(job)
            self.released[job, value] = True
            if last == "":
                continue
            if now_us is None:
                now_us = self.clock.now_us()
            instant = int(last)
            match = re.match(r"\d+", self.last.get(job, ""))
            stored = int(match.group()) if match else -1
            token = _TOKEN_PREFIX.match(value)
            self.released[job, value] = instant <= now_us + max_ahead_us
            if instant > stored and instant <= now_us + max_ahead_us and token is not None:
                self.last[job] = f"{last}:{token.group(1)}"
                self.recorded.setdefault((job, instant), int(token.group(1)))
        if released > 0:
            self.publish(frozenset(names))
        return released

    def claim(self, job: str, value: str, instant_us: int, max_ahead_us: int) -> int:
        """``CLAIM``: 1 recorded (or this term's own last claim), 0 already claimed, -1 not
        the lock's holder, -2 ahead of the server's clock."""
        if value == "" or self._get(job) != value:
            return -1
        prefix = _TOKEN_PREFIX.match(value)
        token = prefix.group(1) if prefix else None
        last, by = -1, None
        stored = self.last.get(job)
        if stored is not None:
            record = _LAST_RECORD.fullmatch(stored)
            if record is not None:
                last, by = int(record.group(1)), record.group(2)
        if instant_us == last and by == token:
            return 1
        if instant_us <= last:
            return 0
        if instant_us > self.clock.now_us() + max_ahead_us:
            return -2
        self.last[job] = f"{instant_us}:{token}"
        if token is not None:
            self.recorded.setdefault((job, instant_us), int(token))
        return 1

    # pub/sub

    def publish(self, jobs: frozenset[str] | None) -> None:
        """Deliver a notice naming ``jobs`` (None: a notice that names none)."""
        loop = asyncio.get_running_loop()
        for callback, _ in list(self._subscribers.values()):  # in subscription order
            loop.call_later(LATENCY_S, callback, jobs)

    async def subscribe(self, on_release: ReleaseListener) -> None:
        """Hold a subscription until it breaks (``ConnectionError`` on a restart)."""
        if self.down:
            raise StoreDown("connection refused: the store is restarting")
        broken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        key = self._next_subscriber
        self._next_subscriber += 1
        self._subscribers[key] = (on_release, broken)
        try:
            await broken
        finally:
            del self._subscribers[key]

    # operators and faults

    def restart(self, lose: str, down_s: float) -> None:
        self.locks.clear()
        if "fences" in lose or lose == "all":
            self.fences.clear()
        if lose == "all":
            self.last.clear()
        self.down_until = self.clock.monotonic() + down_s
        for _, broken in self._subscribers.values():
            if not broken.done():
                broken.set_exception(StoreDown("the store restarted: subscription lost"))

    def write(self, job: str, value: str, ttl_s: float) -> None:
        self._set_px(job, value, max(1, round(ttl_s * 1000)))

    def delete(self, job: str) -> None:
        self.locks.pop(job, None)


def _lua_tonumber(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


# -- adapter: the only code that knows the library's internals ------------------------------------


def call_timeout_s(ttl_s: float) -> float:
    """How long the elector waits for an answer that grants a lease of ``ttl_s``."""
    return lease_deadline(0.0, ttl_s)


def make_schedule(kind: JobKind) -> Schedule:
    if kind == "fixed_rate":
        return FixedRate(FIXED_RATE_EVERY_S)
    if kind == "interval":
        return Interval(INTERVAL_EVERY_S)
    return Cron(CRON_EXPRESSION)


@functools.cache
def make_spec(name: str, config: JobConfig) -> JobSpec:
    """The job as ``SingletonJobs`` registers it; one per name and config, shared by every
    node of every schedule (building one resolves the function's parameters: ~2 ms)."""
    return JobSpec(
        name=name,
        func=_job_body,
        schedule=make_schedule(config.kind),
        kind=config.kind,
        on_leadership_lost=config.policy,
        checkpoint=False,  # the simulation checks the claims; checkpoints have their own tests
    )


async def _job_body(ctx: JobContext) -> None:
    """Every job's code: the run of node ``ctx.node_id`` of the simulation being played."""
    await _PLAYING.get().node_named[ctx.node_id].body(ctx)


_SETTINGS = Settings.build(
    redis_url=None,
    has_client=True,
    project=PROJECT,
    node_id="n",
    heartbeat_interval=HEARTBEAT_S,
    lock_expiry=TTL_S,
    max_backoff=MAX_BACKOFF_S,
    shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    env={},
)


class NodeStore:
    """One node's ``Store``: what ``RedisLeaseStore`` puts on the wire and makes of the
    replies (``_redis_store.py``), over the node's ``Link`` to the ``Server``."""

    def __init__(self, link: Link, server: Server) -> None:
        self._link = link
        self._server = server

    async def elect(self, node_id: str, requests: Sequence[LeaseRequest]) -> list[LeaseReply]:
        # Only a value of the form this library writes can be the caller's own.
        wire = [
            (
                r.job,
                max(1, round(r.ttl_s * 1000)),
                r.held if r.held is not None and is_lock_value(r.held) else "",
                r.take,
            )
            for r in requests
        ]
        member = self.membership
        record = None
        if member is not None and not member.left:  # as sent: the record of this call
            record = (bool(member.payload()), member.record.to_json(), member.digest, member.ttl_ms)

        def call() -> tuple[list[tuple[int, str, int]], tuple[int, str, list[str]] | None]:
            placed = None if record is None else self._server.keep_member(node_id, record)
            return self._server.elect(node_id, wire), placed

        raw, placed = await self._link.call(call)
        if member is not None and placed is not None:
            member.confirmed(True)
            now_ms, epoch, flat = placed
            member.placed(now_ms, epoch, flat if epoch != member.epoch else [])
        return [
            LeaseReply(r.job, status == 1, value or None, None if ttl_ms < 0 else ttl_ms / 1000)
            for r, (status, value, ttl_ms) in zip(requests, raw, strict=True)
        ]

    async def release(
        self, node_id: str, values: dict[str, str], last_us: Mapping[str, int] | None = None
    ) -> int:
        values = {job: value for job, value in values.items() if is_lock_value(value)}
        if not values:
            return 0
        last = last_us or {}
        wire = [(job, value, str(last.get(job, ""))) for job, value in values.items()]
        return await self._link.call(lambda: self._server.release(DEFAULT_MAX_AHEAD_US, wire))

    async def claim(
        self,
        job: str,
        value: str,
        instant_us: int,
        *,
        max_ahead_us: int = DEFAULT_MAX_AHEAD_US,
        timeout_s: float = DEFAULT_CLAIM_TIMEOUT_S,
    ) -> ClaimResult:
        if not is_lock_value(value):
            return ClaimResult.NOT_HOLDER
        call = self._link.call(
            lambda: self._server.claim(job, value, instant_us, max_ahead_us), claim=True
        )
        try:  # the Redis store's deadline (``_store.redis.claims``)
            reply = await asyncio.wait_for(call, timeout_s)
        except TimeoutError:
            raise ConnectionError(f"the claim of {job!r} was not answered in time") from None
        return ClaimResult(reply)

    async def listen_releases(
        self, on_release: ReleaseListener, *, keepalive_s: float = DEFAULT_KEEPALIVE_S
    ) -> None:
        await self._link.subscribe(on_release)

    async def ping(self) -> None:
        await self._link.call(lambda: None)

    async def aclose(self) -> None:
        pass

    # The simulated jobs keep no checkpoint (make_spec): these are never called.

    async def record_runs(self, *args: object, **kwargs: object) -> Recorded:
        raise AssertionError("the simulated jobs keep no checkpoint")

    async def save_state(self, *args: object, **kwargs: object) -> bool:
        raise AssertionError("the simulated jobs keep no checkpoint")

    async def read_checkpoint(self, *args: object, **kwargs: object) -> Checkpoint | None:
        raise AssertionError("the simulated jobs keep no checkpoint")

    async def check_overdue(self, checks: Sequence[OverdueCheck], **kwargs: object) -> OverdueReply:
        # No job is ever overdue here: the simulation keeps no checkpoint, claims or spells.
        await asyncio.sleep(0)
        states = [OverdueState(Anchor(), False, None, False) for _ in checks]
        return OverdueReply(datetime(2000, 1, 1, tzinfo=UTC), states)

    async def read_history(self, *args: object, **kwargs: object) -> list[Occurrence]:
        raise AssertionError("the simulated jobs keep no checkpoint, and so no history")

    async def load_checkpoint(
        self, *args: object, **kwargs: object
    ) -> tuple[Checkpoint | None, datetime, str | None]:
        raise AssertionError("the simulated jobs keep no checkpoint")

    async def reset_checkpoint(self, *args: object, **kwargs: object) -> bool:
        raise AssertionError("the simulated jobs keep no checkpoint")

    # The membership, as ELECT keeps it (spread placement reads it); no controls.

    membership: Membership | None = None

    def announce(self, membership: Membership) -> None:
        self.membership = membership

    async def leave(self) -> None:
        member = self.membership
        if member is None:
            return
        member.left = True
        owner = member.record.owner
        await self._link.call(lambda: self._server.leave(owner))
        member.confirmed(False)

    async def set_control(self, *args: object, **kwargs: object) -> bool:
        raise AssertionError("the simulation sets no control")

    async def read_cluster(self, *args: object, **kwargs: object) -> ClusterData:
        raise AssertionError("the simulation reads no cluster view")

    async def read_members(self, *args: object, **kwargs: object) -> dict[str, MemberRecord]:
        raise AssertionError("the simulation keeps no membership record")


class _TermTelemetry(Telemetry):
    """Reports each new term to the simulation (the elector says "acquired" right after it
    set the term's token and deadline). Explicit no-op providers: the API's default proxy
    provider would keep every engine of every schedule alive (it holds each meter)."""

    def __init__(self, node: SimNode) -> None:
        super().__init__(
            node.name,
            tracer_provider=trace.NoOpTracerProvider(),
            meter_provider=metrics.NoOpMeterProvider(),
        )
        self._node = node
        self.instance: Instance | None = None

    def change(self, job: str, change: str) -> None:
        super().change(job, change)
        if change == "acquired" and self.instance is not None:
            self._node.on_acquired(self.instance, job)


@dataclass(eq=False)
class Instance:
    """One start of a node: its engine and the tasks it runs."""

    engine: Engine
    starting: asyncio.Task[None] | None = None
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    """The election loop, its helpers and the timer (once started)."""
    stopping: bool = False


def build_instance(node: SimNode) -> Instance:
    """A node's engine, wired exactly as ``SingletonJobs`` wires it."""
    sim = node.sim
    telemetry = _TermTelemetry(node)
    specs = [
        make_spec(name, config)
        for name, config in zip(sim.job_names, sim.scenario.jobs, strict=True)
    ]
    engine = Engine(
        dataclasses.replace(_SETTINGS, node_id=node.name, placement=sim.scenario.placement),
        specs,
        NodeStore(node.link, sim.server),
        node.clock,
        telemetry=telemetry,
    )
    instance = Instance(engine)
    telemetry.instance = instance
    return instance


async def start_instance(instance: Instance) -> None:
    engine = instance.engine
    await engine.start()
    tasks = (engine.election_task, engine.timer_task, engine.watch_task)
    instance.tasks = [t for t in tasks if t is not None]


HELPERS = ("release listener", "deadline watchdog")
"""The election loop's helper tasks, by the end of their names."""


def helpers_missing(instances: Sequence[Instance]) -> list[tuple[Instance, str]]:
    """The helper tasks of the election loops of started ``instances`` that are not
    running (one look at every task: too slow to do more often than once a schedule)."""
    running = {t.get_name() for t in asyncio.all_tasks() if not t.done()}
    return [
        (instance, helper)
        for instance in instances
        if instance.tasks
        for helper in HELPERS
        if f"singletonjob {instance.engine.settings.node_id} {helper}" not in running
    ]


async def stop_instance(instance: Instance) -> None:
    """Graceful shutdown: ``Engine.stop`` (stop ticking, hand over idle jobs, drain, release)."""
    await instance.engine.stop()


def crash_instance(instance: Instance) -> None:
    """The process dies: everything stops at once, nothing is released."""
    engine = instance.engine
    engine.ticker.stop_waiting()
    tasks = [
        instance.starting,
        *instance.tasks,
        *(runner.current for runner in engine.runners.values()),
        *engine._retiring,
    ]
    for task in tasks:
        if task is not None:
            task.cancel()


def lease_of(instance: Instance, job: str) -> Lease:
    return instance.engine.elector.leases[job]


def lost_event(lease: Lease, token: int) -> asyncio.Event:
    """The ``leadership_lost`` event of the term ``token`` (set once that term has ended)."""
    return lease.lost_of(token)


def leads(instance: Instance, clock: NodeClock, job: str) -> bool:
    """Whether the node's term of ``job`` is valid, without ``Elector.is_leader``'s side
    effect (it ends an expired term at once; the harness must not end terms)."""
    lease = lease_of(instance, job)
    return lease.token is not None and clock.monotonic() < lease.deadline


def fail_schedule(instance: Instance, job: str) -> None:
    """The node's schedule of ``job`` raises, as a custom schedule's bug would: the timer
    stops the job there and the engine retires it (``Ticker._crash``)."""
    ticker = instance.engine.ticker
    ticker._crash(ticker._slots[job], RuntimeError("injected: the schedule failed"))


def schedule_errors(instance: Instance) -> list[str]:
    """Why jobs' schedules stopped on this node, if any did."""
    return [
        f"job {name!r}: {instance.engine.ticker.failure(name)!r}"
        for name in instance.engine.runners
        if instance.engine.ticker.failure(name) is not None
    ]


# -- the simulated cluster ----------------------------------------------------------------------


@dataclass
class RunEntry:
    node: str
    job: str
    token: int
    scheduled_at: datetime
    kind: JobKind
    policy: Policy
    start: float
    blocks: list[Block] = field(repr=False)
    """The node's blocks (pauses, suspends), see ``NodeClock.blocks``."""
    end: float | None = None
    lost_at: float | None = None

    def counted_until(self, now: float) -> float:
        """Until when this run counts as the job's runner for the overlap invariant: a
        "finish" run until its leadership was lost; a run that a pause or suspend kept from
        ending on time only until the block began (a blocked node runs nothing), when it ended
        as soon after the block as invariant (d) requires."""
        end = self.end if self.end is not None else now
        if self.policy == "finish" and self.lost_at is not None:
            end = min(end, self.lost_at)
        for block in merged(self.blocks):
            step = WATCH_STEP_S if block.suspend else 0.0
            if self.start <= block.start <= end <= block.end + step + SLACK_S:
                return block.start
        return end

    def in_flight_at(self, at: float) -> bool:
        return self.start <= at and (self.end is None or self.end > at)

    def __str__(self) -> str:
        end = "running" if self.end is None else f"{self.end:.4f}"
        lost = "" if self.lost_at is None else f", lost at {self.lost_at:.4f}"
        return (
            f"{self.node} token {self.token} tick {self.scheduled_at.isoformat()} "
            f"[{self.start:.4f} .. {end}{lost}] ({self.policy})"
        )


class Link:
    """One node's connection to the server: latency, the node's pauses, and injected faults
    (a request lost; a reply delayed, or lost after the server ran the call; calls refused
    while the server restarts)."""

    def __init__(self, node: SimNode) -> None:
        self._node = node

    async def call(self, call: Callable[[], T], *, claim: bool = False) -> T:
        """Send ``call`` to the server and wait for its reply. A request sent is run even if
        the caller gives up meanwhile (its timeout): the server does not know. A silent flow
        (``claim``: or the claims' flow) loses requests and replies without an error."""
        node = self._node
        await node.clock.gate()  # a blocked node sends nothing
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[T] = loop.create_future()

        def deliver(result: T) -> None:
            if not node.silent(claim):
                _resolve(reply, result)

        def arrive() -> None:
            if node.silent(claim):
                return  # no reply ever, no error: the caller's deadline ends its wait
            if node.sim.server.down:
                refused = StoreDown("connection refused: the store is restarting")
                loop.call_later(LATENCY_S, _fail, reply, refused)
                return
            fault = node.pop_call_fault()
            if fault == LOST_REQUEST:
                return  # no reply ever: the caller's timeout ends its wait
            result = call()
            if fault is None or not math.isinf(fault):
                loop.call_later(LATENCY_S + (fault or 0.0), deliver, result)

        loop.call_later(LATENCY_S, arrive)
        result = await reply
        await node.clock.gate()  # nor reads a reply
        return result

    async def subscribe(self, on_release: ReleaseListener) -> None:
        await self._node.clock.gate()
        await asyncio.sleep(LATENCY_S)
        await self._node.sim.server.subscribe(on_release)


def _resolve(future: asyncio.Future[T], result: T) -> None:
    if not future.done():
        future.set_result(result)


def _fail(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


class SimNode:
    def __init__(self, sim: Simulation, index: int, config: NodeConfig) -> None:
        self.sim = sim
        self.index = index
        self.name = f"n{index}"
        self.clock = NodeClock(config, index)
        self.rng = random.Random(sim.scenario.seed * 31 + index)
        self.link = Link(self)
        self.call_faults: list[tuple[float, float]] = []
        """Per coming call: its reply's delay (inf: lost), or ``LOST_REQUEST``; and when the
        fault came."""
        self.silent_until = -math.inf
        """The node's flow to the store is silent until then (``silent``)."""
        self.claims_silent_until = -math.inf
        """The node's claims go unanswered until then (``claims_down``)."""
        self.sick: list[tuple[float, float]] = []
        """True-time spans in which this node was not healthy by the liveness invariant: its
        calls faulted, its loop blocked, its clock stepped (see ``Simulation.check_liveness``)."""
        self.down: list[tuple[float, float]] = []
        """True-time spans in which this node was stopped or dead."""
        self.retired: dict[str, list[tuple[float, float]]] = {}
        """Per job: true-time spans in which this node's schedule of it had failed
        (``schedule_fails``, until the node starts again)."""
        self.instance: Instance | None = None
        self.stop_task: asyncio.Task[None] | None = None

    def silent(self, claim: bool) -> bool:
        now = _true_now()
        return now < self.silent_until or (claim and now < self.claims_silent_until)

    def pop_call_fault(self) -> float | None:
        """The fault of the call arriving now, if any; the node is sick from when the fault
        came until the call's timeout has passed."""
        if not self.call_faults:
            return None
        fault, since = self.call_faults.pop(0)
        self.sick.append((since, _true_now() + call_timeout_s(TTL_S)))
        return fault

    def link_fault(self, fault: Fault, now: float) -> None:
        """A fault of the node's flow to the store (``_LINK_FAULTS``)."""
        if fault.kind == "slow_reply":
            self.call_faults.append((fault.value * call_timeout_s(TTL_S), now))
        elif fault.kind == "lost_reply":
            self.call_faults.append((math.inf, now))
        elif fault.kind == "lost_request":
            self.call_faults.append((LOST_REQUEST, now))
        elif fault.kind == "silent":
            self.silent_until = max(self.silent_until, now + fault.value)
            self.sick.append((now, now + fault.value))
        else:  # claims_down
            self.claims_silent_until = max(self.claims_silent_until, now + fault.value)
            self.sick.append((now, now + fault.value))

    def fail_schedule(self, job: str, now: float) -> None:
        """``schedule_fails``: a running node's schedule of ``job`` fails (once a start)."""
        instance = self.instance
        if instance is None or instance.stopping or not instance.tasks:
            return
        spans = self.retired.setdefault(job, [])
        if not spans or not math.isinf(spans[-1][1]):
            spans.append((now, math.inf))
            fail_schedule(instance, job)

    # lifecycle

    @property
    def alive(self) -> bool:
        return self.instance is not None and not self.instance.stopping

    def start(self) -> None:
        if self.instance is not None:
            return
        if self.down and math.isinf(self.down[-1][1]):
            self.down[-1] = (self.down[-1][0], _true_now())
        for spans in self.retired.values():  # a new instance has its schedules afresh
            if spans and math.isinf(spans[-1][1]):
                spans[-1] = (spans[-1][0], _true_now())
        instance = build_instance(self)
        self.instance = instance
        instance.starting = asyncio.create_task(self._start(instance), name=f"{self.name} start")

    async def _start(self, instance: Instance) -> None:
        try:
            await start_instance(instance)
        except Exception as exc:
            self.sim.violate("loop_died", f"{self.name}: the engine did not start: {exc!r}")
            return
        for task in instance.tasks:
            task.add_done_callback(functools.partial(self._ended, instance))

    def _ended(self, instance: Instance, task: asyncio.Task[Any]) -> None:
        if instance.stopping or instance is not self.instance:
            return
        why = "ended" if task.cancelled() or task.exception() is None else repr(task.exception())
        self.sim.violate("loop_died", f"{self.name}: task {task.get_name()!r} {why}")

    def stop(self) -> None:
        instance = self.instance
        if instance is None or instance.stopping:
            return
        instance.stopping = True
        self.down.append((_true_now(), math.inf))

        async def stop() -> None:
            if instance.starting is not None:
                await asyncio.wait({instance.starting})
            await stop_instance(instance)
            if self.instance is instance:
                self.instance = None

        self.stop_task = asyncio.create_task(stop(), name=f"{self.name} stop")

    def crash(self) -> None:
        instance = self.instance
        if instance is None:
            return
        if not instance.stopping:
            self.down.append((_true_now(), math.inf))
        instance.stopping = True
        self.instance = None
        if self.stop_task is not None:
            self.stop_task.cancel()
        crash_instance(instance)

    def leads(self, job: str) -> bool:
        return self.alive and self.instance is not None and leads(self.instance, self.clock, job)

    # observation

    def on_acquired(self, instance: Instance, job: str) -> None:
        lease = lease_of(instance, job)
        assert lease.token is not None
        self.sim.on_term(self, job, lease.token)
        self.sim.spawn(
            self._watch_term(instance, lease, lease.token, lost_event(lease, lease.token))
        )

    async def _watch_term(
        self, instance: Instance, lease: Lease, token: int, lost: asyncio.Event
    ) -> None:
        """Invariant (d): the term's ``leadership_lost`` is set by its deadline."""
        while not (lost.is_set() or lease.token != token or instance.stopping):
            deadline = self.clock.true_of(lease.deadline)
            due = self.clock.lost_due(
                deadline, _true_now(), functools.partial(self._watch_step, lease.job)
            )
            if due - _true_now() > _EPSILON_S:
                await asyncio.sleep(due - _true_now())
                continue  # renewed, ended or blocked meanwhile: look again
            self.sim.violate(
                "late_lost",
                f"{self.name}'s term of {lease.job} (token {token}) passed its deadline at "
                f"{deadline:.4f}s but leadership_lost is not set at {_true_now():.4f}s",
            )
            return

    def _watch_step(self, job: str, at: float) -> float:
        """The deadline watchdog's longest sleep at ``at``: shorter while a run is in flight."""
        running = any(
            r.node == self.name and r.job == job and r.in_flight_at(at) for r in self.sim.runs
        )
        return WATCH_STEP_S if running else HEARTBEAT_S

    async def body(self, ctx: JobContext) -> None:
        sim = self.sim
        config = sim.scenario.jobs[sim.job_names.index(ctx.job)]
        instance = self.instance
        if instance is None or not leads(instance, self.clock, ctx.job):
            sim.violate("stale_start", f"{self.name} started {ctx.job} without a valid lease")
        elif lease_of(instance, ctx.job).token != ctx.fencing_token:
            sim.violate("stale_start", f"{self.name} started {ctx.job} with an ended term's token")
        entry = RunEntry(
            self.name, ctx.job, ctx.fencing_token, ctx.scheduled_at, config.kind, config.policy,
            _true_now(), self.clock.blocks,
        )  # fmt: skip
        sim.on_run_start(entry)
        watcher = asyncio.ensure_future(ctx.leadership_lost.wait())
        watcher.add_done_callback(lambda w: self._on_run_lost(entry, w))
        duration = (
            self.rng.uniform(0.005, 0.05)
            if self.rng.random() < 0.8
            else self.rng.uniform(0.05, 1.5)
        )
        try:
            await self.clock.sleep(duration)
        finally:
            entry.end = _true_now()
            watcher.cancel()
            sim.on_run_end(entry)

    def _on_run_lost(self, entry: RunEntry, watcher: asyncio.Future[Any]) -> None:
        if watcher.cancelled():
            return
        entry.lost_at = _true_now()
        if entry.policy == "cancel" and entry.end is None:
            self.sim.spawn(self._check_cancelled(entry))

    async def _check_cancelled(self, entry: RunEntry) -> None:
        """Invariant (d): a "cancel" run ends once its leadership is lost."""
        assert entry.lost_at is not None
        await asyncio.sleep(SLACK_S)
        blocked_until = self.clock.blocked_between(entry.lost_at, _true_now())
        if blocked_until is not None and blocked_until + SLACK_S > _true_now():
            await asyncio.sleep(blocked_until + SLACK_S - _true_now())
        if entry.end is None and self.alive:
            self.sim.violate(
                "late_lost",
                f"run {entry} of {entry.job} still runs {_true_now() - entry.lost_at:.4f}s "
                "after its leadership was lost (on_leadership_lost='cancel')",
            )


FAST_TICK_TWICE = "fast-tick-twice-on-a-handover-that-records-nothing"
"""Known limit (docs/design.md, "The bound for sub-second fixed rates"), a bug by invariant
(c): a sub-second fixed-rate job claims only the first tick of a term, and records the last
tick it ran only when it releases its lock, and then only within 1 s of the store's clock.
After a handover that records nothing, a successor whose wall clock is behind the old
leader's runs again the ticks the old leader ran that its own clock has not reached yet:

- no release: the old leader's lease ran out (its requests were lost, it was paused or it
  died). A skew above the gap between the two terms suffices: ~13 ms when the old leader's
  requests stop arriving (its deadline's margin and a round trip);
- a release whose last tick was refused as more than 1 s ahead of the store's clock: the
  old leader's wall clock had stepped forward by more than that.

The second case is not in the design's bound yet. See ``test_known_schedules.py``."""
KNOWN_BUGS = frozenset({FAST_TICK_TWICE})
"""Known bugs the invariants excuse by default, so that the randomized schedules look for
other ones; each has a strict ``xfail`` test that replays it without the excuse."""


LIVENESS_LEAD_S = MAX_BACKOFF_S + HEARTBEAT_S
"""How long a node must have been healthy before invariant (g) counts on it: a node whose
calls failed may back off for up to ``MAX_BACKOFF_S`` before its next round."""
PERIOD_S: dict[JobKind, float] = {
    "fixed_rate": FIXED_RATE_EVERY_S,
    "interval": INTERVAL_EVERY_S,
    "cron": 1.0,
}


def liveness_bound_s(kind: JobKind) -> float:
    """The longest a job may run nowhere while a node is healthy: the promise (a due
    instant starts within a lock expiry plus two heartbeats, or the period if longer) plus
    the period to the next instant."""
    period = PERIOD_S[kind]
    return max(TTL_S + 2 * HEARTBEAT_S, period) + period


def _gaps(
    spans: Sequence[tuple[float, float]], start: float, end: float
) -> list[tuple[float, float]]:
    """The parts of ``[start, end]`` that no span of ``spans`` covers."""
    out: list[tuple[float, float]] = []
    at = start
    for s0, s1 in sorted(spans):
        if s0 > at:
            out.append((at, min(s0, end)))
        at = max(at, s1)
        if at >= end:
            return [g for g in out if g[1] > g[0]]
    out.append((at, end))
    return [g for g in out if g[1] > g[0]]


class Simulation:
    def __init__(self, scenario: Scenario, excuse: frozenset[str] = KNOWN_BUGS) -> None:
        self.scenario = scenario
        self.excuse = excuse
        self.excused: list[Violation] = []
        """Violations of a known bug, excused (see ``KNOWN_BUGS``)."""
        self.job_names = [f"j{i}" for i in range(len(scenario.jobs))]
        self.server = Server()
        self.nodes = [SimNode(self, i, config) for i, config in enumerate(scenario.nodes)]
        self.node_named = {node.name: node for node in self.nodes}
        self.runs: list[RunEntry] = []
        self.terms: dict[str, list[tuple[int, str, float, float]]] = {j: [] for j in self.job_names}
        """Per job: each term's token, node, true start and true grant time."""
        self.losses: dict[str, list[float]] = {j: [] for j in self.job_names}
        """True times at which the store lost (or something overwrote) each job's key."""
        self.violations: list[Violation] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._ticks: dict[tuple[str, datetime], RunEntry] = {}
        self.excused_idle: dict[str, list[tuple[float, float]]] = {j: [] for j in self.job_names}
        """Per job: true-time spans in which no node can run it, whatever their health (the
        store down, a foreign value in its lock, a clock step's effect on its claims)."""

    def spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def violate(self, invariant: str, message: str) -> None:
        self.violations.append(Violation(_true_now(), invariant, message))

    # invariants checked as things happen

    def on_term(self, node: SimNode, job: str, token: int) -> None:
        """Invariant (b), in the order the store granted the terms (a node learns of its
        grant a round trip later, and after a restart that lost the lock, a slow reply can
        start a term granted before the current holder's: fencing rejects its writes)."""
        granted = self.server.granted_at.get((job, token), _true_now())
        for other, other_node, other_at, other_granted in self.terms[job]:
            if other_granted <= granted and other >= token:
                self.violate(
                    "token",
                    f"{node.name} began a term of {job} with token {token} (granted at "
                    f"{granted:.4f}s), not above token {other} of {other_node}'s term begun "
                    f"at {other_at:.4f}s (granted at {other_granted:.4f}s)",
                )
                break
        self.terms[job].append((token, node.name, _true_now(), granted))

    def on_run_start(self, entry: RunEntry) -> None:
        self.runs.append(entry)
        if entry.kind == "interval":
            return
        key = (entry.job, entry.scheduled_at)
        earlier = self._ticks.get(key)
        if earlier is not None and not self._excused(entry.job, earlier.start, entry.start):
            violation = Violation(
                _true_now(),
                "tick_twice",
                f"tick {entry.scheduled_at.isoformat()} of {entry.job} ran twice: {earlier} "
                f"and {entry}",
            )
            if self._fast_tick_bug(earlier, entry):
                self.excused.append(violation)
            else:
                self.violations.append(violation)
        self._ticks[key] = entry

    def _fast_tick_bug(self, earlier: RunEntry, entry: RunEntry) -> bool:
        """Whether a tick run twice is the known bug ``FAST_TICK_TWICE``: a sub-second fixed
        rate, a tick that no term but the second run's recorded in the store, and a first
        run whose term ended without a release that recorded its last tick."""
        if FAST_TICK_TWICE not in self.excuse or entry.kind != "fixed_rate":
            return False
        instant_us = (entry.scheduled_at - _EPOCH) // timedelta(microseconds=1)
        recorded_by = self.server.recorded.get((entry.job, instant_us))
        recorded_on_release = any(
            recorded
            for (job, value), recorded in self.server.released.items()
            if job == entry.job and value.startswith(f"{earlier.token}|")
        )
        return recorded_by in (None, entry.token) and not recorded_on_release

    def on_run_end(self, entry: RunEntry) -> None:
        self.check_overlaps(entry)

    def check_overlaps(self, entry: RunEntry) -> None:
        now = _true_now()
        for other in self.runs:
            if other is entry or other.node == entry.node or other.job != entry.job:
                continue
            start = max(entry.start, other.start)
            end = min(entry.counted_until(now), other.counted_until(now))
            if start < end - 1e-9 and not self._excused(entry.job, entry.start, other.start):
                first, second = sorted((entry, other), key=lambda r: r.start)
                self.violate(
                    "overlap",
                    f"runs of {entry.job} overlap for {end - start:.4f}s from {start:.4f}s: "
                    f"{first} and {second}",
                )

    def _excused(self, job: str, start_a: float, start_b: float) -> bool:
        low, high = min(start_a, start_b) - TTL_S - SLACK_S, max(start_a, start_b)
        return any(low <= lost <= high for lost in self.losses[job])

    def check_schedules(self) -> None:
        for node in self.nodes:
            if node.alive and node.instance is not None:
                for error in schedule_errors(node.instance):
                    if "injected: the schedule failed" not in error:
                        self.violate("loop_died", f"{node.name}: the schedule failed: {error}")

    def check_liveness(self, end: float) -> None:
        """Invariant (g): while a node is healthy (alive, its calls answered, its event loop
        and clock sound, for ``LIVENESS_LEAD_S`` and on), every job runs: no stretch of a
        job's schedule with no run of it started or in flight lasts longer than
        ``liveness_bound_s`` within such a span (a job busy with a long run counts as run;
        a "finish" run only until its leadership was lost), plus a lock expiry and a
        heartbeat per unhealthy leader after the first that the job passed through
        (``_chain_allowance``)."""
        for job, kind in zip(self.job_names, (j.kind for j in self.scenario.jobs), strict=True):
            idle = _gaps(
                [(r.start, r.counted_until(end)) for r in self.runs if r.job == job], 0.0, end
            )
            for node in self.nodes:
                unhealthy = node.down + node.sick + node.retired.get(job, [])
                for h0, h1 in _gaps(unhealthy + self.excused_idle[job], 0.0, end):
                    healthy_from = h0 + LIVENESS_LEAD_S if h0 > 0 else h0
                    for i0, i1 in idle:
                        bound = liveness_bound_s(kind) + self._chain_allowance(job, i0, i1)
                        start, stop = max(i0, healthy_from), min(i1, h1)
                        if stop - start > bound + SLACK_S:
                            self.violations.append(
                                Violation(
                                    start + bound,
                                    "liveness",
                                    f"{job} ({kind}) ran nowhere from {i0:.4f}s to {i1:.4f}s "
                                    f"while {node.name} was healthy from {h0:.4f}s to "
                                    f"{h1:.4f}s: {stop - start:.4f}s, over the bound of "
                                    f"{bound:.4f}s",
                                )
                            )
                            return

    def _chain_allowance(self, job: str, start: float, end: float) -> float:
        """What invariant (g) allows beyond its bound for ``[start, end]``: a lock expiry
        and a heartbeat for each fault after the first of the nodes that held ``job``'s lock
        in it (the store granted it to them, whether they learnt it or not).
        The promise is per gray fault: each can cost up to a lock expiry (a lost reply leaves
        a lock its holder does not know of; claims that fail are let go after one), and a
        healthy node may lose the job to a gray one (a placement move, a race)."""
        # The nodes whose locks the store granted, whether or not their term began.
        grants = [
            (at, owner.split(OWNER_SEPARATOR)[0]) for at, owner in self.server.grants.get(job, [])
        ]
        holders = {node for at, node in grants if start < at < end}
        before = [node for at, node in grants if at <= start]
        if before:
            holders.add(before[-1])
        faults = [
            span
            for name in holders
            for span in (
                self.node_named[name].sick
                + self.node_named[name].down
                + self.node_named[name].retired.get(job, [])
            )
            if span[0] < end and span[1] > start
        ]
        # The store's faults count too: a lock deleted, lost or overwritten costs its holder
        # the instant it claims before it learns (at its next round) and takes the lock again.
        faults += [(at, at) for at in self.losses[job] if start - TTL_S < at < end]
        return max(0, len(faults) - 1) * (TTL_S + HEARTBEAT_S)

    # faults

    def target(self, fault: Fault) -> SimNode:
        if fault.node == LEADER:
            leaders = [n for n in self.nodes if n.leads(self.job_names[0])]
            return leaders[0] if leaders else self.nodes[0]
        return self.nodes[fault.node % len(self.nodes)]

    def apply(self, fault: Fault) -> None:
        node = self.target(fault)
        job = self.job_names[fault.job % len(self.job_names)]
        now = _true_now()
        if fault.kind in _LINK_FAULTS:
            node.link_fault(fault, now)
        elif fault.kind == "restart":
            self.server.restart(fault.flag, fault.value)
            for name in self.job_names:
                self.losses[name].append(now)
                self.excused_idle[name].append((now, now + fault.value))
        elif fault.kind == "foreign":
            value = {"garbage": "garbage value", "huge": "9" * 5000 + "|x"}.get(fault.flag, "")
            self.server.write(job, value, fault.value)
            self.losses[job].append(now)
            self.excused_idle[job].append((now, now + fault.value))  # nobody can take it
        elif fault.kind == "delete":
            self.server.delete(job)
            self.losses[job].append(now)
        elif fault.kind == "wall_step":
            self._wall_step(node, fault.value, now)
        elif fault.kind in ("pause", "suspend"):
            node.clock.block(fault.value, suspend=fault.kind == "suspend")
            node.sick.append((now, now + fault.value))
        elif fault.kind == "stop":
            node.stop()
        elif fault.kind == "crash":
            node.crash()
        elif fault.kind == "start":
            node.start()
        elif fault.kind == "schedule_fails":
            node.fail_schedule(job, now)

    def _wall_step(self, node: SimNode, step_s: float, now: float) -> None:
        node.clock.wall_offset_s += step_s
        # Instants claimed by a node ahead are refused to the others until their clocks
        # reach them; a node behind finds its instants claimed: either runs nothing for
        # the step's length, and a node more than the claims' limit ahead nothing at all.
        for name in self.job_names:
            self.excused_idle[name].append((now, now + abs(step_s) + TTL_S))
        if node.clock.wall_offset_s > DEFAULT_MAX_AHEAD_US / 1e6 - 2 * LATENCY_S:
            node.sick.append((now, math.inf))

    # the run

    async def run(self) -> None:
        for node in self.nodes:
            node.start()
        faults = sorted_faults(self.scenario.faults)
        for fault in faults:
            await asyncio.sleep(max(0.0, fault.at_s - _true_now()))
            self.check_schedules()
            self.apply(fault)
            if self.violations:
                return
        end = max((fault.ends_at for fault in faults), default=0.0) + QUIET_S
        while end - _true_now() > _EPSILON_S and not self.violations:  # noqa: ASYNC110
            await asyncio.sleep(min(0.5, end - _true_now()))
        self.check_schedules()
        live = {node.instance: node for node in self.nodes if node.alive and node.instance}
        for instance, helper in helpers_missing(list(live)):
            self.violate("loop_died", f"{live[instance].name}: its {helper} task is not running")
        for entry in self.runs:
            if entry.end is None:
                self.check_overlaps(entry)
        if not self.violations:
            self.check_liveness(_true_now())

    async def shutdown(self) -> None:
        for node in self.nodes:
            node.crash()
        current = asyncio.current_task()
        for _ in range(10):
            pending = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
            if not pending:
                return
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=1.0)


@contextlib.contextmanager
def _quiet_library() -> Iterator[None]:
    # The library logs every lost term and failed round; thousands of schedules' worth of
    # log records would cost more than the simulation itself.
    logger = logging.getLogger("fastapi_singletonjob")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _seeded_random(seed: int) -> Iterator[None]:
    # The library draws its jitter from the global generator: seed it for the schedule, and
    # leave it as it was (Hypothesis and pytest-randomly manage it around each test). The
    # nonce of each node's owner id (``secrets``, unseedable) orders the membership's
    # placement entries: drawn from the seeded generator too, so that a schedule replays.
    state = random.getstate()
    random.seed(seed)
    token_hex = secrets.token_hex
    secrets.token_hex = lambda nbytes=None: random.randbytes(nbytes or 32).hex()
    try:
        yield
    finally:
        secrets.token_hex = token_hex
        random.setstate(state)


_PLAYING: contextvars.ContextVar[Simulation] = contextvars.ContextVar("playing")


def play(scenario: Scenario, excuse: frozenset[str] = KNOWN_BUGS) -> Simulation:
    """Play ``scenario`` on a fresh virtual-time loop; return the finished simulation.
    ``excuse``: the known bugs whose violations do not count (``Simulation.excused``)."""
    sim = Simulation(scenario, excuse)
    playing = _PLAYING.set(sim)
    loop = VirtualLoop()
    unhandled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: unhandled.append(context))

    async def main() -> None:
        try:
            await sim.run()
        finally:
            await sim.shutdown()

    with _quiet_library(), _seeded_random(scenario.seed), loop.current():
        try:
            loop.run_until_complete(main())
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            _PLAYING.reset(playing)
    for context in unhandled:
        exc = context.get("exception")
        if not isinstance(exc, asyncio.CancelledError):
            sim.violations.append(
                Violation(math.inf, "loop_died", f"{context.get('message')}: {exc!r}")
            )
    return sim


def run_scenario(scenario: Scenario) -> list[Violation]:
    """Play ``scenario``; return the violations of the invariants, earliest first."""
    return sorted(play(scenario).violations, key=lambda v: v.at_s)


@dataclass
class Report:
    scenario: Scenario
    violations: list[Violation] = field(default_factory=list)

    def __str__(self) -> str:
        head = "\n".join(str(v) for v in self.violations[:5])
        return f"invariant violated:\n{head}\nschedule:\n{self.scenario.describe()}"
