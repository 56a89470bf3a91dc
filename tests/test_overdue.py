"""Overdue jobs (issue 30, item 2): a job is overdue when no run started within its period
plus a grace; the spell opens once cluster-wide, is told to one node's ``on_overdue``, and ends
at the next run. The schedule math as pure functions; whole nodes on a fake clock with the
memory store; the store's check on the memory store and a real redis-server alike."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta

import httpx
import pytest
from fake_nodes import kill
from fastapi import FastAPI
from servers import RedisServer
from test_runner import START, Factory, clock, make
from waiting import wait_until

from fastapi_singletonjob import ConfigurationError, JobContext, OverdueEvent, SingletonJobs
from fastapi_singletonjob._checkpoint import to_unix_us
from fastapi_singletonjob._cli import render
from fastapi_singletonjob._clock import SystemClock
from fastapi_singletonjob._job.spec import JobSpec
from fastapi_singletonjob._overdue import (
    Anchor,
    default_grace_s,
    overdue_at,
    parse_anchor,
    parse_spell,
    spell_value,
)
from fastapi_singletonjob._run.overdue import OverdueWatch
from fastapi_singletonjob._schedule import Cron, FixedRate, Interval
from fastapi_singletonjob._store import keys as _keys
from fastapi_singletonjob._store.memory import MemoryLeaseStore
from fastapi_singletonjob._store.redis.store import RedisLeaseStore
from fastapi_singletonjob.testing import FakeClock

__all__ = ["clock", "make"]

T0 = START


def us(seconds: float) -> int:
    return to_unix_us(T0 + timedelta(seconds=seconds))


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


# -- the schedule math ---------------------------------------------------------------------


class Ending:
    """A custom schedule with two instants, then none."""

    def next_fire(self, after: datetime) -> datetime | None:
        for instant in (at(60), at(120)):
            if instant > after:
                return instant
        return None


@pytest.mark.parametrize(
    ("schedule", "anchor", "since", "grace_s", "expected"),
    [
        # interval: every 10 s after the end of the last run (its record's time), plus grace
        (Interval(10), Anchor(us(95), us(100), None), 0, 5.0, 115),
        # interval without a record's time: its instant
        (Interval(10), Anchor(us(95), None, None), 0, 5.0, 110),
        # fixed rate: the latest of the recorded and the claimed instant, plus the period
        (FixedRate(10), Anchor(us(100), us(101), us(110)), 0, 5.0, 125),
        (FixedRate(10), Anchor(us(120), us(121), us(110)), 0, 16.0, 146),
        # nothing stored: from when the node began to watch
        (FixedRate(10), Anchor(), 33, 5.0, 45),
        # a base before the watch began counts from the watch (a pause, a fleet restart)
        (Interval(10), Anchor(us(1), us(2), None), 50, 5.0, 65),
        # cron: the next instant plus misfire_grace
        (Cron("* * * * *"), Anchor(us(60), us(61), us(60)), 0, 5.0, 125),
        # cron without misfire_grace: a run may start until the instant after the next
        (Cron("* * * * *"), Anchor(us(60), us(61), us(60)), 0, None, 180),
        # custom: the same rules as cron; a schedule that has ended is never overdue
        (Ending(), Anchor(None, None, us(60)), 0, 1.0, 121),
        (Ending(), Anchor(None, None, us(60)), 0, None, None),
        (Ending(), Anchor(None, None, us(120)), 0, 1.0, None),
    ],
)
def test_when_a_job_is_overdue(
    schedule: object, anchor: Anchor, since: float, grace_s: float | None, expected: float | None
) -> None:
    found = overdue_at(schedule, anchor, since=at(since), grace_s=grace_s)  # type: ignore[arg-type]
    assert found == (None if expected is None else at(expected))


def test_the_default_grace_rides_out_a_failover() -> None:
    assert default_grace_s(10.0, 3.0) == 16.0


def test_anchors_and_spells_as_stored() -> None:
    anchor = parse_anchor(f"{us(1)},{us(2)},{us(3)}")
    assert (anchor.scheduled_us, anchor.completed_us, anchor.claimed_us) == (us(1), us(2), us(3))
    assert parse_anchor(",,").empty and parse_anchor("x,,9").claimed_us == 9
    value = spell_value(at(7), True, anchor)
    assert parse_spell(value) == (at(7), True, anchor.text)
    for odd in ("", "x", "12", "12:2:,,", "a:1:,,"):
        assert parse_spell(odd) is None


# -- whole nodes on a fake clock -----------------------------------------------------------


def told() -> tuple[list[OverdueEvent], Callable[[OverdueEvent], Awaitable[None]]]:
    """A callback and what it was told. A coroutine function, so that it runs on the loop
    at once (a plain one runs in a thread, in real time, while the fake clock runs in none)."""
    events: list[OverdueEvent] = []

    async def callback(event: OverdueEvent) -> None:
        events.append(event)

    return events, callback


async def test_the_spell_is_told_once_across_nodes_and_ends_at_the_next_run(
    make: Factory, clock: FakeClock
) -> None:
    """The leader stops (killed); two observers (the job disabled there, with a callback of
    their own) and the leader's own watch all check: one spell, one call. A new leader's run
    ends it on every node; the next silence is a new spell, told again."""
    events, callback = told()
    leader = make("a")
    observers = [make("b"), make("c")]

    @leader.fixed_rate("tick", every=1.0)
    async def tick(ctx: JobContext) -> None: ...

    for node in observers:
        node.fixed_rate("tick", every=1.0, enabled=False, on_overdue=callback)(tick)
    for node in (leader, *observers):
        await node.start()
    await clock.advance(4.5)
    assert events == [] and leader.status("tick").jobs[0].overdue_since is None
    last_start = clock.now().replace(microsecond=0)  # the tick of 4 s
    kill(leader)
    await clock.advance(12.0)
    # default grace: lock expiry 3 s + 2 heartbeats of 1 s; a period of 1 s
    since = last_start + timedelta(seconds=1 + 5)
    assert [(e.job, e.overdue_since, e.last_started_at) for e in events] == [
        ("tick", since, last_start)
    ]
    assert events[0].node_id in ("b", "c")
    for node in observers:
        assert node.status("tick").jobs[0].overdue_since == since
    view = await observers[0].cluster_status()
    (job,) = view.jobs
    assert job.overdue_since == since
    header, row = render(view).splitlines()[-2:]  # the CLI's status: its jobs table
    assert header.split()[-1] == "OVERDUE" and row.endswith("ago"), row
    assert "since" in row
    app = FastAPI()
    app.include_router(observers[0].router, prefix="/sj")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://b") as client:
        jobs_body = (await client.get("/sj/jobs")).json()
        cluster_body = (await client.get("/sj/cluster")).json()
    assert jobs_body["jobs"][0]["overdue_since"] == since.isoformat().replace("+00:00", "Z")
    assert cluster_body["jobs"][0]["overdue_since"] == jobs_body["jobs"][0]["overdue_since"]

    successor = make("d")
    successor.fixed_rate("tick", every=1.0)(tick)
    await successor.start()
    await clock.advance(4.0)
    for node in (*observers, successor):
        assert node.status("tick").jobs[0].overdue_since is None
    assert (await observers[0].cluster_status()).jobs[0].overdue_since is None
    assert len(events) == 1

    kill(successor)
    await clock.advance(12.0)
    assert len(events) == 2 and events[1].overdue_since > since


@pytest.mark.parametrize("phase_s", [0.0, 0.3, 0.6, 0.9])
async def test_a_failover_is_not_overdue(make: Factory, clock: FakeClock, phase_s: float) -> None:
    """The default grace covers a normal failover: the leader is killed (at each phase of its
    heartbeat), the other node takes over after the lock expiry, well within the period plus
    the grace after the last run; no spell opens."""
    events, callback = told()
    starts: list[datetime] = []

    async def tick(ctx: JobContext) -> None:
        starts.append(ctx.started_at)

    nodes = [make("a", on_overdue=callback), make("b", on_overdue=callback)]
    for node in nodes:
        node.fixed_rate("tick", every=1.0)(tick)
        await node.start()
    await clock.advance(3.0 + phase_s)
    leader = next(node for node in nodes if node.status("tick").jobs[0].is_leader)
    kill(leader)
    last = starts[-1]
    await clock.advance(30.0)
    after = [start for start in starts if start > last]
    assert after, "nobody took over"
    gap_s = (after[0] - last).total_seconds()
    assert gap_s < 1.0 + default_grace_s(3.0, 1.0), gap_s  # the period plus the grace
    assert gap_s > 3.0 - 1.0  # a real failover: the dead lease ran out first
    assert events == []
    other = next(node for node in nodes if node is not leader)
    assert other.status("tick").jobs[0].is_leader


async def _noop(ctx: JobContext) -> None: ...


async def test_a_paused_job_is_never_overdue_and_counts_afresh_on_resume(
    make: Factory, clock: FakeClock
) -> None:
    events, callback = told()
    leader, observer = make("a"), make("b")
    leader.interval("job", every=2.0)(_noop)
    observer.interval("job", every=2.0, enabled=False, on_overdue=callback)(_noop)
    await leader.start()
    await observer.start()
    await clock.advance(3.0)
    kill(leader)
    await clock.advance(12.0)
    assert len(events) == 1
    await observer.pause("job")
    assert (await observer.cluster_status()).jobs[0].overdue_since is None  # at once
    await clock.advance(3.5)  # the next check (every lock expiry) ends the spell
    assert observer.status("job").jobs[0].overdue_since is None
    assert (await observer.cluster_status()).jobs[0].overdue_since is None
    await clock.advance(60.0)  # paused: never overdue
    assert len(events) == 1
    await observer.resume("job")
    resumed = clock.now()
    # Not at once: the period and the grace count from the last check that saw it paused
    # (checks come every lock expiry, 3 s), so it is due 2 + 5 s after that check.
    await clock.advance(3.5)
    assert len(events) == 1 and observer.status("job").jobs[0].overdue_since is None
    await clock.advance(10.0)
    assert len(events) == 2
    delay = (events[1].overdue_since - resumed).total_seconds()
    assert 4.0 <= delay <= 7.0, delay


async def test_a_job_disabled_on_every_node_is_never_overdue(
    make: Factory, clock: FakeClock
) -> None:
    """``enabled=False`` without a callback of the job's own: not watched, even with a
    ``SingletonJobs``-wide ``on_overdue``."""
    events, callback = told()
    node = make("a", on_overdue=callback)
    node.fixed_rate("off", every=1.0, enabled=False)(_noop)
    await node.start()
    await clock.advance(60.0)
    assert events == []
    assert node.status("off").jobs[0].overdue_since is None
    assert node.engine is not None and node.engine.overdue.jobs == []


async def test_without_a_checkpoint_only_jobs_that_claim_each_instant_are_watched(
    make: Factory, clock: FakeClock
) -> None:
    """With ``checkpoint=False`` an interval or sub-second fixed-rate job stores no start: it
    would look silent however it runs, so it is not watched (and never overdue)."""
    events, callback = told()
    node = make("a", on_overdue=callback)
    node.interval("interval", every=1.0, checkpoint=False)(_noop)
    node.fixed_rate("fast", every=0.5, checkpoint=False)(_noop)
    node.fixed_rate("slow", every=1.0, checkpoint=False)(_noop)
    node.cron("cron", "* * * * *", checkpoint=False)(_noop)
    await node.start()
    assert node.engine is not None and sorted(node.engine.overdue.jobs) == ["cron", "slow"]
    await clock.advance(150.0)
    assert events == []  # they run: their claims keep them from being overdue


async def test_a_cron_job_is_overdue_misfire_grace_after_its_instant(
    make: Factory, clock: FakeClock
) -> None:
    events, callback = told()
    leader, observer = make("a"), make("b")
    leader.cron("report", "* * * * *", misfire_grace=5.0)(_noop)
    observer.cron("report", "* * * * *", misfire_grace=5.0, enabled=False, on_overdue=callback)(
        _noop
    )
    await leader.start()
    await observer.start()
    await clock.advance(61.0)  # runs at 00:01
    kill(leader)
    await clock.advance(70.0)
    assert [e.overdue_since for e in events] == [at(125)]
    assert events[0].last_started_at == at(60)


async def test_a_cron_job_without_misfire_grace_may_start_until_the_instant_after(
    make: Factory, clock: FakeClock
) -> None:
    events, callback = told()
    leader = make("a", on_overdue=callback)
    leader.cron("report", "* * * * *")(_noop)
    await leader.start()
    await clock.advance(61.0)
    kill(leader)  # its election and timer stop; its overdue watch goes on, and tells
    await clock.advance(130.0)
    assert [e.overdue_since for e in events] == [at(180)]
    assert events[0].node_id == "a"


async def test_overdue_grace_replaces_the_default(make: Factory, clock: FakeClock) -> None:
    events, callback = told()
    leader, observer = make("a"), make("b")
    leader.interval("job", every=1.0, overdue_grace=30)(_noop)  # the nodes agree on it
    observer.interval("job", every=1.0, enabled=False, on_overdue=callback, overdue_grace=30)(_noop)
    await leader.start()
    await observer.start()
    await clock.advance(2.5)
    kill(leader)
    await clock.advance(20.0)
    assert events == []
    await clock.advance(20.0)
    assert len(events) == 1


def test_bad_overdue_settings_are_refused() -> None:
    jobs = SingletonJobs("memory://", project="p")
    with pytest.raises(ConfigurationError, match="overdue_grace=-1"):
        jobs.interval("a", every=1.0, overdue_grace=-1)
    with pytest.raises(ConfigurationError, match="on_overdue=3 is not callable"):
        jobs.interval("b", every=1.0, on_overdue=3)(_noop)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="on_overdue='x' is not callable"):
        SingletonJobs("memory://", project="p", on_overdue="x")  # type: ignore[arg-type]


# -- the callback: bounded, and never in the way -------------------------------------------


def observed(name: str, callback: object) -> JobSpec:
    return JobSpec(name, _noop, FixedRate(1.0), "fixed_rate", enabled=False, on_overdue=callback)  # type: ignore[arg-type]


async def test_a_callback_that_raises_or_hangs_is_logged_and_given_up_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock(T0)
    store = MemoryLeaseStore("p", clock, url="memory://callbacks")
    release = threading.Event()
    calls: list[str] = []

    async def hangs(event: OverdueEvent) -> None:
        calls.append("hangs")
        await asyncio.Event().wait()

    def raises(event: OverdueEvent) -> None:
        calls.append("raises")
        raise RuntimeError("pager down")

    def blocks(event: OverdueEvent) -> None:  # a sync callback, in a thread
        calls.append("blocks")
        release.wait(5.0)

    specs = [observed("h", hangs), observed("r", raises), observed("b", blocks)]
    watch = OverdueWatch(
        store,
        specs,
        node_id="n",
        heartbeat_s=1.0,
        lock_expiry_s=3.0,
        retention_s=60.0,
        clock=clock,
        callback_timeout_s=0.2,
    )
    with caplog.at_level(logging.ERROR, "fastapi_singletonjob.overdue"):
        await watch.check()
        await clock.advance(10.0)
        await watch.check()  # all three overdue: their calls start, the check is not held up
        assert dict(watch.overdue()) == dict.fromkeys(("h", "r", "b"), at(6))
        await wait_until(lambda: len(calls) == 3, timeout_s=2.0)
        await watch.check()  # the next check goes on while the calls hang
        await wait_until(lambda: len(caplog.records) == 3, timeout_s=3.0)
    release.set()
    messages = sorted(record.getMessage() for record in caplog.records)
    assert messages == [
        "job 'b': on_overdue did not return within 0.2s; given up on",
        "job 'h': on_overdue did not return within 0.2s; given up on",
        "job 'r': on_overdue raised",
    ]
    assert sorted(calls) == ["blocks", "hangs", "raises"]  # once each: one spell
    await watch.aclose()
    await store.aclose()


@pytest.mark.redis
async def test_one_call_checks_500_jobs(
    redis_server: RedisServer, redis_url: str, unique_project: str
) -> None:
    """The cost: one ``EVALSHA`` per check for all of a node's watched jobs, and nothing else
    sent; the script's server time for 500 jobs is printed (docs/sizing.md quotes it)."""
    store = RedisLeaseStore(unique_project, url=redis_url)
    specs = [observed(f"job-{i:03d}", _told) for i in range(500)]
    watch = OverdueWatch(
        store,
        specs,
        node_id="n",
        heartbeat_s=3.0,
        lock_expiry_s=10.0,
        retention_s=60.0,
        clock=SystemClock(),
    )
    try:
        with redis_server.client() as client:
            for spec in specs:  # each job with a record and a claim, as in production
                fields = {"iteration": "7", "last_scheduled_us": us(1), "last_completed_us": us(2)}
                client.hset(_keys.job_key(unique_project, spec.name, "checkpoint"), mapping=fields)
                client.set(_keys.job_key(unique_project, spec.name, "last"), f"{us(1)}:3")
            await watch.check()  # loads the script
            assert watch.overdue() == dict.fromkeys(watch.jobs)
            client.config_resetstat()
            for _ in range(10):
                await watch.check()
            stats = client.info("commandstats")
    finally:
        await store.aclose()
    sent = {
        name.removeprefix("cmdstat_"): stat["calls"]
        for name, stat in stats.items()
        if not name.startswith(("cmdstat_config", "cmdstat_info"))
    }
    assert sent.pop("evalsha") == 10
    assert set(sent) <= {"hmget", "get", "hexists", "time"}, sent  # inside the script
    print(f"OVERDUE for 500 jobs: {stats['cmdstat_evalsha']['usec_per_call']:.0f} µs per call")


def _told(event: OverdueEvent) -> None: ...
