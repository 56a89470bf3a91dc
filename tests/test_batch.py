"""``Batcher``: one call in flight, the items submitted meanwhile sent together next."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from servers import RedisServerFactory

from fastapi_singletonjob._errors import StoreReadOnly
from fastapi_singletonjob._store.base import LeaseRequest
from fastapi_singletonjob._store.redis.batch import OVERRUN_S, Batcher
from fastapi_singletonjob._store.redis.store import RedisLeaseStore
from fastapi_singletonjob.testing import FakeClock


class Sender:
    """Records each batch; each call waits until released, so that tests control overlap."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.timeouts: list[float] = []
        self.gate = asyncio.Event()
        self.fail: Exception | None = None

    async def __call__(self, items: Sequence[int], timeout_s: float) -> list[int]:
        self.batches.append(list(items))
        self.timeouts.append(timeout_s)
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return [item * 10 for item in items]


async def test_a_lone_item_goes_at_once_and_later_ones_together() -> None:
    sender = Sender()
    batcher: Batcher[int, int] = Batcher(sender)
    first = asyncio.create_task(batcher.submit(1, 5.0))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert sender.batches == [[1]]  # sent without waiting for company
    rest = [asyncio.create_task(batcher.submit(i, 5.0)) for i in (2, 3, 4)]
    await asyncio.sleep(0)
    sender.gate.set()
    assert await first == 10
    assert [await task for task in rest] == [20, 30, 40]
    assert sender.batches == [[1], [2, 3, 4]]


async def test_the_batch_is_bounded_by_the_shortest_time_left() -> None:
    sender = Sender()
    batcher: Batcher[int, int] = Batcher(sender)
    first = asyncio.create_task(batcher.submit(1, 5.0))
    await asyncio.sleep(0)
    rest = [
        asyncio.create_task(batcher.submit(2, 5.0)),
        asyncio.create_task(batcher.submit(3, 2.0)),
    ]
    await asyncio.sleep(0)
    sender.gate.set()
    await asyncio.gather(first, *rest)
    assert 1.5 < sender.timeouts[1] <= 2.0


async def test_an_error_is_each_callers_and_the_next_batch_still_goes() -> None:
    sender = Sender()
    batcher: Batcher[int, int] = Batcher(sender)
    sender.fail = ConnectionError("down")
    sender.gate.set()
    results = await asyncio.gather(
        batcher.submit(1, 5.0), batcher.submit(2, 5.0), return_exceptions=True
    )
    assert all(isinstance(result, ConnectionError) for result in results)
    sender.fail = None
    assert await batcher.submit(3, 5.0) == 30


async def test_each_caller_gets_an_error_of_its_own_caused_by_the_calls() -> None:
    """One exception per waiter (its traceback grows only with its own re-raise), of the
    call's type and message, chained from the call's."""
    sender = Sender()
    batcher: Batcher[int, int] = Batcher(sender)
    failure = StoreReadOnly("the Redis server at x is a replica: point redis_url at the primary")
    sender.fail = failure
    sender.gate.set()
    results = await asyncio.gather(
        batcher.submit(1, 5.0), batcher.submit(2, 5.0), return_exceptions=True
    )
    assert len(sender.batches) == 1
    for result in results:
        assert type(result) is StoreReadOnly and result is not failure
        assert str(result) == str(failure) and result.__cause__ is failure
    assert results[0] is not results[1]


async def test_the_deadlines_are_on_the_injected_clock() -> None:
    clock = FakeClock()
    sender = Sender()
    batcher: Batcher[int, int] = Batcher(sender, clock=clock)
    first = asyncio.create_task(batcher.submit(1, 5.0))
    await asyncio.sleep(0)
    late = asyncio.create_task(batcher.submit(2, 1.0))
    kept = asyncio.create_task(batcher.submit(3, 5.0))
    await asyncio.sleep(0)
    await clock.advance(2.0)  # while the first call is in flight, no real time passing
    sender.gate.set()
    assert await first == 10
    with pytest.raises(ConnectionError, match="time ran out"):
        await late
    assert await kept == 30
    assert sender.batches == [[1], [3]]
    assert sender.timeouts == [5.0, 3.0]


async def test_a_caller_cancelled_before_its_batch_is_left_out() -> None:
    sender = Sender()
    batcher: Batcher[int, int] = Batcher(sender)
    first = asyncio.create_task(batcher.submit(1, 5.0))
    await asyncio.sleep(0)
    gone = asyncio.create_task(batcher.submit(2, 5.0))
    kept = asyncio.create_task(batcher.submit(3, 5.0))
    await asyncio.sleep(0)
    gone.cancel()
    sender.gate.set()
    assert await first == 10 and await kept == 30
    assert sender.batches == [[1], [3]]


