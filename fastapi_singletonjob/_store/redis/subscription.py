"""The release subscription of the Redis stores (``listen_releases``), for ``RedisLeaseStore``:
a connection of its own, checked by echoes that ``elect`` publishes and by pings."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from ..base import DEFAULT_KEEPALIVE_S, ReleaseListener, parse_notice

__all__ = ["RedisReleases"]


class RedisReleases:
    """The ``listen_releases`` method of ``RedisLeaseStore``; the store says where to
    subscribe (``_subscriber``, ``_subscribe``) and publishes the echoes (``elect``)."""

    _shown: str
    _connect_timeout_s: float
    _subscriber: Callable[[], Awaitable[Redis]]
    _subscribe: Callable[[PubSub], Awaitable[object]]

    _echo_wanted = False  # the listener heard nothing for a keepalive: the next elect echoes
    _echo_sent_at = float("-inf")  # loop time of the last elect that published an echo
    _broke = False  # the last subscription failed: the next one's confirmation wakes

    async def listen_releases(
        self, on_release: ReleaseListener, *, keepalive_s: float = DEFAULT_KEEPALIVE_S
    ) -> None:
        """See ``Store.listen_releases``: a subscription on a connection of its own.

        The subscription is checked, because a dead peer that never closed it (a failover,
        a NAT or firewall that dropped the flow) would otherwise leave a listener that hears
        nothing, for good: after ``keepalive_s`` without a message the next ``elect``
        publishes an echo on the channel (any node's echo will do), and the listener raises
        ``ConnectionError`` when nothing arrives within another ``keepalive_s``. That also
        catches a subscription left on a server that is no longer where the election writes
        (a failover). Without an ``elect`` in that time (no election, or a failing one) it
        sends a ``PING`` and waits as long again. The confirmation is awaited the same way,
        and, on a subscription that replaces a failed one, passed on as ``on_release(None)``:
        notices may have been missed meanwhile, and the store answers again.
        """
        if not keepalive_s > 0:
            raise ValueError(f"keepalive_s={keepalive_s!r} must be a positive number of seconds")
        loop = asyncio.get_running_loop()
        client = await self._subscriber()
        pubsub = client.pubsub()
        try:
            # Connecting (with its handshake) and sending are bounded too: on a dead peer
            # either can wait for good, as no socket timeout is set.
            await self._within(
                "subscribe", self._subscribe(pubsub), self._connect_timeout_s + keepalive_s
            )
            awaiting_since: float | None = loop.time()  # a reply is due since then
            heard_at, pinged = loop.time(), True
            while True:
                now = loop.time()
                if awaiting_since is not None:
                    wait_s = awaiting_since + keepalive_s - now
                    if wait_s <= 0 and not pinged and self._echo_sent_at < awaiting_since:
                        await self._within("send PING", pubsub.ping(), keepalive_s)
                        awaiting_since, pinged = loop.time(), True
                        continue
                    if wait_s <= 0:
                        raise ConnectionError(
                            f"the release subscription to {self._shown} got no reply within "
                            f"{keepalive_s:g}s: its connection is dead"
                        )
                else:
                    wait_s = heard_at + keepalive_s - now
                    if wait_s <= 0:
                        self._echo_wanted = True
                        awaiting_since, pinged = loop.time(), False
                        continue
                message = await pubsub.get_message(timeout=wait_s)
                if message is None:
                    continue
                heard_at, awaiting_since = loop.time(), None
                kind = message.get("type")
                data = message.get("data", b"")
                if kind in ("message", "smessage") and data not in (b"echo", "echo"):
                    on_release(parse_notice(data))
                elif kind in ("subscribe", "ssubscribe") and self._broke:
                    self._broke = False  # what was released meanwhile is unknown: ask about all
                    on_release(None)
                elif kind == "sunsubscribe":  # a cluster moved the slot away from this node
                    raise ConnectionError(
                        f"the release subscription to {self._shown} was ended by the server: "
                        "the project's hash slot moved to another node"
                    )
        except Exception:
            self._broke = True
            raise
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]
            await client.aclose(close_connection_pool=True)

    async def _within(self, what: str, call: Awaitable[object], timeout_s: float) -> None:
        """Await a call of the release subscription; ``ConnectionError`` past ``timeout_s``."""
        try:
            await asyncio.wait_for(call, timeout_s)
        except TimeoutError as exc:
            raise ConnectionError(
                f"the release subscription to {self._shown} could not {what} within "
                f"{timeout_s:g}s: its connection is dead"
            ) from exc
