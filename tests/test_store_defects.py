"""Regression tests of issue 11's store-side defects, against real redis-servers.

What both stores share is in ``test_store_contract.py`` (foreign lock values, instants ahead
of the store's clock); here is what only Redis has: bytes that are not UTF-8, the connection
pool, the release subscription's keepalive and replicas.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime

import pytest
import redis.asyncio
from fault_proxy import FaultProxy
from servers import HOST, RedisServer, RedisServerFactory
from waiting import wait_until

from fastapi_singletonjob._errors import StoreReadOnly
from fastapi_singletonjob._lock_value import SHOWN_VALUE_CHARS, parse_lock_value
from fastapi_singletonjob._store import keys as _keys
from fastapi_singletonjob._store.base import LeaseRequest
from fastapi_singletonjob._store.redis.store import DEFAULT_MAX_CONNECTIONS, RedisLeaseStore

pytestmark = pytest.mark.redis

TTL_S = 5.0
KEEPALIVE_S = 0.2
SLACK_S = 0.5  # scheduling slack on a busy two-core machine


@pytest.fixture
async def store(unique_project: str, redis_url: str) -> AsyncIterator[RedisLeaseStore]:
    lease_store = RedisLeaseStore(unique_project, url=redis_url)
    try:
        yield lease_store
    finally:
        await lease_store.aclose()


def numsub(server: RedisServer, project: str) -> Callable[[], int]:
    """How many connections listen to ``project``'s release channel, as the server counts."""
    channel = _keys.release_channel(project)

    def count() -> int:
        with server.client() as client:
            return int(dict(client.pubsub_numsub(channel)).get(channel, 0))

    return count


async def listening(task: asyncio.Task[None], subscribers: Callable[[], int]) -> None:
    """Wait until the listener ``task`` is subscribed (and has not failed)."""
    await wait_until(lambda: task.done() or subscribers() >= 1, 3.0, "the listener subscribed")
    assert not task.done(), task


async def cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# --- item 3: lock values the library did not write ---------------------------------------------


PARSED: dict[str, tuple[str | None, tuple[int | None, str | None]]] = {
    "none": (None, (None, None)),
    "smallest": ("1|n1", (1, "n1")),
    "typical": ("1796032021576623|web-1#a083974a", (1796032021576623, "web-1#a083974a")),
    "bar-in-owner": ("7|a|b", (7, "a|b")),
    "int64-max": (f"{2**63 - 1}|n1", (2**63 - 1, "n1")),
    "above-int64": (f"{2**63}|n1", (None, f"{2**63}|n1")),
    "20-digits": ("1" * 20 + "|n1", (None, "1" * 20 + "|n1")),
    "4301-digits": ("9" * 4301 + "|x", (None, "9" * 4301 + "|x")),
    "empty": ("", (None, "")),
    "zero": ("0|n1", (None, "0|n1")),
    "no-owner": ("12|", (None, "12|")),
    "superscript-digit": ("\u00b2|n1", (None, "\u00b2|n1")),
    "arabic-indic-digit": ("\u0661|n1", (None, "\u0661|n1")),  # int() would take it
    "plus-sign": ("+1|n1", (None, "+1|n1")),
    "leading-space": (" 1|n1", (None, " 1|n1")),
}


@pytest.mark.parametrize(("value", "expected"), PARSED.values(), ids=PARSED.keys())
def test_item3_parse_lock_value_never_raises(
    value: str | None, expected: tuple[int | None, str | None]
) -> None:
    assert parse_lock_value(value) == expected


async def test_item3_a_non_utf8_lock_value_leaves_the_other_jobs_alone(
    store: RedisLeaseStore, redis_server: RedisServer, unique_project: str
) -> None:
    with redis_server.client(decode_responses=False) as client:
        client.set(_keys.job_key(unique_project, "other", "lock"), b"\xff\xfe binary\n", px=60_000)

    good, other = await store.elect(
        "n1", [LeaseRequest("good", TTL_S), LeaseRequest("other", TTL_S)]
    )

    assert good.held and good.holder == "n1"
    assert not other.held and other.token is None
    assert other.value == "\ufffd\ufffd binary\n"
    assert other.holder == "\ufffd\ufffd binary\\n"  # shown on one line
    assert other.ttl_s is not None and other.ttl_s <= 60.0
    renewed, again = await store.elect(
        "n1", [LeaseRequest("good", TTL_S, good.value), LeaseRequest("other", TTL_S, other.value)]
    )
    assert renewed.held and not again.held


