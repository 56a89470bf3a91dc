"""The running machinery of one ``SingletonJobs``: built at startup, torn down at shutdown.

Shutdown order, chosen so that no two nodes ever run a job at once:

1. stop ticking (the schedule loops), so no new run starts;
2. let runs in flight finish, up to ``shutdown_timeout``, while the election keeps renewing
   their leases;
3. cancel the runs still going and give them a short grace to end;
4. stop the election, then release the locks whose runs have ended, which notifies the
   other nodes so that they take over at once (a lock whose run is stuck in a thread is
   *not* released: it expires on its own after the run can no longer be ours);
5. close the store if the library opened it, and the worker threads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor

from ._clock import Clock
from ._config import Settings
from ._election import Elector, Lease
from ._job import JobSpec
from ._runner import JobRunner
from ._store import LeaseStore
from ._telemetry import Telemetry

__all__ = ["Engine"]

logger = logging.getLogger("fastapi_singletonjob")

CANCEL_GRACE_S = 5.0
"""Longest wait for cancelled runs to end at shutdown before giving up on them."""


class Engine:
    """Election loop, one runner per enabled job, and their worker threads."""

    def __init__(
        self,
        settings: Settings,
        specs: Sequence[JobSpec],
        store: LeaseStore,
        clock: Clock,
        app: object = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self._clock = clock
        enabled = [spec for spec in specs if spec.enabled]
        self.telemetry = telemetry or Telemetry(settings.node_id)
        leases = [
            Lease(spec.name, spec.lock_expiry_s or settings.lock_expiry_s) for spec in enabled
        ]
        self.elector = Elector(
            store=store,
            node_id=settings.node_id,
            leases=leases,
            heartbeat_s=settings.heartbeat_interval_s,
            max_backoff_s=settings.max_backoff_s,
            clock=clock,
            telemetry=self.telemetry,
        )
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
                lease=lease,
                elector=self.elector,
                clock=clock,
                executor=self._executor,
                app=app,
                telemetry=self.telemetry,
            )
            for spec, lease in zip(enabled, leases, strict=True)
        }
        self._election: asyncio.Task[None] | None = None
        self.started_at = clock.monotonic()
        self._loops: list[asyncio.Task[None]] = []

    @property
    def election_task(self) -> asyncio.Task[None] | None:
        """The election loop's task (None before start)."""
        return self._election

    async def start(self) -> None:
        """Start the election and the schedule loops; returns once they run, without
        waiting for the store (an unreachable Redis is retried in the background)."""
        elector = self.elector
        self.telemetry.register(
            list(self.runners), lambda: [(job, elector.is_leader(job)) for job in self.runners]
        )
        ready = asyncio.Event()
        self.started_at = self._clock.monotonic()
        self._election = asyncio.create_task(
            self.elector.run(ready), name=f"singletonjob {self.settings.node_id} election"
        )
        waiter = asyncio.ensure_future(ready.wait())
        await asyncio.wait({waiter, self._election}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if self._election.done():
            self._election.result()  # re-raise a crash of the loop at startup
        self._loops = [
            asyncio.create_task(runner.loop(), name=f"singletonjob {name!r} schedule")
            for name, runner in self.runners.items()
        ]

    async def abort(self) -> None:
        """Cancel whatever still runs (schedule loops, runs, election), bounded in time: the
        last resort when ``stop`` failed or was cancelled, so that nothing keeps renewing
        leases or starting runs behind the application's back."""
        runs = [runner.current for runner in self.runners.values()]
        await _abort_tasks([*self._loops, *runs, self._election])
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    async def stop(self) -> None:
        """Shut down in the order described in the module docstring; never raises for a
        job's misbehaviour."""
        await asyncio.gather(*(_cancel(task) for task in self._loops))
        runs = {name: r.current for name, r in self.runners.items() if r.current is not None}
        if runs:
            logger.info(
                "waiting up to %gs for runs in flight: %s",
                self.settings.shutdown_timeout_s,
                ", ".join(runs),
            )
            _, pending = await _wait(runs.values(), self.settings.shutdown_timeout_s, self._clock)
            if pending:
                for task in pending:
                    task.cancel()
                _, pending = await _wait(pending, CANCEL_GRACE_S, self._clock)
            stuck = [name for name, task in runs.items() if task in pending]
        else:
            stuck = []
        if stuck:
            logger.error(
                "runs of %s did not end after cancellation; their locks are left to expire so "
                "that no other node starts them while they may still run",
                ", ".join(stuck),
            )
        if self._election is not None:
            await _cancel(self._election)
        await self.elector.release([name for name in self.runners if name not in stuck])
        if self._executor is not None:
            self._executor.shutdown(wait=False)


async def _abort_tasks(tasks: Sequence[asyncio.Task[None] | None]) -> None:
    pending = [task for task in tasks if task is not None and not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=CANCEL_GRACE_S)


async def _wait(
    tasks: Collection[asyncio.Task[None]], timeout_s: float, clock: Clock
) -> tuple[set[asyncio.Task[None]], set[asyncio.Task[None]]]:
    """Wait for ``tasks`` up to ``timeout_s`` on ``clock``; return (done, pending)."""
    pending = set(tasks)
    if not pending or timeout_s <= 0:
        return set(), pending
    timer = asyncio.ensure_future(clock.sleep(timeout_s))
    try:
        while pending and not timer.done():
            await asyncio.wait({*pending, timer}, return_when=asyncio.FIRST_COMPLETED)
            pending = {task for task in pending if not task.done()}
    finally:
        timer.cancel()
    return {task for task in tasks if task.done()}, pending


async def _cancel(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait until it has ended.

    The cancel is repeated: on Python < 3.12, ``asyncio.wait_for`` can swallow a cancel that
    lands just as the awaited call completes, and the task would go on. Waiting with
    ``asyncio.wait`` never raises, so a cancel aimed at the caller itself is not swallowed.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    if not task.cancelled() and task.exception() is not None:
        logger.error("task %s had failed", task.get_name(), exc_info=task.exception())
