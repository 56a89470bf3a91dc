"""Connections of the Redis stores: the pool sizes, the options they take from a URL or a
user's client, and what they force whatever either says (no client-side retries, raw bytes,
no maintenance notifications)."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from redis.asyncio import ConnectionPool, Redis, RedisCluster
from redis.asyncio.connection import AbstractConnection, Connection, parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from ..._aio import within
from .topology import Topology

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "ELECTION_CONNECTIONS",
    "POOL_WAIT_S",
    "bounded",
    "checked_pool_size",
    "drop_idle",
    "forced_options",
    "no_maint_notifications",
    "no_retry",
    "options_from_client",
    "options_from_url",
]

logger = logging.getLogger("fastapi_singletonjob.store")

T = TypeVar("T")

DEFAULT_MAX_CONNECTIONS = 4
"""Connections of the claims' pool when the caller does not size it; more claims wait their
turn."""

ELECTION_CONNECTIONS = 2
"""Connections of the election's own pool: a round, and a release at the same time (a job that
retires while a round is in flight)."""

POOL_WAIT_S = 10.0
"""How long a call waits for a free connection of the shared pool before it fails. A backstop
only: the elector and the runner bound every call with a shorter timeout of their own."""


def checked_pool_size(url: str | None, client: object, max_connections: int | None) -> int:
    """A store's arguments checked (exactly one of ``url`` and ``client``), and the size of
    its claims' pool."""
    if (url is None) == (client is None):
        raise ValueError("pass exactly one of url= or client=")
    size = DEFAULT_MAX_CONNECTIONS if max_connections is None else max_connections
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"max_connections={max_connections!r} must be a whole number of at least 1, "
            "such as max_connections=4, or None for the default"
        )
    return size


def no_retry() -> Retry:
    """A retry policy of no retries (the elector does its own backoff)."""
    return Retry(NoBackoff(), 0)


def no_maint_notifications() -> dict[str, Any]:
    """Pool options that turn off redis-py's maintenance notifications where it has them.

    redis-py 8 turns them on by default over RESP3, and then no longer checks a pooled
    connection for a close by the server before using it: the first call after a Redis
    restart fails on the dead connection, costing the election a round and a backoff, and a
    release at shutdown. They also add a ``CLIENT MAINT_NOTIFICATIONS`` round trip per
    connection, which open-source Redis refuses anyway.
    """
    if "maint_notifications_config" not in inspect.signature(ConnectionPool).parameters:
        return {}  # an older redis-py: nothing to turn off
    from redis.maint_notifications import MaintNotificationsConfig

    return {"maint_notifications_config": MaintNotificationsConfig(enabled=False)}


def forced_options() -> dict[str, Any]:
    """Connection options the store needs whatever the URL or the user's client says: no
    client-side retries, and raw bytes (values are decoded here, never failing on bad UTF-8)."""
    return {"retry": no_retry(), "retry_on_timeout": False, "decode_responses": False}


def options_from_url(
    url: str, connect_timeout_s: float
) -> tuple[type[AbstractConnection], dict[str, Any]]:
    """Connection class and options for ``url``; its query string wins over the defaults."""
    options: dict[str, Any] = dict(parse_url(url))
    connection_class = options.pop("connection_class", Connection)
    options.pop("max_connections", None)  # the store sizes its pools itself
    defaults = {
        "socket_connect_timeout": connect_timeout_s,
        # Every call has a deadline of its own (``bounded``), shorter than any socket
        # timeout would be for a renewal, and drops its connection when it passes.
        "socket_timeout": None,
    }
    return connection_class, {**defaults, **options, **forced_options()}


def options_from_client(client: Redis) -> tuple[type[AbstractConnection], dict[str, Any]]:
    """The user's connection settings (host, TLS, credentials, timeouts), without retries."""
    pool = client.connection_pool
    options = {
        key: value
        for key, value in pool.connection_kwargs.items()
        if not key.startswith(("orig_", "maint_notifications")) and key != "retry"
    }
    return pool.connection_class, {**options, **forced_options()}


async def bounded(call: Awaitable[T], timeout_s: float, topology: Topology) -> T:
    """Await ``call``, a call on ``topology.calls``, for at most ``timeout_s`` (then
    ``TimeoutError``): how every call of the store on that client is bounded.

    A call past its deadline drops its connection: the call is cancelled, and redis-py
    disconnects a connection whose command was cancelled before its reply was read (checked
    on a real server, ``tests/test_silent_flows.py``), so the next call opens a fresh one
    instead of waiting on a flow that may never answer (a NAT or a load balancer that dropped
    it without a RST, a failover). The idle connections of ``client`` are dropped too: opened
    over the same path, they are likely as dead, and a call that took one would wait out its
    whole deadline again.

    A call that fails, or passes its deadline, is told to the topology
    (``Topology.call_failed``): on a cluster, the slot's master may have changed.
    """
    try:
        return await within(call, timeout_s)
    except TimeoutError as exc:
        topology.call_failed(exc)
        await drop_idle(topology.calls)
        raise
    except Exception as exc:
        topology.call_failed(exc)
        raise


DROP_S = 1.0
"""Longest wait for the idle connections to close (closing a socket does not wait for the
peer, so this is a backstop)."""


async def drop_idle(client: Redis | RedisCluster) -> None:
    """Disconnect the idle connections of ``client``'s pools (of each node's, on a
    cluster); best effort, never raises."""
    try:
        if isinstance(client, RedisCluster):
            nodes = client.get_nodes()
            drops = (node.disconnect_free_connections() for node in nodes)
            await within(asyncio.gather(*drops, return_exceptions=True), DROP_S)
        else:
            await within(client.connection_pool.disconnect(inuse_connections=False), DROP_S)
    except Exception as exc:  # the next call reconnects anyway, if it must
        logger.debug("could not drop the idle connections to Redis: %r", exc)
