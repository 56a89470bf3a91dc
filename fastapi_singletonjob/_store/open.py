"""Which lease store a ``SingletonJobs`` uses, opened at startup."""

from __future__ import annotations

from collections.abc import Iterable

from redis.asyncio import Redis, RedisCluster

from .._clock import Clock
from .._config.cluster_url import is_cluster_url
from .._config.redact import redact_url
from .._config.sentinel_url import is_sentinel_url
from .._config.settings import Settings
from .._errors import ConfigurationError
from .._job.spec import JobSpec
from .._schedule import policy_of
from .base import Store
from .memory import MemoryLeaseStore
from .redis.cluster import ClusterLeaseStore
from .redis.sentinel import SentinelLeaseStore
from .redis.store import RedisLeaseStore

__all__ = ["MAX_POOL_SIZE", "open_store"]


MAX_POOL_SIZE = 16
"""Most connections one node opens to Redis for its calls (the release listener has its own)."""


def open_store(
    settings: Settings,
    specs: Iterable[JobSpec],
    *,
    client: Redis | RedisCluster | None,
    clock: Clock,
) -> Store:
    """The store of one ``SingletonJobs``: a Redis store on ``client`` or ``settings``'s URL,
    or the in-process store for ``memory://``, on ``clock``. Opening does not connect.

    The pool holds the connections the store may need at once: the election round, a release,
    and one call per job that claims instants or writes its checkpoint (all may end or fire
    on one instant); capped, since the pool makes callers wait for a free connection rather
    than fail."""
    calling = sum(
        1
        for spec in specs
        if spec.enabled and (spec.checkpoint or not policy_of(spec.schedule).after_run)
    )
    pool_size = min(2 + calling, MAX_POOL_SIZE)
    if isinstance(client, RedisCluster):
        return ClusterLeaseStore(
            settings.project, client=client, max_connections=pool_size, clock=clock
        )
    if client is not None:
        return RedisLeaseStore(
            settings.project, client=client, max_connections=pool_size, clock=clock
        )
    url = settings.redis_url
    assert url is not None
    if url.startswith("memory:"):
        return MemoryLeaseStore(settings.project, clock, url)
    store_class = ClusterLeaseStore if is_cluster_url(url) else RedisLeaseStore
    try:
        if is_sentinel_url(url):
            return SentinelLeaseStore(
                settings.project,
                url,
                connect_timeout_s=settings.heartbeat_interval_s,
                max_connections=pool_size,
                clock=clock,
            )
        return store_class(
            settings.project,
            url=url,
            connect_timeout_s=settings.heartbeat_interval_s,
            max_connections=pool_size,
            clock=clock,
        )
    except (ValueError, TypeError) as exc:
        # Settings.build already refuses what redis-py misreads; should it still fail, its
        # message may quote the URL (urllib's port error quotes a password), so it is
        # replaced, and not chained.
        raise ConfigurationError(
            f"redis_url={redact_url(url)!r} is refused by redis-py "
            f"({type(exc).__name__}); check its form: redis://user:password@host:port/db "
            "with the user name and password percent-encoded",
            field="redis_url",
        ) from None