async def test_item3_a_non_utf8_lock_value_with_a_decoding_client(
    redis_server: RedisServer, unique_project: str
) -> None:
    """A client passed in with ``decode_responses=True`` must not make redis-py decode (and
    fail on) the store's replies: the store decodes them itself."""
    with redis_server.client(decode_responses=False) as client:
        client.set(_keys.job_key(unique_project, "other", "lock"), b"\xff binary", px=60_000)
    user = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
    lease_store = RedisLeaseStore(unique_project, client=user)
    try:
        good, other = await lease_store.elect(
            "n1", [LeaseRequest("good", TTL_S), LeaseRequest("other", TTL_S)]
        )
        assert good.held and not other.held and other.value == "\ufffd binary"
    finally:
        await lease_store.aclose()
        await user.aclose()


async def test_item3_a_huge_foreign_token_is_shown_cut(
    store: RedisLeaseStore, redis_server: RedisServer, unique_project: str
) -> None:
    value = "9" * 4301 + "|x"
    with redis_server.client() as client:
        client.set(_keys.job_key(unique_project, "other", "lock"), value, px=60_000)

    good, other = await store.elect(
        "n1", [LeaseRequest("good", TTL_S), LeaseRequest("other", TTL_S)]
    )

    assert good.held
    assert not other.held and other.token is None and other.value == value
    assert other.holder == "9" * SHOWN_VALUE_CHARS + "\u2026"


# --- item 5: the connection pool ---------------------------------------------------------------


async def claims_and_an_elect(lease_store: RedisLeaseStore, jobs: int) -> None:
    """Lead ``jobs`` jobs, then claim an instant of each at once while also renewing them."""
    names = [f"cron-{i}" for i in range(jobs)]
    terms = await lease_store.elect("n1", [LeaseRequest(name, TTL_S) for name in names])
    assert all(reply.held and reply.value for reply in terms)
    instant_us = int(datetime.now(UTC).timestamp() * 1_000_000)
    claims = [lease_store.claim(r.job, r.value or "", instant_us) for r in terms]
    renewal = lease_store.elect("n1", [LeaseRequest(r.job, TTL_S, r.value) for r in terms])

    *claimed, renewed = await asyncio.wait_for(asyncio.gather(*claims, renewal), 10.0)

    assert claimed == [1] * jobs
    assert isinstance(renewed, list) and all(reply.held for reply in renewed)


async def test_item5_forty_claims_and_an_elect_with_the_default_pool(
    store: RedisLeaseStore, redis_server: RedisServer, unique_project: str
) -> None:
    """40 cron jobs on one instant, a renewal, and the release subscription: the calls wait
    for a free connection instead of failing with "Too many connections"."""
    listener = asyncio.create_task(store.listen_releases(lambda _jobs: None))
    try:
        await listening(listener, numsub(redis_server, unique_project))
        await claims_and_an_elect(store, 40)
        assert not listener.done()
    finally:
        await cancelled(listener)


@pytest.mark.parametrize("via", ["url", "client"])
async def test_item5_the_pool_size_holds_and_the_listener_is_apart(
    redis_server: RedisServer, unique_project: str, via: str
) -> None:
    """``max_connections`` bounds the claims' connections on both ways of building the store;
    the election and the release subscription have connections of their own, even with a
    claims pool of one, so a renewal never queues behind a burst of claims (chaos row 44b)."""
    name = f"{unique_project}-store"
    url = f"{redis_server.url}?client_name={name}"
    user = redis.asyncio.Redis.from_url(url) if via == "client" else None
    lease_store = (
        RedisLeaseStore(unique_project, client=user, max_connections=1)
        if user is not None
        else RedisLeaseStore(unique_project, url=url, max_connections=1)
    )

    def store_connections() -> int:
        with redis_server.client() as client:
            return sum(1 for c in client.client_list() if c["name"] == name)

    listener = asyncio.create_task(lease_store.listen_releases(lambda _jobs: None))
    try:
        assert lease_store.max_connections == 1
        await listening(listener, numsub(redis_server, unique_project))
        await claims_and_an_elect(lease_store, 10)
        # One for the claims, one for the election, one for the subscription.
        assert store_connections() == 3
    finally:
        await cancelled(listener)
        await lease_store.aclose()
        if user is not None:
            await user.aclose()


