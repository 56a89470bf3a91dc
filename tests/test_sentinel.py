"""Redis Sentinel, for real: a primary, a replica and three sentinels started by the test
(tests/sentinels.py), reached through the documented ``redis+sentinel://`` URL (with a
password for the primary and another for the sentinels) and through the client form
``redis=Sentinel(...).master_for(name)``. Steady state, the pushed handover, and a SIGKILL of
the primary with a promotion: runs resume within detection + promotion + a backoff, tokens
never go down, and no password shows anywhere."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from node_proc import Run, max_concurrent, tokens_in_order
from redis.asyncio.sentinel import Sentinel
from sentinels import DOWN_AFTER_MS, FAILOVER_TIMEOUT_MS, SERVICE, SentinelTopology
from servers import HOST
from waiting import wait_until

from fastapi_singletonjob import JobContext, SingletonJobs

pytestmark = [pytest.mark.redis, pytest.mark.slow]

PASSWORD = "pr1mary-s3cret"
SENTINEL_PASSWORD = "sent1nel-s3cret"
HEARTBEAT_S = 0.2
"""The upper end of the integration tests' range: the sentinels are asked with the heartbeat
as timeout, and 0.1 s is tight for a connection with AUTH on a busy machine."""
LOCK_EXPIRY_S = 1.0
MAX_BACKOFF_S = 0.4
EVERY_S = 0.05
STEADY_S = 1.0
PUSHED_S = 0.4
"""Bound on a graceful handover: a round trip plus scheduling. Without the release notice a
follower would wait for the lock's TTL (up to the 1 s expiry)."""
PROMOTION_BUDGET_S = 10.0
"""Bound on detection + sentinel election + promotion (about 2 s measured; a busy machine)."""


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelTopology]:
    """Shared by the tests that do not fail the primary over."""
    workdir = tmp_path_factory.mktemp("sentinel")
    with SentinelTopology.start(
        workdir, password=PASSWORD, sentinel_password=SENTINEL_PASSWORD
    ) as topo:
        yield topo


def node(
    name: str, project: str, runs: list[Run], *, url: str | None = None, redis: object = None
) -> SingletonJobs:
    """A node with one interval job that journals its runs with their fencing tokens."""
    jobs = SingletonJobs(
        url,
        redis=redis,  # type: ignore[arg-type]
        project=project,
        node_id=name,
        heartbeat_interval=HEARTBEAT_S,
        lock_expiry=LOCK_EXPIRY_S,
        max_backoff=MAX_BACKOFF_S,
        shutdown_timeout=1.0,
    )

    @jobs.interval("tick", every=EVERY_S)
    async def tick(ctx: JobContext) -> None:
        run = Run(name, ctx.fencing_token, 0.0, time.monotonic())
        runs.append(run)
        await asyncio.sleep(0.01)
        run.end = time.monotonic()

    return jobs


def leader_of(*nodes: SingletonJobs) -> SingletonJobs | None:
    leaders = [jobs for jobs in nodes if jobs.status().jobs[0].is_leader]
    assert len(leaders) <= 1, "two nodes lead at once"
    return leaders[0] if leaders else None


def runners(runs: list[Run], since: float) -> set[str]:
    return {run.node for run in runs if run.start >= since}


async def test_the_url_form_has_one_runner_and_a_pushed_handover_and_shows_no_password(
    topology: SentinelTopology, unique_project: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="fastapi_singletonjob")
    runs: list[Run] = []
    a = node("a", unique_project, runs, url=topology.url())
    b = node("b", unique_project, runs, url=topology.url())
    async with a, b:
        await wait_until(lambda: leader_of(a, b) is not None and bool(runs), 5.0, "a run")
        steady_from = time.monotonic()
        await asyncio.sleep(STEADY_S)  # the window observed, not a wait for a condition
        assert len(runners(runs, steady_from)) == 1, "exactly one runner in steady state"
        leader = leader_of(a, b)
        assert leader is not None
        follower = b if leader is a else a
        shown = [repr(a.settings), repr(a.engine and a.engine.store), a.status().model_dump_json()]
        stopped_at = time.monotonic()
        await leader.stop()
        led_at = await wait_until(
            lambda: follower.status().jobs[0].is_leader, 2.0, "the follower leads"
        )
        await wait_until(lambda: runners(runs, led_at) == {follower.settings.node_id}, 2.0, "runs")
        assert follower.status().store.error is None
    assert led_at - stopped_at < PUSHED_S, "pushed by the release notice, not found by polling"
    assert max_concurrent(runs) == 1
    assert tokens_in_order(runs)
    text = "\n".join([*shown, caplog.text])
    assert "redis+sentinel://***@" in shown[0] and "sentinel_password=***" in shown[0]
    assert PASSWORD not in text and SENTINEL_PASSWORD not in text


