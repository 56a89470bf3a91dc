"""The chaos harness: replica processes, a faulted Redis, an unfaulted witness, and checks.

A :class:`Cluster` belongs to one test. It starts replica processes (``replica.py``, bare
asyncio or uvicorn) in sessions of their own, optionally behind a :class:`FaultProxy` or
under libfaketime, reads their journals (``checker.py``) and kills every process it started
when the test ends. The faulted redis-server comes from the ``fresh_redis`` fixture; the
witness is the session's shared server, which no test faults.

Settings scale the library's defaults down (heartbeat 0.1 s, lock expiry 0.5 s) so that each
row takes seconds; ``SJTEST_CHAOS_FULL=1`` runs every row, with repetitions.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fault_proxy import FaultProxy
from servers import HOST, RedisServer, RedisServerFactory, free_port
from waiting import wait_until

from fastapi_singletonjob._timing import lease_deadline

from .checker import Event, JournalReader, Run, Term, build_runs, terms
from .replica import CONFIG_ENV, JobConfig, ReplicaConfig, counter_key, fence_keys, now

__all__ = [
    "FULL",
    "STARTUP_S",
    "TOL_S",
    "Cluster",
    "Replica",
    "Results",
    "Timing",
    "faketime_env",
    "faketime_problem",
    "full_only",
    "libfaketime",
    "needs_faketime",
    "now",
    "reps",
]

FULL_ENV = "SJTEST_CHAOS_FULL"
FULL = os.environ.get(FULL_ENV, "") not in ("", "0")
"""Run the whole matrix with repetitions (else: each fault once, the CI subset)."""

FAKETIME_ENV = "SJTEST_LIBFAKETIME"
_FAKETIME_PATHS = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)

TESTS_DIR = Path(__file__).resolve().parent.parent
STARTUP_S = 30.0  # several interpreters importing FastAPI at once, on a busy 2-core machine
EXIT_S = 15.0
TOL_S = 0.25
"""Scheduling slack added to every timing bound: a busy, shared two-core machine."""
POLL_S = 0.01
HTTP_TIMEOUT_S = 5.0


def reps(full: int, default: int = 1) -> range:
    """Repetitions of a row: ``full`` in the full run, ``default`` in the CI subset."""
    return range(full if FULL else default)


full_only = pytest.mark.skipif(
    not FULL, reason=f"full chaos matrix only: set {FULL_ENV}=1 (nox -s chaos)"
)


def libfaketime() -> str | None:
    """Path of libfaketime's shared object, or None when it is not installed."""
    override = os.environ.get(FAKETIME_ENV)
    candidates = [override] if override else list(_FAKETIME_PATHS)
    return next((path for path in candidates if path and os.path.isfile(path)), None)


needs_faketime = pytest.mark.skipif(
    libfaketime() is None,
    reason=f"libfaketime is not installed (apt-get install faketime, or set {FAKETIME_ENV})",
)


def faketime_env(library: str, clock_file: Path) -> dict[str, str]:
    """The environment that puts a process under libfaketime the way a real NTP step moves
    a machine's clocks: ``CLOCK_REALTIME`` follows the offset in ``clock_file`` (re-read on
    every clock call), ``CLOCK_MONOTONIC`` and ``CLOCK_BOOTTIME`` (lease deadlines, asyncio's
    timers, the journal) are left alone, as the kernel leaves them when the wall clock steps.

    Two libfaketime bugs bite such a process (0.9.10, Debian 12's, on glibc >= 2.30), both
    because libfaketime converts *absolute monotonic deadlines* as if monotonic time were
    faked, even with ``FAKETIME_DONT_FAKE_MONOTONIC=1``:

    - ``pthread_cond_timedwait`` on a ``CLOCK_MONOTONIC`` condition variable gets a deadline
      in the distant past and returns at once. CPython's GIL hand-off is such a wait (5 ms),
      so with two busy threads the waiting one spins and the process runs about 100 times
      slower. ``FAKETIME_FORCE_MONOTONIC_FIX=0`` makes libfaketime pass the deadline through
      unchanged, which is exactly right when monotonic time is not faked (fixed upstream
      after 0.9.12).
    - ``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)`` gets a negative deadline: EINVAL.
      Python >= 3.11 implements ``time.sleep`` with it, so ``time.sleep`` raises
      ``OSError: [Errno 22] Invalid argument`` in every thread, at every offset (``+0``
      too). No setting avoids it (fixed in 0.9.11, libfaketime issue #426): the replica
      blocks with ``replica.blocking_sleep`` instead, and the library never calls
      ``time.sleep``. A real NTP step does neither of these things.
    """
    return {
        "LD_PRELOAD": library,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "FAKETIME_FORCE_MONOTONIC_FIX": "0",
        "FAKETIME_NO_CACHE": "1",
        "FAKETIME_TIMESTAMP_FILE": str(clock_file),
    }


