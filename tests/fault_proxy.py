"""A small asyncio TCP proxy that injects network faults between one client and Redis.

toxiproxy is not available here, so the tests put this in front of a real redis-server:

    async with FaultProxy("127.0.0.1", server.port) as proxy:
        client = redis.asyncio.Redis(port=proxy.port, ...)
        proxy.blackhole()      # partition: nothing gets through, connections stay open
        proxy.pass_through()   # heal
        proxy.silence_existing()  # the connections open now die silently; new ones work
        proxy.silence_subscribers()  # only the pub/sub connections open now die silently
        proxy.delay_replies(0.4)  # server->client only: Redis acts at once, the reply is late
        proxy.hold_requests()  # client->server held (replies still flow)

Modes apply at once to existing and new connections. ``blackhole`` holds bytes the way TCP
does during a partition: when it heals, what was sent in the meantime is delivered in order
(possibly long after the client gave up). ``drop_responses`` discards server replies for good.
"""

from __future__ import annotations

import asyncio
import enum
from types import TracebackType

_CHUNK_BYTES = 65536


class Mode(enum.Enum):
    """What the proxy does with bytes in flight."""

    FORWARD = "forward"  # pass through, after the configured latency
    BLACKHOLE = "blackhole"  # hold everything in both directions
    DROP_RESPONSES = "drop_responses"  # forward requests, discard replies


