"""Checkpoint records (issue 12) in the lease stores, on real time.

Every test in the first part runs twice: on :class:`MemoryLeaseStore` with the system clock,
and on :class:`RedisLeaseStore` against the suite's shared redis-server. The second part checks
what only Redis has: the hash's layout, the scripts' cost, keys of another type, a paused
server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone

import pytest
import redis
from redis.crc import key_slot
from servers import RedisServer, RedisServerFactory
from waiting import wait_until

from fastapi_singletonjob._checkpoint import (
    DEFAULT_MAX_STATE_BYTES,
    MAX_ERROR_CHARS,
    Checkpoint,
    FinishedRun,
    JSONValue,
    StateSave,
    encode_state,
    to_unix_us,
)
from fastapi_singletonjob._clock import SYSTEM_CLOCK, SystemClock
from fastapi_singletonjob._errors import ConfigurationError
from fastapi_singletonjob._outcomes import Outcome
from fastapi_singletonjob._run.recorder import Recorder
from fastapi_singletonjob._store import keys as _keys
from fastapi_singletonjob._store.base import LeaseRequest, Store
from fastapi_singletonjob._store.memory import MemoryLeaseStore
from fastapi_singletonjob._store.records import RunArgs, run_arg
from fastapi_singletonjob._store.redis.store import RedisLeaseStore
from fastapi_singletonjob.testing import FakeClock

JOB = "export"
TTL_S = 5.0
RETENTION_S = 7 * 24 * 3600.0
SCHEDULED = datetime(2024, 5, 17, 3, 0, 0, 123457, tzinfo=UTC)
CLOCKS_APART = timedelta(seconds=2)
"""How far the store's clock (this host's: a local redis-server, or the system clock) may be
from the test's reading of it around a call, on a busy machine."""


@dataclass
class Case:
    """One store under test, and how to write its keys as an operator would: a lock
    (``set_lock(job, value, ttl_s)``) and a checkpoint's raw fields (``set_fields``)."""

    store: Store
    set_lock: Callable[[str, str, float], None]
    set_fields: Callable[[str, Mapping[str, str]], None]


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def case(request: pytest.FixtureRequest, unique_project: str) -> AsyncIterator[Case]:
    if request.param == "memory":
        memory = MemoryLeaseStore(unique_project, SystemClock())
        yield Case(memory, memory.set_lock, memory.set_checkpoint_fields)
        await memory.aclose()
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    store = RedisLeaseStore(unique_project, url=request.getfixturevalue("redis_url"))
    with server.client() as inspector:

        def set_lock(job: str, value: str, ttl_s: float) -> None:
            inspector.set(_keys.job_key(unique_project, job, "lock"), value, px=round(ttl_s * 1000))

        def set_fields(job: str, fields: Mapping[str, str]) -> None:
            key = _keys.job_key(unique_project, job, "checkpoint")
            inspector.delete(key)
            inspector.hset(key, mapping=dict(fields))

        try:
            yield Case(store, set_lock, set_fields)
        finally:
            await store.aclose()


async def new_term(store: Store, node: str, ttl_s: float = TTL_S) -> int:
    """Acquire the (free) lock of ``JOB``; return the new term's token."""
    [reply] = await store.elect(f"{node}#nonce", [LeaseRequest(JOB, ttl_s)])
    assert reply.held and reply.token is not None, reply
    return reply.token


async def record(
    store: Store,
    token: int,
    node: str = "n1",
    outcome: Outcome = Outcome.SUCCESS,
    error: str | None = None,
    *,
    at: datetime = SCHEDULED,
    retention_s: float = RETENTION_S,
) -> Checkpoint | None:
    """Record one run; the record as stored after it (read back), or None when its term is
    over."""
    run = FinishedRun(JOB, token, node, outcome, at, error, retention_s)
    recorded = await store.record_runs([run])
    if recorded.iterations == [None]:
        return None
    checkpoint = await store.read_checkpoint(JOB)
    assert checkpoint is not None and checkpoint.iteration == recorded.iterations[0]
    assert checkpoint.last_completed_at == recorded.at
    return checkpoint


def run_of(token: int) -> FinishedRun:
    return FinishedRun(JOB, token, "n1", Outcome.SUCCESS, SCHEDULED, None, RETENTION_S)


async def save(
    store: Store, token: int, value: object, node: str = "n1", retention_s: float = RETENTION_S
) -> bool:
    return await store.save_state(
        StateSave(JOB, token, node, encode_state(JOB, value), retention_s)
    )


# --- both stores -------------------------------------------------------------------------------


async def test_no_checkpoint_before_the_first_run(case: Case) -> None:
    assert await case.store.read_checkpoint(JOB) is None
    assert await case.store.reset_checkpoint(JOB) is False


