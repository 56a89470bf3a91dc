"""The running machinery of one ``SingletonJobs``: built at startup, torn down at shutdown.

Life cycle (``Engine.state``)::

    STARTING ──start()──▶ RUNNING ──stop()──▶ DRAINING ──▶ STOPPED
        └──────────── a failed start or abort() ───────────────▲

Shutdown order, chosen so that no two nodes ever run a job at once and no job pauses longer
than it must:

1. stop the timer, so no new run starts, and the overdue watch;
2. leave the membership, so that the other nodes place the jobs without this one;
3. release at once the locks of the jobs with no run in flight, so that other nodes take them
   over while this one drains;
4. let runs in flight finish, up to ``shutdown_timeout``, while the election keeps renewing
   their leases, and release each lock as soon as its run ends;
5. cancel the runs still going and give them a short grace to end;
6. stop the election (a lock whose run is stuck in a thread is *not* released: it expires on
   its own after the run can no longer be ours);
7. close the store if the library opened it, and the worker threads.

Everything started is registered on one ``AsyncExitStack``: ``stop`` and ``abort`` unwind the
same stack, so there is one teardown path. Every long-lived background task (the election
loop and its helpers, the timer, retirements) is started by one ``Supervisor``, which records
a task that died; the snapshot names those (``failed_tasks``).

The parts are wired here, once, at construction: the election tells the timer of each term
that starts (``Terms``'s ``TermListener``), each runner tells it of each run that ends
(``on_end``), and the runners reach the election through ``_run.leadership.Leadership``.
Data flows one way: each part owns its state, and ``snapshot`` asks each for its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from .._aio import Supervisor, abort_all, cancel_and_wait, wait_all, within
from .._checkpoint import DEFAULT_MAX_STATE_BYTES
from .._clock import Clock
from .._config.settings import Settings
from .._election.elector import Elector
from .._election.lease import Lease
from .._job.spec import JobSpec
from .._overdue import OverdueCallback
from .._run.overdue import OverdueWatch
from .._run.progress import Progress
from .._run.recorder import Recorder
from .._run.runner import JobRunner
from .._run.ticker import Ticker
from .._store.base import Store
from .._store.membership import VERSION, MemberRecord, Membership
from .._telemetry import Telemetry
from .snapshot import EngineSnapshot, EngineState, JobSnapshot, StoreSnapshot

__all__ = ["Engine", "EngineState"]

logger = logging.getLogger("fastapi_singletonjob")

CANCEL_GRACE_S = 5.0
"""Longest wait for cancelled runs to end at shutdown before giving up on them."""
PROBE_POLL_S = 0.01
"""How often ``probe_store`` looks whether the election's round, brought forward, is done."""
LEAVE_TIMEOUT_S = 1.0
"""Longest wait for the membership record's deletion at shutdown (it expires anyway)."""


