"""Rows 23-25, 39 and 40: wall-clock steps on one replica, DST, and cron across takeovers.

Clock faults use libfaketime on one replica with ``FAKETIME_DONT_FAKE_MONOTONIC=1``,
``FAKETIME_NO_CACHE=1`` and a ``FAKETIME_TIMESTAMP_FILE`` (``+3600``, ``-30``, ...) that the
test rewrites while the replica runs: its wall clock steps, its monotonic clock (leases,
timeouts, the journal) does not. Cron and custom instants are claimed in Redis before they
run (the "last instant" key), so none runs twice across leaders or clock steps; an instant
missed while no node led is caught up once by the new leader within ``misfire_grace``
(default: until the next instant).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import datetime, timezone

import pytest

from .checker import Run, duplicates, max_concurrent
from .harness import TOL_S, Cluster, Results, full_only, needs_faketime, now
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


async def faketime_leader(cluster: Cluster, jobs: list[JobConfig]) -> None:
    """The store, a leader ``f`` under libfaketime (offset 0 for now), and a follower."""
    cluster.redis()
    leader = cluster.replica("f", jobs, clock_offset=0.0)
    await cluster.ready(leader)
    for job in jobs:
        assert await cluster.wait_leader(job.name) == "f"
    follower = cluster.replica("n1", jobs)
    await cluster.ready(follower)
    await cluster.until_runs(CRON.name, 2, since=now(), timeout_s=10)


@needs_faketime
async def test_row23_leader_wall_clock_jumps_forward(cluster: Cluster, record: Results) -> None:
    jobs = [RATE, INTERVAL, CRON]
    await faketime_leader(cluster, jobs)
    jumped_at = now()
    cluster.replicas["f"].set_clock(3600.0)
    await cluster.sleep(3.0)
    after = {job.name: [r for r in cluster.runs(job.name) if r.start > jumped_at] for job in jobs}
    terms = {job.name: len(cluster.terms(job.name)) for job in jobs}
    # The step is corrected: the leader's cron instants are now an hour behind the last
    # instant claimed in Redis.
    corrected_at = now()
    cluster.replicas["f"].set_clock(0.0)
    await cluster.sleep(3.0)
    cron_after_fix = [r for r in cluster.runs(CRON.name) if r.start > corrected_at]
    record.add(
        "23",
        "leader-clock+1h",
        terms=terms,
        rate_runs_3s=len(after["rate"]),
        interval_runs_3s=len(after["interval"]),
        cron_runs_3s=len(after["cron"]),
        cron_runs_3s_after_correction=len(cron_after_fix),
    )
    assert terms == {job.name: 1 for job in jobs}  # leases run on the monotonic clock
    assert len(after["rate"]) >= 10 and len(after["interval"]) >= 10  # cadence unchanged
    assert len(after["cron"]) >= 2
    for job in jobs:
        runs = cluster.runs(job.name)
        assert max_concurrent(runs) == 1
        if job.kind != "interval":
            assert duplicates(runs) == {}
    # Skipped occurrences are not run; no cron instant runs twice or out of order.
    assert increasing(cluster.runs(CRON.name))


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
        last_run_by_a=datetime.fromtimestamp(run.scheduled, timezone.utc).isoformat(),
        runs_by_b_in_3s=len(by_b),
        b_first_run_s=(by_b[0].start - killed_at) if by_b else None,
    )
    assert not [r for r in by_b if r.scheduled <= run.scheduled], by_b
    assert increasing(cluster.runs(EVERY_2S.name))


@pytest.mark.parametrize("case", ["mid-run", "catch-up", "catch-up-grace-0.1s"])
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
FALL_BACK_UTC = datetime(2026, 11, 1, 6, 0, tzinfo=timezone.utc)  # 02:00 EDT -> 01:00 EST
SPRING_FORWARD_UTC = datetime(2026, 3, 8, 7, 0, tzinfo=timezone.utc)  # 02:00 EST -> 03:00 EDT


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
