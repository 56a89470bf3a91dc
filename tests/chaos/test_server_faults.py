"""Real servers through their stops, reloads and recycles (issue 15): gunicorn with
uvicorn-worker, ``uvicorn --workers`` and ``--reload``, ``hypercorn -w``, each a subprocess
serving the chaos replica on a real Redis. Every row checks the journals (one runner at a time,
tokens never down, one node id per worker, nothing started or acquired by a worker whose
shutdown began) and measures the handover gap: the old leader's last run end to the new
leader's first run start. docs/lifespan.md quotes these numbers."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .checker import Run
from .harness import Cluster, Replica, Results, Timing, full_only, now
from .replica import JobConfig
from .server_procs import (
    GUNICORN,
    HYPERCORN,
    TICK,
    UVICORN,
    Verdict,
    gunicorn,
    hypercorn,
    needs,
    ready_pids,
    start_server,
    uvicorn,
    verdict,
    watch_workers,
    workers_ready,
)

JOB = "tick"
SLOW = JobConfig(JOB, every=1.0, run_s=0.8)
"""A job that is mostly running: a stop usually finds a run in flight."""
LONG = JobConfig(JOB, every=3.0, run_s=2.5)
"""Runs longer than the server lets a worker drain."""
MAX_REQUESTS = 20
STARTUP_RUN_S = 20.0
OUTAGE_SEEN_S = 5.0
OUTAGE_S = 2.0
SETTLE_RUNS = 3
"""Runs of the new leader to wait for after a handover, so that it has settled."""
HANDOVER_S = 10.0
SERVER_EXIT_S = 20.0
SIGNAL_TO_SHUTDOWN_S = 2.0
"""A server starts the lifespan shutdown this soon after its signal, on a busy machine: the
``uvicorn --workers`` supervisor handles signals every 0.5 s, and a uvicorn worker (also under
gunicorn) looks at its exit flag every 0.1 s; until then the library cannot know that a stop
is coming."""


def after_signal(v: Verdict, pids: set[int], sent: float) -> tuple[int, float]:
    """How many runs the signalled workers started after the signal, and the latest such
    start (seconds after the signal; 0 when none)."""
    late = v.after_signal(pids, sent)
    latest = max((r.start - sent for r in late), default=0.0)
    assert latest < SIGNAL_TO_SHUTDOWN_S, f"a run {latest:.3f} s after the signal"
    return len(late), latest


async def settle(cluster: Cluster, since: float) -> None:
    """Until the job has run a few times after ``since``."""
    await cluster.until_runs(JOB, SETTLE_RUNS, since=since, timeout_s=HANDOVER_S)


async def stop_with_backup(
    cluster: Cluster,
    record: Results,
    row: str,
    server: Replica,
    workers: int,
    *,
    job: JobConfig = TICK,
    mid_run: bool = False,
) -> tuple[Verdict, list[Run]]:
    """Start ``server`` with ``workers`` workers, let one of them lead, start a one-worker
    uvicorn beside it, SIGTERM ``server``'s master and wait for the backup to take over:
    the rolling-deploy case. Returns the verdict and the runs of ``server`` that a kill cut
    short."""
    async with watch_workers(server):
        pids = await workers_ready(cluster, server, workers)
        leader = await cluster.one_leader(JOB)
        backup = start_server(cluster, "backup", uvicorn(), job)
        await workers_ready(cluster, backup, 1)
        if mid_run:  # signal just after a run started: it has most of its time to go
            await cluster.wait(
                lambda: fresh_run(cluster, leader), HANDOVER_S, "a run just started", poll_s=0.002
            )
        sent = server.send(signal.SIGTERM)
        code = await server.wait_exit(SERVER_EXIT_S)
        await cluster.first_run(JOB, after=sent, newer_than=0, timeout_s=HANDOVER_S)
        await settle(cluster, now())
    v = verdict(cluster)
    v.check()
    late, latest = after_signal(v, set(pids), sent)
    # A sibling worker that has not yet noticed the stop may lead for a while in between
    # (hypercorn's workers each look at the shutdown event every 0.1 s): measure to the backup.
    backups = set(ready_nodes(backup))
    gap_s, within = v.handover_to(backups, sent)
    leased = min(e.t for e in v.events if e.ev == "lead" and e.t > sent and e.node in backups)
    cut_short = [r for r in v.runs if r.pid in pids and r.outcome == "unfinished"]
    record.add(
        row,
        row,
        exit=code,
        gap_ms=gap_s * 1e3,
        handovers_within_server=within,
        lease_taken_after_signal_ms=(leased - sent) * 1e3,
        runs_after_signal=late,
        last_run_after_signal_ms=latest * 1e3,
        runs_cut_short=len(cut_short),
        released=any(e.ev == "released" and e.pid in pids for e in v.events),
    )
    return v, cut_short


def assert_stopped_cleanly(server: Replica, v: Verdict) -> None:
    """Every worker of ``server`` completed its lifespan shutdown, and one released the lock."""
    workers = {e.pid for e in v.events if e.ev == "ready" and e.data["node"] == server.name}
    stopped = {e.pid for e in v.events if e.ev == "stopped" and e.data["node"] == server.name}
    assert workers <= stopped, f"workers {sorted(workers - stopped)} did not complete shutdown"
    assert any(e.ev == "released" and e.pid in workers for e in v.events), "no release"


def fresh_run(cluster: Cluster, node: str) -> bool:
    """True when ``node`` started a run of the job less than 30 ms ago."""
    run = cluster.in_flight(JOB, node)
    return run is not None and now() - run.start < 0.03


def ready_nodes(replica: Replica) -> list[str]:
    """Node ids of every worker of ``replica`` that started."""
    return [str(e.data["electors"][0]) for e in replica.events() if e.ev == "ready"]


# --- gunicorn + uvicorn-worker --------------------------------------------------------------


@needs(GUNICORN)
async def test_gunicorn_sigterm_hands_over(cluster: Cluster, record: Results) -> None:
    cluster.redis()
    server = start_server(cluster, "g", gunicorn(2, "--graceful-timeout", "5"))
    v, _ = await stop_with_backup(cluster, record, "gunicorn SIGTERM", server, 2)
    assert_stopped_cleanly(server, v)
    assert v.handovers[-1].gap_s < 1.0  # the release is pushed: no wait for the lock expiry


@full_only
@needs(GUNICORN)
async def test_gunicorn_sighup_reloads_workers(cluster: Cluster, record: Results) -> None:
    cluster.redis()
    server = start_server(cluster, "g", gunicorn(2, "--graceful-timeout", "5"))
    async with watch_workers(server) as watch:
        old = await workers_ready(cluster, server, 2)
        await cluster.one_leader(JOB)
        sent = server.send(signal.SIGHUP)
        new = await workers_ready(cluster, server, 2, since=sent)
        await cluster.wait(
            lambda: set(old) <= set(watch.exits), SERVER_EXIT_S, "the old workers exit"
        )
        await cluster.first_run(JOB, after=sent, newer_than=0, timeout_s=HANDOVER_S)
        await settle(cluster, now())
    v = verdict(cluster)
    v.check()
    assert server.alive
    assert not set(old) & set(new)
    late, latest = after_signal(v, set(old), sent)
    gap_s, within = v.handover_to(set(new.values()), sent)
    record.add(
        "gunicorn SIGHUP",
        "sighup",
        gap_ms=gap_s * 1e3,
        handovers_among_old_workers=within,
        runs_after_signal=late,
        last_run_after_signal_ms=latest * 1e3,
    )


@full_only
@needs(GUNICORN)
async def test_gunicorn_max_requests_recycles_the_leader(cluster: Cluster, record: Results) -> None:
    cluster.redis()
    options = ("--max-requests", str(MAX_REQUESTS), "--max-requests-jitter", "0")
    server = start_server(cluster, "g", gunicorn(2, *options))
    async with watch_workers(server) as watch:
        first = await workers_ready(cluster, server, 2)
        leader = await cluster.one_leader(JOB)
        (leader_pid,) = [pid for pid, node in first.items() if node == leader]
        sent = now()
        served = await requests_to(server, leader, MAX_REQUESTS + 1)
        await cluster.wait(
            lambda: leader_pid in watch.exits, SERVER_EXIT_S, "the leader's worker recycles"
        )
        await cluster.first_run(JOB, after=sent, newer_than=0, timeout_s=HANDOVER_S)
        await settle(cluster, now())
    v = verdict(cluster)
    v.check()
    handover = v.gap_after(sent)
    assert handover.old == leader
    others = set(first) - {leader_pid}
    assert handover.new in {first[pid] for pid in others}, (handover, first)
    assert not others & set(watch.exits), "a worker that served no request recycled"
    assert handover.gap_s < 1.0  # to a live worker, through the pushed release
    record.add("gunicorn --max-requests", "recycle", gap_ms=handover.gap_s * 1e3, served=served)


@full_only
@needs(GUNICORN)
async def test_gunicorn_max_requests_recycles_workers_together(
    cluster: Cluster, record: Results
) -> None:
    # Requests over new connections spread over both workers: with no jitter they reach the
    # limit close together, and the job waits for a new worker's startup.
    cluster.redis()
    options = ("--max-requests", str(MAX_REQUESTS), "--max-requests-jitter", "0")
    server = start_server(cluster, "g", gunicorn(2, *options))
    async with watch_workers(server) as watch:
        first = await workers_ready(cluster, server, 2)
        await cluster.one_leader(JOB)
        sent = now()
        async with httpx.AsyncClient(timeout=5.0, headers={"Connection": "close"}) as http:
            for _ in range(10 * MAX_REQUESTS):
                if set(first) <= set(watch.exits):
                    break
                with contextlib.suppress(httpx.TransportError):
                    await http.get(server.url + "/sj/health/live")
        await cluster.wait(
            lambda: set(first) <= set(watch.exits), SERVER_EXIT_S, "both workers recycle"
        )
        await cluster.first_run(
            JOB, after=max(watch.exits.values()), newer_than=0, timeout_s=HANDOVER_S
        )
        await settle(cluster, now())
    v = verdict(cluster)
    v.check()
    exits = sorted(watch.exits[pid] for pid in first)
    gap_s, _ = v.handover_to(set(ready_pids(server, sent).values()), sent)
    record.add(
        "gunicorn --max-requests, workers together",
        "recycle together",
        recycled_apart_ms=(exits[-1] - exits[0]) * 1e3,
        gap_ms=gap_s * 1e3,
    )


@full_only
@needs(GUNICORN)
async def test_gunicorn_graceful_timeout_below_the_drain(cluster: Cluster, record: Results) -> None:
    # Misconfigured on purpose: gunicorn SIGKILLs a worker --graceful-timeout (1 s) after the
    # SIGTERM, while the library would let a 2.5 s run finish (shutdown_timeout 3 s). The run
    # is cut short, nothing is released, and the other replica waits for the lock's expiry.
    cluster.redis()
    timing = Timing(shutdown_timeout=3.0)
    server = start_server(cluster, "g", gunicorn(1, "--graceful-timeout", "1"), LONG, timing)
    async with watch_workers(server):
        pids = await workers_ready(cluster, server, 1)
        leader = await cluster.wait_leader(JOB)
        backup = start_server(cluster, "backup", uvicorn(), LONG, timing)
        backups = set((await workers_ready(cluster, backup, 1)).values())
        await cluster.wait(
            lambda: fresh_run(cluster, leader), HANDOVER_S, "a run just started", poll_s=0.002
        )
        sent = server.send(signal.SIGTERM)
        await server.wait_exit(SERVER_EXIT_S)
        await cluster.first_run(JOB, after=sent, newer_than=0, timeout_s=HANDOVER_S)
    v = verdict(cluster)
    v.check()
    cut_short = [r for r in v.runs if r.pid in pids and r.outcome == "unfinished"]
    assert len(cut_short) == 1, v.runs
    assert not any(e.ev == "released" and e.pid in pids for e in v.events)
    leased = min(e.t for e in v.events if e.ev == "lead" and e.node in backups)
    record.add(
        "gunicorn --graceful-timeout below the drain",
        "graceful timeout",
        lease_taken_after_signal_ms=(leased - sent) * 1e3,
        killed_after_signal_ms=(cut_short[0].ended_by(leased) - sent) * 1e3,
    )


async def requests_to(server: Replica, node: str, count: int) -> int:
    """Send ``count`` requests to the worker of ``server`` whose node id is ``node``: open
    connections until one lands on that worker, then keep it alive for the rest (a kept-alive
    connection stays with the worker that accepted it). Returns how many that worker served."""
    limits = httpx.Limits(max_connections=1)
    for _ in range(100):
        async with httpx.AsyncClient(timeout=5.0, limits=limits) as http:
            answer = await http.get(server.url + "/sj/health/live")
            if answer.json()["node_id"] != node:
                continue
            served = 1
            for _ in range(count - 1):
                try:
                    await http.get(server.url + "/sj/health/live")
                except httpx.TransportError:
                    break  # the worker closed the connection on its way out
                served += 1
            return served
    raise AssertionError(f"no connection reached {node} in 100 attempts")


@needs(GUNICORN)
async def test_gunicorn_preload_gives_each_worker_its_node_id(
    cluster: Cluster, record: Results
) -> None:
    cluster.redis()
    server = start_server(cluster, "g", gunicorn(3, "--preload"))
    async with watch_workers(server):
        workers = await workers_ready(cluster, server, 3)
        await cluster.one_leader(JOB)
    v = verdict(cluster)
    v.check()
    assert len(set(workers.values())) == 3, workers
    for pid, node in workers.items():
        assert f"-{pid}-" in node, f"worker {pid} kept the master's node id {node}"
    record.add("gunicorn --preload", "preload", node_ids=sorted(workers.values()))


# --- uvicorn ---------------------------------------------------------------------------------


@full_only
@needs(UVICORN)
async def test_uvicorn_workers_sigterm_hands_over(cluster: Cluster, record: Results) -> None:
    cluster.redis()
    server = start_server(cluster, "u", uvicorn("--workers", "3"))
    v, _ = await stop_with_backup(cluster, record, "uvicorn --workers SIGTERM", server, 3)
    assert_stopped_cleanly(server, v)


@full_only
@needs(UVICORN)
async def test_uvicorn_reload_hands_over(cluster: Cluster, record: Results, tmp_path: Path) -> None:
    cluster.redis()
    watched = tmp_path / "watched"
    watched.mkdir()
    source = watched / "module.py"
    source.write_text("VERSION = 1\n")
    server = start_server(cluster, "u", uvicorn("--reload", "--reload-dir", str(watched)))
    async with watch_workers(server) as watch:
        (old,) = await workers_ready(cluster, server, 1)
        await cluster.one_leader(JOB)
        touched = now()
        source.write_text("VERSION = 2\n")
        (new,) = await workers_ready(cluster, server, 1, since=touched)
        await cluster.first_run(JOB, after=touched, newer_than=0, timeout_s=HANDOVER_S)
        await settle(cluster, now())
    v = verdict(cluster)
    v.check()
    assert old in watch.exits and new != old
    gap_s, _ = v.handover_to({ready_pids(server, touched)[new]}, touched)
    record.add(
        "uvicorn --reload",
        "reload",
        gap_ms=gap_s * 1e3,
        old_exit_after_touch_ms=(watch.exits[old] - touched) * 1e3,
    )


# --- hypercorn -------------------------------------------------------------------------------


@needs(UVICORN)
async def test_uvicorn_workers_ready_again_after_a_redis_outage(
    cluster: Cluster, record: Results
) -> None:
    # A long max_backoff: readiness must not wait for the election's next attempt.
    timing = Timing(max_backoff=5.0)
    store = cluster.redis()
    server = start_server(cluster, "u", uvicorn("--workers", "3"), timing=timing)
    workers = await workers_ready(cluster, server, 3)
    async with contextlib.AsyncExitStack() as stack:
        probes = Probes(await pinned(stack, server.url, set(workers.values())))
        await cluster.wait(
            lambda: probes.all("ok", 200), STARTUP_RUN_S, "every worker is ready", poll_s=0.02
        )
        store.kill()
        killed = now()
        await cluster.wait(
            lambda: probes.all("degraded", 503, since=killed),
            OUTAGE_SEEN_S,
            "every worker reports the outage (200 degraded, strict 503)",
            poll_s=0.02,
        )
        degraded_ms = (now() - killed) * 1e3
        # The election backs off meanwhile; /health stays 200 on every worker throughout.
        while now() < killed + OUTAGE_S:
            await probes.all("degraded", 503)
            await cluster.sleep(0.05)
        store.restart()
        restarted = now()
        await cluster.wait(
            lambda: probes.all("ok", 200, since=restarted),
            timing.heartbeat + 1.0,
            f"every worker is ready again within a heartbeat and a second: {probes.first}",
            poll_s=0.02,
        )
    ready_ms = sorted(round((at - restarted) * 1e3) for at in probes.first.values())
    record.add(
        "uvicorn --workers readiness after Redis returns",
        "ready again",
        degraded_seen_ms=degraded_ms,
        ready_again_ms=ready_ms,
    )


async def pinned(
    stack: contextlib.AsyncExitStack, url: str, nodes: set[str]
) -> dict[str, httpx.AsyncClient]:
    """One kept-alive connection to each worker (node id) of the server at ``url``: open
    connections until every worker has accepted one (a connection stays with its worker)."""
    clients: dict[str, httpx.AsyncClient] = {}
    for _ in range(200):
        client = await stack.enter_async_context(
            httpx.AsyncClient(base_url=url, timeout=5.0, limits=httpx.Limits(max_connections=1))
        )
        node = (await client.get("/sj/health/live")).json()["node_id"]
        clients.setdefault(node, client)  # a second connection to a worker stays unused
        if set(clients) >= nodes:
            return clients
    raise AssertionError(f"no connection reached every worker: {sorted(clients)} of {nodes}")


@dataclass
class Probes:
    """Polls the readiness probes of each worker of a server over its own connection, and
    remembers when each first answered as expected."""

    clients: dict[str, httpx.AsyncClient]
    first: dict[str, float] = field(default_factory=dict)

    async def all(self, status: str, strict_code: int, since: float = 0.0) -> bool:
        """True once every worker has answered ``/sj/health`` with ``status`` (never anything
        but 200) and ``/sj/health/jobs`` with ``strict_code``, each since ``since``."""
        self.first = {node: at for node, at in self.first.items() if at >= since}
        answers = await asyncio.gather(*(self._both(n) for n in self.clients))
        for node, (at, health, strict) in zip(self.clients, answers, strict=True):
            if health == status and strict == strict_code:
                self.first.setdefault(node, at)
        return set(self.first) >= set(self.clients)

    async def _both(self, node: str) -> tuple[float, str, int]:
        client = self.clients[node]
        health = await client.get("/sj/health")
        strict = await client.get("/sj/health/jobs")
        at = now()
        assert health.status_code == 200, f"{node} left rotation: {health.text}"
        seen = {health.json()["node_id"], strict.json()["node_id"]}
        assert seen == {node}, f"the connection to {node} moved to {seen}"
        return at, health.json()["status"], strict.status_code


@needs(HYPERCORN)
async def test_hypercorn_workers_sigterm(cluster: Cluster, record: Results) -> None:
    cluster.redis()
    server = start_server(cluster, "h", hypercorn(2, "--graceful-timeout", "5"))
    _, cut_short = await stop_with_backup(cluster, record, "hypercorn -w 2 SIGTERM", server, 2)
    assert not cut_short, cut_short


@full_only
@needs(HYPERCORN)
async def test_hypercorn_workers_sigterm_mid_run(cluster: Cluster, record: Results) -> None:
    # hypercorn's master SIGTERMs the remaining workers as soon as one has exited; the workers
    # of `-w N` keep Python's default SIGTERM action (their stop comes through an event), so a
    # leader still waiting for its run in flight dies there: no lifespan shutdown, no release.
    # One runner still holds; the lease waits for its expiry.
    cluster.redis()
    server = start_server(cluster, "h", hypercorn(2, "--graceful-timeout", "5"), SLOW)
    await stop_with_backup(
        cluster, record, "hypercorn -w 2 SIGTERM mid-run", server, 2, job=SLOW, mid_run=True
    )


@full_only
@needs(HYPERCORN)
async def test_hypercorn_one_worker_sigterm_mid_run(cluster: Cluster, record: Results) -> None:
    # With one worker there is no other worker to exit first: the run ends, the lease is
    # released and handed over at once.
    cluster.redis()
    server = start_server(cluster, "h", hypercorn(1, "--graceful-timeout", "5"), SLOW)
    _, cut_short = await stop_with_backup(
        cluster, record, "hypercorn -w 1 SIGTERM mid-run", server, 1, job=SLOW, mid_run=True
    )
    assert not cut_short, cut_short
    assert "released leadership of tick" in server.output(), cluster.describe()
