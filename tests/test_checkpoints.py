"""Checkpoints as jobs see them: ctx.checkpoint, ctx.iteration, ctx.save_state, misfire
policies and interval spacing across leaders (fake clock, memory store: zero real time)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fake_nodes import kill, stop

from fastapi_singletonjob import (
    Checkpoint,
    ConfigurationError,
    DropReason,
    JobContext,
    LeadershipLost,
    SingletonJobs,
    UsageError,
)
from fastapi_singletonjob._store.base import Store
from fastapi_singletonjob._store.memory import MemoryLeaseStore
from fastapi_singletonjob.testing import FakeClock

START = datetime(2026, 3, 1, 0, 59, 30, tzinfo=UTC)  # 30 s before 01:00

Factory = Callable[..., SingletonJobs]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


@pytest.fixture
async def make(clock: FakeClock, request: pytest.FixtureRequest) -> AsyncIterator[Factory]:
    made: list[SingletonJobs] = []
    url = f"memory://{abs(hash(request.node.nodeid))}"

    def factory(node_id: str = "a", **kwargs: Any) -> SingletonJobs:
        jobs = SingletonJobs(
            url,
            project="cp",
            node_id=node_id,
            clock=clock,
            heartbeat_interval=1.0,
            lock_expiry=3.0,
            shutdown_timeout=2.0,
            **kwargs,
        )
        made.append(jobs)
        return jobs

    yield factory
    for jobs in made:
        await stop(jobs, clock)


async def test_state_and_iteration_continue_across_nodes(make: Factory, clock: FakeClock) -> None:
    seen: list[tuple[str, int, object]] = []

    def define(node: str) -> SingletonJobs:
        jobs = make(node)

        @jobs.interval("export", every=1.0)
        async def export(ctx: JobContext) -> None:
            cursor = ctx.checkpoint.state if ctx.checkpoint else None
            seen.append((ctx.node_id, ctx.iteration, cursor))
            await ctx.save_state(cursor + 1 if isinstance(cursor, int) else 1)

        return jobs

    a, b = define("a"), define("b")
    await a.start()
    await clock.advance(2.5)
    await b.start()
    await stop(a, clock)  # graceful: b leads within a round trip
    await clock.advance(2.0)
    nodes = [node for node, _, _ in seen]
    assert nodes[:3] == ["a", "a", "a"] and nodes[3:] == ["b"] * (len(seen) - 3)
    assert len(seen) >= 5
    assert [iteration for _, iteration, _ in seen] == list(range(1, len(seen) + 1)), "cluster-wide"
    assert [state for _, _, state in seen] == [None, *range(1, len(seen))]
    stored = await b.checkpoint("export")
    assert stored is not None and stored.iteration == len(seen)
    assert stored.state == len(seen)
    assert stored.node_id == "b" and stored.last_outcome == "success"


async def test_a_failed_run_keeps_iteration_and_state_and_records_its_error(
    make: Factory, clock: FakeClock
) -> None:
    jobs = make()
    outcomes = iter([None, "boom", None])

    @jobs.interval("flaky", every=1.0)
    async def flaky(ctx: JobContext) -> None:
        await ctx.save_state(ctx.iteration)
        error = next(outcomes)
        if error:
            raise RuntimeError(error)

    await jobs.start()
    await clock.advance(0.5)
    first = await jobs.checkpoint("flaky")
    await clock.advance(1.0)
    failed = await jobs.checkpoint("flaky")
    await clock.advance(1.0)
    after = await jobs.checkpoint("flaky")
    assert first is not None and failed is not None and after is not None
    assert (first.iteration, first.state, first.last_outcome) == (1, 1, "success")
    # The failed run saved state 2 before it raised: the save stands (it was durable when it
    # returned), the run is not counted.
    assert (failed.iteration, failed.state, failed.last_outcome) == (1, 2, "failed")
    assert failed.last_error == "RuntimeError: boom"
    assert (after.iteration, after.state, after.last_error) == (2, 2, None)


async def test_save_state_after_the_term_ended_raises_and_changes_nothing(
    make: Factory, clock: FakeClock
) -> None:
    a, b = make("a"), make("b")
    errors: list[BaseException] = []
    resume = asyncio.Event()

    @a.interval("long", every=100.0)
    async def long_a(ctx: JobContext) -> None:
        await ctx.save_state("a-start")
        await resume.wait()  # meanwhile a is cut off and b takes over
        try:
            await ctx.save_state("a-late")
        except LeadershipLost as exc:
            errors.append(exc)

    @b.interval("long", every=100.0)
    async def long_b(ctx: JobContext) -> None:
        await ctx.save_state("b")

    await a.start()
    await clock.advance(0.5)
    await b.start()
    kill(a)  # a's run goes on, but a renews nothing any more
    await clock.advance(10.0)
    assert (await b.checkpoint("long")) is not None
    resume.set()
    await clock.advance(0.5)
    assert len(errors) == 1 and "long" in str(errors[0])
    stored = await b.checkpoint("long")
    assert stored is not None and stored.state == "b" and stored.node_id == "b"


async def test_bad_states_fail_before_the_store_and_opting_out_has_no_state(
    make: Factory, clock: FakeClock
) -> None:
    jobs = make()
    errors: dict[str, BaseException] = {}

    @jobs.interval("picky", every=100.0)
    async def picky(ctx: JobContext) -> None:
        for name, value in {"set": {1, 2}, "big": "x" * (64 * 1024), "nan": float("nan")}.items():
            try:
                await ctx.save_state(value)
            except ConfigurationError as exc:
                errors[name] = exc

    @jobs.interval("fast", every=100.0, checkpoint=False)
    async def fast(ctx: JobContext) -> None:
        assert ctx.checkpoint is None
        try:
            await ctx.save_state(1)
        except UsageError as exc:
            errors["opted-out"] = exc

    await jobs.start()
    await clock.advance(0.5)
    assert sorted(errors) == ["big", "nan", "opted-out", "set"]
    assert all("picky" in str(errors[name]) for name in ("big", "nan", "set"))
    assert "checkpoint=False" in str(errors["opted-out"])
    assert await jobs.checkpoint("fast") is None
    stored = await jobs.checkpoint("picky")
    assert stored is not None and stored.state is None and stored.iteration == 1


async def test_checkpoint_and_reset_work_before_startup_and_name_unknown_jobs(
    make: Factory, clock: FakeClock
) -> None:
    jobs = make()

    @jobs.interval("job", every=1.0)
    async def job(ctx: JobContext) -> None:
        await ctx.save_state(ctx.iteration)

    assert await jobs.checkpoint("job") is None
    await jobs.start()
    await clock.advance(1.5)
    await stop(jobs, clock)
    stored = await jobs.checkpoint("job")  # stopped: a store is opened for the call
    assert isinstance(stored, Checkpoint) and stored.iteration == 2
    assert await jobs.reset_checkpoint("job") is True
    assert await jobs.checkpoint("job") is None
    with pytest.raises(KeyError, match="nope"):
        await jobs.checkpoint("nope")


def cron_jobs(make: Factory, node: str, runs: list[datetime], **options: Any) -> SingletonJobs:
    jobs = make(node)

    @jobs.cron("hourly", "0 * * * *", **options)
    async def hourly(ctx: JobContext) -> None:
        runs.append(ctx.scheduled_at)

    return jobs


def at(hour: int) -> datetime:
    return datetime(2026, 3, 1, hour, tzinfo=UTC)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"misfire": "skip"}, [at(1), at(5)]),
        ({}, [at(1), at(4), at(5)]),  # run_once, the default: the latest missed instant
        ({"misfire": "run_once", "misfire_grace": 10}, [at(1), at(5)]),  # 04:00 is 30 s late
        ({"misfire": "catch_up", "misfire_grace": 3 * 3600}, [at(1), at(2), at(3), at(4), at(5)]),
        ({"misfire": "catch_up", "misfire_grace": 5400}, [at(1), at(3), at(4), at(5)]),
    ],
    ids=["skip", "run_once", "run_once-grace", "catch_up", "catch_up-grace"],
)
async def test_a_fleet_starting_after_downtime_applies_the_misfire_policy(
    make: Factory, clock: FakeClock, options: dict[str, Any], expected: list[datetime]
) -> None:
    runs: list[datetime] = []
    first = cron_jobs(make, "a", runs, **options)
    await first.start()
    await clock.advance(60.0)  # 01:00:30: ran 01:00
    await stop(first, clock)
    clock.jump_wall(3 * 3600.0)  # the whole fleet is down until 04:00:30 (02:00-04:00 missed)
    second = cron_jobs(make, "b", runs, **options)
    await second.start()
    await clock.advance(3600.0)  # and on through 05:00
    assert runs == expected
    assert len(set(runs)) == len(runs), "no instant twice"


async def test_catch_up_needs_a_grace_and_a_checkpoint(make: Factory) -> None:
    jobs = make()
    with pytest.raises(ConfigurationError, match="misfire_grace"):
        jobs.cron("c", "0 * * * *", misfire="catch_up")(lambda: None)
    with pytest.raises(ConfigurationError, match="checkpoint=False"):
        jobs.cron("d", "0 * * * *", misfire="catch_up", misfire_grace=60, checkpoint=False)(
            lambda: None
        )
    with pytest.raises(ConfigurationError, match="'often'"):
        jobs.cron("e", "0 * * * *", misfire="often")(lambda: None)  # type: ignore[arg-type]


async def test_an_interval_jobs_new_leader_waits_out_the_period(
    make: Factory, clock: FakeClock
) -> None:
    starts: list[tuple[str, float]] = []

    def define(node: str) -> SingletonJobs:
        jobs = make(node)

        @jobs.interval("every-10s", every=10.0)
        async def job(ctx: JobContext) -> None:
            starts.append((ctx.node_id, clock.monotonic()))

        return jobs

    a, b = define("a"), define("b")
    await a.start()
    await clock.advance(0.5)
    await b.start()
    await clock.advance(1.0)
    await stop(a, clock)  # b leads at once, 1.5 s after a's run
    await clock.advance(20.0)
    (a_at,), b_at = [t for n, t in starts if n == "a"], [t for n, t in starts if n == "b"]
    assert b_at and b_at[0] - a_at == pytest.approx(10.0, abs=0.1), "not 1.5 s after a's run"
    assert b_at[1] - b_at[0] == pytest.approx(10.0, abs=0.1)


class OffsetClock:
    """The test's ``FakeClock`` with a wall clock ``offset_s`` off: a node whose time sync is
    broken. Its monotonic time and sleeps are the fake clock's."""

    def __init__(self, base: FakeClock, offset_s: float) -> None:
        self._base = base
        self._offset = timedelta(seconds=offset_s)

    def monotonic(self) -> float:
        return self._base.monotonic()

    def now(self) -> datetime:
        return self._base.now() + self._offset

    async def sleep(self, seconds: float) -> None:
        await self._base.sleep(seconds)


