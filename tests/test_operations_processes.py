"""Operating real replica processes (``node_proc.py``) on a real Redis, from another process:
pause stops new runs within a round trip and survives a restart of the leader, trigger runs
exactly once, step-down hands over with a gap under 50 ms, and the CLI (a real subprocess)
prints the JSON of ``GET /cluster`` and exits with its documented codes."""

from __future__ import annotations

import asyncio
import io
import json
import re
import signal
import subprocess
import sys

import httpx
import pytest
from fastapi import FastAPI
from node_proc import JOB, max_concurrent, now
from servers import free_port
from test_failover import Cluster, cluster
from waiting import wait_until

__all__ = ["cluster"]  # the fixture, shared with test_failover

from fastapi_singletonjob import JobContext, SingletonJobs
from fastapi_singletonjob._cli import EXIT_NO_JOB, EXIT_OK, EXIT_UNREACHABLE, main

pytestmark = pytest.mark.redis

STARTUP_S = 20.0  # interpreters importing FastAPI at once, on a busy machine
POLL_S = 0.01
PAUSE_BOUND_S = 0.1
"""A run may start after ``pause`` returned only if the leader's woken round had not yet come
back: one round trip, a few ms; this bound leaves room for a busy machine."""
STEP_DOWN_GAP_MAX_S = 0.05
CLI_S = 60.0


@pytest.fixture
def operator(redis_url: str, unique_project: str) -> SingletonJobs:
    """Another process's view: no jobs of its own, never started."""
    return SingletonJobs(redis_url, project=unique_project, node_id="operator")


async def running(cluster: Cluster, *nodes: str) -> None:
    cluster.start(*nodes)
    await wait_until(lambda: bool(cluster.runs()), STARTUP_S, "a first run", poll_s=POLL_S)


async def members(operator: SingletonJobs, count: int) -> None:
    async def joined() -> bool:
        return len((await operator.cluster_status()).nodes) == count

    await wait_until(joined, STARTUP_S, f"{count} members")


async def test_pause_stops_new_runs_at_once_and_survives_a_restart_of_the_leader(
    cluster: Cluster, operator: SingletonJobs
) -> None:
    await running(cluster, "n1", "n2")
    await members(operator, 2)
    leader = cluster.leader()
    await operator.pause(JOB)
    paused_at = now()
    await asyncio.sleep(0.5)
    late = [r.start - paused_at for r in cluster.runs() if r.start > paused_at]
    print(f"runs started after pause() returned: {[f'{x * 1000:.1f} ms' for x in late]}")
    assert all(x < PAUSE_BOUND_S for x in late), late

    cluster.send(leader, signal.SIGTERM)
    assert await cluster.wait_exit(leader) == 0, cluster.describe()
    cluster.start(leader)  # the same node id, a new process
    await members(operator, 2)
    view = await operator.cluster_status()
    assert view.jobs[0].paused and view.jobs[0].leader is not None
    quiet_since = now()
    await asyncio.sleep(1.0)
    assert not [r for r in cluster.runs() if r.start > quiet_since], "still paused"

    await operator.resume(JOB)
    resumed_at = now()
    await wait_until(
        lambda: any(r.start > resumed_at for r in cluster.runs()), 2.0, "a run", poll_s=POLL_S
    )
    first = min(r.start for r in cluster.runs() if r.start > resumed_at)
    print(f"first run {(first - resumed_at) * 1000:.1f} ms after resume() returned")
    assert max_concurrent(cluster.runs()) == 1


async def test_trigger_runs_exactly_once_on_the_leader(
    redis_url: str, unique_project: str, operator: SingletonJobs
) -> None:
    # Two nodes in this process (the trigger's path is the same in any process), whose job's
    # next instant is an hour away: every run is a triggered one.
    runs: list[str] = []
    nodes = [
        SingletonJobs(
            redis_url,
            project=unique_project,
            node_id=name,
            heartbeat_interval=0.1,
            lock_expiry=0.5,
        )
        for name in ("n1", "n2")
    ]
    for jobs in nodes:

        @jobs.fixed_rate(JOB, every=3600.0)
        async def tick(ctx: JobContext) -> None:
            runs.append(ctx.node_id)

        await jobs.start()
    try:

        async def led() -> bool:
            # No job is listed until a node's first round has written its membership record.
            listed = (await operator.cluster_status()).jobs
            return bool(listed) and listed[0].leader is not None

        await wait_until(led, 5.0, "a leader")
        leader = (await operator.cluster_status()).jobs[0].leader
        for count in (1, 2):
            await operator.trigger(JOB)
            asked_at = now()

            def ran(count: int = count) -> bool:
                return len(runs) >= count

            await wait_until(ran, 5.0, f"{count} runs", poll_s=POLL_S)
            print(f"triggered run {count} started {(now() - asked_at) * 1000:.1f} ms after")
        await asyncio.sleep(1.0)  # ten more election rounds: nothing left to take again
        assert runs == [leader, leader]
        assert not (await operator.cluster_status()).jobs[0].pending
    finally:
        for jobs in nodes:
            await jobs.stop()


