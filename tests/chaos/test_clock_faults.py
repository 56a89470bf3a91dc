"""Rows 23-25, 39 and 40: wall-clock steps on one replica, DST, and cron across takeovers.

Clock faults use libfaketime on one replica (``harness.faketime_env``): a
``FAKETIME_TIMESTAMP_FILE`` (``+3600``, ``-30``, ...) that the test rewrites while the replica
runs steps its wall clock, and only that, as a real NTP step does: its monotonic clocks
(leases, asyncio's timers, the journal) do not move, which the harness checks once per
session. Cron and custom instants are claimed in Redis before they run (the "last instant"
key), so none runs twice across leaders or clock steps; an instant missed while no node led
is caught up once by the new leader within ``misfire_grace`` (default: until the next
instant).

What libfaketime cannot show: the clocks of the other processes (Redis, the follower) stay
put, as they would when NTP steps one host; and the step reaches the replica through its
clock reads, not through a kernel wait already pending on the wall clock (the library has
none: asyncio waits relative timeouts on ``CLOCK_MONOTONIC``). Row 23 also runs in-process on
a stepped clock, without libfaketime.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest

from fastapi_singletonjob import JobContext, SingletonJobs
from fastapi_singletonjob._clock import SYSTEM_CLOCK

from .checker import Run, duplicates, max_concurrent
from .harness import TOL_S, Cluster, Results, Timing, full_only, needs_faketime, now
from .replica import JobConfig

RATE = JobConfig("rate", kind="rate", every=0.2, run_s=0.02)
INTERVAL = JobConfig("interval", kind="interval", every=0.2, run_s=0.02)
CRON = JobConfig("cron", kind="cron", expression="* * * * * *", run_s=0.05)
EVERY_2S = JobConfig("cron2", kind="cron", expression="* * * * * */2", run_s=0.1)


def increasing(runs: Sequence[Run]) -> bool:
    """True when every run's instant is later than the instants of all runs started before
    it: no instant runs twice, and none older than one already run."""
    highest = float("-inf")
    for run in sorted(runs, key=lambda r: r.start):
        if run.scheduled <= highest:
            return False
        highest = run.scheduled
    return True


def on_grid(instant: float, every_s: float) -> bool:
    """True when ``instant`` (Unix seconds) is a whole multiple of ``every_s``."""
    ticks = round(instant / every_s)
    return abs(instant - ticks * every_s) < 1e-4


def between(runs: Sequence[Run], start: float, end: float) -> list[Run]:
    """The runs that started in ``(start, end]`` (journal clock)."""
    return [run for run in runs if start < run.start <= end]


async def faketime_leader(
    cluster: Cluster, jobs: list[JobConfig], *, watch_loop: bool = False
) -> None:
    """The store, a leader ``f`` under libfaketime (offset 0 for now), and a follower."""
    cluster.redis()
    leader = cluster.replica("f", jobs, clock_offset=0.0, watch_loop=watch_loop)
    await cluster.ready(leader)
    for job in jobs:
        assert await cluster.wait_leader(job.name) == "f"
    follower = cluster.replica("n1", jobs)
    await cluster.ready(follower)
    await cluster.until_runs(CRON.name, 2, since=now(), timeout_s=10)


STEP_S = 3600.0


@needs_faketime
async def test_row23_leader_wall_clock_jumps_forward(cluster: Cluster, record: Results) -> None:
    # An NTP step of +1 h on the leader, then its correction, a step of -1 h.
    jobs = [RATE, INTERVAL, CRON]
    await faketime_leader(cluster, jobs, watch_loop=True)
    leader = cluster.replicas["f"]
    wall = time.time() - now()  # the real wall clock, on the journal clock
    leader.set_clock(STEP_S)
    stepped_at = now()
    await cluster.sleep(3.0)
    leader.set_clock(0.0)
    corrected_at = now()
    await cluster.sleep(3.0)
    ended_at = now()
    # A run the replica fired just before a step may be journaled just after it: skip 50 ms.
    stepped = {
        job.name: between(cluster.runs(job.name), stepped_at + 0.05, corrected_at) for job in jobs
    }
    corrected = {
        job.name: between(cluster.runs(job.name), corrected_at + 0.05, ended_at) for job in jobs
    }
    terms = {job.name: len(cluster.terms(job.name)) for job in jobs}
    stall = max(cluster.stalls(leader, since=stepped_at), default=0.0)
    record.add(
        "23",
        "leader-clock+1h",
        terms=terms,
        longest_loop_stall_s=stall,
        rate_runs_3s=len(stepped["rate"]),
        interval_runs_3s=len(stepped["interval"]),
        cron_runs_3s=len(stepped["cron"]),
        interval_runs_3s_after_correction=len(corrected["interval"]),
        rate_runs_3s_after_correction=len(corrected["rate"]),
        cron_runs_3s_after_correction=len(corrected["cron"]),
    )
    # Leases run on the monotonic clock, which no step moves: one term per job through both
    # steps. Only a stall of the leader's event loop longer than its lease could end a term;
    # but cron, whose every claim is refused as an hour ahead, is let go a lock expiry
    # later (for a node whose clock is right; alone, f takes it back after its rest).
    assert {name: n for name, n in terms.items() if name != CRON.name} == {
        job.name: 1 for job in jobs if job is not CRON
    }, (
        f"longest stall of the leader's event loop after the step: {stall:.3f} s "
        f"(the lease is {cluster.timing.lease_s:.3f} s)\n{cluster.describe()}"
    )
    # After +1 h: fixed rate goes on at its cadence, on its grid of the stepped clock, and
    # interval at its cadence (it waits on the monotonic clock).
    assert len(stepped["rate"]) >= 10 and len(stepped["interval"]) >= 10
    for run in stepped["rate"]:
        assert on_grid(run.scheduled, RATE.every), run
        assert -0.01 <= wall + run.start + STEP_S - run.scheduled <= TOL_S, run
    # Cron either goes on, on the whole seconds of the stepped clock (its claims succeed), or
    # the store refuses instants an hour ahead of its own clock and the leader says so.
    # Or, once f let it go, the follower runs it on its own (right) clock: its first run may
    # be the instant it took over in, caught up within its grace (the next instant).
    for run in stepped["cron"]:
        assert on_grid(run.scheduled, 1.0), run
        if run.node == "f":
            assert -0.01 <= wall + run.start + STEP_S - run.scheduled <= TOL_S, run
        else:
            assert -0.01 <= wall + run.start - run.scheduled <= 1.0 + TOL_S, run
    assert len(stepped["cron"]) >= 2 or cluster.log_has("is ahead of the store's clock", leader)
    assert terms[CRON.name] == 1 or cluster.log_has("wall clock is ahead of Redis's", leader)
    # After the correction: interval keeps its cadence; fixed rate and cron run nothing at or
    # before an instant already run (they wait for the wall clock to pass it again).
    assert len(corrected["interval"]) >= 10
    for job in jobs:
        runs = cluster.runs(job.name)
        assert max_concurrent(runs) == 1
        if job.kind != "interval":
            assert duplicates(runs) == {}
            assert increasing(runs), job.name


class SteppedClock:
    """The system clock, with a wall clock that a test steps as NTP does: the monotonic clock
    (leases, sleeps) never moves with it."""

    def __init__(self) -> None:
        self.step = timedelta()

    def monotonic(self) -> float:
        """See ``Clock.monotonic``."""
        return SYSTEM_CLOCK.monotonic()

    def now(self) -> datetime:
        """See ``Clock.now``: the system's wall clock plus the step."""
        return SYSTEM_CLOCK.now() + self.step

    async def sleep(self, seconds: float) -> None:
        """See ``Clock.sleep``."""
        await SYSTEM_CLOCK.sleep(seconds)


