"""Tick precision: how late each tick starts, and whether the schedule drifts.

One child process per (scheduler, period, load): a measured job every 10 ms, 100 ms or 500 ms
whose body awaits for 20 % of the period, alone or beside 100 more jobs every 500 ms (each
awaiting 100 ms, all on the measured job's instants, as jobs declared without an offset are:
every 500 ms tick, every fifth 100 ms tick and every fiftieth 10 ms tick shares its instant
with the 100). Lateness is ``time.time()`` at the body's first instruction minus the tick's
ideal instant. The children of one phase run at the same time, on instants shifted by a
different offset each, so that all schedulers share the machine's conditions without waking
together (``_layout``: the rows alone, by scheduler in turn, clear of the bursts of the rows
beside 100 jobs). The variants that busy-wait before each instant (``SPINNING``) have phases
of their own: on a 2-CPU machine their spinning would take the CPU from the others' wake-ups,
and the others' wake-ups would preempt their spins. Each child also reports its process's CPU time
over the window, which gives the CPU cost of the library's ``precision=`` setting.

Schedulers: fastapi-singletonjob (``fixed_rate``, ``memory://``), the same with its defaults
on a real redis-server that this family starts (``DEFAULTS_ON_REDIS``: checkpoints on, every
job's record written after each run), the same on ``memory://`` with ``precision=0.002`` (wake
2 ms early and yield to the loop until the instant), APScheduler 3 (``AsyncIOScheduler``,
interval trigger, ``max_instances=1``), fastapi-utils ``repeat_every`` (or the canonical
``while True: await f(); await asyncio.sleep(s)`` when it is not installed), and a bare asyncio
loop that sleeps until each grid instant: the floor any asyncio scheduler stands on.

``REDIS_SCHEDULERS`` are the library on a real redis-server (``--redis-url``, a project of its
own per child) with its checkpoints (the default) and with ``checkpoint=False``. The first is
``DEFAULTS_ON_REDIS``, which this family runs in its phases beside the peers; both run in
``bench/checkpoints.py``, with that family's server, through ``_phase``.

    python -m bench.precision child --scheduler singletonjob --period 0.01 --background 100 \\
        --offset 0.00125 --out result.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import resource
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import _common
from bench._common import (
    Child,
    Json,
    downsample,
    optional,
    percentile,
    say,
    spawn,
    stats,
    stop_children,
)

SCHEDULERS = (
    "singletonjob",
    "singletonjob_precise",
    "apscheduler",
    "repeat_every",
    "asyncio_floor",
    "asyncio_spin",
)
SPINNING = ("singletonjob_precise", "asyncio_spin")
"""The variants that yield-spin before each instant: measured in phases of their own."""
REDIS_SCHEDULERS = ("singletonjob_redis", "singletonjob_redis_nocheckpoint")
"""The library on Redis, checkpoint on and off (run by ``bench/checkpoints.py``)."""
DEFAULTS_ON_REDIS = "singletonjob_redis"
"""The library as configured by default, on Redis: run in this family's phases, beside the
peers and the floor, on a redis-server of its own."""
PRECISION_S = 0.002
"""The library's ``precision=`` in the ``singletonjob_precise`` rows."""
SPIN_S = PRECISION_S
"""The reference yield-spin loop's early wake: the library's, for a like-for-like row."""
BODY_FRACTION = 0.2
BACKGROUND_JOBS = 100
BACKGROUND_PERIOD_S = 0.5
READY_TIMEOUT_S = 120.0
SLOW_WINDOW_S = 300
"""The window of the 100 and 500 ms phases: 3,000 runs at 100 ms. A p99 of 1,200 runs (120 s)
is one of the dozen latest, noise that flipped a comparison of two schedulers from run to
run; a longer window gives more runs without more processes on the machine at once (each
process more is more contention, which moves every tail)."""
POOLED = {0.5: 5}
"""Processes per scheduler for the rows *alone* of a period, their runs pooled into one row:
the window holds 600 runs at 500 ms, five processes 3,000, as one does at 100 ms. Drift is
the first process's, CPU the processes' mean."""
STALL_S = 0.0002
"""A gap between two iterations of the reference spin longer than this is a stall: the loop
did nothing else, so the process (or its virtual CPU) was not running."""
DRIFT_POINTS = 211  # runs sampled for the drift slope (a prime: no beat with 1-in-100 spikes)

