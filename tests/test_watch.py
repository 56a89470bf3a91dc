"""What followers ask about (``_watch``), with whole nodes on a fake clock (memory store, zero
real time): a job held by one node is watched by one other node, the rest look at it only in
turns, so Redis does not pay for every follower; and no job is left without a watcher."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from fake_nodes import kill
from test_spread import EXPIRY_S, HEARTBEAT_S, JOBS, cluster, leaders, run_for, three_settled

from fastapi_singletonjob import SingletonJobs
from fastapi_singletonjob._store.base import LeaseReply, LeaseRequest

__all__ = ["cluster"]  # the fixture, used by name

WINDOW_S = 5.0  # ten lock expiries
MEMBERS = 3


def record_asks(jobs: SingletonJobs) -> list[set[str]]:
    """From now on, the jobs of each election call of ``jobs``, in order."""
    engine = jobs.engine
    assert engine is not None
    store = engine.store
    elect = store.elect
    asked: list[set[str]] = []

    async def recording(node_id: str, requests: Sequence[LeaseRequest]) -> list[LeaseReply]:
        asked.append({request.job for request in requests})
        return await elect(node_id, requests)

    store.elect = recording  # type: ignore[method-assign]
    return asked


def asks_per_follower(
    nodes: list[SingletonJobs], asked: dict[str, list[set[str]]], job: str, holder: str
) -> list[int]:
    """How many rounds of each node but the holder asked about ``job``, most first."""
    return sorted(
        (sum(job in call for call in asked[n.node_id]) for n in nodes if n.node_id != holder),
        reverse=True,
    )


async def test_a_held_job_is_watched_by_one_follower_and_surveyed_by_the_others(
    cluster: Callable[..., SingletonJobs],
) -> None:
    clock, nodes, settled = await three_settled(cluster)
    asked = {jobs.node_id: record_asks(jobs) for jobs in nodes}

    history = await run_for(clock, nodes, WINDOW_S)

    assert all(seen == settled for seen in history), "leadership moved in a settled cluster"
    for job, holder in settled.items():
        assert holder is not None
        watcher, other = asks_per_follower(nodes, asked, job, holder)
        # The watcher: at least every half lock expiry (20 in the window).
        assert watcher >= 0.8 * WINDOW_S / (EXPIRY_S / 2), (job, watcher, other)
        # Another follower: in the survey's turns only, once per half lock expiry times the
        # members (6.7 in the window); before, every half lock expiry like the watcher.
        assert other <= WINDOW_S / (EXPIRY_S / 2 * MEMBERS) + 2, (job, watcher, other)
    # The holders' own rounds ask about every job they lead, every heartbeat.
    for jobs in nodes:
        mine = [job for job, holder in settled.items() if holder == jobs.node_id]
        rounds = [call for call in asked[jobs.node_id] if set(mine) <= call]
        assert len(rounds) >= 0.9 * WINDOW_S / HEARTBEAT_S


@pytest.mark.parametrize("job", ["job-00", "job-07"])
async def test_when_a_holder_and_its_watcher_die_together_the_last_node_takes_over(
    cluster: Callable[..., SingletonJobs], job: str
) -> None:
    clock, nodes, settled = await three_settled(cluster)
    asked = {jobs.node_id: record_asks(jobs) for jobs in nodes}
    await run_for(clock, nodes, 1.0)
    holder = settled[job]
    assert holder is not None
    watcher = max(
        (jobs.node_id for jobs in nodes if jobs.node_id != holder),
        key=lambda node_id: sum(job in call for call in asked[node_id]),
    )
    (last,) = [jobs for jobs in nodes if jobs.node_id not in (holder, watcher)]
    for jobs in nodes:
        if jobs is not last:
            kill(jobs)

    # The lock runs out one lock expiry after the holder's last renewal, the watcher's
    # membership as long after its last round; the last node then watches the job and
    # takes it at its next round.
    history = await run_for(clock, [last], 2 * EXPIRY_S + 4 * HEARTBEAT_S)

    assert history[-1] == dict.fromkeys(JOBS, last.node_id)


async def test_a_pause_wakes_every_node_for_that_job_only(
    cluster: Callable[..., SingletonJobs],
) -> None:
    clock, nodes, settled = await three_settled(cluster)
    job = "job-03"
    holder = settled[job]
    operator = next(jobs for jobs in nodes if jobs.node_id != holder)
    asked = {jobs.node_id: record_asks(jobs) for jobs in nodes}

    await operator.pause(job)
    await clock.advance(0.0)  # the notice's rounds, at once

    for jobs in nodes:
        assert jobs.status(job).jobs[0].paused, jobs.node_id
        first = asked[jobs.node_id][0]
        # That job, the jobs the node leads, and a watched or surveyed one or two: not every
        # job (a full round of every replica at each pause, before).
        mine = {name for name, node_id in settled.items() if node_id == jobs.node_id}
        assert mine | {job} <= first and len(first) < len(JOBS), (jobs.node_id, first)
    assert leaders(nodes) == settled


async def test_a_followers_status_shows_no_lease_time_for_a_job_it_last_saw_long_ago(
    cluster: Callable[..., SingletonJobs],
) -> None:
    clock, nodes, settled = await three_settled(cluster)
    await run_for(clock, nodes, WINDOW_S)

    unknown = 0
    for jobs in nodes:
        for view in jobs.status().jobs:
            assert view.leader == settled[view.name]  # the holder, as last seen
            if view.is_leader:
                assert view.lease_time_left_s is not None and view.lease_time_left_s > 0
            elif view.lease_time_left_s is None:
                unknown += 1
            else:
                assert 0 <= view.lease_time_left_s <= EXPIRY_S  # rounded to the ms
    # Each job has one watcher, which keeps seeing it; the other follower mostly does not.
    assert 0 < unknown <= len(JOBS)


async def test_a_node_that_handed_a_job_over_sees_who_took_it(
    cluster: Callable[..., SingletonJobs],
) -> None:
    """Placement counts each node's jobs from what this node last saw: a node that handed a
    job over looks (never takes) until it sees the taker, instead of counting the job as its
    own for as long as it rests (which made it move one job too many after a leave)."""
    clock, nodes, settled = await three_settled(cluster)
    job = "job-05"
    holder = next(jobs for jobs in nodes if jobs.node_id == settled[job])
    engine = holder.engine
    assert engine is not None

    await holder.step_down(job)
    history = await run_for(clock, nodes, 3 * HEARTBEAT_S)

    taker = history[-1][job]
    assert taker not in (None, holder.node_id), history[-1]
    assert engine.elector.leases[job].holder == taker
    # Still resting: it took nothing back.
    assert all(seen[job] != holder.node_id for seen in history[5:])


async def test_after_a_crash_every_node_sees_who_took_the_dead_nodes_jobs(
    cluster: Callable[..., SingletonJobs],
) -> None:
    """The watcher takes a dead node's jobs over without a notice; the other nodes watch a
    job whose holder left the membership until they see its new holder, so their views (and
    placement's counts of each node's jobs) are right within a heartbeat of that, not only
    after the survey's turn."""
    clock, nodes, settled = await three_settled(cluster)
    victim, survivors = nodes[0], nodes[1:]
    kill(victim)

    taken = 0.0
    while None in leaders(survivors).values() or victim.node_id in leaders(survivors).values():
        assert taken < 2 * EXPIRY_S + 4 * HEARTBEAT_S, leaders(survivors)
        await clock.advance(0.01)
        taken += 0.01
    # At most a lock expiry after the crash the record left the membership too; a few
    # heartbeats later every survivor has looked (the survey's turn: 0.75 s).
    history = await run_for(clock, survivors, 3 * HEARTBEAT_S)

    led = history[-1]
    assert None not in led.values(), led
    for jobs in survivors:
        engine = jobs.engine
        assert engine is not None
        seen = {job: engine.elector.leases[job].holder for job in JOBS}
        assert seen == led, jobs.node_id
