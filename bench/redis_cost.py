"""Redis cost: round trips per replica as the number of jobs grows, and bytes per job.

Two replicas (a leader and a follower, two ``SingletonJobs`` in this process, each with its own
connection pool) elect 1, 10, 100 and 1,000 fixed-rate jobs (every hour, so no run happens
while measuring) on a dedicated redis-server. ``INFO commandstats`` and ``INFO stats`` deltas
over a window give, per replica: the commands it sends (round trips), the commands its scripts
run on the server, the server time per election round and the bytes per round. The leader is
measured alone first, then with the follower; the follower's share is the difference. Both use
``placement="first"``, so that one replica leads every job and the other follows all of them.
``MEMORY USAGE`` of a job's lock and fence keys gives the bytes per job.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from bench._common import Json, RedisServer, percentile, redis_version

JOB_COUNTS = (1, 10, 100, 1000)
HEARTBEAT_S = 0.25
LOCK_EXPIRY_S = 1.0
DEFAULT_HEARTBEAT_S = 3.0
SCRIPT_COMMANDS = {"get", "set", "pexpire", "pttl", "time", "del", "publish"} | {
    # ELECT's membership, placement and controls
    "hlen",
    "hget",
    "hgetall",
    "hexists",
    "hset",
    "hsetnx",
    "hdel",
    "hincrby",
    "zadd",
    "zrangebyscore",
    "zremrangebyscore",
    # the overdue check (OVERDUE, one call per lock expiry): its checkpoint fields
    "hmget",
}
OWN_COMMANDS = ("info", "config", "memory", "flushall", "dbsize")


def _classify(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per command: calls and server µs between two ``INFO commandstats`` snapshots."""
    delta: dict[str, dict[str, float]] = {}
    for key, stat in after.items():
        name = key.removeprefix("cmdstat_")
        if name.startswith(OWN_COMMANDS):
            continue
        old = before.get(key, {"calls": 0, "usec": 0})
        calls = stat["calls"] - old["calls"]
        if calls:
            delta[name] = {"calls": calls, "usec": stat["usec"] - old["usec"]}
    return delta


async def _snapshot(client: aioredis.Redis) -> tuple[dict[str, Any], dict[str, Any], float]:
    commands = await client.info("commandstats")
    net = await client.info("stats")
    return commands, net, time.monotonic()


async def _window(client: aioredis.Redis, seconds: float, jobs: list[Any]) -> Json:
    """Deltas over ``seconds``, with the election round trips the replicas saw meanwhile."""
    rtts: list[float] = []
    c0, n0, t0 = await _snapshot(client)
    while time.monotonic() - t0 < seconds:
        await asyncio.sleep(0.02)
        for sj in jobs:
            rtt = sj.engine.elector.round_trip_s
            if rtt is not None:
                rtts.append(rtt)
    c1, n1, t1 = await _snapshot(client)
    delta = _classify(c0, c1)
    return {
        "elapsed_s": t1 - t0,
        "commands": delta,
        "net_in": n1["total_net_input_bytes"] - n0["total_net_input_bytes"],
        "net_out": n1["total_net_output_bytes"] - n0["total_net_output_bytes"],
        "rtt_ms": percentile(rtts, 50) * 1000 if rtts else None,
    }


def _per_replica(window: Json, minus: Json | None = None) -> Json:
    """Rates of one replica from a window (less another window's, per second)."""

    def rates(w: Json) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, stat in w["commands"].items():
            out[name] = stat["calls"] / w["elapsed_s"]
            out[f"{name}.usec"] = stat["usec"] / w["elapsed_s"]
        out["net_in"] = w["net_in"] / w["elapsed_s"]
        out["net_out"] = w["net_out"] / w["elapsed_s"]
        return out

    rate = rates(window)
    if minus is not None:
        base = rates(minus)
        rate = {k: v - base.get(k, 0.0) for k, v in rate.items()}
    sent = {k: v for k, v in rate.items() if "." not in k and k not in SCRIPT_COMMANDS}
    sent.pop("net_in", None)
    sent.pop("net_out", None)
    inside = sum(v for k, v in rate.items() if k in SCRIPT_COMMANDS)
    rounds = rate.get("evalsha", 0.0)
    per_round = (lambda v: v / rounds) if rounds else (lambda v: float("nan"))
    client_cmds = sum(sent.values())
    return {
        "round_trips_per_s": round(client_cmds, 2),
        "elect_rounds_per_s": round(rounds, 2),
        "round_trips_per_round": round(per_round(client_cmds), 3),
        "round_trips_per_s_at_default_heartbeat": round(
            per_round(client_cmds) / DEFAULT_HEARTBEAT_S, 3
        ),
        "commands_sent": {k: round(v, 2) for k, v in sorted(sent.items())},
        "script_commands_per_round": round(per_round(inside), 1),
        "server_us_per_round": round(per_round(rate.get("evalsha.usec", 0.0)), 1),
        "bytes_in_per_round": round(per_round(rate["net_in"])),
        "bytes_out_per_round": round(per_round(rate["net_out"])),
    }


