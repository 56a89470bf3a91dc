"""Rows 2-7, 30 and 41: replica processes killed, stopped, paused, blocked and rolled.

Timing (the CI defaults): heartbeat H = 0.1 s, lock expiry T = 0.5 s, the lease deadline
``lease_s`` = 0.4945 s after a renewal is sent; a fixed-rate job every 0.1 s. Faults are real
signals to real processes; every bound adds ``TOL_S`` of scheduling slack.
"""

from __future__ import annotations

import signal
from typing import Literal

import pytest

from .checker import (
    duplicates,
    first_accepted,
    max_concurrent,
    missed_instants,
    overlap_s,
    stale_writes,
    writes_sent_after,
)
from .harness import EXIT_S, FULL, TOL_S, Cluster, Results, full_only, now, reps
from .replica import JobConfig

JOB = "tick"
EVERY_S = 0.1
TICK = JobConfig(JOB, kind="rate", every=EVERY_S, run_s=0.03)


async def three_replicas(
    cluster: Cluster, job: JobConfig = TICK, *, http: bool = False, runs: bool = True
) -> str:
    """Start the store and three replicas; return the leader's node id once it has run
    three times (or, with ``runs=False``, once it leads)."""
    cluster.redis()
    nodes = [cluster.replica(f"n{i}", [job], http=http) for i in (1, 2, 3)]
    await cluster.ready(*nodes)
    if not runs:
        return await cluster.wait_leader(job.name)
    return await cluster.one_leader(job.name)


@pytest.mark.parametrize("rep", reps(5))
async def test_row02_sigkill_leader_mid_run(cluster: Cluster, record: Results, rep: int) -> None:
    t = cluster.timing
    leader = await three_replicas(cluster)
    victim = cluster.replica_of(leader)
    run = await cluster.mid_run(JOB, leader)
    killed_at = victim.kill()
    assert await victim.wait_exit() == -signal.SIGKILL

    first = await cluster.first_run(
        JOB, after=killed_at, newer_than=run.token, timeout_s=t.lock_expiry + 5
    )
    await cluster.until_runs(JOB, 5, since=first.start, timeout_s=5)
    runs = cluster.runs(JOB)
    takeover = first.start - killed_at
    done = sum(r.outcome == "ok" for r in runs)
    counter = cluster.witness_counter(JOB)
    record.add("2", "sigkill", takeover_s=takeover, max_concurrent=max_concurrent(runs))
    assert max_concurrent(runs) == 1
    # The lock expires T after the last renewal, which came at most one heartbeat (and a
    # round trip) before the kill; the first run waits for the next tick of the grid.
    assert t.lock_expiry - t.heartbeat - 0.05 <= takeover <= t.lock_expiry + EVERY_S + TOL_S
    assert done <= counter <= done + 1  # no lost update; the killed run may have counted
    assert cluster.witness_fence(JOB)[1] == 0


@pytest.mark.parametrize("state", ["idle", "running"])
async def test_row03_sigterm_hands_over(cluster: Cluster, record: Results, state: str) -> None:
    # Runs of 0.3 s every 0.5 s, so that SIGTERM can land inside a run or between runs.
    job = JobConfig(JOB, kind="rate", every=0.5, run_s=0.3 if state == "running" else 0.02)
    leader = await three_replicas(cluster, job, http=True)
    old = cluster.replica_of(leader)
    if state == "running":
        run = await cluster.mid_run(JOB, leader)
    else:
        # Right after a run ended: the next tick is about 0.5 s away.
        await cluster.mid_run(JOB, leader)
        await cluster.wait(lambda: cluster.in_flight(JOB, leader) is None, 5, "idle", poll_s=0.002)
        run = cluster.runs(JOB)[-1]
    sent_at = old.terminate()
    assert await old.wait_exit() in (0, -signal.SIGTERM), cluster.describe()

    first = await cluster.first_run(JOB, after=sent_at, newer_than=run.token, timeout_s=5)
    events = cluster.events()
    released = [e for e in events if e.ev == "released" and e.node == leader]
    lead = next(e for e in events if e.ev == "lead" and e.token == first.token)
    runs = cluster.runs(JOB)
    last_old = [r for r in runs if r.node == leader][-1]
    assert released, cluster.describe()  # the lock was handed over, not left to expire
    assert last_old.end is not None
    # From SIGTERM, or from the end of the old leader's last run when it was running (the
    # release follows it), to the new term.
    handover = lead.t - max(sent_at, last_old.end)
    record.add(
        "3",
        f"sigterm-{state}",
        handover_s=handover,
        sigterm_to_successor_s=lead.t - sent_at,
        last_run_outcome=last_old.outcome,
    )
    assert max_concurrent(runs) == 1
    assert last_old.outcome == "ok"  # drained, not cut: it finished before the release
    assert last_old.end <= released[0].t
    # The release notice wakes the followers at once: one round trip, not a poll.
    assert 0 <= handover <= cluster.timing.heartbeat + TOL_S
    assert "Traceback" not in old.output()


