"""Failover between real replica processes on a real redis-server.

Replicas are processes in the pattern of ``tests/node_proc.py``: one ``SingletonJobs`` with a
fixed-rate job (every 50 ms, 10 ms per run) that journals each run with ``CLOCK_MONOTONIC``
times, stopped gracefully on SIGTERM. A monitor process subscribes to the keyspace
notifications of the lock keys (``set``, ``expire``, ``del``, ``expired``) and journals when
each arrives, so that release, renewal and acquisition are all timed on one clock and through
one delivery path:

- graceful (SIGTERM): leaderless time = the ``del`` of the release -> the ``set`` of the next
  acquisition;
- hard kill (SIGKILL): takeover = the leader's last renewal (its last ``expire``) -> the next
  ``set``, to compare with the lock expiry; leaderless time = the kill -> that ``set``.

From the journals: the old leader's last run -> the new leader's first run, the ticks lost in
between, and a check that no two runs overlapped and fencing tokens never went down.

Short settings (heartbeat 0.1 s, expiry 0.5 s) run their trials one after the other on one
cluster of three replicas, a fresh replica replacing each stopped one. Default settings (3 s,
10 s) run one two-replica cluster per trial, all at once, their signals staggered.

    python -m bench.failover replica --url redis://... --project p --node n1 --journal j.jsonl
    python -m bench.failover monitor --url redis://... --out events.txt
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench._common import (
    Child,
    Json,
    RedisServer,
    node_proc,
    now,
    redis_version,
    say,
    spawn,
    stats,
    stop_children,
)

JOB = "tick"
EVERY_S = 0.05
RUN_S = 0.01
SHUTDOWN_TIMEOUT_S = 1.0
SHORT = {"heartbeat_s": 0.1, "lock_expiry_s": 0.5}
DEFAULTS = {"heartbeat_s": 3.0, "lock_expiry_s": 10.0}
READY_TIMEOUT_S = 60.0
SETTLE_RUNS = 5
POLL_S = 0.01
STAGGER_S = 0.5
GRACEFUL_GOAL_P99_MS = 50.0
KILL_GOAL_SLACK_MS = 100.0


# -- the replica and the monitor ----------------------------------------------------------------


async def serve(args: argparse.Namespace) -> None:
    """One replica: tests/node_proc.py's, with this benchmark's settings."""
    await node_proc.serve(
        args.url,
        args.project,
        args.node,
        args.journal,
        heartbeat_s=args.heartbeat,
        lock_expiry_s=args.expiry,
        ready=Path(f"{args.journal}.ready"),
    )


def monitor(url: str, out: Path) -> None:
    """Journal the keyspace notifications of every lock key: ``<monotonic> <event> <key>``."""
    import redis

    client = redis.Redis.from_url(url, decode_responses=True)
    client.config_set("notify-keyspace-events", "Kgx$")
    pubsub = client.pubsub()  # type: ignore[no-untyped-call, unused-ignore]
    pubsub.psubscribe("__keyspace@0__:singletonjob:*:lock")
    while pubsub.get_message(timeout=5.0) is None:  # the subscription's confirmation
        pass
    with open(out, "a", buffering=1) as journal:
        say("ready")
        for message in pubsub.listen():  # type: ignore[no-untyped-call, unused-ignore]
            received = now()
            if message["type"] == "pmessage":
                key = message["channel"].split(":", 1)[1]
                journal.write(f"{received:.6f} {message['data']} {key}\n")


# -- clusters ---------------------------------------------------------------------------------


@dataclass
class Replica:
    node: str
    child: Child
    journal: Path
    killed_at: float | None = None

    @property
    def ready(self) -> bool:
        return Path(f"{self.journal}.ready").exists()

    @property
    def alive(self) -> bool:
        return self.child.proc.poll() is None


@dataclass
class Cluster:
    """The replicas of one project; replaced ones stay listed (their journals count)."""

    url: str
    project: str
    workdir: Path
    heartbeat_s: float
    expiry_s: float
    replicas: dict[str, Replica] = field(default_factory=dict)

    @property
    def lock_key(self) -> str:
        return f"singletonjob:{{{self.project}}}:{JOB}:lock"

    def add(self) -> Replica:
        node = f"{self.project}-n{len(self.replicas) + 1}"
        journal = self.workdir / f"{node}.jsonl"
        args = [
            "replica",
            *("--url", self.url, "--project", self.project, "--node", node),
            *("--journal", str(journal)),
            *("--heartbeat", str(self.heartbeat_s), "--expiry", str(self.expiry_s)),
        ]
        child = spawn(node, "bench.failover", args, self.workdir / f"{node}.log")
        self.replicas[node] = Replica(node, child, journal)
        return self.replicas[node]

    def live(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.alive and r.killed_at is None]

    def runs(self) -> list[node_proc.Run]:
        runs = []
        for replica in self.replicas.values():
            for run in node_proc.read_journal(replica.journal):
                if run.end is None and replica.killed_at is not None:
                    run.end = replica.killed_at
                runs.append(run)
        return sorted(runs, key=lambda r: r.start)

    def steady_leader(self) -> Replica | None:
        """The node that ran the last SETTLE_RUNS runs, the latest one recent; else None."""
        runs = self.runs()[-SETTLE_RUNS:]
        if len(runs) < SETTLE_RUNS or now() - runs[-1].start > 3 * EVERY_S:
            return None
        nodes = {run.node for run in runs}
        replica = self.replicas.get(runs[-1].node)
        if len(nodes) != 1 or replica is None or not replica.alive:
            return None
        return replica

    def children(self) -> list[Child]:
        return [r.child for r in self.replicas.values()]


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate()`` until true; raise after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"not true within {timeout_s:g} s: {what}")
        time.sleep(POLL_S)


def _all_ready(cluster: Cluster, count: int = 2) -> bool:
    live = cluster.live()
    return len(live) >= count and all(r.ready for r in live)


def _has_leader(cluster: Cluster) -> bool:
    return cluster.steady_leader() is not None


def read_events(path: Path, key: str) -> list[tuple[float, str]]:
    """The monitor's ``(time, event)`` pairs for one lock key, in arrival order."""
    events = []
    for line in path.read_text().splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[2] == key:
            events.append((float(parts[0]), parts[1]))
    return events