async def longest_stall(until: asyncio.Event, period_s: float = 0.01) -> float:
    """The longest time this event loop did not run a ``period_s`` sleeper, until ``until``."""
    longest = 0.0
    while not until.is_set():
        asleep = time.monotonic()
        await asyncio.sleep(period_s)
        longest = max(longest, time.monotonic() - asleep - period_s)
    return longest


async def test_row23_wall_clock_step_in_process(
    unique_project: str, record: Results, caplog: pytest.LogCaptureFixture
) -> None:
    # Row 23 without libfaketime, on the chaos timings: a leader of a per-second cron job and
    # a fixed-rate job whose wall clock steps +1 h, then back. Reacting to the step must not
    # block the event loop (the election's heartbeats run on it), and no term may end.
    timing = Timing()
    clock = SteppedClock()
    jobs = SingletonJobs(
        "memory://",
        project=unique_project,
        node_id="a",
        clock=clock,
        heartbeat_interval=timing.heartbeat,
        lock_expiry=timing.lock_expiry,
    )
    tokens: dict[str, set[int]] = {"cron": set(), "rate": set()}
    cron_runs: list[datetime] = []

    @jobs.cron("cron", "* * * * * *")
    async def cron(ctx: JobContext) -> None:
        tokens["cron"].add(ctx.fencing_token)
        cron_runs.append(ctx.scheduled_at)

    @jobs.fixed_rate("rate", every=0.2)
    async def rate(ctx: JobContext) -> None:
        tokens["rate"].add(ctx.fencing_token)

    caplog.set_level(logging.WARNING, logger="fastapi_singletonjob")
    async with jobs:
        deadline = time.monotonic() + 10.0
        while len(cron_runs) < 2:
            assert time.monotonic() < deadline, "the cron job never ran twice"
            await asyncio.sleep(0.01)
        done = asyncio.Event()
        watcher = asyncio.create_task(longest_stall(done))
        clock.step = timedelta(seconds=STEP_S)
        await asyncio.sleep(2.5)
        runs_after_step = len(cron_runs)
        clock.step = timedelta()
        await asyncio.sleep(1.5)
        done.set()
        stall = await watcher
    lost = [r.getMessage() for r in caplog.records if "lost leadership" in r.getMessage()]
    record.add("23", "in-process-clock+1h", longest_loop_stall_s=stall, terms_lost=len(lost))
    assert lost == [], f"longest event-loop stall: {stall:.3f} s"
    assert {job: len(seen) for job, seen in tokens.items()} == {"cron": 1, "rate": 1}
    assert stall < timing.lease_s - timing.heartbeat, "a wall-clock step blocked the loop"
    assert runs_after_step > 2  # cron went on after the step
    assert cron_runs == sorted(set(cron_runs))  # no instant twice, none out of order