_CLOCKS_PROBE = (
    "import time; print(time.clock_gettime(time.CLOCK_REALTIME), "
    "time.clock_gettime(time.CLOCK_MONOTONIC), time.clock_gettime(time.CLOCK_BOOTTIME))"
)
_PROBE_STEP_S = 3600.0


def _clocks() -> tuple[float, float, float]:
    return (
        time.clock_gettime(time.CLOCK_REALTIME),
        time.clock_gettime(time.CLOCK_MONOTONIC),
        time.clock_gettime(time.CLOCK_BOOTTIME),
    )


@functools.cache
def faketime_problem(library: str) -> str | None:
    """None when ``faketime_env`` models an NTP step with ``library``: a child process sees
    its wall clock stepped by +1 h and its monotonic and boot-time clocks unchanged (those
    clocks are machine-wide, so the child's readings must fall between two of this
    process's). Else what is wrong: the clock rows would not test what they claim to.
    Checked once per session."""
    with tempfile.TemporaryDirectory() as tmp:
        clock_file = Path(tmp) / "probe.faketime"
        clock_file.write_text(f"{_PROBE_STEP_S:+.6f}\n")
        env = {**os.environ, **faketime_env(library, clock_file)}
        before = _clocks()
        done = subprocess.run(
            [sys.executable, "-c", _CLOCKS_PROBE],
            env=env,
            capture_output=True,
            text=True,
            timeout=STARTUP_S,
            check=False,
        )
        after = _clocks()
    try:
        seen = tuple(float(x) for x in done.stdout.split())
    except ValueError:
        seen = ()
    if done.returncode != 0 or len(seen) != 3:
        return f"python under {library} failed (exit {done.returncode}): {done.stderr[-500:]}"
    step = (_PROBE_STEP_S, 0.0, 0.0)
    wrong = [
        f"{name} moved by {value - low:+.3f} s, not {offset:+.0f} s"
        for name, value, low, high, offset in zip(
            ("CLOCK_REALTIME", "CLOCK_MONOTONIC", "CLOCK_BOOTTIME"),
            seen,
            before,
            after,
            step,
            strict=True,
        )
        if not low + offset - 0.001 <= value <= high + offset + 0.001
    ]
    if wrong:
        return f"{library} does not model an NTP step (only the wall clock moves): " + "; ".join(
            wrong
        )
    return None


@dataclass(frozen=True)
class Timing:
    """The library settings of a row (the CI defaults: sub-second)."""

    heartbeat: float = 0.1
    lock_expiry: float = 0.5
    max_backoff: float = 1.0
    shutdown_timeout: float = 1.0

    @property
    def lease_s(self) -> float:
        """How long after sending a renewal a leader may act on it (the lease deadline)."""
        return lease_deadline(0.0, self.lock_expiry)