class SkewedNode(SingletonJobs):
    """A node on a skewed clock whose ``memory://`` store keeps the shared fake clock: the
    store's clock (the server's ``TIME``, on Redis) stays right while the node's is wrong."""

    store_clock: FakeClock

    def _open_store(self) -> Store:
        assert self.settings.redis_url is not None
        return MemoryLeaseStore(self.settings.project, self.store_clock, self.settings.redis_url)


@pytest.mark.parametrize("offset_s", [86400.0, -86400.0], ids=["a-day-ahead", "a-day-behind"])
async def test_an_interval_handover_spaces_runs_by_every_whatever_the_old_leaders_clock(
    make: Factory,
    clock: FakeClock,
    request: pytest.FixtureRequest,
    offset_s: float,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A new leader spaces an interval job's runs by ``every`` on the store's clock, whatever
    the old leader's wall clock said; the old leader says, once, that its clock is a day off
    the store's."""
    caplog.set_level(logging.WARNING, logger="fastapi_singletonjob.checkpoint")
    starts: list[tuple[str, float]] = []
    skewed = SkewedNode(
        f"memory://{abs(hash(request.node.nodeid))}",
        project="cp",
        node_id="a",
        clock=OffsetClock(clock, offset_s),
        heartbeat_interval=1.0,
        lock_expiry=3.0,
        shutdown_timeout=2.0,
    )
    skewed.store_clock = clock
    correct = make("b")
    for node in (skewed, correct):

        @node.interval("every-10s", every=10.0)
        async def job(ctx: JobContext) -> None:
            starts.append((ctx.node_id, clock.monotonic()))

    await skewed.start()
    try:
        await clock.advance(0.5)
        await correct.start()
        await clock.advance(1.0)
    finally:
        await stop(skewed, clock)  # b leads at once, 1.5 s after a's run
    await clock.advance(20.0)
    (a_at,), b_at = [t for n, t in starts if n == "a"], [t for n, t in starts if n == "b"]
    assert b_at, "b did not run in the 20 s after the handover"
    assert b_at[0] - a_at == pytest.approx(10.0, abs=0.1), "not `every` after a's run"
    assert b_at[1] - b_at[0] == pytest.approx(10.0, abs=0.1)
    checkpoint = await correct.checkpoint("every-10s")
    assert checkpoint is not None and checkpoint.last_completed_at is not None
    assert checkpoint.last_completed_at == START + timedelta(seconds=b_at[1] - 1000.0)
    told = [r.getMessage() for r in caplog.records if "wall clock is" in r.getMessage()]
    way = "ahead of" if offset_s > 0 else "behind"
    assert len(told) == 1 and f"node a's wall clock is 86400.000s {way} the store's" in told[0]


async def test_issue27_item2_a_pause_stops_a_catch_up_within_one_round_trip(
    make: Factory, clock: FakeClock
) -> None:
    """A paused job starts nothing, a catch-up's instants included: the run in flight at the
    pause goes on, and no run starts after it."""
    starts: list[tuple[float, datetime]] = []

    def define(node: str) -> SingletonJobs:
        jobs = make(node)

        @jobs.cron("report", "* * * * * *", misfire="catch_up", misfire_grace=60)
        async def report(ctx: JobContext) -> None:
            starts.append((clock.monotonic(), ctx.scheduled_at))
            await clock.sleep(0.25)

        return jobs

    first = define("a")
    await first.start()
    await clock.advance(1.0)
    await stop(first, clock)
    clock.jump_wall(40.0)  # the fleet was down: 40 instants to catch up, 0.25 s each
    second = define("b")
    await second.start()
    await clock.advance(1.0)
    caught_up = len(starts)
    assert caught_up >= 4, "the catch-up is going"
    await second.pause("report")
    paused_at = clock.monotonic()
    await clock.advance(10.0)
    late = [t - paused_at for t, _ in starts if t > paused_at]
    assert late == [], f"runs started after pause() returned, at {late}"
    status = second.status("report").jobs[0]
    assert status.paused and status.dropped[DropReason.PAUSED] > 0
    await second.resume("report")
    await clock.advance(2.0)
    assert len(starts) > caught_up, "runs again once resumed"


async def test_issue27_item3_a_reset_reaches_the_running_leader(
    make: Factory, clock: FakeClock
) -> None:
    """The next run after ``reset_checkpoint`` sees what the store holds (iteration 1, no
    state), not the leader's copy from the start of its term."""
    seen: list[tuple[int, object]] = []
    jobs = make()

    @jobs.fixed_rate("export", every=1.0)
    async def export(ctx: JobContext) -> None:
        cursor = ctx.checkpoint.state if ctx.checkpoint else None
        seen.append((ctx.iteration, cursor))
        assert cursor is None or isinstance(cursor, int)
        if cursor is None or cursor < 3:
            await ctx.save_state((cursor or 0) + 1)

    await jobs.start()
    await clock.advance(5.5)
    assert seen[-1] == (5, 3)
    before = len(seen)
    other = make("b")  # an operator's call from another process
    other.interval("export", every=1.0)(lambda: None)
    assert await other.reset_checkpoint("export") is True
    await clock.advance(3.0)
    assert seen[before:] == [(1, None), (2, 1), (3, 2)]
    stored = await jobs.checkpoint("export")
    assert stored is not None and (stored.iteration, stored.state) == (3, 3)


async def test_issue27_item4_a_run_cancelled_at_shutdown_is_recorded(
    make: Factory, clock: FakeClock
) -> None:
    """A run cancelled past shutdown_timeout is recorded as cancelled (its term still holds:
    the election renews the lease during the drain), keeping iteration and state."""
    calls: list[int] = []
    jobs = make()

    @jobs.interval("export", every=0.2)
    async def export(ctx: JobContext) -> None:
        calls.append(ctx.iteration)
        if len(calls) == 1:
            await ctx.save_state("cursor")
        if len(calls) >= 3:
            await clock.sleep(30.0)  # still going at shutdown

    await jobs.start()
    await clock.advance(1.0)
    assert calls == [1, 2, 3]
    await stop(jobs, clock)
    stored = await jobs.checkpoint("export")
    assert stored is not None
    assert (stored.iteration, stored.last_outcome, stored.state) == (2, "cancelled", "cursor")


async def test_issue27_item4_a_cancelled_run_whose_term_ended_is_not_recorded(
    make: Factory, clock: FakeClock
) -> None:
    """The record of a cancelled run is fenced by its own term: here the lock was deleted by
    hand while the run went on, and the node's next round began a new term (a new token), so
    the run of the old term, cancelled at shutdown, writes nothing."""
    calls: list[int] = []
    jobs = make()

    @jobs.interval("export", every=1.0)
    async def export(ctx: JobContext) -> None:
        calls.append(ctx.fencing_token)
        await clock.sleep(60.0)

    await jobs.start()
    await clock.advance(0.5)
    assert jobs.engine is not None and isinstance(jobs.engine.store, MemoryLeaseStore)
    jobs.engine.store.delete_lock("export")
    await clock.advance(1.5)
    token = jobs.status("export").jobs[0].fencing_token
    assert token is not None and calls and token > calls[0], "a new term, the old run goes on"
    await stop(jobs, clock)  # cancels the old term's run past shutdown_timeout
    assert await jobs.checkpoint("export") is None, "the old term recorded nothing"


@pytest.mark.redis
async def test_issue27_item4_on_redis_a_run_cancelled_at_shutdown_is_recorded(
    redis_url: str, unique_project: str
) -> None:
    """The same on a real Redis, in real time: the third run is still going at shutdown, is
    cancelled after shutdown_timeout, and its record says so."""
    jobs = SingletonJobs(
        redis_url,
        project=unique_project,
        node_id="n1",
        heartbeat_interval=0.1,
        lock_expiry=0.5,
        shutdown_timeout=0.3,
    )
    calls: list[int] = []

    @jobs.interval("export", every=0.1)
    async def export(ctx: JobContext) -> None:
        calls.append(ctx.iteration)
        if len(calls) >= 3:
            await asyncio.sleep(30)

    await jobs.start()
    try:
        for _ in range(100):
            if len(calls) >= 3:
                break
            await asyncio.sleep(0.05)
        assert calls == [1, 2, 3]
    finally:
        await jobs.stop()
    stored = await jobs.checkpoint("export")
    assert stored is not None and (stored.iteration, stored.last_outcome) == (2, "cancelled")
