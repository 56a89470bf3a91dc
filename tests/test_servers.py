"""Tests of the harness itself: real server processes, real signals, a real TCP proxy."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis
import redis.asyncio
from fault_proxy import FaultProxy, Mode
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from servers import ENV_BINARY, RedisServer, RedisServerFactory, find_redis_server, free_port

pytestmark = pytest.mark.redis


def async_client(port: int, **overrides: Any) -> redis.asyncio.Redis:
    """An asyncio client without redis-py's default retries (they would hide the faults)."""
    options: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": port,
        "decode_responses": True,
        "socket_timeout": 5.0,
        "socket_connect_timeout": 5.0,
        "retry": Retry(NoBackoff(), 0),
    }
    options.update(overrides)
    return redis.asyncio.Redis(**options)


async def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 2.0) -> None:
    """Poll ``condition`` while the event loop (and so the proxy) keeps running."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s} s: {what}")
        await asyncio.sleep(0.01)


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
async def proxy(redis_server: RedisServer) -> AsyncIterator[FaultProxy]:
    async with FaultProxy("127.0.0.1", redis_server.port) as fault_proxy:
        yield fault_proxy


# --- servers.py -------------------------------------------------------------------------------


def test_find_redis_server_returns_an_executable() -> None:
    path = find_redis_server()
    assert os.path.isfile(path)
    assert os.access(path, os.X_OK)


def test_find_redis_server_rejects_a_bad_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_BINARY, "/nonexistent/redis-server")
    with pytest.raises(RuntimeError, match=ENV_BINARY):
        find_redis_server()


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_start_ping_stop() -> None:
    with RedisServer.start() as server:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        with server.client() as client:
            assert client.ping() is True
            assert int(client.info("server")["process_id"]) == server.pid
            assert client.config_get("save") == {"save": ""}
            assert client.config_get("appendonly") == {"appendonly": "no"}
        pid, data_dir = server.pid, server.data_dir
        server.stop()
        assert not server.running
        assert not process_exists(pid)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
    assert not data_dir.exists()


def test_start_on_a_taken_port_fails_clearly() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="log tail"):
            RedisServer.start(port)


def test_requirepass_in_extra_args_is_used_by_client(fresh_redis: RedisServerFactory) -> None:
    server = fresh_redis(extra_args=["--requirepass", "s3cret"])
    assert server.password == "s3cret"
    assert "s3cret" not in repr(server)
    with server.client() as client:
        assert client.ping()
    with server.client(password=None) as client, pytest.raises(redis.AuthenticationError):
        client.ping()


def test_close_kills_a_paused_server() -> None:
    with RedisServer.start() as server:
        server.pause()
        pid = server.pid
    assert not process_exists(pid)


def test_kill_then_restart_on_the_same_port_is_empty(fresh_redis: RedisServerFactory) -> None:
    server = fresh_redis()
    port, old_pid = server.port, server.pid
    with server.client() as client:
        client.set("k", "v")
    server.kill()
    assert not server.running
    assert not process_exists(old_pid)
    server.restart()
    assert (server.port, server.running) == (port, True)
    assert server.pid != old_pid
    with server.client() as client:
        assert client.dbsize() == 0


def test_restart_with_appendonly_keeps_a_key(fresh_redis: RedisServerFactory) -> None:
    server = fresh_redis(appendonly=True)
    with server.client() as client:
        client.set("k", "v")
    server.kill()
    server.restart()
    with server.client() as client:
        assert client.get("k") == "v"


def test_restart_keep_data_saves_a_running_server(fresh_redis: RedisServerFactory) -> None:
    server = fresh_redis()
    with server.client() as client:
        client.set("k", "v")
    server.restart(keep_data=True)
    with server.client() as client:
        assert client.get("k") == "v"
    server.restart()
    with server.client() as client:
        assert client.get("k") is None


def test_pause_times_out_and_resume_heals(fresh_redis: RedisServerFactory) -> None:
    server = fresh_redis()
    with server.client(socket_timeout=0.3) as client:
        assert client.ping()
        server.pause()
        started = time.monotonic()
        with pytest.raises(redis.TimeoutError):
            client.ping()
        assert 0.25 < time.monotonic() - started < 2.0
        server.resume()
        assert client.ping()


# --- fault_proxy.py ---------------------------------------------------------------------------


async def test_proxy_passes_through(
    proxy: FaultProxy, redis_server: RedisServer, unique_project: str
) -> None:
    key = f"{unique_project}:pass"
    async with async_client(proxy.port) as client:
        assert await client.ping()
        await client.set(key, "v")
        assert await client.get(key) == "v"
        assert proxy.connections == 1
    with redis_server.client() as direct:
        assert direct.get(key) == "v"


async def test_proxy_latency_delays_both_directions(proxy: FaultProxy) -> None:
    async with async_client(proxy.port) as client:
        await client.ping()
        proxy.latency(0.2)
        started = time.monotonic()
        await client.ping()
        assert 0.4 <= time.monotonic() - started < 2.0  # 0.2 s up plus 0.2 s down
        proxy.pass_through()
        started = time.monotonic()
        await client.ping()
        assert time.monotonic() - started < 0.2


async def test_proxy_blackhole_holds_until_healed(
    proxy: FaultProxy, redis_server: RedisServer, unique_project: str
) -> None:
    key = f"{unique_project}:held"
    async with async_client(proxy.port) as client, async_client(proxy.port) as newcomer:
        await client.ping()
        proxy.blackhole()
        assert proxy.mode is Mode.BLACKHOLE
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.set(key, "v"), 0.3)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(newcomer.ping(), 0.3)
        with redis_server.client() as direct:
            assert direct.get(key) is None
            proxy.pass_through()
            # Like TCP after a partition heals, the held request arrives late.
            await wait_until(lambda: direct.get(key) == "v", "the held SET reaches Redis")
        assert await client.ping()


async def test_proxy_drop_responses_loses_replies_not_requests(
    proxy: FaultProxy, redis_server: RedisServer, unique_project: str
) -> None:
    key = f"{unique_project}:dropped"
    async with async_client(proxy.port) as client:
        await client.ping()
        proxy.drop_responses()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.set(key, "v"), 0.3)
        with redis_server.client() as direct:
            await wait_until(lambda: direct.get(key) == "v", "the SET reaches Redis")
        proxy.pass_through()
        assert await client.ping()


async def test_proxy_reset_breaks_an_in_flight_command(
    proxy: FaultProxy, redis_server: RedisServer, unique_project: str
) -> None:
    name = unique_project.replace("-", "_")
    async with async_client(proxy.port, client_name=name, socket_timeout=None) as client:
        blpop = asyncio.ensure_future(client.blpop([f"{unique_project}:list"], timeout=10))
        with redis_server.client() as direct:
            await wait_until(
                lambda: any(
                    c["name"] == name and c["cmd"] == "blpop" for c in direct.client_list()
                ),
                "BLPOP is blocked on the server",
            )
            proxy.reset()
            with pytest.raises(redis.ConnectionError):
                await asyncio.wait_for(blpop, 2.0)
            await wait_until(lambda: proxy.connections == 0, "the proxy dropped the link")
            # The RST reached Redis as well: the blocked client is gone.
            await wait_until(
                lambda: all(c["name"] != name for c in direct.client_list()),
                "Redis dropped the client",
            )
        assert await client.ping()  # new connections still work


async def test_proxy_refuse_rejects_new_connections_only(proxy: FaultProxy) -> None:
    async with async_client(proxy.port) as early, async_client(proxy.port) as late:
        await early.ping()
        proxy.refuse()
        with pytest.raises(redis.ConnectionError):
            await asyncio.wait_for(late.ping(), 2.0)
        assert await early.ping()
        proxy.accept()
        assert await late.ping()


async def test_proxy_delay_replies_delays_only_replies(
    proxy: FaultProxy, redis_server: RedisServer, unique_project: str
) -> None:
    key = f"{unique_project}:late-reply"
    async with async_client(proxy.port) as client:
        await client.ping()
        proxy.delay_replies(0.5)
        started = time.monotonic()
        sent = asyncio.ensure_future(client.set(key, "v"))
        with redis_server.client() as direct:
            # Redis acts at once; only the answer is late.
            await wait_until(lambda: direct.get(key) == "v", "the SET reaches Redis", 0.3)
        assert await sent
        assert 0.5 <= time.monotonic() - started < 2.0
        proxy.pass_through()
        started = time.monotonic()
        await client.ping()
        assert time.monotonic() - started < 0.2


async def test_proxy_hold_requests_holds_until_healed(
    proxy: FaultProxy, redis_server: RedisServer, unique_project: str
) -> None:
    key = f"{unique_project}:held-request"
    async with async_client(proxy.port) as client:
        await client.ping()
        proxy.delay_replies(0.3)
        answered = asyncio.ensure_future(client.ping())  # on its way when the hold begins
        await asyncio.sleep(0.1)
        proxy.hold_requests()
        assert await asyncio.wait_for(answered, 2.0)  # replies still flow
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.set(key, "v"), 0.3)
        with redis_server.client() as direct:
            assert direct.get(key) is None
            proxy.pass_through()
            await wait_until(lambda: direct.get(key) == "v", "the held SET reaches Redis")
        assert await client.ping()


async def test_proxy_silence_subscribers_spares_other_connections(
    proxy: FaultProxy, redis_server: RedisServer, unique_project: str
) -> None:
    channel = f"{unique_project}:channel"
    async with async_client(proxy.port) as client:
        pubsub = client.pubsub()
        await pubsub.subscribe(channel)
        assert (await pubsub.get_message(timeout=2.0) or {}).get("type") == "subscribe"
        await client.ping()  # the client's other connection
        proxy.silence_subscribers()
        with redis_server.client() as direct:
            assert direct.publish(channel, "hello") == 1  # Redis still counts it
        assert await pubsub.get_message(timeout=0.3) is None  # but nothing arrives
        assert await client.ping()
        assert proxy.connections == 2  # silent, not closed
        later = client.pubsub()
        await later.subscribe(channel)  # a new subscription works
        assert (await later.get_message(timeout=2.0) or {}).get("type") == "subscribe"
        await later.aclose()  # type: ignore[no-untyped-call, unused-ignore]
        await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]


async def test_proxy_close_aborts_connections(redis_server: RedisServer) -> None:
    fault_proxy = FaultProxy("127.0.0.1", redis_server.port)
    await fault_proxy.start()
    async with async_client(fault_proxy.port, single_connection_client=True) as client:
        await client.ping()
        await fault_proxy.close()
        assert fault_proxy.connections == 0
        with pytest.raises(redis.ConnectionError):
            await asyncio.wait_for(client.ping(), 2.0)
