"""Rows 18 and 42: a thundering herd of electors after an outage, and 50 jobs per replica.

A "process" here hosts several ``SingletonJobs`` instances (electors), each with its own
connection pool, to reach 50-100 electors on two cores.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from .checker import max_concurrent
from .harness import FULL, STARTUP_S, TOL_S, Cluster, Results, now
from .replica import JobConfig

JOB = "tick"
TICK = JobConfig(JOB, kind="rate", every=0.1, run_s=0.02)


class ClientsSampler:
    """Samples ``connected_clients`` and counters of the store in a thread."""

    def __init__(self, cluster: Cluster) -> None:
        assert cluster.store is not None
        self._client = cluster.store.client()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                clients = int(self._client.info("clients")["connected_clients"])
                self.peak = max(self.peak, clients)
            except Exception:  # the store is down: nothing to sample
                pass
            self._stop.wait(0.02)

    def __enter__(self) -> ClientsSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._client.close()


@pytest.mark.timeout(180)
async def test_row18_thundering_herd_after_an_outage(cluster: Cluster, record: Results) -> None:
    t = cluster.timing
    processes, per_process = (10, 10) if FULL else (5, 10)
    store = cluster.redis()
    nodes = [cluster.replica(f"h{i}", [TICK], electors=per_process) for i in range(processes)]
    await cluster.ready(*nodes, timeout_s=2 * STARTUP_S)
    old = (await cluster.first_run(JOB, after=0, newer_than=0, timeout_s=10)).token
    killed_at = now()
    await asyncio.to_thread(store.kill)
    outage_s = 2.0
    await cluster.sleep(killed_at + outage_s - now())
    await asyncio.to_thread(store.restart)
    restarted_at = now()
    with ClientsSampler(cluster) as sampler:
        first = await cluster.first_run(JOB, after=restarted_at, newer_than=old, timeout_s=10)
        await cluster.until_runs(JOB, 10, since=first.start, timeout_s=10)
        await cluster.sleep(restarted_at + t.max_backoff + 0.5 - now())
    with store.client() as client:
        stats = client.info("stats")
    reached = sorted(
        e.t - restarted_at for e in cluster.events() if e.ev == "reached" and e.t > restarted_at
    )
    electors = processes * per_process
    record.add(
        "18",
        f"herd-{electors}-electors",
        leader_after_restart_s=first.start - restarted_at,
        peak_clients=sampler.peak,
        rejected_connections=int(stats["rejected_connections"]),
        reconnected=len(reached),
        reconnect_p50_s=reached[len(reached) // 2] if reached else None,
        reconnect_max_s=reached[-1] if reached else None,
    )
    assert max_concurrent(cluster.runs(JOB)) == 1
    assert first.start - restarted_at <= t.max_backoff + t.heartbeat + 0.1 + TOL_S
    assert int(stats["rejected_connections"]) == 0
    # Each elector holds at most its pool (election, release listener): no storm.
    assert sampler.peak <= 3 * electors + 5


async def test_row42_fifty_jobs_on_three_replicas(cluster: Cluster, record: Results) -> None:
    # Without checkpoints: the row measures the election's cost (a checkpoint adds one call
    # per run, measured in docs/benchmarks.md).
    jobs = [
        JobConfig(f"job{i:02d}", kind="rate", every=0.5, run_s=0.01, checkpoint=False)
        for i in range(50)
    ]
    store = cluster.redis()
    nodes = [cluster.replica(f"n{i}", jobs) for i in (1, 2, 3)]
    await cluster.ready(*nodes)
    for job in jobs:
        await cluster.wait_leader(job.name)
    window_s = 3.0
    with store.client() as client:
        before = client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
        cpu_before = {n.name: cpu_s(n.pid) for n in nodes}
        began = now()
        await cluster.sleep(window_s)
        elapsed = now() - began
        after = client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
        cpu_after = {n.name: cpu_s(n.pid) for n in nodes}
    leaders: dict[str, int] = {}
    for job in jobs:
        leader = cluster.leader(job.name)
        assert leader is not None
        leaders[leader] = leaders.get(leader, 0) + 1
        runs = cluster.runs(job.name)
        assert max_concurrent(runs) == 1, job.name
        assert runs, job.name
    record.add(
        "42",
        "50-jobs-3-replicas",
        evalsha_per_s=round((after - before) / elapsed, 1),
        cpu_percent={
            k: round(100 * (cpu_after[k] - cpu_before[k]) / elapsed, 1) for k in cpu_after
        },
        jobs_per_leader=leaders,
    )
    # One ELECT per replica per heartbeat whatever the number of jobs, plus one CLAIM per job
    # for the first tick of its leader's term (the window starts as the terms do) and nothing
    # else: far below one call per job per heartbeat.
    elect_per_s = 3 / cluster.timing.heartbeat * 1.5
    assert (after - before) / elapsed <= elect_per_s + len(jobs) / elapsed


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / 100.0