_LOG_LINE = re.compile(r"^(\d+\.\d+) (\S+) .*?(released leadership|became leader) of")


def _handover(cluster: Cluster, old: str) -> tuple[float, str] | None:
    """From the replicas' logs: the new leader's start minus the old one's release, in s."""
    released: float | None = None
    for replica in cluster.replicas.values():
        for line in replica.log.read_text(errors="replace").splitlines():
            match = _LOG_LINE.match(line)
            if match and match[2] == old and match[3] == "released leadership":
                released = float(match[1])
    if released is None:
        return None
    for replica in cluster.replicas.values():
        for line in replica.log.read_text(errors="replace").splitlines():
            match = _LOG_LINE.match(line)
            if match and match[3] == "became leader" and float(match[1]) >= released:
                return float(match[1]) - released, match[2]
    return None


async def test_step_down_hands_over_within_50_ms(cluster: Cluster, operator: SingletonJobs) -> None:
    await running(cluster, "n1", "n2", "n3")
    await members(operator, 3)
    old = cluster.leader()
    asked_at = now()
    await operator.step_down(JOB)
    await wait_until(lambda: _handover(cluster, old) is not None, 3.0, "a handover", poll_s=POLL_S)
    handed_at = now()
    handover = _handover(cluster, old)
    assert handover is not None
    gap_s, new = handover
    await asyncio.sleep(1.0)
    runs = cluster.runs()
    after = [r for r in runs if r.start > handed_at]
    print(f"step_down() to handover seen: {(handed_at - asked_at) * 1000:.0f} ms")
    print(f"step-down: {new} leads {gap_s * 1000:.0f} ms after {old} released")
    assert new != old, "the node that stepped down did not take it back"
    assert gap_s < STEP_DOWN_GAP_MAX_S, cluster.describe()
    assert after and {r.node for r in after} == {new}
    assert max_concurrent(runs) == 1


# -- the CLI, a real subprocess ------------------------------------------------------------


def cli(*args: str, url: str, project: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "fastapi_singletonjob", "--redis-url", url, *args]
    return subprocess.run(
        [*command, "--project", project], capture_output=True, text=True, timeout=CLI_S
    )


_MOVING = {
    "observed_at",
    "lease_time_left_s",
    "expires_in_s",
    "last_seen",
    "last_instant",
    "iteration",  # the job runs every 50 ms between the two reads
    "last_completed_at",
    "last_scheduled_at",
}


def _steady(value: object) -> object:
    """``value`` without the fields that change from one read to the next."""
    if isinstance(value, dict):
        return {k: _steady(v) for k, v in value.items() if k not in _MOVING}
    if isinstance(value, list):
        return [_steady(v) for v in value]
    return value


async def test_cli_json_matches_get_cluster_and_exit_codes(
    cluster: Cluster, redis_url: str, unique_project: str
) -> None:
    await running(cluster, "n1", "n2")
    jobs = SingletonJobs(redis_url, project=unique_project, node_id="web")
    await members(jobs, 2)
    app = FastAPI()
    app.include_router(jobs.router)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://web") as client:
        served = (await client.get("/cluster")).json()
    printed = await asyncio.to_thread(
        cli, "status", "--json", url=redis_url, project=unique_project
    )
    assert printed.returncode == EXIT_OK, printed.stderr
    assert _steady(json.loads(printed.stdout)) == _steady(served)

    # In this process (an interpreter less to start): the table, and an unknown job.
    out = io.StringIO()
    args = ["--redis-url", redis_url, "--project", unique_project]
    assert await asyncio.to_thread(main, [*args, "status"], out) == EXIT_OK
    assert "LEASE LEFT" in out.getvalue() and "n1" in out.getvalue()
    assert await asyncio.to_thread(main, [*args, "pause", "nope"], out) == EXIT_NO_JOB
    out = io.StringIO()
    assert await asyncio.to_thread(main, [*args, "checkpoint", JOB, "--json", "--state"], out) == 0
    checkpoint = json.loads(out.getvalue())
    assert checkpoint["iteration"] > 0 and checkpoint["last_outcome"] == "success"
    assert checkpoint["node_id"] in ("n1", "n2") and "state" in checkpoint

    down = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    gone = await asyncio.to_thread(cli, "status", url=down, project=unique_project)
    assert gone.returncode == EXIT_UNREACHABLE, gone.stderr
    assert "did not answer" in gone.stderr and "Traceback" not in gone.stderr
    assert "hunter2" not in gone.stderr
