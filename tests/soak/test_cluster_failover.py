"""Soak: a Redis Cluster slot master SIGKILLed under two nodes, 20 times over, and SIGSTOPped
(frozen: it accepts connections and answers nothing) 10 times (issue 26, item 4: in 2 of 7
runs no run came within 9 s of the kill, though the replica was promoted 2.5-3.0 s after it).

Each run starts a cluster of its own (three masters with a replica each,
``cluster-node-timeout`` 1000 ms) and two nodes, each ``SingletonJobs(redis=RedisCluster(host,
port))`` with one fixed-rate job every 100 ms (heartbeat 0.2 s, lock expiry 1 s). The client
names one node: in even runs the master that is then stopped (the seed the store's clients
start from is gone), in odd runs another master. Once the job runs, the master of the
project's slot is SIGKILLed (or SIGSTOPped). A run measures the *resume time*, from the fault
to the start of the first run of a new term (the old leader's lease goes on for up to a lock
expiry, and a fixed-rate job runs on it unclaimed, so its runs after the fault do not count),
and the time from the replica's promotion (as the cluster reports it) to that run. Each run
must resume within ``BOUND_S`` of the fault and within ``AFTER_PROMOTION_S`` of the
promotion; ``nox -s soak`` prints the distributions (see docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import RedisCluster
from redis.crc import key_slot
from redis_cluster import TestCluster
from servers import HOST

from fastapi_singletonjob import JobContext, SingletonJobs
from fastapi_singletonjob._store.keys import job_key

from .measure import Measurements, runs

HEARTBEAT_S = 0.2
LOCK_EXPIRY_S = 1.0
EVERY_S = 0.1
NODE_TIMEOUT_MS = 1000
AFTER_PROMOTION_S = LOCK_EXPIRY_S + 2 * HEARTBEAT_S
"""Once the replica serves the slot, the first run comes within a lock expiry and two
heartbeats (the issue's liveness bound; the killed leader's lease has run out by then)."""
BOUND_S = 3.5 + AFTER_PROMOTION_S
"""From the fault: the promotion (1.9-3.0 s measured at ``cluster-node-timeout`` 1000 ms, on
the shared two-core machine up to 3.5 s), then ``AFTER_PROMOTION_S``."""
LIMIT_S = 9.0
"""A run gives up measuring after this (the issue's runs without a run within 9 s)."""
POLL_S = 0.01
RUNS = runs(20)
FROZEN_RUNS = runs(10)
FAULTS = [("kill", run) for run in range(RUNS)] + [("pause", run) for run in range(FROZEN_RUNS)]
SIGNALS = {"kill": "SIGKILL", "pause": "SIGSTOP"}


def node(
    client: RedisCluster, project: str, name: str, started: list[tuple[int, float]]
) -> SingletonJobs:
    """A replica with the one fixed-rate job, which notes the term (fencing token) and the
    start of each of its runs."""
    jobs = SingletonJobs(
        redis=client,
        project=project,
        node_id=name,
        heartbeat_interval=HEARTBEAT_S,
        lock_expiry=LOCK_EXPIRY_S,
        shutdown_timeout=1.0,
    )

    @jobs.fixed_rate("tick", every=EVERY_S)
    async def tick(ctx: JobContext) -> None:
        started.append((ctx.fencing_token, time.monotonic()))

    return jobs


async def first_of_new_term(started: list[tuple[int, float]], since: float) -> float | None:
    """The start of the first run of a term that had not run by ``since`` (monotonic),
    waiting up to ``LIMIT_S`` from then."""
    old = {token for token, at in started if at <= since}
    while time.monotonic() - since < LIMIT_S:
        later = [at for token, at in started if token not in old]
        if later:
            return min(later)
        await asyncio.sleep(POLL_S)
    return None


@pytest.mark.timeout(60 + LIMIT_S)
@pytest.mark.parametrize(("fault", "run"), FAULTS, ids=[f"{f}-{r}" for f, r in FAULTS])
async def test_a_slot_master_killed_or_frozen_resumes_the_job_once_its_replica_is_promoted(
    fault: str, run: int, unique_project: str, measurements: Measurements
) -> None:
    started: list[tuple[int, float]] = []
    slot = key_slot(job_key(unique_project, "tick", "lock").encode())
    with TestCluster.start(
        masters=3,
        replicas=1,
        node_timeout_ms=NODE_TIMEOUT_MS,
        node_args=lambda: ["--repl-diskless-sync-delay", "0"],  # the replicas sync at once
    ) as cluster:
        master = cluster.slot_owner(slot)
        seed = master if run % 2 == 0 else next(m for m in cluster.masters() if m is not master)
        clients = [RedisCluster(host=HOST, port=seed.port) for _ in range(2)]
        nodes = [
            node(client, unique_project, name, started)
            for client, name in zip(clients, ("a", "b"), strict=True)
        ]
        try:
            for jobs in nodes:
                await jobs.start()
            began = time.monotonic()
            while len(started) < 5:
                assert time.monotonic() - began < 10.0, "the job never ran before the fault"
                await asyncio.sleep(POLL_S)
            if fault == "kill":
                master.kill()
            else:
                cluster.pause(master)  # the helpers ask the other nodes from now on
            faulted_at = time.monotonic()
            # In a thread: the nodes' event loop goes on meanwhile.
            promotion = asyncio.create_task(
                asyncio.to_thread(cluster.wait_promoted, master, slot, LIMIT_S)
            )
            resumed_at = await first_of_new_term(started, faulted_at)
            promoted_at = await promotion
        finally:
            await asyncio.gather(*(jobs.stop() for jobs in nodes if jobs.engine is not None))
            for client in clients:
                await client.aclose()
    signal = SIGNALS[fault]
    resumed_s = None if resumed_at is None else resumed_at - faulted_at
    after_s = None if resumed_at is None else resumed_at - promoted_at
    measurements.add(
        f"cluster failover, {signal} to the first run of a new term",
        run,
        resumed_s,
        bound_s=BOUND_S,
        limit_s=LIMIT_S,
    )
    measurements.add(
        f"cluster failover ({signal}), promotion to that run",
        run,
        after_s,
        bound_s=AFTER_PROMOTION_S,
        limit_s=LIMIT_S,
    )
    seeded = "the master then stopped" if seed is master else "another master"
    promoted_s = promoted_at - faulted_at
    print(f"{signal} run {run}: seeded with {seeded}, promoted {promoted_s:.2f} s after")
    assert resumed_s is not None and resumed_s <= BOUND_S, (
        f"{signal} run {run} (seeded with {seeded}): first run {resumed_s} s after the "
        f"fault, promotion {promoted_s:.2f} s after it; bound {BOUND_S:g} s"
    )
    assert after_s is not None and after_s <= AFTER_PROMOTION_S, (
        f"{signal} run {run}: first run {after_s:.2f} s after the promotion, "
        f"bound {AFTER_PROMOTION_S:g} s"
    )
