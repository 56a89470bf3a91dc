"""Overhead: CPU per tick with 500 and 1,000 empty jobs, OpenTelemetry's share, memory per
job, startup and shutdown.

CPU per tick: a child process runs 500 or 1,000 empty jobs every 100 ms (all on the same
instants, as jobs declared without an offset are) and divides its CPU time
(``time.process_time``) over a window of whole periods by the runs in it; ticks per second per
core is the inverse. Variants: the library's ``fixed_rate`` on ``memory://`` (``checkpoint=False``:
the scheduler's own cost, like APScheduler's; a checkpoint's cost per run is the checkpoints
family's) and with its defaults (checkpoints on) on a real redis-server that this family starts
(``ON_REDIS``), both with the OpenTelemetry API alone (no SDK configured: every call a no-op),
APScheduler 3 (``AsyncIOScheduler``, interval jobs), ``repeat_every``, and bare asyncio loops
(the floor). For the library the child also reports the ticks it dropped in the window, by
reason (from the engine's snapshot, ``Engine.snapshot``, which the status API reads), and the
library's own duration of every run (``JobStats.last_run.duration_s``, up to its body's return:
the run's record goes to Redis after it) of as many periods again after the window, read by the
body of the job's next run (``Counter.observing``: in the window the bodies only test that they
need not);
and on Redis, the script calls (``EVAL``, ``EVALSHA``, ``FCALL`` and their read-only forms in
``INFO commandstats``) and redis-server's own CPU time (``INFO cpu``) over the window.
OpenTelemetry's share is measured apart, at a load the SDK keeps up with (100 jobs every
100 ms): the library with and without the SDK and in-memory exporters
(``SimpleSpanProcessor`` + ``InMemorySpanExporter``, ``InMemoryMetricReader``). Each variant
runs ``repeats`` times in a fresh process, the variants interleaved, and the median is reported.

Memory per job: RSS (``/proc/self/statm``, after ``gc.collect()``) of a fresh process with
1,000 interval jobs started, less that of one with a single job, over 999; for the library
(``memory://``) and APScheduler 3 (``AsyncIOScheduler``, started).

Startup: lifespan start to the first run of an interval job (and to the last of 1,000), on
``memory://`` and on a local redis-server. Shutdown: lifespan exit while no run is in flight.

    python -m bench.overhead cpu --scheduler singletonjob --jobs 1000 --period 0.1
    python -m bench.overhead cpu --scheduler singletonjob_redis_defaults --url redis://...
    python -m bench.overhead memory --scheduler apscheduler --jobs 1000
    python -m bench.overhead lifecycle --url redis://... --repeats 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import _common
from bench._common import Child, Json, optional, say, spawn, stats, stop_children

if TYPE_CHECKING:
    from bench._common import RedisServer

CPU_SCHEDULERS = (
    "singletonjob",
    "singletonjob_redis_defaults",
    "singletonjob_otel",
    "apscheduler",
    "repeat_every",
    "asyncio_floor",
)
CPU_JOBS = (500, 1000)
"""The job counts of the CPU comparison."""
CPU_VARIANTS = (
    "singletonjob",
    "singletonjob_redis_defaults",
    "apscheduler",
    "repeat_every",
    "asyncio_floor",
)
"""The variants of the CPU comparison, each at every count of ``CPU_JOBS``."""
ON_REDIS = ("singletonjob_redis_defaults",)
"""The variants on this family's redis-server (``--url``); the library's others are on
``memory://``."""
NO_SDK_VARIANTS = ("singletonjob", "singletonjob_redis_defaults")
"""The variants whose child runs as if opentelemetry-sdk were not installed (``NO_SDK``)."""
SCRIPT_COMMANDS = ("eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro")
"""The commands that run a script in Redis: the script calls of ``INFO commandstats``."""
OTEL_JOBS = 100
"""The load of the OpenTelemetry pair: light enough for the SDK variant to keep up with at
``PERIOD_S`` (a span exported per run costs several times a run without)."""
OTEL_VARIANTS = ("singletonjob", "singletonjob_otel")
PERIOD_S = 0.1
MEMORY_SCHEDULERS = ("singletonjob", "apscheduler")
MEMORY_JOBS = (1, 1000)
MEMORY_EVERY_S = 3600.0
"""Period of the memory children's interval jobs: each runs once at the start, then waits."""
LIFECYCLE_JOBS = (1, 1000)