async def test_an_item_whose_time_ran_out_while_waiting_is_not_sent() -> None:
    sender = Sender()
    batcher: Batcher[int, int] = Batcher(sender)
    first = asyncio.create_task(batcher.submit(1, 5.0))
    await asyncio.sleep(0)
    late = asyncio.create_task(batcher.submit(2, 0.01))
    await asyncio.sleep(0.05)
    sender.gate.set()
    assert await first == 10
    with pytest.raises(ConnectionError, match="time ran out"):
        await late
    assert sender.batches == [[1]]


async def test_close_fails_what_is_not_answered() -> None:
    sender = Sender()
    batcher: Batcher[int, int] = Batcher(sender)
    first = asyncio.create_task(batcher.submit(1, 5.0))
    await asyncio.sleep(0)
    waiting = asyncio.create_task(batcher.submit(2, 5.0))
    await asyncio.sleep(0)
    await batcher.aclose()
    for task in (first, waiting):
        with pytest.raises(ConnectionError, match="closed"):
            await task


class Stuck:
    """A sender whose first call never returns (a flow gone silent, a bound ignored)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.forever = asyncio.Event()

    async def __call__(self, items: Sequence[int], timeout_s: float) -> list[int]:
        self.batches.append(list(items))
        if len(self.batches) == 1:
            await self.forever.wait()
        return [item * 10 for item in items]


async def test_a_call_in_flight_past_its_deadline_holds_back_nothing() -> None:
    """Issue 26, item 1: the caller of a call that never returns fails at its deadline, and
    the next batch goes ``OVERRUN_S`` after it, without the stuck call."""
    clock = FakeClock()
    sender = Stuck()
    batcher: Batcher[int, int] = Batcher(sender, clock=clock)
    stuck = asyncio.create_task(batcher.submit(1, 1.0))
    await asyncio.sleep(0)
    waiting = asyncio.create_task(batcher.submit(2, 1.0 + OVERRUN_S + 5.0))
    await clock.advance(1.0)
    with pytest.raises(ConnectionError, match="no answer within 1s"):
        await asyncio.wait_for(stuck, 1.0)
    assert not waiting.done() and sender.batches == [[1]]
    await clock.advance(OVERRUN_S)
    assert await asyncio.wait_for(waiting, 1.0) == 20
    assert sender.batches == [[1], [2]]
    assert await asyncio.wait_for(batcher.submit(3, 1.0), 1.0) == 30


async def test_an_item_waiting_behind_a_call_in_flight_fails_at_its_own_deadline() -> None:
    clock = FakeClock()
    sender = Stuck()
    batcher: Batcher[int, int] = Batcher(sender, clock=clock)
    first = asyncio.create_task(batcher.submit(1, 10.0))
    await asyncio.sleep(0)
    waiting = asyncio.create_task(batcher.submit(2, 0.5))
    await clock.advance(0.5)
    with pytest.raises(ConnectionError, match="time ran out"):
        await asyncio.wait_for(waiting, 1.0)
    assert not first.done()
    await batcher.aclose()
    with pytest.raises(ConnectionError):
        await first


@pytest.mark.redis
async def test_redis_claims_made_together_cost_two_script_calls(
    fresh_redis: RedisServerFactory, unique_project: str
) -> None:
    """Forty jobs claim one instant at once: one call, or two (when the first claim went
    before the others were made); each judged on its own (an instant claimed before, a lock
    not held)."""
    server = fresh_redis()
    store = RedisLeaseStore(unique_project, url=server.url)
    jobs = [f"job-{i}" for i in range(40)]
    instant_us = 1_700_000_000_000_000
    try:
        terms = await store.elect("n1#nonce", [LeaseRequest(job, 60.0) for job in jobs])
        values = [term.value or "" for term in terms]
        assert await store.claim(jobs[3], values[3], instant_us) == 1  # claimed before
        with server.client() as client:
            client.config_resetstat()
            claimed = await asyncio.gather(
                *(
                    store.claim(job, value, instant_us)
                    for job, value in zip(jobs, values, strict=True)
                ),
                store.claim(jobs[5], "1|someone-else#x", instant_us),
            )
            calls = client.info("commandstats")["cmdstat_evalsha"]["calls"]
    finally:
        await store.aclose()
    *mine, foreign = claimed
    assert foreign == -1
    assert mine == [1] * 40  # job-3's own claim retried by its term reads as its own
    assert calls <= 2