@pytest.mark.parametrize("server", [pytest.param("uvicorn", marks=full_only), "asyncio"])
async def test_row04_sigterm_with_a_run_stuck_in_a_thread(
    cluster: Cluster, record: Results, server: str
) -> None:
    # A sync job sleeping 8 s in a thread (it cannot be cancelled). Shutdown waits
    # shutdown_timeout (1 s), cancels, waits CANCEL_GRACE_S (5 s), then stops renewing and
    # leaves the lock to expire instead of releasing it.
    job = JobConfig(JOB, kind="rate", every=0.5, behavior="thread_sleep", run_s=8.0, steps=16)
    leader = await three_replicas(cluster, job, http=server == "uvicorn", runs=False)
    old = cluster.replica_of(leader)
    run = await cluster.mid_run(JOB, leader, timeout_s=5)
    sent_at = old.terminate()
    first = await cluster.first_run(JOB, after=sent_at, newer_than=run.token, timeout_s=15)
    code = await old.wait_exit(timeout_s=15)
    await cluster.wait(lambda: old.pid in old.exits, 5, "the exit is noted")
    exited_at = old.exits[old.pid]
    await cluster.wait(
        lambda: len(next(r for r in cluster.runs(JOB) if r.run == first.run).writes) >= 2,
        5,
        "the successor writes",
    )
    runs = cluster.runs(JOB)
    stuck = next(r for r in runs if r.run == run.run)
    late, rejected = stale_writes(runs)
    released = [e for e in cluster.events() if e.ev == "released" and e.node == leader]
    overlap = overlap_s(runs)
    record.add(
        "4",
        f"sigterm-stuck-thread-{server}",
        successor_after_sigterm_s=first.start - sent_at,
        old_exit_after_sigterm_s=exited_at - sent_at,
        overlap_s=overlap,
        late_writes=late,
        rejected_writes=rejected,
        exit_code=code,
    )
    assert not released  # never released while its run may still be alive
    assert "did not end after cancellation" in old.output()
    # Leases were renewed through the drain: no successor before shutdown_timeout + grace.
    assert first.start - sent_at >= 1.0 + 5.0
    if server == "uvicorn":
        # uvicorn re-raises SIGTERM once its shutdown completed: the process dies with the
        # stuck thread right after the election stopped, before the lock expires.
        assert code == -signal.SIGTERM
        assert max_concurrent(runs) == 1
        assert exited_at <= first.start
    else:
        # Known limit (docs/design.md, "A sync job cannot be interrupted"): Python waits for
        # the thread at exit, the lock expires meanwhile, and the runs overlap until the
        # thread returns; the fenced register rejects the stuck run's writes after the
        # successor's first write.
        assert code == 0
        assert stuck.end is not None and stuck.end > first.start
        assert overlap <= stuck.end - first.start + 0.01
        successor_write = first_accepted(runs, above=run.token)
        assert all(not w.ok for w in writes_sent_after(stuck, successor_write))