async def _wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"not true within {timeout_s:g} s: {what}")
        await asyncio.sleep(0.01)


def _replica(url: str, project: str, node: str | None, count: int) -> Any:
    from fastapi_singletonjob import SingletonJobs

    sj = SingletonJobs(
        redis_url=url,
        project=project,
        node_id=node,
        heartbeat_interval=HEARTBEAT_S,
        lock_expiry=LOCK_EXPIRY_S,
        placement="first",  # one leader of every job, one follower: the two roles' costs
    )

    async def job() -> None:
        pass

    for i in range(count):
        sj.fixed_rate(f"job-{i:04d}", every=3600.0)(job)
    return sj


async def _measure(url: str, count: int, window_s: float) -> Json:
    client = aioredis.Redis.from_url(url, decode_responses=True)
    project = f"cost-{count}"
    leader = _replica(url, project, None, count)  # default node id: realistic key sizes
    follower = _replica(url, project, "follower-node", count)
    try:
        await client.flushall()
        used0 = (await client.info("memory"))["used_memory"]
        await leader.start()
        await _wait(
            lambda: all(x.token is not None for x in leader.engine.elector.leases.values()),
            10.0,
            "the leader holds every job",
        )
        await asyncio.sleep(0.3)
        alone = await _window(client, window_s, [leader])
        used1 = (await client.info("memory"))["used_memory"]
        await follower.start()
        await _wait(
            lambda: follower.engine.elector.last_success_at is not None, 10.0, "a follower round"
        )
        await asyncio.sleep(0.3)
        both = await _window(client, window_s, [leader, follower])
        sample = [f"job-{i:04d}" for i in range(0, count, max(1, count // 10))]
        lock_bytes: list[float] = []
        fence_bytes: list[float] = []
        lock_len: list[float] = []
        for job in sample:
            lock = f"singletonjob:{{{project}}}:{job}:lock"
            fence = f"singletonjob:{{{project}}}:{job}:fence"
            lock_bytes.append(await client.memory_usage(lock) or 0)
            fence_bytes.append(await client.memory_usage(fence) or 0)
            lock_len.append(await client.strlen(lock))
    finally:
        await follower.stop()
        await leader.stop()
        await client.aclose()
    return {
        "jobs": count,
        "leader": {**_per_replica(alone), "rtt_ms": _round(alone["rtt_ms"])},
        "follower": _per_replica(both, minus=alone),
        "rtt_ms_both": _round(both["rtt_ms"]),
        "lock_bytes": percentile(lock_bytes, 50),
        "fence_bytes": percentile(fence_bytes, 50),
        "lock_value_chars": percentile(lock_len, 50),
        "used_memory_per_job": round((used1 - used0) / count, 1),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def run(quick: bool, workdir: Path) -> Json:
    """Measure every job count on one dedicated server."""
    window_s = 1.0 if quick else 3.0
    started = time.monotonic()
    with RedisServer.start(data_dir=workdir / "redis-cost") as server:
        version = redis_version(server)
        results = [asyncio.run(_measure(server.url, n, window_s)) for n in JOB_COUNTS]
    return {
        "settings": {
            "heartbeat_s": HEARTBEAT_S,
            "lock_expiry_s": LOCK_EXPIRY_S,
            "default_heartbeat_s": DEFAULT_HEARTBEAT_S,
            "window_s": window_s,
            "redis_server": version,
        },
        "results": results,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