@dataclass
class Replica:
    """One replica process: bare asyncio (``python -m chaos.replica``) or uvicorn."""

    name: str
    config: ReplicaConfig
    workdir: Path
    http: bool = False
    clock_offset: float | None = None
    server: tuple[str, ...] = ()
    """A server's command line after ``python -m`` (``{host}`` and ``{port}`` filled in), e.g.
    ``("gunicorn", "-w", "2", ...)``, serving ``chaos.server_app:app``; else uvicorn or bare."""
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    killed_at: float | None = None
    spawns: int = 0
    exits: dict[int, float] = field(default_factory=dict)
    """Journal-clock time at which each pid of this replica was seen to exit (a watcher
    thread waits on every process, so the time is exact to a few milliseconds)."""
    reader: JournalReader = field(init=False)

    def __post_init__(self) -> None:
        self.reader = JournalReader(self.journal)

    @property
    def journal(self) -> Path:
        """The journal file (JSON lines)."""
        return Path(self.config.journal)

    @property
    def log(self) -> Path:
        """Everything the process wrote to stdout and stderr."""
        return self.workdir / f"{self.name}.log"

    @property
    def clock_file(self) -> Path:
        """libfaketime's timestamp file for this replica (``FAKETIME_TIMESTAMP_FILE``)."""
        return self.workdir / f"{self.name}.faketime"

    @property
    def url(self) -> str:
        """Base HTTP URL (uvicorn replicas)."""
        return f"http://{HOST}:{self.port}"

    @property
    def process(self) -> subprocess.Popen[bytes]:
        """The current process."""
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc

    @property
    def pid(self) -> int:
        """Pid of the current process."""
        return self.process.pid

    @property
    def alive(self) -> bool:
        """True while the process exists (a stopped process counts)."""
        return self.proc is not None and self.proc.poll() is None

    def spawn(self) -> None:
        """Start the process (again); its journal and log are appended to."""
        self.spawns += 1
        self.killed_at = None
        config_path = self.workdir / f"{self.name}.json"
        self.config.dump(config_path)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SINGLETONJOB_")}
        env.update(
            PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")])),
            PYTHONUNBUFFERED="1",
            PYTHONDONTWRITEBYTECODE="1",
        )
        if self.clock_offset is not None:
            library = libfaketime()
            assert library is not None, "libfaketime is not installed"
            problem = faketime_problem(library)
            assert problem is None, problem
            self.set_clock(self.clock_offset)
            env.update(faketime_env(library, self.clock_file))
        if self.server:
            self.port = free_port()
            env[CONFIG_ENV] = str(config_path)
            args = [
                sys.executable,
                "-m",
                *(a.format(host=HOST, port=self.port) for a in self.server),
            ]
        elif self.http:
            self.port = free_port()
            env[CONFIG_ENV] = str(config_path)
            args = [
                *(sys.executable, "-m", "uvicorn", "--factory", "chaos.replica:create_app"),
                *("--host", HOST, "--port", str(self.port), "--no-access-log"),
            ]
        else:
            args = [sys.executable, "-m", "chaos.replica", "--config", str(config_path)]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                args,
                cwd=TESTS_DIR,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = self.proc
        threading.Thread(target=self._watch, args=(proc,), daemon=True).start()

    def _watch(self, proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(Exception):
            proc.wait()
            self.exits[proc.pid] = now()

    def set_clock(self, offset_s: float) -> None:
        """Set the replica's wall clock to real time plus ``offset_s`` (libfaketime reads
        the file on every clock call); the rename makes the change atomic."""
        self.clock_offset = offset_s
        temporary = self.clock_file.with_suffix(".tmp")
        temporary.write_text(f"{offset_s:+.6f}\n")
        temporary.replace(self.clock_file)

    def events(self) -> list[Event]:
        """Every event this replica journaled so far (all its processes)."""
        return self.reader.poll()

    def send(self, signum: signal.Signals) -> float:
        """Send ``signum`` to the process; return when (journal clock) it was sent."""
        at = now()
        os.kill(self.pid, signum)
        return at

    def kill(self) -> float:
        """SIGKILL the process and its session; return when it was sent."""
        at = now()
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.killed_at = at
        return at

    async def pause(self) -> float:
        """SIGSTOP the process; return when it was sent, once the kernel shows it stopped."""
        at = self.send(signal.SIGSTOP)
        await self._wait_state(stopped=True)
        return at

    async def resume(self) -> float:
        """SIGCONT the process; return when it was sent."""
        at = self.send(signal.SIGCONT)
        await self._wait_state(stopped=False)
        return at

    def terminate(self) -> float:
        """SIGTERM the process, as an orchestrator does; return when it was sent."""
        return self.send(signal.SIGTERM)

    async def wait_exit(self, timeout_s: float = EXIT_S) -> int:
        """Wait (bounded) for the process to exit; return its exit code."""
        proc = self.process
        await wait_until(lambda: proc.poll() is not None, timeout_s, f"{self.name} exits")
        assert proc.returncode is not None
        return proc.returncode

    async def _wait_state(self, *, stopped: bool) -> None:
        stat = Path(f"/proc/{self.pid}/stat")

        def state_is_stopped() -> bool:
            return stat.read_text().rpartition(")")[2].split()[0] in ("T", "t")

        await wait_until(lambda: state_is_stopped() == stopped, 5.0, f"{self.name} stop state")

    def output(self) -> str:
        """The process's output so far."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, lines: int = 25) -> str:
        """The last lines of the output."""
        return "\n".join(self.output().splitlines()[-lines:])

    def bind_failed(self) -> bool:
        """True when a uvicorn replica exited because another process took its port."""
        return self.http and not self.alive and "address already in use" in self.output()

    def close(self) -> None:
        """Kill the process and its session and reap it."""
        if self.proc is None:
            return
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(EXIT_S)


class Results:
    """Measured numbers of every chaos row of the session, for the summary and the docs."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, row: str, test: str, **metrics: Any) -> None:
        """Record one repetition of a row."""
        self.rows.append({"row": row, "test": test, **metrics})
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())
        print(f"[chaos row {row}] {shown}")

    def dump(self, path: Path) -> None:
        """Write every record as JSON."""
        path.write_text(json.dumps(self.rows, indent=1, default=str))

    def lines(self) -> list[str]:
        """One line per record, for the terminal summary."""
        return [
            f"row {r['row']:>4}: "
            + ", ".join(f"{k}={_fmt(v)}" for k, v in r.items() if k not in ("row", "test"))
            for r in self.rows
        ]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


