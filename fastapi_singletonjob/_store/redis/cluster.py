"""The Redis lease store on a Redis Cluster.

All keys of a project share the hash tag ``{project}`` (``_store.keys``), so they live in one hash
slot on one master, and every script stays one round trip to it. What differs from a single
Redis is which node that is, and that it changes:

- calls go through redis-py's ``RedisCluster``, which sends each one to the slot's master and
  follows ``MOVED`` (after a failover or a migration: it updates its slot map) and ``ASK``
  (while the slot migrates) by itself. Like the single-Redis store, it does no retries of its
  own (a retry hidden in one call could outlast the lease it renews): a call to a master that
  just died fails, the elector backs off as for any failure, and the next call goes where the
  refreshed slot map says;
- release notices use sharded pub/sub (``SPUBLISH``/``SSUBSCRIBE``, Redis 7.0 or newer): the
  notice stays on the slot's shard, and the subscription is one connection to the slot's
  master. When the slot moves, Redis ends the subscription (``sunsubscribe``) or the
  connection dies with the master; the listener then subscribes again, at the node the
  election's slot map names, or at the one a ``MOVED`` reply names.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Awaitable, Sequence
from typing import Any, cast

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import SSLConnection, parse_url
from redis.commands.core import AsyncScript
from redis.exceptions import (
    MovedError,
    NoPermissionError,
    RedisClusterException,
    RedisError,
    ResponseError,
)

from ..._config.cluster_url import seed_urls
from ..._errors import StoreMismatch, StoreReadOnly
from ..base import DEFAULT_KEEPALIVE_S, LeaseReply, LeaseRequest, ReleaseListener
from . import scripts as _scripts
from .connect import forced_options, no_maint_notifications
from .store import ELECTION_CONNECTIONS, RedisLeaseStore

__all__ = ["ClusterLeaseStore"]

logger = logging.getLogger(__name__)

_CLUSTER_OPTIONS = frozenset(inspect.signature(RedisCluster.__init__).parameters) - {"self"}
_NODE_OPTIONS = frozenset(inspect.signature(Redis.__init__).parameters) - {"self"}
_OWN_OPTIONS = frozenset(
    {
        "host",
        "port",
        "db",
        "startup_nodes",
        "max_connections",
        "retry",
        "retry_on_timeout",
        "retry_on_error",
        "cluster_error_retry_attempts",
        "decode_responses",
        "maint_notifications_config",
        "event_dispatcher",
        "read_from_replicas",
        "load_balancing_strategy",
        "require_full_coverage",
    }
)
"""Options the store sets itself, whatever the URL or the user's client says."""

_NOT_A_CLUSTER = "Cluster mode is not enabled"


def _options_from_url(
    url: str, connect_timeout_s: float
) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """Seed nodes and ``RedisCluster`` options of a ``redis+cluster://`` URL."""
    seeds = []
    options: dict[str, Any] = {}
    for seed in seed_urls(url):
        options = dict(parse_url(seed))
        seeds.append((str(options["host"]), int(options["port"])))
    if options.pop("connection_class", None) is SSLConnection:
        options["ssl"] = True
    defaults = {"socket_connect_timeout": connect_timeout_s, "socket_timeout": None}
    return seeds, {**defaults, **options}


def _options_from_client(client: RedisCluster) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """Seed nodes (every node the user's client knows) and its connection settings."""
    nodes = client.get_nodes() or client.startup_nodes
    seeds = [(node.host, int(node.port)) for node in nodes]
    kwargs = client.connection_kwargs
    options = {key: value for key, value in kwargs.items() if key in _CLUSTER_OPTIONS}
    if issubclass(kwargs.get("connection_class", object), SSLConnection):
        options["ssl"] = True
    remap = client.nodes_manager.address_remap
    if remap is not None:
        options["address_remap"] = remap
    return seeds, options


def _first_reply(exc: BaseException) -> BaseException | None:
    """The error reply at the bottom of redis-py's chain of cluster exceptions, if any."""
    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, ResponseError):
        seen = seen.__cause__ or seen.__context__
    return seen


