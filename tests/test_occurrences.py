"""Cron instants across failovers, leaderless gaps and wall-clock steps: each runs at most once,
and one missed during a takeover runs once within its grace (fake clock, memory store)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fake_nodes import kill

from fastapi_singletonjob import DropReason, JobContext, SingletonJobs
from fastapi_singletonjob._store.base import ClaimResult
from fastapi_singletonjob.testing import FakeClock

# 02:59:50 UTC: the daily 03:00 instant comes 10 s after the start
START = datetime(2026, 3, 1, 2, 59, 50, tzinfo=UTC)
THREE = datetime(2026, 3, 1, 3, 0, tzinfo=UTC)

Factory = Callable[..., SingletonJobs]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


@pytest.fixture
async def make(clock: FakeClock, request: pytest.FixtureRequest) -> AsyncIterator[Factory]:
    made: list[SingletonJobs] = []
    url = f"memory://{abs(hash(request.node.nodeid))}"

    def factory(node_id: str, runs: list[tuple[str, datetime]], **cron: Any) -> SingletonJobs:
        jobs = SingletonJobs(
            url, project="occ", node_id=node_id, clock=clock, heartbeat_interval=1, lock_expiry=3
        )

        @jobs.cron("report", "0 3 * * *", **cron)
        async def report(ctx: JobContext) -> None:
            runs.append((ctx.node_id, ctx.scheduled_at))

        made.append(jobs)
        return jobs

    yield factory
    for jobs in made:
        task = asyncio.create_task(jobs.stop())
        while not task.done():
            await clock.advance(0.05)
        await task


def drops(jobs: SingletonJobs, reason: DropReason) -> int:
    assert jobs.engine is not None
    return jobs.engine.runners["report"].stats.dropped[reason]


@pytest.mark.parametrize("checkpoint", [True, False])
async def test_successor_does_not_run_an_instant_the_dead_leader_ran(
    make: Factory, clock: FakeClock, checkpoint: bool
) -> None:
    runs: list[tuple[str, datetime]] = []
    a, b = make("a", runs, checkpoint=checkpoint), make("b", runs, checkpoint=checkpoint)
    await a.start()
    await clock.settle()
    await b.start()
    await clock.advance(11.0)  # 03:00:01: a ran the instant
    assert runs == [("a", THREE)]
    kill(a)
    await clock.advance(10.0)  # b takes over about 3 s later and considers 03:00 again
    assert b.engine is not None and b.engine.elector.is_leader("report")
    assert runs == [("a", THREE)], "the store stops a second run"
    # With a checkpoint, b knows from it that 03:00 ran; without, the claim refuses it.
    assert drops(b, DropReason.ALREADY_RUN) == (0 if checkpoint else 1)


async def test_an_instant_missed_in_a_leaderless_gap_runs_once_on_the_successor(
    make: Factory, clock: FakeClock
) -> None:
    runs: list[tuple[str, datetime]] = []
    a, b = make("a", runs), make("b", runs)
    await a.start()
    await clock.settle()
    await b.start()
    await clock.advance(9.0)  # 02:59:59
    kill(a)  # dies one second before the instant: nobody leads at 03:00
    await clock.advance(10.0)
    assert runs == [("b", THREE)]
    # taken over ~3 s after a's last renewal, i.e. at about 03:00:01-03:00:02
    assert b.engine is not None
    last = b.engine.runners["report"].stats.last_run
    assert last is not None and last.started_at - THREE < timedelta(seconds=3)


async def test_misfire_grace_bounds_the_catch_up(make: Factory, clock: FakeClock) -> None:
    runs: list[tuple[str, datetime]] = []
    a, b = make("a", runs, misfire_grace=1.0), make("b", runs, misfire_grace=1.0)
    await a.start()
    await clock.settle()
    await b.start()
    await clock.advance(9.0)
    kill(a)
    await clock.advance(10.0)  # b leads only at ~03:00:02, past the 1 s grace
    assert runs == []
    assert drops(b, DropReason.LATE) == 1


async def test_a_node_whose_wall_clock_steps_back_does_not_run_an_instant_twice(
    make: Factory, clock: FakeClock
) -> None:
    runs: list[tuple[str, datetime]] = []
    a = make("a", runs)
    await a.start()
    await clock.advance(11.0)
    assert runs == [("a", THREE)]
    clock.jump_wall(-30.0)  # NTP steps the clock back: 03:00 comes again on the wall
    await clock.advance(40.0)
    assert runs == [("a", THREE)], "the loop moves on from the last instant it handled"


@pytest.mark.parametrize("checkpoint", [True, False])
async def test_a_successor_with_a_clock_behind_does_not_rerun(
    make: Factory, clock: FakeClock, checkpoint: bool
) -> None:
    runs: list[tuple[str, datetime]] = []
    a, b = make("a", runs, checkpoint=checkpoint), make("b", runs, checkpoint=checkpoint)
    await a.start()
    await clock.settle()
    await b.start()
    await clock.advance(11.0)
    kill(a)
    clock.jump_wall(-30.0)  # from here on, the surviving node's clock is 30 s behind
    await clock.advance(60.0)
    assert runs == [("a", THREE)]
    if not checkpoint:  # with one, b knows from it that 03:00 ran and does not try
        assert drops(b, DropReason.ALREADY_RUN) >= 1


async def test_a_store_error_at_the_instant_is_retried_within_the_grace(
    make: Factory, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[tuple[str, datetime]] = []
    a = make("a", runs, misfire_grace=5.0)
    await a.start()
    await clock.advance(5.0)
    assert a.engine is not None
    store = a.engine.elector._store
    real_claim = store.claim
    failures = 0

    async def flaky_claim(job: str, value: str, instant_us: int, **kwargs: Any) -> ClaimResult:
        nonlocal failures
        if failures < 3:
            failures += 1
            raise ConnectionError("blip")
        return await real_claim(job, value, instant_us, **kwargs)

    monkeypatch.setattr(store, "claim", flaky_claim)
    await clock.advance(10.0)
    assert runs == [("a", THREE)]
    assert failures == 3
