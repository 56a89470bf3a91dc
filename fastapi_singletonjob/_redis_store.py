"""The Redis lease store.

The election talks to Redis through a connection pool of its own, with redis-py's automatic
retries turned off: a retry hidden inside one call could outlast the lease it is renewing. The
elector bounds every call with a timeout and does its own backoff. Only clients this module
created are closed; a client passed in by the user is never closed (only the pool derived from
its settings is).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from . import _keys, _scripts
from ._config import redact_url
from ._store import LeaseReply, LeaseRequest

__all__ = ["RedisLeaseStore"]

logger = logging.getLogger(__name__)

_POOL_SIZE = 4  # elect/release, the release listener, status reads: never more than a few


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def _no_retry() -> Retry:
    return Retry(NoBackoff(), 0)


def _no_maint_notifications() -> dict[str, Any]:
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


def _derive_pool(client: Redis) -> ConnectionPool:
    """A small pool with the user's connection settings but without client-side retries."""
    pool = client.connection_pool
    kwargs = {
        key: value
        for key, value in pool.connection_kwargs.items()
        if not key.startswith(("orig_", "maint_notifications")) and key != "retry"
    }
    kwargs.update(retry=_no_retry(), retry_on_timeout=False, **_no_maint_notifications())
    return ConnectionPool(
        connection_class=pool.connection_class, max_connections=_POOL_SIZE, **kwargs
    )


class RedisLeaseStore:
    """Leases kept in Redis keys (see ``_keys``), changed only by the scripts in ``_scripts``."""

    def __init__(
        self,
        project: str,
        *,
        url: str | None = None,
        client: Redis | None = None,
        connect_timeout_s: float = 5.0,
    ) -> None:
        if (url is None) == (client is None):
            raise ValueError("pass exactly one of url= or client=")
        self._project = project
        if client is not None:
            self._shown = "<client passed in>"
            self._redis = Redis(connection_pool=_derive_pool(client))
        else:
            assert url is not None
            self._shown = redact_url(url)
            self._redis = Redis.from_url(
                url,
                retry=_no_retry(),
                retry_on_timeout=False,
                socket_connect_timeout=connect_timeout_s,
                socket_timeout=None,  # every call is bounded by the elector's own timeout
                max_connections=_POOL_SIZE,
                **_no_maint_notifications(),
            )
        self._elect = self._redis.register_script(_scripts.ELECT)
        self._release = self._redis.register_script(_scripts.RELEASE)
        self._claim = self._redis.register_script(_scripts.CLAIM)
        self._checked_policy = False
        self._channel = _keys.release_channel(project)

    async def elect(self, node_id: str, requests: Sequence[LeaseRequest]) -> list[LeaseReply]:
        """See ``LeaseStore.elect``: one ``EVALSHA`` for all jobs."""
        keys: list[str] = []
        args: list[str | int] = [node_id]
        for request in requests:
            keys += (
                _keys.lock_key(self._project, request.job),
                _keys.fence_key(self._project, request.job),
            )
            args += (max(1, round(request.ttl_s * 1000)), request.held or "")
        raw: list[Any] = await self._elect(keys=keys, args=args)
        if not self._checked_policy:
            self._checked_policy = True
            await self._warn_if_evicting()
        replies = []
        for i, request in enumerate(requests):
            status, value, ttl_ms = raw[3 * i : 3 * i + 3]
            if int(status) < 0:  # the free lock could not be written: value is the error
                replies.append(LeaseReply(request.job, False, None, None, _text(value)))
                continue
            ttl_s = None if int(ttl_ms) < 0 else int(ttl_ms) / 1000
            replies.append(LeaseReply(request.job, int(status) == 1, _text(value), ttl_s))
        return replies

    async def release(self, node_id: str, values: dict[str, str]) -> int:
        """See ``LeaseStore.release``: one script call, which also publishes the notice."""
        if not values:
            return 0
        keys = [_keys.lock_key(self._project, job) for job in values]
        released: int = await self._release(keys=keys, args=[self._channel, *values.values()])
        return int(released)

    async def claim(self, job: str, value: str, instant_us: int) -> int:
        """See ``LeaseStore.claim``: one script call."""
        keys = [_keys.lock_key(self._project, job), _keys.last_key(self._project, job)]
        result: int = await self._claim(keys=keys, args=[value, instant_us])
        return int(result)

    async def listen_releases(self, on_release: Callable[[], None]) -> None:
        """See ``LeaseStore.listen_releases``: a pub/sub subscription on its own connection."""
        pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self._channel)
            async for message in pubsub.listen():
                if message.get("type") == "message":
                    on_release()
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def _warn_if_evicting(self) -> None:
        """Lock keys carry a TTL, so every eviction policy but ``noeviction`` may evict them
        when Redis is full, and then two nodes can lead at once: say so, once."""
        try:
            memory = await self._redis.info("memory")
        except Exception as exc:  # INFO may be forbidden by an ACL; the check is advisory
            logger.debug("could not read the eviction policy of %s: %r", self._shown, exc)
            return
        policy = str(memory.get("maxmemory_policy", "noeviction"))
        if int(memory.get("maxmemory", 0) or 0) > 0 and policy != "noeviction":
            logger.warning(
                "Redis at %s has maxmemory set with maxmemory-policy %s: when it is full it "
                "may evict lock keys, and then two nodes can run a job at once; use "
                "maxmemory-policy noeviction (or a Redis dedicated to locks without maxmemory)",
                self._shown,
                policy,
            )

    async def ping(self) -> None:
        """See ``LeaseStore.ping``."""
        await self._redis.ping()

    async def aclose(self) -> None:
        """Close this store's own pool; a user's client stays open."""
        await self._redis.aclose(close_connection_pool=True)

    def __repr__(self) -> str:
        return f"RedisLeaseStore(project={self._project!r}, url={self._shown!r})"
