"""Real servers (gunicorn + uvicorn-worker, uvicorn ``--workers`` and ``--reload``, hypercorn)
running the chaos replica (``server_app.py``) on a real Redis, and what their journals show.

A server is a chaos :class:`~chaos.harness.Replica` started with ``server=`` (its command line);
its workers each draw a node id of their own and journal every run with their pid, node id and
fencing token. :class:`WorkerWatch` notes when each worker process exits, so that a run cut
short by a hard kill ends there. :func:`verdict` reads every journal of the test and checks the
two promises of the library through a server's stops, reloads and recycles: one runner at a
time with tokens that never go down, and nothing acquired or started by a node that is stopping.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .checker import Event, Run, max_concurrent, overlap_s, stale_writes
from .harness import Cluster, Replica, Timing, now
from .replica import JobConfig

__all__ = [
    "APP",
    "TICK",
    "GUNICORN",
    "HYPERCORN",
    "UVICORN",
    "Handover",
    "Verdict",
    "WorkerWatch",
    "gunicorn",
    "hypercorn",
    "needs",
    "uvicorn",
    "verdict",
    "watch_workers",
    "workers_ready",
]

APP = "chaos.server_app:app"
TICK = JobConfig("tick", every=0.05, run_s=0.01)
EXTRA = {"generated_node_id": True}

GUNICORN = "gunicorn"
UVICORN = "uvicorn"
HYPERCORN = "hypercorn"


def needs(server: str) -> pytest.MarkDecorator:
    """Skip unless ``python -m server`` can run (the ``test`` extra installs every server)."""
    return pytest.mark.skipif(
        importlib.util.find_spec(server) is None,
        reason=f"{server} is not installed in this environment: pip install -e '.[test]'",
    )


def gunicorn(workers: int, *options: str) -> tuple[str, ...]:
    """``gunicorn -k uvicorn_worker.UvicornWorker -w N ... chaos.server_app:app``."""
    return (
        *("gunicorn", "-k", "uvicorn_worker.UvicornWorker", "-w", str(workers)),
        *("-b", "{host}:{port}", "--log-level", "info", *options, APP),
    )


def uvicorn(*options: str) -> tuple[str, ...]:
    """``uvicorn chaos.server_app:app ...``."""
    return ("uvicorn", APP, "--host", "{host}", "--port", "{port}", "--no-access-log", *options)


def hypercorn(workers: int, *options: str) -> tuple[str, ...]:
    """``hypercorn -w N ... chaos.server_app:app``."""
    return ("hypercorn", "-w", str(workers), "-b", "{host}:{port}", *options, APP)


def start_server(
    cluster: Cluster,
    name: str,
    server: Sequence[str],
    job: JobConfig = TICK,
    timing: Timing | None = None,
) -> Replica:
    """A server running the one-job replica, every worker with its own node id."""
    return cluster.replica(name, [job], server=server, extra=dict(EXTRA), timing=timing)


def ready_pids(replica: Replica, since: float = 0.0) -> dict[int, str]:
    """``{pid: node id}`` of the workers of ``replica`` whose lifespan startup completed
    after ``since``."""
    return {
        e.pid: str(e.data["electors"][0])
        for e in replica.events()
        if e.ev == "ready" and e.t > since
    }


async def workers_ready(
    cluster: Cluster, replica: Replica, count: int, *, since: float = 0.0, timeout_s: float = 40.0
) -> dict[int, str]:
    """Wait until ``count`` workers of ``replica`` started after ``since``; return them."""

    def enough() -> bool:
        if not replica.alive:
            raise AssertionError(f"{replica.name} exited\n{cluster.describe()}")
        return len(ready_pids(replica, since)) >= count

    await cluster.wait(enough, timeout_s, f"{count} workers of {replica.name} are ready")
    return ready_pids(replica, since)


@dataclass
class WorkerWatch:
    """Notes (journal clock) when each worker of the watched replicas exits."""

    replicas: Sequence[Replica]
    exits: dict[int, float] = field(default_factory=dict)

    async def run(self) -> None:
        """Poll every worker that journaled ``ready`` until it is gone (or a zombie)."""
        while True:
            for replica in self.replicas:
                for pid in ready_pids(replica):
                    if pid not in self.exits and not _alive(pid):
                        self.exits[pid] = replica.exits[pid] = now()
            await asyncio.sleep(0.005)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@contextlib.asynccontextmanager
async def watch_workers(*replicas: Replica) -> AsyncIterator[WorkerWatch]:
    """Watch the workers of ``replicas`` for the block's duration."""
    watch = WorkerWatch(replicas)
    task = asyncio.create_task(watch.run(), name="worker watch")
    try:
        yield watch
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@dataclass(frozen=True)
class Handover:
    """The job moved from one node to another: the old leader's last run ended at ``end``,
    the new one's first run started ``gap_s`` later."""

    old: str
    new: str
    end: float
    gap_s: float


