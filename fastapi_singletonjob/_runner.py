"""Runs one job on the node that leads it, on its schedule.

Each job has a schedule loop (cancelled at shutdown: it only decides *when*) and at most one
run in flight (a separate task, drained at shutdown). A tick that comes while a run is still
going is dropped and counted, never queued; a node that wakes after later ticks were already
due runs none of them and waits for the next (no burst after a stall). Leadership is checked
synchronously right before the job's code starts, so a node whose lease ran out, even while
its event loop was blocked, never starts a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
from concurrent.futures import Executor
from datetime import datetime, timedelta, timezone
from typing import Any

from ._clock import Clock
from ._context import JobContext
from ._election import Elector, Lease
from ._job import JobSpec
from ._schedule import FixedRate, Interval
from ._state import DropReason, JobStats, Outcome, RunRecord
from ._telemetry import NOT_LEADER, Telemetry

__all__ = ["JobRunner"]

logger = logging.getLogger("fastapi_singletonjob.runner")

_MAX_SLEEP_S = 60.0  # re-read the wall clock at least this often while waiting for a tick
_MAX_COUNTED_TICKS = 10_000
_CLAIM_RETRY_S = 0.05
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


class JobRunner:
    """Schedules and supervises the runs of one job on this node."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        lease: Lease,
        elector: Elector,
        clock: Clock,
        executor: Executor | None,
        app: object = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.spec = spec
        self.stats = JobStats()
        self._lease = lease
        self._elector = elector
        self._clock = clock
        self._executor = executor
        self._app = app
        self._telemetry = telemetry or Telemetry(elector.node_id)
        self._warned: set[str] = set()
        # Instants of cron and custom schedules are claimed in the store before they run:
        # worth a round trip for schedules that fire seldom, not for sub-second ticks.
        self._claims = spec.kind in ("cron", "custom")
        self._iteration = 0
        self.current: asyncio.Task[None] | None = None
        """The run in flight, if any."""
        self.crashed: BaseException | None = None
        """Why the schedule loop died, if it did."""

    # -- scheduling -----------------------------------------------------------------------

    async def loop(self) -> None:
        """Decide when to run, until cancelled or until the schedule has no more instants.

        When the loop ends for good (no more instants, or the schedule itself raised), the
        node resigns the job's lease so that the lock is not held by a node that never runs
        it; a run in flight is left to finish.
        """
        try:
            if isinstance(self.spec.schedule, Interval):
                await self._interval_loop(self.spec.schedule)
            else:
                await self._instant_loop()
            logger.info("job %r has no more fire times on node %s", self.spec.name, self._node)
        except Exception as exc:
            self.crashed = exc
            logger.exception(
                "the schedule of job %r failed on node %s; the job stops on this node",
                self.spec.name,
                self._node,
            )
        self.stats.next_run = None
        if self.current is not None:
            await asyncio.wait({self.current})
        await self._elector.resign(self.spec.name)

    async def _interval_loop(self, schedule: Interval) -> None:
        # Run as soon as this node leads, then wait `every` after each run ends.
        while True:
            await self._lease.leading.wait()
            scheduled_at = self._clock.now()
            self.stats.next_run = None  # known once this run has ended
            run = self.start(scheduled_at)
            if run is not None:
                await asyncio.wait({run})  # not cancelled with this loop: drained at shutdown
                due = schedule.next_fire(self._clock.now())
            else:
                due = self._clock.now() + timedelta(seconds=schedule.every_s)
            self.stats.next_run = due
            await self._sleep_until(due)

    async def _instant_loop(self) -> None:
        schedule = self.spec.schedule
        previous = self._clock.now()
        missed: datetime | None = None  # the last instant, passed while another node led
        while True:
            due = schedule.next_fire(previous)
            if due is None:
                return
            self.stats.next_run = due
            if await self._sleep_until(due, wake_on_leadership=missed is not None):
                # This node took over between two instants. The previous leader may have died
                # before running the last one: run it now, once; the claim skips it if the
                # previous leader did run it.
                if missed is not None:
                    if self._within_grace(missed, self._clock.now()):
                        self.start(missed)
                    else:
                        self._drop(DropReason.LATE)
                missed = None
                continue
            now = self._clock.now()
            following = schedule.next_fire(due)
            grace = self.spec.misfire_grace_s
            if following is not None and following <= now:
                self._drop(DropReason.LATE, self._count_ticks(due, now))
                previous = now
                continue
            if grace is not None and (now - due).total_seconds() > grace:
                self._drop(DropReason.LATE, 1)
                previous = due
                continue
            previous = due
            started = self.start(due)
            missed = due if started is None and self._claims and self._lease.token is None else None

    def _within_grace(self, instant: datetime, now: datetime) -> bool:
        """Whether a run for ``instant`` may still start at ``now``: within ``misfire_grace``,
        or by default until the following instant."""
        if self.spec.misfire_grace_s is not None:
            return (now - instant).total_seconds() <= self.spec.misfire_grace_s
        following = self.spec.schedule.next_fire(instant)
        return following is None or now < following

    def _count_ticks(self, due: datetime, now: datetime) -> int:
        schedule = self.spec.schedule
        if isinstance(schedule, FixedRate):
            return 1 + schedule.ticks_between(due, now)
        count, instant = 1, schedule.next_fire(due)
        while instant is not None and instant <= now and count < _MAX_COUNTED_TICKS:
            count, instant = count + 1, schedule.next_fire(instant)
        return count

    async def _sleep_until(self, due: datetime, *, wake_on_leadership: bool = False) -> bool:
        """Sleep until the wall clock reaches ``due``; with ``wake_on_leadership``, return True
        as soon as this node leads the job. Sleeps in bounded steps so that a wall-clock jump
        is noticed within a minute."""
        leading = self._lease.leading
        while (left := (due - self._clock.now()).total_seconds()) > 0:
            if not wake_on_leadership:
                await self._clock.sleep(min(left, _MAX_SLEEP_S))
                continue
            if leading.is_set():
                return True
            sleeper = asyncio.ensure_future(self._clock.sleep(min(left, _MAX_SLEEP_S)))
            gained = asyncio.ensure_future(leading.wait())
            try:
                await asyncio.wait({sleeper, gained}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                sleeper.cancel()
                gained.cancel()
        return wake_on_leadership and leading.is_set()

    def _drop(self, reason: DropReason, count: int = 1) -> None:
        self.stats.dropped[reason] += count
        self._telemetry.drop(self.spec.name, reason.value, count)
        logger.debug(
            "job %r dropped %d tick(s) on node %s: %s", self.spec.name, count, self._node, reason
        )

    @property
    def _node(self) -> str:
        return self._elector.node_id

    # -- running --------------------------------------------------------------------------

    def start(self, scheduled_at: datetime) -> asyncio.Task[None] | None:
        """Start a run for the instant ``scheduled_at`` if this node leads and is idle."""
        token = self._lease.token
        if token is None or not self._elector.is_leader(self.spec.name, token):
            self.stats.not_leader += 1
            self._telemetry.drop(self.spec.name, NOT_LEADER)
            return None
        if self.current is not None:
            self._drop(DropReason.OVERLAP)
            return None
        self._iteration += 1
        ctx = JobContext(
            job=self.spec.name,
            node_id=self._node,
            fencing_token=token,
            scheduled_at=scheduled_at,
            started_at=self._clock.now(),
            iteration=self._iteration,
            leadership_lost=self._lease.lost,
            _is_leader=functools.partial(self._elector.is_leader, self.spec.name, token),
        )
        self.stats.running_since = ctx.started_at
        self.current = asyncio.create_task(
            self._supervise(ctx), name=f"singletonjob run {self.spec.name!r} #{ctx.iteration}"
        )
        return self.current

    async def _claim(self, ctx: JobContext) -> DropReason | None:
        """Claim the run's instant in the store, so that no instant runs twice across leaders
        (a successor, or a node whose wall clock is behind). None when claimed; else why not.
        A store error is retried while the lease holds and the instant is within its grace."""
        instant_us = (ctx.scheduled_at - _EPOCH) // timedelta(microseconds=1)
        delay_s = _CLAIM_RETRY_S
        while True:
            result = await self._elector.claim(ctx.job, ctx.fencing_token, instant_us)
            if result == 1:
                return None
            if result == 0:
                logger.info(
                    "job %r: instant %s was already run by another leader; not running it "
                    "again on node %s",
                    ctx.job,
                    ctx.scheduled_at.isoformat(),
                    ctx.node_id,
                )
                return DropReason.ALREADY_RUN
            if result == -1 or not ctx.is_leader:
                return DropReason.LEASE_EXPIRED
            if not self._within_grace(ctx.scheduled_at, self._clock.now()):
                logger.warning(
                    "job %r: instant %s skipped on node %s: the store did not answer within "
                    "its grace, and running it unclaimed could run it twice",
                    ctx.job,
                    ctx.scheduled_at.isoformat(),
                    ctx.node_id,
                )
                return DropReason.STORE_ERROR
            await self._clock.sleep(delay_s)
            delay_s = min(2 * delay_s, 1.0)

    async def _supervise(self, ctx: JobContext) -> None:
        if self._claims:
            reason = await self._claim(ctx)
            if reason is not None:
                self.current = None
                self.stats.running_since = None
                self._drop(reason)
                return
        outcome: Outcome = Outcome.CANCELLED
        error: BaseException | None = None
        started = self._clock.monotonic()
        lateness_s = (ctx.started_at - ctx.scheduled_at).total_seconds()
        with self._telemetry.run_span(ctx, lateness_s) as span:
            ran = True
            try:
                outcome, error = await self._watch(ctx)
            except _NotStarted:
                ran = False
                span.set_attribute("singletonjob.outcome", DropReason.LEASE_EXPIRED.value)
                self._drop(DropReason.LEASE_EXPIRED)
            finally:
                self.current = None
                self.stats.running_since = None
                if ran:
                    duration_s = self._clock.monotonic() - started
                    self._telemetry.run_finished(span, ctx.job, outcome, duration_s, error)
                    self._record(ctx, outcome, error, duration_s)

    def _record(
        self, ctx: JobContext, outcome: Outcome, error: BaseException | None, duration_s: float
    ) -> None:
        finished_at = ctx.started_at + timedelta(seconds=duration_s)
        summary = None if error is None else _summary(error)
        self.stats.record(
            RunRecord(ctx.scheduled_at, ctx.started_at, finished_at, duration_s, outcome, summary)
        )
        self._warn_if_long(duration_s)
        logger.debug(
            "job %r run #%d on node %s: %s in %.3fs",
            ctx.job,
            ctx.iteration,
            ctx.node_id,
            outcome.value,
            duration_s,
        )

    def _warn_if_long(self, duration_s: float) -> None:
        # Once per job and kind: a warning per tick would flood the log of a slow job.
        period_s = getattr(self.spec.schedule, "every_s", None)
        if period_s is not None and duration_s >= 0.8 * period_s and "period" not in self._warned:
            self._warned.add("period")
            fix = (
                "ticks that come meanwhile are dropped; lengthen `every` or shorten the run"
                if self.spec.kind == "fixed_rate"
                else "the job runs less often than `every` suggests; shorten the run"
            )
            logger.warning(
                "job %r: a run took %.3fs, %d%% of its period every=%gs: %s",
                self.spec.name,
                duration_s,
                round(100 * duration_s / period_s),
                period_s,
                fix,
            )
        if duration_s >= 0.8 * self._lease.ttl_s and "expiry" not in self._warned:
            self._warned.add("expiry")
            logger.warning(
                "job %r: a run took %.3fs, close to or past lock_expiry=%gs; if renewals fail "
                "during such a run, another node may start the job before it ends: raise "
                "lock_expiry, or use on_leadership_lost='cancel' and the fencing token",
                self.spec.name,
                duration_s,
                self._lease.ttl_s,
            )

    async def _run_unwatched(self, ctx: JobContext) -> tuple[Outcome, BaseException | None]:
        try:
            await self._invoke(ctx)
        except (_NotStarted, asyncio.CancelledError):
            raise
        except Exception as exc:
            logger.exception(
                "job %r run #%d failed on node %s", ctx.job, ctx.iteration, ctx.node_id
            )
            return Outcome.FAILED, exc
        return Outcome.SUCCESS, None

    async def _watch(self, ctx: JobContext) -> tuple[Outcome, BaseException | None]:
        """Run the job, cancelling it at its timeout or, if so configured, when the lease
        ends; return how it ended."""
        if self.spec.timeout_s is None and self.spec.on_leadership_lost == "finish":
            # Nothing to watch: run in this task, saving a task per run on the tick path.
            return await self._run_unwatched(ctx)
        run = asyncio.ensure_future(self._invoke(ctx))
        watchers: dict[asyncio.Future[Any], Outcome] = {}
        if self.spec.timeout_s is not None:
            watchers[asyncio.ensure_future(self._clock.sleep(self.spec.timeout_s))] = (
                Outcome.TIMEOUT
            )
        if self.spec.on_leadership_lost == "cancel":
            watchers[asyncio.ensure_future(ctx.leadership_lost.wait())] = Outcome.CANCELLED
        try:
            cause: Outcome | None = None
            if watchers:
                done, _ = await asyncio.wait({run, *watchers}, return_when="FIRST_COMPLETED")
                if run not in done:
                    cause = next(watchers[w] for w in done if w in watchers)
                    self._log_stop(ctx, cause)
                    run.cancel()
            try:
                await run
            except asyncio.CancelledError:
                if cause is None:
                    raise
                return cause, None
            except _NotStarted:
                raise
            except Exception as exc:
                logger.exception(
                    "job %r run #%d failed on node %s", ctx.job, ctx.iteration, ctx.node_id
                )
                return Outcome.FAILED, exc
            return Outcome.SUCCESS, None
        finally:
            for watcher in watchers:
                watcher.cancel()
            if not run.done():
                run.cancel()
                with contextlib.suppress(BaseException):
                    await run

    def _log_stop(self, ctx: JobContext, cause: Outcome) -> None:
        if cause is Outcome.TIMEOUT:
            logger.warning(
                "job %r run #%d exceeded its timeout of %gs on node %s; cancelling it",
                ctx.job,
                ctx.iteration,
                self.spec.timeout_s,
                ctx.node_id,
            )
        else:
            logger.warning(
                "job %r run #%d: node %s lost leadership; cancelling the run",
                ctx.job,
                ctx.iteration,
                ctx.node_id,
            )

    async def _invoke(self, ctx: JobContext) -> None:
        async with contextlib.AsyncExitStack() as stack:  # closes `yield` dependencies
            kwargs = await self.spec.call.arguments(ctx, self._app, stack)
            # Last check, with no suspension point between it and the job's first instruction.
            if not ctx.is_leader:
                raise _NotStarted
            try:
                if self.spec.is_async:
                    await self.spec.func(**kwargs)
                else:
                    await self._in_thread(ctx, kwargs)
            except (SystemExit, KeyboardInterrupt) as exc:
                # Let through, these would stop the event loop and so the whole service:
                # a job's sys.exit() is a failed run, nothing more.
                raise _Escaped(exc) from exc

    async def _in_thread(self, ctx: JobContext, kwargs: dict[str, Any]) -> None:
        loop = asyncio.get_running_loop()
        call = functools.partial(contextvars.copy_context().run, self.spec.func, **kwargs)
        thread = loop.run_in_executor(self._executor, call)
        try:
            await asyncio.shield(thread)
        except asyncio.CancelledError:
            # A thread cannot be interrupted: the run stays in flight until it returns, so
            # that no second run of this job starts on this node meanwhile.
            logger.warning(
                "job %r run #%d runs in a thread and cannot be cancelled; waiting for it",
                ctx.job,
                ctx.iteration,
            )
            while not thread.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(thread)
            raise


class _Escaped(Exception):
    """A job raised ``SystemExit`` or ``KeyboardInterrupt``; carried as a failure."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"{type(original).__name__}: {original}")
        self.original = original


class _NotStarted(Exception):
    """The lease ran out between the tick and the start of the job's code."""


def _summary(exc: BaseException, limit: int = 300) -> str:
    if isinstance(exc, _Escaped):
        exc = exc.original
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[: limit - 1] + "…"