async def test_the_client_form_from_master_for_keeps_working(
    topology: SentinelTopology, unique_project: str
) -> None:
    sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
        [(HOST, s.port) for s in topology.sentinels],
        sentinel_kwargs={"password": SENTINEL_PASSWORD},
        password=PASSWORD,
    )
    client = sentinel.master_for(SERVICE)
    runs: list[Run] = []
    try:
        async with node("c", unique_project, runs, redis=client) as jobs:
            await wait_until(lambda: len(runs) >= 3, 5.0, "runs through the client form")
            assert jobs.status().store.error is None
    finally:
        await client.aclose()
        await sentinel.aclose()


async def test_a_sigkilled_primary_is_replaced_and_runs_resume_with_tokens_in_order(
    tmp_path: Path, unique_project: str
) -> None:
    """Detection (``down-after-milliseconds``) + the sentinels' vote + the promotion, then
    a heartbeat, not a backoff: the release listener, trying every heartbeat, subscribes on
    the new primary and wakes the election, so the first run follows the promotion within
    ``HEARTBEAT_S`` and a round (with a margin for a busy machine)."""
    topo = await asyncio.to_thread(
        SentinelTopology.start, tmp_path, password=PASSWORD, sentinel_password=SENTINEL_PASSWORD
    )
    runs: list[Run] = []
    try:
        a = node("a", unique_project, runs, url=topo.url())
        b = node("b", unique_project, runs, url=topo.url())
        async with a, b:
            await wait_until(lambda: len(runs) >= 3, 5.0, "runs before the kill")
            old = topo.primary
            old.kill()
            killed_at = time.monotonic()
            await asyncio.to_thread(topo.wait_promoted, old, PROMOTION_BUDGET_S)
            promoted_at = time.monotonic()
            resumed_at = await wait_until(
                lambda: any(run.start > promoted_at for run in runs),
                MAX_BACKOFF_S + HEARTBEAT_S + 3.0,
                "a run on the new primary",
            )
            steady_from = time.monotonic()
            await asyncio.sleep(STEADY_S)  # the window observed after the failover
            assert len(runners(runs, steady_from)) == 1, "one runner after the failover"
            assert a.status().store.error is None and b.status().store.error is None
    finally:
        await asyncio.to_thread(topo.close)
    before = [run for run in runs if run.start < killed_at]
    after = [run for run in runs if run.start > killed_at]
    gap_s = after[0].start - max(run.start for run in before)
    print(
        f"sentinel failover: promoted {promoted_at - killed_at:.2f}s after the kill "
        f"(down-after {DOWN_AFTER_MS} ms, failover-timeout {FAILOVER_TIMEOUT_MS} ms); first "
        f"run {resumed_at - promoted_at:.2f}s after the promotion; gap {gap_s:.2f}s; "
        f"tokens {before[-1].token} -> {after[0].token}"
    )
    assert promoted_at - killed_at >= DOWN_AFTER_MS / 1000, "not detected before down-after"
    assert resumed_at - promoted_at <= HEARTBEAT_S + EVERY_S + 0.5, "a heartbeat, no backoff"
    assert tokens_in_order(runs), "fencing tokens never go down"
    assert after[0].token > before[-1].token, "a new term on the new primary"
    assert max_concurrent(runs) == 1, "no overlap: the old leader stopped at its deadline"


async def test_a_wrong_sentinel_password_is_reported_without_any_password(
    topology: SentinelTopology, unique_project: str
) -> None:
    wrong = "wr0ng-sentinel-pw"
    url = topology.url().replace(SENTINEL_PASSWORD, wrong)
    runs: list[Run] = []
    async with node("d", unique_project, runs, url=url) as jobs:
        await wait_until(lambda: jobs.status().store.error is not None, 5.0, "a failed round")
        error = jobs.status().store.error
        status = jobs.status().model_dump_json()
    assert error is not None and "No master found for 'mymaster'" in error, error
    assert "AuthenticationError" in error or "invalid" in error.lower(), error
    assert runs == []
    for secret in (PASSWORD, SENTINEL_PASSWORD, wrong):
        assert secret not in status
