"""One replica of the chaos suite's service, run as a process of its own.

Two ways to run it, both configured by a JSON file written by the harness (``harness.py``):

- bare asyncio: ``python -m chaos.replica --config n1.json``; SIGTERM stops it gracefully;
- uvicorn: ``CHAOS_REPLICA_CONFIG=n1.json python -m uvicorn --factory chaos.replica:create_app``,
  with the library's status router under ``/sj``.

Each job run appends JSON lines to the replica's journal: ``start`` (with the fencing token and
the scheduled instant), one ``write`` per fenced write to the witness, and ``end`` (with its
outcome), so that a run cut short by SIGKILL is still on record. The library's own transitions
(``lead``, ``lost``, ``released``, ``fail``, ``reached``) are journaled from its log records.
A ``cursor`` job also journals the checkpoint it was given in its ``start`` event (``state``,
``iteration``, ``cp_token``: the term that wrote the record) and each ``save_state``: ``saving``
before the call, ``saved`` after it (``ok``, or the error's type). Every ``t`` is
``CLOCK_MONOTONIC`` seconds, shared by every process of the machine and left
alone by libfaketime (``FAKETIME_DONT_FAKE_MONOTONIC=1``); ``scheduled`` is wall-clock time as
the replica sees it (faked, under libfaketime).

The witness is a second redis-server that the tests never fault:

- a lost-update counter per job: a run GETs it, works, and SETs it to the value read plus one;
  a final value below the number of completed runs means two runs overlapped;
- a fenced register per job (``FENCE_SCRIPT``): a write whose token is below the highest token
  seen is rejected and counted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import select
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import redis
import redis.asyncio
from fastapi import FastAPI

from fastapi_singletonjob import DropReason, JobContext, SingletonJobs
from fastapi_singletonjob._run.runner import JobRunner

__all__ = [
    "CONFIG_ENV",
    "FENCE_SCRIPT",
    "STALL_S",
    "JobConfig",
    "ReplicaConfig",
    "blocking_sleep",
    "counter_key",
    "create_app",
    "fence_keys",
    "main",
]

CONFIG_ENV = "CHAOS_REPLICA_CONFIG"
"""Environment variable naming the JSON config file (uvicorn mode)."""

Behavior = Literal[
    "witness",  # fenced writes and the lost-update counter around `run_s` of async work
    "raise",  # raise RuntimeError
    "system_exit",  # raise a SystemExit subclass
    "keyboard_interrupt",  # raise a KeyboardInterrupt subclass
    "hang",  # await an event that is never set
    "ignore_cancel",  # like witness, but keep going for `hold_s` after a cancellation
    "block_loop",  # like witness, but run `block_on` blocks the event loop for `hold_s`
    "thread_sleep",  # a sync job (run in a thread): fenced writes around time.sleep steps
    "pool_hog",  # hold every connection of the application's own client with BLPOP
    "cursor",  # resume from ctx.checkpoint.state, then `steps` save_state calls of cursor + 1
]

# Fenced register: rejects a token below the highest seen.
#
# KEYS[1] - highest token accepted   KEYS[2] - count of rejected writes
# KEYS[3] - count of accepted writes ARGV[1] - the writer's fencing token
#
# Returns 1 when the write is accepted, 0 when it is rejected as stale. Tokens are below 2^53,
# so Lua's doubles compare them exactly.
FENCE_SCRIPT = """
local high = tonumber(redis.call('GET', KEYS[1]) or '0')
local token = tonumber(ARGV[1])
if token < high then
  redis.call('INCR', KEYS[2])
  return 0
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('INCR', KEYS[3])
return 1
"""


STALL_S = 0.05
"""A replica started with ``watch_loop`` journals every event-loop stall longer than this."""
_WATCH_PERIOD_S = 0.01


def now() -> float:
    """The journal clock: ``CLOCK_MONOTONIC``, comparable across the machine's processes."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def blocking_sleep(seconds: float) -> None:
    """``time.sleep`` that also works under libfaketime 0.9.10 (see ``harness.faketime_env``:
    there ``time.sleep`` raises EINVAL on Python >= 3.11). ``select`` waits a relative
    timeout, which libfaketime leaves alone, and Python resumes it after a signal."""
    select.select([], [], [], max(seconds, 0.0))


