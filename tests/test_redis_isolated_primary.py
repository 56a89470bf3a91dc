"""The guard against a Sentinel split brain, for real: a primary cut off from its replica.

In a partition that leaves the old primary reachable by some nodes but not by its replica and
the sentinels, those nodes could go on renewing their locks on it while the others lead on the
promoted replica. docs/redis.md tells operators to set ``min-replicas-to-write 1`` and
``min-replicas-max-lag`` on the primary: an isolated primary then refuses writes. This checks
what the library makes of that: a primary with the setting, its replica linked through a fault
proxy, a node that leads through a direct URL (a node on the primary's side of the partition).
When the replica's link goes silent, the primary refuses the node's renewals (``NOREPLICAS``),
the node stops leading at its lease deadline and runs nothing after it, readiness names the
reason; once the link is back the node leads again."""

from __future__ import annotations

import asyncio
import time

import pytest
from fault_proxy import FaultProxy
from servers import HOST, RedisServerFactory
from waiting import wait_until

from fastapi_singletonjob import JobContext, SingletonJobs
from fastapi_singletonjob._singletonjobs import StatusView
from fastapi_singletonjob._timing import lease_deadline
from fastapi_singletonjob._web.health import readiness

pytestmark = pytest.mark.redis

H = 0.1  # heartbeat
T = 0.5  # lock expiry
B = 0.3  # max backoff
MAX_LAG_S = 1
"""``min-replicas-max-lag``: the primary refuses writes once its replica's last
acknowledgement (sent every second) is older than this."""
REFUSED_WITHIN_S = MAX_LAG_S + 4.0
"""Bound on how long the primary keeps taking writes after the link went silent: the lag,
the replica's acknowledgement period and the primary's once-a-second count of good replicas,
with slack for a busy machine."""


async def test_a_primary_cut_from_its_replica_refuses_renewals_and_its_leader_stops(
    fresh_redis: RedisServerFactory, unique_project: str
) -> None:
    primary = fresh_redis(
        extra_args=[
            *("--min-replicas-to-write", "1", "--min-replicas-max-lag", str(MAX_LAG_S)),
        ]
    )
    async with FaultProxy(HOST, primary.port) as proxy:
        replica = fresh_redis(extra_args=["--replicaof", HOST, str(proxy.port)])
        await asyncio.to_thread(replica.wait_replica_synced)  # the proxy runs on this loop
        runs: list[tuple[float, int]] = []
        jobs = SingletonJobs(
            f"redis://{HOST}:{primary.port}/0",
            project=unique_project,
            node_id="a",
            heartbeat_interval=H,
            lock_expiry=T,
            max_backoff=B,
        )

        @jobs.interval("tick", 0.02, checkpoint=False)
        async def tick(ctx: JobContext) -> None:
            runs.append((time.monotonic(), ctx.fencing_token))

        def leads() -> bool:
            return jobs.status().jobs[0].is_leader

        async with jobs:
            await wait_until(lambda: len(runs) >= 10, 5.0, "runs on the primary")
            token_before = runs[-1][1]
            proxy.blackhole()  # the replica hears nothing more, and acknowledges nothing
            cut_at = time.monotonic()
            stopped_at = await wait_until(
                lambda: not leads(), REFUSED_WITHIN_S + T, "the leader stops"
            )
            assert jobs.engine is not None
            last_success = jobs.engine.elector.last_success_at
            assert last_success is not None
            reasons: list[str] = []

            async def names_noreplicas() -> bool:
                ready, reason = await readiness(StatusView(jobs), strict=True)
                reasons.append(reason or "")
                return ready != "ok" and "min-replicas-to-write asks (NOREPLICAS" in (reason or "")

            await wait_until(names_noreplicas, 2.0, f"readiness names NOREPLICAS: {reasons}")
            # Nothing ran after the lease confirmed by the last renewal that got through.
            deadline = lease_deadline(last_success, T)
            late = [start for start, _ in runs if start > deadline]
            assert late == [], f"{len(late)} runs after the lease deadline"
            proxy.pass_through()
            await wait_until(leads, 10.0, "leads again once the replica is back")
            count = len(runs)
            await wait_until(lambda: len(runs) > count + 3, 5.0, "runs again")
        print(
            f"isolated primary: refused writes, the leader stopped {stopped_at - cut_at:.2f} s "
            f"after the replica's link went silent; readiness: {reasons[-1]}"
        )
        assert stopped_at - cut_at < REFUSED_WITHIN_S + T
        assert runs[-1][1] > token_before, "a new term, with a greater token"
