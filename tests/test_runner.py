"""Schedules, runs, drops, timeouts and shutdown, on the fake clock and memory store."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import pairwise

import pytest
from fake_nodes import stop

from fastapi_singletonjob import DropReason, JobContext, Outcome, SingletonJobs
from fastapi_singletonjob._engine.engine import Engine
from fastapi_singletonjob._run import ticker as ticker_module
from fastapi_singletonjob._run.runner import JobRunner
from fastapi_singletonjob.testing import FakeClock

START = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass
class Run:
    node: str
    token: int
    scheduled_at: datetime
    started: float
    ended: float | None = None


class Journal:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.runs: list[Run] = []

    def begin(self, ctx: JobContext) -> Run:
        run = Run(ctx.node_id, ctx.fencing_token, ctx.scheduled_at, self.clock.monotonic())
        self.runs.append(run)
        return run

    def max_concurrent(self) -> int:
        events = sorted(
            [(r.started, 1) for r in self.runs]
            + [(r.ended if r.ended is not None else float("inf"), -1) for r in self.runs],
            key=lambda e: (e[0], e[1]),
        )
        current = peak = 0
        for _, delta in events:
            current += delta
            peak = max(peak, current)
        return peak


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


@pytest.fixture
def journal(clock: FakeClock) -> Journal:
    return Journal(clock)


Factory = Callable[..., SingletonJobs]


@pytest.fixture
async def make(clock: FakeClock, request: pytest.FixtureRequest) -> AsyncIterator[Factory]:
    made: list[SingletonJobs] = []
    url = f"memory://{abs(hash(request.node.nodeid))}"

    def factory(node_id: str = "a", **kwargs: object) -> SingletonJobs:
        settings: dict[str, object] = {
            "heartbeat_interval": 1.0,
            "lock_expiry": 3.0,
            "shutdown_timeout": 2.0,
        }
        settings.update(kwargs)
        jobs = SingletonJobs(url, project="p", node_id=node_id, clock=clock, **settings)  # type: ignore[arg-type]
        made.append(jobs)
        return jobs

    yield factory
    for jobs in made:
        await stop(jobs, clock)


def engine(jobs: SingletonJobs) -> Engine:
    assert jobs.engine is not None
    return jobs.engine


async def test_fixed_rate_ticks_on_the_epoch_grid_without_drift(
    make: Factory, clock: FakeClock, journal: Journal
) -> None:
    jobs = make()

    @jobs.fixed_rate("tick", every=timedelta(milliseconds=250), offset=0.1)
    async def tick(ctx: JobContext) -> None:
        journal.begin(ctx).ended = clock.monotonic()

    await jobs.start()
    await clock.advance(1000.0)
    instants = [run.scheduled_at for run in journal.runs]
    assert len(instants) >= 3990
    for instant in instants:
        micros = (instant - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)
        assert micros % 250_000 == 100_000
    assert all(b - a == timedelta(milliseconds=250) for a, b in pairwise(instants))
    late = [run.started - (run.scheduled_at - START).total_seconds() for run in journal.runs]
    assert max(late) - min(late) < 1e-6, "runs start exactly on the grid"


async def test_jobs_of_one_instant_start_shortest_period_first(
    make: Factory, clock: FakeClock
) -> None:
    """Rate-monotonic order at a shared instant: whatever the order of declaration, the job
    with the least time to spare starts first (the others wait behind its start, not it
    behind theirs)."""
    jobs = make()
    started: list[tuple[datetime, str]] = []
    for name, every in (("slow", 10.0), ("fast", 1.0), ("middle", 5.0)):

        async def body(ctx: JobContext) -> None:
            started.append((ctx.scheduled_at, ctx.job))

        jobs.fixed_rate(name, every=every)(body)
    await jobs.start()
    await clock.advance(30.0)
    shared = [job for at, job in started if at.second % 10 == 0 and at.microsecond == 0]
    assert shared[:3] == ["fast", "middle", "slow"], started
    assert shared[3:6] == ["fast", "middle", "slow"], started


async def test_overlapping_ticks_are_dropped_and_counted(
    make: Factory, clock: FakeClock, journal: Journal
) -> None:
    jobs = make()

    @jobs.fixed_rate("slow", every=1.0)
    async def slow(ctx: JobContext) -> None:
        run = journal.begin(ctx)
        await clock.sleep(2.5)
        run.ended = clock.monotonic()

    await jobs.start()
    await clock.advance(30.0)
    stats = engine(jobs).runners["slow"].stats
    assert journal.max_concurrent() == 1
    assert 8 <= len(journal.runs) <= 11
    assert stats.dropped[DropReason.OVERLAP] >= 2 * (len(journal.runs) - 1)
    # the next run starts at the first tick after the previous one ended: never queued
    for before, after in pairwise(journal.runs):
        assert before.ended is not None
        assert 0 <= after.started - before.ended <= 1.0


async def test_a_stall_runs_no_burst_of_missed_ticks(
    make: Factory, clock: FakeClock, journal: Journal
) -> None:
    jobs = make(lock_expiry=100.0)

    @jobs.fixed_rate("tick", every=0.1)
    async def tick(ctx: JobContext) -> None:
        journal.begin(ctx).ended = clock.monotonic()

    await jobs.start()
    await clock.advance(1.0)
    before = len(journal.runs)
    clock.stall(5.0)  # the loop was blocked for 50 periods
    await clock.advance(0.0)
    await clock.advance(0.25)
    after_stall = journal.runs[before:]
    assert len(after_stall) <= 3, "missed ticks must not be replayed"
    stats = engine(jobs).runners["tick"].stats
    assert stats.dropped[DropReason.LATE] >= 49


async def test_interval_runs_then_waits(make: Factory, clock: FakeClock, journal: Journal) -> None:
    jobs = make()

    @jobs.interval("every", every=2.0)
    async def every(ctx: JobContext) -> None:
        run = journal.begin(ctx)
        await clock.sleep(0.5)
        run.ended = clock.monotonic()

    await jobs.start()
    await clock.advance(20.0)
    runs = journal.runs
    assert runs[0].started == pytest.approx(1000.0), "runs as soon as the node leads"
    for before, after in pairwise(runs):
        assert before.ended is not None
        assert after.started - before.ended == pytest.approx(2.0)
    assert len(runs) == 9  # at 0, 2.5, ..., 20


async def test_cron_in_a_time_zone_fires_once_a_day(
    make: Factory, clock: FakeClock, journal: Journal
) -> None:
    jobs = make(lock_expiry=200.0, heartbeat_interval=60.0, max_backoff=60.0)

    @jobs.cron("report", "0 3 * * *", timezone="Asia/Singapore")
    async def report(ctx: JobContext) -> None:
        journal.begin(ctx).ended = clock.monotonic()

    await jobs.start()
    await clock.advance(3 * 86400.0)
    assert [run.scheduled_at.astimezone(UTC).hour for run in journal.runs] == [19] * 3
    assert len({run.scheduled_at.date() for run in journal.runs}) == 3


async def test_a_failing_run_is_logged_counted_and_the_schedule_goes_on(
    make: Factory, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    jobs = make()
    calls = 0

    @jobs.fixed_rate("boom", every=1.0)
    async def boom() -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("downstream is down")

    await jobs.start()
    with caplog.at_level(logging.ERROR, logger="fastapi_singletonjob"):
        await clock.advance(5.0)
    stats = engine(jobs).runners["boom"].stats
    assert calls == 5
    assert stats.failures == stats.runs == 5
    assert stats.last_run is not None
    assert stats.last_run.outcome is Outcome.FAILED
    assert stats.last_run.error == "RuntimeError: downstream is down"
    failures = [r for r in caplog.records if "failed" in r.getMessage()]
    assert failures and failures[0].exc_info is not None, "logged with its traceback"
    assert engine(jobs).elector.is_leader("boom")


async def test_timeout_cancels_a_run_that_takes_too_long(make: Factory, clock: FakeClock) -> None:
    jobs = make()
    cancelled = 0

    @jobs.fixed_rate("hang", every=5.0, timeout=1.5)
    async def hang() -> None:
        nonlocal cancelled
        try:
            await clock.sleep(100)
        except asyncio.CancelledError:
            cancelled += 1
            raise

    await jobs.start()
    await clock.advance(12.0)  # ticks at 5 and 10, each cancelled 1.5 s later
    stats = engine(jobs).runners["hang"].stats
    assert cancelled == 2
    assert stats.timeouts == 2
    assert stats.last_run is not None
    assert stats.last_run.duration_s == pytest.approx(1.5)


@pytest.mark.parametrize("policy", ["finish", "cancel"])
async def test_leadership_loss_cancels_only_when_asked(
    make: Factory,
    clock: FakeClock,
    journal: Journal,
    policy: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    jobs = make()

    @jobs.fixed_rate("long", every=60.0, on_leadership_lost=policy)  # type: ignore[arg-type]
    async def long(ctx: JobContext) -> None:
        run = journal.begin(ctx)
        try:
            await clock.sleep(30)
        finally:
            run.ended = clock.monotonic()

    clock.jump_wall(-0.5)  # make the first tick come 0.5 s after start
    await jobs.start()
    await clock.advance(1.0)
    assert len(journal.runs) == 1
    elector = engine(jobs).elector
    deadline = elector.leases["long"].deadline

    async def unreachable(*args: object, **kwargs: object) -> object:
        raise ConnectionError("gone")

    monkeypatch.setattr(elector._store, "elect", unreachable)
    await clock.advance(10.0)
    run = journal.runs[0]
    if policy == "cancel":
        assert run.ended is not None
        assert run.ended == pytest.approx(deadline, abs=0.02), "cancelled at the deadline"
        stats = engine(jobs).runners["long"].stats
        assert stats.last_run is not None and stats.last_run.outcome is Outcome.CANCELLED
    else:
        assert run.ended is None


async def test_two_nodes_never_run_a_job_at_once(
    make: Factory, clock: FakeClock, journal: Journal
) -> None:
    nodes = [make(name) for name in ("a", "b", "c")]
    for jobs in nodes:

        @jobs.fixed_rate("tick", every=0.5)
        async def tick(ctx: JobContext) -> None:
            run = journal.begin(ctx)
            await clock.sleep(0.3)
            run.ended = clock.monotonic()

        await jobs.start()
    await clock.advance(5.0)
    await stop(nodes[0], clock)  # graceful: hands over at once
    await clock.advance(5.0)
    assert journal.max_concurrent() == 1
    leaders = {run.node for run in journal.runs}
    assert len(leaders) == 2 and "a" in leaders
    tokens = [run.token for run in journal.runs]
    assert tokens == sorted(tokens)
    (successor,) = leaders - {"a"}
    gap = min(r.started for r in journal.runs if r.node == successor) - max(
        r.started for r in journal.runs if r.node == "a"
    )
    assert gap <= 0.5 + 0.3 + 0.06, "the next tick after the handover runs on the new leader"


async def test_shutdown_drains_the_run_in_flight_before_releasing(
    make: Factory, clock: FakeClock, journal: Journal
) -> None:
    a, b = make("a"), make("b")
    for jobs in (a, b):

        @jobs.fixed_rate("tick", every=10.0)
        async def tick(ctx: JobContext) -> None:
            run = journal.begin(ctx)
            await clock.sleep(1.0)
            run.ended = clock.monotonic()

    clock.jump_wall(-0.5)
    await a.start()
    await b.start()
    await clock.advance(0.7)
    (run,) = journal.runs
    assert run.ended is None
    await stop(a, clock)
    assert journal.runs[0].ended == pytest.approx(1001.5, abs=0.06), "drained, not cancelled"
    assert engine(b).elector.is_leader("tick")


async def test_shutdown_cancels_runs_after_the_timeout(make: Factory, clock: FakeClock) -> None:
    jobs = make(shutdown_timeout=1.0)
    outcome: list[str] = []

    @jobs.interval("forever", every=10.0)
    async def forever() -> None:
        try:
            await clock.sleep(1000)
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise

    await jobs.start()
    await clock.advance(0.1)
    began = clock.monotonic()
    await stop(jobs, clock)
    assert outcome == ["cancelled"]
    assert clock.monotonic() - began == pytest.approx(1.0, abs=0.06)


async def test_a_disabled_job_never_touches_the_store(make: Factory, clock: FakeClock) -> None:
    jobs = make()
    ran = False

    @jobs.fixed_rate("off", every=0.5, enabled=False)
    async def off() -> None:
        nonlocal ran
        ran = True

    await jobs.start()
    await clock.advance(5.0)
    assert not ran
    assert "off" not in engine(jobs).elector.leases
    assert "off" not in engine(jobs).runners


async def test_sync_jobs_run_in_a_worker_thread(make: Factory, clock: FakeClock) -> None:
    jobs = make()
    threads: list[str] = []
    done = threading.Event()

    @jobs.interval("sync", every=100.0)
    def sync(ctx: JobContext) -> None:
        assert ctx.is_leader
        threads.append(threading.current_thread().name)
        done.set()

    await jobs.start()
    await clock.settle()
    assert await asyncio.to_thread(done.wait, 5.0)
    assert threads and threads[0].startswith("singletonjob")
    assert threads[0] != threading.current_thread().name


async def test_context_carries_the_run_facts(make: Factory, clock: FakeClock) -> None:
    jobs = make(node_id="node-1")
    seen: list[JobContext] = []

    @jobs.fixed_rate("ctx", every=1.0)
    async def job(context: JobContext) -> None:
        seen.append(context)

    await jobs.start()
    await clock.advance(2.0)
    first, second = seen[:2]
    assert (first.job, first.node_id, first.fencing_token) == ("ctx", "node-1", 1)
    assert first.scheduled_at == START + timedelta(seconds=1)
    assert first.started_at == first.scheduled_at
    assert (first.iteration, second.iteration) == (1, 2)
    assert first.is_leader and not first.leadership_lost.is_set()


async def test_no_run_starts_on_a_lease_that_expired_while_the_loop_was_blocked(
    make: Factory, clock: FakeClock, journal: Journal
) -> None:
    jobs = make()

    @jobs.fixed_rate("tick", every=1.0)
    async def tick(ctx: JobContext) -> None:
        journal.begin(ctx).ended = clock.monotonic()

    await jobs.start()
    await clock.advance(2.5)
    runs = len(journal.runs)
    # A whole lock expiry: past the deadline of the last renewal, whenever in the heartbeat
    # the node's rounds fall (a random phase; 2.9 s left it leading when its last round was
    # sent less than 0.07 s before the stall).
    clock.stall(3.0)
    runner = engine(jobs).runners["tick"]
    assert runner.start(clock.now()) is None
    assert len(journal.runs) == runs


class Twice:
    """A custom schedule: two instants, then none."""

    def __init__(self, first: datetime) -> None:
        self.instants = [first, first + timedelta(seconds=1)]

    def next_fire(self, after: datetime) -> datetime | None:
        return next((t for t in self.instants if t > after), None)


class Broken:
    def next_fire(self, after: datetime) -> datetime | None:
        raise ArithmeticError("bad schedule")


async def test_custom_schedule_that_ends_releases_the_lock(
    make: Factory, clock: FakeClock, journal: Journal
) -> None:
    jobs = make()

    @jobs.schedule("twice", Twice(START + timedelta(seconds=2)))
    async def twice(ctx: JobContext) -> None:
        journal.begin(ctx).ended = clock.monotonic()

    await jobs.start()
    await clock.advance(10.0)
    assert [run.scheduled_at for run in journal.runs] == Twice(
        START + timedelta(seconds=2)
    ).instants
    lease = engine(jobs).elector.leases["twice"]
    assert not lease.wanted and lease.token is None and lease.value is None


class Counted:
    """A custom schedule that counts its calls: ticks every second."""

    def __init__(self) -> None:
        self.calls = 0

    def next_fire(self, after: datetime) -> datetime | None:
        self.calls += 1
        return after.replace(microsecond=0) + timedelta(seconds=1)  # the next whole second


async def test_jobs_declared_alike_share_the_math_of_their_instants(
    make: Factory, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Jobs whose schedules are equal built-in ones (``FixedRate``, ``Cron``) have their next
    instant computed once per instant for all of them, and each runs every instant of its
    own grid; a custom schedule is asked for every job, every time (it may be anything)."""
    computed: list[str] = []
    next_fire = ticker_module._next_fire

    def counting(runner: JobRunner, after: datetime) -> datetime | None:
        computed.append(runner.spec.name)
        return next_fire(runner, after)

    monkeypatch.setattr(ticker_module, "_next_fire", counting)
    jobs = make()
    runs: dict[str, list[datetime]] = {}
    customs = [Counted(), Counted()]
    names = [f"alike-{i}" for i in range(5)]
    for name in [*names, "offset", "custom-0", "custom-1"]:

        async def body(ctx: JobContext) -> None:
            runs.setdefault(ctx.job, []).append(ctx.scheduled_at)

        if name == "offset":
            jobs.fixed_rate(name, every=1.0, offset=0.5)(body)
        elif name.startswith("custom"):
            jobs.schedule(name, customs[int(name[-1])])(body)
        else:
            jobs.fixed_rate(name, every=1.0)(body)

    await jobs.start()
    await clock.advance(10.0)
    grid = runs[names[0]]
    assert len(grid) >= 9 and all(b - a == timedelta(seconds=1) for a, b in pairwise(grid))
    assert all(runs[name] == grid for name in names), runs
    assert all(runs[f"custom-{i}"] == grid for i in range(2)), runs
    offset = runs["offset"]
    assert len(offset) >= 9 and all(b - a == timedelta(seconds=1) for a, b in pairwise(offset))
    assert all(instant.microsecond == 500_000 for instant in offset), offset
    # Past the start (two per job: the first instant and the one after it), per instant:
    # one computation for the five alike (not five), one for the offset job, and one for
    # each custom job.
    shared = [name for name in computed if not name.startswith("custom")]
    assert len(shared) <= 2 * 6 + 2 * len(grid), computed
    assert all(computed.count(f"custom-{i}") >= len(grid) for i in range(2)), computed
    assert all(counted.calls >= len(grid) for counted in customs)