def counter_key(project: str, job: str) -> str:
    """The witness's lost-update counter of ``job``."""
    return f"witness:{project}:{job}:counter"


def fence_keys(project: str, job: str) -> list[str]:
    """The witness's fenced register of ``job``: highest token, rejected, accepted."""
    return [f"witness:{project}:{job}:fence:{part}" for part in ("high", "rejected", "accepted")]


@dataclass
class JobConfig:
    """One job of the replica."""

    name: str
    kind: Literal["rate", "interval", "cron"] = "rate"
    every: float = 0.1
    expression: str = "* * * * * *"
    timezone: str = "UTC"
    misfire_grace: float | None = None
    behavior: Behavior = "witness"
    run_s: float = 0.02
    steps: int = 1
    policy: Literal["finish", "cancel"] = "finish"
    timeout: float | None = None
    hold_s: float = 0.0
    block_on: int = 0
    checkpoint: bool = True
    """Keep the job's checkpoint (one Redis call after each run)."""


@dataclass
class ReplicaConfig:
    """Everything one replica process needs; written as JSON by the harness."""

    node: str
    project: str
    url: str
    journal: str
    witness_url: str
    jobs: list[JobConfig]
    heartbeat: float
    lock_expiry: float
    max_backoff: float
    shutdown_timeout: float
    password: str | None = None
    username: str | None = None
    electors: int = 1
    client_pool: int = 0
    """Above 0: pass ``redis=`` an application client with this many connections at most."""
    extra: dict[str, Any] = field(default_factory=dict)
    watch_loop: bool = False
    """Journal a ``stall`` (its length in ``late``) whenever the event loop did not run for
    more than ``STALL_S``: what a blocking call costs the election's heartbeats."""
    placement: str = "first"
    """The rows judge terms and handovers that faults cause: first-come leadership, so that
    no placement handover counts among them (tests/test_spread.py tests ``spread``)."""

    def dump(self, path: Path) -> None:
        """Write the config as JSON."""
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> ReplicaConfig:
        """Read a config written by :meth:`dump`."""
        raw = json.loads(path.read_text())
        raw["jobs"] = [JobConfig(**job) for job in raw["jobs"]]
        return cls(**raw)


class Journal:
    """Append-only JSON lines; one ``os.write`` per line, so lines never interleave."""

    def __init__(self, path: Path, node: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.node = node

    def write(self, ev: str, **fields: object) -> None:
        """Append one event, stamped with ``CLOCK_MONOTONIC``, this node and this pid."""
        row: dict[str, object] = {"ev": ev, "node": self.node, "pid": os.getpid(), "t": now()}
        row.update(fields)
        os.write(self._fd, (json.dumps(row) + "\n").encode())

    def close(self) -> None:
        """Close the file."""
        os.close(self._fd)


class JournalHandler(logging.Handler):
    """Journals the library's leadership and store transitions from its log records."""

    _EVENTS = (
        ("node %s became leader of job %r", "lead"),
        ("node %s lost leadership of job %r", "lost"),
        ("node %s released leadership of %s", "released"),
        ("node %s cannot reach the lease store", "fail"),
        ("node %s reaches the lease store again", "reached"),
    )

    def __init__(self, journal: Journal) -> None:
        super().__init__(logging.DEBUG)
        self.journal = journal

    def emit(self, record: logging.LogRecord) -> None:
        """Turn a known record into a journal event; ignore the rest."""
        message = str(record.msg)
        args = record.args if isinstance(record.args, tuple) else ()
        for prefix, ev in self._EVENTS:
            if message.startswith(prefix) and args:
                fields: dict[str, object] = {
                    "node": args[0],
                    "text": record.getMessage(),
                    "wall": record.created,
                }
                if ev in ("lead", "lost"):
                    fields.update(job=args[1], token=_int_or_none(args[2]))
                elif ev == "released":
                    fields.update(jobs=str(args[1]).split(", "))
                elif ev in ("fail", "reached"):
                    fields.update(failures=args[1])
                self.journal.write(ev, **fields)
                return


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) else None


class JobExit(SystemExit):
    """A SystemExit subclass raised by a job."""


class JobInterrupt(KeyboardInterrupt):
    """A KeyboardInterrupt subclass raised by a job."""


