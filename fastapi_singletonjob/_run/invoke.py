"""Calling a job's function for one run: on the event loop or in a worker thread, with its
parameters resolved, under its timeout and its ``on_leadership_lost`` policy; what came of it.
``_run/runner.py`` decides whether a run starts and records how it ended; this warns of runs that
take most of their period or of the lock expiry, and names the run that held the event loop
(``_run/holds.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
from collections.abc import Awaitable, Coroutine
from concurrent.futures import Executor
from typing import Any

from .._aio import call_in_thread
from .._clock import Clock
from .._job.context import JobContext
from .._job.spec import JobSpec
from .._outcomes import Outcome
from .._schedule import Policy
from .holds import held_during, timed_steps

__all__ = ["Invoker", "NotStarted", "summary"]

logger = logging.getLogger("fastapi_singletonjob.runner")


class Invoker:
    """Calls one job's function."""

    __slots__ = (
        "_app",
        "_call_name",
        "_clock",
        "_executor",
        "_is_async",
        "_unbounded",
        "_warned",
        "spec",
    )

    def __init__(
        self, spec: JobSpec, *, clock: Clock, executor: Executor | None, app: object
    ) -> None:
        self.spec = spec
        self._clock = clock
        self._executor = executor
        self._app = app
        self._is_async = spec.is_async
        self._unbounded = spec.timeout_s is None and spec.on_leadership_lost == "finish"
        self._call_name = f"singletonjob call {spec.name!r}"
        """The name of the task of the job's code, when it runs bounded (``_run_bounded``)."""
        self._warned: tuple[str, ...] = ()
        """Which long-run warnings were given (once per job and kind)."""

    async def run(self, ctx: JobContext) -> tuple[Outcome, BaseException | None]:
        """Run the job once; how it ended. Raises ``NotStarted`` when the lease ran out
        before the job's code began, and ``CancelledError`` when cancelled from outside."""
        if self._unbounded:  # no timeout, no cancel policy: no task besides the run's own
            return await self._outcome(ctx, self._invoke(ctx))
        return await self._run_bounded(ctx)

    async def _outcome(
        self, ctx: JobContext, run: Awaitable[None], cause: Outcome | None = None
    ) -> tuple[Outcome, BaseException | None]:
        """Await the run; how it ended. A cancellation is the outcome ``cause`` when a bound
        (the timeout, the lease's end) caused it; a cancel of this task itself (shutdown)
        always propagates, even when it lands as the cancelled run unwinds."""
        try:
            await run
        except asyncio.CancelledError:
            if cause is None or _cancelling():
                raise
            return cause, None
        except NotStarted:
            raise
        except Exception as exc:
            logger.exception(
                "job %r run #%d failed on node %s", ctx.job, ctx.iteration, ctx.node_id
            )
            return Outcome.FAILED, exc
        return Outcome.SUCCESS, None

    async def _run_bounded(self, ctx: JobContext) -> tuple[Outcome, BaseException | None]:
        """Run the job as a task of its own, cancelling it at its timeout or, if so
        configured, when the lease ends; return how it ended."""
        run = asyncio.create_task(self._invoke(ctx), name=self._call_name)
        bounds: dict[asyncio.Future[Any], Outcome] = {}
        if self.spec.timeout_s is not None:
            bounds[asyncio.ensure_future(self._clock.sleep(self.spec.timeout_s))] = Outcome.TIMEOUT
        if self.spec.on_leadership_lost == "cancel":
            bounds[asyncio.ensure_future(ctx.leadership_lost.wait())] = Outcome.CANCELLED
        try:
            cause: Outcome | None = None
            done, _ = await asyncio.wait({run, *bounds}, return_when=asyncio.FIRST_COMPLETED)
            if run not in done:
                cause = next(bounds[w] for w in done if w in bounds)
                self._log_stop(ctx, cause)
                run.cancel()
            return await self._outcome(ctx, run, cause)
        finally:
            for bound in bounds:
                bound.cancel()
            if not run.done():
                # Left early (this task was cancelled): the run ends before this returns, so
                # that no second run of the job can start meanwhile.
                run.cancel()
                try:
                    await run
                except asyncio.CancelledError:
                    if _cancelling():
                        raise
                except BaseException:  # the run's own end is moot: this call did not wait
                    pass  # for it to say how the run went (what propagates says why)

    def warn_if_long(self, duration_s: float, policy: Policy, lock_expiry_s: float) -> None:
        """Warn of a run that took most of its period or of the lock expiry; once per job
        and kind, as a warning per tick would flood the log of a slow job."""
        period_s = policy.period_s
        if period_s is not None and duration_s >= 0.8 * period_s and "period" not in self._warned:
            self._warned += ("period",)
            fix = (
                "ticks that come meanwhile are dropped; lengthen `every` or shorten the run"
                if not policy.after_run
                else "the job runs less often than `every` suggests; shorten the run"
            )
            logger.warning(
                "job %r: a run took %.3fs, %d%% of its period every=%gs: %s%s",
                self.spec.name,
                duration_s,
                round(100 * duration_s / period_s),
                period_s,
                fix,
                self._held_by_another(duration_s),
            )
        if duration_s >= 0.8 * lock_expiry_s and "expiry" not in self._warned:
            self._warned += ("expiry",)
            logger.warning(
                "job %r: a run took %.3fs, close to or past lock_expiry=%gs; if renewals fail "
                "during such a run, another node may start the job before it ends: raise "
                "lock_expiry, or use on_leadership_lost='cancel' and the fencing token%s",
                self.spec.name,
                duration_s,
                lock_expiry_s,
                self._held_by_another(duration_s),
            )

    def _held_by_another(self, duration_s: float) -> str:
        """What a slow-run warning adds when another job's run held the event loop meanwhile
        (it, not this job, may be what was slow), else nothing."""
        hold = held_during(duration_s, besides=self.spec.name)
        if hold is None:
            return ""
        return (
            f" (but job {hold.job!r} run #{hold.run} held the event loop for "
            f"{hold.held_s:.3f}s meanwhile: that run, not this job, may be what was slow)"
        )

    def _held(self) -> bool:
        """A step of this job's code held the event loop: whether it was named before (the
        WARNING comes once per job, later ones at DEBUG)."""
        if "hold" in self._warned:
            return True
        self._warned += ("hold",)
        return False

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
            raise NotStarted
        try:
            if self._is_async:
                await timed_steps(self.spec.func(**kwargs), ctx.job, ctx.iteration, self._held)
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
                    clock=self._clock,
                )
        except (SystemExit, KeyboardInterrupt) as exc:
            # Let through, these would stop the event loop and so the whole service:
            # a job's sys.exit() is a failed run, nothing more.
            raise Escaped(exc) from exc


def _cancelling() -> bool:
    """Whether the current task was asked to cancel (not only its awaited run)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Escaped(Exception):
    """A job raised ``SystemExit`` or ``KeyboardInterrupt``; carried as a failure."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"{type(original).__name__}: {original}")
        self.original = original


class NotStarted(Exception):
    """The lease ran out between the tick and the start of the job's code."""


def summary(exc: BaseException, limit: int = 300) -> str:
    """``"<type>: <message>"`` of a run's error, cut to ``limit`` characters."""
    if isinstance(exc, Escaped):
        exc = exc.original
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[: limit - 1] + "…"
