"""Checkpoints: the Redis commands a checkpoint costs per run, and the tick lateness with and
without it.

Commands per run: one replica (a ``SingletonJobs`` in this process, alone, so it leads) runs
one job every ``EVERY_S`` with an empty body, ``fixed_rate`` or ``interval``, on a dedicated
redis-server, in four variants: ``checkpoint=False``, ``checkpoint=True`` (the default),
and the default plus one ``ctx.save_state`` per run (of a small cursor, or of a state near the
64 KiB limit). ``INFO commandstats`` and ``INFO stats`` are read while run ``FIRST_RUN`` waits
at the start of its body, and again while run ``FIRST_RUN + runs`` does: the deltas hold
exactly the ``runs`` whole runs between, and nothing polls meanwhile. The window is shorter
than the heartbeat (``HEARTBEAT_S``), so it holds one election round at most; one that does is
counted and its ``EVALSHA`` taken off. Commands the client sends are told from those the
scripts run inside Redis by name: ``EVALSHA`` and the rest are sent, ``SCRIPT_COMMANDS`` run
inside (a term's one ``HGETALL`` read is sent, but it comes before the window). The term's
start is measured too, from before ``start()`` to the second run's body: the ``HGETALL`` sent
in that phase are the term's read of the record. *Outside the body*
is the library's duration of a run (to its body's return; the record goes after it) less the
body's own;
*CPU per run* is this process's CPU time (``time.process_time``) over the window, divided by
its runs.

Lateness: ``bench.precision`` children (``REDIS_SCHEDULERS``: the library on this family's
redis-server, checkpoint on and off, a project each) tick every 10 and 100 ms, alone and
beside 100 jobs every 500 ms, all at the same time on shifted instants, as in the precision
family; with checkpoints every one of those jobs writes its record after each run.

    python -m bench --only checkpoints [--quick]
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from bench import precision
from bench._common import Json, RedisServer, log, optional, percentile, redis_version
from bench.redis_cost import _classify

KINDS = ("fixed_rate", "interval")
VARIANTS = ("off", "on", "save_state", "save_state_large")
"""``checkpoint=False``; ``checkpoint=True``; ``checkpoint=True`` and one ``save_state`` of
``STATE`` per run, or of ``LARGE_STATE``."""
EVERY_S = 0.1
HEARTBEAT_S = 10.0
LOCK_EXPIRY_S = 30.0
SCRIPT_COMMANDS = frozenset(
    {"get", "set", "pexpire", "pttl", "time", "del", "publish"}  # ELECT, CLAIM, RELEASE
    | {"hlen", "hexists", "zadd", "zrangebyscore"}  # ELECT: controls and membership
    | {"type", "hget", "hmget", "hincrby", "hset", "hdel"}  # RECORD_RUN, SAVE_STATE
    | {"hlen", "hexists", "hsetnx", "zadd", "zrangebyscore", "zremrangebyscore"}  # ELECT
)
"""Commands that only the library's scripts run (inside Redis); ``HGETALL`` is the read at a
term's first run, which comes before the window."""
OWN_COMMANDS = ("info", "flushall")
STATE = {"after_id": 123456789, "page": "2026-11-30T16:41:37Z"}
"""The state saved per run in the ``save_state`` variant: a typical cursor."""
LARGE_STATE = {"ids": list(range(100_000, 109_000))}
"""The state of the ``save_state_large`` variant: 63 kB of JSON, near the 64 KiB default
limit (every ``RECORD_RUN`` returns the whole record, state included)."""
LATENESS_PERIODS = ((0.01,), (0.1,))
FIRST_RUN = 4
"""The window of the commands per run starts at this run (the term's start is before it)."""


async def _stats(client: aioredis.Redis) -> tuple[dict[str, Any], dict[str, Any]]:
    return await client.info("commandstats"), await client.info("stats")