# -- CPU per tick (child) -------------------------------------------------------------------


class Counter:
    """The ticks the jobs' bodies saw; for the library's jobs, also each run's duration as
    the library recorded it, while ``durations`` is a list."""

    def __init__(self) -> None:
        self.ticks = 0
        self.durations: list[float] | None = None
        self.window = (math.inf, math.inf)
        """The runs whose durations count: scheduled in [start, end), Unix seconds."""

    async def tick(self) -> None:
        self.ticks += 1

    def observing(self, sj: Any, name: str) -> Callable[[], Awaitable[None]]:
        """The body of the library's job ``name``: it counts its tick and, while
        ``durations`` is a list, reads the library's record of the job's run before it. A
        run starts only once the one before has ended and is recorded (a tick meanwhile is
        dropped), so each run is read once, by the next."""

        async def tick() -> None:
            self.ticks += 1
            if self.durations is not None:
                last = sj.engine.runners[name].stats.last_run
                start, end = self.window
                if last is not None and start <= last.scheduled_at.timestamp() < end:
                    self.durations.append(last.duration_s)

        return tick


def _otel_providers() -> tuple[Any, Any, Any]:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    return tracer_provider, meter_provider, exporter


async def _cpu_singletonjob(
    counter: Counter, jobs: int, period: float, otel: bool, redis_url: str | None = None
) -> Any:
    """The library with ``jobs`` fixed-rate jobs: on ``memory://`` without checkpoints, or
    with its defaults on ``redis_url`` (a project per process: the children share the
    server)."""
    from fastapi_singletonjob import SingletonJobs

    tracer_provider = meter_provider = None
    if otel:
        tracer_provider, meter_provider, _ = _otel_providers()
    sj = SingletonJobs(
        redis_url=redis_url or "memory://overhead",
        project=f"bench-overhead-{os.getpid()}" if redis_url else "bench-overhead",
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
    )
    for i in range(jobs):
        name = f"job-{i:04d}"
        if redis_url:  # the defaults: a checkpoint written after every run
            sj.fixed_rate(name, every=period)(counter.observing(sj, name))
        else:
            # The scheduler's own cost, as APScheduler's: without a checkpoint (its cost per
            # run is measured in the checkpoints family).
            sj.fixed_rate(name, every=period, checkpoint=False)(counter.observing(sj, name))
    await sj.start()
    return sj


