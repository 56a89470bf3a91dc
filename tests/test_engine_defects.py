"""Regression tests for the defects of the adversarial review (issue 11) that live in the
election and the runner: each is named after its item and runs on the fake clock."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fake_nodes import stop as stop_on
from waiting import wait_until

from fastapi_singletonjob import JobContext, SingletonJobs
from fastapi_singletonjob._clock import SystemClock
from fastapi_singletonjob._election.elector import Elector
from fastapi_singletonjob._election.lease import Lease
from fastapi_singletonjob._store.base import (
    DEFAULT_KEEPALIVE_S,
    LeaseReply,
    LeaseRequest,
    ReleaseListener,
)
from fastapi_singletonjob._store.base import Store as LeaseStoreLike
from fastapi_singletonjob._store.memory import MemoryLeaseStore
from fastapi_singletonjob.testing import FakeClock


class SlowReplyStore(MemoryLeaseStore):
    """The script runs on the server at once; its reply reaches the node ``delay_s`` later."""

    delay_s = 0.0

    async def elect(self, node_id: str, requests: Sequence[LeaseRequest]) -> list[LeaseReply]:
        replies = await super().elect(node_id, requests)
        await self._clock.sleep(self.delay_s)
        return replies

    async def listen_releases(
        self, on_release: ReleaseListener, *, keepalive_s: float = DEFAULT_KEEPALIVE_S
    ) -> None:
        await asyncio.Event().wait()


@contextlib.asynccontextmanager
async def running(
    clock: FakeClock, store: LeaseStoreLike, lease: Lease, heartbeat_s: float
) -> AsyncIterator[Elector]:
    """An elector of ``lease`` on ``store``, its loop running until the block ends."""
    elector = Elector(
        store=store,
        node_id="n1",
        leases=[lease],
        heartbeat_s=heartbeat_s,
        max_backoff_s=30.0,
        clock=clock,
        rng=lambda: 0.0,
    )
    task = asyncio.create_task(elector.run())
    try:
        yield elector
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def _first_term(clock: FakeClock, lease: Lease, step_s: float = 0.01) -> tuple[float, float]:
    """Advance until ``lease`` starts a term; return (its deadline, when leadership_lost came)."""
    deadline = None
    for _ in range(100_000):
        await clock.advance(step_s)
        if deadline is None and lease.token is not None:
            deadline = lease.deadline
        if deadline is not None and lease.lost.is_set():
            return deadline, clock.monotonic()
    raise AssertionError("no term started and ended")


@pytest.mark.parametrize("reply_delay_s", [8.0, 9.05, 9.5])
async def test_item1_leadership_lost_is_set_at_the_deadline_after_a_slow_reply(
    reply_delay_s: float,
) -> None:
    clock = FakeClock()
    store = SlowReplyStore("p", clock, f"memory://item1-{reply_delay_s}")
    store.delay_s = reply_delay_s
    lease = Lease("job", 10.0)
    async with running(clock, store, lease, heartbeat_s=3.0):
        deadline, lost_at = await _first_term(clock, lease)
    # Before the fix the watchdog slept on the interval it computed before the term began,
    # and the event came up to a heartbeat (2.1 s) after the deadline.
    assert lost_at <= deadline + 0.011


async def test_item4_leadership_lost_is_set_right_after_a_suspend() -> None:
    clock = FakeClock()
    lease = Lease("job", 3.0)
    store = MemoryLeaseStore("p", clock, "memory://item4")
    async with running(clock, store, lease, heartbeat_s=1.0) as elector:
        await clock.advance(1.5)
        assert elector.is_leader("job")
        lost = lease.lost
        elector.run_started("job")  # a run is in flight: it may be waiting on the event
        await clock.advance(0.5)
        clock.suspend(60.0)  # the lease is long gone in the store; no timer has fired
        await clock.advance(0.11)
        # The watchdog sleeps at most WATCH_STEP_S while leading; before the fix it slept up
        # to a heartbeat, and `is_leader` said False while `leadership_lost` was still clear.
        assert lost.is_set()


async def test_item4_is_leader_false_implies_leadership_lost() -> None:
    clock = FakeClock()
    lease = Lease("job", 3.0)
    store = MemoryLeaseStore("p", clock, "memory://item4b")
    async with running(clock, store, lease, heartbeat_s=1.0) as elector:
        await clock.advance(0.5)
        lost = lease.lost
        clock.suspend(60.0)
        # No task has run since the resume: the first reader of leadership ends the term.
        assert not elector.is_leader("job")
        assert lost.is_set()


class ForeignHeldStore(MemoryLeaseStore):
    """A broken store that reports a lock with a foreign value as held by the caller."""

    async def elect(self, node_id: str, requests: Sequence[LeaseRequest]) -> list[LeaseReply]:
        return [LeaseReply(r.job, True, "", r.ttl_s) for r in requests]


async def test_item3_a_held_reply_without_a_token_is_never_a_term() -> None:
    clock = FakeClock()
    lease = Lease("job", 3.0)
    elector = Elector(
        store=ForeignHeldStore("p", clock, "memory://item3"),
        node_id="n1",
        leases=[lease],
        heartbeat_s=1.0,
        max_backoff_s=30.0,
        clock=clock,
        rng=lambda: 0.0,
    )
    await elector.round()
    assert lease.token is None
    assert not elector.is_leader("job")


# -- items 6, 7, 8: the timer and the drain, through SingletonJobs on the fake clock ---------


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(datetime(2026, 3, 1, 2, 0, tzinfo=UTC))


@pytest.fixture
async def make(clock: FakeClock, request: pytest.FixtureRequest) -> AsyncIterator[Factory]:
    made: list[SingletonJobs] = []
    url = f"memory://defects-{abs(hash(request.node.nodeid))}"

    def factory(node_id: str = "a", **settings: Any) -> SingletonJobs:
        jobs = SingletonJobs(
            url,
            project="p",
            node_id=node_id,
            clock=clock,
            **{"heartbeat_interval": 1.0, "lock_expiry": 3.0, "shutdown_timeout": 5.0, **settings},
        )
        made.append(jobs)
        return jobs

    yield factory
    for jobs in made:
        await stop_on(jobs, clock)


Factory = Callable[..., SingletonJobs]


class Stuck:
    """A custom schedule whose ``next_fire`` does not move forward after its first answer."""

    def __init__(self, first: datetime) -> None:
        self.first = first
        self.calls = 0

    def next_fire(self, after: datetime) -> datetime | None:
        self.calls += 1
        return self.first if after < self.first else after


async def test_item6_a_custom_schedule_that_does_not_advance_stops_the_job_with_an_error(
    make: Factory, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    jobs = make()
    schedule = Stuck(clock.now() + timedelta(seconds=1))
    runs: list[datetime] = []

    @jobs.schedule("stuck", schedule)
    async def stuck(ctx: JobContext) -> None:
        runs.append(ctx.scheduled_at)

    await jobs.start()
    with caplog.at_level(logging.ERROR, logger="fastapi_singletonjob"):
        await clock.advance(5.0)
    # Refused at the first answer that does not move forward: before the fix the timer spun
    # on it (custom_hang2.py) or dropped every instant as late (custom_hang.py).
    assert runs == []
    assert schedule.calls <= 3, "the timer must not spin on a schedule that does not advance"
    status = jobs.status("stuck").jobs[0]
    assert status.error is not None and "ScheduleError" in status.error
    assert "'stuck'" in status.error and "not later" in status.error
    assert any("stuck" in r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)


async def test_item7_interval_jobs_wait_on_the_monotonic_clock(
    make: Factory, clock: FakeClock
) -> None:
    jobs = make()
    runs: list[float] = []

    @jobs.interval("poll", every=2.0)
    async def poll() -> None:
        runs.append(clock.monotonic())

    await jobs.start()
    await clock.advance(3.0)
    before = len(runs)
    assert before >= 1
    clock.jump_wall(-3600.0)  # NTP steps the wall clock back an hour
    await clock.advance(10.0)
    # Before the fix the job slept until the wall clock came back: no run for an hour.
    assert len(runs) - before == 5
    assert all(b - a == pytest.approx(2.0) for a, b in zip(runs, runs[1:], strict=False))


async def test_item8_a_graceful_stop_hands_idle_jobs_over_at_once(
    make: Factory, clock: FakeClock
) -> None:
    a, b = make("a"), make("b")
    fast_runs: list[tuple[str, float]] = []

    def define(jobs: SingletonJobs) -> None:
        @jobs.fixed_rate("fast", every=0.1)
        async def fast(ctx: JobContext) -> None:
            fast_runs.append((ctx.node_id, clock.monotonic()))

        @jobs.interval("slow", every=60.0)
        async def slow() -> None:
            await clock.sleep(2.0)

    define(a)
    define(b)
    await a.start()
    await clock.advance(0.3)
    await b.start()
    await clock.advance(0.5)
    assert a.engine is not None and a.engine.runners["slow"].current is not None
    stopping = asyncio.create_task(a.stop())
    began = clock.monotonic()
    await clock.advance(0.05)
    assert a.status().state == "draining"
    while not stopping.done():
        await clock.advance(0.05)
    await stopping
    ended = clock.monotonic()
    assert ended - began >= 1.0, "the drain waited for the slow run"
    during = [node for node, at in fast_runs if began < at < ended]
    # Before the fix 'fast' did not run anywhere while 'a' drained 'slow'.
    assert during.count("b") >= 8
    assert "a" not in during


# -- item 2: a fixed-rate tick runs once across a graceful handover, against real Redis --------


class Behind(SystemClock):
    """The system clock with the wall clock 50 ms behind, as NTP leaves a node at times."""

    def now(self) -> datetime:
        return super().now() - timedelta(milliseconds=50)


@pytest.mark.parametrize("every_s", [1.0, 0.2], ids=["claims-every-tick", "claims-first-tick"])
async def test_item2_a_fixed_rate_tick_runs_once_across_a_graceful_handover(
    redis_url: str, unique_project: str, every_s: float
) -> None:
    runs: list[tuple[str, datetime]] = []
    ran = {"a": asyncio.Event(), "b": asyncio.Event()}

    def node(name: str, clock: SystemClock) -> SingletonJobs:
        jobs = SingletonJobs(
            redis_url,
            project=unique_project,
            node_id=name,
            clock=clock,
            heartbeat_interval=0.1,
            lock_expiry=0.5,
        )

        @jobs.fixed_rate("report", every=every_s)
        async def report(ctx: JobContext) -> None:
            runs.append((name, ctx.scheduled_at))
            ran[name].set()

        return jobs

    a, b = node("a", SystemClock()), node("b", Behind())
    await a.start()
    try:
        await wait_until(lambda: a.status("report").jobs[0].is_leader, 5.0, "a leads")
        await b.start()
        for _ in range(2):
            ran["a"].clear()
            await asyncio.wait_for(ran["a"].wait(), 5 * every_s)
        await a.stop()  # a rolling deploy: right after a's tick, b takes over at once
        await asyncio.wait_for(ran["b"].wait(), 5 * every_s)
    finally:
        await a.stop()
        await b.stop()
    instants = [at for _, at in runs]
    assert len(instants) == len(set(instants)), f"an instant ran twice: {runs}"
    assert {name for name, _ in runs} == {"a", "b"}