# -- one trial ----------------------------------------------------------------------------------


@dataclass
class Trial:
    cluster: Cluster
    kind: str  # "graceful" or "kill"
    old: Replica
    signalled_at: float = 0.0

    def fire(self) -> None:
        self.signalled_at = now()
        if self.kind == "kill":
            self.old.killed_at = self.signalled_at
            self.old.child.signal(signal.SIGKILL)
        else:
            self.old.child.signal(signal.SIGTERM)

    def successor(self) -> node_proc.Run | None:
        return next(
            (
                r
                for r in self.cluster.runs()
                if r.node != self.old.node and r.start > self.signalled_at
            ),
            None,
        )

    def measure(self, events_path: Path) -> Json:
        runs = self.cluster.runs()
        first = self.successor()
        last = max((r for r in runs if r.node == self.old.node), key=lambda r: r.start)
        assert first is not None
        events = read_events(events_path, self.cluster.lock_key)
        acquired_i = next(
            i for i, (t, e) in enumerate(events) if e == "set" and t >= self.signalled_at
        )
        acquired = events[acquired_i][0]
        result: Json = {
            "signal_to_acquire_ms": (acquired - self.signalled_at) * 1000,
            "last_to_first_run_ms": (first.start - last.start) * 1000,
            "last_end_to_first_run_ms": (first.start - last.ended_by(self.signalled_at)) * 1000,
            "ticks_lost": round((first.scheduled - last.scheduled) / EVERY_S) - 1,
            "token_increased": first.token > last.token,
        }
        if self.kind == "graceful":
            released = next(
                t for t, e in events[:acquired_i] if e == "del" and t >= self.signalled_at
            )
            result["leaderless_ms"] = (acquired - released) * 1000
            result["signal_to_release_ms"] = (released - self.signalled_at) * 1000
        else:
            renewed = max(t for t, e in events[:acquired_i] if e == "expire")
            result["leaderless_ms"] = (acquired - self.signalled_at) * 1000
            result["renewal_to_acquire_ms"] = (acquired - renewed) * 1000
            result["renewal_to_kill_ms"] = (self.signalled_at - renewed) * 1000
        window = [r for r in runs if last.start - 1.0 <= r.start <= first.start + 1.0]
        result["max_concurrent"] = node_proc.max_concurrent(window)
        result["tokens_in_order"] = node_proc.tokens_in_order(window)
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}

    def done(self) -> bool:
        return self.successor() is not None and not self.old.alive