def _delta(
    before: tuple[dict[str, Any], dict[str, Any]], after: tuple[dict[str, Any], dict[str, Any]]
) -> Json:
    commands = {
        name: stat
        for name, stat in _classify(before[0], after[0]).items()
        if not name.startswith(OWN_COMMANDS)
    }
    return {
        "commands": commands,
        "net_in": after[1]["total_net_input_bytes"] - before[1]["total_net_input_bytes"],
        "net_out": after[1]["total_net_output_bytes"] - before[1]["total_net_output_bytes"],
    }


async def _reached(gate: tuple[asyncio.Event, asyncio.Event], what: str) -> None:
    try:
        await asyncio.wait_for(gate[0].wait(), 30.0)
    except TimeoutError:
        raise RuntimeError(f"not within 30 s: {what}") from None


async def _measure(url: str, kind: str, variant: str, runs: int) -> Json:
    """One variant: the term's start, then ``runs`` whole runs."""
    from fastapi_singletonjob import JobContext, SingletonJobs

    assert runs * EVERY_S < HEARTBEAT_S - 1, "the window must hold one election round at most"
    client = aioredis.Redis.from_url(url, decode_responses=True)
    name = "measured"
    sj = SingletonJobs(
        redis_url=url,
        project=f"bench-checkpoint-{kind}-{variant}",
        heartbeat_interval=HEARTBEAT_S,
        lock_expiry=LOCK_EXPIRY_S,
    )
    body_s: dict[int, float] = {}
    outside_s: list[float] = []
    save_s: list[float] = []
    save = variant.startswith("save_state")
    state = LARGE_STATE if variant == "save_state_large" else STATE
    # Run n's body waits at its gate, if it has one, until the counters are read: they then
    # hold every command of the runs before n and none of n's.
    gates: dict[int, tuple[asyncio.Event, asyncio.Event]] = {
        n: (asyncio.Event(), asyncio.Event()) for n in (2, FIRST_RUN, FIRST_RUN + runs)
    }
    count = 0

    async def job(ctx: JobContext) -> None:
        nonlocal count
        count += 1
        n = count
        if n in gates:
            gates[n][0].set()
            await gates[n][1].wait()
        began = time.perf_counter()
        last = sj.engine.runners[name].stats.last_run if sj.engine else None
        if last is not None and n - 1 in body_s and n - 1 not in gates:  # recorded by now
            outside_s.append(last.duration_s - body_s[n - 1])
        if save:
            await ctx.save_state(state)
            save_s.append(time.perf_counter() - began)
        body_s[n] = time.perf_counter() - began

    decorate = sj.fixed_rate if kind == "fixed_rate" else sj.interval
    decorate(name, every=EVERY_S, checkpoint=variant != "off")(job)
    try:
        await client.flushall()
        start0 = await _stats(client)
        await sj.start()
        assert sj.engine is not None
        elector = sj.engine.elector
        await _reached(gates[2], "the second run")
        start1 = await _stats(client)
        gates[2][1].set()
        await _reached(gates[FIRST_RUN], f"run {FIRST_RUN}")
        before, round0 = await _stats(client), elector.last_round_at
        cpu0 = time.process_time()
        gates[FIRST_RUN][1].set()
        await _reached(gates[FIRST_RUN + runs], f"run {FIRST_RUN + runs}")
        cpu_s = time.process_time() - cpu0
        after, rounds = await _stats(client), int(elector.last_round_at != round0)
        gates[FIRST_RUN + runs][1].set()
    finally:
        for _, go in gates.values():
            go.set()
        await sj.stop()
        await client.aclose()
    window = _delta(before, after)
    start = _delta(start0, start1)
    return {
        "kind": kind,
        "variant": variant,
        "runs": runs,
        "elect_rounds": rounds,
        **_per_run(window, runs, rounds),
        "term_start": {
            "runs": 1,
            "hgetall_sent": start["commands"].get("hgetall", {}).get("calls", 0),
            "commands": start["commands"],
        },
        "cpu_us_per_run": round(cpu_s / runs * 1e6, 1),
        "outside_body_ms": _ms(outside_s),
        "save_state_ms": _ms(save_s) if save else None,
    }


