"""Rows 32-33: a Redis Sentinel failover under three replicas reaching Redis through the
``redis+sentinel://`` URL (tests/sentinels.py: a primary, one replica and three sentinels with
``down-after-milliseconds`` 400 and ``failover-timeout`` 2000).

- 32: the primary SIGKILLed; the sentinels promote the replica.
- 32b: the promoted replica lost the latest writes: its replication link goes through a
  ``FaultProxy`` that is blackholed for 2T before the kill, so the lock's renewals, the fence
  and the per-second cron's claimed instants of those 2T never reach it.
- 32c: the old primary partitioned from everyone (SIGSTOP) until the replica is promoted, then
  back (SIGCONT): the sentinels turn it into a replica of the new primary.
- 33: a planned failover (``SENTINEL FAILOVER``).

Every row checks the runs of the two jobs for overlap, fencing tokens in start order, the
time from the promotion to the first run of the new term, and (32b) instants run twice.
These rows run in the full matrix only (``nox -s chaos``); the default suite has its own
SIGKILL-and-promotion test (tests/test_sentinel.py).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis
from fault_proxy import FaultProxy
from sentinels import SentinelTopology
from servers import HOST, RedisServer

from .checker import Run, duplicates, max_concurrent, overlap_s, stale_writes
from .harness import TOL_S, Cluster, Results, full_only, now, reps
from .replica import JobConfig

pytestmark = full_only

JOB, CRON = "tick", "every-second"
EVERY_S = 0.1
RUN_S = 0.03
JOBS = [
    JobConfig(JOB, kind="rate", every=EVERY_S, run_s=RUN_S),
    JobConfig(CRON, kind="cron", expression="* * * * * *", run_s=RUN_S),
]
PROMOTION_S = 15.0
"""Bound on detection + the sentinels' vote + promotion (1.6-2.5 s measured)."""


@pytest.fixture
async def proxies() -> AsyncIterator[list[FaultProxy]]:
    made: list[FaultProxy] = []
    try:
        yield made
    finally:
        for proxy in made:
            await proxy.close()


async def start(
    cluster: Cluster, tmp_path: Path, proxies: list[FaultProxy], *, lagging: bool = False
) -> SentinelTopology:
    """The topology (the replica behind a proxy when ``lagging``) and three replicas on it."""
    loop = asyncio.get_running_loop()

    def via_proxy(primary: RedisServer) -> int:
        proxy = FaultProxy(HOST, primary.port)
        asyncio.run_coroutine_threadsafe(proxy.start(), loop).result(10)
        proxies.append(proxy)
        return proxy.port

    topo = await asyncio.to_thread(
        SentinelTopology.start, tmp_path / "sentinel", replicate_from=via_proxy if lagging else None
    )
    nodes = [cluster.replica(f"n{i}", JOBS, url=topo.url()) for i in (1, 2, 3)]
    await cluster.ready(*nodes)
    await cluster.one_leader(JOB)
    await cluster.until_runs(CRON, 2, since=0.0, timeout_s=5)
    return topo


def tokens_in_order(runs: list[Run]) -> bool:
    return all(a.token <= b.token for a, b in itertools.pairwise(runs))


async def after_failover(
    cluster: Cluster,
    record: Results,
    row: str,
    name: str,
    *,
    fault_at: float,
    promoted_at: float,
    old_token: int,
    **extra: float | int | bool,
) -> dict[str, float | int | bool]:
    """Wait for the new term, then measure and check both jobs; return the measurements."""
    t = cluster.timing
    first = await cluster.first_run(JOB, after=promoted_at, newer_than=old_token, timeout_s=10)
    await cluster.until_runs(JOB, 10, since=first.start, timeout_s=5)
    await cluster.until_runs(CRON, 2, since=first.start, timeout_s=5)
    runs, crons = cluster.runs(JOB), cluster.runs(CRON)
    last_old = max(r.start for r in runs if r.token <= old_token)
    late, rejected = stale_writes(runs)
    measured: dict[str, float | int | bool] = {
        "promotion_s": promoted_at - fault_at,
        "first_run_after_promotion_s": first.start - promoted_at,
        "gap_s": first.start - last_old,
        "overlap_s": overlap_s(runs) + overlap_s(crons),
        "tokens_in_order": tokens_in_order(runs) and tokens_in_order(crons),
        "cron_duplicates": len(duplicates(crons)),
        "late_writes": late,
        "rejected_writes": rejected,
        **extra,
    }
    record.add(row, name, **measured)
    assert measured["tokens_in_order"], "fencing tokens never go down"
    assert first.token > old_token
    # Not a backoff later: the release listener, trying every heartbeat, subscribes on the
    # new primary and wakes the election (detection + promotion + one heartbeat).
    assert first.start - promoted_at <= t.heartbeat + EVERY_S + TOL_S
    return measured


@pytest.mark.parametrize("rep", reps(3))
async def test_row32_primary_sigkilled_and_the_replica_promoted(
    cluster: Cluster, record: Results, tmp_path: Path, proxies: list[FaultProxy], rep: int
) -> None:
    topo = await start(cluster, tmp_path, proxies)
    try:
        old = topo.primary
        old_token = cluster.runs(JOB)[-1].token
        killed_at = now()
        await asyncio.to_thread(old.kill)
        await asyncio.to_thread(topo.wait_promoted, old, PROMOTION_S)
        promoted_at = now()
        measured = await after_failover(
            cluster,
            record,
            "32",
            "sentinel-primary-sigkill",
            fault_at=killed_at,
            promoted_at=promoted_at,
            old_token=old_token,
        )
    finally:
        await asyncio.to_thread(topo.close)
    assert max_concurrent(cluster.runs(JOB)) == 1 and max_concurrent(cluster.runs(CRON)) == 1
    assert measured["cron_duplicates"] == 0