# -- the parent ---------------------------------------------------------------------------------


def _start_monitor(url: str, workdir: Path, children: list[Child]) -> Path:
    events = workdir / "keyspace-events.txt"
    args = ["monitor", "--url", url, "--out", str(events)]
    child = spawn("monitor", "bench.failover", args, workdir / "monitor.log")
    children.append(child)
    child.expect("ready")
    return events


def sequential_trials(
    url: str, workdir: Path, events: Path, kinds: list[str], children: list[Child]
) -> dict[str, list[Json]]:
    """Short settings: one cluster of three replicas, trials one after the other."""
    cluster = Cluster(url, "fo-short", workdir, SHORT["heartbeat_s"], SHORT["lock_expiry_s"])
    results: dict[str, list[Json]] = {"graceful": [], "kill": []}
    try:
        for _ in range(3):
            cluster.add()
        for kind in kinds:
            wait_for(functools.partial(_all_ready, cluster, 3), READY_TIMEOUT_S, "3 replicas")
            wait_for(functools.partial(_has_leader, cluster), 10.0, "a steady leader")
            leader = cluster.steady_leader()
            assert leader is not None
            trial = Trial(cluster, kind, leader)
            trial.fire()
            timeout = 5.0 + (cluster.expiry_s if kind == "kill" else 0.0)
            try:
                wait_for(trial.done, timeout, f"{kind} takeover")
                time.sleep(0.05)  # let the monitor journal the acquisition
                results[kind].append(trial.measure(events))
            except Exception as exc:  # one odd trial must not void the others: count it
                results[kind].append({"error": f"{type(exc).__name__}: {exc}"})
                leader.child.proc.kill()
            cluster.add()  # replaces the stopped replica
    finally:
        children += cluster.children()
    return results


def parallel_trials(
    url: str, workdir: Path, events: Path, kinds: list[str], children: list[Child]
) -> dict[str, list[Json]]:
    """Default settings: one two-replica cluster per trial, all at once, staggered."""
    clusters = [
        Cluster(url, f"fo-default-{i}", workdir, DEFAULTS["heartbeat_s"], DEFAULTS["lock_expiry_s"])
        for i in range(len(kinds))
    ]
    try:
        for cluster in clusters:
            cluster.add()
            cluster.add()
        for cluster in clusters:
            wait_for(functools.partial(_all_ready, cluster), READY_TIMEOUT_S, "ready replicas")
        trials = []
        for cluster, kind in zip(clusters, kinds, strict=True):
            wait_for(functools.partial(_has_leader, cluster), 10.0, "a steady leader")
            leader = cluster.steady_leader()
            assert leader is not None
            trials.append(Trial(cluster, kind, leader))
        for trial in trials:
            trial.fire()
            time.sleep(STAGGER_S)
        timeout = DEFAULTS["lock_expiry_s"] + 10.0
        try:
            wait_for(lambda: all(t.done() for t in trials), timeout, "every takeover")
        except RuntimeError:
            pass  # the trials without a takeover are recorded as failed below
        time.sleep(0.05)
        results: dict[str, list[Json]] = {"graceful": [], "kill": []}
        for trial in trials:
            try:
                results[trial.kind].append(trial.measure(events))
            except Exception as exc:
                results[trial.kind].append({"error": f"{type(exc).__name__}: {exc}"})
        return results
    finally:
        for cluster in clusters:
            children += cluster.children()