def _per_run(window: Json, runs: int, rounds: int) -> Json:
    """Per-run figures of a window of ``runs`` whole runs and ``rounds`` election rounds."""
    commands: dict[str, dict[str, float]] = {
        name: dict(stat) for name, stat in window["commands"].items()
    }
    if rounds and "evalsha" in commands:  # an election round: one EVALSHA (usec unknown)
        commands["evalsha"]["calls"] -= rounds
    sent = {k: v for k, v in commands.items() if k not in SCRIPT_COMMANDS and v["calls"] > 0}
    inside = {k: v for k, v in commands.items() if k in SCRIPT_COMMANDS}
    return {
        "sent_per_run": {k: round(v["calls"] / runs, 3) for k, v in sorted(sent.items())},
        "round_trips_per_run": round(sum(v["calls"] for v in sent.values()) / runs, 3),
        "inside_per_run": {k: round(v["calls"] / runs, 3) for k, v in sorted(inside.items())},
        "inside_total_per_run": round(sum(v["calls"] for v in inside.values()) / runs, 3),
        "server_us_per_run": round(sum(v["usec"] for v in sent.values()) / runs, 1),
        "evalsha_us_per_run": round(commands.get("evalsha", {}).get("usec", 0) / runs, 1),
        "hgetall_per_run": round(commands.get("hgetall", {}).get("calls", 0) / runs, 3),
        "bytes_in_per_run": round(window["net_in"] / runs),
        "bytes_out_per_run": round(window["net_out"] / runs),
    }


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _json_bytes(value: object) -> int:
    return len(json.dumps(value, separators=(",", ":")).encode())


def _ms(values: list[float]) -> Json:
    if not values:
        return {"n": 0, "p50": None, "p99": None}
    ms = [v * 1000 for v in values]
    return {"n": len(ms), "p50": round(percentile(ms, 50), 3), "p99": round(percentile(ms, 99), 3)}


def run(quick: bool, workdir: Path) -> Json:
    """Commands per run for every kind and variant, then the lateness children."""
    runs = 20 if quick else 50
    fast_s, slow_s = (4, 4) if quick else (30, 60)
    started = time.monotonic()
    loadavg = [_loadavg()]
    with RedisServer.start(data_dir=workdir / "redis-checkpoints") as server:
        version = redis_version(server)
        commands = []
        for kind in KINDS:
            for variant in VARIANTS:
                log(f"checkpoints: commands per run, {kind}, {variant}")
                commands.append(asyncio.run(_measure(server.url, kind, variant, runs)))
        loadavg.append(_loadavg())
        schedulers = list(precision.REDIS_SCHEDULERS)
        lateness: list[Json] = []
        for periods, duration_s in zip(LATENESS_PERIODS, (fast_s, slow_s), strict=True):
            log(f"checkpoints: lateness at {periods[0] * 1000:g} ms, {duration_s} s")
            with server.client() as sync:
                sync.flushall()
            lateness += precision._phase(
                periods, duration_s, schedulers, workdir, extra_args=("--redis-url", server.url)
            )
            loadavg.append(_loadavg())
    return {
        "settings": {
            "every_s": EVERY_S,
            "heartbeat_s": HEARTBEAT_S,
            "lock_expiry_s": LOCK_EXPIRY_S,
            "runs_per_window": runs,
            "state_json_bytes": _json_bytes(STATE),
            "large_state_json_bytes": _json_bytes(LARGE_STATE),
            "redis_server": version,
            "redis_parser": "hiredis" if optional("hiredis") else "redis-py's own (no hiredis)",
            "body_fraction": precision.BODY_FRACTION,
            "background_jobs": precision.BACKGROUND_JOBS,
            "background_period_s": precision.BACKGROUND_PERIOD_S,
            "lateness_window_s": {"10": fast_s, "100": slow_s},
            "concurrent_children": 2 * len(schedulers),
        },
        "loadavg": loadavg,
        "commands": commands,
        "lateness": lateness,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
