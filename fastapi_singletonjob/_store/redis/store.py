"""The Redis lease store.

The store talks to Redis through connections of its own, with redis-py's automatic retries
turned off: a retry hidden inside one call could outlast the lease it is renewing. The elector
bounds every call with a timeout and does its own backoff.

Connections: one shared pool for the calls (elect, release, claims, pings), which makes a call
wait for a free connection rather than fail when all are busy (claims of many cron jobs on one
instant come all at once), and one dedicated connection per release subscription, which holds
its connection for good and must not take one from the calls. Only clients and pools this
module created are closed; a client passed in by the user is never closed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
from redis.asyncio.client import PubSub
from redis.exceptions import (
    AskError,
    ClusterCrossSlotError,
    ReadOnlyError,
    RedisError,
    ResponseError,
)

from ..._config.redact import redact_url
from ..._errors import StoreMismatch, StoreReadOnly
from ..._lock_value import is_lock_value
from .. import keys as _keys
from ..base import DEFAULT_MAX_AHEAD_US, LeaseReply, LeaseRequest
from ..checkpoints import RedisCheckpoints
from ..controls import RedisControls
from . import scripts as _scripts
from .batch import Batcher
from .claims import RedisClaims
from .connect import (
    DEFAULT_MAX_CONNECTIONS,
    checked_pool_size,
    no_maint_notifications,
    options_from_client,
    options_from_url,
)
from .subscription import RedisReleases

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "ELECTION_CONNECTIONS",
    "POOL_WAIT_S",
    "RedisLeaseStore",
]

logger = logging.getLogger(__name__)


ELECTION_CONNECTIONS = 2
"""Connections of the election's own pool: a round, and a release at the same time (a job that
retires while a round is in flight)."""

POOL_WAIT_S = 10.0
"""How long a call waits for a free connection of the shared pool before it fails. A backstop
only: the elector and the runner bound every call with a shorter timeout of their own."""

_READ_ONLY_PREFIX = "READONLY"


def _text(value: bytes | str | None) -> str | None:
    # A lock value is anybody's to write: bytes that are not UTF-8 must not fail the reply
    # of every job in the call, so they become U+FFFD (and such a value is foreign anyway).
    return value.decode(errors="replace") if isinstance(value, bytes) else value


class RedisLeaseStore(RedisClaims, RedisCheckpoints, RedisControls, RedisReleases):
    """Leases kept in Redis keys (see ``_store.keys``), changed only by the scripts in
    ``_store.redis.scripts``.

    :param max_connections: size of the claims' pool (default ``DEFAULT_MAX_CONNECTIONS``);
        callers size it from the work, e.g. two plus the number of jobs that claim instants,
        capped. The election (renewals, releases) has ``ELECTION_CONNECTIONS`` of its own, and
        each release subscription one more.
    """

    def __init__(
        self,
        project: str,
        *,
        url: str | None = None,
        client: Redis | None = None,
        connect_timeout_s: float = 5.0,
        max_connections: int | None = None,
    ) -> None:
        size = self._init_shared(project, url, client, connect_timeout_s, max_connections)
        if client is not None:
            self._fix = "pass redis= a client of the primary (with Sentinel: master_for())"
            self._connection_class, self._options = options_from_client(client)
        else:
            assert url is not None
            self._fix = "point redis_url at the primary"
            self._connection_class, self._options = options_from_url(url, connect_timeout_s)
        # The election has connections of its own: a renewal never waits behind a burst of
        # claims (40 cron jobs on one instant), or its lease could lapse while it queues.
        self._redis = Redis(
            connection_pool=self._pool(
                BlockingConnectionPool, ELECTION_CONNECTIONS, timeout=POOL_WAIT_S
            )
        )
        self._claims = Redis(
            connection_pool=self._pool(BlockingConnectionPool, size, timeout=POOL_WAIT_S)
        )
        self._elect = self._redis.register_script(_scripts.ELECT)
        self._release = self._redis.register_script(_scripts.RELEASE)
        self._claim = self._claims.register_script(_scripts.CLAIM)

    def _init_shared(
        self,
        project: str,
        url: str | None,
        client: object,
        connect_timeout_s: float,
        max_connections: int | None,
    ) -> int:
        """The start of ``__init__``, shared with ``ClusterLeaseStore`` (whose ``__init__``
        does not call this class's): the arguments checked, and what does not depend on the
        topology. Returns the size of the claims' pool."""
        size = checked_pool_size(url, client, max_connections)
        self._project = project
        self._connect_timeout_s = connect_timeout_s
        self._shown = self._CLIENT_SHOWN if url is None else redact_url(url)
        self._checked_server = False
        self._channel = _keys.release_channel(project)
        self._claim_batcher = Batcher(self._claim_all)
        self._record_batcher = Batcher(self._record_runs)
        return size

    _CLIENT_SHOWN = "<client passed in>"
    """How logs and errors name the store when the user passed a client."""

    _CLUSTER_REPLIES: tuple[type[Exception], ...] = (AskError, ClusterCrossSlotError)
    """Replies only a Redis Cluster node gives: this server is one (see ``cluster``)."""

    @property
    def max_connections(self) -> int:
        """Size of the claims' pool."""
        return int(self._claims.connection_pool.max_connections)

    def _pool(
        self, pool_class: type[ConnectionPool], max_connections: int, **extra: Any
    ) -> ConnectionPool:
        return pool_class(
            connection_class=self._connection_class,
            max_connections=max_connections,
            **self._options,
            **no_maint_notifications(),
            **extra,
        )

    async def elect(self, node_id: str, requests: Sequence[LeaseRequest]) -> list[LeaseReply]:
        """See ``Store.elect``: one ``EVALSHA`` for all jobs."""
        member, project = self.membership, self._project
        keys = [
            _keys.project_key(project, name)
            for name in ("nodes", "nodes:expiry", "controls", "nodes:placement")
        ]
        echo = self._echo_wanted
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
            raw: list[Any] = await self._elect(keys=keys, args=args)
        except ReadOnlyError as exc:  # a renewal's PEXPIRE, refused by a replica
            raise await self._read_only("a read-only replica") from exc
        except self._CLUSTER_REPLIES as exc:
            raise self._cluster_node(type(exc).__name__) from None
        except ResponseError as exc:  # min-replicas-to-write: a primary cut off from replicas
            if not str(exc).startswith("NOREPLICAS"):
                raise
            raise await self._refused(
                f"the Redis server at {self._shown} refuses writes: fewer of its replicas "
                "answer than its min-replicas-to-write asks (NOREPLICAS; cut off from them, it "
                "may no longer be the primary), so this node's leases end at their deadlines"
            ) from exc
        if echo:
            self._echo_wanted, self._echo_sent_at = False, asyncio.get_running_loop().time()
        if member is not None:
            member.confirmed(int(raw[0]) == 1)
            server_ms, epoch, *flat = raw[4 * len(requests) + 1 :]
            member.placed(int(server_ms), _text(epoch) or "", [_text(x) or "" for x in flat])
        replies = []
        for i, request in enumerate(requests):
            status, value, ttl_ms, flags = raw[4 * i + 1 : 4 * i + 5]
            if int(status) < 0:  # the free lock could not be written: value is the error
                error = _text(value)
                if error is not None and error.startswith(_READ_ONLY_PREFIX):
                    raise await self._read_only("a read-only replica")
                replies.append(LeaseReply(request.job, False, None, None, error))
                continue
            ttl_s = None if int(ttl_ms) < 0 else int(ttl_ms) / 1000
            replies.append(
                LeaseReply(
                    request.job,
                    int(status) == 1,
                    _text(value),
                    ttl_s,
                    paused=bool(int(flags) & 1),
                    triggered=bool(int(flags) & 2),
                    step_down=bool(int(flags) & 4),
                )
            )
        if not self._checked_server:
            await self._check_server()
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
            raise await self._read_only("a read-only replica") from exc
        return int(released)

    async def _subscriber(self) -> Redis:
        """A client of one connection, for a release subscription."""
        return Redis(connection_pool=self._pool(ConnectionPool, 1))

    def _subscribe(self, pubsub: PubSub) -> Awaitable[object]:
        return pubsub.subscribe(self._channel)

    def _cluster_node(self, reply: str) -> StoreMismatch:
        return StoreMismatch(
            f"the Redis server at {self._shown} is a Redis Cluster node (it answered "
            f"{reply}): use redis+cluster://host:port,host:port/ or pass redis= a "
            "redis.asyncio.RedisCluster"
        )

    async def _read_only(self, what: str) -> StoreReadOnly:
        """The error for a server that will not take the election's writes."""
        return await self._refused(f"the Redis server at {self._shown} is {what}: {self._fix}")

    async def _refused(self, message: str) -> StoreReadOnly:
        """``StoreReadOnly(message)``, once the pool's idle connections are dropped: a
        Sentinel-managed connection looks up the primary again when it reconnects, so the
        next round reaches the new primary."""
        try:
            for client in (self._redis, self._claims):
                await client.connection_pool.disconnect(inuse_connections=False)
        except Exception as exc:  # dropping is best effort; the error below is what matters
            logger.debug("could not drop the connections to %s: %r", self._shown, exc)
        return StoreReadOnly(message)

    async def _check_server(self) -> None:
        """Once, after the first election call that answered: refuse a replica, and warn
        about an eviction policy that may evict locks.

        A replica whose locks are all held by nodes on the primary writes nothing, so only
        its role gives it away; a replica with ``replica-read-only no`` would even take the
        writes and lead alone. ``INFO`` may be forbidden by an ACL: then writes on a replica
        are still refused with ``READONLY`` (see ``elect``), and the policy goes unchecked.
        """
        try:
            info = await self._redis.info()
        except ResponseError as exc:  # forbidden by an ACL, say: both checks are advisory
            self._checked_server = True
            logger.debug("could not read INFO of %s: %r", self._shown, exc)
            return
        except RedisError as exc:  # the connection failed right after the call: next round
            logger.debug("could not read INFO of %s: %r", self._shown, exc)
            return
        if str(info.get("role", "master")) in ("slave", "replica"):
            raise await self._read_only("a replica")
        if int(info.get("cluster_enabled", 0) or 0):
            raise self._cluster_node("cluster_enabled:1 in INFO")
        self._checked_server = True
        self._warn_eviction(info)

    def _warn_eviction(self, info: Mapping[str, Any]) -> None:
        """Warn about an eviction policy that may evict locks."""
        policy = str(info.get("maxmemory_policy", "noeviction"))
        if int(info.get("maxmemory", 0) or 0) > 0 and policy != "noeviction":
            logger.warning(
                "Redis at %s has maxmemory set with maxmemory-policy %s: when it is full it "
                "may evict lock keys, and then two nodes can run a job at once; use "
                "maxmemory-policy noeviction (or a Redis dedicated to locks without maxmemory)",
                self._shown,
                policy,
            )

    async def ping(self) -> None:
        """See ``Store.ping``."""
        await self._redis.ping()

    async def aclose(self) -> None:
        """Close this store's own pool; a user's client stays open."""
        try:
            await self._record_batcher.aclose()
            await self._claim_batcher.aclose()
            await self._claims.aclose(close_connection_pool=True)
        finally:
            await self._redis.aclose(close_connection_pool=True)

    def __repr__(self) -> str:
        return f"RedisLeaseStore(project={self._project!r}, url={self._shown!r})"