@pytest.mark.parametrize("policy", ["finish", "cancel"])
@pytest.mark.parametrize("rep", reps(3))
async def test_row05_sigstop_leader_for_two_lease_times(
    cluster: Cluster, record: Results, policy: Literal["finish", "cancel"], rep: int
) -> None:
    t = cluster.timing
    job = JobConfig(JOB, kind="rate", every=0.2, run_s=0.15, steps=3, policy=policy)
    leader = await three_replicas(cluster, job)
    old = cluster.replica_of(leader)
    run = await cluster.mid_run(JOB, leader)
    stopped_at = await old.pause()
    try:
        first = await cluster.first_run(
            JOB, after=stopped_at, newer_than=run.token, timeout_s=t.lock_expiry + 5
        )
        await cluster.sleep(stopped_at + 2 * t.lock_expiry - now())
    finally:
        resumed_at = await old.resume()
    await cluster.until_runs(JOB, 5, since=resumed_at, timeout_s=5)
    await cluster.wait(lambda: cluster.in_flight(JOB, leader) is None, 5, "the old run ends")

    runs = cluster.runs(JOB)
    paused = next(r for r in runs if r.run == run.run)
    after_resume = writes_sent_after(paused, resumed_at)
    late, rejected = stale_writes(runs)
    done = sum(r.outcome == "ok" for r in runs)
    lost_updates = max(0, done - cluster.witness_counter(JOB))
    stale_starts = [r for r in runs if r.node == leader and r.start > resumed_at]
    record.add(
        "5",
        f"sigstop-2T-{policy}",
        takeover_s=first.start - stopped_at,
        resume_to_end_s=(paused.end or 0) - resumed_at,
        old_run_outcome=paused.outcome,
        writes_after_resume=len(after_resume),
        rejected_writes=rejected,
        overlap_s=overlap_s(runs),
        lost_updates=lost_updates,
    )
    assert first.start - stopped_at <= t.lock_expiry + 0.2 + TOL_S
    # No new run by the old leader after it resumes: its lease deadline has passed.
    assert not [r for r in stale_starts if r.token == run.token]
    # Everything the paused run still writes after resuming is stale, and rejected.
    assert all(not w.ok for w in after_resume), after_resume
    if policy == "cancel":
        # The deadline passed during the pause: the library cancels the run as soon as the
        # loop runs again. The job ends at its next await; now and then its in-flight witness
        # command (redis-py) absorbs that cancel and the job ends after its remaining steps,
        # whose writes are stale and rejected above (docs/reliability.md, row 5).
        assert cluster.log_has("lost leadership; cancelling the run", old)
        assert paused.end is not None
        if paused.outcome == "cancelled":
            assert len(after_resume) <= 1
            assert paused.end - resumed_at <= TOL_S
        else:
            assert paused.end - resumed_at <= job.run_s + TOL_S


@pytest.mark.parametrize("rep", reps(5))
async def test_row06_short_sigstop_of_the_leader(
    cluster: Cluster, record: Results, rep: int
) -> None:
    # Half a lease: shorter than T - margin - H, so the next renewal still finds the key.
    t = cluster.timing
    leader = await three_replicas(cluster)
    old = cluster.replica_of(leader)
    await cluster.until_runs(JOB, 5, since=0, timeout_s=5)
    stopped_at = await old.pause()
    await cluster.sleep(stopped_at + t.lock_expiry / 2 - now())
    resumed_at = await old.resume()
    await cluster.until_runs(JOB, 10, since=resumed_at, timeout_s=5)
    runs = cluster.runs(JOB)
    around = [r for r in runs if stopped_at - 1 <= r.start]
    longest_gap = max(b.start - a.start for a, b in zip(around, around[1:], strict=False))
    record.add("6", "sigstop-T/2", terms=len(cluster.terms(JOB)), longest_gap_s=longest_gap)
    assert len(cluster.terms(JOB)) == 1, cluster.terms(JOB)
    assert max_concurrent(runs) == 1
    assert longest_gap <= resumed_at - stopped_at + EVERY_S + TOL_S