@pytest.mark.parametrize("rep", reps(3))
async def test_row32b_the_promoted_replica_lost_the_latest_writes(
    cluster: Cluster, record: Results, tmp_path: Path, proxies: list[FaultProxy], rep: int
) -> None:
    t = cluster.timing
    topo = await start(cluster, tmp_path, proxies, lagging=True)
    try:
        old = topo.primary
        [link] = proxies
        link.blackhole()  # the replica hears nothing more; its link still looks up
        lag_from = now()
        await cluster.sleep(2 * t.lock_expiry)
        old_token = cluster.runs(JOB)[-1].token
        killed_at = now()
        await asyncio.to_thread(old.kill)
        await asyncio.to_thread(topo.wait_promoted, old, PROMOTION_S)
        promoted_at = now()
        measured = await after_failover(
            cluster,
            record,
            "32b",
            "sentinel-promoted-replica-lagged-2T",
            fault_at=killed_at,
            promoted_at=promoted_at,
            old_token=old_token,
            lag_s=killed_at - lag_from,
        )
    finally:
        await asyncio.to_thread(topo.close)
    # The lock the replica kept had expired long before the promotion, and the old leader
    # stopped at its lease deadline, which also came before it: no overlap. What was lost is
    # the record of the cron instants claimed during the lag, and the fence's last value
    # (the new tokens are floored by the new primary's clock, so they still grow).
    assert measured["overlap_s"] == 0
    assert measured["cron_duplicates"] <= 1, "at most the instant within misfire_grace"


@pytest.mark.parametrize("rep", reps(3))
async def test_row32c_old_primary_partitioned_until_the_promotion_then_back(
    cluster: Cluster, record: Results, tmp_path: Path, proxies: list[FaultProxy], rep: int
) -> None:
    t = cluster.timing
    topo = await start(cluster, tmp_path, proxies)
    try:
        old = topo.primary
        old_token = cluster.runs(JOB)[-1].token
        paused_at = now()
        await asyncio.to_thread(old.pause)
        await asyncio.to_thread(topo.wait_promoted, old, PROMOTION_S)
        promoted_at = now()
        await cluster.first_run(JOB, after=promoted_at, newer_than=old_token, timeout_s=10)
        await asyncio.to_thread(old.resume)
        resumed_at = now()

        def demoted() -> bool:
            try:
                with old.client() as client:
                    return str(client.info("replication").get("role")) == "slave"
            except redis.ConnectionError:  # it drops its clients as it becomes a replica
                return False

        # A sentinel waits about 8 s (4 publish periods) after a former primary reports itself
        # as a primary again before it turns it into a replica.
        demoted_at = await cluster.wait(demoted, 25, "the old primary becomes a replica")
        await cluster.sleep(4 * t.heartbeat)  # rounds that may have reached the old primary
        measured = await after_failover(
            cluster,
            record,
            "32c",
            "sentinel-old-primary-sigstop",
            fault_at=paused_at,
            promoted_at=promoted_at,
            old_token=old_token,
            demoted_after_resume_s=demoted_at - resumed_at,
            terms_after_resume=len([x for x in cluster.terms(JOB) if x.t > resumed_at]),
        )
    finally:
        await asyncio.to_thread(topo.close)
    runs = cluster.runs(JOB)
    assert max(r.start for r in runs if r.token <= old_token) <= paused_at + t.lease_s + 0.02
    assert max_concurrent(runs) == 1, measured


@pytest.mark.parametrize("rep", reps(3))
async def test_row33_planned_failover(
    cluster: Cluster, record: Results, tmp_path: Path, proxies: list[FaultProxy], rep: int
) -> None:
    topo = await start(cluster, tmp_path, proxies)
    try:
        old = topo.primary
        asked_at = now()
        with topo.sentinels[0].client() as client:
            client.execute_command("SENTINEL", "FAILOVER", "mymaster")
        await asyncio.to_thread(topo.wait_promoted, old, PROMOTION_S)
        promoted_at = now()
        runs_before = cluster.runs(JOB)
        await cluster.until_runs(JOB, 10, since=promoted_at, timeout_s=10)
        terms_after = [x for x in cluster.terms(JOB) if x.t > asked_at]
        runs = cluster.runs(JOB)
        after = [r for r in runs if r.start > promoted_at]
        record.add(
            "33",
            "sentinel-planned-failover",
            promotion_s=promoted_at - asked_at,
            transitions=len(terms_after),
            first_run_after_promotion_s=after[0].start - promoted_at,
            longest_gap_s=max(
                b.start - a.start for a, b in itertools.pairwise(runs) if b.start > asked_at
            ),
            overlap_s=overlap_s(runs),
            tokens_in_order=tokens_in_order(runs),
        )
    finally:
        await asyncio.to_thread(topo.close)
    # The lock replicated before the switch (the primary waits for its replica to catch up),
    # so the leader may keep its term on the new primary; either way, one runner at a time.
    assert runs_before and tokens_in_order(runs)
    assert max_concurrent(runs) == 1
