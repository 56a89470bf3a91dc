"""A single Redis server as the store's topology: the primary named by a ``redis://`` URL,
by a user's client, or by Sentinel (``_store.redis.sentinel``).

The calls go through two blocking pools (``connect.ELECTION_CONNECTIONS`` for the election,
the store's size for the rest), which make a call wait for a free connection rather than
fail when all are busy; each release subscription has one connection of its own.
"""

from __future__ import annotations

import logging
from typing import Any

from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
from redis.exceptions import AskError, ClusterCrossSlotError, RedisError, ResponseError

from ..._config.redact import redact_url
from ..._errors import StoreMismatch, StoreReadOnly
from .connect import (
    ELECTION_CONNECTIONS,
    POOL_WAIT_S,
    checked_pool_size,
    no_maint_notifications,
    options_from_client,
    options_from_url,
)
from .topology import warn_eviction

__all__ = ["CLIENT_SHOWN", "SingleServer"]

logger = logging.getLogger("fastapi_singletonjob.store")

CLIENT_SHOWN = "<client passed in>"
"""How logs and errors name the store when the user passed a client."""

_CLUSTER_REPLIES: tuple[type[Exception], ...] = (AskError, ClusterCrossSlotError)
"""Replies only a Redis Cluster node gives: this server is one (see ``_store.redis.cluster``)."""


class SingleServer:
    """The ``Topology`` of one Redis server: pools of its own, plain pub/sub.

    :param url: a ``redis://`` or ``rediss://`` URL; or
    :param client: a ``redis.asyncio.Redis`` whose connection settings the pools copy (it is
        never used for calls, nor closed).
    :param shown: how logs and errors name the store, when not by ``url`` (Sentinel: its URL).
    :param fix: what to do when the server refuses writes, when not the default for ``url``
        or ``client``.
    """

    sharded = False

    def __init__(
        self,
        *,
        url: str | None,
        client: Redis | None,
        connect_timeout_s: float,
        max_connections: int | None,
        shown: str | None = None,
        fix: str | None = None,
    ) -> None:
        size = checked_pool_size(url, client, max_connections)
        self.connect_timeout_s = connect_timeout_s
        self.shown = shown or (CLIENT_SHOWN if url is None else redact_url(url))
        if client is not None:
            self._fix = "pass redis= a client of the primary (with Sentinel: master_for())"
            self._connection_class, self._options = options_from_client(client)
        else:
            assert url is not None
            self._fix = "point redis_url at the primary"
            self._connection_class, self._options = options_from_url(url, connect_timeout_s)
        if fix is not None:
            self._fix = fix
        # The election has connections of its own: a renewal never waits behind a burst of
        # claims (40 cron jobs on one instant), or its lease could lapse while it queues.
        self.election = Redis(
            connection_pool=self._pool(
                BlockingConnectionPool, ELECTION_CONNECTIONS, timeout=POOL_WAIT_S
            )
        )
        self.calls = Redis(
            connection_pool=self._pool(BlockingConnectionPool, size, timeout=POOL_WAIT_S)
        )

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

    @property
    def max_connections(self) -> int:
        """See ``Topology.max_connections``."""
        return int(self.calls.connection_pool.max_connections)

    def mismatch(self, exc: Exception) -> Exception | None:
        """See ``Topology.mismatch``: a reply only a cluster node gives."""
        if isinstance(exc, _CLUSTER_REPLIES):
            return self._cluster_node(type(exc).__name__)
        return None

    def _cluster_node(self, reply: str) -> StoreMismatch:
        return StoreMismatch(
            f"the Redis server at {self.shown} is a Redis Cluster node (it answered "
            f"{reply}): use redis+cluster://host:port,host:port/ or pass redis= a "
            "redis.asyncio.RedisCluster"
        )

    async def read_only(self, what: str) -> StoreReadOnly:
        """See ``Topology.read_only``."""
        return await self.refused(f"the Redis server at {self.shown} is {what}: {self._fix}")

    async def refused(self, message: str) -> StoreReadOnly:
        """See ``Topology.refused``: the pools' idle connections are dropped first, since a
        Sentinel-managed connection looks up the primary again when it reconnects, so the
        next round reaches the new primary."""
        try:
            for client in (self.election, self.calls):
                await client.connection_pool.disconnect(inuse_connections=False)
        except Exception as exc:  # dropping is best effort; the error below is what matters
            logger.debug("could not drop the connections to %s: %r", self.shown, exc)
        return StoreReadOnly(message)

    async def check_server(self) -> bool:
        """See ``Topology.check_server``: refuse a replica and a cluster node.

        A replica whose locks are all held by nodes on the primary writes nothing, so only
        its role gives it away; a replica with ``replica-read-only no`` would even take the
        writes and lead alone. ``INFO`` may be forbidden by an ACL: then writes on a replica
        are still refused with ``READONLY`` (see ``RedisStore.elect``), and the policy goes
        unchecked.
        """
        try:
            info = await self.election.info()
        except ResponseError as exc:  # forbidden by an ACL, say: both checks are advisory
            logger.debug("could not read INFO of %s: %r", self.shown, exc)
            return True
        except RedisError as exc:  # the connection failed right after the call: next round
            logger.debug("could not read INFO of %s: %r", self.shown, exc)
            return False
        if str(info.get("role", "master")) in ("slave", "replica"):
            raise await self.read_only("a replica")
        if int(info.get("cluster_enabled", 0) or 0):
            raise self._cluster_node("cluster_enabled:1 in INFO")
        warn_eviction(info, self.shown)
        return True

    async def ping(self) -> None:
        """See ``Topology.ping``."""
        await self.election.ping()

    async def subscriber(self) -> Redis:
        """See ``Topology.subscriber``: a pool of one connection, with the store's options."""
        return Redis(connection_pool=self._pool(ConnectionPool, 1))

    def call_failed(self, exc: BaseException) -> None:
        """See ``Topology.call_failed``: nothing to do, as every call goes to the one server
        (a Sentinel-managed connection looks the primary up again when it reconnects)."""

    def subscription_ended(self, exc: BaseException) -> None:
        """See ``Topology.subscription_ended``: the next one connects to the same server."""

    async def aclose(self) -> None:
        """See ``Topology.aclose``: both pools (the user's client, if any, stays open)."""
        try:
            await self.calls.aclose(close_connection_pool=True)
        finally:
            await self.election.aclose(close_connection_pool=True)