class Node:
    """The ``SingletonJobs`` instances (electors) of one replica process and their jobs."""

    def __init__(self, config: ReplicaConfig) -> None:
        self.config = config
        self.journal = Journal(Path(config.journal), config.node)
        self.witness = redis.asyncio.Redis.from_url(
            config.witness_url, socket_timeout=5.0, decode_responses=True
        )
        self.sync_witness = redis.Redis.from_url(
            config.witness_url, socket_timeout=5.0, decode_responses=True
        )
        self.fence = self.witness.register_script(FENCE_SCRIPT)
        self.sync_fence = self.sync_witness.register_script(FENCE_SCRIPT)
        self._sync_runs = 0
        """Sync runs in flight: their threads use ``sync_witness`` until they return."""
        self.client: redis.asyncio.Redis | None = None
        if config.client_pool:
            # extra["no_handshake"]: RESP2 and no CLIENT SETINFO, so that a new connection
            # sends nothing before the caller's first command (redis-py 8 sends HELLO 3).
            setinfo: dict[str, Any] = (
                {"lib_name": None, "lib_version": None, "protocol": 2}
                if config.extra.get("no_handshake")
                else {}
            )
            self.client = redis.asyncio.Redis.from_url(
                config.url,
                max_connections=config.client_pool,
                password=config.password,
                username=config.username,
                **setinfo,
            )
        self._runs = itertools.count(1)
        """Numbers this process's runs: ``ctx.iteration`` repeats by design (a failed run keeps
        it, a store that lost the record restarts it), a run id must not."""
        self.electors = [self._elector(i) for i in range(config.electors)]

    def _elector(self, index: int) -> SingletonJobs:
        config = self.config
        node = config.node if config.electors == 1 else f"{config.node}.{index}"
        settings: dict[str, Any] = {
            "project": config.project,
            "node_id": node,
            "heartbeat_interval": config.heartbeat,
            "lock_expiry": config.lock_expiry,
            "max_backoff": config.max_backoff,
            "shutdown_timeout": config.shutdown_timeout,
            "placement": config.placement,
        }
        if config.extra.get("generated_node_id"):
            # Several workers of one server share this config: let the library draw an id per
            # process (after a fork too, as with gunicorn --preload).
            del settings["node_id"]
        if self.client is not None:
            jobs = SingletonJobs(redis=self.client, **settings)
        else:
            jobs = SingletonJobs(_with_credentials(config), **settings)
        for job in config.jobs:
            self._register(jobs, job)
        return jobs

    def _register(self, jobs: SingletonJobs, job: JobConfig) -> None:
        common: dict[str, Any] = {
            "on_leadership_lost": job.policy,
            "timeout": job.timeout,
            "checkpoint": job.checkpoint,
        }
        if job.kind == "rate":
            decorator = jobs.fixed_rate(job.name, every=job.every, **common)
        elif job.kind == "interval":
            decorator = jobs.interval(job.name, every=job.every, **common)
        else:
            decorator = jobs.cron(
                job.name,
                job.expression,
                timezone=job.timezone,
                misfire_grace=job.misfire_grace,
                **common,
            )
        decorator(self._body(job))

    def _body(self, job: JobConfig) -> Callable[..., Any]:
        if job.behavior == "thread_sleep":

            def sync_run(ctx: JobContext) -> None:
                self._sync_run(ctx, job)

            return sync_run

        async def run(ctx: JobContext) -> None:
            await self._run(ctx, job)

        return run

    # -- one run ----------------------------------------------------------------------------

    @staticmethod
    def _checkpoint(ctx: JobContext) -> dict[str, object]:
        """What a ``cursor`` run was given: the stored state, iteration and writing term."""
        checkpoint = ctx.checkpoint
        return {
            "state": None if checkpoint is None else checkpoint.state,
            "iteration": ctx.iteration,
            "cp_token": None if checkpoint is None else checkpoint.fencing_token,
        }

    def _base(self, ctx: JobContext, number: int) -> dict[str, object]:
        return {
            "job": ctx.job,
            "node": ctx.node_id,
            "token": ctx.fencing_token,
            "run": f"{ctx.node_id}:{os.getpid()}:{number}",
        }

    async def _fenced(self, ctx: JobContext, base: dict[str, object]) -> None:
        keys = fence_keys(self.config.project, ctx.job)
        sent = now()
        accepted = await self.fence(keys=keys, args=[ctx.fencing_token])
        self.journal.write("write", ok=bool(accepted), sent=sent, **base)

    async def _run(self, ctx: JobContext, job: JobConfig) -> None:
        number = next(self._runs)
        base = self._base(ctx, number)
        given = self._checkpoint(ctx) if job.behavior == "cursor" else {}
        self.journal.write(
            "start",
            scheduled=ctx.scheduled_at.timestamp(),
            started_at=ctx.started_at.timestamp(),
            **given,
            **base,
        )
        outcome = "error"
        try:
            await self._behave(ctx, job, base, number)
            outcome = "ok"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self.journal.write("end", outcome=outcome, **base)

    async def _behave(
        self, ctx: JobContext, job: JobConfig, base: dict[str, object], number: int
    ) -> None:
        behavior = job.behavior
        if behavior == "raise":
            raise RuntimeError(f"job {ctx.job} fails on purpose")
        if behavior == "system_exit":
            raise JobExit(3)
        if behavior == "keyboard_interrupt":
            raise JobInterrupt
        if behavior == "hang":
            await asyncio.Event().wait()
        if behavior == "pool_hog":
            await self._hog(job, base)
            return
        if behavior == "cursor":
            await self._cursor(ctx, job, base)
            return
        counter = counter_key(self.config.project, ctx.job)
        await self._fenced(ctx, base)
        value = int(await self.witness.get(counter) or 0)
        if behavior == "block_loop" and number == job.block_on:
            self.journal.write("block", seconds=job.hold_s, **base)
            blocking_sleep(job.hold_s)  # the fault: the event loop is blocked
            self.journal.write("unblock", **base)
        step_s = job.run_s / max(job.steps, 1)
        cancelled_at: float | None = None
        for _ in range(max(job.steps, 1)):
            try:
                await asyncio.sleep(step_s)
                await self._fenced(ctx, base)
            except asyncio.CancelledError:
                if behavior != "ignore_cancel":
                    raise
                cancelled_at = now()
                self.journal.write("cancel_ignored", **base)
                break
        if cancelled_at is not None:
            # Go on working for hold_s after the cancellation, ignoring further cancels.
            while (left := cancelled_at + job.hold_s - now()) > 0:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(min(step_s, left))
                with contextlib.suppress(asyncio.CancelledError):
                    await self._fenced(ctx, base)
        await self.witness.set(counter, value + 1)

    async def _cursor(self, ctx: JobContext, job: JobConfig, base: dict[str, object]) -> None:
        # The cursor pattern of docs/checkpoints.md: resume after the stored cursor, save each
        # step's. A refused or failed save ends the run (LeadershipLost: the next leader
        # resumes from the stored state).
        state = ctx.checkpoint.state if ctx.checkpoint is not None else None
        cursor = state if isinstance(state, int) else 0
        step_s = job.run_s / max(job.steps, 1)
        for _ in range(max(job.steps, 1)):
            await asyncio.sleep(step_s)
            cursor += 1
            self.journal.write("saving", value=cursor, **base)
            try:
                await ctx.save_state(cursor)
            except Exception as exc:  # LeadershipLost, ConnectionError: journaled, raised
                self.journal.write(
                    "saved", value=cursor, ok=False, error=type(exc).__name__, **base
                )
                raise
            self.journal.write("saved", value=cursor, ok=True, **base)

    async def _hog(self, job: JobConfig, base: dict[str, object]) -> None:
        # Ask for more connections than the application's pool has; the election must not
        # notice (it has a pool of its own).
        assert self.client is not None, "pool_hog needs client_pool > 0"
        client = self.client
        waits = [client.blpop([f"hog:{base['run']}:{i}"], timeout=job.run_s) for i in range(40)]
        results = await asyncio.gather(*waits, return_exceptions=True)
        errors = [type(r).__name__ for r in results if isinstance(r, BaseException)]
        self.journal.write("hogged", errors=len(errors), kinds=sorted(set(errors)), **base)

    def _sync_run(self, ctx: JobContext, job: JobConfig) -> None:
        base = self._base(ctx, next(self._runs))
        keys = fence_keys(self.config.project, ctx.job)
        self.journal.write("start", scheduled=ctx.scheduled_at.timestamp(), **base)
        outcome = "error"
        self._sync_runs += 1
        try:
            counter = counter_key(self.config.project, ctx.job)
            value = int(self.sync_witness.get(counter) or 0)
            for step in range(max(job.steps, 1) + 1):
                if step:
                    blocking_sleep(job.run_s / max(job.steps, 1))
                sent = now()
                accepted = self.sync_fence(keys=keys, args=[ctx.fencing_token])
                self.journal.write("write", ok=bool(accepted), sent=sent, **base)
            self.sync_witness.set(counter, value + 1)
            outcome = "ok"
        finally:
            self._sync_runs -= 1
            self.journal.write("end", outcome=outcome, **base)

    # -- lifecycle --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self, app: object = None) -> AsyncIterator[None]:
        """Start every elector; on exit stop them, journal their counters and close up."""
        watcher = asyncio.create_task(self._watch_loop()) if self.config.watch_loop else None
        try:
            async with contextlib.AsyncExitStack() as stack:
                for jobs in self.electors:
                    await stack.enter_async_context(jobs.lifespan(app))
                engines = [(jobs.node_id, jobs.engine) for jobs in self.electors]
                self.journal.write("ready", electors=[jobs.node_id for jobs in self.electors])
                yield
                self.journal.write("stopping", wall=time.time())
            for node, engine in engines:
                if engine is not None:
                    self._stats(node, engine.runners)
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            await self._close()

    async def _watch_loop(self) -> None:
        while True:
            asleep = now()
            await asyncio.sleep(_WATCH_PERIOD_S)
            late = now() - asleep - _WATCH_PERIOD_S
            if late > STALL_S:
                self.journal.write("stall", late=late, since=asleep + _WATCH_PERIOD_S)

    def _stats(self, node: str, runners: dict[str, JobRunner]) -> None:
        for name, runner in runners.items():
            stats = runner.stats
            self.journal.write(
                "stats",
                node=node,
                job=name,
                runs=stats.runs,
                failures=stats.failures,
                timeouts=stats.timeouts,
                cancelled=stats.cancelled,
                not_leader=stats.not_leader,
                dropped={reason.value: stats.dropped[reason] for reason in DropReason},
            )

    async def _close(self) -> None:
        self.journal.write("stopped")
        await self.witness.aclose()
        if not self._sync_runs:  # else a stuck thread still writes: closed at the exit
            self.sync_witness.close()
        if self.client is not None:
            await self.client.aclose()


