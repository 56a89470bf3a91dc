"""*How* a job runs: claim its instant, run it on the loop or in a thread, watch its deadline,
record how it ended. *When* it runs is the ticker's business (``_ticker.py``).

A job has at most one run in flight: a tick that comes while a run is still going is dropped
and counted, never queued. Leadership is checked synchronously right before the job's code
starts, so a node whose lease ran out, even while its event loop was blocked, never starts a
run.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import random
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Executor
from datetime import datetime, timedelta, timezone
from typing import Any

from ._aio import call_in_thread
from ._clock import Clock
from ._context import JobContext
from ._election import Elector
from ._job import JobSpec
from ._lease import LeaseView
from ._schedule import policy_of
from ._state import DropReason, JobStats, Outcome, RunRecord
from ._telemetry import NOT_LEADER, Telemetry

__all__ = ["JobRunner"]

logger = logging.getLogger("fastapi_singletonjob.runner")

_CLAIM_RETRY_S = 0.05
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_ONE_US = timedelta(microseconds=1)


class JobRunner:
    """Starts and supervises the runs of one job on this node."""

    __slots__ = (
        "_app",
        "_claimed_term",
        "_clock",
        "_elector",
        "_executor",
        "_is_async",
        "_task_name",
        "_unwatched",
        "_iteration",
        "_telemetry",
        "_warned",
        "crashed",
        "current",
        "lease",
        "on_run_end",
        "policy",
        "spec",
        "stats",
    )

    def __init__(
        self,
        spec: JobSpec,
        *,
        elector: Elector,
        clock: Clock,
        executor: Executor | None,
        app: object = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.spec = spec
        self.stats = JobStats()
        self.lease: LeaseView = elector.terms.view(spec.name)
        self._elector = elector
        self._clock = clock
        self._executor = executor
        self._app = app
        self._telemetry = telemetry or Telemetry(elector.node_id)
        self._warned: tuple[str, ...] = ()
        """Which long-run warnings were given (once per job and kind)."""
        self.policy = policy_of(spec.schedule)
        self._is_async = spec.is_async
        self._unwatched = spec.timeout_s is None and spec.on_leadership_lost == "finish"
        self._task_name = f"singletonjob run {spec.name!r}"
        self._claimed_term: int | None = None
        """The last term whose first instant was claimed (schedules that claim only that)."""
        self._iteration = 0
        self.current: asyncio.Task[None] | None = None
        """The run in flight, if any."""
        self.crashed: BaseException | None = None
        """Why the job's schedule failed on this node, if it did."""
        self.on_run_end: Callable[[JobRunner], None] | None = None
        """Called when a run (or an attempt to start one) has ended."""

    def within_grace(self, instant: datetime, now: datetime) -> bool:
        """Whether a run for ``instant`` may still start at ``now``: within ``misfire_grace``,
        or by default until the following instant."""
        if self.spec.misfire_grace_s is not None:
            return (now - instant).total_seconds() <= self.spec.misfire_grace_s
        following = self.spec.schedule.next_fire(instant)
        return following is None or now < following

    def drop(self, reason: DropReason, count: int = 1) -> None:
        """Count ``count`` ticks dropped for ``reason``."""
        self.stats.dropped[reason] += count
        self._telemetry.drop(self.spec.name, reason.value, count)
        logger.debug(
            "job %r dropped %d tick(s) on node %s: %s", self.spec.name, count, self.node, reason
        )

    @property
    def node(self) -> str:
        """This node's id."""
        return self._elector.node_id

    # -- running --------------------------------------------------------------------------

    def start(self, scheduled_at: datetime) -> asyncio.Task[None] | None:
        """Start a run for the instant ``scheduled_at`` if this node leads and is idle."""
        token = self.lease.token
        if token is None or not self._elector.is_leader(self.spec.name, token):
            self.stats.not_leader += 1
            self._telemetry.drop(self.spec.name, NOT_LEADER)
            return None
        if self.current is not None:
            self.drop(DropReason.OVERLAP)
            return None
        claim = self.policy.claims_every_instant or (
            not self.policy.after_run and self._claimed_term != token
        )
        self._iteration += 1
        ctx = JobContext(
            job=self.spec.name,
            node_id=self.node,
            fencing_token=token,
            scheduled_at=scheduled_at,
            started_at=self._clock.now(),
            iteration=self._iteration,
            _is_leader=functools.partial(self._elector.is_leader, self.spec.name, token),
            _lost=functools.partial(self.lease.lost_of, token),
        )
        self.stats.running_since = ctx.started_at
        self.current = run = asyncio.create_task(self._supervise(ctx, claim), name=self._task_name)
        # After the task: its first step (up to the job's first await) then comes before the
        # deadline watchdog that this wakes.
        self._elector.run_started(self.spec.name)
        return run

    async def _claim(self, ctx: JobContext) -> DropReason | None:
        """Claim the run's instant in the store, so that no instant runs twice across leaders
        (a successor, or a node whose wall clock is behind). None when claimed; else why not.
        A store error is retried, with jitter, while the lease holds and the instant is within
        its grace."""
        instant_us = (ctx.scheduled_at - _EPOCH) // _ONE_US
        delay_s = _CLAIM_RETRY_S
        while True:
            result = await self._elector.claim(ctx.job, ctx.fencing_token, instant_us)
            if result == 1:
                self._claimed_term = ctx.fencing_token
                return None
            if result == -2:
                logger.error(
                    "job %r: instant %s is ahead of the store's clock; node %s's wall clock "
                    "is wrong (fix its time sync): not running it",
                    ctx.job,
                    ctx.scheduled_at.isoformat(),
                    ctx.node_id,
                )
                return DropReason.CLOCK_AHEAD
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
            if not self.within_grace(ctx.scheduled_at, self._clock.now()):
                logger.warning(
                    "job %r: instant %s skipped on node %s: the store did not answer within "
                    "its grace, and running it unclaimed could run it twice",
                    ctx.job,
                    ctx.scheduled_at.isoformat(),
                    ctx.node_id,
                )
                return DropReason.STORE_ERROR
            # Jittered, so that jobs claiming one instant together do not retry in lockstep.
            await self._clock.sleep(delay_s * (0.5 + random.random()))
            delay_s = min(2 * delay_s, 1.0)

    async def _supervise(self, ctx: JobContext, claim: bool) -> None:
        try:
            if claim:
                reason = await self._claim(ctx)
                if reason is not None:
                    self.current = None
                    self.stats.running_since = None
                    self.drop(reason)
                    return
            if not self.policy.after_run:
                self._elector.terms.instant_started(ctx.job, ctx.scheduled_at)
            await self._run(ctx)
        finally:
            self._elector.terms.run_ended(self.spec.name)
            if self.on_run_end is not None:
                self.on_run_end(self)

    async def _run(self, ctx: JobContext) -> None:
        outcome: Outcome = Outcome.CANCELLED
        error: BaseException | None = None
        started = self._clock.monotonic()
        with self._telemetry.run_span(ctx) as span:
            ran = True
            try:
                if self._unwatched:  # nothing to watch: no task besides the run's own
                    outcome, error = await self._outcome(ctx, self._invoke(ctx))
                else:
                    outcome, error = await self._watch(ctx)
            except _NotStarted:
                ran = False
                span.set_attribute("singletonjob.outcome", DropReason.LEASE_EXPIRED.value)
                self.drop(DropReason.LEASE_EXPIRED)
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
        period_s = self.policy.period_s
        if period_s is not None and duration_s >= 0.8 * period_s and "period" not in self._warned:
            self._warned += ("period",)
            fix = (
                "ticks that come meanwhile are dropped; lengthen `every` or shorten the run"
                if not self.policy.after_run
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
        if duration_s >= 0.8 * self.lease.ttl_s and "expiry" not in self._warned:
            self._warned += ("expiry",)
            logger.warning(
                "job %r: a run took %.3fs, close to or past lock_expiry=%gs; if renewals fail "
                "during such a run, another node may start the job before it ends: raise "
                "lock_expiry, or use on_leadership_lost='cancel' and the fencing token",
                self.spec.name,
                duration_s,
                self.lease.ttl_s,
            )

    async def _outcome(
        self, ctx: JobContext, run: Awaitable[None], cause: Outcome | None = None
    ) -> tuple[Outcome, BaseException | None]:
        """Await the run; how it ended. A cancellation is the outcome ``cause`` when a watcher
        caused it, else it propagates (shutdown)."""
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

    async def _watch(self, ctx: JobContext) -> tuple[Outcome, BaseException | None]:
        """Run the job, cancelling it at its timeout or, if so configured, when the lease
        ends; return how it ended."""
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
            done, _ = await asyncio.wait({run, *watchers}, return_when="FIRST_COMPLETED")
            if run not in done:
                cause = next(watchers[w] for w in done if w in watchers)
                self._log_stop(ctx, cause)
                run.cancel()
            return await self._outcome(ctx, run, cause)
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

    def _invoke(self, ctx: JobContext) -> Coroutine[Any, Any, None]:
        call = self.spec.call
        if call.trivial:  # no dependency to resolve or close: no exit stack on the tick path
            return self._call(ctx, call.context_arguments(ctx))
        return self._invoke_with_dependencies(ctx)

    async def _invoke_with_dependencies(self, ctx: JobContext) -> None:
        async with contextlib.AsyncExitStack() as stack:  # closes `yield` dependencies
            await self._call(ctx, await self.spec.call.arguments(ctx, self._app, stack))

    async def _call(self, ctx: JobContext, kwargs: dict[str, Any]) -> None:
        # Last check, with no suspension point between it and the job's first instruction.
        if not ctx.is_leader:
            raise _NotStarted
        try:
            if self._is_async:
                await self.spec.func(**kwargs)
            else:
                await call_in_thread(
                    self._executor,
                    functools.partial(contextvars.copy_context().run, self.spec.func, **kwargs),
                    on_cancel=functools.partial(
                        logger.warning,
                        "job %r run #%d runs in a thread and cannot be cancelled; waiting for it",
                        ctx.job,
                        ctx.iteration,
                    ),
                )
        except (SystemExit, KeyboardInterrupt) as exc:
            # Let through, these would stop the event loop and so the whole service:
            # a job's sys.exit() is a failed run, nothing more.
            raise _Escaped(exc) from exc


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
