"""``placement="spread"`` with real replica processes (``node_proc.py``, 12 fixed-rate jobs
each) on a real Redis: leadership settles at 4/4/4; a join moves its share to the newcomer and
a graceful leave the leaver's jobs, each with at most a job or two more between the others (to
the node it is now shared out to: every node's share changed); no job ever has two runs at
once, nor a fencing token that goes down."""

from __future__ import annotations

import itertools
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis
from node_proc import HEARTBEAT_S, JOB, LOCK_EXPIRY_S, Run, max_concurrent, now, tokens_in_order
from process_fleet import STARTUP_S
from test_failover import Cluster
from waiting import wait_until

from fastapi_singletonjob._election.placement import share_out
from fastapi_singletonjob._store import keys as _keys

pytestmark = pytest.mark.redis

JOBS = [f"{JOB}-{i:02d}" for i in range(12)]
EVERY_S = 0.1
WINDOW_S = 0.35
"""Who leads a job: the node of its last run within this long (a few periods)."""
STABLE_S = 1.0
"""Leadership counts as settled once it did not change for this long (10 heartbeats)."""
SETTLE_S = LOCK_EXPIRY_S + 30 * HEARTBEAT_S + STABLE_S
"""Bound on settling after the last join: a lock expiry (before a newcomer is preferred),
then two moves per heartbeat, with room for a busy machine."""


def shared_out(nodes: list[str]) -> dict[str, str]:
    """The node each job is shared out to when the nodes ``nodes`` run ``JOBS``."""
    return share_out(JOBS, dict.fromkeys(nodes, frozenset(JOBS)))


def leaders(cluster: Cluster) -> dict[str, str | None]:
    """Each job's leader now: the node of its last run that started within ``WINDOW_S``."""
    since = now() - WINDOW_S
    led: dict[str, str | None] = dict.fromkeys(JOBS)
    for run in cluster.runs():
        if run.start >= since:
            led[run.job] = run.node
    return led


async def members(url: str, project: str, nodes: list[str]) -> float:
    """Wait until the membership holds exactly ``nodes``; return when (monotonic)."""
    with redis.Redis.from_url(url, decode_responses=True) as client:

        def check() -> bool:
            owners = client.hkeys(_keys.project_key(project, "nodes"))
            return sorted(owner.partition("#")[0] for owner in owners) == sorted(nodes)

        await wait_until(check, STARTUP_S, f"members {nodes}", poll_s=0.05)
    return time.monotonic()


async def settled(
    cluster: Cluster, nodes: list[str], what: str, *, not_before: float = 0.0
) -> dict[str, str | None]:
    """Wait until every job is led by one of ``nodes`` and nothing moved for ``STABLE_S``,
    counting from ``not_before`` (monotonic) at the earliest."""
    last: dict[str, object] = {"view": None, "since": time.monotonic()}

    def check() -> bool:
        cluster.check_alive()
        view = leaders(cluster)
        if view != last["view"] or time.monotonic() < not_before:
            last["view"], last["since"] = view, time.monotonic()
            return False
        led = set(view.values())
        complete = None not in led and led <= set(nodes)
        return complete and time.monotonic() - float(str(last["since"])) >= STABLE_S

    await wait_until(check, SETTLE_S + STARTUP_S, what, poll_s=0.05)
    view = leaders(cluster)
    print(f"{what}: {Counter(view.values())}")
    return view


def check_runs(runs: list[Run]) -> dict[str, float]:
    """Check each job's runs; return the gap of each move (the old leader's last run's end
    to the new leader's first run's start), by "job: old node -> new node" (the longest
    when a job made the same move twice)."""
    gaps: dict[str, float] = {}
    for job in JOBS:
        of_job = sorted((run for run in runs if run.job == job), key=lambda run: run.start)
        assert max_concurrent(of_job) == 1, f"{job} ran twice at once"
        assert tokens_in_order(of_job), f"{job}'s fencing tokens went down"
        for old, new in itertools.pairwise(of_job):
            if old.node != new.node and old.end is not None:
                move = f"{job}: {old.node} -> {new.node}"
                gaps[move] = max(gaps.get(move, 0.0), new.start - old.end)
    return gaps


@pytest.fixture
async def cluster(redis_url: str, unique_project: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    replicas = Cluster(redis_url, unique_project, tmp_path, "--jobs", "12", "--every", "0.1")
    try:
        yield replicas
    finally:
        replicas.close()


async def test_twelve_jobs_spread_and_a_join_and_a_leave_move_only_what_they_must(
    cluster: Cluster, redis_url: str, unique_project: str
) -> None:
    # A newcomer is preferred once it kept its membership for a lock expiry; then moves
    # take a heartbeat or two.
    settle_s = LOCK_EXPIRY_S + 3 * HEARTBEAT_S
    cluster.start("n1", "n2", "n3")
    joined = await members(redis_url, unique_project, ["n1", "n2", "n3"])
    before = await settled(
        cluster, ["n1", "n2", "n3"], "three replicas settled", not_before=joined + settle_s
    )
    counts = Counter(before.values())
    assert [counts[node] for node in ("n1", "n2", "n3")] == [4, 4, 4], counts

    cluster.start("n4")
    joined = await members(redis_url, unique_project, ["n1", "n2", "n3", "n4"])
    after_join = await settled(
        cluster, ["n1", "n2", "n3", "n4"], "after n4 joined", not_before=joined + settle_s
    )
    moved = [job for job in JOBS if before[job] != after_join[job]]
    assert sorted(Counter(after_join.values()).values()) == [3, 3, 3, 3], after_join
    # Its share goes to the newcomer; every node's share changed, so a job or two may also
    # move between the others, each to the node it is now shared out to.
    assert len(moved) <= 3 + 2, (before, after_join)
    preferred = shared_out(["n1", "n2", "n3", "n4"])
    for job in moved:
        assert after_join[job] == preferred[job], (job, before, after_join)

    cluster.send("n1", signal.SIGTERM)
    assert await cluster.wait_exit("n1") == 0, cluster.describe()
    after_leave = await settled(cluster, ["n2", "n3", "n4"], "after n1 left")
    moved_out = {job for job in JOBS if after_join[job] != after_leave[job]}
    leavers = {job for job in JOBS if after_join[job] == "n1"}
    assert leavers <= moved_out, (after_join, after_leave)
    # Besides the leaver's jobs, a job or two may move between the others (their shares
    # changed), each to the node it is now shared out to.
    assert sorted(Counter(after_leave.values()).values()) == [4, 4, 4], after_leave
    rebalanced = moved_out - leavers
    assert len(rebalanced) <= 2, (after_join, after_leave)
    preferred = shared_out(["n2", "n3", "n4"])
    for job in moved_out:
        assert after_leave[job] == preferred[job], (job, after_join, after_leave)

    await cluster.stop_all()
    gaps = check_runs(cluster.runs())
    longest = max(gaps.values(), default=0.0)
    slowest = sorted(gaps.items(), key=lambda item: -item[1])[:4]
    print(f"{len(gaps)} moves, run gap max {longest * 1000:.0f} ms (period 100 ms): {slowest}")
    # Every move was a graceful handover, pushed: never the lock expiry's wait.
    assert gaps and longest < LOCK_EXPIRY_S, (gaps, cluster.describe())