def _with_credentials(config: ReplicaConfig) -> str:
    if config.password is None:
        return config.url
    scheme, rest = config.url.split("://", 1)
    user = config.username or ""
    return f"{scheme}://{user}:{config.password}@{rest}"


def setup_logging(config: ReplicaConfig, journal: Journal) -> None:
    """Send the library's records to stderr (the replica's log file) and to the journal."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(created).3f {config.node} %(name)s %(levelname)s %(message)s")
    )
    library = logging.getLogger("fastapi_singletonjob")
    library.addHandler(handler)
    library.addHandler(JournalHandler(journal))
    library.setLevel(logging.INFO)
    # Every failed round, not only the first, for the attempt counts of the backoff rows.
    logging.getLogger("fastapi_singletonjob.election").setLevel(logging.DEBUG)


def create_app() -> FastAPI:
    """The uvicorn factory: the replica as a FastAPI application."""
    config = ReplicaConfig.load(Path(os.environ[CONFIG_ENV]))
    node = Node(config)
    setup_logging(config, node.journal)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with node.running(app):
            yield

    app = FastAPI(title=f"chaos replica {config.node}", lifespan=lifespan)
    app.include_router(node.electors[0].router, prefix="/sj")
    return app


async def serve(config: ReplicaConfig) -> None:
    """Bare asyncio mode: run until SIGTERM, then stop gracefully."""
    node = Node(config)
    setup_logging(config, node.journal)
    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    async with node.running():
        await stopping.wait()


def main(argv: list[str] | None = None) -> int:
    """``python -m chaos.replica --config path``."""
    parser = argparse.ArgumentParser(description="chaos suite replica")
    parser.add_argument("--config", required=True, type=Path)
    args = parser.parse_args(argv)
    asyncio.run(serve(ReplicaConfig.load(args.config)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
