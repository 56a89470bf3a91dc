"""Opt-in precision (``precision=``): the timer wakes that long before an instant, starts the
run then, held before the job's code, and opens it when the instant comes. On the fake clock
and the memory store."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fake_nodes import stop
from test_runner import Factory, clock, engine, make

from fastapi_singletonjob import DropReason, JobContext
from fastapi_singletonjob._engine.engine import Engine
from fastapi_singletonjob._store.base import ClaimResult
from fastapi_singletonjob.testing import FakeClock

__all__ = ["clock", "make"]  # fixtures

PRECISION_S = 0.005


def apart(a: datetime, b: datetime) -> float:
    """Seconds from ``b`` to ``a``."""
    return (a - b).total_seconds()


def slow_claims(jobs_engine: Engine, clock: FakeClock, delay_s: float) -> list[datetime]:
    """Make the store take ``delay_s`` to answer each claim; return when each was asked."""
    store = jobs_engine.store
    claim = store.claim
    asked: list[datetime] = []

    async def slow(job: str, value: str, instant_us: int, **kwargs: Any) -> ClaimResult:
        asked.append(clock.now())
        await clock.sleep(delay_s)
        return await claim(job, value, instant_us, **kwargs)

    store.claim = slow  # type: ignore[method-assign]
    return asked


async def test_the_claim_is_made_ahead_and_the_code_starts_on_the_instant(
    make: Factory, clock: FakeClock
) -> None:
    """A cron job claims each instant in the store before running it: with ``precision``,
    that round trip (3 ms here) is made before the instant, not between it and the code."""
    jobs = make(precision=PRECISION_S)
    runs: list[tuple[JobContext, datetime]] = []

    @jobs.cron("minutely", "* * * * *")
    async def minutely(ctx: JobContext) -> None:
        runs.append((ctx, clock.now()))

    await jobs.start()
    asked = slow_claims(engine(jobs), clock, 0.003)
    await clock.advance(330.0)  # five instants, the next one's claim not yet asked
    assert len(runs) == 5
    assert len(asked) == len(runs)
    for (ctx, began), claimed in zip(runs, asked, strict=True):
        assert abs(apart(began, ctx.scheduled_at)) <= 1e-6, "the code starts on the instant"
        assert abs(apart(ctx.started_at, ctx.scheduled_at)) <= 1e-6
        assert 0.003 < apart(ctx.scheduled_at, claimed) <= PRECISION_S, "claimed ahead"
    assert engine(jobs).runners["minutely"].stats.dropped_total == 0


async def test_a_run_that_ends_after_the_wake_lets_the_next_instant_run(
    make: Factory, clock: FakeClock
) -> None:
    """A run still going when the timer wakes for the next instant is no reason to drop that
    instant: it fires when it comes, as without the setting, and the run has ended by then."""
    jobs = make(precision=PRECISION_S)
    runs: list[tuple[datetime, datetime]] = []

    @jobs.fixed_rate("busy", every=1.0)
    async def busy(ctx: JobContext) -> None:
        runs.append((ctx.scheduled_at, clock.now()))
        await clock.sleep(1.0 - PRECISION_S / 2)  # ends inside the next instant's wake

    await jobs.start()
    await clock.advance(20.5)
    assert len(runs) >= 19
    for instant, began in runs:
        assert abs(apart(began, instant)) <= 1e-6
    assert engine(jobs).runners["busy"].stats.dropped[DropReason.OVERLAP] == 0


async def test_a_run_held_when_shutdown_begins_runs_on_its_instant_and_is_drained(
    make: Factory, clock: FakeClock
) -> None:
    """The held run of a cron job has claimed its instant in the store, so no other node
    will run it: shutdown lets it run on its instant, and waits for it as for any run in
    flight, before releasing the lock."""
    jobs = make(precision=0.05)
    runs: list[tuple[JobContext, datetime]] = []

    @jobs.cron("minutely", "* * * * *")
    async def minutely(ctx: JobContext) -> None:
        runs.append((ctx, clock.now()))
        await clock.sleep(0.5)

    await jobs.start()
    asked = slow_claims(engine(jobs), clock, 0.001)
    await clock.advance(59.97)  # the instant is 30 ms away: its run is held, its claim made
    runner = engine(jobs).runners["minutely"]
    assert runner.current is not None
    assert runner.stats.running_since is None, "held, not running"
    assert len(asked) == 1
    await stop(jobs, clock)
    assert len(runs) == 1
    ctx, began = runs[0]
    assert abs(apart(began, ctx.scheduled_at)) <= 1e-6
    assert runner.stats.last_run is not None
    assert runner.stats.dropped_total == 0


async def test_a_node_that_does_not_lead_holds_no_run(make: Factory, clock: FakeClock) -> None:
    """Only the leader starts a run ahead; the follower counts each instant as not led, once,
    when it comes."""
    leader, follower = make("a", precision=PRECISION_S), make("b", precision=PRECISION_S)
    runs: list[str] = []
    for jobs in (leader, follower):

        @jobs.fixed_rate("tick", every=1.0)
        async def tick(ctx: JobContext) -> None:
            runs.append(ctx.node_id)

        await jobs.start()
        await clock.advance(0.1)
    await clock.advance(10.0)
    assert set(runs) == {"a"}
    assert len(runs) >= 9
    not_led = engine(follower).runners["tick"].stats.not_leader
    assert len(runs) - 1 <= not_led <= len(runs) + 1
