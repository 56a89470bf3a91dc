"""Release-channel messages on a real redis-server: whatever a client publishes on the channel
(junk, or a flood of real-looking notices), it wakes at most one extra election round per
heartbeat per node, and a genuine notice after a quiet spell still hands a job over at once."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import redis
from fake_nodes import stop
from waiting import wait_until

from fastapi_singletonjob import SingletonJobs
from fastapi_singletonjob._election.elector import NOTICE_BURST
from fastapi_singletonjob._store.base import LeaseReply, LeaseRequest
from fastapi_singletonjob._store.keys import release_channel
from fastapi_singletonjob._store.memory import MemoryLeaseStore
from fastapi_singletonjob.testing import FakeClock

HEARTBEAT_S = 0.5
EXPIRY_S = 3.0
JOBS = [f"j{i:02d}" for i in range(20)]
FLOOD_S = 2.5
FLOOD_MAX_MESSAGES = 50_000


def make(url: str, project: str, node: str) -> SingletonJobs:
    jobs = SingletonJobs(
        url,
        project=project,
        node_id=node,
        heartbeat_interval=HEARTBEAT_S,
        lock_expiry=EXPIRY_S,
    )
    for name in JOBS:

        @jobs.interval(name, every=60)
        async def job() -> None: ...

    return jobs


def count_elects(jobs: SingletonJobs) -> list[float]:
    """From now on, when each election call of ``jobs`` was sent (``time.monotonic()``)."""
    engine = jobs.engine
    assert engine is not None
    store = engine.store
    elect = store.elect
    sent: list[float] = []

    async def counting(node_id: str, requests: Sequence[LeaseRequest]) -> list[LeaseReply]:
        sent.append(time.monotonic())
        return await elect(node_id, requests)

    store.elect = counting  # type: ignore[method-assign]
    return sent


def flood(url: str, channel: str, stop: threading.Event, sent: list[int]) -> None:
    """Publish junk and notices naming real jobs, as fast as one connection can, until
    ``stop`` or ``FLOOD_MAX_MESSAGES``."""
    client = redis.Redis.from_url(url)
    messages = ["x", "jobs j00 j01", "control j02", "jobs", "jobs nobody"]
    try:
        while not stop.is_set() and sent[0] < FLOOD_MAX_MESSAGES:
            client.publish(channel, messages[sent[0] % len(messages)])
            sent[0] += 1
    finally:
        client.close()


async def test_a_flood_on_the_release_channel_wakes_at_most_a_round_per_heartbeat(
    redis_url: str, unique_project: str
) -> None:
    nodes = [make(redis_url, unique_project, f"n{i}") for i in range(3)]
    for jobs in nodes:
        await jobs.start()
    try:
        await asyncio.sleep(EXPIRY_S + 2 * HEARTBEAT_S)  # settled: placement done
        calls = {jobs.node_id: count_elects(jobs) for jobs in nodes}
        stop, sent = threading.Event(), [0]
        publisher = threading.Thread(
            target=flood, args=(redis_url, release_channel(unique_project), stop, sent)
        )
        began = time.monotonic()
        publisher.start()
        try:
            await asyncio.sleep(FLOOD_S)
        finally:
            stop.set()
            await asyncio.to_thread(publisher.join)
        ended = time.monotonic()
        elapsed = ended - began
        rates = {
            node: sum(began <= t <= ended for t in times) / elapsed for node, times in calls.items()
        }
        print(f"{sent[0]} messages in {elapsed:.2f}s; election calls per second: {rates}")
        assert sent[0] > 1_000, "the publisher did not flood"
        # Per node: its own beat, plus one woken round per heartbeat, plus the burst, plus
        # a few rounds of its own (a placement round at once, a lock's expiry).
        most = (2 * elapsed / HEARTBEAT_S + NOTICE_BURST + 3) / elapsed
        assert all(rate <= most for rate in rates.values()), (rates, most)

        # Quiet for a while: the budget is whole again, and a genuine handover is pushed.
        await asyncio.sleep(NOTICE_BURST * HEARTBEAT_S + HEARTBEAT_S)
        job = JOBS[0]
        holder = next(jobs for jobs in nodes if jobs.engine and jobs.engine.elector.is_leader(job))
        asked = time.monotonic()
        await holder.step_down(job)

        def led_elsewhere() -> bool:
            return any(
                jobs.engine is not None and jobs.engine.elector.is_leader(job)
                for jobs in nodes
                if jobs is not holder
            )

        took = await wait_until(led_elsewhere, 5 * HEARTBEAT_S, "another node leads")
        print(f"step-down to another leader: {took - asked:.3f}s")
        assert took - asked < HEARTBEAT_S / 2
    finally:
        for jobs in nodes:
            await jobs.stop()


# --- a lost notice, on a fake clock (memory store, zero real time) -----------------------

LOST_HEARTBEAT_S = 0.2
LOST_EXPIRY_S = 2.0


def fake_node(clock: FakeClock, project: str, name: str) -> SingletonJobs:
    jobs = SingletonJobs(
        "memory://",
        project=project,
        node_id=name,
        heartbeat_interval=LOST_HEARTBEAT_S,
        lock_expiry=LOST_EXPIRY_S,
        shutdown_timeout=0.5,
        clock=clock,
        placement="first",
    )

    @jobs.interval("sweep", every=60, checkpoint=False)
    async def sweep() -> None: ...

    return jobs


def deaf(jobs: SingletonJobs) -> None:
    """From now on ``jobs`` hears no release notice: its listener is gone from the store."""
    engine = jobs.engine
    assert engine is not None and isinstance(engine.store, MemoryLeaseStore)
    listeners = engine.store._data.listeners
    for listener in list(listeners):
        if getattr(listener, "__self__", None) is engine.elector:
            listeners.discard(listener)
    assert all(getattr(x, "__self__", None) is not engine.elector for x in listeners)


def leads(jobs: SingletonJobs, job: str = "sweep") -> bool:
    return jobs.engine is not None and jobs.engine.elector.is_leader(job)


async def lost_notice_gap(clock: FakeClock, project: str, phase_s: float, step_down: bool) -> float:
    """Seconds from the holder's release (a graceful stop, or a step-down) to the other
    node's lead, when the other node never hears the notice."""
    a, b = fake_node(clock, project, "a"), fake_node(clock, project, "b")
    await a.start()
    await clock.advance(0.5)
    await b.start()
    try:
        assert leads(a) and not leads(b)
        deaf(b)
        await clock.advance(0.5 + phase_s)
        began = clock.monotonic()
        if step_down:
            await a.step_down("sweep")
        else:
            await stop(a, clock, step_s=0.001)
        while not leads(b):
            await clock.advance(0.001)
            assert clock.monotonic() - began < 2 * LOST_EXPIRY_S, "b never took over"
        return clock.monotonic() - began
    finally:
        for jobs in (a, b):
            if jobs.engine is not None:
                await stop(jobs, clock)