class _Link:
    """One proxied connection: the client side, the Redis side and the four pump tasks."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.writers = [client]
        self.tasks: list[asyncio.Task[None]] = []
        self.aborted = False
        self.alive = asyncio.Event()  # cleared for good by FaultProxy.silence_existing()
        self.alive.set()
        self.subscribed = False
        """True once the client sent a (P)SUBSCRIBE on this connection."""

    def abort(self) -> None:
        """Reset both sides (RST, not FIN) and stop pumping."""
        self.aborted = True
        for writer in self.writers:
            writer.transport.abort()
        for task in self.tasks:
            task.cancel()


class FaultProxy:
    """Listen on a free 127.0.0.1 port and relay every connection to the upstream server."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        """Configure the upstream; nothing listens until :meth:`start`."""
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._mode = Mode.FORWARD
        self._latency_s = 0.0
        self._reply_latency_s = 0.0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._requests_flowing = asyncio.Event()
        self._requests_flowing.set()
        self._refusing = False
        self._links: set[_Link] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def mode(self) -> Mode:
        """The current mode."""
        return self._mode

    @property
    def connections(self) -> int:
        """Number of client connections currently relayed."""
        return len(self._links)

    async def start(self) -> None:
        """Start listening on a free port of 127.0.0.1 (see :attr:`port`)."""
        self._server = await asyncio.start_server(self._on_client, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening and abort every connection."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        await asyncio.sleep(0)  # let a connection accepted just now reach _on_client
        self.reset()
        while self._handlers:
            await asyncio.gather(*self._handlers, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    async def __aenter__(self) -> FaultProxy:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def pass_through(self) -> None:
        """Forward everything without delay; releases what a blackhole or
        :meth:`hold_requests` held and ends :meth:`delay_replies`."""
        self._set(Mode.FORWARD, 0.0)
        self._reply_latency_s = 0.0
        self._requests_flowing.set()

    def latency(self, seconds: float) -> None:
        """Delay each chunk by ``seconds`` in each direction, keeping order."""
        if seconds < 0:
            raise ValueError(f"latency must be >= 0 seconds, got {seconds!r}")
        self._set(Mode.FORWARD, seconds)

    def blackhole(self) -> None:
        """Keep connections open (and accept new ones) but forward nothing either way."""
        self._set(Mode.BLACKHOLE, 0.0)

    def drop_responses(self) -> None:
        """Forward client->server, discard server->client."""
        self._set(Mode.DROP_RESPONSES, 0.0)

    def reset(self) -> None:
        """Abort all current connections now: both the client and Redis get a RST."""
        for link in list(self._links):
            link.abort()

    def silence_existing(self) -> None:
        """Let the connections open now die without a word, for good: they forward nothing
        more either way and are never closed, as when the peer is gone without a RST (a
        failover, a NAT or firewall that dropped the flow). New connections are relayed."""
        for link in self._links:
            link.alive.clear()

    def silence_subscribers(self) -> None:
        """Like :meth:`silence_existing`, but only for the connections open now on which the
        client subscribed to a channel (sent ``SUBSCRIBE`` or ``PSUBSCRIBE``): a half-open
        pub/sub connection while the client's other connections, and new ones, work."""
        for link in self._links:
            if link.subscribed:
                link.alive.clear()

    def delay_replies(self, seconds: float) -> None:
        """Delay each server->client chunk by ``seconds`` more (on top of :meth:`latency`),
        keeping order; requests are not delayed, so Redis acts on a command long before its
        client hears the answer. Applies to chunks read from now on."""
        if seconds < 0:
            raise ValueError(f"reply delay must be >= 0 seconds, got {seconds!r}")
        self._reply_latency_s = seconds

    def hold_requests(self) -> None:
        """Hold every client->server byte (delivered in order by :meth:`pass_through`), while
        replies already on their way, and anything else the server sends, still flow."""
        self._requests_flowing.clear()

    def refuse(self) -> None:
        """Reset new connections as soon as they are accepted (existing ones are kept)."""
        self._refusing = True

    def accept(self) -> None:
        """Relay new connections again after :meth:`refuse`."""
        self._refusing = False

    def _set(self, mode: Mode, latency_s: float) -> None:
        self._mode, self._latency_s = mode, latency_s
        if mode is Mode.BLACKHOLE:
            self._flowing.clear()
        else:
            self._flowing.set()

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        link = _Link(writer)
        self._links.add(link)
        try:
            if self._refusing or self._server is None:
                link.abort()
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(
                    self.upstream_host, self.upstream_port
                )
            except OSError:  # Redis is down: the client sees a reset, as with a real outage
                link.abort()
                return
            link.writers.append(up_writer)
            if link.aborted:  # reset() or close() ran while we were connecting
                link.abort()
                return
            upstream: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
            downstream: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
            link.tasks = [
                asyncio.create_task(self._read(reader, upstream, link=link)),
                asyncio.create_task(self._read(up_reader, downstream, replies=True)),
                asyncio.create_task(self._write(upstream, up_writer, replies=False, link=link)),
                asyncio.create_task(self._write(downstream, writer, replies=True, link=link)),
            ]
            # Either side closing (EOF forwarded) or failing ends the whole connection.
            await asyncio.wait(link.tasks[2:], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in link.writers:
                w.close()  # FIN after what is buffered; a no-op after abort()
            for pump in link.tasks:
                pump.cancel()
            await asyncio.gather(*link.tasks, return_exceptions=True)
            # Wait for the sockets to be released, so none is left to the garbage collector.
            await asyncio.gather(*(w.wait_closed() for w in link.writers), return_exceptions=True)
            self._links.discard(link)
            self._handlers.discard(task)

    async def _read(
        self,
        reader: asyncio.StreamReader,
        queue: asyncio.Queue[tuple[float, bytes]],
        *,
        replies: bool = False,
        link: _Link | None = None,
    ) -> None:
        """Stamp each chunk with its due time; an empty chunk marks EOF or a broken socket.
        Client chunks (``link`` given) mark the link as subscribed when they subscribe."""
        loop = asyncio.get_running_loop()
        chunk = b"-"
        while chunk:
            try:
                chunk = await reader.read(_CHUNK_BYTES)
            except OSError:
                chunk = b""
            if link is not None and not link.subscribed and b"SUBSCRIBE" in chunk.upper():
                link.subscribed = True
            delay_s = self._latency_s + (self._reply_latency_s if replies else 0.0)
            queue.put_nowait((loop.time() + delay_s, chunk))

    async def _write(
        self,
        queue: asyncio.Queue[tuple[float, bytes]],
        writer: asyncio.StreamWriter,
        *,
        replies: bool,
        link: _Link | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, chunk = await queue.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            await self._flowing.wait()
            if not replies:
                await self._requests_flowing.wait()
            if link is not None:
                await link.alive.wait()
            if not chunk:
                return
            if replies and self._mode is Mode.DROP_RESPONSES:
                continue
            writer.write(chunk)
            await writer.drain()