async def _until_leading(sj: Any, timeout_s: float = 30.0) -> None:
    """Wait until this process leads every job (at once on ``memory://``; after the first
    election round, and the term's first reads, on Redis)."""
    deadline = time.monotonic() + timeout_s
    while not all(job.leads for job in sj.engine.snapshot().jobs.values()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the jobs were not all led within {timeout_s:g} s")
        await asyncio.sleep(0.05)


def _dropped(sj: Any) -> dict[str, int]:
    """Ticks the library dropped since it started, by reason, over all its jobs."""
    out: dict[str, int] = {}
    for job in sj.engine.snapshot().jobs.values():
        for reason, count in job.stats.dropped.items():
            if count:
                out[reason.value] = out.get(reason.value, 0) + count
    return out


def _less(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """The counts of ``after`` less those of ``before`` (the ones that grew)."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}


class RedisMeter:
    """Script calls and redis-server CPU time, from ``INFO``, on the server the child's
    library uses (its own client: none of the library's connections)."""

    def __init__(self, url: str) -> None:
        import redis.asyncio as aioredis

        self.client = aioredis.Redis.from_url(url, decode_responses=True)

    async def read(self) -> Json:
        commands = await self.client.info("commandstats")
        cpu = await self.client.info("cpu")
        calls = sum(commands.get(f"cmdstat_{name}", {}).get("calls", 0) for name in SCRIPT_COMMANDS)
        return {
            "at": time.monotonic(),
            "script_calls": calls,
            "server_cpu_s": cpu["used_cpu_sys"] + cpu["used_cpu_user"],
        }

    async def close(self) -> None:
        await self.client.aclose()


def _redis_figures(before: Json, after: Json, ticks: int) -> Json:
    """Script calls (per second, per run) and the server's CPU per tick between two reads."""
    calls = after["script_calls"] - before["script_calls"]
    elapsed = after["at"] - before["at"]
    server_cpu = after["server_cpu_s"] - before["server_cpu_s"]
    return {
        "script_calls": calls,
        "script_calls_per_s": calls / elapsed,
        "script_calls_per_run": calls / ticks if ticks else None,
        "redis_cpu_us_per_tick": server_cpu / ticks * 1e6 if ticks else None,
    }


async def _run_durations(counter: Counter, period: float, periods: int) -> list[float]:
    """The library's own duration (s) of every run of the next ``periods`` bursts, as the
    bodies of the runs after them read it (``Counter.observing``); the reading stops two
    periods after the last of those bursts, when every job has run again (or dropped its
    ticks)."""
    first = (math.floor(time.time() / period) + 1) * period
    # The instants are multiples of the period: half a period of margin for the rounding.
    counter.window = (first - period / 2, first + (periods - 0.5) * period)
    counter.durations = []
    await asyncio.sleep(max(0.0, first + (periods + 2) * period - time.time()))
    durations, counter.durations = counter.durations, None
    return durations


async def _cpu_apscheduler(counter: Counter, jobs: int, period: float) -> Any:
    module = optional("apscheduler.schedulers.asyncio")
    if module is None:
        raise SystemExit("apscheduler is not installed")
    scheduler = module.AsyncIOScheduler(timezone=UTC)
    # The first run on the grid of instants the other variants use, a period or two ahead:
    # the measuring window (after the warm-up) must not open before it.
    first = datetime.fromtimestamp((math.floor(time.time() / period) + 2) * period, UTC)
    for i in range(jobs):
        scheduler.add_job(
            counter.tick,
            "interval",
            seconds=period,
            start_date=first,
            id=f"job-{i}",
            max_instances=1,
        )
    scheduler.start()

    async def stop() -> None:
        scheduler.shutdown(wait=False)

    return stop


async def _cpu_tasks(loops: list[Awaitable[None]]) -> Any:
    tasks = [asyncio.ensure_future(loop) for loop in loops]

    async def stop() -> None:
        for task in tasks:
            task.cancel()

    return stop


async def _floor_loop(period: float, body: Callable[[], Awaitable[None]]) -> None:
    while True:
        due = (math.floor(time.time() / period) + 1) * period
        await asyncio.sleep(due - time.time())
        await body()


async def cpu_child(args: argparse.Namespace) -> Json:
    import fastapi

    # Every variant lives in a FastAPI application's heap (the garbage collector's work
    # grows with it), as a scheduler inside a FastAPI service does.
    app = fastapi.FastAPI()
    counter = Counter()
    before = set(asyncio.all_tasks())
    sj = None
    if args.scheduler in ON_REDIS and args.url.startswith("memory://"):
        raise SystemExit(f"--scheduler {args.scheduler} needs --url redis://...")
    meter = RedisMeter(args.url) if args.scheduler in ON_REDIS else None
    if args.scheduler.startswith("singletonjob"):
        sj = await _cpu_singletonjob(
            counter,
            args.jobs,
            args.period,
            otel=args.scheduler == "singletonjob_otel",
            redis_url=args.url if meter else None,
        )
        await _until_leading(sj)
        stop = sj.stop
    elif args.scheduler == "apscheduler":
        stop = await _cpu_apscheduler(counter, args.jobs, args.period)
    elif args.scheduler == "repeat_every":
        from bench.precision import _repeat_every

        repeat_every, _ = _repeat_every()
        for _ in range(args.jobs):
            await repeat_every(seconds=args.period)(counter.tick)()
        created = set(asyncio.all_tasks()) - before

        async def stop() -> None:
            for task in created:
                task.cancel()

    else:
        stop = await _cpu_tasks([_floor_loop(args.period, counter.tick) for _ in range(args.jobs)])
    await asyncio.sleep(args.warmup)
    # Whole periods, from halfway between two bursts of ticks: a burst is never cut in two.
    half = (math.floor(time.time() / args.period) + 1.5) * args.period
    await asyncio.sleep(half - time.time())
    periods = max(1, round(args.window / args.period))
    # Read before the window opens and after it closes: their own CPU is not in it. The
    # drops are read with no await between them and the ticks, so both cover the same runs.
    redis0 = await meter.read() if meter else None
    dropped0 = _dropped(sj) if sj is not None else {}
    ticks0, cpu0, wall0 = counter.ticks, time.process_time(), time.monotonic()
    await asyncio.sleep(periods * args.period)
    ticks1, cpu1, wall1 = counter.ticks, time.process_time(), time.monotonic()
    dropped1 = _dropped(sj) if sj is not None else {}
    redis1 = await meter.read() if meter else None
    ticks = ticks1 - ticks0
    cpu = cpu1 - cpu0
    library: Json = {}
    if sj is not None:
        durations_ms = [d * 1000 for d in await _run_durations(counter, args.period, periods)]
        library = {
            "dropped": _less(dropped1, dropped0),
            "dropped_since_start": dropped1,
            "run_duration_ms": stats(durations_ms, digits=4),
            "run_duration_expected": args.jobs * periods,
        }
    if meter is not None:
        assert redis0 is not None and redis1 is not None
        library.update(_redis_figures(redis0, redis1, ticks))
        await meter.close()
    await stop()
    return {
        "ticks": ticks,
        "cpu_s": cpu,
        "wall_s": wall1 - wall0,
        "cpu_us_per_tick": cpu / ticks * 1e6 if ticks else None,
        "expected_ticks": args.jobs * periods,  # every tick of the window's whole periods
        "ticks_per_s": ticks / (periods * args.period),
        **library,
        "otel_sdk_imported": sys.modules.get("opentelemetry.sdk") is not None,
        "app": type(app).__name__,
    }


# -- memory per job (child) --------------------------------------------------------------------


def rss_bytes() -> int:
    """This process's resident set size, from ``/proc/self/statm`` (pages × page size)."""
    with open("/proc/self/statm") as statm:
        resident = int(statm.read().split()[1])
    return resident * os.sysconf("SC_PAGE_SIZE")


async def memory_child(args: argparse.Namespace) -> Json:
    """Start ``args.jobs`` interval jobs, let each run once, then measure the RSS."""
    counter = Counter()
    all_ran = asyncio.Event()

    async def job() -> None:
        await counter.tick()
        if counter.ticks >= args.jobs:
            all_ran.set()

    if args.scheduler == "singletonjob":
        from fastapi_singletonjob import SingletonJobs

        sj = SingletonJobs(redis_url="memory://memory", project="bench-memory")
        for i in range(args.jobs):
            sj.interval(f"job-{i:04d}", every=MEMORY_EVERY_S)(job)
        await sj.start()
        stop = sj.stop
    else:
        module = optional("apscheduler.schedulers.asyncio")
        if module is None:
            raise SystemExit("apscheduler is not installed")
        scheduler = module.AsyncIOScheduler(timezone=UTC)
        run_now = datetime.now(UTC)
        for i in range(args.jobs):
            scheduler.add_job(
                job,
                "interval",
                seconds=MEMORY_EVERY_S,
                next_run_time=run_now,  # runs once now, as the library's interval jobs do
                id=f"job-{i:04d}",
                max_instances=1,
            )
        scheduler.start()

        async def stop() -> None:
            scheduler.shutdown(wait=False)

    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(all_ran.wait(), 10.0)  # "runs" in the result tells if not
    await asyncio.sleep(args.settle)  # the runs' tasks are done and collected
    gc.collect()
    rss = rss_bytes()
    runs = counter.ticks
    await stop()
    return {"rss_bytes": rss, "jobs": args.jobs, "runs": runs}


# -- lifecycle (child) -------------------------------------------------------------------------


async def _lifecycle_singletonjob(url: str, project: str, count: int) -> Json:
    from fastapi_singletonjob import SingletonJobs

    loop = asyncio.get_running_loop()
    first: asyncio.Future[float] = loop.create_future()
    last: asyncio.Future[float] = loop.create_future()
    ran = [0]

    async def job() -> None:
        ran[0] += 1
        stamp = time.perf_counter()
        if not first.done():
            first.set_result(stamp)
        if ran[0] == count:
            last.set_result(stamp)

    t_reg = time.perf_counter()
    sj = SingletonJobs(redis_url=url, project=project)
    for i in range(count):
        sj.interval(f"job-{i:04d}", every=3600.0)(job)
    registered = time.perf_counter() - t_reg
    lifespan = sj.lifespan(None)
    t0 = time.perf_counter()
    await lifespan.__aenter__()
    entered = time.perf_counter()
    t_first = await first
    t_last = await last
    await asyncio.sleep(0.05)  # idle: no run in flight
    t_stop = time.perf_counter()
    await lifespan.__aexit__(None, None, None)
    stopped = time.perf_counter()
    return {
        "register_ms": registered * 1000,
        "lifespan_enter_ms": (entered - t0) * 1000,
        "first_run_ms": (t_first - t0) * 1000,
        "all_ran_ms": (t_last - t0) * 1000,
        "shutdown_ms": (stopped - t_stop) * 1000,
    }


async def _lifecycle_apscheduler(count: int) -> Json | None:
    module = optional("apscheduler.schedulers.asyncio")
    if module is None:
        return None
    loop = asyncio.get_running_loop()
    first: asyncio.Future[float] = loop.create_future()
    last: asyncio.Future[float] = loop.create_future()
    ran = [0]

    async def job() -> None:
        ran[0] += 1
        stamp = time.perf_counter()
        if not first.done():
            first.set_result(stamp)
        if ran[0] == count:
            last.set_result(stamp)

    t_reg = time.perf_counter()
    scheduler = module.AsyncIOScheduler(timezone=UTC)
    run_now = datetime.now(UTC)
    for i in range(count):
        scheduler.add_job(
            job, "interval", seconds=3600, next_run_time=run_now, id=f"j{i}", max_instances=1
        )
    registered = time.perf_counter() - t_reg
    t0 = time.perf_counter()
    scheduler.start()
    entered = time.perf_counter()
    t_first = await first
    t_last = await last
    await asyncio.sleep(0.05)
    t_stop = time.perf_counter()
    scheduler.shutdown(wait=True)
    stopped = time.perf_counter()
    return {
        "register_ms": registered * 1000,
        "lifespan_enter_ms": (entered - t0) * 1000,
        "first_run_ms": (t_first - t0) * 1000,
        "all_ran_ms": (t_last - t0) * 1000,
        "shutdown_ms": (stopped - t_stop) * 1000,
    }


async def _lifecycle_repeat_every(count: int) -> Json:
    from bench.precision import _repeat_every

    repeat_every, _ = _repeat_every()
    loop = asyncio.get_running_loop()
    first: asyncio.Future[float] = loop.create_future()
    last: asyncio.Future[float] = loop.create_future()
    ran = [0]

    async def job() -> None:
        ran[0] += 1
        stamp = time.perf_counter()
        if not first.done():
            first.set_result(stamp)
        if ran[0] == count:
            last.set_result(stamp)

    before = set(asyncio.all_tasks())
    t_reg = time.perf_counter()
    starters = [repeat_every(seconds=3600)(job) for _ in range(count)]
    registered = time.perf_counter() - t_reg
    t0 = time.perf_counter()
    for starter in starters:
        await starter()
    entered = time.perf_counter()
    t_first = await first
    t_last = await last
    for task in set(asyncio.all_tasks()) - before:
        task.cancel()  # repeat_every has no shutdown: its tasks can only be cancelled
    return {
        "register_ms": registered * 1000,
        "lifespan_enter_ms": (entered - t0) * 1000,
        "first_run_ms": (t_first - t0) * 1000,
        "all_ran_ms": (t_last - t0) * 1000,
        "shutdown_ms": None,
    }


async def lifecycle_child(args: argparse.Namespace) -> Json:
    out: dict[str, list[Json]] = {}

    def add(name: str, row: Json | None) -> None:
        if row is not None:
            out.setdefault(name, []).append(row)

    for count in LIFECYCLE_JOBS:
        for i in range(args.repeats):
            add(
                f"singletonjob-memory-{count}",
                await _lifecycle_singletonjob(
                    f"memory://life-{count}-{i}", f"life-{count}-{i}", count
                ),
            )
            add(
                f"singletonjob-redis-{count}",
                await _lifecycle_singletonjob(args.url, f"life-{count}-{i}", count),
            )
            add(f"apscheduler-{count}", await _lifecycle_apscheduler(count))
            add(f"repeat_every-{count}", await _lifecycle_repeat_every(count))
    return {
        name: {key: _median([row[key] for row in rows]) for key in rows[0]}
        for name, rows in out.items()
    }


def _median(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    if not present:
        return None
    ordered = sorted(present)
    mid = len(ordered) // 2
    value = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return round(float(value), 3)


# -- the parent ---------------------------------------------------------------------------------


NO_SDK = (
    "import sys, runpy; sys.modules['opentelemetry.sdk'] = None; "
    "runpy.run_module('bench.overhead', run_name='__main__', alter_sys=True)"
)
"""Run the child as if opentelemetry-sdk were not installed (redis-py imports it if it is)."""


def _start_child(name: str, args: list[str], workdir: Path, *, no_sdk: bool = False) -> Child:
    log = workdir / f"overhead-{name}.log"
    if no_sdk:
        return Child(name, ["-c", NO_SDK, *args], log)
    return spawn(name, "bench.overhead", args, log)


def _read_json(child: Child) -> Json:
    data: Json = json.loads(child.expect("{"))
    return data


def _child_json(
    name: str, args: list[str], workdir: Path, timeout_s: float, *, no_sdk: bool = False
) -> Json:
    child = _start_child(name, args, workdir, no_sdk=no_sdk)
    try:
        return _read_json(child)
    finally:
        stop_children([child], timeout_s)


def _median_of(rows: list[Json], key: str, digits: int) -> float | None:
    """The median of ``key`` over the repeats that have it."""
    median: float | None = stats([r[key] for r in rows if r.get(key) is not None], digits=digits)[
        "p50"
    ]
    return median


def _library_row(rows: list[Json]) -> Json:
    """What the library's children report beside the CPU: drops, run durations, and on Redis
    the script calls and the server's CPU (medians of the repeats, with every repeat's)."""
    if "run_duration_ms" not in rows[0]:
        return {}
    durations = [r["run_duration_ms"] for r in rows]
    out: Json = {
        "dropped": [r["dropped"] for r in rows],
        "dropped_since_start": [r["dropped_since_start"] for r in rows],
        "run_duration_ms": {
            "p50": stats([d["p50"] for d in durations if d["n"]], digits=4)["p50"],
            "p99": stats([d["p99"] for d in durations if d["n"]], digits=4)["p50"],
            "max": max((d["max"] for d in durations if d["n"]), default=None),
            "n": sum(d["n"] for d in durations),
            "expected": sum(r["run_duration_expected"] for r in rows),
        },
        "run_duration_p99_ms_all": [d["p99"] for d in durations],
    }
    if "script_calls" in rows[0]:
        out.update(
            script_calls_per_s=_median_of(rows, "script_calls_per_s", 2),
            script_calls_per_s_all=[round(r["script_calls_per_s"], 2) for r in rows],
            script_calls_per_run=_median_of(rows, "script_calls_per_run", 5),
            redis_cpu_us_per_tick=_median_of(rows, "redis_cpu_us_per_tick", 2),
        )
    return out


def _cpu_row(rows: list[Json]) -> Json:
    """The median CPU per tick of one variant's repeats, with every repeat's figures."""
    per_tick = [r["cpu_us_per_tick"] for r in rows if r["cpu_us_per_tick"]]
    median_us = stats(per_tick, digits=2)["p50"]
    return {
        "cpu_us_per_tick": median_us,
        "cpu_us_per_tick_all": [round(x, 2) for x in per_tick],
        "ticks_per_s_per_core": round(1e6 / median_us) if median_us else None,
        "cpu_percent": stats([100 * r["cpu_s"] / r["wall_s"] for r in rows], digits=1)["p50"],
        "ticks": [r["ticks"] for r in rows],
        "expected_ticks": [r["expected_ticks"] for r in rows],
        "ticks_per_s": stats([r["ticks_per_s"] for r in rows], digits=1)["p50"],
        **_library_row(rows),
        "otel_sdk_imported": any(r["otel_sdk_imported"] for r in rows),
    }


def _cpu(quick: bool, workdir: Path, server: RedisServer) -> Json:
    """CPU per tick: every (jobs, variant) of the comparison and the OpenTelemetry pair, in
    fresh processes, the variants interleaved within each repeat; the ``ON_REDIS`` variants
    on ``server``, emptied before each of their children."""
    repeats, warmup, window = (1, 0.4, 0.6) if quick else (5, 1.5, 3.0)
    has_aps = optional("apscheduler") is not None
    plan = [
        ("by_jobs", jobs, scheduler)
        for jobs in CPU_JOBS
        for scheduler in CPU_VARIANTS
        if scheduler != "apscheduler" or has_aps
    ]
    plan += [("otel", OTEL_JOBS, scheduler) for scheduler in OTEL_VARIANTS]
    samples: dict[tuple[str, int, str], list[Json]] = {key: [] for key in plan}
    for _ in range(repeats):
        for key in plan:
            _, jobs, scheduler = key
            args = [
                "cpu",
                *("--scheduler", scheduler, "--jobs", str(jobs), "--period", str(PERIOD_S)),
                *("--warmup", str(warmup), "--window", str(window)),
            ]
            if scheduler in ON_REDIS:
                args += ["--url", server.url]
                with server.client() as client:
                    client.flushall()  # and the keys of the children before are gone
            # Without an SDK installed, the library's OpenTelemetry calls are no-ops.
            no_sdk = scheduler in NO_SDK_VARIANTS
            samples[key].append(
                _child_json(f"{scheduler}-{jobs}", args, workdir, 60.0, no_sdk=no_sdk)
            )
    by_jobs: dict[str, Json] = {}
    otel: Json = {}
    for (part, jobs, scheduler), rows in samples.items():
        if part == "otel":
            otel[scheduler] = _cpu_row(rows)
        else:
            by_jobs.setdefault(str(jobs), {})[scheduler] = _cpu_row(rows)
    noop = otel["singletonjob"]["cpu_us_per_tick"]
    sdk = otel["singletonjob_otel"]["cpu_us_per_tick"]
    return {
        "settings": {
            "jobs": list(CPU_JOBS),
            "period_s": PERIOD_S,
            "otel_jobs": OTEL_JOBS,
            "repeats": repeats,
            "warmup_s": warmup,
            "window_s": window,
            "on_redis": list(ON_REDIS),
            "script_commands": list(SCRIPT_COMMANDS),
            "redis_server": _common.redis_version(server),
        },
        "by_jobs": by_jobs,
        "otel": otel,
        "otel_delta_us_per_tick": round(sdk - noop, 2) if noop and sdk else None,
    }


PAIRED = ("singletonjob_redis_defaults", "apscheduler")
"""The pair of the side-by-side comparison: the library with its defaults on Redis, and
APScheduler 3."""


def _cpu_paired(quick: bool, workdir: Path, server: RedisServer) -> Json:
    """CPU per tick of ``PAIRED``, side by side: in each round both children run at the same
    time (one per core), so that both see the same machine; the round's figure is the ratio
    of their CPU per tick, and the median of the rounds' ratios judges. Across separate runs
    this machine's CPU per tick moves by a quarter (APScheduler's own median at 500 jobs went
    from 41.2 to 28.7 µs between two runs of the same code), more than the margins judged;
    within a round both move together."""
    if optional("apscheduler") is None:
        return {}
    rounds, warmup, window = (1, 0.4, 0.6) if quick else (6, 1.5, 3.0)
    by_jobs: Json = {}
    for jobs in CPU_JOBS:
        figures: dict[str, list[float]] = {name: [] for name in PAIRED}
        for _ in range(rounds):
            with server.client() as client:
                client.flushall()
            children = []
            for name in PAIRED:
                args = [
                    "cpu",
                    *("--scheduler", name, "--jobs", str(jobs), "--period", str(PERIOD_S)),
                    *("--warmup", str(warmup), "--window", str(window)),
                    *("--url", server.url),
                ]
                no_sdk = name in NO_SDK_VARIANTS
                children.append(_start_child(f"paired-{name}-{jobs}", args, workdir, no_sdk=no_sdk))
            try:
                for name, child in zip(PAIRED, children, strict=True):
                    figures[name].append(_read_json(child)["cpu_us_per_tick"])
            finally:
                stop_children(children, 60.0)
        ratios = [ours / aps for ours, aps in zip(*figures.values(), strict=True)]
        by_jobs[str(jobs)] = {
            **{name: [round(x, 2) for x in values] for name, values in figures.items()},
            "ratios": [round(r, 3) for r in ratios],
            "median_ratio": stats(ratios, digits=3)["p50"],
        }
    return {
        "settings": {
            "pair": list(PAIRED),
            "rounds": rounds,
            "warmup_s": warmup,
            "window_s": window,
        },
        "by_jobs": by_jobs,
    }


def _memory(quick: bool, workdir: Path) -> Json:
    """RSS per registered job: a fresh process for each count, scheduler and repeat."""
    repeats = 1 if quick else 3
    schedulers = [s for s in MEMORY_SCHEDULERS if s != "apscheduler" or optional("apscheduler")]
    samples: dict[str, dict[int, list[Json]]] = {
        s: {n: [] for n in MEMORY_JOBS} for s in schedulers
    }
    for _ in range(repeats):
        # The processes of one repeat run at once: RSS is the process's own, whatever runs
        # beside it.
        plan = [(scheduler, jobs) for scheduler in schedulers for jobs in MEMORY_JOBS]
        children: list[Child] = []
        try:
            for scheduler, jobs in plan:
                args = ["memory", "--scheduler", scheduler, "--jobs", str(jobs)]
                name = f"memory-{scheduler}-{jobs}"
                children.append(
                    _start_child(name, args, workdir, no_sdk=scheduler == "singletonjob")
                )
            for (scheduler, jobs), child in zip(plan, children, strict=True):
                samples[scheduler][jobs].append(_read_json(child))
        finally:
            stop_children(children, 30.0)
    few, many = MEMORY_JOBS
    out: Json = {}
    for scheduler, by_count in samples.items():
        rss = {
            n: stats([r["rss_bytes"] for r in rows], digits=0)["p50"]
            for n, rows in by_count.items()
        }
        out[scheduler] = {
            "rss_bytes": {str(n): int(v) for n, v in rss.items()},
            "rss_bytes_all": {
                str(n): [r["rss_bytes"] for r in rows] for n, rows in by_count.items()
            },
            "runs": {str(n): [r["runs"] for r in rows] for n, rows in by_count.items()},
            "bytes_per_job": round((rss[many] - rss[few]) / (many - few)),
        }
    return {
        "settings": {"jobs": list(MEMORY_JOBS), "repeats": repeats, "every_s": MEMORY_EVERY_S},
        "results": out,
    }


def run(quick: bool, workdir: Path) -> Json:
    """CPU per tick (interleaved repeats), memory per job, then the lifecycle timings."""
    started = time.monotonic()
    lifecycle_repeats = 3 if quick else 10
    # Through the module: tests/servers.py (and redis) load on first use, not in every child.
    with _common.RedisServer.start(data_dir=workdir / "redis-overhead") as server:
        cpu = _cpu(quick, workdir, server)
        cpu_paired = _cpu_paired(quick, workdir, server)
        memory = _memory(quick, workdir)
        lifecycle = _child_json(
            "lifecycle",
            ["lifecycle", "--url", server.url, "--repeats", str(lifecycle_repeats)],
            workdir,
            120.0,
        )
    return {
        "settings": {
            "lifecycle_jobs": list(LIFECYCLE_JOBS),
            "lifecycle_repeats": lifecycle_repeats,
        },
        "cpu": cpu,
        "cpu_paired": cpu_paired,
        "memory": memory,
        "lifecycle": lifecycle,
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of a child process: prints one JSON line."""
    parser = argparse.ArgumentParser(description="overhead child process")
    parser.add_argument("role", choices=["cpu", "memory", "lifecycle"])
    parser.add_argument("--scheduler", choices=CPU_SCHEDULERS, default="singletonjob")
    parser.add_argument("--jobs", type=int, default=CPU_JOBS[-1])
    parser.add_argument("--period", type=float, default=PERIOD_S)
    parser.add_argument("--warmup", type=float, default=1.5)
    parser.add_argument("--window", type=float, default=3.0)
    parser.add_argument("--settle", type=float, default=0.5, help="memory: wait before measuring")
    parser.add_argument("--url", default="memory://", help="lifecycle, and the ON_REDIS variants")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    child = {"cpu": cpu_child, "memory": memory_child, "lifecycle": lifecycle_child}[args.role]
    say(json.dumps(asyncio.run(child(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