async def test_the_first_run_creates_iteration_1(case: Case) -> None:
    token = await new_term(case.store, "n1")

    before = datetime.now(UTC)
    written = await record(case.store, token)

    assert written is not None and written.last_completed_at is not None
    assert before - CLOCKS_APART <= written.last_completed_at <= datetime.now(UTC) + CLOCKS_APART
    assert written == Checkpoint(
        iteration=1,
        last_completed_at=written.last_completed_at,
        last_scheduled_at=SCHEDULED,
        last_outcome="success",
        last_error=None,
        node_id="n1",
        fencing_token=token,
        state=None,
    )
    assert await case.store.read_checkpoint(JOB) == written


async def test_a_success_adds_one_and_clears_the_error(case: Case) -> None:
    token = await new_term(case.store, "n1")
    await record(case.store, token)
    await record(case.store, token, outcome=Outcome.FAILED, error="ValueError: boom")
    later = SCHEDULED + timedelta(minutes=1)

    written = await record(case.store, token, error="ignored on success", at=later)

    assert written is not None
    assert (written.iteration, written.last_outcome, written.last_error) == (2, "success", None)
    assert written.last_scheduled_at == later
    assert await case.store.read_checkpoint(JOB) == written


@pytest.mark.parametrize("outcome", [Outcome.FAILED, Outcome.TIMEOUT, Outcome.CANCELLED])
async def test_a_run_that_did_not_succeed_keeps_iteration_and_state(
    case: Case, outcome: Outcome
) -> None:
    token = await new_term(case.store, "n1")
    await record(case.store, token)
    assert await save(case.store, token, {"after_id": 41})
    later = SCHEDULED + timedelta(minutes=1)
    error = "RuntimeError: " + "x" * 2000

    written = await record(case.store, token, outcome=outcome, error=error, at=later)

    assert written is not None
    assert written.iteration == 1
    assert written.state == {"after_id": 41}
    assert written.last_outcome == outcome.value
    assert written.last_scheduled_at == later
    assert written.last_completed_at is not None
    assert abs(written.last_completed_at - datetime.now(UTC)) <= CLOCKS_APART
    assert written.last_error is not None
    assert len(written.last_error) == MAX_ERROR_CHARS
    assert written.last_error == error[: MAX_ERROR_CHARS - 1] + "\u2026"
    assert await case.store.read_checkpoint(JOB) == dataclasses.replace(
        written, state={"after_id": 41}
    )


async def test_an_error_that_is_not_valid_unicode_is_stored(case: Case) -> None:
    token = await new_term(case.store, "n1")
    written = await record(case.store, token, outcome=Outcome.FAILED, error="bad \ud800 text")
    assert written is not None and written.last_error == "bad ? text"


async def test_a_stale_term_is_refused_once_another_began(case: Case) -> None:
    old = await new_term(case.store, "n1", ttl_s=0.2)
    await record(case.store, old)
    assert await save(case.store, old, ["cursor", 1])
    before = await case.store.read_checkpoint(JOB)
    await asyncio.sleep(0.25)  # the old lease runs out; n1 is partitioned and does not know
    new = await new_term(case.store, "n2")

    assert await record(case.store, old) is None
    assert await record(case.store, old, outcome=Outcome.FAILED, error="late") is None
    assert await save(case.store, old, ["cursor", 99]) is False
    assert await case.store.read_checkpoint(JOB) == before

    written = await record(case.store, new, node="n2")
    assert written is not None and before is not None
    assert written.iteration == 2 and written.state == ["cursor", 1]
    assert (written.node_id, written.fencing_token) == ("n2", new)


async def test_a_term_is_refused_once_its_lock_expired(case: Case) -> None:
    token = await new_term(case.store, "n1", ttl_s=0.2)
    await record(case.store, token)
    before = await case.store.read_checkpoint(JOB)
    await asyncio.sleep(0.25)

    assert await record(case.store, token) is None
    assert await save(case.store, token, "late") is False
    assert await case.store.read_checkpoint(JOB) == before


@pytest.mark.parametrize("lock", [None, "not-a-lock-value", "{token}", "{other}|n1#nonce"])
async def test_no_lock_of_the_term_refuses_and_creates_nothing(
    case: Case, lock: str | None
) -> None:
    token = 1_700_000_000_000_001
    if lock is not None:
        case.set_lock(JOB, lock.format(token=token, other=token + 1), TTL_S)

    assert await record(case.store, token) is None
    assert await save(case.store, token, {"a": 1}) is False
    assert await case.store.read_checkpoint(JOB) is None


async def test_a_term_written_by_hand_may_write(case: Case) -> None:
    """Only the token counts, compared exactly: a token above 2^53 (a double would round it)."""
    token = 2**62 + 1
    case.set_lock(JOB, f"{token}|n1#nonce", TTL_S)

    assert await record(case.store, token - 1) is None
    written = await record(case.store, token)
    assert written is not None and written.fencing_token == token


