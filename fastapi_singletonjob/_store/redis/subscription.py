"""The release subscription of the Redis store (``Store.listen_releases``): a connection of its
own, on the topology's pub/sub, checked by echoes that ``elect`` publishes and by pings."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable

from ..._aio import within
from ..._clock import Clock
from ..base import DEFAULT_KEEPALIVE_S, ReleaseListener, parse_notice
from .topology import Topology

__all__ = ["ReleaseSubscription"]

logger = logging.getLogger("fastapi_singletonjob.store")


class ReleaseSubscription:
    """Listens for the release notices of one project, and says when its connection wants
    checking: ``echo_wanted`` is True once it heard nothing for a keepalive, and the store's
    next ``elect`` publishes an echo on the channel, then calls ``echo_sent``.

    :param channel: the project's release channel.
    :param clock: whose ``monotonic()`` the keepalive deadlines are on.
    """

    def __init__(self, topology: Topology, channel: str, *, clock: Clock) -> None:
        self._topology = topology
        self._channel = channel
        self._clock = clock
        self._echo_wanted = False
        self._echo_sent_at = float("-inf")  # when the last elect that published an echo ended
        self._broke = False  # the last subscription failed: the next one's confirmation wakes

    @property
    def echo_wanted(self) -> bool:
        """The listener heard nothing for a keepalive: the next ``elect`` is to publish an
        echo on the channel (any node's echo will do)."""
        return self._echo_wanted

    def echo_sent(self) -> None:
        """An ``elect`` call that published an echo answered."""
        self._echo_wanted, self._echo_sent_at = False, self._clock.monotonic()

    async def listen(
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
        try:
            await self._listen(on_release, keepalive_s)
        except BaseException as exc:
            self._topology.subscription_ended(exc)
            raise

    async def _listen(self, on_release: ReleaseListener, keepalive_s: float) -> None:
        if not keepalive_s > 0:
            raise ValueError(f"keepalive_s={keepalive_s!r} must be a positive number of seconds")
        topology, clock = self._topology, self._clock
        client = await topology.subscriber()
        pubsub = client.pubsub()
        subscribe = pubsub.ssubscribe if topology.sharded else pubsub.subscribe
        try:
            # Connecting (with its handshake) and sending are bounded too: on a dead peer
            # either can wait for good, as no socket timeout is set.
            await self._within(
                "subscribe", subscribe(self._channel), topology.connect_timeout_s + keepalive_s
            )
            awaiting_since: float | None = clock.monotonic()  # a reply is due since then
            heard_at, pinged = clock.monotonic(), True
            while True:
                now = clock.monotonic()
                if awaiting_since is not None:
                    wait_s = awaiting_since + keepalive_s - now
                    if wait_s <= 0 and not pinged and self._echo_sent_at < awaiting_since:
                        await self._within("send PING", pubsub.ping(), keepalive_s)
                        awaiting_since, pinged = clock.monotonic(), True
                        continue
                    if wait_s <= 0:
                        raise ConnectionError(
                            f"the release subscription to {topology.shown} got no reply within "
                            f"{keepalive_s:g}s: its connection is dead"
                        )
                else:
                    wait_s = heard_at + keepalive_s - now
                    if wait_s <= 0:
                        self._echo_wanted = True
                        awaiting_since, pinged = clock.monotonic(), False
                        continue
                message = await pubsub.get_message(timeout=wait_s)
                if message is None:
                    continue
                heard_at, awaiting_since = clock.monotonic(), None
                kind = message.get("type")
                data = message.get("data", b"")
                if kind in ("message", "smessage") and data not in (b"echo", "echo"):
                    on_release(parse_notice(data))
                elif kind in ("subscribe", "ssubscribe") and self._broke:
                    self._broke = False  # what was released meanwhile is unknown: ask about all
                    on_release(None)
                elif kind == "sunsubscribe":  # a cluster moved the slot away from this node
                    raise ConnectionError(
                        f"the release subscription to {topology.shown} was ended by the server: "
                        "the project's hash slot moved to another node"
                    )
        except Exception:
            self._broke = True
            raise
        finally:
            # Bounded too: closing waits for nothing from the peer, but a dead flow must
            # never hold the listener, so that the next subscription goes on a fresh one.
            await self._close(
                pubsub.aclose,
                functools.partial(client.aclose, close_connection_pool=True),
            )

    async def _close(self, *closes: Callable[[], Awaitable[object]]) -> None:
        """Call and await each of ``closes`` for at most the connect timeout; an error is no
        concern of the listener's (the connection is gone either way). Each close is made
        only when its turn comes: one made ahead and left unawaited by a cancel (shutdown)
        would be reported as never awaited."""
        for close in closes:
            try:
                await within(close(), self._topology.connect_timeout_s)
            except Exception as exc:
                logger.debug("could not close a release subscription: %r", exc)

    async def _within(self, what: str, call: Awaitable[object], timeout_s: float) -> None:
        """Await a call of the release subscription; ``ConnectionError`` past ``timeout_s``."""
        try:
            await within(call, timeout_s)
        except TimeoutError as exc:
            raise ConnectionError(
                f"the release subscription to {self._topology.shown} could not {what} within "
                f"{timeout_s:g}s: its connection is dead"
            ) from exc
