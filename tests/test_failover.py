"""Failover between real replica processes (``node_proc.py``) on one real Redis.

Three replicas run the same fixed-rate job (every 50 ms, 10 ms per run; heartbeat 0.1 s,
lock expiry 0.5 s) and journal every run with ``CLOCK_MONOTONIC`` times. The journals are
checked for concurrent runs, for fencing tokens going down, and for how long a job stood
still when its leader stopped gracefully or was killed.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import node_proc
import pytest
from node_proc import LOCK_EXPIRY_S, Run, first_and_last, max_concurrent, now, tokens_in_order
from process_fleet import POLL_S, STARTUP_S, ProcessFleet
from waiting import wait_until

pytestmark = pytest.mark.redis

NODES = ("n1", "n2", "n3")
GRACEFUL_GAP_MAX_S = 0.4
KILL_GAP_MIN_S = 0.2
KILL_GAP_MAX_S = LOCK_EXPIRY_S + 0.5


class Cluster(ProcessFleet):
    """Three ``node_proc`` replicas of one project."""

    def __init__(self, url: str, project: str, workdir: Path, *extra_args: str) -> None:
        super().__init__(workdir)
        self.url = url
        self.project = project
        self.extra_args = extra_args
        """More arguments for each replica (``--every``)."""

    def start(self, *nodes: str) -> None:
        for node in nodes:
            self.spawn(
                node,
                [
                    sys.executable,
                    node_proc.__file__,
                    *("--url", self.url, "--project", self.project),
                    *("--node", node, "--journal", str(self.journal_of(node))),
                    *self.extra_args,
                ],
            )

    def runs(self) -> list[Run]:
        """Every node's runs in start order; a killed node's unfinished run ends at the kill."""
        runs = []
        for replica in self.replicas.values():
            for run in node_proc.read_journal(replica.journal):
                if run.end is None and replica.killed_at is not None:
                    run.end = replica.killed_at
                runs.append(run)
        return sorted(runs, key=lambda r: r.start)

    def leader(self) -> str:
        """The node that ran last."""
        return self.runs()[-1].node


@pytest.fixture
async def cluster(redis_url: str, unique_project: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    replicas = Cluster(redis_url, unique_project, tmp_path)
    try:
        yield replicas
    finally:
        replicas.close()


async def start_and_settle(cluster: Cluster, settle_s: float) -> None:
    """Start the three replicas and wait until the job has run for ``settle_s`` seconds."""
    cluster.start(*NODES)
    await wait_until(
        lambda: bool(cluster.runs()) or cluster.exited(),
        STARTUP_S,
        "a first run",
        poll_s=POLL_S,
    )
    assert not cluster.exited(), cluster.describe()
    first = cluster.runs()[0].start
    await wait_until(
        lambda: cluster.runs()[-1].start - first >= settle_s,
        settle_s + 5.0,
        f"{settle_s} s of runs",
        poll_s=POLL_S,
    )


def successor_after(cluster: Cluster, old: str, since: float) -> Run | None:
    return next((r for r in cluster.runs() if r.node != old and r.start > since), None)


async def test_exactly_one_replica_runs_at_a_time(cluster: Cluster) -> None:
    await start_and_settle(cluster, 2.0)
    stopped_at = now()
    await cluster.stop_all()

    runs = cluster.runs()
    steady = [r for r in runs if r.start < stopped_at]
    print(f"steady state: {len(steady)} runs by {sorted({r.node for r in steady})}")
    assert max_concurrent(runs) == 1, runs
    assert tokens_in_order(runs)
    assert all(r.end is not None for r in runs)  # graceful stops finish their runs
    # Healthy Redis, healthy replicas: one term for the whole steady state, no flapping.
    assert len({(r.node, r.token) for r in steady}) == 1, cluster.describe()
    assert len(steady) >= 20  # ~40 ticks in 2 s: the leader really runs the job


async def test_graceful_stop_hands_over_within_a_tick(cluster: Cluster) -> None:
    await start_and_settle(cluster, 0.5)
    old = cluster.leader()
    terminated_at = cluster.send(old, signal.SIGTERM)

    assert await cluster.wait_exit(old) == 0, cluster.describe()
    await wait_until(
        lambda: successor_after(cluster, old, terminated_at) is not None,
        3.0,
        "a successor's first run",
        poll_s=POLL_S,
    )

    runs = cluster.runs()
    last = first_and_last(runs)[old][1]
    first = successor_after(cluster, old, terminated_at)
    assert first is not None and last.end is not None
    gap = first.start - last.end
    print(
        f"graceful handover: successor's first run {gap * 1000:.0f} ms after the old "
        f"leader's last run ended ({(first.start - terminated_at) * 1000:.0f} ms after SIGTERM)"
    )
    assert 0 < gap < GRACEFUL_GAP_MAX_S, cluster.describe()
    assert first.token > last.token
    assert max_concurrent(runs) == 1
    assert tokens_in_order(runs)


async def test_killed_leader_is_replaced_after_lock_expiry(cluster: Cluster) -> None:
    await start_and_settle(cluster, 0.5)
    old = cluster.leader()
    killed_at = cluster.send(old, signal.SIGKILL)

    assert await cluster.wait_exit(old) == -signal.SIGKILL
    await wait_until(
        lambda: successor_after(cluster, old, killed_at) is not None,
        LOCK_EXPIRY_S + 3.0,
        "a successor's first run",
        poll_s=POLL_S,
    )

    runs = cluster.runs()
    last = first_and_last(runs)[old][1]
    first = successor_after(cluster, old, killed_at)
    assert first is not None
    gap = first.start - last.ended_by(killed_at)
    print(
        f"hard-kill takeover: successor's first run {gap * 1000:.0f} ms after the old leader's "
        f"last run ended ({(first.start - killed_at) * 1000:.0f} ms after SIGKILL)"
    )
    assert KILL_GAP_MIN_S < gap < KILL_GAP_MAX_S, cluster.describe()
    assert first.token > last.token
    assert max_concurrent(runs) == 1
    assert tokens_in_order(runs)
