"""Scale: many replicas and many jobs on one Redis, through a cold start and a Redis outage.

Each replica is a small process with one ``SingletonJobs`` (default settings: heartbeat 3 s,
lock expiry 10 s, max backoff 30 s) and the same interval jobs (every hour: nothing runs after
each job's first run). All replicas start their lifespans at one "go" from the parent. The
parent reads every lock key: a job is elected when its lock exists, and the lock's token is the
Redis server time in µs at the grant, so "every job elected" is timed on the server's clock.
Then Redis is killed, left down, and restarted empty on the same port; each replica reports
when its first election round after the outage went through (its retry), and the parent times
the re-election of every job again.

    python -m bench.scale replica --url redis://... --project p --node n1 --jobs 1000 \\
        --events n1.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from bench._common import (
    Child,
    Json,
    RedisServer,
    percentile,
    redis_version,
    say,
    spawn,
    stats,
    stop_children,
)

POLL_S = 0.02
HEARTBEAT_S = 3.0  # the default, which the replicas use
LOCK_EXPIRY_S = 10.0  # the default
JOB_EVERY_S = 3600.0


# -- the replica ------------------------------------------------------------------------------


async def serve(args: argparse.Namespace, out: TextIO) -> None:
    """One replica: wait for "go", start, report the election's state changes, stop on TERM."""
    from fastapi_singletonjob import SingletonJobs

    jobs = SingletonJobs(redis_url=args.url, project=args.project, node_id=args.node)

    async def job() -> None:
        pass

    for i in range(args.jobs):
        jobs.interval(f"job-{i:04d}", every=JOB_EVERY_S)(job)

    def emit(event: str, t: float, **extra: Any) -> None:
        out.write(json.dumps({"event": event, "t": t, **extra}) + "\n")

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    say("ready")
    await loop.run_in_executor(None, sys.stdin.readline)
    emit("go", time.time())
    await jobs.start()
    watcher = asyncio.ensure_future(_watch(jobs, emit))
    await stopping.wait()
    watcher.cancel()
    await jobs.stop()


async def _watch(jobs: Any, emit: Any) -> None:
    """Poll the elector; report each successful round (when it was sent), the first failure
    of a run of failures, and the jobs whose leases it holds."""
    elector = jobs.engine.elector
    clock = jobs.clock
    last_ok = None
    failing = False
    held: list[str] = []
    while True:
        offset = time.time() - clock.monotonic()  # this replica's monotonic -> wall time
        if elector.last_success_at is not None and elector.last_success_at != last_ok:
            last_ok = elector.last_success_at
            emit("ok", last_ok + offset)
        if elector.failures and not failing:
            failing = True
            emit("down", time.time())
        elif not elector.failures:
            failing = False
        now_held = sorted(job for job, lease in elector.leases.items() if lease.token is not None)
        if now_held != held:
            held = now_held
            emit("held", time.time(), jobs=held)
        await asyncio.sleep(POLL_S)


# -- the parent -------------------------------------------------------------------------------


def _read_events(path: Path) -> list[Json]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _locks(server: RedisServer, project: str, jobs: int) -> list[str | None]:
    keys = [f"singletonjob:{{{project}}}:job-{i:04d}:lock" for i in range(jobs)]
    with server.client(socket_timeout=10.0) as client:
        values: list[str | None] = client.mget(keys)
    return values