Record = Callable[[float, float], None]


# -- the child --------------------------------------------------------------------------------


class Window:
    """The measuring window [t0, t_end) and the measured job's runs inside it."""

    def __init__(self, t0: float, t_end: float) -> None:
        self.t0 = t0
        self.t_end = t_end
        self.ideal: list[float] = []
        self.start: list[float] = []
        self.lib_lateness: list[float] = []
        self.stalls: list[float] | None = None
        """The reference spin's stalls inside the window, in seconds (None: not a spin)."""

    def record(self, ideal: float, start: float) -> None:
        if self.t0 <= ideal < self.t_end:
            self.ideal.append(ideal)
            self.start.append(start)


async def _sleep_until(wall: float) -> None:
    await asyncio.sleep(max(0.0, wall - time.time()))


async def run_singletonjob(
    period: float,
    offset: float,
    background: int,
    window: Window,
    precision: float = 0.0,
    *,
    redis_url: str | None = None,
    checkpoint: bool = True,
) -> dict[str, Any]:
    from fastapi_singletonjob import JobContext, SingletonJobs

    if redis_url is None:
        jobs = SingletonJobs(
            redis_url="memory://precision", project="bench-precision", precision=precision
        )
    else:  # children share the server: a project each, so that each leads its own jobs
        jobs = SingletonJobs(
            redis_url=redis_url, project=f"bench-precision-{os.getpid()}", precision=precision
        )
    body_s = BODY_FRACTION * period

    @jobs.fixed_rate("measured", every=period, offset=offset, checkpoint=checkpoint)
    async def measured(ctx: JobContext) -> None:
        start = time.time()
        ideal = ctx.scheduled_at.timestamp()
        window.record(ideal, start)
        if window.t0 <= ideal < window.t_end:
            window.lib_lateness.append((ctx.started_at - ctx.scheduled_at).total_seconds())
        await asyncio.sleep(body_s)

    async def other() -> None:
        await asyncio.sleep(BODY_FRACTION * BACKGROUND_PERIOD_S)

    for i in range(background):
        jobs.fixed_rate(
            f"background-{i}", every=BACKGROUND_PERIOD_S, offset=offset, checkpoint=checkpoint
        )(other)
    await jobs.start()
    try:
        await _sleep_until(window.t_end + 0.05)
        stats_ = jobs.engine.runners["measured"].stats if jobs.engine else None
        dropped = {k.value: v for k, v in stats_.dropped.items()} if stats_ else {}
    finally:
        await jobs.stop()
    label = "fastapi-singletonjob fixed_rate" + (f", precision={precision:g}" if precision else "")
    if redis_url is not None:
        label += f", Redis, checkpoint={checkpoint}"
    return {"label": label, "dropped": dropped}


async def run_singletonjob_precise(
    period: float, offset: float, background: int, window: Window
) -> dict[str, Any]:
    return await run_singletonjob(period, offset, background, window, precision=PRECISION_S)


async def run_singletonjob_redis(
    period: float, offset: float, background: int, window: Window, *, redis_url: str
) -> dict[str, Any]:
    return await run_singletonjob(period, offset, background, window, redis_url=redis_url)


async def run_singletonjob_redis_nocheckpoint(
    period: float, offset: float, background: int, window: Window, *, redis_url: str
) -> dict[str, Any]:
    return await run_singletonjob(
        period, offset, background, window, redis_url=redis_url, checkpoint=False
    )