COMMON_KEYS = ("signal_to_acquire_ms", "last_to_first_run_ms", "last_end_to_first_run_ms")
KIND_KEYS = {
    "graceful": ("leaderless_ms", "signal_to_release_ms"),
    "kill": ("leaderless_ms", "renewal_to_acquire_ms", "renewal_to_kill_ms"),
}


def _summary(all_trials: list[Json], settings: dict[str, float], kind: str) -> Json:
    trials = [t for t in all_trials if "error" not in t]
    keys = [*COMMON_KEYS, *KIND_KEYS[kind]]
    summary: Json = {
        "trials": len(trials),
        "failed_trials": [t["error"] for t in all_trials if "error" in t],
        **{key: stats([t[key] for t in trials]) for key in keys},
        "ticks_lost": stats([float(t["ticks_lost"]) for t in trials], digits=1),
        "overlapping_runs": sum(1 for t in trials if t["max_concurrent"] > 1),
        "token_violations": sum(
            1 for t in trials if not (t["tokens_in_order"] and t["token_increased"])
        ),
        "raw": all_trials,
    }
    heartbeat_ms = settings["heartbeat_s"] * 1000
    expiry_ms = settings["lock_expiry_s"] * 1000
    summary["dotnet_design_bound_ms"] = (
        heartbeat_ms if kind == "graceful" else expiry_ms + heartbeat_ms
    )
    return summary


def run(quick: bool, workdir: Path) -> Json:
    """All failover trials on one dedicated redis-server."""
    short_n = 3 if quick else 20
    default_graceful, default_kill = (3, 3) if quick else (5, 4)
    started = time.monotonic()
    children: list[Child] = []
    server = RedisServer.start(data_dir=workdir / "redis-failover")
    try:
        events = _start_monitor(server.url, workdir, children)
        kinds = ["graceful", "kill"] * short_n
        short = sequential_trials(server.url, workdir, events, kinds, children)
        stop_children(children[1:])
        default_kinds = ["graceful"] * default_graceful + ["kill"] * default_kill
        defaults = parallel_trials(server.url, workdir, events, default_kinds, children)
        version = redis_version(server)
    finally:
        stop_children(children)
        server.close()
    result: Json = {
        "settings": {
            "short": SHORT,
            "defaults": DEFAULTS,
            "job_every_s": EVERY_S,
            "run_s": RUN_S,
            "replicas_short": 3,
            "replicas_defaults": 2,
            "stagger_s": STAGGER_S,
            "redis_server": version,
            "goal_graceful_p99_ms": GRACEFUL_GOAL_P99_MS,
            "goal_kill_slack_ms": KILL_GOAL_SLACK_MS,
        },
        "short": {kind: _summary(trials, SHORT, kind) for kind, trials in short.items()},
        "defaults": {kind: _summary(trials, DEFAULTS, kind) for kind, trials in defaults.items()},
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point of a replica or of the keyspace monitor."""
    parser = argparse.ArgumentParser(description="failover replica or keyspace monitor")
    parser.add_argument("role", choices=["replica", "monitor"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--project")
    parser.add_argument("--node")
    parser.add_argument("--journal", type=Path)
    parser.add_argument("--heartbeat", type=float, default=SHORT["heartbeat_s"])
    parser.add_argument("--expiry", type=float, default=SHORT["lock_expiry_s"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.role == "monitor":
        monitor(args.url, args.out)
        return 0
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(created).6f {args.node} %(name)s %(levelname)s %(message)s",
    )
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
