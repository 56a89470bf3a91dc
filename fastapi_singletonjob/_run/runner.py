"""*How* a job runs: claim its instant, read its checkpoint at a term's first run, call it
(``_run/invoke.py``: on the loop or in a thread, under its timeout), record how it ended, here and
in the checkpoint. *When* it runs is the ticker's business (``_run/ticker.py``), and what a new
leader does about the runs no node made is ``_run/misfire.py``'s.

A job has at most one run in flight: a tick that comes while a run is still going is dropped
and counted, never queued. Leadership is checked synchronously right before the job's code
starts, so a node whose lease ran out, even while its event loop was blocked, never starts a
run.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from concurrent.futures import Executor
from datetime import datetime, timedelta

from .._checkpoint import to_unix_us
from .._clock import Clock
from .._election.elector import Elector
from .._election.lease import LeaseView
from .._job.context import JobContext
from .._job.spec import JobSpec
from .._outcomes import DropReason, JobStats, Outcome, RunRecord
from .._schedule import policy_of
from .._store.base import ClaimResult
from .._telemetry import NOT_LEADER, Telemetry
from .invoke import Invoker, NotStarted, summary
from .misfire import catch_up, put_off
from .progress import Progress, no_checkpoint

__all__ = ["JobRunner"]

logger = logging.getLogger("fastapi_singletonjob.runner")

_CLAIM_RETRY_S = 0.05


class JobRunner:
    """Starts and supervises the runs of one job on this node."""

    __slots__ = (
        "_claimed_term",
        "clock",
        "_elector",
        "_task_name",
        "_invoker",
        "_iteration",
        "closed",
        "resume_in_s",
        "progress",
        "_telemetry",
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
        progress: Progress | None = None,
    ) -> None:
        self.spec = spec
        self.progress = progress
        """The job's checkpoint; None with ``checkpoint=False``."""
        self.stats = JobStats()
        self.lease: LeaseView = elector.terms.view(spec.name)
        self._elector = elector
        self.clock = clock
        self._invoker = Invoker(spec, clock=clock, executor=executor, app=app)
        self._telemetry = telemetry or Telemetry(elector.node_id)
        self.policy = policy_of(spec.schedule)
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
        self.resume_in_s: float | None = None
        """Set when an interval job's run was put off (``put_off``): the delay to the next."""
        self.closed = False
        """Set at shutdown: no run starts any more."""

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

    def can_start(self) -> bool:
        """Whether ``start`` would start a run now: this node leads the job, which is idle."""
        token = self.lease.token
        return (
            not self.closed
            and self.current is None
            and token is not None
            and self._elector.is_leader(self.spec.name, token)
        )

    def start(
        self, scheduled_at: datetime, gate: asyncio.Future[float] | None = None
    ) -> asyncio.Task[None] | None:
        """Start a run for the instant ``scheduled_at`` if this node leads and is idle. With
        a ``gate`` (opt-in precision: ``scheduled_at`` is still to come) the run does what
        comes before the job's code now, and the job's code waits for the gate to open (its
        value: how long the run still waits on its own, at shutdown; else 0)."""
        if self.closed:
            return None
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
        started_at = self.clock.now()
        if gate is None:
            self.stats.running_since = started_at
        self.current = run = asyncio.create_task(
            self._supervise(token, scheduled_at, started_at, claim, gate), name=self._task_name
        )
        # After the task: its first step (up to the job's first await) then comes before the
        # deadline watchdog that this wakes.
        self._elector.run_started(self.spec.name)
        return run

    # -- what a JobContext asks of its runner ---------------------------------------------

    def is_leader_of(self, token: int) -> bool:
        """Whether this node still leads the job in term ``token``."""
        return self._elector.is_leader(self.spec.name, token)

    def lost_of(self, token: int) -> asyncio.Event:
        """The "leadership lost" signal of term ``token``."""
        self._elector.lost_awaited(self.spec.name)
        return self.lease.lost_of(token)

    async def save_state_of(self, ctx: JobContext, value: object) -> None:
        """``ctx.save_state(value)``: a fenced write of the job's state."""
        if self.progress is None:
            raise no_checkpoint(self.spec.name)
        time_left = self._elector.terms.time_left(self.spec.name)
        if not self.is_leader_of(ctx.fencing_token):
            time_left = 0.0
        await self.progress.save_state(ctx.fencing_token, value, time_left)

    # -- the run --------------------------------------------------------------------------

    async def _context(
        self, token: int, scheduled_at: datetime, started_at: datetime
    ) -> JobContext | DropReason:
        """The run's context, with the checkpoint as it stands (read at a term's first run);
        or why the run cannot start."""
        checkpoint = None
        if self.progress is None:
            self._iteration += 1
            iteration = self._iteration
        else:
            try:
                checkpoint = await self.progress.load(
                    token, self._elector.terms.time_left(self.spec.name)
                )
            except Exception as exc:
                logger.warning(
                    "job %r: instant %s skipped on node %s: its checkpoint could not be read "
                    "(%r), and running without it could repeat work",
                    self.spec.name,
                    scheduled_at.isoformat(),
                    self.node,
                    exc,
                )
                return DropReason.STORE_ERROR
            iteration = (checkpoint.iteration if checkpoint is not None else 0) + 1
        return JobContext(
            job=self.spec.name,
            node_id=self.node,
            fencing_token=token,
            scheduled_at=scheduled_at,
            started_at=started_at,
            iteration=iteration,
            checkpoint=checkpoint,
            _run=self,
        )

    async def _claim(self, token: int, scheduled_at: datetime) -> DropReason | None:
        """Claim the run's instant in the store, so that no instant runs twice across leaders
        (a successor, or a node whose wall clock is behind). None when claimed; else why not.
        A store error is retried, with jitter, while the lease holds and the instant is within
        its grace."""
        job, node = self.spec.name, self.node
        instant_us = to_unix_us(scheduled_at)
        delay_s = _CLAIM_RETRY_S
        while True:
            result = await self._elector.claim(job, token, instant_us)
            if result is ClaimResult.CLAIMED:
                self._claimed_term = token
                return None
            if result is ClaimResult.CLOCK_AHEAD:
                logger.error(
                    "job %r: instant %s is ahead of the store's clock; node %s's wall clock "
                    "is wrong (fix its time sync): not running it",
                    job,
                    scheduled_at.isoformat(),
                    node,
                )
                return DropReason.CLOCK_AHEAD
            if result is ClaimResult.ALREADY_RUN:
                logger.info(
                    "job %r: instant %s was already run by another leader; not running it "
                    "again on node %s",
                    job,
                    scheduled_at.isoformat(),
                    node,
                )
                return DropReason.ALREADY_RUN
            if result is ClaimResult.NOT_HOLDER or not self.is_leader_of(token):
                return DropReason.LEASE_EXPIRED
            if not self.within_grace(scheduled_at, self.clock.now()):
                logger.warning(
                    "job %r: instant %s skipped on node %s: the store did not answer within "
                    "its grace, and running it unclaimed could run it twice",
                    job,
                    scheduled_at.isoformat(),
                    node,
                )
                return DropReason.STORE_ERROR
            # Jittered, so that jobs claiming one instant together do not retry in lockstep.
            await self.clock.sleep(delay_s * (0.5 + random.random()))
            delay_s = min(2 * delay_s, 1.0)

    async def _supervise(
        self,
        token: int,
        scheduled_at: datetime,
        started_at: datetime,
        claim: bool,
        gate: asyncio.Future[float] | None,
    ) -> None:
        try:
            await self.attempt(token, scheduled_at, started_at, claim, gate)
        finally:
            self.ended()

    async def attempt(
        self,
        token: int,
        scheduled_at: datetime,
        started_at: datetime,
        claim: bool,
        gate: asyncio.Future[float] | None = None,
    ) -> None:
        """Claim the instant if asked, read the checkpoint at a term's first run, run; with
        a ``gate``, wait for it (and then the time it says) after the claim."""
        first_of_term = self.progress is not None and not self.progress.loaded_for(token)
        begun: JobContext | DropReason | None = None
        if gate is None:
            self.stats.running_since = started_at
        if claim:
            begun = await self._claim(token, scheduled_at)
        if gate is not None:
            left_s = await gate
            if left_s > 0:
                await self.clock.sleep(left_s)
            started_at = self.stats.running_since = self.clock.now()
        if begun is None:
            if not self.policy.after_run:
                self._elector.terms.instant_started(self.spec.name, scheduled_at)
            begun = await self._context(token, scheduled_at, started_at)
        if isinstance(begun, DropReason):
            self.drop(begun)
        elif first_of_term and self.policy.after_run and put_off(self, begun.checkpoint):
            pass  # a new leader waits out the interval since the previous leader's run
        else:
            await self._run(begun)
        self.stats.running_since = None

    def ended(self) -> None:
        """The run in flight (or the catch-up) has ended: the job is idle again."""
        self.current = None
        self.stats.running_since = None
        self._elector.run_ended(self.spec.name)
        if self.on_run_end is not None:
            self.on_run_end(self)

    # -- misfires -------------------------------------------------------------------------

    def catch_up(self, missed: datetime | None) -> asyncio.Task[None] | None:
        """This node began a term of a cron or custom job: run what its ``misfire`` policy
        says of the instants after the stored last run that no node ran, as one task that
        counts as the run in flight (a tick meanwhile is dropped as an overlap). Without a
        stored run, ``missed`` (the last instant this node saw pass while another led) is
        run once, within its grace."""
        token = self.lease.token
        if self.closed or token is None or self.current is not None or self.progress is None:
            return None
        self.current = task = asyncio.create_task(
            catch_up(self, token, missed), name=self._task_name
        )
        self._elector.run_started(self.spec.name)
        return task

    def time_left(self) -> float:
        """Seconds left on this node's lease of the job (0 when it does not lead)."""
        return self._elector.terms.time_left(self.spec.name)

    async def _run(self, ctx: JobContext) -> None:
        outcome: Outcome = Outcome.CANCELLED
        error: BaseException | None = None
        started = self.clock.monotonic()
        with self._telemetry.run_span(ctx) as span:
            ran = True
            try:
                outcome, error = await self._invoker.run(ctx)
            except NotStarted:
                ran = False
                span.set_attribute("singletonjob.outcome", DropReason.LEASE_EXPIRED.value)
                self.drop(DropReason.LEASE_EXPIRED)
            else:
                if self.progress is not None:  # before the run counts as ended
                    await self.progress.record(
                        ctx.fencing_token,
                        outcome,
                        ctx.scheduled_at,
                        self.clock.now(),
                        None if error is None else summary(error),
                        self.time_left(),
                    )
            finally:
                if ran:
                    duration_s = self.clock.monotonic() - started
                    self._telemetry.run_finished(span, ctx.job, outcome, duration_s, error)
                    self._record(ctx, outcome, error, duration_s)

    def _record(
        self, ctx: JobContext, outcome: Outcome, error: BaseException | None, duration_s: float
    ) -> None:
        finished_at = ctx.started_at + timedelta(seconds=duration_s)
        text = None if error is None else summary(error)
        self.stats.record(
            RunRecord(ctx.scheduled_at, ctx.started_at, finished_at, duration_s, outcome, text)
        )
        self._invoker.warn_if_long(duration_s, self.policy, self.lease.ttl_s)
        logger.debug(
            "job %r run #%d on node %s: %s in %.3fs",
            ctx.job,
            ctx.iteration,
            ctx.node_id,
            outcome.value,
            duration_s,
        )