async def run_apscheduler(
    period: float, offset: float, background: int, window: Window
) -> dict[str, Any]:
    asyncio_mod = optional("apscheduler.schedulers.asyncio")
    events = optional("apscheduler.events")
    if asyncio_mod is None or events is None:
        raise SystemExit("apscheduler is not installed")
    scheduler = asyncio_mod.AsyncIOScheduler(timezone=UTC)
    pending: collections.deque[float] = collections.deque()

    def submitted(event: Any) -> None:
        if event.job_id == "measured":
            pending.extend(t.timestamp() for t in event.scheduled_run_times)

    scheduler.add_listener(submitted, events.EVENT_JOB_SUBMITTED)
    body_s = BODY_FRACTION * period

    async def measured() -> None:
        start = time.time()
        window.record(pending.popleft() if pending else math.nan, start)
        await asyncio.sleep(body_s)

    async def other() -> None:
        await asyncio.sleep(BODY_FRACTION * BACKGROUND_PERIOD_S)

    first = datetime.fromtimestamp(window.t0 + offset, UTC)
    scheduler.add_job(
        measured, "interval", seconds=period, start_date=first, id="measured", max_instances=1
    )
    for i in range(background):
        scheduler.add_job(
            other,
            "interval",
            seconds=BACKGROUND_PERIOD_S,
            start_date=first,
            id=f"background-{i}",
            max_instances=1,
        )
    scheduler.start()
    try:
        await _sleep_until(window.t_end + 0.05)
    finally:
        scheduler.shutdown(wait=False)
    version = optional("apscheduler")
    return {"label": f"APScheduler {getattr(version, '__version__', '3')} interval"}


