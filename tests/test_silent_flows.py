"""Flows to Redis that go silent (issue 26, item 1): a NAT, a load balancer or a failover drops
the connections open now without a RST, while new ones work. On a real redis-server behind
``tests/fault_proxy.py``.

Every call to Redis has a deadline and a call past it drops its connection, so a claim that
waited on a dead flow never holds back the claims after it: the runs of a cron job every second
resume within a lock expiry and a heartbeat of the freeze (the claim in flight then waits at
most a heartbeat, and the next goes on a fresh connection).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio
from fault_proxy import FaultProxy
from servers import HOST, RedisServer
from waiting import wait_until

from fastapi_singletonjob import SingletonJobs
from fastapi_singletonjob._store.base import LeaseRequest
from fastapi_singletonjob._store.redis.store import RedisLeaseStore

pytestmark = pytest.mark.redis

HEARTBEAT_S = 0.2
LOCK_EXPIRY_S = 1.0
SLACK_S = 0.5
"""Scheduling slack on a busy two-core machine."""
BLACK_HOLE_S = 2.0
RESUME_BOUND_S = LOCK_EXPIRY_S + HEARTBEAT_S + SLACK_S
"""From the freeze to the first run that starts after it: the claim in flight waits at most
a heartbeat, then it is retried (or the next instant's claim goes) on a fresh connection; a
cron instant comes every second."""


@pytest.fixture
async def proxy(redis_server: RedisServer) -> AsyncIterator[FaultProxy]:
    async with FaultProxy(HOST, redis_server.port) as fault_proxy:
        yield fault_proxy


def every_second_node(
    proxy: FaultProxy, project: str, runs: list[float], **settings: Any
) -> SingletonJobs:
    """One node behind ``proxy`` with a cron job every second, whose starts go to ``runs``."""
    jobs = SingletonJobs(
        proxy.url,
        project=project,
        node_id="n1",
        heartbeat_interval=HEARTBEAT_S,
        lock_expiry=LOCK_EXPIRY_S,
        shutdown_timeout=1.0,
        **settings,
    )

    @jobs.cron("every-second", "* * * * * *")
    async def every_second() -> None:
        runs.append(time.monotonic())

    return jobs


async def test_a_cron_job_keeps_running_after_the_flows_go_silent(
    proxy: FaultProxy, unique_project: str
) -> None:
    """The repro of issue 26 (``claim_batch_stuck_forever.py``): 0 runs from 3 s to 12 s
    after the freeze, the node still leading. Now the runs go on, each second."""
    runs: list[float] = []
    jobs = every_second_node(proxy, unique_project, runs)
    await jobs.start()
    try:
        await wait_until(lambda: len(runs) >= 2, 5.0, "two runs before the freeze")
        frozen_at = time.monotonic()
        proxy.silence_existing()  # every flow open now goes dead, without a RST
        await asyncio.sleep(6.0)
        after = [at - frozen_at for at in runs if at > frozen_at]
        print(f"runs after the freeze (s after it): {[round(x, 2) for x in after]}")
        assert after, "no run started after the flows went silent"
        assert after[0] <= RESUME_BOUND_S, after
        # Then one run a second: at least 4 in the last 5 s.
        assert len([x for x in after if x > 1.0]) >= 4, after
        gaps = [b - a for a, b in zip(after, after[1:], strict=False)]
        assert max(gaps, default=0.0) <= 1.0 + RESUME_BOUND_S, gaps
    finally:
        await jobs.stop()


async def test_runs_resume_after_silent_flows_and_a_black_hole_for_new_ones(
    proxy: FaultProxy, unique_project: str
) -> None:
    """The existing flows die silently and, for 2 s, new ones are black-holed too (the
    connections open, nothing comes back): the runs resume within a lock expiry and a
    heartbeat after the path heals, not when TCP gives up."""
    runs: list[float] = []
    jobs = every_second_node(proxy, unique_project, runs, max_backoff=1.0)
    await jobs.start()
    try:
        await wait_until(lambda: len(runs) >= 2, 5.0, "two runs before the freeze")
        proxy.silence_existing()
        proxy.blackhole()
        await asyncio.sleep(BLACK_HOLE_S)
        healed_at = time.monotonic()
        proxy.pass_through()
        await asyncio.sleep(5.0)
        after = [at - healed_at for at in runs if at > healed_at]
        print(f"runs after the path healed (s after it): {[round(x, 2) for x in after]}")
        assert after and after[0] <= RESUME_BOUND_S + 1.0, after  # + the backoff (max 1 s)
        assert len([x for x in after if x > after[0]]) >= 3, after
    finally:
        await jobs.stop()


async def test_a_claim_past_its_deadline_drops_its_connection(
    proxy: FaultProxy, unique_project: str
) -> None:
    """Store level: a claim on a dead flow fails at its deadline, and the next claim, on a
    fresh connection, is answered at once (it neither queues behind the dead one nor takes
    another dead connection from the pool)."""
    store = RedisLeaseStore(unique_project, url=proxy.url, connect_timeout_s=1.0)
    try:
        (reply,) = await store.elect("n1", [LeaseRequest("job", 30.0)])
        assert reply.value is not None
        now_us = int(time.time() * 1e6)
        # Fill the pool with open connections, all of which are about to die.
        await asyncio.gather(
            *(store.claim("job", reply.value, now_us - i, timeout_s=1.0) for i in range(8))
        )
        proxy.silence_existing()
        began = time.monotonic()
        with pytest.raises((ConnectionError, TimeoutError, redis.exceptions.ConnectionError)):
            await store.claim("job", reply.value, now_us + 1, timeout_s=0.5)
        assert time.monotonic() - began <= 0.5 + SLACK_S
        began = time.monotonic()
        result = await store.claim("job", reply.value, now_us + 2, timeout_s=2.0)
        answered_s = time.monotonic() - began
        print(f"next claim answered in {answered_s * 1000:.0f} ms: {result}")
        assert answered_s <= SLACK_S
    finally:
        await store.aclose()
