"""``SingletonJobs``: settings, job registration, and the lifespan that runs them; the status,
the routers and the operators' calls, delegated to ``_web`` and an ``AdminClient``."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Literal, TypeVar

from fastapi import APIRouter
from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import TracerProvider
from redis.asyncio import Redis, RedisCluster

from ._admin import AdminClient, opened_for_the_call, require_registered
from ._checkpoint import Checkpoint
from ._clock import SYSTEM_CLOCK, Clock
from ._config.redact import redact_url
from ._config.settings import Duration, Settings, is_name
from ._config.workers import memory_store_warning, this_process
from ._engine.engine import Engine
from ._engine.snapshot import EngineSnapshot
from ._errors import ConfigurationError, UsageError
from ._history import DEFAULT_HISTORY, Occurrence
from ._job.spec import (
    JobOptions,
    JobSpec,
    LeadershipLostPolicy,
    MisfirePolicy,
    ScheduleKind,
    cron_schedule,
    custom_schedule,
    fixed_rate_schedule,
    interval_schedule,
)
from ._outcomes import JobStats
from ._overdue import OverdueCallback
from ._schedule import Schedule
from ._store.base import Store
from ._store.open import open_store
from ._telemetry import Telemetry
from ._web.admin_router import create_admin_router
from ._web.models import ClusterStatus, NodeStatus
from ._web.router import create_router
from ._web.views import node_status

__all__ = ["SingletonJobs", "StatusView"]

logger = logging.getLogger("fastapi_singletonjob")

F = TypeVar("F", bound=Callable[..., Any])


class SingletonJobs:
    """A set of periodic jobs, each run by exactly one replica at a time.

    Every argument may also come from the environment (``SINGLETONJOB_REDIS_URL``,
    ``SINGLETONJOB_PROJECT``, ``SINGLETONJOB_NODE_ID``, ``SINGLETONJOB_HEARTBEAT_INTERVAL``,
    ``SINGLETONJOB_LOCK_EXPIRY``, ``SINGLETONJOB_MAX_BACKOFF``,
    ``SINGLETONJOB_SHUTDOWN_TIMEOUT``, ``SINGLETONJOB_PRECISION``,
    ``SINGLETONJOB_CHECKPOINT_RETENTION``, ``SINGLETONJOB_PLACEMENT``, ``SINGLETONJOB_HISTORY``;
    durations in seconds); explicit arguments win. A ``SINGLETONJOB_*`` variable that is none
    of these is warned of at startup.

    :param redis_url: ``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://host:port,...``
        (Redis Cluster), or ``memory://`` (one process only, for development and tests).
        Default ``redis://localhost:6379/0``.
    :param redis: a ``redis.asyncio.Redis`` or ``redis.asyncio.RedisCluster`` client you own,
        instead of ``redis_url``; the library copies its connection settings into a small
        pool of its own (without client-side retries) and never closes your client.
    :param project: namespaces every key; required (a shared default would let unrelated
        deployments elect each other).
    :param node_id: this replica's name in locks, logs and status; default pod or host name,
        pid and a short random suffix.
    :param heartbeat_interval: how often leases are renewed and free locks tried (3 s).
    :param lock_expiry: lease time; a dead leader is replaced about this long after its last
        renewal (10 s). Must ride out one failed renewal (a little over 2.1 heartbeats; the
        error gives the exact minimum); 3x or more is recommended.
    :param max_backoff: cap of the retry delay while the store is unreachable (30 s).
    :param shutdown_timeout: how long shutdown lets runs in flight finish before cancelling
        them (10 s).
    :param precision: opt-in tick precision: the timer wakes this long before each instant,
        starts the run then (held before the job's code) and yields to the event loop until
        the instant comes, so runs start within a fraction of a millisecond of their instant
        instead of the ~1-2 ms of asyncio's timer; costs CPU while it waits (0 = off, the
        default; 0.002 is a good value; at most 0.05).
    :param checkpoint_retention: how long a job's checkpoint outlives the last node that led
        it (30 days); a live job's record never expires.
    :param placement: ``"spread"`` (default): leadership of the jobs spreads over the live
        replicas, moved by graceful handovers; ``"first"``: the first node to ask leads
        (``SINGLETONJOB_PLACEMENT``).
    :param history: how many occurrences (runs, and instants not run with the reason) each
        job's history keeps in Redis, cluster-wide (100; 0 keeps none; ``jobs.history``,
        ``SINGLETONJOB_HISTORY``); a job's own ``history=`` wins.
    :param on_overdue: called with an ``OverdueEvent`` when a job's overdue spell begins
        (no run started within its period plus a grace): once per spell, on the one node whose
        check noticed it first, a coroutine function on the loop or a function in a thread,
        bounded (30 s); what it raises is logged. A job's own ``on_overdue=`` wins. See
        docs/operations.md, "Overdue jobs".
    :param clock: a ``FakeClock`` in tests; default the
        system clock.
    :param tracer_provider: OpenTelemetry tracer provider; default the global one.
    :param meter_provider: OpenTelemetry meter provider; default the global one.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        redis: Redis | RedisCluster | None = None,
        project: str | None = None,
        node_id: str | None = None,
        heartbeat_interval: Duration | None = None,
        lock_expiry: Duration | None = None,
        max_backoff: Duration | None = None,
        shutdown_timeout: Duration | None = None,
        precision: Duration | None = None,
        checkpoint_retention: Duration | None = None,
        placement: Literal["spread", "first"] | None = None,
        history: int | None = None,
        on_overdue: OverdueCallback | None = None,
        clock: Clock | None = None,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
    ) -> None:
        if is_name(redis_url):
            # SingletonJobs("myapp"): a name has no "://", so it is no URL; the first argument
            # is the URL, the project a keyword.
            raise ConfigurationError(
                f"redis_url={redis_url!r} is not a URL: the first argument of SingletonJobs is "
                f"the Redis URL; to name the project pass SingletonJobs(project={redis_url!r}), "
                "with the Redis as redis_url='redis://localhost:6379/0' (the default), or "
                "'memory://' for one process only",
                field="redis_url",
            )
        if redis_url is not None and redis is not None:
            raise ConfigurationError(
                "pass either redis_url= or redis=, not both", field="redis_url"
            )
        if redis is not None and not isinstance(redis, (Redis, RedisCluster)):
            raise ConfigurationError(
                f"redis={type(redis).__name__} is not a redis.asyncio.Redis or "
                "redis.asyncio.RedisCluster client; pass one, or use redis_url=",
                field="redis",
            )
        self.settings = Settings.build(
            redis_url=redis_url,
            has_client=redis is not None,
            project=project,
            node_id=node_id,
            heartbeat_interval=heartbeat_interval,
            lock_expiry=lock_expiry,
            max_backoff=max_backoff,
            shutdown_timeout=shutdown_timeout,
            precision=precision,
            checkpoint_retention=checkpoint_retention,
            placement=placement,
            history=history,
        )
        if on_overdue is not None and not callable(on_overdue):
            raise ConfigurationError(
                f"on_overdue={on_overdue!r} is not callable; pass a function or coroutine "
                "function that takes an OverdueEvent",
                field="on_overdue",
            )
        self._on_overdue = on_overdue
        self._client = redis
        self._kept: dict[str, JobStats] | None = None
        """Each job's counters and last run as the last stop left them (``status()``)."""
        self._clock: Clock = clock or SYSTEM_CLOCK
        self._specs: dict[str, JobSpec] = {}
        self._engine: Engine | None = None
        self._telemetry = Telemetry(
            self.settings.node_id, tracer_provider=tracer_provider, meter_provider=meter_provider
        )
        self._admin = self._admin_client()

    @property
    def node_id(self) -> str:
        """This replica's id."""
        return self.settings.node_id

    @property
    def project(self) -> str:
        """The project namespace."""
        return self.settings.project

    @property
    def jobs(self) -> dict[str, JobSpec]:
        """The registered jobs by name (a copy)."""
        return dict(self._specs)

    @property
    def clock(self) -> Clock:
        """The clock the library runs on."""
        return self._clock

    @property
    def store_description(self) -> str:
        """Where the leases are kept, without credentials."""
        if self._client is not None:
            return "<redis client passed in>"
        return redact_url(self.settings.redis_url or "")

    @property
    def engine(self) -> Engine | None:
        """The running machinery between startup and shutdown, else None."""
        return self._engine

    # -- status, routers and the operators' calls -----------------------------------------

    @functools.cached_property
    def router(self) -> APIRouter:
        """The status API and health probes: ``app.include_router(jobs.router, prefix=...)``.

        ``GET /jobs``, ``GET /jobs/{name}``, ``/jobs/{name}/history``, ``/cluster``,
        ``GET /health`` and ``/health/jobs`` (readiness), ``GET /health/live`` (liveness),
        and the status page in HTML, ``GET /ui``; see ``fastapi_singletonjob._web.router``.
        """
        return create_router(StatusView(self))

    @functools.cached_property
    def admin_router(self) -> APIRouter:
        """The operators' actions: ``POST /jobs/{name}/pause``, ``/resume``, ``/trigger`` and
        ``/step-down``. Include it behind the application's own authentication::

            app.include_router(jobs.admin_router, dependencies=[Depends(require_admin)])
        """
        return create_admin_router(self)

    async def cluster_status(self) -> ClusterStatus:
        """Every live node and every job of the project, as stored in Redis: the same from
        every replica (two round trips). Works before startup too."""
        return await self._admin.cluster_status()

    async def pause(self, job: str) -> None:
        """Pause ``job`` cluster-wide: its leader starts no new run (a run in flight goes on)
        from its next election round, which this call wakes at once. Stored in Redis, so it
        stays paused across restarts until ``resume``."""
        await self._admin.pause(job)

    async def resume(self, job: str) -> None:
        """Undo ``pause``: the job's next instant runs as usual."""
        await self._admin.resume(job)

    async def trigger(self, job: str) -> None:
        """Ask ``job``'s current leader for one extra run now (dropped, and logged on the
        leader, when a run is in flight or the job is paused). Taken once, by the leader's
        next election round, which this call wakes at once."""
        await self._admin.trigger(job)

    async def step_down(self, job: str) -> None:
        """Ask ``job``'s leader to hand it over: it releases the lock once no run is in
        flight, another node takes it over at the release notice, and the node that stepped
        down stays out of that job's election for one lock expiry."""
        await self._admin.step_down(job)

    def status(self, job: str | None = None) -> NodeStatus:
        """A snapshot of this node and its jobs (or only ``job``), as the router serves it."""
        if job is not None:
            require_registered(job, self._specs)
        return node_status(StatusView(self), only=job, kept=self._kept)

    async def checkpoint(self, job: str) -> Checkpoint | None:
        """``job``'s checkpoint as stored, the same from every replica; None before its first
        run. Works before startup too (it opens a connection for the call)."""
        return await self._admin.checkpoint(job)

    async def history(self, job: str, *, limit: int = DEFAULT_HISTORY) -> list[Occurrence]:
        """``job``'s last ``limit`` occurrences, newest first, the same from every replica:
        each run (instant, start, duration, node, fencing token, outcome, error) and each
        instant its leader did not run, with the reason. Kept in Redis, ``history`` of them
        per job. Works before startup too (it opens a connection for the call)."""
        return await self._admin.history(job, limit)

    async def reset_checkpoint(self, job: str) -> bool:
        """Delete ``job``'s checkpoint (an operator's action, not fenced): its next run starts
        from iteration 1 and no state. True if there was one."""
        return await self._admin.reset_checkpoint(job)

    def _admin_client(self) -> AdminClient:
        return AdminClient(
            self._store,
            project=self.settings.project,
            jobs=self._specs.keys(),
            clock=self._clock,
            node_id=self.settings.node_id,
        )

    @contextlib.asynccontextmanager
    async def _store(self) -> AsyncIterator[Store]:
        """The running engine's store, or one opened for the call."""
        if self._engine is not None:
            yield self._engine.store
            return
        async with opened_for_the_call(self._open_store)() as store:
            yield store

    # -- registration ---------------------------------------------------------------------

    def interval(
        self,
        name: str,
        every: Duration,
        *,
        enabled: bool = True,
        timeout: Duration | None = None,
        on_leadership_lost: LeadershipLostPolicy = "finish",
        lock_expiry: Duration | None = None,
        checkpoint: bool = True,
        history: int | None = None,
        on_overdue: OverdueCallback | None = None,
        overdue_grace: Duration | None = None,
    ) -> Callable[[F], F]:
        """Run the decorated function as soon as this node leads, then ``every`` after
        each run ends (run, then wait)."""
        options = JobOptions.parse(
            name,
            enabled,
            on_leadership_lost,
            checkpoint,
            timeout,
            lock_expiry,
            self._heartbeat_s,
            history,
            on_overdue,
            overdue_grace,
        )
        return self._decorator(name, interval_schedule(name, every), "interval", options)

    def fixed_rate(
        self,
        name: str,
        every: Duration,
        *,
        offset: Duration = 0.0,
        enabled: bool = True,
        timeout: Duration | None = None,
        on_leadership_lost: LeadershipLostPolicy = "finish",
        lock_expiry: Duration | None = None,
        checkpoint: bool = True,
        history: int | None = None,
        on_overdue: OverdueCallback | None = None,
        overdue_grace: Duration | None = None,
    ) -> Callable[[F], F]:
        """Run the decorated function on a grid of instants ``epoch + offset + k * every``
        shared by all replicas; a tick that comes while a run is still going is dropped."""
        options = JobOptions.parse(
            name,
            enabled,
            on_leadership_lost,
            checkpoint,
            timeout,
            lock_expiry,
            self._heartbeat_s,
            history,
            on_overdue,
            overdue_grace,
        )
        return self._decorator(
            name, fixed_rate_schedule(name, every, offset), "fixed_rate", options
        )

    def cron(
        self,
        name: str,
        expression: str,
        *,
        timezone: str = "UTC",
        misfire_grace: Duration | None = None,
        misfire: MisfirePolicy = "run_once",
        enabled: bool = True,
        timeout: Duration | None = None,
        on_leadership_lost: LeadershipLostPolicy = "finish",
        lock_expiry: Duration | None = None,
        checkpoint: bool = True,
        history: int | None = None,
        on_overdue: OverdueCallback | None = None,
        overdue_grace: Duration | None = None,
    ) -> Callable[[F], F]:
        """Run the decorated function at the instants of a cron expression (5 fields, or 6
        with seconds last), in ``timezone``. A run may start up to ``misfire_grace`` after
        its instant (default: until the next instant)."""
        options = JobOptions.parse(
            name,
            enabled,
            on_leadership_lost,
            checkpoint,
            timeout,
            lock_expiry,
            self._heartbeat_s,
            history,
            on_overdue,
            overdue_grace,
        ).misfiring(name, misfire_grace, misfire)
        return self._decorator(name, cron_schedule(name, expression, timezone), "cron", options)

    def schedule(
        self,
        name: str,
        schedule: Schedule,
        *,
        misfire_grace: Duration | None = None,
        misfire: MisfirePolicy = "run_once",
        enabled: bool = True,
        timeout: Duration | None = None,
        on_leadership_lost: LeadershipLostPolicy = "finish",
        lock_expiry: Duration | None = None,
        checkpoint: bool = True,
        history: int | None = None,
        on_overdue: OverdueCallback | None = None,
        overdue_grace: Duration | None = None,
    ) -> Callable[[F], F]:
        """Run the decorated function at the instants of any object with a
        ``next_fire(after: datetime) -> datetime | None`` method."""
        options = JobOptions.parse(
            name,
            enabled,
            on_leadership_lost,
            checkpoint,
            timeout,
            lock_expiry,
            self._heartbeat_s,
            history,
            on_overdue,
            overdue_grace,
        ).misfiring(name, misfire_grace, misfire)
        return self._decorator(name, custom_schedule(name, schedule), "custom", options)

    @property
    def _heartbeat_s(self) -> float:
        return self.settings.heartbeat_interval_s

    def _decorator(
        self, name: str, schedule: Schedule, kind: ScheduleKind, options: JobOptions
    ) -> Callable[[F], F]:
        if name in self._specs:
            raise ConfigurationError(
                "a job with this name is already registered; job names must be unique "
                "within a project",
                job=name,
                field="name",
            )

        def register(func: F) -> F:
            if self._engine is not None:
                raise ConfigurationError(
                    "jobs must be registered before startup", job=name, field="name"
                )
            if name in self._specs:
                raise ConfigurationError(
                    "a job with this name is already registered", job=name, field="name"
                )
            self._specs[name] = options.spec(name, func, schedule, kind)
            return func

        return register

    # -- lifecycle ------------------------------------------------------------------------

    def _open_store(self) -> Store:
        return open_store(
            self.settings, self._specs.values(), client=self._client, clock=self._clock
        )

    async def start(self, app: object = None) -> None:
        """Start electing and running the jobs; returns at once (also when Redis is down).

        :param app: the application whose ``dependency_overrides`` apply to job parameters
            (the lifespan passes it).
        """
        if self._engine is not None:
            raise UsageError(
                f"SingletonJobs {self.project!r} is already started; start it once (the "
                "lifespan does), or use a second SingletonJobs"
            )
        self.settings = self.settings.for_this_process()
        self._admin = self._admin_client()  # a forked worker's new node id signs its pauses
        store = self._open_store()
        try:
            engine = Engine(
                self.settings,
                list(self._specs.values()),
                store,
                self._clock,
                app,
                self._telemetry,
                on_overdue=self._on_overdue,
            )
        except BaseException:
            await store.aclose()
            raise
        await engine.start()  # on failure it has torn itself down and closed the store
        self._engine = engine
        disabled = [spec.name for spec in self._specs.values() if not spec.enabled]
        logger.info(
            "singletonjob node %s started for project %r: %d job(s)%s, store %r",
            self.node_id,
            self.project,
            len(engine.runners),
            f" ({len(disabled)} disabled: {', '.join(disabled)})" if disabled else "",
            store,
        )
        self._warn_of_a_memory_store()

    def _warn_of_a_memory_store(self) -> None:
        """``memory://`` on the system clock is an application's store, not a test's: say that
        it elects within this process only, at ERROR when this process is one of several
        workers of a server (each runs every job). On an injected clock it is a simulation."""
        url = self.settings.redis_url
        if self._client is not None or url is None or not url.startswith("memory:"):
            return
        if self._clock is not SYSTEM_CLOCK:
            return
        workers = this_process()
        level = logging.WARNING if workers is None else logging.ERROR
        logger.log(level, "%s", memory_store_warning(url, workers, os.getpid()))

    async def stop(self) -> None:
        """Stop ticking, drain runs, release the locks, close what the library opened."""
        engine = self._engine
        if engine is None:
            return
        try:
            # The engine stays visible while it drains: status and probes report it.
            await engine.stop()
        except BaseException:
            # stop() failed or was cancelled midway: make sure nothing keeps running.
            await asyncio.shield(engine.abort())
            raise
        finally:
            # What the runs did stays in status() until the next start: a test that stops
            # the node and then reads its counters sees them (they showed no runs).
            with contextlib.suppress(Exception):  # never hide why stop() failed
                self._kept = {name: job.stats for name, job in engine.snapshot().jobs.items()}
            self._engine = None
            logger.info("singletonjob node %s stopped", self.node_id)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: object = None) -> AsyncIterator[None]:
        """An ASGI lifespan: ``FastAPI(lifespan=jobs.lifespan)``, or nested in your own with
        ``async with jobs.lifespan(app): yield``. Installs no signal handlers."""
        await self.start(app)
        try:
            yield
        finally:
            await self.stop()

    async def __aenter__(self) -> SingletonJobs:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def __repr__(self) -> str:
        return (
            f"SingletonJobs(project={self.project!r}, node_id={self.node_id!r}, "
            f"jobs={sorted(self._specs)!r})"
        )


class StatusView:
    """A ``SingletonJobs`` as the web layer reads it (``_web.source.StatusSource``): its public
    properties and calls, and the running engine's snapshot and store probe, which are not
    part of the public API."""

    __slots__ = ("_jobs",)

    def __init__(self, jobs: SingletonJobs) -> None:
        self._jobs = jobs

    @property
    def store_description(self) -> str:
        return self._jobs.store_description

    @property
    def settings(self) -> Settings:
        return self._jobs.settings

    @property
    def jobs(self) -> Mapping[str, JobSpec]:
        return self._jobs.jobs

    def snapshot(self) -> EngineSnapshot | None:
        engine = self._jobs.engine
        return None if engine is None else engine.snapshot()

    async def checkpoint(self, job: str) -> Checkpoint | None:
        return await self._jobs.checkpoint(job)

    async def cluster_status(self) -> ClusterStatus:
        return await self._jobs.cluster_status()

    async def history(self, job: str, limit: int) -> list[Occurrence]:
        return await self._jobs.history(job, limit=limit)

    async def probe_store(self, within_s: float) -> bool:
        engine = self._jobs.engine
        return False if engine is None else await engine.probe_store(within_s)