class ClusterLeaseStore(RedisLeaseStore):
    """``RedisLeaseStore`` on a Redis Cluster: the same scripts and replies, sent through
    ``RedisCluster`` clients, with release notices on sharded pub/sub.

    :param url: a ``redis+cluster://`` URL (see ``_config.cluster_url``).
    :param client: a ``redis.asyncio.RedisCluster``; the store opens clients of its own with
        its seeds and connection settings, and never closes this one.
    """

    _CLIENT_SHOWN = "<cluster client passed in>"
    _CLUSTER_REPLIES = ()  # redirections are followed here, not errors

    def __init__(
        self,
        project: str,
        *,
        url: str | None = None,
        client: RedisCluster | None = None,
        connect_timeout_s: float = 5.0,
        max_connections: int | None = None,
    ) -> None:
        # Not RedisLeaseStore.__init__: it builds connection pools for one server.
        size = self._init_shared(project, url, client, connect_timeout_s, max_connections)
        if client is not None:
            seeds, options = _options_from_client(client)
        else:
            assert url is not None
            seeds, options = _options_from_url(url, connect_timeout_s)
        self._fix = "pass the cluster's nodes, not a replica"
        self._seeds = seeds
        self._options = {k: v for k, v in options.items() if k not in _OWN_OPTIONS}
        self._size = size
        # As on one Redis, the election has connections of its own (per node).
        self._clusters = (self._cluster(ELECTION_CONNECTIONS), self._cluster(size))
        # What the base class calls on them (scripts, HGETALL, DEL) RedisCluster has too.
        self._redis, self._claims = (cast(Redis, client) for client in self._clusters)
        self._elect = self._redis.register_script(_scripts.ELECT_SHARDED)
        self._release = self._redis.register_script(_scripts.RELEASE_SHARDED)
        self._claim = self._claims.register_script(_scripts.CLAIM)
        self._listen_at: tuple[str, int] | None = None

    @functools.cached_property
    def _control_script(self) -> AsyncScript:
        # The wake-up of an operator's control goes by sharded pub/sub, like the releases.
        return self._claims.register_script(_scripts.CONTROL_SHARDED)

    def _cluster(self, max_connections: int) -> RedisCluster:
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in self._seeds],
            max_connections=max_connections,
            require_full_coverage=False,  # only the project's slot matters
            **{k: v for k, v in self._options.items() if k in _CLUSTER_OPTIONS},
            **{k: v for k, v in forced_options().items() if k in _CLUSTER_OPTIONS},
            **no_maint_notifications(),
        )

    @property
    def _cluster_client(self) -> RedisCluster:
        """The election's client."""
        return self._clusters[0]

    @property
    def max_connections(self) -> int:
        """Size of the claims' pool, per node."""
        return self._size

    async def elect(self, node_id: str, requests: Sequence[LeaseRequest]) -> list[LeaseReply]:
        """See ``RedisLeaseStore.elect``; a server that is no cluster node is named."""
        try:
            return await super().elect(node_id, requests)
        except RedisClusterException as exc:
            if _NOT_A_CLUSTER not in str(exc):
                raise
            # redis-py says "not enabled" for any error reply to CLUSTER SLOTS: an ACL's too.
            if isinstance(_first_reply(exc), NoPermissionError):
                raise NoPermissionError(
                    f"the Redis user of {self._shown} may not read the cluster's slot map: "
                    "add +cluster|slots +command +spublish +ssubscribe to its ACL"
                ) from None
            raise StoreMismatch(
                f"the Redis server at {self._shown} is not a Redis Cluster node (cluster mode "
                "is not enabled): use redis:// (or a redis.asyncio.Redis client) for a single "
                "Redis, redis+cluster:// (or RedisCluster) for a cluster"
            ) from None

    async def _subscriber(self) -> Redis:
        """A client of one connection to the slot's master: the one a ``MOVED`` reply named
        last, else the one the election's slot map names."""
        if self._listen_at is not None:
            host, port = self._listen_at
        else:
            # Reads the slot map if the client has none yet, or marked it stale after a
            # connection error (a dead master); else does nothing.
            client = await self._cluster_client.initialize()
            node = client.get_node_from_key(self._channel)
            if node is None:
                raise ConnectionError(f"no node of {self._shown} serves the project's slot yet")
            host, port = node.host, int(node.port)
        options = {**self._options, **forced_options(), **no_maint_notifications()}
        # retry_on_timeout=False is the default, and redis-py warns when it is passed
        options = {k: v for k, v in options.items() if k in _NODE_OPTIONS - {"retry_on_timeout"}}
        return Redis(host=host, port=port, single_connection_client=True, **options)

    def _subscribe(self, pubsub: PubSub) -> Awaitable[object]:
        return pubsub.ssubscribe(self._channel)

    async def listen_releases(
        self, on_release: ReleaseListener, *, keepalive_s: float = DEFAULT_KEEPALIVE_S
    ) -> None:
        """See ``RedisLeaseStore.listen_releases``; follows the slot when it moves."""
        try:
            await super().listen_releases(on_release, keepalive_s=keepalive_s)
        except MovedError as exc:  # SSUBSCRIBE sent to a node that no longer has the slot
            self._listen_at = (exc.host, int(exc.port))
            raise
        except BaseException:
            self._listen_at = None
            raise

    async def _read_only(self, what: str) -> StoreReadOnly:
        """The error for a write refused as read-only. A cluster replica answers ``MOVED``
        for writes (followed by ``RedisCluster``), so this means a master demoted under a
        call: the next call goes where the refreshed slot map says."""
        return StoreReadOnly(f"the Redis server at {self._shown} is {what}: {self._fix}")

    async def _check_server(self) -> None:
        """Once, on the slot's master: refuse a Redis older than 7.0 (no sharded pub/sub, so
        every release would fail), and warn about an eviction policy that may evict locks."""
        client = self._cluster_client
        try:
            node = client.get_node_from_key(self._channel)
            info = await client.info(target_nodes=node)
        except (ResponseError, RedisClusterException) as exc:  # an ACL, say: advisory only
            self._checked_server = True
            logger.debug("could not read INFO of %s: %r", self._shown, exc)
            return
        except RedisError as exc:
            logger.debug("could not read INFO of %s: %r", self._shown, exc)
            return
        version = str(info.get("redis_version", ""))
        if version.partition(".")[0].isdigit() and int(version.partition(".")[0]) < 7:
            raise StoreMismatch(
                f"the Redis Cluster at {self._shown} runs Redis {version}: the library needs "
                "Redis 7.0 or newer on a cluster (sharded pub/sub, SPUBLISH)"
            )
        self._checked_server = True
        self._warn_eviction(info)

    async def ping(self) -> None:
        """See ``Store.ping``: the slot's master."""
        client = await self._cluster_client.initialize()  # no slot map yet: read it first
        await client.ping(target_nodes=client.get_node_from_key(self._channel))

    async def aclose(self) -> None:
        """Close this store's own clients; a user's client stays open."""
        election, claims = self._clusters
        try:
            await self._record_batcher.aclose()
            await self._claim_batcher.aclose()
            await claims.aclose()
        finally:
            await election.aclose()

    def __repr__(self) -> str:
        return f"ClusterLeaseStore(project={self._project!r}, url={self._shown!r})"