def _wait_elected(server: RedisServer, project: str, jobs: int, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            values = _locks(server, project, jobs)
        except Exception:  # a server still starting: try again
            values = [None]
        if all(v is not None for v in values):
            return [v for v in values if v is not None]
        if time.monotonic() > deadline:
            missing = sum(1 for v in values if v is None)
            raise RuntimeError(f"{missing} of {jobs} jobs still without a leader")
        time.sleep(0.01)


def _wait_settled(
    server: RedisServer,
    project: str,
    jobs: int,
    *,
    not_before: float,
    stable_s: float,
    timeout_s: float,
) -> tuple[float | None, dict[str, int]]:
    """Wait until every job has a leader and no leader changed for ``stable_s``, counted from
    ``not_before`` (monotonic) at the earliest (placement moves over); the seconds that took
    (None: not within ``timeout_s``) and the jobs per leader at the end."""
    started = time.monotonic()
    last: list[str | None] = []
    since = started
    while True:
        values = [v.rpartition("|")[2] if v else None for v in _locks(server, project, jobs)]
        now = time.monotonic()
        if values != last or None in values or now < not_before:
            last, since = values, now
        elif now - since >= stable_s:
            return round(since - started, 2), _tokens([f"0|{v}" for v in values if v])[1]
        if now - started > timeout_s:
            return None, _tokens([f"0|{v}" for v in values if v])[1]
        time.sleep(0.2)


def _tokens(values: list[str]) -> tuple[list[float], dict[str, int]]:
    """Grant times (server wall time, s) and jobs per leader node."""
    times: list[float] = []
    leaders: dict[str, int] = {}
    for value in values:
        token, _, owner = value.partition("|")
        times.append(int(token) / 1e6)
        node = owner.rpartition("#")[0]
        leaders[node] = leaders.get(node, 0) + 1
    return times, leaders


def _spread(leaders: dict[str, int], replicas: int) -> Json:
    """How many jobs each replica leads: min, p50, max (replicas leading none count)."""
    counts = [leaders.get(f"r{i:02d}", 0) for i in range(replicas)]
    return {"min": min(counts), "p50": percentile(counts, 50), "max": max(counts)}


def _overlap_s(events: dict[str, list[Json]], since: float) -> float:
    """Longest time after ``since`` during which two or more replicas held the lease of the
    same job (as each replica's own view said)."""
    changes = sorted(
        (e["t"], node, frozenset(e["jobs"]))
        for node, rows in events.items()
        for e in rows
        if e["event"] == "held"
    )
    holding: dict[str, frozenset[str]] = {}
    holders: dict[str, int] = {}
    began: dict[str, float] = {}
    longest = 0.0
    for t, node, jobs in changes:
        before = holding.get(node, frozenset())
        holding[node] = jobs
        for job in jobs - before:
            holders[job] = holders.get(job, 0) + 1
            if holders[job] == 2:
                began[job] = t
        for job in before - jobs:
            holders[job] -= 1
            if holders[job] == 1 and t > since:
                longest = max(longest, t - max(began.pop(job), since))
    return longest


def _steady(server: RedisServer, seconds: float) -> Json:
    """Election rounds per second, server CPU, how bunched the rounds are in time, and the
    latency another client's PING sees meanwhile."""
    samples: list[tuple[float, int, int]] = []
    pings: list[float] = []
    with server.client() as client:
        # Every script's own duration, from the slow log: what another client can wait
        # behind at most, without this process's scheduling in it (the PING's is).
        client.config_set("slowlog-max-len", 100_000)
        client.config_set("slowlog-log-slower-than", 0)
        client.slowlog_reset()
        cpu0 = client.info("cpu")
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            sent = time.perf_counter()
            client.ping()
            pings.append((time.perf_counter() - sent) * 1000)
            stat = client.info("commandstats").get("cmdstat_evalsha", {"calls": 0, "usec": 0})
            samples.append((time.monotonic(), int(stat["calls"]), int(stat["usec"])))
            time.sleep(0.01)
        cpu1 = client.info("cpu")
        client.config_set("slowlog-log-slower-than", -1)
        logged = client.slowlog_get(100_000)
        scripts = [
            entry["duration"] / 1000
            for entry in logged
            if entry["command"][:7].upper() in (b"EVALSHA", "EVALSHA")
        ]
        slowest = max(logged, key=lambda entry: entry["duration"], default=None)
    elapsed = samples[-1][0] - samples[0][0]
    calls = samples[-1][1] - samples[0][1]
    usec = samples[-1][2] - samples[0][2]
    busiest = 0
    for i, (t, c, _) in enumerate(samples):
        j = i
        while j + 1 < len(samples) and samples[j + 1][0] - t <= 0.1:
            j += 1
        busiest = max(busiest, samples[j][1] - c)
    cpu = sum(cpu1[k] - cpu0[k] for k in ("used_cpu_sys", "used_cpu_user"))
    return {
        "window_s": round(elapsed, 2),
        "elect_rounds_per_s": round(calls / elapsed, 2),
        "server_script_ms_per_s": round(usec / elapsed / 1000, 2),
        "server_us_per_round": round(usec / calls, 1) if calls else None,
        "server_cpu_percent": round(100 * cpu / elapsed, 1),
        # Of one heartbeat's rounds, the share that came within the busiest 100 ms: about
        # 0.1 s / heartbeat if spread evenly, 1.0 if every replica renews at the same moment.
        "busiest_100ms_share": round(busiest / (calls / elapsed * HEARTBEAT_S), 3)
        if calls
        else None,
        "ping_ms": stats(pings, digits=2),
        "script_ms": stats(scripts, digits=2),
        "slowest_command": None
        if slowest is None
        else [str(slowest["command"])[:40], slowest["duration"] / 1000],
    }


def run(quick: bool, workdir: Path) -> Json:
    """Cold start and Redis outage with ``replicas`` processes of ``jobs`` jobs each."""
    replicas, jobs = (10, 100) if quick else (50, 1000)
    outage_s = 4.0 if quick else 5.0  # longer than a heartbeat: every replica notices
    reconnect_wait_s = 16.0 if quick else 45.0
    project = "scale"
    started = time.monotonic()
    children: list[Child] = []
    server = RedisServer.start(data_dir=workdir / "redis-scale")
    events_paths = {f"r{i:02d}": workdir / f"scale-r{i:02d}.jsonl" for i in range(replicas)}
    try:
        version = redis_version(server)
        for node, path in events_paths.items():
            args = [
                "replica",
                *("--url", server.url, "--project", project, "--node", node),
                *("--jobs", str(jobs), "--events", str(path)),
            ]
            children.append(spawn(node, "bench.scale", args, workdir / f"scale-{node}.log"))
        t_spawn = time.monotonic()
        for child in children:
            child.expect("ready")
        startup_s = time.monotonic() - t_spawn

        # Cold start.
        t_go = time.time()
        for child in children:
            child.send("go")
        values = _wait_elected(server, project, jobs, 60.0)
        grants, leaders = _tokens(values)
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            events = {n: _read_events(p) for n, p in events_paths.items()}
            if all(any(e["event"] == "ok" for e in rows) for rows in events.values()):
                break
            time.sleep(0.05)
        first_rounds = [
            next(e["t"] for e in rows if e["event"] == "ok") - t_go
            for rows in events.values()
            if any(e["event"] == "ok" for e in rows)
        ]
        cold = {
            "jobs_per_replica": _spread(leaders, replicas),
            "all_elected_s": round(max(grants) - t_go, 4),
            "first_elected_s": round(min(grants) - t_go, 4),
            "every_replica_first_round_s": stats(first_rounds, digits=4),
            "leaders": dict(sorted(leaders.items())),
        }

        # Steady state, once placement moves are over: what the whole cluster costs Redis,
        # and when its rounds arrive.
        # Newcomers are preferred once they kept their membership for a lock expiry; the
        # moves come after that.
        since_go_s = time.time() - t_go
        settled_s, leaders_settled = _wait_settled(
            server,
            project,
            jobs,
            not_before=time.monotonic() - since_go_s + LOCK_EXPIRY_S + HEARTBEAT_S,
            stable_s=2 * HEARTBEAT_S,
            timeout_s=180.0,
        )
        # The PINGs measure how long Redis keeps another client waiting. With 50 replica
        # processes on a small machine, Redis's and this process's own waits for a CPU would
        # count too, which a Redis on a machine of its own does not have: both run under the
        # real-time scheduler for the window where allowed (as root; both mostly sleep).
        with server.client() as client:
            pids = [os.getpid(), int(client.info("server")["process_id"])]
        try:
            for pid in pids:
                os.sched_setscheduler(pid, os.SCHED_FIFO, os.sched_param(10))
            realtime = True
        except PermissionError:
            realtime = False
        try:
            steady = _steady(server, 3.0 if quick else 6.0)
        finally:
            for pid in pids:
                with contextlib.suppress(PermissionError, ProcessLookupError):
                    os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
        steady["realtime_priority"] = realtime
        steady["settled_after_go_s"] = None if settled_s is None else since_go_s + settled_s
        steady["jobs_per_replica"] = _spread(leaders_settled, replicas)

        # Outage: kill, wait, restart empty.
        t_kill = time.time()
        server.kill()
        time.sleep(outage_s)
        t_restart = time.time()
        server.restart()
        t_up = time.time()
        values = _wait_elected(server, project, jobs, reconnect_wait_s)
        grants_after, leaders_after = _tokens(values)
        deadline = time.monotonic() + reconnect_wait_s
        reconnects: dict[str, float] = {}
        while time.monotonic() < deadline and len(reconnects) < replicas:
            for node, path in events_paths.items():
                # The first round sent after the restart began that went through.
                ups = [
                    e["t"] for e in _read_events(path) if e["event"] == "ok" and e["t"] > t_restart
                ]
                if ups and node not in reconnects:
                    reconnects[node] = ups[0] - t_up
            time.sleep(0.1)
        events = {n: _read_events(p) for n, p in events_paths.items()}
        delays = sorted(reconnects.values())
        outage = {
            "outage_s": round(t_restart - t_kill, 3),
            "restart_to_up_s": round(t_up - t_restart, 3),
            "all_elected_s": round(max(grants_after) - t_up, 4),
            "first_elected_s": round(min(grants_after) - t_up, 4),
            "leaders": dict(sorted(leaders_after.items())),
            "reconnect_s": [round(x, 3) for x in delays],
            "reconnect_stats_s": stats(delays, digits=3),
            "never_noticed": sum(
                1
                for rows in events.values()
                if not any(e["event"] == "down" and e["t"] > t_kill for e in rows)
            ),
            "not_reconnected": replicas - len(reconnects),
            "dual_leader_s": round(_overlap_s(events, t_up), 3),
        }
    finally:
        stop_children(children, timeout_s=20.0)
        server.close()
    return {
        "settings": {
            "replicas": replicas,
            "jobs": jobs,
            "heartbeat_s": 3.0,
            "lock_expiry_s": 10.0,
            "max_backoff_s": 30.0,
            "outage_s": outage_s,
            "watch_poll_s": POLL_S,
            "redis_server": version,
        },
        "process_startup_s": round(startup_s, 2),
        "cold_start": cold,
        "steady": steady,
        "outage": outage,
        "reconnect_p50_s": round(percentile(delays, 50), 3) if delays else None,
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of a replica process."""
    parser = argparse.ArgumentParser(description="scale replica")
    parser.add_argument("role", choices=["replica"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--project", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--jobs", type=int, required=True)
    parser.add_argument("--events", type=Path, required=True)
    args = parser.parse_args(argv)
    with open(args.events, "a", buffering=1) as out:
        asyncio.run(serve(args, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