async def test_row07_sigstop_a_follower(cluster: Cluster, record: Results) -> None:
    t = cluster.timing
    leader = await three_replicas(cluster)
    follower = next(r for r in cluster.replicas.values() if r.name != leader)
    stopped_at = await follower.pause()
    await cluster.sleep(stopped_at + 3 * t.lock_expiry - now())
    resumed_at = await follower.resume()
    await cluster.until_runs(JOB, 10, since=resumed_at, timeout_s=5)
    runs = cluster.runs(JOB)
    record.add("7", "sigstop-follower-3T", terms=len(cluster.terms(JOB)))
    assert len(cluster.terms(JOB)) == 1
    assert {r.node for r in runs} == {leader}
    assert max_concurrent(runs) == 1
    assert follower.alive


@pytest.mark.parametrize("rep", reps(3))
async def test_row30_event_loop_blocked_in_the_leader(
    cluster: Cluster, record: Results, rep: int
) -> None:
    # The third run blocks in a sleep of 2T inside its coroutine: the whole event loop of the
    # leader (renewals included) stands still.
    t = cluster.timing
    block_s = 2 * t.lock_expiry
    job = JobConfig(
        JOB, kind="rate", every=0.2, run_s=0.06, steps=2, behavior="block_loop", hold_s=block_s
    )
    job.block_on = 3
    leader = await three_replicas(cluster, job)
    await cluster.wait(
        lambda: any(e.ev == "block" for e in cluster.events()), 10, "the loop blocks"
    )
    block = next(e for e in cluster.events() if e.ev == "block")
    first = await cluster.first_run(
        JOB, after=block.t, newer_than=int(block.token or 0), timeout_s=t.lock_expiry + 5
    )
    unblock = await cluster.wait(
        lambda: any(e.ev == "unblock" for e in cluster.events()), 5, "the loop runs again"
    )
    await cluster.until_runs(JOB, 5, since=unblock, timeout_s=5)
    runs = cluster.runs(JOB)
    unblocked_at = next(e.t for e in cluster.events() if e.ev == "unblock")
    blocked_run = next(r for r in runs if r.run == block.run)
    stale_starts = [r for r in runs if r.node == leader and r.start > unblocked_at]
    after = writes_sent_after(blocked_run, unblocked_at)
    record.add(
        "30",
        "event-loop-blocked-2T",
        takeover_s=first.start - block.t,
        overlap_s=overlap_s(runs),
        writes_after_unblock=len(after),
        rejected=sum(not w.ok for w in after),
    )
    assert first.start - block.t <= t.lock_expiry + 0.2 + TOL_S
    assert not [r for r in stale_starts if r.token == block.token]
    assert all(not w.ok for w in after)


@pytest.mark.timeout(180)
async def test_row41_rolling_restart(cluster: Cluster, record: Results) -> None:
    cluster.redis()
    nodes = [cluster.replica(f"n{i}", [TICK], http=True) for i in (1, 2, 3)]
    await cluster.ready(*nodes)
    await cluster.one_leader(JOB)
    began = now()
    rounds = 2 if FULL else 1
    for _ in range(rounds):
        for node in nodes:
            node.terminate()
            assert await node.wait_exit(EXIT_S) in (0, -signal.SIGTERM), cluster.describe()
            node.spawn()
            await cluster.ready(node)
    await cluster.until_runs(JOB, 10, since=now(), timeout_s=10)
    runs = cluster.runs(JOB)
    window = [r for r in runs if r.start >= began]
    missed = missed_instants(window, EVERY_S, window[0].scheduled, window[-1].scheduled)
    transitions = len([term for term in cluster.terms(JOB) if term.t >= began])
    record.add(
        "41",
        "rolling-restart",
        restarts=rounds * len(nodes),
        transitions=transitions,
        missed_ticks=len(missed),
        of_ticks=len(window) + len(missed),
    )
    assert max_concurrent(runs) == 1
    assert duplicates(runs) == {}
    # Only stopping the leader moves the lock; a graceful stop hands it over at once.
    assert transitions <= rounds * len(nodes)
    assert len(missed) <= transitions * 2 + 2, missed