@needs_faketime
async def test_row24_leader_wall_clock_jumps_back(cluster: Cluster, record: Results) -> None:
    jobs = [RATE, CRON]
    await faketime_leader(cluster, jobs)
    last_before = {job.name: cluster.runs(job.name)[-1].scheduled for job in jobs}
    jumped_at = now()
    cluster.replicas["f"].set_clock(-3600.0)
    await cluster.sleep(3.0)
    after = {job.name: [r for r in cluster.runs(job.name) if r.start > jumped_at] for job in jobs}
    record.add(
        "24",
        "leader-clock-1h",
        terms={job.name: len(cluster.terms(job.name)) for job in jobs},
        rate_runs_3s=len(after["rate"]),
        cron_runs_3s=len(after["cron"]),
    )
    for job in jobs:
        runs = cluster.runs(job.name)
        assert len(cluster.terms(job.name)) == 1
        assert max_concurrent(runs) == 1
        assert duplicates(runs) == {}
        # Nothing already run runs again (the cron claim; the rate grid waits for the
        # wall clock to pass the last tick).
        assert all(r.scheduled > last_before[job.name] for r in after[job.name])
    assert increasing(cluster.runs(CRON.name))


@needs_faketime
async def test_row25_follower_behind_takes_over_after_a_cron_run(
    cluster: Cluster, record: Results
) -> None:
    t = cluster.timing
    cluster.redis()
    a = cluster.replica("a", [EVERY_2S])
    await cluster.ready(a)
    assert await cluster.wait_leader(EVERY_2S.name) == "a"
    b = cluster.replica("b", [EVERY_2S], clock_offset=-30.0)
    await cluster.ready(b)
    run = await cluster.mid_run(EVERY_2S.name, "a", timeout_s=10)
    await cluster.wait(lambda: cluster.in_flight(EVERY_2S.name, "a") is None, 5, "it ends")
    killed_at = a.kill()  # just after the occurrence ran
    await cluster.wait(
        lambda: any(term.node == "b" for term in cluster.terms(EVERY_2S.name)),
        t.lock_expiry + 5,
        "b leads",
    )
    await cluster.sleep(3.0)
    by_b = [r for r in cluster.runs(EVERY_2S.name) if r.node == "b"]
    record.add(
        "25",
        "follower-30s-behind",
        last_run_by_a=datetime.fromtimestamp(run.scheduled, UTC).isoformat(),
        runs_by_b_in_3s=len(by_b),
        b_first_run_s=(by_b[0].start - killed_at) if by_b else None,
    )
    assert not [r for r in by_b if r.scheduled <= run.scheduled], by_b
    assert increasing(cluster.runs(EVERY_2S.name))


