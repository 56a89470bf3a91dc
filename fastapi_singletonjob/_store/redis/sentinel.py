"""``SentinelLeaseStore``: the Redis store on the primary that the sentinels of a
``redis+sentinel://`` URL name (the URL form is in ``_config.sentinel_url``), a single server
(``_store.redis.server``) reached through redis-py's ``Sentinel``."""

from __future__ import annotations

from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

from ..._clock import SYSTEM_CLOCK, Clock
from ..._config.redact import redact_url
from ..._config.sentinel_url import parse_sentinel_url
from .server import SingleServer
from .store import RedisStore

__all__ = ["SentinelLeaseStore"]


class SentinelLeaseStore(RedisStore):
    """The Redis store on the primary that the sentinels of a URL name.

    It owns the ``Sentinel`` and the ``master_for`` client it builds, and closes them. Each
    sentinel is asked with a timeout and without retries: a sentinel that hangs (a paused
    process, a lost route) must not stall the look-up of the primary, which moves on to the
    next sentinel.

    :param clock: see ``RedisStore``.
    """

    def __init__(
        self,
        project: str,
        url: str,
        *,
        connect_timeout_s: float = 5.0,
        max_connections: int | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        address = parse_sentinel_url(url)
        asking = {
            "socket_connect_timeout": connect_timeout_s,
            "socket_timeout": connect_timeout_s,
            "retry": Retry(NoBackoff(), 0),
        }
        self._sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
            address.sentinels,
            sentinel_kwargs={
                **asking,
                "username": address.sentinel_username,
                "password": address.sentinel_password,
            },
            username=address.username,
            password=address.password,
            db=address.db,
            socket_connect_timeout=connect_timeout_s,
        )
        # Held for as long as the store: the store's connections reach the primary through
        # this client's pool, which they hold only by a weak reference.
        self._primary = self._sentinel.master_for(address.service)
        topology = SingleServer(
            url=None,
            client=self._primary,
            connect_timeout_s=connect_timeout_s,
            max_connections=max_connections,
            shown=redact_url(url),
            fix=(
                f"check that the sentinels monitor {address.service!r} and agree on its "
                "primary (SENTINEL GET-MASTER-ADDR-BY-NAME)"
            ),
        )
        super().__init__(project, topology, clock=clock)

    async def aclose(self) -> None:
        """Close the store's pools, then the client and the sentinels it built."""
        try:
            await super().aclose()
        finally:
            try:
                await self._primary.aclose(close_connection_pool=True)
            finally:
                await self._sentinel.aclose()

    def __repr__(self) -> str:
        # Named as it always was: the Redis store, on the URL that says it is Sentinel's.
        return f"RedisLeaseStore(project={self._project!r}, url={self._topology.shown!r})"