class Engine:
    """Election loop, the timer, one runner per enabled job, and their worker threads."""

    def __init__(
        self,
        settings: Settings,
        specs: Sequence[JobSpec],
        store: Store,
        clock: Clock,
        app: object = None,
        telemetry: Telemetry | None = None,
        rng: Callable[[], float] = random.random,
        on_overdue: OverdueCallback | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.state = EngineState.STARTING
        self.clock = clock
        enabled = [spec for spec in specs if spec.enabled]
        self.telemetry = telemetry or Telemetry(settings.node_id)
        self.supervisor = Supervisor()
        """Starts every long-lived background task of the engine and records those that
        died (``EngineSnapshot.failed_tasks``)."""
        self.ticker = Ticker(clock=clock, retire=self._retire, precision_s=settings.precision_s)
        leases = [
            Lease(
                spec.name,
                spec.lock_expiry_s or settings.lock_expiry_s,
                settings.checkpoint_retention_s if spec.checkpoint else None,
            )
            for spec in enabled
        ]
        self._longest_lease_s = max(
            (lease.ttl_s for lease in leases), default=settings.lock_expiry_s
        )
        self.elector = Elector(
            store=store,
            node_id=settings.node_id,
            leases=leases,
            heartbeat_s=settings.heartbeat_interval_s,
            max_backoff_s=settings.max_backoff_s,
            clock=clock,
            rng=rng,
            telemetry=self.telemetry,
            placement=settings.placement,
            supervisor=self.supervisor,
            listener=self.ticker,
        )
        self.recorder = Recorder(store, clock=clock, node_id=settings.node_id)
        """Writes the runs' checkpoint records, off their run path."""
        sync_jobs = sum(1 for spec in enabled if not spec.is_async)
        # One thread per sync job: a job never has two runs at once, so none ever queues.
        self._executor = (
            ThreadPoolExecutor(max_workers=sync_jobs, thread_name_prefix="singletonjob")
            if sync_jobs
            else None
        )
        self.runners = {
            spec.name: JobRunner(
                spec,
                supervisor=self.supervisor,
                leadership=self.elector,
                clock=clock,
                executor=self._executor,
                app=app,
                telemetry=self.telemetry,
                progress=Progress(
                    store,
                    spec.name,
                    settings.node_id,
                    recorder=self.recorder,
                    retention_s=settings.checkpoint_retention_s,
                    history=settings.history if spec.history is None else spec.history,
                    max_state_bytes=DEFAULT_MAX_STATE_BYTES,
                )
                if spec.checkpoint
                else None,
                rng=rng,
                on_end=self.ticker.run_ended,
            )
            for spec in enabled
        }
        for runner in self.runners.values():
            self.ticker.add(runner)
        self.overdue = OverdueWatch(
            store,
            specs,
            node_id=settings.node_id,
            heartbeat_s=settings.heartbeat_interval_s,
            lock_expiry_s=settings.lock_expiry_s,
            retention_s=settings.checkpoint_retention_s,
            clock=clock,
            on_overdue=on_overdue,
            telemetry=self.telemetry,
            check_s=settings.lock_expiry_s,
            stopped=self.ticker.failure,
        )
        """Each watched job's overdue check, and the ``on_overdue`` calls."""
        store.announce(Membership(self._member_record(enabled)))
        self._election: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        self._timer: asyncio.Task[None] | None = None
        self._retiring: set[asyncio.Task[None]] = set()
        self._stack = contextlib.AsyncExitStack()
        self.started_at = clock.monotonic()

    def _member_record(self, enabled: Sequence[JobSpec]) -> MemberRecord:
        """What this node announces to the others (see ``_store.membership``)."""
        return MemberRecord(
            node_id=self.settings.node_id,
            owner=self.elector.owner,
            version=VERSION,
            started_at=self.clock.now(),
            jobs={spec.name: spec.announced for spec in enabled},
            ttl_s=self._longest_lease_s,
        )

    def snapshot(self) -> EngineSnapshot:
        """A consistent read-only picture of the engine, for the status API and probes,
        assembled from what each part says of itself."""
        now = self.clock.monotonic()
        election = self.elector.status()
        last_ok = election.last_success_at
        timer = self._timer
        return EngineSnapshot(
            state=self.state,
            election_alive=self._election is not None and not self._election.done(),
            timer_alive=timer is not None and not timer.done(),
            last_round_s_ago=now - (election.last_round_at or self.started_at),
            longest_lease_s=self._longest_lease_s,
            store=StoreSnapshot(
                last_success_s_ago=None if last_ok is None else now - last_ok,
                round_trip_s=election.round_trip_s,
                failures=election.failures,
                last_error=election.last_error,
                refused=None if election.refused is None else str(election.refused),
            ),
            jobs={name: self._job_snapshot(name, runner) for name, runner in self.runners.items()},
            failed_tasks=self.supervisor.failed,
            overdue=dict(self.overdue.overdue()),
        )

    def _job_snapshot(self, name: str, runner: JobRunner) -> JobSnapshot:
        elector = self.elector
        lease = elector.view(name)
        leads = elector.is_leader(name)
        stats = runner.stats_copy()
        stats.next_run = self.ticker.next_run(name)
        return JobSnapshot(
            leads=leads,
            holder=self.settings.node_id if leads else lease.holder,
            token=lease.token if leads else lease.holder_token,
            time_left_s=elector.holder_time_left(name),
            running=runner.current is not None,
            stats=stats,
            error=self.ticker.failure(name),
            paused=lease.paused,
            let_go=lease.let_go,
        )

    async def probe_store(self, within_s: float) -> bool:
        """Whether the store answers a PING within ``within_s`` now and, woken by it, the
        election then completes a round within ``within_s`` more (measured on the clock). The
        readiness probe calls it when the store seemed in trouble: the election may be waiting
        out its backoff."""
        elector, began = self.elector, self.clock.monotonic()
        try:
            await within(self.store.ping(), within_s)
        except Exception:  # whatever the client raises (a cluster's RedisClusterException too)
            return False
        elector.retry_now()
        deadline = self.clock.monotonic() + within_s
        while not (elector.failures == 0 and (elector.last_success_at or -math.inf) >= began):
            if elector.refused is not None and (elector.last_round_at or -math.inf) >= began:
                return False  # Redis answers a PING but refused the round: no use waiting
            left_s = deadline - self.clock.monotonic()
            if left_s <= 0:
                return False
            await self.clock.sleep(min(PROBE_POLL_S, left_s))
        return True

    @property
    def election_task(self) -> asyncio.Task[None] | None:
        """The election loop's task (None before start)."""
        return self._election

    @property
    def timer_task(self) -> asyncio.Task[None] | None:
        """The timer's task (None before start or once stopped)."""
        return self._timer

    @property
    def watch_task(self) -> asyncio.Task[None] | None:
        """The overdue watch's task (None before start)."""
        return self._watch

    async def start(self) -> None:
        """Start the election and the timer; returns once they run, without waiting for the
        store (an unreachable Redis is retried in the background). On failure everything
        started so far is torn down and the store closed."""
        stack = self._stack
        stack.push_async_callback(self.store.aclose)
        stack.push_async_callback(self.recorder.aclose)
        stack.push_async_callback(self.overdue.aclose)
        if self._executor is not None:
            stack.callback(self._executor.shutdown, wait=False)
        try:
            elector, watch = self.elector, self.overdue
            self.telemetry.register(
                list(self.runners),
                lambda: [(job, elector.is_leader(job)) for job in self.runners],
                lambda: [(job, lease.paused) for job, lease in elector.leases.items()],
                lambda: [(job, since is not None) for job, since in watch.overdue().items()],
                watch.jobs,
            )
            stack.callback(self.telemetry.unregister)
            ready = asyncio.Event()
            self.started_at = self.clock.monotonic()
            stack.push_async_callback(self.supervisor.aclose)  # first of all that closes
            election = self._election = self.supervisor.start(
                elector.run(ready), name=f"singletonjob {self.settings.node_id} election"
            )
            waiter = asyncio.ensure_future(ready.wait())
            await asyncio.wait({waiter, election}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            await asyncio.wait({waiter})
            if election.done():
                election.result()  # re-raise a crash of the loop at startup
            self._timer = self.supervisor.start(
                self.ticker.run(), name=f"singletonjob {self.settings.node_id} timer"
            )
            self._watch = self.supervisor.start(
                self.overdue.run(), name=f"singletonjob {self.settings.node_id} overdue"
            )
        except BaseException:
            await self.abort()
            raise
        self.state = EngineState.RUNNING

    def _retire(self, runner: JobRunner) -> None:
        """The job's schedule ended or failed: once its run (if any) ends, hand its lock to
        the other nodes, so that a job nobody runs here is not kept locked. It leaves this
        node's membership record at once, so that placement prefers another node for it."""
        membership = self.store.membership
        if membership is not None:
            membership.drop_jobs([runner.spec.name])

        async def retire() -> None:
            if runner.current is not None:
                await asyncio.wait({runner.current})
            await runner.written()
            await self.elector.resign([runner.spec.name])

        task = self.supervisor.start(
            retire(), name=f"singletonjob retire {runner.spec.name!r}", forever=False
        )
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def abort(self) -> None:
        """Cancel whatever still runs, bounded in time, and close the store: the last resort
        when ``start`` or ``stop`` failed or was cancelled, so that nothing keeps renewing
        leases or starting runs behind the application's back."""
        self.supervisor.stop()
        self.ticker.stop_waiting()
        runs = [runner.current for runner in self.runners.values()]
        await abort_all(
            [self._timer, self._watch, *runs, *self._retiring, self._election], CANCEL_GRACE_S
        )
        await self._close()

    async def _close(self) -> None:
        self.state = EngineState.STOPPED
        try:
            await self._stack.aclose()
        except Exception:
            logger.exception("node %s: error while closing", self.settings.node_id)

    async def stop(self) -> None:
        """Shut down in the order described in the module docstring; never raises for a
        job's misbehaviour."""
        self.state = EngineState.DRAINING
        self.supervisor.stop()  # the tasks of the engine end from now on: no death
        self.elector.stop_acquiring()  # from now on no new term, and no new run
        for runner in self.runners.values():
            runner.close()
        self.ticker.stop_waiting()
        if self._timer is not None:
            await cancel_and_wait(self._timer)
        if self._watch is not None:
            await cancel_and_wait(self._watch)
        # Leave the membership before releasing anything: a node woken by the release then
        # already places the job without this one, instead of leaving it to a node that left.
        await self._leave()
        runs = {name: r.current for name, r in self.runners.items() if r.current is not None}
        idle = [name for name in self.runners if name not in runs]
        if idle:
            await self._written(idle)
            await self.elector.resign(idle)
        stuck = await self._drain(runs) if runs else []
        if stuck:
            logger.error(
                "runs of %s did not end after cancellation; their locks are left to expire so "
                "that no other node starts them while they may still run",
                ", ".join(stuck),
            )
        await abort_all(list(self._retiring), CANCEL_GRACE_S)
        if self._election is not None:
            await cancel_and_wait(self._election)
        await self.elector.release([name for name in runs if name not in stuck])
        await self._close()

    async def _written(self, jobs: Sequence[str]) -> None:
        """Wait until the records of ``jobs``' runs are written, before their locks go: the
        successor reads them (``iteration`` stays exact across a graceful handover). Each
        record is bounded by its own deadline; this by the longest lease, as a backstop."""
        waiting = [job for job in jobs if self.runners[job].unwritten]
        writes = {asyncio.ensure_future(self.runners[job].written()) for job in waiting}
        late = await wait_all(writes, self._longest_lease_s, self.clock)
        for write in late:
            write.cancel()
        if late:
            logger.warning(
                "node %s: records of %s were still unanswered after %gs; their locks go "
                "anyway (the successor may not read the last of them)",
                self.settings.node_id,
                ", ".join(job for job in waiting if self.runners[job].unwritten),
                self._longest_lease_s,
            )

    async def _leave(self) -> None:
        """Leave the membership at once (else the record expires one lock expiry later)."""
        try:
            await within(self.store.leave(), LEAVE_TIMEOUT_S)
        except Exception as exc:  # it expires on its own
            logger.debug("node %s could not leave the membership: %r", self.settings.node_id, exc)

    async def _drain(self, runs: dict[str, asyncio.Task[None]]) -> list[str]:
        """Wait for ``runs``, releasing each job's lock as its run ends; cancel those still
        going after ``shutdown_timeout``. Returns the jobs whose runs would not end."""
        logger.info(
            "waiting up to %gs for runs in flight: %s",
            self.settings.shutdown_timeout_s,
            ", ".join(runs),
        )
        job_of: dict[asyncio.Future[None], str] = {task: name for name, task in runs.items()}
        pending: set[asyncio.Future[None]] = set(runs.values())
        deadline = self.clock.monotonic() + self.settings.shutdown_timeout_s
        cancelled = False
        while pending:
            left = deadline - self.clock.monotonic()
            if left <= 0:
                if cancelled:
                    break
                cancelled = True
                for task in pending:
                    task.cancel()
                deadline = self.clock.monotonic() + CANCEL_GRACE_S
                continue
            still = await wait_all(pending, left, self.clock, first=True)
            ended = [job_of[task] for task in pending - still]
            pending = still
            if ended:
                await self._written(ended)
                await self.elector.resign(ended)
        return [job_of[task] for task in pending]