class Cluster:
    """The processes, proxies and journals of one chaos test."""

    def __init__(
        self,
        workdir: Path,
        project: str,
        *,
        witness: RedisServer,
        servers: RedisServerFactory,
        http: httpx.AsyncClient,
    ) -> None:
        self.workdir = workdir
        self.project = project
        self.witness = witness
        self._servers = servers
        self.http = http
        self.store: RedisServer | None = None
        self.replicas: dict[str, Replica] = {}
        self.proxies: list[FaultProxy] = []
        self.timing = Timing()

    # -- processes --------------------------------------------------------------------------

    def redis(self, *, appendonly: bool = False, extra_args: Sequence[str] = ()) -> RedisServer:
        """Start the redis-server that this test faults (the lease store)."""
        self.store = self._servers(appendonly=appendonly, extra_args=extra_args)
        return self.store

    async def read_replica(self, timeout_s: float = 10.0) -> RedisServer:
        """Start a second redis-server replicating the store (``--replicaof``, read-only as
        by default) and return it once its link to the store is up; killed at teardown."""
        primary = self.store
        assert primary is not None, "start the store with cluster.redis() first"
        with primary.client() as client:  # start the first sync at once, not 5 s later
            client.config_set("repl-diskless-sync-delay", 0)
        server = self._servers(extra_args=("--replicaof", HOST, str(primary.port)))

        def in_sync() -> bool:
            with server.client() as client:
                info = client.info("replication")
            return str(info.get("master_link_status")) == "up"

        await self.wait(in_sync, timeout_s, "the replica is in sync with the store", poll_s=0.05)
        return server

    def replica(
        self,
        name: str,
        jobs: Sequence[JobConfig],
        *,
        url: str | None = None,
        timing: Timing | None = None,
        http: bool = False,
        clock_offset: float | None = None,
        electors: int = 1,
        client_pool: int = 0,
        password: str | None = None,
        username: str | None = None,
        extra: dict[str, Any] | None = None,
        watch_loop: bool = False,
        server: Sequence[str] = (),
        start: bool = True,
    ) -> Replica:
        """Configure (and by default start) a replica; ``url`` defaults to the store.
        ``watch_loop``: journal every stall of its event loop (``stalls``)."""
        timing = timing or self.timing
        if url is None:
            assert self.store is not None, "start the store with cluster.redis() first"
            url = self.store.url
        config = ReplicaConfig(
            node=name,
            project=self.project,
            url=url,
            journal=str(self.workdir / f"{name}.jsonl"),
            witness_url=self.witness.url,
            jobs=list(jobs),
            heartbeat=timing.heartbeat,
            lock_expiry=timing.lock_expiry,
            max_backoff=timing.max_backoff,
            shutdown_timeout=timing.shutdown_timeout,
            password=password,
            username=username,
            electors=electors,
            client_pool=client_pool,
            extra=extra or {},
            watch_loop=watch_loop,
        )
        replica = Replica(
            name,
            config,
            self.workdir,
            http=http or bool(server),
            clock_offset=clock_offset,
            server=tuple(server),
        )
        assert name not in self.replicas, f"replica {name} exists"
        self.replicas[name] = replica
        if start:
            replica.spawn()
        return replica

    async def ready(self, *replicas: Replica, timeout_s: float = STARTUP_S) -> None:
        """Wait until each replica journaled ``ready`` (its lifespan startup completed) since
        its latest spawn, and a uvicorn replica answers HTTP too (uvicorn binds its port after
        the startup); uvicorn replicas that lost their port are started again."""

        async def is_ready(replica: Replica) -> bool:
            if replica.bind_failed() and replica.spawns < 3:
                replica.spawn()
                return False
            if not replica.alive:
                raise AssertionError(f"{replica.name} exited\n{self.describe()}")
            if not any(e.ev == "ready" and e.pid == replica.pid for e in replica.events()):
                return False
            return not replica.http or await self.get(replica, "/") is not None

        async def all_ready() -> bool:
            return all([await is_ready(replica) for replica in replicas])

        await self.wait(all_ready, timeout_s, "every replica is ready")

    async def proxy(self, server: RedisServer | None = None) -> FaultProxy:
        """A fault proxy in front of ``server`` (default: the store), closed at teardown."""
        target = server or self.store
        assert target is not None
        proxy = FaultProxy(HOST, target.port)
        await proxy.start()
        self.proxies.append(proxy)
        return proxy

    # -- journals ---------------------------------------------------------------------------

    def events(self) -> list[Event]:
        """Every replica's events, in time order."""
        found = [event for r in self.replicas.values() for event in r.events()]
        return sorted(found, key=lambda e: e.t)

    def runs(self, job: str | None = None, until: float | None = None) -> list[Run]:
        """Runs (of ``job``), in start order. A run without an end lasts until its process
        was killed, or until ``until`` (default: now)."""
        cutoff = now() if until is None else until
        cutoffs = {}
        for replica in self.replicas.values():
            cutoffs.update(replica.exits)
            if replica.killed_at is not None and replica.proc is not None:
                cutoffs[replica.proc.pid] = replica.killed_at
        events = [e for e in self.events() if job is None or e.job == job]
        return build_runs(events, cutoffs, cutoff)

    def terms(self, job: str) -> list[Term]:
        """The leadership terms of ``job`` so far."""
        return terms(self.events(), job)

    def stalls(self, replica: Replica, since: float = 0.0) -> list[float]:
        """How long each event-loop stall of ``replica`` (started with ``watch_loop``) that
        ended after ``since`` lasted, in seconds."""
        return [float(e.data["late"]) for e in replica.events() if e.ev == "stall" and e.t > since]

    def leader(self, job: str) -> str | None:
        """Node id of the latest term of ``job``."""
        found = self.terms(job)
        return found[-1].node if found else None

    def replica_of(self, node: str) -> Replica:
        """The replica process whose node id is ``node`` (``name`` or ``name.i``)."""
        return self.replicas[node.split(".")[0]]

    def witness_counter(self, job: str) -> int:
        """The lost-update counter of ``job``."""
        with self.witness.client() as client:
            return int(client.get(counter_key(self.project, job)) or 0)

    def witness_fence(self, job: str) -> tuple[int, int]:
        """The fenced register of ``job``: ``(accepted, rejected)`` writes."""
        _, rejected, accepted = fence_keys(self.project, job)
        with self.witness.client() as client:
            return int(client.get(accepted) or 0), int(client.get(rejected) or 0)

    def log_has(self, text: str, *replicas: Replica) -> bool:
        """True when any of ``replicas`` (default: all) logged ``text``."""
        return any(text in r.output() for r in (replicas or self.replicas.values()))

    # -- waiting ----------------------------------------------------------------------------

    async def wait(
        self,
        predicate: Callable[[], bool | Awaitable[bool]],
        timeout_s: float,
        what: str,
        *,
        poll_s: float = POLL_S,
    ) -> float:
        """Like ``waiting.wait_until``, but on the journal clock and with every replica's
        log in the failure message. Returns when the predicate was first seen true."""
        try:
            await wait_until(predicate, timeout_s, what, poll_s=poll_s)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.describe()}") from None
        return now()

    async def until_runs(self, job: str, count: int, *, since: float, timeout_s: float) -> None:
        """Wait until ``count`` runs of ``job`` have started since ``since``."""
        await self.wait(
            lambda: sum(r.start >= since for r in self.runs(job)) >= count,
            timeout_s,
            f"{count} runs of {job} since {since:.3f}",
        )

    async def wait_leader(self, job: str, timeout_s: float = STARTUP_S) -> str:
        """Wait until some node has become leader of ``job``; return its node id."""
        await self.wait(lambda: bool(self.terms(job)), timeout_s, f"a leader of {job}")
        leader = self.leader(job)
        assert leader is not None
        return leader

    async def one_leader(self, job: str, timeout_s: float = STARTUP_S) -> str:
        """Wait until ``job`` has run at least three times; return its leader's node id."""
        await self.until_runs(job, 3, since=0.0, timeout_s=timeout_s)
        leader = self.leader(job)
        assert leader is not None
        return leader

    def in_flight(self, job: str, node: str) -> Run | None:
        """The run of ``job`` that ``node`` has started and not ended, if any."""
        open_runs = [r for r in self.runs(job) if r.node == node and r.outcome == "unfinished"]
        return open_runs[-1] if open_runs else None

    async def mid_run(self, job: str, node: str, timeout_s: float = 10.0) -> Run:
        """Wait until ``node`` is in the middle of a run of ``job``; return that run."""
        await self.wait(
            lambda: self.in_flight(job, node) is not None,
            timeout_s,
            f"{node} runs {job}",
            poll_s=0.002,
        )
        run = self.in_flight(job, node)
        assert run is not None
        return run

    async def first_run(self, job: str, *, after: float, newer_than: int, timeout_s: float) -> Run:
        """Wait for the first run of ``job`` that started after ``after`` with a token
        greater than ``newer_than`` (a new term); return it."""

        def found() -> Run | None:
            return next(
                (r for r in self.runs(job) if r.start > after and r.token > newer_than), None
            )

        await self.wait(lambda: found() is not None, timeout_s, f"a new term of {job} runs")
        run = found()
        assert run is not None
        return run

    async def sleep(self, seconds: float) -> None:
        """Hold a fault for a fixed duration (the only kind of sleep the suite allows)."""
        await asyncio.sleep(seconds)

    async def get(self, replica: Replica, path: str) -> httpx.Response | None:
        """GET on a uvicorn replica; None when it does not answer."""
        try:
            return await self.http.get(replica.url + path)
        except httpx.TransportError:
            return None

    # -- teardown ---------------------------------------------------------------------------

    def describe(self) -> str:
        """Exit codes and log tails of every replica, for assertion messages."""
        parts = []
        for replica in self.replicas.values():
            code = replica.proc.poll() if replica.proc is not None else None
            parts.append(f"--- {replica.name} (exit {code}):\n{replica.tail()}")
        if self.store is not None:
            parts.append(f"--- store {self.store.url}:\n{self.store.log_tail(8)}")
        return "\n".join(parts)

    async def aclose(self) -> None:
        """Kill every replica (with its session) and close every proxy."""
        try:
            for replica in self.replicas.values():
                replica.close()
        finally:
            for proxy in self.proxies:
                await proxy.close()


def node_runs(runs: Iterable[Run], node: str) -> list[Run]:
    """The runs of one node."""
    return [run for run in runs if run.node == node]
