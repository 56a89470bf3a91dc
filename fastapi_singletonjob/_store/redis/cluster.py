"""Redis Cluster as the store's topology (``ClusterTopology``), and ``ClusterLeaseStore``, the
Redis store on it.

All keys of a project share the hash tag ``{project}`` (``_store.keys``), so they live in one hash
slot on one master, and every script stays one round trip to it. What differs from a single
Redis is which node that is, and that it changes:

- calls go through redis-py's ``RedisCluster``, which sends each one to the slot's master and
  follows ``MOVED`` (after a failover or a migration: it updates its slot map) and ``ASK``
  (while the slot migrates) by itself. Like the single-Redis store, it does no retries of its
  own (a retry hidden in one call could outlast the lease it renews): a call to a master that
  just died fails, the elector backs off as for any failure, and the next call goes where the
  refreshed slot map says;
- a call that fails on its connection, or passes its deadline, re-reads the slot map of both
  clients (``ClusterTopology.call_failed``), not only of the client it failed on: redis-py
  re-reads a client's map only at that client's next call after its own connection error,
  so the release listener (which reads the election's map, and fails on connections of its
  own) and the claims kept going to a master that died, with a map read before its
  replica's promotion, until the election's next failed round, a backoff later (issue 26,
  item 4). Both clients read their map at the first round that answers, while the seeds
  are known to be up: a client first used after a failover could otherwise start only
  from seeds that may all be the dead master (``RedisCluster(host, port)`` passed in);
- release notices use sharded pub/sub (``SPUBLISH``/``SSUBSCRIBE``, Redis 7.0 or newer): the
  notice stays on the slot's shard, and the subscription is one connection to the slot's
  master. When the slot moves, Redis ends the subscription (``sunsubscribe``) or the
  connection dies with the master; the listener then subscribes again, at the node the
  election's slot map names, or at the one a ``MOVED`` reply names.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode, NodesManager
from redis.asyncio.connection import SSLConnection, parse_url
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    MovedError,
    NoPermissionError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..._aio import within
from ..._clock import SYSTEM_CLOCK, Clock
from ..._config.cluster_url import seed_urls
from ..._config.redact import redact_url
from ..._errors import StoreMismatch, StoreReadOnly
from .. import keys as _keys
from .connect import (
    ELECTION_CONNECTIONS,
    checked_pool_size,
    forced_options,
    no_maint_notifications,
)
from .store import RedisStore
from .topology import warn_eviction

__all__ = ["CLUSTER_CLIENT_SHOWN", "ClusterLeaseStore", "ClusterTopology"]

logger = logging.getLogger("fastapi_singletonjob.store")

CLUSTER_CLIENT_SHOWN = "<cluster client passed in>"
"""How logs and errors name the store when the user passed a cluster client."""

_CLUSTER_OPTIONS = frozenset(inspect.signature(RedisCluster.__init__).parameters) - {"self"}
_DEFERS_FAILED_NODE = all(
    "last_failed_node_name" in inspect.signature(method).parameters
    for method in (RedisCluster.initialize, NodesManager.initialize)
)
"""redis-py (8.x) can be told which node to ask last when it re-reads the slot map."""
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

_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    ConnectionError,  # the store's own, for a call not answered in time
    TimeoutError,
    RedisConnectionError,
    RedisTimeoutError,
)
"""Failures after which the slot's master may have changed (it died, or froze and its replica
took over): the slot map is read again."""


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


class ClusterTopology:
    """The ``Topology`` of a Redis Cluster: ``RedisCluster`` clients of the store's own, sharded
    pub/sub, and the project's hash slot (that of its release channel, as of all its keys)
    as the place to subscribe, check and ping.

    :param channel: the project's release channel.
    :param url: a ``redis+cluster://`` URL (see ``_config.cluster_url``); or
    :param client: a ``redis.asyncio.RedisCluster``; the store opens clients of its own with
        its seeds and connection settings, and never closes this one.
    """

    sharded = True

    def __init__(
        self,
        channel: str,
        *,
        url: str | None,
        client: RedisCluster | None,
        connect_timeout_s: float,
        max_connections: int | None,
    ) -> None:
        size = checked_pool_size(url, client, max_connections)
        self._channel = channel
        self.connect_timeout_s = connect_timeout_s
        self.shown = CLUSTER_CLIENT_SHOWN if url is None else redact_url(url)
        if client is not None:
            seeds, options = _options_from_client(client)
        else:
            assert url is not None
            seeds, options = _options_from_url(url, connect_timeout_s)
        self._fix = "pass the cluster's nodes, not a replica"
        self.seeds = seeds
        """The nodes the store's clients start from."""
        self.options = {k: v for k, v in options.items() if k not in _OWN_OPTIONS}
        """The connection settings taken from the URL or the user's client."""
        self._size = size
        # As on one Redis, the election has connections of its own (per node).
        self.election = self._cluster(ELECTION_CONNECTIONS)
        self.calls = self._cluster(size)
        self._listen_at: tuple[str, int] | None = None
        self._reread: asyncio.Task[None] | None = None
        self._slot = key_slot(channel.encode())  # of every key of the project too
        self._closed = False

    def _cluster(self, max_connections: int) -> RedisCluster:
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in self.seeds],
            max_connections=max_connections,
            require_full_coverage=False,  # only the project's slot matters
            **{k: v for k, v in self.options.items() if k in _CLUSTER_OPTIONS},
            **{k: v for k, v in forced_options().items() if k in _CLUSTER_OPTIONS},
            **no_maint_notifications(),
        )

    @property
    def max_connections(self) -> int:
        """See ``Topology.max_connections``: per node."""
        return self._size

    def mismatch(self, exc: Exception) -> Exception | None:
        """See ``Topology.mismatch``: a server that is no cluster node is named, and so is an
        ACL that forbids reading the slot map. (Redirections are followed by
        ``RedisCluster``, not errors.)"""
        if not isinstance(exc, RedisClusterException) or _NOT_A_CLUSTER not in str(exc):
            return None
        # redis-py says "not enabled" for any error reply to CLUSTER SLOTS: an ACL's too.
        if isinstance(_first_reply(exc), NoPermissionError):
            return NoPermissionError(
                f"the Redis user of {self.shown} may not read the cluster's slot map: "
                "add +cluster|slots +command +spublish +ssubscribe to its ACL"
            )
        return StoreMismatch(
            f"the Redis server at {self.shown} is not a Redis Cluster node (cluster mode "
            "is not enabled): use redis:// (or a redis.asyncio.Redis client) for a single "
            "Redis, redis+cluster:// (or RedisCluster) for a cluster"
        )

    async def read_only(self, what: str) -> StoreReadOnly:
        """See ``Topology.read_only``. A cluster replica answers ``MOVED`` for writes
        (followed by ``RedisCluster``), so this means a master demoted under a call: the next
        call goes where the refreshed slot map says."""
        return await self.refused(f"the Redis server at {self.shown} is {what}: {self._fix}")

    async def refused(self, message: str) -> StoreReadOnly:
        """See ``Topology.refused``: nothing to drop, as ``RedisCluster`` refreshes its slot
        map after an error of a connection, and follows ``MOVED``."""
        return StoreReadOnly(message)

    async def check_server(self) -> bool:
        """See ``Topology.check_server``: the calls' client reads its slot map now, and, on
        the slot's master, refuse a Redis older than 7.0 (no sharded pub/sub, so every
        release would fail).

        The calls' client would otherwise read its map at its first call, which on a
        follower is the first claim after it takes a job over, maybe after a failover, and
        then from the seeds alone: with a client passed in that names one node, the master
        that just died (issue 26, item 4). Read now, while the election's call has just
        reached the cluster, its map names every node, and each re-read after that starts
        from all of them."""
        client = self.election
        try:
            await self.calls.initialize()
        except (RedisError, RedisClusterException) as exc:  # tried again at the next round
            logger.debug("the claims' client could not read the slot map: %r", exc)
            return False
        try:
            node = client.get_node_from_key(self._channel)
            info = await client.info(target_nodes=node)
        except (ResponseError, RedisClusterException) as exc:  # an ACL, say: advisory only
            logger.debug("could not read INFO of %s: %r", self.shown, exc)
            return True
        except RedisError as exc:
            logger.debug("could not read INFO of %s: %r", self.shown, exc)
            return False
        version = str(info.get("redis_version", ""))
        if version.partition(".")[0].isdigit() and int(version.partition(".")[0]) < 7:
            raise StoreMismatch(
                f"the Redis Cluster at {self.shown} runs Redis {version}: the library needs "
                "Redis 7.0 or newer on a cluster (sharded pub/sub, SPUBLISH)"
            )
        warn_eviction(info, self.shown)
        return True

    async def ping(self) -> None:
        """See ``Topology.ping``: the slot's master."""
        client = await self.election.initialize()  # no slot map yet: read it first
        await client.ping(target_nodes=client.get_node_from_key(self._channel))

    async def subscriber(self) -> Redis:
        """See ``Topology.subscriber``: a client of one connection to the slot's master, the
        one a ``MOVED`` reply named last, else the one the election's slot map names."""
        if self._listen_at is not None:
            host, port = self._listen_at
        else:
            reread = self._reread
            if reread is not None and not reread.done():
                # a re-read after a failure is under way: its map, not the one it replaces
                # (the wait is bounded by the re-read's own deadline; never cancels it)
                await asyncio.wait({reread})
            # Reads the slot map if the client has none yet, or marked it stale after a
            # connection error (a dead master); else does nothing.
            client = await self.election.initialize()
            node = client.get_node_from_key(self._channel)
            if node is None:
                raise ConnectionError(f"no node of {self.shown} serves the project's slot yet")
            host, port = node.host, int(node.port)
        options = {**self.options, **forced_options(), **no_maint_notifications()}
        # retry_on_timeout=False is the default, and redis-py warns when it is passed
        options = {k: v for k, v in options.items() if k in _NODE_OPTIONS - {"retry_on_timeout"}}
        return Redis(host=host, port=port, single_connection_client=True, **options)

    def call_failed(self, exc: BaseException) -> None:
        """See ``Topology.call_failed``: after a connection error or a timeout, re-read the
        slot map of both clients, in a task of its own; at most one re-read is under way at
        a time (a failure meanwhile shares it), and each ends within ``connect_timeout_s``.

        redis-py re-reads a ``RedisCluster``'s map only at that client's next call after a
        connection error of its own, and after a call cancelled at its deadline not at all.
        The release listener reads the election's map but fails on connections of its own.
        So after a master's SIGKILL the listener kept subscribing at the dead master, with a
        map read before its replica was promoted, and could not wake the election, which
        waited out its backoff (seconds, doubling) before its next round failed once more
        and marked the map stale (issue 26, item 4); after a SIGSTOP (a master that froze:
        every call times out) no map was re-read at all: no run within 15 s. A re-read at
        every failure, shared by both clients and the listener, finds the promoted replica
        at the first failure after the promotion. The cost is a ``CLUSTER SLOTS`` call per
        client per failure at most, during a failover or an outage."""
        if self._closed or not isinstance(exc, _CONNECTION_ERRORS):
            return
        if self._reread is None or self._reread.done():
            self._reread = asyncio.get_running_loop().create_task(
                self._reread_maps(), name="singletonjob-cluster-slot-map"
            )

    async def _reread_maps(self) -> None:
        """Read the slot map of both clients again, at once (a client not yet initialised
        reads it, with the command table, for the first time); failures are the next
        call's concern."""
        await asyncio.gather(*(self._reread_map(c) for c in (self.election, self.calls)))

    async def _reread_map(self, client: RedisCluster) -> None:
        """Read ``client``'s slot map again, asking the node that serves the project's slot
        in the map it replaces last: that is where the failed call went, and a master that
        froze (``SIGSTOP``, a partition) accepts the connection but never answers, so asked
        first it would hold the whole re-read until its deadline."""
        last: dict[str, Any] = {}
        serving = client.nodes_manager.slots_cache.get(self._slot)
        if serving and _DEFERS_FAILED_NODE:
            last["last_failed_node_name"] = serving[0].name
        try:
            await within(self._read_again(client, last), self.connect_timeout_s)
        except Exception as exc:
            logger.debug("could not re-read the slot map of %s: %r", self.shown, exc)

    @staticmethod
    async def _read_again(client: RedisCluster, last: dict[str, Any]) -> None:
        await client.initialize(**last)  # nothing to do once initialised
        await client.nodes_manager.initialize(**last)

    def subscription_ended(self, exc: BaseException) -> None:
        """See ``Topology.subscription_ended``: after ``MOVED`` (``SSUBSCRIBE`` sent to a node
        that no longer has the slot) the next one goes where it names, else where the slot
        map says, re-read first after a connection error or a timeout
        (``call_failed``)."""
        self._listen_at = (exc.host, int(exc.port)) if isinstance(exc, MovedError) else None
        if self._listen_at is None:
            self.call_failed(exc)

    async def aclose(self) -> None:
        """See ``Topology.aclose``: a re-read under way, and the store's own clients (a
        user's client stays open)."""
        self._closed = True
        reread, self._reread = self._reread, None
        try:
            if reread is not None:
                reread.cancel()
                await asyncio.wait({reread})
        finally:
            try:
                await self.calls.aclose()
            finally:
                await self.election.aclose()


class ClusterLeaseStore(RedisStore):
    """The Redis store on a Redis Cluster: the same scripts and replies, sent through
    ``RedisCluster`` clients, with release notices on sharded pub/sub.

    :param url: a ``redis+cluster://`` URL (see ``_config.cluster_url``).
    :param client: a ``redis.asyncio.RedisCluster``; the store opens clients of its own with
        its seeds and connection settings, and never closes this one.
    :param max_connections: size of the claims' pool, per node (see ``RedisLeaseStore``).
    :param clock: see ``RedisStore``.
    """

    def __init__(
        self,
        project: str,
        *,
        url: str | None = None,
        client: RedisCluster | None = None,
        connect_timeout_s: float = 5.0,
        max_connections: int | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        topology = ClusterTopology(
            _keys.release_channel(project),
            url=url,
            client=client,
            connect_timeout_s=connect_timeout_s,
            max_connections=max_connections,
        )
        super().__init__(project, topology, clock=clock)