def _repeat_every() -> tuple[Callable[..., Any], str]:
    tasks = optional("fastapi_utils.tasks")
    if tasks is not None:
        return tasks.repeat_every, "fastapi-utils repeat_every"

    def canonical(*, seconds: float, wait_first: float | None = None) -> Callable[..., Any]:
        # The canonical loop, for when fastapi-utils is not installed.
        def decorator(func: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
            async def start() -> None:
                async def loop() -> None:
                    if wait_first is not None:
                        await asyncio.sleep(wait_first)
                    while True:
                        await func()
                        await asyncio.sleep(seconds)

                asyncio.ensure_future(loop())

            return start

        return decorator

    return canonical, "canonical repeat_every loop (fastapi-utils not installed)"


async def run_repeat_every(
    period: float, offset: float, background: int, window: Window
) -> dict[str, Any]:
    repeat_every, label = _repeat_every()
    body_s = BODY_FRACTION * period
    first = window.t0 + offset

    async def measured() -> None:
        start = time.time()
        # No grid: the ideal instant of run k is the first one plus k periods.
        window.record(first + len(window.start) * period, start)
        await asyncio.sleep(body_s)

    async def other() -> None:
        await asyncio.sleep(BODY_FRACTION * BACKGROUND_PERIOD_S)

    before = set(asyncio.all_tasks())
    await repeat_every(seconds=period, wait_first=first - time.time())(measured)()
    for _ in range(background):
        await repeat_every(seconds=BACKGROUND_PERIOD_S, wait_first=first - time.time())(other)()
    try:
        await _sleep_until(window.t_end + 0.05)
    finally:
        # repeat_every gives no handle to stop it: cancel the tasks it created.
        for task in set(asyncio.all_tasks()) - before:
            task.cancel()
    return {"label": label}


async def run_asyncio_floor(
    period: float, offset: float, background: int, window: Window
) -> dict[str, Any]:
    async def loop(every: float, body_s: float, record: Record | None) -> None:
        while True:
            due = (math.floor((time.time() - offset) / every) + 1) * every + offset
            await asyncio.sleep(due - time.time())
            start = time.time()
            if record is not None:
                record(due, start)
            await asyncio.sleep(body_s)

    tasks = [asyncio.ensure_future(loop(period, BODY_FRACTION * period, window.record))]
    tasks += [
        asyncio.ensure_future(loop(BACKGROUND_PERIOD_S, BODY_FRACTION * BACKGROUND_PERIOD_S, None))
        for _ in range(background)
    ]
    try:
        await _sleep_until(window.t_end + 0.05)
    finally:
        for task in tasks:
            task.cancel()
    return {"label": "bare asyncio loop sleeping until each grid instant"}


async def run_asyncio_spin(
    period: float, offset: float, background: int, window: Window
) -> dict[str, Any]:
    async def loop(every: float, body_s: float, record: Record | None) -> None:
        while True:
            due = (math.floor((time.time() - offset) / every) + 1) * every + offset
            await asyncio.sleep(due - SPIN_S - time.time())
            last = time.perf_counter()
            while time.time() < due:  # a spin on purpose: no epoll timeout
                await asyncio.sleep(0)  # yield to the other tasks, but do not block in epoll
                now = time.perf_counter()
                if now - last > STALL_S and record is not None and window.t0 <= due < window.t_end:
                    stalls.append(now - last)
                last = now
            start = time.time()
            if record is not None:
                record(due, start)
            await asyncio.sleep(body_s)

    stalls = window.stalls = []
    tasks = [asyncio.ensure_future(loop(period, BODY_FRACTION * period, window.record))]
    tasks += [
        asyncio.ensure_future(
            _plain_loop(BACKGROUND_PERIOD_S, BODY_FRACTION * BACKGROUND_PERIOD_S, offset)
        )
        for _ in range(background)
    ]
    try:
        await _sleep_until(window.t_end + 0.05)
    finally:
        for task in tasks:
            task.cancel()
    return {"label": f"asyncio loop: sleep to {SPIN_S * 1000:g} ms before, then yield-spin"}


async def _plain_loop(every: float, body_s: float, offset: float) -> None:
    while True:
        due = (math.floor((time.time() - offset) / every) + 1) * every + offset
        await asyncio.sleep(due - time.time())
        await asyncio.sleep(body_s)


PRELOAD = {
    "singletonjob": ("fastapi_singletonjob",),
    "singletonjob_precise": ("fastapi_singletonjob",),
    "apscheduler": ("apscheduler.schedulers.asyncio", "apscheduler.events"),
    "repeat_every": ("fastapi_utils.tasks",),
    "asyncio_floor": (),
    "asyncio_spin": (),
    "singletonjob_redis": ("fastapi_singletonjob", "redis.asyncio"),
    "singletonjob_redis_nocheckpoint": ("fastapi_singletonjob", "redis.asyncio"),
}


RUNNERS = {
    "singletonjob": run_singletonjob,
    "singletonjob_precise": run_singletonjob_precise,
    "apscheduler": run_apscheduler,
    "repeat_every": run_repeat_every,
    "asyncio_floor": run_asyncio_floor,
    "asyncio_spin": run_asyncio_spin,
}
REDIS_RUNNERS = {
    "singletonjob_redis": run_singletonjob_redis,
    "singletonjob_redis_nocheckpoint": run_singletonjob_redis_nocheckpoint,
}


async def child(args: argparse.Namespace) -> Json:
    """Say ready, take the window from stdin, run the scheduler through it, return the runs."""
    for module in PRELOAD[args.scheduler]:
        optional(module)  # import before "ready": a slow import must not eat into the window
    say("ready")
    loop = asyncio.get_running_loop()
    line = await loop.run_in_executor(None, sys.stdin.readline)
    t0, t_end = (float(x) for x in line.split())
    window = Window(t0, t_end)
    cpu: dict[str, float] = {}

    async def meter() -> None:
        await _sleep_until(t0)
        cpu["start"] = time.process_time()
        cpu["switches"] = -resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw
        await _sleep_until(t_end)
        cpu["end"] = time.process_time()
        cpu["switches"] += resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw

    metering = asyncio.ensure_future(meter())
    if args.scheduler in REDIS_RUNNERS:
        if not args.redis_url:
            raise SystemExit(f"--scheduler {args.scheduler} needs --redis-url")
        extra = await REDIS_RUNNERS[args.scheduler](
            args.period, args.offset, args.background, window, redis_url=args.redis_url
        )
    else:
        extra = await RUNNERS[args.scheduler](args.period, args.offset, args.background, window)
    await metering
    return {
        **extra,
        "ideal": window.ideal,
        "start": window.start,
        "lib_lateness": window.lib_lateness,
        "stalls": window.stalls,
        "involuntary_switches": int(cpu["switches"]),
        "cpu_s": cpu["end"] - cpu["start"],
        "window_s": t_end - t0,
    }


# -- the parent -------------------------------------------------------------------------------


def theil_sen(values: list[float]) -> float | None:
    """Median of the pairwise slopes of ``values`` against their index (a robust trend that
    a few late outliers do not move), on at most DRIFT_POINTS samples spread over the run."""
    n = len(values)
    if n < 2:
        return None
    count = min(n, DRIFT_POINTS)
    index = sorted({round(i * (n - 1) / (count - 1)) for i in range(count)})
    slopes = [
        (values[b] - values[a]) / (b - a) for i, a in enumerate(index) for b in index[i + 1 :]
    ]
    return percentile(slopes, 50)


def _late_ms(raw: Json) -> list[float]:
    return [
        (s - i) * 1000 for i, s in zip(raw["ideal"], raw["start"], strict=True) if not math.isnan(i)
    ]


def summarize(period: float, raws: list[Json], expected: int) -> Json:
    """Lateness, interval error and drift of the runs of one child, or of several pooled
    (drift from the first, CPU their mean), in milliseconds."""
    raw = raws[0]
    late_ms = [ms for one in raws for ms in _late_ms(one)]
    gaps_ms = [
        (b - a - period) * 1000
        for one in raws
        for a, b in zip(one["start"], one["start"][1:], strict=False)
    ]
    first = _late_ms(raw)
    slope = theil_sen(first)
    drift = None if slope is None else slope * (len(first) - 1)
    per_1000 = None if slope is None else slope * 1000
    runs = sum(len(one["start"]) for one in raws)
    cpu_s = sum(one["cpu_s"] for one in raws) / len(raws)
    result: Json = {
        "label": raw["label"],
        "processes": len(raws),
        "runs": runs,
        "expected": expected,
        "lateness_ms": stats(late_ms),
        "interval_error_ms": stats(gaps_ms),
        "drift_ms": None if drift is None else round(drift, 3),
        "drift_per_1000_ticks_ms": None if per_1000 is None else round(per_1000, 3),
        "cpu_ms_per_s": round(cpu_s / raw["window_s"] * 1000, 2),
        "cpu_us_per_run": round(cpu_s * len(raws) / runs * 1e6, 1) if runs else None,
        "series_ms": downsample(first),
        "involuntary_switches": sum(one.get("involuntary_switches", 0) for one in raws),
    }
    if raw.get("stalls") is not None:
        stalls_ms = [x * 1000 for one in raws for x in one["stalls"]]
        result["stalls_ms"] = {
            "count": len(stalls_ms),
            "total": round(sum(stalls_ms), 2),
            "max": round(max(stalls_ms, default=0.0), 3),
        }
    lib_lateness = [x * 1000 for one in raws for x in one.get("lib_lateness", [])]
    if lib_lateness:
        result["library_lateness_ms"] = stats(lib_lateness)
    if "dropped" in raw:
        dropped: collections.Counter[str] = collections.Counter()
        for one in raws:
            dropped.update(one["dropped"])
        result["dropped"] = dict(dropped)
    return result


def _phase(
    periods: tuple[float, ...],
    duration_s: int,
    schedulers: list[str],
    workdir: Path,
    extra_args: Sequence[str] = (),
    pooled: Mapping[float, int] | None = None,
    loads: tuple[int, ...] = (0, BACKGROUND_JOBS),
) -> list[Json]:
    """Run one child per (scheduler, period, load in ``loads``), ``pooled[period]`` for the
    rows alone, all at the same time through one window (at the offsets of ``_layout``);
    summarize each row."""
    busy = [(s, p, BACKGROUND_JOBS, 0) for p in periods for s in schedulers]
    alone = [
        (s, period, 0, process)
        for period in periods
        for process in range((pooled or {}).get(period, 1))
        for s in schedulers
    ]
    busy, alone = (busy if BACKGROUND_JOBS in loads else []), (alone if 0 in loads else [])
    plan = list(zip(busy + alone, _layout(len(busy), len(alone), min(periods)), strict=True))
    children: list[tuple[Child, Path, str, float, int, float]] = []
    try:
        for (scheduler, period, background, process), offset in plan:
            name = f"{scheduler}-{period}-{background}" + (f"-{process}" if process else "")
            out = workdir / f"precision-{name}.json"
            args = [
                "child",
                *("--scheduler", scheduler, "--period", str(period)),
                *("--background", str(background), "--offset", str(offset), "--out", str(out)),
                *extra_args,
            ]
            log = workdir / f"precision-{name}.log"
            child_ = spawn(f"{name}", "bench.precision", args, log)
            children.append((child_, out, scheduler, period, background, offset))
        deadline = time.monotonic() + READY_TIMEOUT_S
        for child_, *_ in children:
            child_.expect("ready")
            if time.monotonic() > deadline:
                raise RuntimeError("precision children took too long to start")
        t0 = math.ceil(time.time() + 1.5)
        t_end = t0 + duration_s
        for child_, *_ in children:
            child_.send(f"{t0} {t_end}")
        time.sleep(max(0.0, t0 - time.time()))
        steal_start = (time.monotonic(), _steal_s())
        rows: dict[tuple[str, float, int], list[tuple[Json, int, float]]] = {}
        for child_, out, scheduler, period, background, offset in children:
            child_.expect("done")
            expected = math.ceil((duration_s - offset) / period - 1e-9)
            row = rows.setdefault((scheduler, period, background), [])
            row.append((json_load(out), expected, offset))
        steal = _steal_share(*steal_start)
        results = []
        for (scheduler, period, background), row in rows.items():
            summary = summarize(period, [raw for raw, _, _ in row], sum(e for _, e, _ in row))
            summary.update(
                scheduler=scheduler, period_ms=round(period * 1000), background=background
            )
            summary["offset_ms"] = round(row[0][2] * 1000, 3)
            summary["phase_steal"] = steal
            results.append(summary)
        return results
    finally:
        stop_children([c[0] for c in children])


def _layout(busy: int, alone: int, cycle_s: float) -> list[float]:
    """Offsets of ``busy`` rows beside 100 jobs, then of ``alone`` rows alone, in a cycle of
    the shortest period. The busy rows start in its first quarter: each wakes 100 jobs at
    once, a burst of several milliseconds of CPU (more with contention) every 500 ms. The
    rows alone tick in its second half, clear of those bursts where the period allows (at 10
    ms they outlast it: ``run`` gives the rows alone a phase of their own), and in turn by
    scheduler (``_phase`` lists them so): laid out in blocks instead, the first
    scheduler's rows alone sat right after the bursts and the last one's furthest from them,
    which ranked the schedulers' tails by their place in the plan."""
    return [round(i * cycle_s / 4 / busy, 6) for i in range(busy)] + [
        round(cycle_s / 2 + j * cycle_s / 2 / alone, 6) for j in range(alone)
    ]


def _steal_s() -> float | None:
    """CPU time the hypervisor has taken from this virtual machine's CPUs, in seconds (the
    *steal* column of ``/proc/stat``), or None where there is no such column."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _steal_share(since: float, steal_then: float | None) -> float | None:
    """The share of the CPUs' time stolen by the hypervisor since ``since`` (monotonic)."""
    steal_now = _steal_s()
    if steal_then is None or steal_now is None:
        return None
    elapsed = (time.monotonic() - since) * (os.cpu_count() or 1)
    return round((steal_now - steal_then) / elapsed, 5) if elapsed > 0 else None


def json_load(path: Path) -> Json:
    data: Json = json.loads(path.read_text())
    return data


def run(quick: bool, workdir: Path) -> Json:
    """Run both phases; return the summaries."""
    schedulers = [s for s in SCHEDULERS if s != "apscheduler" or optional("apscheduler")]
    # The defaults on Redis next to the library on memory://: the rows alone take their
    # places in the cycle by scheduler in turn (``_layout``).
    schedulers.insert(schedulers.index("singletonjob") + 1, DEFAULTS_ON_REDIS)
    fast_s, slow_s = (4, 4) if quick else (50, SLOW_WINDOW_S)
    started = time.monotonic()
    plain = [s for s in schedulers if s not in SPINNING]
    spinning = [s for s in schedulers if s in SPINNING]
    slow = sum(POOLED.get(period, 1) + 1 for period in (0.1, 0.5))  # alone, and beside jobs
    results = []
    # Through the module: tests/servers.py (and redis) load here, not in every child.
    with _common.RedisServer.start(data_dir=workdir / "redis-precision") as server:
        redis_server = _common.redis_version(server)
        for periods, window_s, phases in (
            ((0.01,), fast_s, ((0,), (BACKGROUND_JOBS,))),
            ((0.1, 0.5), slow_s, ((0, BACKGROUND_JOBS),)),
        ):
            # At 10 ms the bursts of the rows beside 100 jobs outlast the period: no place in
            # the cycle is clear of them (see ``_layout``), so the rows alone have a phase of
            # their own.
            for group in (plain, spinning):
                for loads in phases:
                    with server.client() as client:
                        client.flushall()
                    results += _phase(
                        periods,
                        window_s,
                        group,
                        workdir,
                        extra_args=("--redis-url", server.url),
                        pooled=POOLED,
                        loads=loads,
                    )
    return {
        "settings": {
            "body_fraction": BODY_FRACTION,
            "background_jobs": BACKGROUND_JOBS,
            "background_period_s": BACKGROUND_PERIOD_S,
            "precision_s": PRECISION_S,
            "spin_s": SPIN_S,
            "window_s": {"10": fast_s, "100": slow_s, "500": slow_s},
            "store": "memory://",
            "defaults_on_redis": DEFAULTS_ON_REDIS,
            "redis_server": redis_server,
            "drift_points": DRIFT_POINTS,
            "pooled_processes": {str(round(p * 1000)): n for p, n in POOLED.items()},
            "concurrent_children": {"10": len(plain), "100+500": slow * len(plain)},
            "concurrent_spinning": {"10": len(spinning), "100+500": slow * len(spinning)},
            "stall_ms": STALL_S * 1000,
        },
        "schedulers": schedulers,
        "results": results,
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of a child process."""
    parser = argparse.ArgumentParser(description="tick-precision child process")
    parser.add_argument("role", choices=["child"])
    parser.add_argument("--scheduler", choices=SCHEDULERS + REDIS_SCHEDULERS, required=True)
    parser.add_argument("--period", type=float, required=True)
    parser.add_argument("--background", type=int, default=0)
    parser.add_argument("--offset", type=float, default=0.0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--redis-url", help="the server of the REDIS_SCHEDULERS")
    args = parser.parse_args(argv)
    result = asyncio.run(child(args))
    args.out.write_text(json.dumps(result))
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