def test_item5_max_connections_is_checked_and_defaults_small(unique_project: str) -> None:
    assert DEFAULT_MAX_CONNECTIONS <= 8
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_connections"):
            RedisLeaseStore(unique_project, url="redis://127.0.0.1:1/0", max_connections=bad)  # type: ignore[arg-type]


# --- item 9: the release subscription's keepalive ----------------------------------------------


async def test_item9_a_silently_dead_subscription_raises(
    redis_server: RedisServer, unique_project: str
) -> None:
    async with FaultProxy(HOST, redis_server.port) as proxy:
        lease_store = RedisLeaseStore(unique_project, url=proxy.url, connect_timeout_s=1.0)
        listener = asyncio.create_task(
            lease_store.listen_releases(lambda _jobs: None, keepalive_s=KEEPALIVE_S)
        )
        try:
            await listening(listener, numsub(redis_server, unique_project))
            await asyncio.sleep(3 * KEEPALIVE_S)  # idle, but answering its pings: still up
            assert not listener.done()
            proxy.blackhole()
            dead_at = time.monotonic()
            with pytest.raises(ConnectionError, match="no reply"):
                await asyncio.wait_for(listener, 3 * KEEPALIVE_S + SLACK_S)
            detected_s = time.monotonic() - dead_at
            print(f"dead release subscription detected after {detected_s * 1000:.0f} ms")
            assert detected_s <= 2 * KEEPALIVE_S + SLACK_S
        finally:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)
            await lease_store.aclose()


async def test_item9_a_new_subscription_hears_releases_after_the_old_one_died(
    redis_server: RedisServer, unique_project: str
) -> None:
    """As in a failover that left the old connections open but dead: the listener raises, and
    the caller's next subscription, on a new connection, hears releases again."""
    subscribers = numsub(redis_server, unique_project)
    heard: list[str] = []
    async with FaultProxy(HOST, redis_server.port) as proxy:
        lease_store = RedisLeaseStore(unique_project, url=proxy.url, connect_timeout_s=1.0)
        first = asyncio.create_task(
            lease_store.listen_releases(
                lambda _jobs: heard.append("first"), keepalive_s=KEEPALIVE_S
            )
        )
        second: asyncio.Task[None] | None = None
        try:
            await listening(first, subscribers)
            proxy.silence_existing()
            with pytest.raises(ConnectionError):
                await asyncio.wait_for(first, 3 * KEEPALIVE_S + SLACK_S)
            before = subscribers()  # the server may still count the dead connection

            task = asyncio.create_task(
                lease_store.listen_releases(
                    lambda _jobs: heard.append("second"), keepalive_s=KEEPALIVE_S
                )
            )
            second = task
            await wait_until(
                lambda: task.done() or subscribers() > before, 3.0, "the new listener subscribed"
            )
            assert not task.done(), task
            reply = (await lease_store.elect("n1", [LeaseRequest("job", TTL_S)]))[0]
            assert reply.held and reply.value is not None
            assert await lease_store.release("n1", {"job": reply.value}) == 1
            await wait_until(lambda: heard == ["second"], 2.0, "the new listener hears it")
        finally:
            for listener in (first, second):
                if listener is not None:
                    listener.cancel()
                    await asyncio.gather(listener, return_exceptions=True)
            await lease_store.aclose()


async def test_item9_a_subscription_that_cannot_connect_raises(
    redis_server: RedisServer, unique_project: str
) -> None:
    async with FaultProxy(HOST, redis_server.port) as proxy:
        proxy.blackhole()  # the TCP connection opens; the handshake never gets an answer
        lease_store = RedisLeaseStore(unique_project, url=proxy.url, connect_timeout_s=0.2)
        try:
            began = time.monotonic()
            with pytest.raises(ConnectionError):
                await asyncio.wait_for(
                    lease_store.listen_releases(lambda _jobs: None, keepalive_s=KEEPALIVE_S), 5.0
                )
            assert time.monotonic() - began <= 0.2 + KEEPALIVE_S + SLACK_S
        finally:
            await lease_store.aclose()


# --- item 10: a replica instead of the primary -------------------------------------------------


# A primary starts a (diskless) sync at once, not after the default 5 s wait for more replicas.
PRIMARY_ARGS = ("--repl-diskless-sync-delay", "0")


