"""A run ends when its code returns; its checkpoint record goes to the store after it
(``_run/recorder.py``, issue 28), on a fake clock with a slow or failing store: a record in
flight never delays the next tick, a graceful handover hands the last record to the
successor (``iteration`` exact), and a record that fails is reported and counted, never
blocking a run."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import pytest
from fake_nodes import stop
from test_runner import Factory, clock, engine, make

from fastapi_singletonjob import DropReason, JobContext, SingletonJobs
from fastapi_singletonjob._aio import OVERRUN_S
from fastapi_singletonjob._checkpoint import FinishedRun, Recorded
from fastapi_singletonjob._store.base import Store
from fastapi_singletonjob.testing import FakeClock

__all__ = ["clock", "make"]


def slow_records(jobs: SingletonJobs, clock: FakeClock, delay_s: float) -> list[list[str]]:
    """Make the store of ``jobs`` answer each ``record_runs`` call ``delay_s`` after it was
    made (a slow link); returns the jobs of each call, as it is made."""
    store = engine(jobs).store
    record_runs = store.record_runs
    calls: list[list[str]] = []

    async def slow(runs: Sequence[FinishedRun], **kwargs: Any) -> Recorded:
        calls.append([run.job for run in runs])
        await clock.sleep(delay_s)
        return await record_runs(runs, **kwargs)

    store.record_runs = slow  # type: ignore[method-assign]
    return calls


async def started_prices(jobs: SingletonJobs, clock: FakeClock) -> Store:
    """Define a no-op job ``prices`` every second on ``jobs``, start them and let 1.5 s pass
    (the job led and run); returns their store."""

    @jobs.fixed_rate("prices", every=1.0)
    async def prices() -> None:
        pass

    await jobs.start()
    await clock.advance(1.5)
    return engine(jobs).store


async def two_counting_nodes(
    make: Factory, clock: FakeClock, seen: list[tuple[str, int]]
) -> tuple[SingletonJobs, SingletonJobs]:
    """Nodes a and b, each with a job ``count`` every second that notes (node, iteration) in
    ``seen``; started 0.5 s apart, then 2 s of runs, a leading."""

    def define(node: str) -> SingletonJobs:
        jobs = make(node, lock_expiry=10.0)

        @jobs.fixed_rate("count", every=1.0)
        async def count(ctx: JobContext) -> None:
            seen.append((ctx.node_id, ctx.iteration))

        return jobs

    a, b = define("a"), define("b")
    await a.start()
    await clock.advance(0.5)
    await b.start()
    await clock.advance(2.0)
    return a, b


async def test_a_record_in_flight_never_delays_the_next_tick(
    make: Factory, clock: FakeClock
) -> None:
    """Each record takes 2.5 periods to be answered; every tick still runs on time, each run
    lasts what its code took (0 here), and ``iteration`` counts every run."""
    jobs = make(lock_expiry=10.0)
    seen: list[tuple[float, int]] = []

    @jobs.fixed_rate("prices", every=0.5)
    async def prices(ctx: JobContext) -> None:
        seen.append((clock.monotonic(), ctx.iteration))

    await jobs.start()
    await clock.advance(1.0)
    calls = slow_records(jobs, clock, delay_s=1.25)
    before = len(seen)
    await clock.advance(5.0)
    (status,) = jobs.status("prices").jobs
    assert len(seen) - before == 10, seen  # one run per 0.5 s tick, none dropped
    assert status.dropped[DropReason.OVERLAP] == 0
    assert status.last_run is not None and status.last_run.duration_s == 0.0
    iterations = [iteration for _, iteration in seen]
    assert iterations == list(range(1, len(seen) + 1)), "each run sees the one before"
    assert len(calls) >= 3, "records were in flight while the next runs started"
    store, runner = engine(jobs).store, engine(jobs).runners["prices"]
    assert runner.unwritten >= 1
    await stop(jobs, clock)  # a graceful stop writes the records still on their way
    stored = await store.read_checkpoint("prices")
    assert stored is not None and stored.iteration == len(seen)
    assert runner.unwritten == 0


async def test_records_of_one_turn_go_in_one_call(make: Factory, clock: FakeClock) -> None:
    """Fifty jobs ending on one instant: one store call for all their records."""
    jobs = make()
    names = [f"job-{i}" for i in range(50)]
    for name in names:

        @jobs.fixed_rate(name, every=1.0)
        async def body() -> None:
            pass

    await jobs.start()
    await clock.advance(1.5)
    calls = slow_records(jobs, clock, delay_s=0.1)
    await clock.advance(1.0)
    assert calls and sorted(calls[0]) == sorted(names), calls
    assert len(calls) == 1


async def test_a_graceful_handover_hands_the_last_record_to_the_successor(
    make: Factory, clock: FakeClock
) -> None:
    """Node a stops while its last record is still on its way: its lock is released only
    once the record is written, so b's first run continues the count exactly."""
    seen: list[tuple[str, int]] = []
    a, b = await two_counting_nodes(make, clock, seen)
    assert {node for node, _ in seen} == {"a"}
    calls = slow_records(a, clock, delay_s=0.8)
    await clock.advance(1.0)  # a run whose record is still in flight
    assert engine(a).runners["count"].unwritten == 1 and calls
    await stop(a, clock)
    await clock.advance(3.0)
    nodes = [node for node, _ in seen]
    assert "b" in nodes and nodes == sorted(nodes), seen
    assert [iteration for _, iteration in seen] == list(range(1, len(seen) + 1)), seen
    await stop(b, clock)