async def test_a_graceful_stop_whose_notice_is_lost_is_taken_over_within_a_heartbeat(
    unique_project: str,
) -> None:
    """The leaver leaves the membership before it releases: the other node's next round sees
    it gone and asks about its jobs at once, and in every round after, so that the release is
    found within a heartbeat (plus the round trips) though its notice never came."""
    clock = FakeClock()
    gaps = [
        await lost_notice_gap(clock, f"{unique_project}-{k}", 0.037 * k, step_down=False)
        for k in range(8)
    ]
    print("gaps after a graceful stop, notice lost:", [round(g, 3) for g in gaps])
    assert max(gaps) <= LOST_HEARTBEAT_S + 0.01, gaps


async def test_a_step_down_whose_notice_is_lost_is_taken_over_within_half_a_lock_expiry(
    unique_project: str,
) -> None:
    """A step-down leaves its node a member: the watcher finds the free lock at its next
    check of its watched jobs, every half lock expiry, so at most that plus a heartbeat."""
    clock = FakeClock()
    gaps = [
        await lost_notice_gap(clock, f"{unique_project}-{k}", 0.13 * k, step_down=True)
        for k in range(8)
    ]
    print("gaps after a step-down, notice lost:", [round(g, 3) for g in gaps])
    assert max(gaps) <= LOST_EXPIRY_S / 2 + LOST_HEARTBEAT_S + 0.01, gaps