@pytest.fixture
def primary_and_replica(fresh_redis: RedisServerFactory) -> tuple[RedisServer, RedisServer]:
    primary = fresh_redis(extra_args=PRIMARY_ARGS)
    replica = fresh_redis(extra_args=["--replicaof", HOST, str(primary.port)])
    replica.wait_replica_synced()
    return primary, replica


async def test_item10_electing_on_a_replica_raises_store_read_only(
    primary_and_replica: tuple[RedisServer, RedisServer], unique_project: str
) -> None:
    _, replica = primary_and_replica
    lease_store = RedisLeaseStore(unique_project, url=replica.url)
    try:
        with pytest.raises(StoreReadOnly) as raised:
            await lease_store.elect("n1", [LeaseRequest("job", TTL_S)])
    finally:
        await lease_store.aclose()
    assert isinstance(raised.value, ConnectionError)
    message = str(raised.value)
    assert f"127.0.0.1:{replica.port}" in message
    assert "read-only replica" in message and "point redis_url at the primary" in message


async def test_item10_a_replica_is_refused_also_while_others_hold_every_lock(
    primary_and_replica: tuple[RedisServer, RedisServer], unique_project: str
) -> None:
    """Nothing to write (every lock is held by a node on the primary), so no READONLY error:
    the server's role still gives the replica away."""
    primary, replica = primary_and_replica
    on_primary = RedisLeaseStore(unique_project, url=primary.url)
    on_replica = RedisLeaseStore(unique_project, url=replica.url)
    lock = _keys.job_key(unique_project, "job", "lock")
    try:
        assert (await on_primary.elect("n1", [LeaseRequest("job", 60.0)]))[0].held
        with replica.client() as client:
            await wait_until(lambda: client.exists(lock) == 1, 3.0, "the lock replicated")
        with pytest.raises(StoreReadOnly, match="is a replica"):
            await on_replica.elect("n2", [LeaseRequest("job", 60.0)])
        with pytest.raises(StoreReadOnly):  # every round, not only the first
            await on_replica.elect("n2", [LeaseRequest("job", 60.0)])
    finally:
        await on_primary.aclose()
        await on_replica.aclose()


async def test_item10_a_primary_demoted_to_replica_is_refused(
    primary_and_replica: tuple[RedisServer, RedisServer],
    fresh_redis: RedisServerFactory,
    unique_project: str,
) -> None:
    """A store that saw a primary, which then became a replica (a failover, REPLICAOF): a
    renewal, a claim and a release are each refused by the script's plain write."""
    primary, _ = primary_and_replica
    other = fresh_redis(extra_args=PRIMARY_ARGS)
    lease_store = RedisLeaseStore(unique_project, url=primary.url)
    lock = _keys.job_key(unique_project, "job", "lock")
    try:
        [reply] = await lease_store.elect("n1", [LeaseRequest("job", 60.0)])
        assert reply.held and reply.value is not None
        with other.client() as client:  # the new primary has the lock too
            client.set(lock, reply.value, px=60_000)
        with primary.client() as client:
            client.replicaof(HOST, other.port)
        await asyncio.to_thread(primary.wait_replica_synced)

        with pytest.raises(StoreReadOnly, match="read-only replica"):
            await lease_store.elect("n1", [LeaseRequest("job", 60.0, reply.value)])
        with pytest.raises(StoreReadOnly):
            await lease_store.claim("job", reply.value, 1_000)
        with pytest.raises(StoreReadOnly):
            await lease_store.release("n1", {"job": reply.value})
        with other.client() as client:
            assert client.get(lock) == reply.value
    finally:
        await lease_store.aclose()


# --- item 11: instants ahead of the store's clock ----------------------------------------------


async def test_item11_an_instant_ahead_is_not_recorded(
    store: RedisLeaseStore, redis_server: RedisServer, unique_project: str
) -> None:
    [reply] = await store.elect("n1", [LeaseRequest("job", TTL_S)])
    assert reply.value is not None
    now_us = int(datetime.now(UTC).timestamp() * 1_000_000)
    year_us = 365 * 24 * 3600 * 1_000_000

    assert await store.claim("job", reply.value, now_us + year_us) == -2
    with redis_server.client() as client:
        assert client.exists(_keys.job_key(unique_project, "job", "last")) == 0
    assert await store.claim("job", reply.value, now_us) == 1
