"""Soak: 12 jobs on 3 replicas with ``placement="spread"``, on a real Redis, 50 times over
(issue 26, item 3: in 1 of 5 runs the leads stayed at 5/6/1 for 12 s).

Each run starts three nodes in the test's process (their default node ids, so each run is a
new placement problem), the second and the third after a gap drawn for the run: none, up to a
heartbeat, or up to two lock expiries (the others have settled by then). It measures the
*convergence time*, from the call that starts the third node until the leads differ by one job
at most (4/4/4) with every job led, counting from the start of the balanced stretch that
lasts ``STABLE_S`` (nothing may unbalance it again). Each run must converge within
``BOUND_S``; ``nox -s soak`` prints the distribution (see docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import pytest

from fastapi_singletonjob import SingletonJobs

from .measure import Measurements, runs

HEARTBEAT_S = 0.2
LOCK_EXPIRY_S = 1.0
JOBS = [f"job-{i:02d}" for i in range(12)]
EVERY_S = 0.1
BUSY_S = 0.02
"""Each run of a job: a run is in flight at a fifth of the instants a round may come."""
BOUND_S = LOCK_EXPIRY_S + 10 * HEARTBEAT_S
"""Each run converges within this: the third node is counted once it has kept its membership
for a lock expiry, then a few heartbeats of moves (about 0.5 s on the fake clock: 1.75 s at
most from the last start over 300 runs), with room for the shared two-core machine."""
STABLE_S = 5 * HEARTBEAT_S
"""A balance that holds this long counts as reached (at most five heartbeats of rounds)."""
LIMIT_S = 12.0
"""A run gives up measuring after this (the issue's stall was still there at 12 s)."""
POLL_S = 0.01
RUNS = runs(50)


def node(url: str, project: str) -> SingletonJobs:
    """A replica with the twelve jobs, its node id the default (host, pid, random suffix)."""
    jobs = SingletonJobs(
        url,
        project=project,
        heartbeat_interval=HEARTBEAT_S,
        lock_expiry=LOCK_EXPIRY_S,
        shutdown_timeout=1.0,
    )
    for name in JOBS:

        @jobs.fixed_rate(name, every=EVERY_S, checkpoint=False)
        async def work() -> None:
            await asyncio.sleep(BUSY_S)

    return jobs


def leads(nodes: list[SingletonJobs]) -> Counter[str | None]:
    """How many jobs each node leads now (None: jobs without a leader); fails on a job that
    two nodes lead at once."""
    leaders: dict[str, str | None] = dict.fromkeys(JOBS)
    for jobs in nodes:
        engine = jobs.engine
        assert engine is not None
        for name in JOBS:
            if engine.elector.is_leader(name):
                assert leaders[name] is None, f"{name} led by {leaders[name]} and {jobs.node_id}"
                leaders[name] = jobs.node_id
    return Counter(leaders.values())


def balanced(counts: Counter[str | None], nodes: list[SingletonJobs]) -> bool:
    led = [counts[jobs.node_id] for jobs in nodes]
    return counts[None] == 0 and max(led) - min(led) <= 1


async def converge(nodes: list[SingletonJobs], began: float) -> tuple[float | None, list[str]]:
    """Watch the leads from ``began`` (monotonic): the start of the balanced stretch that
    lasted ``STABLE_S``, in seconds after ``began`` (None: none by ``LIMIT_S``), and the leads
    each tenth of a second, for the failure message."""
    since: float | None = None
    trace: list[str] = []
    next_trace = began
    while (now := time.monotonic()) - began < LIMIT_S + STABLE_S:
        counts = leads(nodes)
        if now >= next_trace:
            shown = "/".join(str(counts[jobs.node_id]) for jobs in nodes)
            free = f" ({counts[None]} without a leader)" if counts[None] else ""
            trace.append(f"{now - began:.1f}s {shown}{free}")
            next_trace += 0.1
        if not balanced(counts, nodes):
            since = None
        elif since is None:
            since = now
        elif now - since >= STABLE_S:
            return since - began, trace
        await asyncio.sleep(POLL_S)
    return None, trace


@pytest.mark.timeout(LIMIT_S + 30)
@pytest.mark.parametrize("run", range(RUNS))
async def test_twelve_jobs_on_three_replicas_converge_to_four_each(
    run: int, redis_url: str, unique_project: str, measurements: Measurements
) -> None:
    rng = random.Random(run)  # the gaps of run N are the same in every session
    gaps = [
        rng.choice([0.0, rng.uniform(0, HEARTBEAT_S), rng.uniform(0, 2 * LOCK_EXPIRY_S)])
        for _ in range(2)
    ]
    nodes = [node(redis_url, unique_project) for _ in range(3)]
    try:
        await nodes[0].start()
        await asyncio.sleep(gaps[0])
        await nodes[1].start()
        await asyncio.sleep(gaps[1])
        began = time.monotonic()
        await nodes[2].start()
        converged_s, trace = await converge(nodes, began)
    finally:
        await asyncio.gather(*(jobs.stop() for jobs in nodes if jobs.engine is not None))
    ids = ", ".join(jobs.node_id for jobs in nodes)
    measurements.add(
        "spread convergence, 12 jobs x 3 replicas",
        run,
        converged_s,
        bound_s=BOUND_S,
        limit_s=LIMIT_S,
    )
    print(f"run {run}: nodes {ids}, gaps {gaps[0]:.2f} s and {gaps[1]:.2f} s")
    assert converged_s is not None and converged_s <= BOUND_S, (
        f"run {run} (nodes {ids}, gaps {gaps[0]:.2f}/{gaps[1]:.2f} s): balanced after "
        f"{converged_s} s, bound {BOUND_S:g} s; leads every 0.1 s: {trace}"
    )