async def test_a_failing_schedule_is_logged_and_resigned(
    make: Factory, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    jobs = make()

    @jobs.schedule("broken", Broken())
    async def broken() -> None:
        raise AssertionError("never runs")

    with caplog.at_level(logging.ERROR, logger="fastapi_singletonjob"):
        await jobs.start()
        await clock.advance(2.0)
    assert isinstance(engine(jobs).ticker.failure("broken"), ArithmeticError)
    assert any("schedule of job 'broken' failed" in r.getMessage() for r in caplog.records)
    assert not engine(jobs).elector.is_leader("broken")


async def test_a_cancel_that_lands_while_a_timed_out_run_unwinds_is_not_swallowed(
    make: Factory, clock: FakeClock
) -> None:
    """The timeout cancelled the run; a cancel of the runner's task (shutdown) that lands
    while the run unwinds is that task's own, and propagates: it is not the run's timeout."""
    jobs = make()
    unwinding, release = asyncio.Event(), asyncio.Event()

    @jobs.interval("slow", every=60.0, timeout=1.0)
    async def slow() -> None:
        try:
            await clock.sleep(10.0)
        except asyncio.CancelledError:
            unwinding.set()
            await release.wait()  # a slow cleanup
            raise

    await jobs.start()
    await clock.advance(1.5)
    assert unwinding.is_set()
    task = engine(jobs).runners["slow"].current
    assert task is not None
    task.cancel()
    await asyncio.sleep(0)
    release.set()
    await asyncio.wait({task})
    assert task.cancelled()
    last = engine(jobs).runners["slow"].stats.last_run
    assert last is not None and last.outcome is Outcome.CANCELLED