def _nested(depth: int) -> JSONValue:
    value: JSONValue = {"deepest": depth}
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


STATES: dict[str, JSONValue] = {
    "nested": {"a": {"b": [1, 2, {"c": None, "d": [True, False]}]}, "e": "f"},
    "empty-list": [],
    "empty-dict": {},
    "empties": [[], {}, [[]], {"x": {}}, ""],
    "unicode": {"grüße": "東京 🎉 \u2028 \x00 \"'\\"},
    "big-ints": [2**53 + 1, -(2**63), 2**64 + 7, 10**40],
    "floats": [0.1, 1e-300, 1.7976931348623157e308, -0.0, 5e-324, 123456789.123456789],
    "scalar-int": 2**53 + 1,
    "scalar-str": "cursor-after-8812",
    "scalar-bool": False,
    "null": None,
    "deep": _nested(60),
}


@pytest.mark.parametrize("state", STATES.values(), ids=STATES.keys())
async def test_save_state_round_trips_exactly(case: Case, state: JSONValue) -> None:
    token = await new_term(case.store, "n1")
    await record(case.store, token)

    assert await save(case.store, token, state)
    read = await case.store.read_checkpoint(JOB)

    assert read is not None
    assert read.state == state
    # Equality holds for 1 == 1.0 == True too: the JSON text shows the types.
    assert json.dumps(read.state) == json.dumps(state)
    assert read.iteration == 1  # only the state changed


