"""What differs between the Redis topologies the store runs on, as one interface.

A single server (reached directly or through Sentinel, ``_store.redis.server``) and a Redis
Cluster (``_store.redis.cluster``) take the same scripts, keys and replies; they differ in
which clients and pools carry the calls, whether notices go by plain or sharded pub/sub
(``PUBLISH``/``SUBSCRIBE`` or ``SPUBLISH``/``SSUBSCRIBE``: the script variants and the
subscription's command), where the release subscription connects, how the server is checked
and pinged, which errors say the server is of the other kind, and what the fix is when it
refuses writes. ``RedisStore`` (``_store.redis.store``) does the rest for both.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

from redis.asyncio import Redis, RedisCluster

from ..._errors import StoreReadOnly

__all__ = ["Client", "Topology", "server_time", "warn_eviction"]

logger = logging.getLogger("fastapi_singletonjob.store")

Client = Redis | RedisCluster
"""A client the store's calls go through: a single server's or a cluster's. Both take every
command, script and pipeline the store sends (mypy checks each call against both), and a
cluster client sends each to the master of the project's hash slot."""


class Topology(Protocol):
    """The clients of one store and what depends on the topology behind them; what the store
    and its helpers read of it is read-only."""

    @property
    def shown(self) -> str:
        """The store as logs and errors name it: its URL without secrets, or that a client
        was passed in."""
        ...

    @property
    def sharded(self) -> bool:
        """Notices go by sharded pub/sub (a cluster): the ``_SHARDED`` scripts publish them,
        and the release subscription uses ``SSUBSCRIBE``."""
        ...

    @property
    def connect_timeout_s(self) -> float:
        """How long connecting (with its handshake) may take."""
        ...

    @property
    def election(self) -> Client:
        """The election's client (elect, release, leave, server checks, pings): connections
        of its own, so that a renewal never waits behind a burst of claims."""
        ...

    @property
    def calls(self) -> Client:
        """The client of the other calls: claims, checkpoints, operators' controls and
        reads."""
        ...

    @property
    def max_connections(self) -> int:
        """Size of the calls' pool (per node on a cluster)."""
        ...

    def mismatch(self, exc: Exception) -> Exception | None:
        """The error to raise (from None) instead of ``exc``, an election call's failure, when
        ``exc`` shows that the server is of another kind (or may not say which); else None."""
        ...

    async def read_only(self, what: str) -> StoreReadOnly:
        """The error for a server that will not take the election's writes (``what`` it is,
        such as "a replica"), with the fix."""
        ...

    async def refused(self, message: str) -> StoreReadOnly:
        """``StoreReadOnly(message)``, once whatever lets the next round reach the new
        primary is done."""
        ...

    async def check_server(self) -> bool:
        """Check, after the first election call that answered, that the server is what the
        store needs, and warn about an eviction policy that may evict locks; raise when it
        is not. True once checked (also when it cannot be, as an ACL forbids ``INFO``), False
        when the check failed on the connection and is to be tried again."""
        ...

    async def ping(self) -> None:
        """Raise unless the server that holds the project's keys answers."""
        ...

    async def subscriber(self) -> Redis:
        """A client of one connection, for one release subscription, to the server that
        carries the project's notices."""
        ...

    def call_failed(self, exc: BaseException) -> None:
        """A call of the store failed with ``exc`` (or passed its deadline: a
        ``TimeoutError``): where the next calls go may have changed (a cluster re-reads
        its slot map after a connection error or a timeout). Returns at once; never
        raises."""
        ...

    def subscription_ended(self, exc: BaseException) -> None:
        """A release subscription ended with ``exc``: where the next one connects may
        change (a cluster follows a ``MOVED`` reply)."""
        ...

    async def aclose(self) -> None:
        """Close the clients this topology created (never a client the user passed in)."""
        ...


def warn_eviction(info: Mapping[str, Any], shown: str) -> None:
    """Warn about an eviction policy that may evict locks (``info``: the server's ``INFO``)."""
    policy = str(info.get("maxmemory_policy", "noeviction"))
    if int(info.get("maxmemory", 0) or 0) > 0 and policy != "noeviction":
        logger.warning(
            "Redis at %s has maxmemory set with maxmemory-policy %s: when it is full it "
            "may evict lock keys, and then two nodes can run a job at once; use "
            "maxmemory-policy noeviction (or a Redis dedicated to locks without maxmemory)",
            shown,
            policy,
        )


async def server_time(client: Client, key: str) -> tuple[int, int]:
    """``TIME`` (seconds, microseconds) of the server that holds ``key``: on a cluster, its
    slot's master (a cluster client refuses ``TIME`` inside a pipeline, and asks every node
    for it unless told which)."""
    if isinstance(client, RedisCluster):
        reply: Any = await client.time(target_nodes=client.get_node_from_key(key))
        if isinstance(reply, dict):  # a reply per node, from the one node asked
            (reply,) = reply.values()
    else:
        reply = await client.time()
    seconds, micros = reply
    return int(seconds), int(micros)