@pytest.mark.parametrize(
    "case",
    # the CI subset runs it mid-run and with a 0.1 s grace; the full matrix also "catch-up"
    ["mid-run", pytest.param("catch-up", marks=full_only), "catch-up-grace-0.1s"],
)
async def test_row40_leader_killed_around_a_cron_instant(
    cluster: Cluster, record: Results, case: str
) -> None:
    t = cluster.timing
    job = EVERY_2S
    if case == "catch-up-grace-0.1s":
        job = JobConfig("cron2", kind="cron", expression="* * * * * */2", run_s=0.1)
        job.misfire_grace = 0.1
    cluster.redis()
    nodes = [cluster.replica(f"n{i}", [job]) for i in (1, 2)]
    await cluster.ready(*nodes)
    leader = await cluster.wait_leader(job.name)
    run = await cluster.mid_run(job.name, leader, timeout_s=10)
    victim = cluster.replica_of(leader)
    if case == "mid-run":
        killed_at = victim.kill()
        target = run.scheduled  # must not run again
    else:
        # Kill 0.15 s before the next instant: it passes while nobody leads.
        target = run.scheduled + 2.0
        await cluster.sleep(target - time.time() - 0.15)
        killed_at = victim.kill()
    await cluster.wait(
        lambda: len({term.node for term in cluster.terms(job.name)}) == 2,
        t.lock_expiry + 5,
        "the other node leads",
    )
    took_over = cluster.terms(job.name)[-1].t
    await cluster.until_runs(job.name, 1, since=took_over + 1.0, timeout_s=5)
    runs = cluster.runs(job.name)
    of_target = [r for r in runs if abs(r.scheduled - target) < 1e-3]
    successor = [r for r in runs if r.start > killed_at]
    record.add(
        "40",
        f"leader-killed-{case}",
        takeover_s=took_over - killed_at,
        runs_of_instant=len(of_target),
        successor_first=(
            round(successor[0].scheduled - target, 3) if successor else None
        ),  # its first instant, relative to the one at stake
    )
    assert increasing(runs)
    assert max_concurrent(runs) == 1
    if case == "mid-run":
        # The instant was claimed by the old leader: at most once, even though its run
        # was cut short.
        assert len(of_target) == 1
        assert successor and successor[0].scheduled > target
    elif case == "catch-up":
        # Missed during the takeover, run once by the new leader as soon as it leads.
        assert len(of_target) == 1 and of_target[0].start > killed_at
        assert of_target[0].start - took_over <= TOL_S
    else:
        assert of_target == []  # more than misfire_grace late: skipped


# Row 39: daylight-saving changes, end to end. The replica's wall clock starts a few seconds
# before the change (libfaketime); its cron job is in America/New_York.
FALL_BACK_UTC = datetime(2026, 11, 1, 6, 0, tzinfo=UTC)  # 02:00 EDT -> 01:00 EST
SPRING_FORWARD_UTC = datetime(2026, 3, 8, 7, 0, tzinfo=UTC)  # 02:00 EST -> 03:00 EDT


async def dst_runs(cluster: Cluster, job: JobConfig, change: datetime) -> list[Run]:
    """Run ``job`` on one replica whose clock starts 8 s before ``change`` and return its
    runs once its clock is 6 s past it."""
    cluster.redis()
    offset = change.timestamp() - 8.0 - time.time()
    spawned = time.time()
    replica = cluster.replica("dst", [job], clock_offset=offset)
    await cluster.ready(replica)
    await cluster.wait_leader(job.name)
    await cluster.sleep(spawned + 14.0 - time.time())
    return cluster.runs(job.name)


@full_only  # 14 s of real time; the schedule's fall-back rule is tested in test_schedule.py
@needs_faketime
async def test_row39_fall_back_runs_a_fixed_hour_job_in_the_first_hour_only(
    cluster: Cluster, record: Results
) -> None:
    # Every second of 01:xx local: 01:59:5x EDT runs, and 01:00:0x EST (the repeated hour)
    # does not.
    job = JobConfig(
        "dst", kind="cron", expression="* 1 * * * *", timezone="America/New_York", run_s=0.02
    )
    runs = await dst_runs(cluster, job, FALL_BACK_UTC)
    change = FALL_BACK_UTC.timestamp()
    record.add(
        "39",
        "fall-back-new-york",
        runs_before=sum(r.scheduled < change for r in runs),
        runs_in_repeated_hour=sum(r.scheduled >= change for r in runs),
    )
    assert sum(r.scheduled < change for r in runs) >= 2
    assert [r for r in runs if r.scheduled >= change] == []
    assert duplicates(runs) == {}


@full_only
@needs_faketime
async def test_row39_spring_forward_runs_a_job_in_the_gap_once(
    cluster: Cluster, record: Results
) -> None:
    # 02:30 does not exist on 2026-03-08 in New York: the job runs once, at 03:00 EDT.
    job = JobConfig(
        "dst", kind="cron", expression="30 2 * * *", timezone="America/New_York", run_s=0.02
    )
    runs = await dst_runs(cluster, job, SPRING_FORWARD_UTC)
    record.add("39", "spring-forward-new-york", instants=[r.scheduled for r in runs])
    assert [r.scheduled for r in runs] == [SPRING_FORWARD_UTC.timestamp()]
