"""Real Redis faults under running ``SingletonJobs``: kill, restart empty, SIGSTOP, DEL.

Each test runs its nodes in this process against its own redis-server from ``fresh_redis``,
with a fixed-rate job every 50 ms (10 ms per run), heartbeat 0.1 s and lock expiry 0.5 s,
and journals the runs with ``time.monotonic()``. Bounds follow from the election rules: a node
acts on a lease only until ``sent + lock_expiry`` of its last confirmed renewal, so no run can
start later than ``lock_expiry`` after Redis stopped answering.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from node_proc import Run, max_concurrent, overlap_s, tokens_in_order
from servers import RedisServer, RedisServerFactory
from waiting import wait_until

from fastapi_singletonjob import JobContext, Outcome, SingletonJobs
from fastapi_singletonjob._election.lease import Lease
from fastapi_singletonjob._store import keys as _keys

pytestmark = pytest.mark.redis

JOB = "tick"
HEARTBEAT_S = 0.1
LOCK_EXPIRY_S = 0.5
MAX_BACKOFF_S = 1.0
EVERY_S = 0.05
RUN_S = 0.01
TOLERANCE_S = 0.15  # scheduling slack on a busy two-core machine


class Journal:
    """Every run of every node of one test, on ``time.monotonic()``."""

    def __init__(self) -> None:
        self.runs: list[Run] = []

    async def tick(self, ctx: JobContext) -> None:
        run = Run(ctx.node_id, ctx.fencing_token, ctx.scheduled_at.timestamp(), time.monotonic())
        self.runs.append(run)
        await asyncio.sleep(RUN_S)
        run.end = time.monotonic()

    def since(self, instant: float) -> list[Run]:
        return [run for run in self.runs if run.start >= instant]

    def last_token(self) -> int:
        return max(run.token for run in self.runs)


class Nodes:
    """The ``SingletonJobs`` of one test; those still running are stopped at teardown."""

    def __init__(self, project: str) -> None:
        self.project = project
        self.all: list[SingletonJobs] = []

    def make(self, url: str, node: str, **settings: Any) -> SingletonJobs:
        options: dict[str, Any] = {
            "heartbeat_interval": HEARTBEAT_S,
            "lock_expiry": LOCK_EXPIRY_S,
            "max_backoff": MAX_BACKOFF_S,
            "shutdown_timeout": 1.0,
        }
        options.update(settings)
        jobs = SingletonJobs(url, project=self.project, node_id=node, **options)
        self.all.append(jobs)
        return jobs

    async def start(self, url: str, journal: Journal, *names: str) -> list[SingletonJobs]:
        started = []
        for name in names:
            jobs = self.make(url, name)
            jobs.fixed_rate(JOB, every=EVERY_S)(journal.tick)
            await jobs.start()
            started.append(jobs)
        return started

    def leaders(self, job: str = JOB) -> list[str]:
        return [
            jobs.node_id
            for jobs in self.all
            if jobs.engine is not None and jobs.engine.elector.is_leader(job)
        ]

    async def aclose(self) -> None:
        for jobs in self.all:
            await jobs.stop()


@pytest.fixture
async def nodes(unique_project: str) -> AsyncIterator[Nodes]:
    group = Nodes(unique_project)
    try:
        yield group
    finally:
        await group.aclose()


async def running(journal: Journal, nodes: Nodes, runs: int = 5) -> None:
    """Wait until the job has run ``runs`` times under one leader."""
    await wait_until(lambda: len(journal.runs) >= runs, 5.0, f"{runs} runs")
    assert len(nodes.leaders()) == 1


async def kill(server: RedisServer) -> float:
    """SIGKILL Redis (in a thread: the nodes keep running); return when it was dead."""
    await asyncio.to_thread(server.kill)
    return time.monotonic()


async def just_after_a_round(jobs: SingletonJobs) -> None:
    """Return right after ``jobs`` finished an election round."""
    engine = jobs.engine
    assert engine is not None
    before = engine.elector.last_round_at
    await wait_until(lambda: engine.elector.last_round_at != before, 1.0, "a round", poll_s=0.001)


async def leads_at(lease: Lease) -> float:
    """The ``time.monotonic()`` at which the node starts a term of ``lease`` (polled every
    millisecond)."""
    await wait_until(lambda: lease.token is not None, 5.0, "a term", poll_s=0.001)
    return time.monotonic()


async def runs_since(journal: Journal, instant: float, count: int) -> None:
    """Wait until ``count`` runs have started since ``instant``."""
    await wait_until(
        lambda: len(journal.since(instant)) >= count, 2.0, f"{count} runs since {instant:.3f}"
    )


async def first_run_above(journal: Journal, token: int, timeout_s: float) -> Run:
    """The first run of a term newer than ``token``, once there is one."""
    await wait_until(
        lambda: any(run.token > token for run in journal.runs), timeout_s, "a run of a new term"
    )
    return next(run for run in journal.runs if run.token > token)


async def test_redis_killed_leader_stops_within_lock_expiry(
    fresh_redis: RedisServerFactory, nodes: Nodes
) -> None:
    server, journal = fresh_redis(), Journal()
    await nodes.start(server.url, journal, "a", "b")
    await running(journal, nodes)

    killed_at = await kill(server)
    stepped_down_at = await wait_until(
        lambda: not nodes.leaders(), LOCK_EXPIRY_S + TOLERANCE_S, "every node steps down"
    )
    last_start = max(run.start for run in journal.runs)
    print(
        f"Redis killed: leader stepped down after {(stepped_down_at - killed_at) * 1000:.0f} ms, "
        f"last run started {(last_start - killed_at) * 1000:.0f} ms after the kill"
    )
    # Runs go on while the confirmed lease lasts, and stop when it ends.
    assert last_start <= killed_at + LOCK_EXPIRY_S
    assert stepped_down_at - killed_at >= LOCK_EXPIRY_S - HEARTBEAT_S - TOLERANCE_S

    newcomer = nodes.make(server.url, "c")
    newcomer.fixed_rate(JOB, every=EVERY_S)(journal.tick)
    began = time.monotonic()
    await newcomer.start()
    assert time.monotonic() - began < 1.0
    assert newcomer.engine is not None
    await wait_until(
        lambda: newcomer.engine is not None and newcomer.engine.elector.failures >= 2,
        2.0,
        "the newcomer retries in the background",
    )
    assert not journal.since(stepped_down_at)
    began = time.monotonic()
    await newcomer.stop()
    assert time.monotonic() - began < 1.0


async def test_redis_back_wakes_the_election_out_of_a_long_backoff(
    fresh_redis: RedisServerFactory, nodes: Nodes
) -> None:
    """With a long ``max_backoff`` the election, failing, waits longer and longer between
    rounds; the release listener keeps trying every heartbeat, and its subscription, once Redis
    answers again, wakes the election: a new term within about a heartbeat of the restart, not
    at the end of a backoff (the detection + promotion + one heartbeat of a failover)."""
    server, journal = fresh_redis(), Journal()
    jobs = nodes.make(server.url, "a", max_backoff=30.0)
    jobs.fixed_rate(JOB, every=EVERY_S)(journal.tick)
    await jobs.start()
    await running(journal, nodes)
    old_token = journal.last_token()
    assert jobs.engine is not None
    elector = jobs.engine.elector

    await kill(server)
    # Down until the election backs off well past a heartbeat (HEARTBEAT_S * 2^5 = 3.2 s at
    # the fifth failure in a row, half of it at random).
    await wait_until(lambda: elector.failures >= 5, 10.0, "the election backs off")
    failures = elector.failures
    await asyncio.to_thread(server.restart)  # the same port, no data
    restarted_at = time.monotonic()
    led_at = await wait_until(
        lambda: any(run.token > old_token for run in journal.runs), 10.0, "a run of a new term"
    )
    print(
        f"Redis back after {failures} failed rounds: a new term running "
        f"{(led_at - restarted_at) * 1000:.0f} ms later"
    )
    # The listener's next attempt (at most a heartbeat; the restart's own start-up aside), the
    # round it wakes, the first run.
    assert led_at - restarted_at <= HEARTBEAT_S + EVERY_S + 3 * TOLERANCE_S
    assert tokens_in_order(journal.runs)


async def test_redis_restarted_empty_elects_again_with_a_greater_token(
    fresh_redis: RedisServerFactory, nodes: Nodes
) -> None:
    server, journal = fresh_redis(), Journal()
    a, b = await nodes.start(server.url, journal, "a", "b")
    await running(journal, nodes)
    old_token = journal.last_token()

    await kill(server)
    await wait_until(lambda: not nodes.leaders(), LOCK_EXPIRY_S + TOLERANCE_S, "no leader")
    # Stay down until both nodes back off to the cap.
    await wait_until(
        lambda: all(n.engine is not None and n.engine.elector.failures >= 4 for n in (a, b)),
        5.0,
        "both nodes back off",
    )
    await asyncio.to_thread(server.restart)  # the same port, no data
    restarted_at = time.monotonic()

    led_at = await wait_until(
        lambda: any(run.token > old_token for run in journal.runs),
        MAX_BACKOFF_S + 1.0,
        "a run of a new term",
    )
    print(f"Redis restarted empty: new term running {(led_at - restarted_at) * 1000:.0f} ms later")
    first = next(run for run in journal.runs if run.token > old_token)
    assert first.start - restarted_at <= MAX_BACKOFF_S + 2 * EVERY_S + TOLERANCE_S
    await wait_until(lambda: len(journal.since(first.start)) >= 5, 2.0, "the new term runs on")
    assert len(nodes.leaders()) == 1
    assert max_concurrent(journal.runs) == 1
    assert tokens_in_order(journal.runs)


async def test_redis_paused_leader_stops_at_its_deadline(
    fresh_redis: RedisServerFactory, nodes: Nodes
) -> None:
    server, journal = fresh_redis(), Journal()
    await nodes.start(server.url, journal, "a", "b")
    await running(journal, nodes)
    old_token = journal.last_token()

    await asyncio.to_thread(server.pause)
    paused_at = time.monotonic()
    try:
        stepped_down_at = await wait_until(
            lambda: not nodes.leaders(), LOCK_EXPIRY_S + TOLERANCE_S, "every node steps down"
        )
        await asyncio.sleep(paused_at + 3 * LOCK_EXPIRY_S - time.monotonic())  # the outage
        last_start = max(run.start for run in journal.runs)
        assert last_start <= paused_at + LOCK_EXPIRY_S
        assert not journal.since(stepped_down_at)
    finally:
        await asyncio.to_thread(server.resume)
    resumed_at = time.monotonic()
    print(
        f"Redis paused: leader stepped down after {(stepped_down_at - paused_at) * 1000:.0f} ms, "
        f"last run started {(last_start - paused_at) * 1000:.0f} ms after the pause"
    )

    # Exactly one node leads again; sample the leaders while the new term settles.
    seen: list[list[str]] = []

    def settled() -> bool:
        seen.append(nodes.leaders())
        return len(journal.since(resumed_at)) >= 10

    await wait_until(settled, MAX_BACKOFF_S + 2.0, "10 runs after the pause")
    assert all(len(leaders) <= 1 for leaders in seen), seen
    assert len(nodes.leaders()) == 1
    after = journal.since(resumed_at)
    assert min(run.token for run in after) > old_token
    assert max_concurrent(journal.runs) == 1
    assert tokens_in_order(journal.runs)


async def test_lock_deleted_by_hand_overlap_is_bounded(
    fresh_redis: RedisServerFactory, nodes: Nodes, unique_project: str
) -> None:
    server, journal = fresh_redis(), Journal()
    both = await nodes.start(server.url, journal, "a")
    await wait_until(lambda: nodes.leaders() == ["a"], 2.0, "a leads")
    # Half a heartbeat apart, as replicas started at different times are: nodes started
    # together poll in lockstep, and the leader's next round would always come first.
    await asyncio.sleep(HEARTBEAT_S / 2)
    both += await nodes.start(server.url, journal, "b")
    await running(journal, nodes)
    lock = _keys.job_key(unique_project, JOB, "lock")
    overlaps, winners = [], []

    with server.client() as client:
        for _ in range(3):
            old_token = journal.last_token()
            await just_after_a_round(next(n for n in both if n.node_id in nodes.leaders()))
            # Deleted right after the leader renewed: the follower's round most likely comes
            # first, and the old leader runs on until its own next round. The worst case.
            deleted_at = time.monotonic()
            assert client.delete(lock) == 1
            first = await first_run_above(journal, old_token, HEARTBEAT_S + EVERY_S + 1.0)
            assert first.start - deleted_at <= HEARTBEAT_S + EVERY_S + TOLERANCE_S
            await runs_since(journal, first.start, 6)
            window = journal.since(deleted_at - EVERY_S)
            overlaps.append(overlap_s(window))
            winners.append(first.node)
            stale = [run for run in window if run.token == old_token]
            assert all(run.start <= deleted_at + HEARTBEAT_S + TOLERANCE_S for run in stale)
            assert len(nodes.leaders()) == 1

    print(
        f"DEL of the lock: new terms won by {winners}, overlap windows "
        f"{[round(s * 1000, 1) for s in overlaps]} ms"
    )
    # The documented limit: the old leader runs on until its next round (one heartbeat).
    assert max(overlaps) <= HEARTBEAT_S + RUN_S + TOLERANCE_S
    # Across nodes a stale run carries an older token (that is what fencing is for); each
    # node's own tokens never go down.
    for node in ("a", "b"):
        assert tokens_in_order([run for run in journal.runs if run.node == node])


async def test_graceful_stop_hands_over_at_once(
    fresh_redis: RedisServerFactory, nodes: Nodes, unique_project: str
) -> None:
    # A long heartbeat, so that a takeover by polling instead of by the release notice would
    # mostly take far longer than the 100 ms asserted.
    heartbeat_s, expiry_s = 0.5, 2.0
    server, journal = fresh_redis(), Journal()
    channel = _keys.release_channel(unique_project)
    gaps = []

    def make(node: str) -> SingletonJobs:
        jobs = nodes.make(server.url, node, heartbeat_interval=heartbeat_s, lock_expiry=expiry_s)
        jobs.fixed_rate(JOB, every=EVERY_S)(journal.tick)
        return jobs

    with server.client() as client:

        def subscribers() -> int:
            return int(dict(client.pubsub_numsub(channel)).get(channel, 0))

        leader, follower = make("a"), make("b")
        await leader.start()
        await wait_until(lambda: nodes.leaders() == ["a"], 2.0, "a leads")
        for round_ in range(3):
            await follower.start()
            await wait_until(lambda: subscribers() == 2, 2.0, "both nodes listen for releases")
            assert follower.engine is not None
            lease = follower.engine.elector.leases[JOB]
            assert lease.token is None
            await runs_since(journal, time.monotonic(), 1)
            assert journal.runs[-1].node == leader.node_id
            takeover = asyncio.create_task(leads_at(lease))
            stopping_at = time.monotonic()
            await leader.stop()
            gaps.append(await asyncio.wait_for(takeover, expiry_s + 1.0) - stopping_at)
            await wait_until(lambda: subscribers() == 1, 2.0, f"round {round_}: one listener")
            leader, follower = follower, make(leader.node_id)

    print(f"graceful stop in-process: follower leads {[round(g * 1000) for g in gaps]} ms later")
    assert max(gaps) < 0.1
    assert max_concurrent(journal.runs) == 1
    assert tokens_in_order(journal.runs)


async def test_run_is_cancelled_when_the_lease_ends(
    fresh_redis: RedisServerFactory, nodes: Nodes
) -> None:
    server = fresh_redis()
    started: list[float] = []
    cancelled: list[float] = []
    jobs = nodes.make(server.url, "a")

    @jobs.interval("long", every=EVERY_S, on_leadership_lost="cancel")
    async def long() -> None:
        started.append(time.monotonic())
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(time.monotonic())
            raise

    await jobs.start()
    await wait_until(lambda: bool(started), 5.0, "the long run starts")
    killed_at = await kill(server)
    await wait_until(lambda: bool(cancelled), LOCK_EXPIRY_S + 1.0, "the run is cancelled")

    latency = cancelled[0] - killed_at
    print(f"cancel on lease loss: run cancelled {latency * 1000:.0f} ms after Redis was killed")
    assert LOCK_EXPIRY_S - HEARTBEAT_S - TOLERANCE_S <= latency <= LOCK_EXPIRY_S + TOLERANCE_S
    assert jobs.engine is not None
    stats = jobs.engine.runners["long"].stats
    await wait_until(lambda: stats.last_run is not None, 1.0, "the run is recorded")
    assert stats.last_run is not None and stats.last_run.outcome is Outcome.CANCELLED
    assert len(started) == 1  # no run starts without a lease