async def test_a_step_down_waits_for_the_record_in_flight(make: Factory, clock: FakeClock) -> None:
    """An operator's step-down hands the job over after its record is written, not before."""
    seen: list[tuple[str, int]] = []
    a, b = await two_counting_nodes(make, clock, seen)
    slow_records(a, clock, delay_s=0.9)
    await clock.advance(1.0)
    assert engine(a).runners["count"].unwritten == 1
    await a.step_down("count")
    for _ in range(100):
        await clock.advance(0.1)
        if seen[-1][0] == "b":
            break
    assert seen[-1][0] == "b", seen
    assert [iteration for _, iteration in seen] == list(range(1, len(seen) + 1)), seen
    await stop(b, clock)
    await stop(a, clock)


async def test_a_record_that_fails_is_reported_and_never_blocks(
    make: Factory, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The store fails every record: every tick still runs, each failure is logged and
    counted (``unrecorded``), and the runs read the stored record again."""
    jobs = make(lock_expiry=10.0)
    seen: list[int] = []

    @jobs.fixed_rate("prices", every=0.5)
    async def prices(ctx: JobContext) -> None:
        seen.append(ctx.iteration)

    await jobs.start()
    await clock.advance(1.0)
    store = engine(jobs).store

    async def failing(runs: Sequence[FinishedRun], **kwargs: Any) -> Recorded:
        await clock.sleep(0.2)
        raise ConnectionError("Redis did not record the runs in time")

    store.record_runs = failing  # type: ignore[method-assign]
    before = len(seen)
    with caplog.at_level(logging.WARNING, logger="fastapi_singletonjob"):
        await clock.advance(2.3)  # four ticks, the last one's record answered 0.2 s after it
    runner = engine(jobs).runners["prices"]
    assert len(seen) - before == 4, seen
    assert runner.stats.unrecorded == 4 and runner.unwritten == 0
    (status,) = jobs.status("prices").jobs
    assert status.dropped[DropReason.OVERLAP] == 0 and status.unrecorded_runs == 4
    messages = [r.getMessage() for r in caplog.records if "could not record" in r.getMessage()]
    assert len(messages) == 4 and "prices" in messages[0], messages
    # Nothing was written since: each run read the stored iteration again.
    assert seen[before:] == [seen[before]] * 4


async def test_a_record_call_that_never_returns_is_abandoned(
    make: Factory, clock: FakeClock
) -> None:
    """The store takes one record call and never answers it (a flow gone silent whose own
    bound failed too): ``OVERRUN_S`` past its deadline the call is abandoned and its records
    are told so; the job does not stay busy for good. Its records failing for a lock expiry,
    the node lets the job go, and (alone) takes it back, its records written again."""
    jobs = make(lock_expiry=3.0)
    store = await started_prices(jobs, clock)
    record_runs = store.record_runs
    stuck: list[int] = []

    async def once_stuck(runs: Sequence[FinishedRun], **kwargs: Any) -> Recorded:
        if not stuck:
            stuck.append(len(runs))
            await asyncio.Event().wait()  # never answers, never gives up
        return await record_runs(runs, **kwargs)

    store.record_runs = once_stuck  # type: ignore[method-assign]
    runner = engine(jobs).runners["prices"]
    await clock.advance(1.0)  # the stuck call is made
    assert stuck and runner.unwritten == 1
    await clock.advance(3.0 + OVERRUN_S)
    assert runner.stats.unrecorded >= 1 and runner.unwritten == 0
    let_go = jobs.status("prices").jobs[0].let_go
    assert let_go is not None and "checkpoint could not be written" in let_go
    before = await store.read_checkpoint("prices")
    await clock.advance(10.0)
    after = await store.read_checkpoint("prices")
    assert before is not None and after is not None and after.iteration > before.iteration


async def test_a_stop_waits_for_a_record_no_longer_than_a_lease_and_says_so(
    make: Factory, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The store never answers the record of a run that just ended: the stop hands the lock
    over once a lock expiry has passed (the record's own bound, the term's time left, at least
    a lock expiry less a heartbeat, plus the recorder's ``OVERRUN_S``, comes later), and says
    which job's record it did not wait for."""
    jobs = make(heartbeat_interval=0.2, lock_expiry=3.0)
    store = await started_prices(jobs, clock)

    async def never(runs: Sequence[FinishedRun], **kwargs: Any) -> Recorded:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    store.record_runs = never  # type: ignore[method-assign]
    await clock.advance(0.55)  # a run whose record is stuck, just now
    assert engine(jobs).runners["prices"].unwritten == 1
    began = clock.monotonic()
    with caplog.at_level(logging.WARNING, logger="fastapi_singletonjob"):
        await stop(jobs, clock)
    assert clock.monotonic() - began <= 3.0 + 0.2
    late = [r.getMessage() for r in caplog.records if "still unanswered" in r.getMessage()]
    assert len(late) == 1 and "prices" in late[0] and "3s" in late[0], late