@dataclass
class Verdict:
    """What the journals of one test show."""

    runs: list[Run]
    events: list[Event]
    peak: int
    overlap_s: float
    tokens_ordered: bool
    handovers: list[Handover]
    nodes_by_pid: dict[int, set[str]]
    after_stopping: list[str]
    """Runs started and leases taken by a worker after its lifespan shutdown began."""

    def after_signal(self, pids: set[int], sent_at: float) -> list[Run]:
        """Runs that workers ``pids`` started after their server got a signal at ``sent_at``."""
        return [r for r in self.runs if r.pid in pids and r.start > sent_at]

    def gap_after(self, instant: float) -> Handover:
        """The first handover whose old leader's last run ended after ``instant``."""
        found = [h for h in self.handovers if h.end > instant - 0.2]
        assert found, f"no handover after {instant:.3f}: {self.handovers}"
        return found[0]

    def handover_to(self, nodes: set[str], since: float) -> tuple[float, int]:
        """The gap from the last run of any other node to the first run of ``nodes`` after
        ``since``, and how many handovers among the other nodes came in between (a worker
        that has not yet noticed a stop may lead for a moment after a stopping sibling)."""
        first = min(
            (r for r in self.runs if r.node in nodes and r.start > since), key=lambda r: r.start
        )
        last_end = max(
            r.ended_by(first.start)
            for r in self.runs
            if r.node not in nodes and r.start < first.start
        )
        within = sum(
            since - 0.2 < h.end < first.start and h.new not in nodes for h in self.handovers
        )
        return first.start - last_end, within

    def check(self) -> None:
        """One runner at a time (and no write to the witness's fenced register by a stale
        term), tokens never down, one node id per process, nothing started or acquired once
        stopping."""
        assert self.peak <= 1, f"{self.peak} runs at once, overlapping {self.overlap_s:.3f} s"
        late, rejected = stale_writes(self.runs)
        assert (late, rejected) == (0, 0), f"{late} stale writes, {rejected} rejected by the fence"
        assert self.tokens_ordered, [(r.node, r.token) for r in self.runs]
        shared = {pid: nodes for pid, nodes in self.nodes_by_pid.items() if len(nodes) > 1}
        assert not shared, f"a process ran under several node ids: {shared}"
        by_node: dict[str, set[int]] = {}
        for pid, nodes in self.nodes_by_pid.items():
            for node in nodes:
                by_node.setdefault(node, set()).add(pid)
        assert all(len(p) == 1 for p in by_node.values()), f"a node id in two processes: {by_node}"
        assert not self.after_stopping, self.after_stopping


def verdict(cluster: Cluster, job: str = TICK.name) -> Verdict:
    """Read every journal of the test and compute the verdict."""
    events = cluster.events()
    runs = cluster.runs(job)
    ordered = sorted(runs, key=lambda r: r.start)
    handovers = [
        Handover(a.node, b.node, a.ended_by(b.start), b.start - a.ended_by(b.start))
        for a, b in itertools.pairwise(ordered)
        if a.node != b.node
    ]
    nodes_by_pid: dict[int, set[str]] = {}
    for run in runs:
        nodes_by_pid.setdefault(run.pid, set()).add(run.node)
    for event in events:
        if event.ev == "ready":
            nodes_by_pid.setdefault(event.pid, set()).update(map(str, event.data["electors"]))
    # The library starts a run (ctx.started_at) before the job's body journals "start": a
    # run started just before the shutdown began may begin its body just after. Compare the
    # library's own start with the shutdown, on the worker's wall clock.
    stopping: dict[int, float] = {}
    for event in events:
        if event.ev == "stopping":
            stopping.setdefault(event.pid, float(event.data["wall"]))
    started = {
        e.run: float(e.data["started_at"]) for e in events if e.ev == "start" and e.run is not None
    }
    late = [
        f"run of {r.node} (pid {r.pid}, token {r.token}) started "
        f"{started[r.run] - stopping[r.pid]:.3f} s after its shutdown began"
        for r in runs
        if r.pid in stopping and started[r.run] > stopping[r.pid]
    ]
    late += [
        f"{e.node} (pid {e.pid}) took the lease (token {e.token}) after its shutdown began"
        for e in events
        if e.ev == "lead" and e.pid in stopping and float(e.data["wall"]) > stopping[e.pid]
    ]
    return Verdict(
        runs=runs,
        events=events,
        peak=max_concurrent(runs),
        overlap_s=overlap_s(runs),
        tokens_ordered=all(a.token <= b.token for a, b in itertools.pairwise(ordered)),
        handovers=handovers,
        nodes_by_pid=nodes_by_pid,
        after_stopping=late,
    )
