"""The Redis lease store: ``RedisStore``, one class for every topology, and ``RedisLeaseStore``,
the store on a single server.

The store talks to Redis through connections of its own, with redis-py's automatic retries
turned off: a retry hidden inside one call could outlast the lease it is renewing. The elector
bounds every call with a timeout and does its own backoff.

``RedisStore`` encodes and decodes the election's ``ELECT`` and ``RELEASE`` calls itself, and
hands the rest to helpers it builds: claims (``RedisClaims``), checkpoints
(``RedisCheckpoints``), the operators' calls (``RedisControls``) and the release subscription
(``ReleaseSubscription``). What depends on the topology (single server, Sentinel, Redis
Cluster: clients and pools, pub/sub, server checks, error classification) is its
``Topology``. Only clients and pools the store created are closed; a client passed in by the
user is never closed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ReadOnlyError, ResponseError

from ..._checkpoint import (
    DEFAULT_CHECKPOINT_TIMEOUT_S,
    Checkpoint,
    FinishedRun,
    Recorded,
    StateSave,
)
from ..._clock import SYSTEM_CLOCK, Clock
from ..._history import Occurrence
from ..._lock_value import is_lock_value
from .. import keys as _keys
from ..base import (
    DEFAULT_CLAIM_TIMEOUT_S,
    DEFAULT_CONTROL_TIMEOUT_S,
    DEFAULT_KEEPALIVE_S,
    DEFAULT_MAX_AHEAD_US,
    ClaimResult,
    ClusterData,
    LeaseReply,
    LeaseRequest,
    OverdueCheck,
    OverdueReply,
    ReleaseListener,
)
from ..membership import MemberRecord, Membership
from . import scripts as _scripts
from .checkpoints import RedisCheckpoints
from .claims import RedisClaims
from .connect import DEFAULT_MAX_CONNECTIONS, ELECTION_CONNECTIONS, POOL_WAIT_S, drop_idle
from .controls import RedisControls
from .overdue import RedisOverdue
from .server import SingleServer
from .subscription import ReleaseSubscription
from .topology import Topology

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "ELECTION_CONNECTIONS",
    "POOL_WAIT_S",
    "RedisLeaseStore",
    "RedisStore",
]

_READ_ONLY_PREFIX = "READONLY"


def _text(value: bytes | str | None) -> str | None:
    # A lock value is anybody's to write: bytes that are not UTF-8 must not fail the reply
    # of every job in the call, so they become U+FFFD (and such a value is foreign anyway).
    return value.decode(errors="replace") if isinstance(value, bytes) else value


class RedisStore:
    """Leases kept in Redis keys (see ``_store.keys``), changed only by the scripts in
    ``_store.redis.scripts``, on any topology; build one of ``RedisLeaseStore``,
    ``ClusterLeaseStore`` or ``SentinelLeaseStore``.

    :param topology: the clients, and what depends on the topology behind them.
    :param clock: whose ``monotonic()`` the store's deadlines are on (coalesced calls, the
        release subscription's keepalive).
    """

    def __init__(self, project: str, topology: Topology, *, clock: Clock) -> None:
        self._project = project
        self._topology = topology
        self._channel = _keys.release_channel(project)
        self._checked_server = False
        self.membership: Membership | None = None
        election = topology.election
        self._elect = election.register_script(
            _scripts.ELECT_SHARDED if topology.sharded else _scripts.ELECT
        )
        self._release = election.register_script(
            _scripts.RELEASE_SHARDED if topology.sharded else _scripts.RELEASE
        )
        self._claims = RedisClaims(topology, project, clock=clock)
        self._checkpoints = RedisCheckpoints(topology, project, self._channel, clock=clock)
        self._controls = RedisControls(topology, project, self._channel)
        self._overdue = RedisOverdue(topology, project)
        self._subscription = ReleaseSubscription(topology, self._channel, clock=clock)

    @property
    def max_connections(self) -> int:
        """Size of the claims' pool (per node on a cluster). The election (renewals,
        releases) has ``ELECTION_CONNECTIONS`` of its own, and each release subscription
        one more."""
        return self._topology.max_connections

    # Leases

    async def _elect_call(self, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self._elect(keys=keys, args=args)
        except asyncio.CancelledError:
            # Past the election's deadline (its caller's bound): redis-py drops this call's
            # connection; the idle ones of both pools go too, as likely dead (a silent
            # flow), so that neither the next round nor the next claim or checkpoint read
            # waits out its deadline on one again; and on a cluster the slot map is read
            # again (a frozen master's replica may have taken over).
            self._topology.call_failed(TimeoutError("the election's call passed its deadline"))
            await drop_idle(self._topology.election)
            await drop_idle(self._topology.calls)
            raise
        except Exception as exc:
            self._topology.call_failed(exc)  # a cluster re-reads its slot map
            raise

    async def elect(self, node_id: str, requests: Sequence[LeaseRequest]) -> list[LeaseReply]:
        """See ``Store.elect``: one ``EVALSHA`` for all jobs."""
        member, project, topology = self.membership, self._project, self._topology
        keys = [
            _keys.project_key(project, name)
            for name in ("nodes", "nodes:expiry", "controls", "nodes:placement")
        ]
        echo = self._subscription.echo_wanted
        args: list[str | int] = [node_id, "", "", "", "", self._channel if echo else ""]
        if member is not None and not member.left:
            args[1:5] = [member.payload(), member.ttl_ms, member.epoch, member.digest]
        for request in requests:
            keys += (
                _keys.job_key(project, request.job, kind)
                for kind in ("lock", "fence", "checkpoint")
            )
            # Only a value of the form this library writes can be the caller's own.
            held = request.held if is_lock_value(request.held) else None
            retention = request.retention_s
            args += (
                max(1, round(request.ttl_s * 1000)) if request.take else 0,
                held or "",
                "" if retention is None else max(1, round(retention * 1000)),
                request.job,
            )
        try:
            raw: list[Any] = await self._elect_call(keys, args)
        except ReadOnlyError as exc:  # a renewal's PEXPIRE, refused by a replica
            raise await topology.read_only("a read-only replica") from exc
        except Exception as exc:
            mismatch = topology.mismatch(exc)
            if mismatch is not None:
                raise mismatch from None
            # min-replicas-to-write: a primary cut off from its replicas
            if not (isinstance(exc, ResponseError) and str(exc).startswith("NOREPLICAS")):
                raise
            raise await topology.refused(
                f"the Redis server at {topology.shown} refuses writes: fewer of its replicas "
                "answer than its min-replicas-to-write asks (NOREPLICAS; cut off from them, it "
                "may no longer be the primary), so this node's leases end at their deadlines"
            ) from exc
        if echo:
            self._subscription.echo_sent()
        if member is not None:
            member.confirmed(int(raw[0]) == 1)
            server_ms, epoch, *flat = raw[len(requests) + 1 :]
            member.placed(int(server_ms), _text(epoch) or "", [_text(x) or "" for x in flat])
        replies = []
        for request, answer in zip(requests, raw[1 : len(requests) + 1], strict=True):
            # "<status> <ttl ms> <controls>[ <value>]": the value last, whole (ELECT)
            status, ttl_ms, flags, *rest = answer.split(b" ", 3)
            value = _text(rest[0]) if rest else None
            if status[0] == 45:  # b"-": the free lock could not be written: value is the error
                if value is not None and value.startswith(_READ_ONLY_PREFIX):
                    raise await topology.read_only("a read-only replica")
                replies.append(LeaseReply(request.job, False, None, None, value))
                continue
            controls = int(flags)
            replies.append(
                LeaseReply(
                    request.job,
                    status == b"1",
                    value,
                    None if ttl_ms[0] == 45 else int(ttl_ms) / 1000,
                    paused=bool(controls & 1),
                    triggered=bool(controls & 2),
                    step_down=bool(controls & 4),
                    checkpoint_reset=bool(controls & 8),
                )
            )
        if not self._checked_server:
            self._checked_server = await topology.check_server()
        return replies

    async def release(
        self, node_id: str, values: dict[str, str], last_us: Mapping[str, int] | None = None
    ) -> int:
        """See ``Store.release``: one script call, which also publishes the notice."""
        values = {job: value for job, value in values.items() if is_lock_value(value)}
        if not values:
            return 0
        last_us = last_us or {}
        keys: list[str] = []
        args: list[str | int] = [self._channel, DEFAULT_MAX_AHEAD_US]
        for job, value in values.items():
            keys += (_keys.job_key(self._project, job, kind) for kind in ("lock", "last"))
            args += (value, last_us.get(job, ""))
        try:
            released: int = await self._release(keys=keys, args=args)
        except ReadOnlyError as exc:
            raise await self._topology.read_only("a read-only replica") from exc
        except Exception as exc:
            self._topology.call_failed(exc)  # a cluster re-reads its slot map
            raise
        return int(released)

    async def claim(
        self,
        job: str,
        value: str,
        instant_us: int,
        *,
        max_ahead_us: int = DEFAULT_MAX_AHEAD_US,
        timeout_s: float = DEFAULT_CLAIM_TIMEOUT_S,
    ) -> ClaimResult:
        """See ``Store.claim`` and ``RedisClaims.claim``."""
        return await self._claims.claim(
            job, value, instant_us, max_ahead_us=max_ahead_us, timeout_s=timeout_s
        )

    async def listen_releases(
        self, on_release: ReleaseListener, *, keepalive_s: float = DEFAULT_KEEPALIVE_S
    ) -> None:
        """See ``Store.listen_releases`` and ``ReleaseSubscription.listen``."""
        await self._subscription.listen(on_release, keepalive_s=keepalive_s)

    async def ping(self) -> None:
        """See ``Store.ping``."""
        try:
            await self._topology.ping()
        except Exception as exc:
            self._topology.call_failed(exc)  # a cluster re-reads its slot map
            raise

    async def aclose(self) -> None:
        """Close this store's own clients and pools; a user's client stays open."""
        try:
            await self._checkpoints.aclose()
            await self._claims.aclose()
        finally:
            await self._topology.aclose()

    # Checkpoints

    async def record_runs(
        self, runs: Sequence[FinishedRun], *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> Recorded:
        """See ``Store.record_runs`` and ``RedisCheckpoints.record_runs``."""
        return await self._checkpoints.record_runs(runs, timeout_s=timeout_s)

    async def check_overdue(
        self,
        checks: Sequence[OverdueCheck],
        *,
        retention_s: float,
        timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S,
    ) -> OverdueReply:
        """See ``Store.check_overdue``."""
        return await self._overdue.check_overdue(
            checks, retention_s=retention_s, timeout_s=timeout_s
        )

    async def read_history(
        self, job: str, *, limit: int, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> list[Occurrence]:
        """See ``Store.read_history`` and ``RedisCheckpoints.read_history``."""
        return await self._checkpoints.read_history(job, limit=limit, timeout_s=timeout_s)

    async def save_state(
        self, save: StateSave, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> bool:
        """See ``Store.save_state`` and ``RedisCheckpoints.save_state``."""
        return await self._checkpoints.save_state(save, timeout_s=timeout_s)

    async def read_checkpoint(
        self, job: str, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> Checkpoint | None:
        """See ``Store.read_checkpoint`` and ``RedisCheckpoints.read_checkpoint``."""
        return await self._checkpoints.read_checkpoint(job, timeout_s=timeout_s)

    async def load_checkpoint(
        self, job: str, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> tuple[Checkpoint | None, datetime, str | None]:
        """See ``Store.load_checkpoint`` and ``RedisCheckpoints.load_checkpoint``."""
        return await self._checkpoints.load_checkpoint(job, timeout_s=timeout_s)

    async def reset_checkpoint(
        self, job: str, *, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S
    ) -> bool:
        """See ``Store.reset_checkpoint`` and ``RedisCheckpoints.reset_checkpoint``."""
        return await self._checkpoints.reset_checkpoint(job, timeout_s=timeout_s)

    # Membership and the operators' calls

    def announce(self, membership: Membership) -> None:
        """See ``Store.announce``."""
        self.membership = membership

    async def leave(self) -> None:
        """See ``Store.leave`` and ``RedisControls.leave``."""
        if self.membership is not None:
            await self._controls.leave(self.membership)

    async def set_control(
        self, field: str, value: str | None, *, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S
    ) -> bool:
        """See ``Store.set_control`` and ``RedisControls.set_control``."""
        return await self._controls.set_control(field, value, timeout_s=timeout_s)

    async def read_cluster(
        self, jobs: Iterable[str] = (), *, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S
    ) -> ClusterData:
        """See ``Store.read_cluster`` and ``RedisControls.read_cluster``."""
        return await self._controls.read_cluster(jobs, timeout_s=timeout_s)

    async def read_members(
        self, owners: Sequence[str], *, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S
    ) -> dict[str, MemberRecord]:
        """See ``Store.read_members`` and ``RedisControls.read_members``."""
        return await self._controls.read_members(owners, timeout_s=timeout_s)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(project={self._project!r}, url={self._topology.shown!r})"


class RedisLeaseStore(RedisStore):
    """The Redis store on a single server (the primary).

    :param url: a ``redis://`` or ``rediss://`` URL; or
    :param client: a ``redis.asyncio.Redis`` whose connection settings the store copies into
        pools of its own (it never closes this one).
    :param max_connections: size of the claims' pool (default ``DEFAULT_MAX_CONNECTIONS``);
        callers size it from the work, e.g. two plus the number of jobs that claim instants,
        capped. The election (renewals, releases) has ``ELECTION_CONNECTIONS`` of its own, and
        each release subscription one more.
    :param clock: see ``RedisStore``.
    """

    def __init__(
        self,
        project: str,
        *,
        url: str | None = None,
        client: Redis | None = None,
        connect_timeout_s: float = 5.0,
        max_connections: int | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        topology = SingleServer(
            url=url,
            client=client,
            connect_timeout_s=connect_timeout_s,
            max_connections=max_connections,
        )
        super().__init__(project, topology, clock=clock)