async def test_state_at_the_size_limit_round_trips(case: Case) -> None:
    token = await new_term(case.store, "n1")
    state = "é" * ((DEFAULT_MAX_STATE_BYTES - 2) // 2)  # 2 bytes each, and 2 quotes
    assert len(encode_state(JOB, state).encode()) == DEFAULT_MAX_STATE_BYTES

    assert await save(case.store, token, state)
    read = await case.store.read_checkpoint(JOB)
    assert read is not None and read.state == state


async def test_save_state_before_the_first_run_ends_starts_at_iteration_0(case: Case) -> None:
    token = await new_term(case.store, "n1")

    assert await save(case.store, token, {"after_id": 7})

    assert await case.store.read_checkpoint(JOB) == Checkpoint(
        iteration=0, node_id="n1", fencing_token=token, state={"after_id": 7}
    )
    written = await record(case.store, token)
    assert written is not None and written.iteration == 1
    after = await case.store.read_checkpoint(JOB)
    assert after is not None and after.state == {"after_id": 7}


async def test_a_run_is_stamped_and_read_on_the_stores_clock(case: Case) -> None:
    token = await new_term(case.store, "n1")
    assert (await case.store.load_checkpoint(JOB))[0] is None
    before = datetime.now(UTC)

    written = await record(case.store, token, at=SCHEDULED)  # the writer's instant: 2024
    read, store_now, _ = await case.store.load_checkpoint(JOB)

    assert read == written and read is not None and read.last_completed_at is not None
    assert before - CLOCKS_APART <= read.last_completed_at <= store_now
    assert abs(store_now - datetime.now(UTC)) <= CLOCKS_APART
    assert store_now.tzinfo == UTC


async def test_the_memory_store_stamps_and_reads_its_clocks_now(unique_project: str) -> None:
    clock = FakeClock(SCHEDULED)
    store = MemoryLeaseStore(unique_project, clock)
    token = await new_term(store, "n1")
    await clock.advance(2.5)

    written = await record(store, token)
    await clock.advance(1.0)

    assert written is not None
    assert written.last_completed_at == SCHEDULED + timedelta(seconds=2.5)
    assert await store.load_checkpoint(JOB) == (written, SCHEDULED + timedelta(seconds=3.5), None)


MOMENTS = {
    "microseconds": datetime(2024, 2, 29, 23, 59, 59, 999999, tzinfo=UTC),
    "epoch": datetime(1970, 1, 1, tzinfo=UTC),
    "year-9999": datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    "other-zone": datetime(2024, 7, 1, 9, 30, 0, 1, tzinfo=timezone(timedelta(hours=8))),
}


@pytest.mark.parametrize("moment", MOMENTS.values(), ids=MOMENTS.keys())
async def test_times_round_trip_to_the_microsecond(case: Case, moment: datetime) -> None:
    token = await new_term(case.store, "n1")

    await record(case.store, token, at=moment)

    read = await case.store.read_checkpoint(JOB)
    assert read is not None
    assert read.last_scheduled_at == moment
    assert read.last_scheduled_at.tzinfo == UTC


async def test_reset_deletes_the_record(case: Case) -> None:
    token = await new_term(case.store, "n1")
    await record(case.store, token)
    await record(case.store, token)

    assert await case.store.reset_checkpoint(JOB) is True
    assert await case.store.read_checkpoint(JOB) is None
    assert await case.store.reset_checkpoint(JOB) is False
    written = await record(case.store, token)
    assert written is not None and written.iteration == 1


async def test_the_record_expires_after_its_retention_and_each_write_renews_it(
    case: Case,
) -> None:
    retention_s = 0.6
    token = await new_term(case.store, "n1")
    started = time.monotonic()
    await record(case.store, token, retention_s=retention_s)
    await asyncio.sleep(0.4)
    assert await save(case.store, token, 1, retention_s=retention_s)
    renewed = time.monotonic()
    await asyncio.sleep(0.4)  # past the first write's retention, within the second's

    assert await case.store.read_checkpoint(JOB) is not None, time.monotonic() - started
    gone = await wait_until(lambda: _absent(case.store), 2.0, "the record expired", poll_s=0.02)
    assert retention_s - 0.05 <= gone - renewed <= retention_s + 0.5


async def _absent(store: Store) -> bool:
    return await store.read_checkpoint(JOB) is None


NOT_RECORDS = {
    "bad-iteration": {"iteration": "many", "state": "[1]"},
    "no-iteration": {"state": "[1]", "node_id": "n9"},
    "negative": {"iteration": "-1"},
    "too-long": {"iteration": "1" * 19},
    "non-ascii-digits": {"iteration": "\u0661\u0662"},
}


@pytest.mark.parametrize("fields", NOT_RECORDS.values(), ids=NOT_RECORDS.keys())
async def test_a_record_that_is_not_one_reads_as_none_and_the_next_write_replaces_it(
    case: Case, fields: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    token = await new_term(case.store, "n1")
    case.set_fields(JOB, fields)

    with caplog.at_level(logging.WARNING, "fastapi_singletonjob"):
        assert await case.store.read_checkpoint(JOB) is None
    assert f"job {JOB!r}" in caplog.text and "reset the checkpoint" in caplog.text

    written = await record(case.store, token)
    assert written is not None
    assert written.iteration == 1
    after = await case.store.read_checkpoint(JOB)
    assert after is not None and after.state is None  # nothing of the old hash is kept
    assert await case.store.read_checkpoint(JOB) == written


async def test_save_state_replaces_a_record_that_is_not_one(case: Case) -> None:
    token = await new_term(case.store, "n1")
    case.set_fields(JOB, {"iteration": "x", "last_outcome": "success"})

    assert await save(case.store, token, [1])

    assert await case.store.read_checkpoint(JOB) == Checkpoint(
        iteration=0, node_id="n1", fencing_token=token, state=[1]
    )


async def test_a_field_that_does_not_parse_reads_as_none(
    case: Case, caplog: pytest.LogCaptureFixture
) -> None:
    token = await new_term(case.store, "n1")
    case.set_fields(
        JOB,
        {
            "iteration": "3",
            "state": "{not json",
            "last_completed_us": "soon",
            "last_scheduled_us": "9" * 19,  # beyond datetime's range
            "fencing_token": "-5",
            "node_id": "n7",
            "future_field": "ignored",
        },
    )

    with caplog.at_level(logging.WARNING, "fastapi_singletonjob"):
        read = await case.store.read_checkpoint(JOB)

    assert read == Checkpoint(iteration=3, node_id="n7")
    for name in ("state", "last_completed_us", "last_scheduled_us", "fencing_token"):
        assert name in caplog.text
    written = await record(case.store, token)
    assert written is not None and written.iteration == 4


# --- values refused before any traffic -----------------------------------------------------------


class Opaque:
    pass


BAD_STATES: dict[str, tuple[object, str]] = {
    "datetime": ({"at": SCHEDULED}, "the state['at'] is of type datetime"),
    "tuple": ({"cursor": (1, 2)}, "the state['cursor'] is of type tuple"),
    "set": ({1, 2}, "the state is of type set"),
    "int-key": ({"a": {1: "x"}}, "the state['a'] has the key 1 (int, not str)"),
    "nan": ([1.0, float("nan")], "the state[1] is nan"),
    "infinity": ({"x": float("inf")}, "the state['x'] is inf"),
    "object": (Opaque(), "the state is of type Opaque"),
    "bytes": (b"raw", "the state is of type bytes"),
    "surrogate": (["\ud800"], "lone surrogate"),
}


@pytest.mark.parametrize(("value", "why"), BAD_STATES.values(), ids=BAD_STATES.keys())
def test_a_value_that_is_not_json_is_refused(value: object, why: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        encode_state(JOB, value)

    message = str(caught.value)
    assert message.startswith(f"job {JOB!r}: save_state() takes a JSON value")
    assert why in message
    assert "pass dicts with str keys, lists" in message  # the fix
    assert (caught.value.job, caught.value.field) == (JOB, "state")


def test_a_value_that_contains_itself_is_refused() -> None:
    value: list[object] = [1]
    value.append({"again": value})
    with pytest.raises(ConfigurationError, match=r"the state\[1\]\['again'\] contains itself"):
        encode_state(JOB, value)


def test_a_value_over_the_limit_is_refused() -> None:
    value = {"rows": ["x" * 100] * 700}
    size = len(json.dumps(value, separators=(",", ":")))

    with pytest.raises(ConfigurationError) as caught:
        encode_state(JOB, value)

    message = str(caught.value)
    assert f"job {JOB!r}" in message
    assert f"{size} bytes" in message and f"limit of {DEFAULT_MAX_STATE_BYTES} bytes" in message
    assert "save a cursor" in message and "max_state_bytes" in message
    assert encode_state(JOB, value, max_bytes=size) == json.dumps(value, separators=(",", ":"))
    with pytest.raises(ConfigurationError, match=f"{size} bytes"):
        encode_state(JOB, value, max_bytes=size - 1)


@pytest.mark.parametrize("max_bytes", [0, -1, True, 1.5, "64k"])
def test_a_bad_size_limit_is_refused(max_bytes: object) -> None:
    with pytest.raises(ConfigurationError, match="max_state_bytes=.* at least 1") as caught:
        encode_state(JOB, {}, max_bytes)  # type: ignore[arg-type]
    assert caught.value.field == "max_state_bytes"


def test_encode_state_is_compact_and_keeps_unicode() -> None:
    assert encode_state(JOB, {"a": [1, "é"], "b": None}) == '{"a":[1,"é"],"b":null}'


# --- Redis only ----------------------------------------------------------------------------------


@pytest.fixture
async def store(unique_project: str, redis_url: str) -> AsyncIterator[RedisLeaseStore]:
    lease_store = RedisLeaseStore(unique_project, url=redis_url)
    try:
        yield lease_store
    finally:
        await lease_store.aclose()


@pytest.mark.redis
async def test_redis_layout(
    store: RedisLeaseStore, redis_server: RedisServer, unique_project: str
) -> None:
    token = await new_term(store, "web-1")
    await record(store, token, "web-1", Outcome.FAILED, "KeyError: 'x'")
    await store.save_state(StateSave(JOB, token, "web-1", '{"after":[1,2.5]}', RETENTION_S))
    key = _keys.job_key(unique_project, JOB, "checkpoint")

    with redis_server.client() as client:
        assert key == f"singletonjob:{{{unique_project}}}:{JOB}:checkpoint"
        # The lock's hash tag: one slot, so one script can read the lock and write the record.
        assert key_slot(key.encode()) == key_slot(
            _keys.job_key(unique_project, JOB, "lock").encode()
        )
        assert client.type(key) == "hash"
        fields = client.hgetall(key)
        seconds, micros = client.time()  # the server's clock stamped the run's end
        stamp_us = int(fields["last_completed_us"])
        assert 0 <= seconds * 10**6 + micros - stamp_us < 5 * 10**6
        assert fields == {
            "iteration": "0",
            "last_scheduled_us": "1715914800123457",
            "last_completed_us": str(stamp_us),
            "last_outcome": "failed",
            "last_error": "KeyError: 'x'",
            "node_id": "web-1",
            "fencing_token": str(token),
            "state": '{"after":[1,2.5]}',
        }
        ttl_ms = client.pttl(key)
        assert RETENTION_S * 1000 - 5000 <= ttl_ms <= RETENTION_S * 1000
        print(f"MEMORY USAGE of a checkpoint record: {client.memory_usage(key)} B")


def _calls(client: redis.Redis) -> dict[str, int]:
    """Calls per command so far, leaving out the INFO calls that read them."""
    stats = client.info("commandstats")
    return {k[len("cmdstat_") :]: int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info"}


@pytest.mark.redis
async def test_redis_one_write_is_one_script_call(
    fresh_redis: RedisServerFactory, unique_project: str
) -> None:
    server = fresh_redis()
    store = RedisLeaseStore(unique_project, url=server.url)
    runs = 200
    try:
        token = await new_term(store, "n1")
        await record(store, token)  # loads the script
        await save(store, token, {"after_id": 1})
        with server.client() as client:
            client.config_resetstat()
            before = _calls(client)
            await store.record_runs([run_of(token)])
            after = _calls(client)
            assert await save(store, token, {"after_id": 2})
            saved = _calls(client)
            assert await store.read_checkpoint(JOB) is not None
            read = _calls(client)
            assert (await store.load_checkpoint(JOB))[0] is not None
            loaded = _calls(client)
            client.config_resetstat()
            started = time.perf_counter()
            for _ in range(runs):
                await store.record_runs([run_of(token)])
            elapsed_s = time.perf_counter() - started
            script = client.info("commandstats")["cmdstat_evalsha"]
    finally:
        await store.aclose()

    delta = {name: n - before.get(name, 0) for name, n in after.items() if n > before.get(name, 0)}
    assert delta.pop("evalsha") == 1
    assert set(delta) <= {
        "time",
        *("get", "type", "hget", "hincrby", "hset", "hdel", "pexpire", "hmget"),
    }
    delta = {name: n - after.get(name, 0) for name, n in saved.items() if n > after.get(name, 0)}
    assert delta.pop("evalsha") == 1
    assert set(delta) <= {"get", "type", "hget", "hincrby", "hset", "pexpire"}
    delta = {name: n - saved.get(name, 0) for name, n in read.items() if n > saved.get(name, 0)}
    assert delta == {"hgetall": 1}
    delta = {name: n - read.get(name, 0) for name, n in loaded.items() if n > read.get(name, 0)}
    assert delta == {"hgetall": 1, "time": 1}  # one pipeline: one round trip
    print(
        f"record_runs: 1 round trip, {script['usec_per_call']} µs of script time on the server, "
        f"{elapsed_s / runs * 1e6:.0f} µs per call seen by the client ({runs} calls)"
    )


@contextlib.asynccontextmanager
async def redis_recorder(
    server: RedisServer, project: str
) -> AsyncIterator[tuple[RedisLeaseStore, Recorder]]:
    """A store of ``project`` on ``server`` and a ``Recorder`` on it, both closed after."""
    store = RedisLeaseStore(project, url=server.url)
    recorder = Recorder(store, clock=SYSTEM_CLOCK)
    try:
        yield store, recorder
    finally:
        await recorder.aclose()
        await store.aclose()


@pytest.mark.redis
async def test_redis_runs_that_end_together_are_recorded_in_one_call_each_fenced(
    fresh_redis: RedisServerFactory, unique_project: str
) -> None:
    """The records put in one turn of the event loop go together (``Recorder``): one script
    call for 51 jobs ending on one instant, and each job of the batch is fenced on its own (a
    stale token is refused without refusing the others)."""
    server = fresh_redis()
    jobs = [f"job-{i}" for i in range(51)]
    told: dict[str, object] = {}

    def tell(run: FinishedRun, put_at: float, iteration: object, at: object) -> None:
        told[run.job] = iteration

    async with redis_recorder(server, unique_project) as (store, recorder):
        replies = await store.elect("n1#nonce", [LeaseRequest(job, TTL_S) for job in jobs])
        tokens = [reply.token for reply in replies]
        assert all(token is not None for token in tokens)
        stale = jobs[7]
        await store.record_runs([])  # loads the script
        with server.client() as client:
            client.delete(_keys.job_key(unique_project, stale, "lock"))  # its term is over
            client.config_resetstat()
            for job, token in zip(jobs, tokens, strict=True):
                assert token is not None
                run = FinishedRun(job, token, "n1", Outcome.SUCCESS, SCHEDULED, None, RETENTION_S)
                recorder.put(run, 5.0, tell)
            await wait_until(lambda: len(told) == len(jobs), 5.0, "every record answered")
            calls = _calls(client)
            stored = {
                job: client.hget(_keys.job_key(unique_project, job, "checkpoint"), "iteration")
                for job in jobs
            }

    assert calls.get("evalsha", 0) == 1, calls
    for job in jobs:
        if job == stale:
            assert told[job] is None and stored[job] is None
        else:
            assert told[job] == 1 and stored[job] == "1", (job, told[job])


@pytest.mark.redis
async def test_redis_a_record_callback_that_raises_keeps_no_other_from_hearing(
    fresh_redis: RedisServerFactory, unique_project: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The answers of one call go to each record's callback in order: one that raises is
    logged, and the records after it in the same call still hear theirs."""
    jobs = [f"job-{i}" for i in range(5)]
    told: dict[str, object] = {}

    def tell(run: FinishedRun, put_at: float, iteration: object, at: object) -> None:
        told[run.job] = iteration
        if run.job in ("job-1", "job-3"):
            raise RuntimeError(f"callback of {run.job} broke")

    async with redis_recorder(fresh_redis(), unique_project) as (store, recorder):
        replies = await store.elect("n1#nonce", [LeaseRequest(job, TTL_S) for job in jobs])
        await store.record_runs([])  # loads the script: the five go in one call
        with caplog.at_level(logging.ERROR, logger="fastapi_singletonjob"):
            for reply in replies:
                assert reply.token is not None
                run = FinishedRun(
                    reply.job, reply.token, "n1", Outcome.SUCCESS, SCHEDULED, None, RETENTION_S
                )
                recorder.put(run, 5.0, tell)
            await wait_until(lambda: len(told) == len(jobs), 5.0, "every record answered")

    assert told == dict.fromkeys(jobs, 1)
    broke = [r for r in caplog.records if "callback failed" in r.getMessage()]
    assert len(broke) == 2 and all(r.exc_info for r in broke), broke


@pytest.mark.redis
async def test_redis_a_bad_value_fails_before_any_traffic(
    fresh_redis: RedisServerFactory, unique_project: str
) -> None:
    server = fresh_redis()
    store = RedisLeaseStore(unique_project, url=server.url)
    try:
        token = await new_term(store, "n1")
        with server.client() as client:
            before = _calls(client)
            for value in ({"at": SCHEDULED}, "x" * (DEFAULT_MAX_STATE_BYTES + 1)):
                with pytest.raises(ConfigurationError):
                    await save(store, token, value)
            assert _calls(client) == before
            assert client.exists(_keys.job_key(unique_project, JOB, "checkpoint")) == 0
    finally:
        await store.aclose()


OTHER_TYPES: dict[str, Callable[[redis.Redis, str], object]] = {
    "string": lambda client, key: client.set(key, "garbage"),
    "list": lambda client, key: client.rpush(key, "a", "b"),
    "zset": lambda client, key: client.zadd(key, {"a": 1.0}),
}


@pytest.mark.redis
@pytest.mark.parametrize("write", OTHER_TYPES.values(), ids=OTHER_TYPES.keys())
async def test_redis_a_key_of_another_type_reads_as_none_and_is_replaced(
    store: RedisLeaseStore,
    redis_server: RedisServer,
    unique_project: str,
    write: Callable[[redis.Redis, str], object],
    caplog: pytest.LogCaptureFixture,
) -> None:
    token = await new_term(store, "n1")
    key = _keys.job_key(unique_project, JOB, "checkpoint")
    with redis_server.client() as client:
        write(client, key)
        with caplog.at_level(logging.WARNING, "fastapi_singletonjob"):
            assert await store.read_checkpoint(JOB) is None
            assert (await store.load_checkpoint(JOB))[0] is None
        # Said once, however often it is read (a view polled every second).
        assert caplog.text.count("a key of another type than hash") == 1

        assert await save(store, token, {"a": []})
        assert client.type(key) == "hash"
        client.delete(key)
        write(client, key)
        written = await record(store, token)

    assert written is not None
    assert (written.iteration, written.state) == (1, None)


@pytest.mark.redis
async def test_redis_script_flush_is_survived(
    store: RedisLeaseStore, redis_server: RedisServer
) -> None:
    token = await new_term(store, "n1")
    await record(store, token)
    with redis_server.client() as client:
        client.script_flush()
        written = await record(store, token)  # NOSCRIPT, then the script is sent again
        client.script_flush()
        assert await save(store, token, "s")
    assert written is not None and written.iteration == 2


@pytest.mark.redis
async def test_redis_calls_are_bounded_by_their_timeout(
    fresh_redis: RedisServerFactory, unique_project: str
) -> None:
    server = fresh_redis()
    store = RedisLeaseStore(unique_project, url=server.url)
    try:
        token = await new_term(store, "n1")
        assert await store.read_checkpoint(JOB) is None  # the claims' pool is connected
        await asyncio.to_thread(server.pause)
        try:
            calls = {
                "read the checkpoint": store.read_checkpoint(JOB, timeout_s=0.3),
                "reset the checkpoint": store.reset_checkpoint(JOB, timeout_s=0.3),
                "record a run": store.record_runs(
                    [FinishedRun(JOB, token, "n1", Outcome.SUCCESS, SCHEDULED, None, 9.0)],
                    timeout_s=0.3,
                ),
                "save the state": store.save_state(
                    StateSave(JOB, token, "n1", "1", 60.0), timeout_s=0.3
                ),
            }
            for what, call in calls.items():
                started = time.monotonic()
                with pytest.raises(ConnectionError, match=f"did not {what} of job 'export'"):
                    await call
                assert time.monotonic() - started < 0.3 + 0.5
        finally:
            await asyncio.to_thread(server.resume)
        written = await record(store, token)
        assert written is not None and written.iteration == 1
    finally:
        await store.aclose()


async def test_the_leaders_renewals_keep_the_record_and_only_the_holders(case: Case) -> None:
    """A live job's record never expires: each renewal by the lock's holder pushes its expiry
    back to the retention, in the election's own round trip; a follower's round does not."""
    retention_s = 0.6
    [reply] = await case.store.elect("n1#a", [LeaseRequest(JOB, TTL_S)])
    assert reply.held and reply.value is not None and reply.token is not None
    await record(case.store, reply.token, retention_s=retention_s)
    renewal = LeaseRequest(JOB, TTL_S, reply.value, retention_s)
    began = time.monotonic()
    while time.monotonic() - began < 3 * retention_s:  # well past the write's retention
        [renewed] = await case.store.elect("n1#a", [renewal])
        assert renewed.held
        [other] = await case.store.elect("n2#b", [LeaseRequest(JOB, TTL_S, None, retention_s)])
        assert not other.held
        await asyncio.sleep(retention_s / 4)
    assert await case.store.read_checkpoint(JOB) is not None, "renewals kept the record"
    await wait_until(lambda: _absent(case.store), 2.0, "the record expired", poll_s=0.02)


async def test_any_error_text_and_node_id_round_trip(case: Case) -> None:
    """A record's fields go to ``RECORD_RUN`` packed in one string per run (``run_arg``): an
    error with line breaks, commas and spaces, and a node id with spaces and bars, come back
    exactly."""
    node = "web 1 | eu-west,a"
    token = await new_term(case.store, node)
    error = "ValueError: first line\nsecond, with a comma\n\n  ünïcödé 1,2 -1"

    written = await record(case.store, token, node, Outcome.FAILED, error)

    assert written is not None
    assert (written.node_id, written.last_error, written.last_outcome) == (node, error, "failed")
    assert written.iteration == 0 and written.fencing_token == token


def test_a_calls_runs_are_one_value_each_term_encoded_once_per_job() -> None:
    """``RunArgs`` packs a call's runs in one value, each run's error after its length in
    bytes (non-ASCII text counted in bytes); what a term's runs share is kept per job and
    replaced when the term changes; a job name the script could not build keys from, or a
    node id with a line break, is refused."""
    encode = RunArgs()
    first = FinishedRun("job-1", 7, "n1", Outcome.SUCCESS, SCHEDULED, None, RETENTION_S)
    failed = first._replace(outcome=Outcome.FAILED, error="ünï\ncödé")
    later = first._replace(token=8, node_id="n 2", history=5)

    blob = encode([first, failed, later])

    args = [run_arg(run) for run in (first, failed, later)]
    assert blob == "".join(args).encode()
    assert args[0].endswith(" 0 0 7 604800000 0 job-1 n1\n0:")
    assert args[1].endswith(" 7 604800000 0 job-1 n1\n12:ünï\ncödé")
    assert args[2].endswith(" 8 604800000 5 job-1 n 2\n0:")
    for bad in (first._replace(job="a b"), first._replace(node_id="n\n1")):
        with pytest.raises(ValueError):
            encode([bad])


def test_a_runs_own_fields_encode_alike_on_both_paths() -> None:
    """``RunArgs`` encodes a run with a start inline (the common case, hundreds per call) and
    anything else through ``run_arg``'s own functions: both give the same text, and refuse
    the same values (a naive instant, an outcome that is no ``Outcome``) with the same
    error."""
    encode = RunArgs()
    started = SCHEDULED + timedelta(microseconds=1234)
    run = FinishedRun(
        "job-1", 7, "n1", Outcome.SUCCESS, SCHEDULED, None, RETENTION_S, started, 0.0125, 5
    )
    cases = [
        run,
        run._replace(outcome=Outcome.TIMEOUT, error="TimeoutError: slow"),
        run._replace(duration_s=-1e-7),  # a clock step: never a negative duration
        run._replace(started_at=None),
        run._replace(missed="late", instants=3, last_at=started),
    ]
    for case in cases:
        assert encode([case]) == run_arg(case).encode(), case
    assert run_arg(run).startswith(
        f"r success {to_unix_us(SCHEDULED)} {to_unix_us(started)} 12500 7 "
    )
    for bad in (
        run._replace(scheduled_at=SCHEDULED.replace(tzinfo=None)),
        run._replace(started_at=started.replace(tzinfo=None)),
        run._replace(outcome="bogus"),  # type: ignore[arg-type]
    ):
        with pytest.raises(ValueError) as inline:
            encode([bad])
        with pytest.raises(ValueError) as alone:
            run_arg(bad)
        assert str(inline.value) == str(alone.value)


@pytest.mark.redis
async def test_redis_reads_at_the_start_of_many_terms_go_together(
    fresh_redis: RedisServerFactory, unique_project: str
) -> None:
    """A node that takes 60 jobs at once reads their records in one or two pipelines (one
    ``TIME`` each), not 60: no first run waits in the pool's queue past its period."""
    server = fresh_redis()
    store = RedisLeaseStore(unique_project, url=server.url)
    jobs = [f"job-{i}" for i in range(60)]
    try:
        replies = await store.elect("n1#nonce", [LeaseRequest(job, TTL_S) for job in jobs])
        token = replies[3].token
        assert token is not None
        await store.record_runs(
            [FinishedRun(jobs[3], token, "n1", Outcome.SUCCESS, SCHEDULED, None, RETENTION_S)]
        )
        with server.client() as client:
            client.config_resetstat()
            loaded = await asyncio.gather(*(store.load_checkpoint(job) for job in jobs))
            calls = _calls(client)
    finally:
        await store.aclose()

    assert calls["hgetall"] == len(jobs) and calls["time"] <= 2, calls
    records = [record for record, _, _ in loaded]
    assert records[3] is not None and records[3].iteration == 1
    assert all(record is None for i, record in enumerate(records) if i != 3)
    assert len({now for _, now, _ in loaded}) <= 2
