"""*How* a job runs: claim its instant, read its checkpoint at a term's first run, call it
(``_run/invoke.py``: on the loop or in a thread, under its timeout), record how it ended, here and
in the checkpoint. *When* it runs is the ticker's business (``_run/ticker.py``); what a new
leader does about the runs no node made is decided in ``_run/misfire.py`` and carried out
here. The election is reached through ``_run/leadership.py``'s ``Leadership``.

A job has at most one run in flight: a tick that comes while a run is still going is dropped
and counted, never queued. Leadership is checked synchronously right before the job's code
starts, so a node whose lease ran out, even while its event loop was blocked, never starts a
run; and the pause as the election last learned it is checked at every start, each instant of
a catch-up included. Every run whose code began is recorded in the checkpoint with how it
ended, a run cancelled at shutdown too (fenced: a term that ended records nothing). The run
ends when the job's code returns: its duration is the code's, the job is idle at once, and
the record goes to the store after it (``_run/recorder.py``); the job stays busy for the
election until the store has answered, so that a handover waits for its records.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import random
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Executor
from datetime import datetime, timedelta
from typing import TypeVar

from .._aio import Supervisor, within
from .._checkpoint import Checkpoint, from_unix_us, to_unix_us
from .._clock import Clock
from .._frozen import maker
from .._history import cursor_of
from .._job.context import JobContext
from .._job.spec import JobSpec
from .._outcomes import OUTCOME_WORDS, DropReason, JobStats, Outcome, RunRecord
from .._schedule import count_instants, latest_instant, policy_of
from .._store.base import ClaimResult
from .._telemetry import NOT_LEADER, Telemetry
from .invoke import Invoker, NotStarted, summary
from .leadership import Leadership, TermView
from .misfire import (
    gap,
    gap_budget,
    interval_gap,
    is_late,
    next_missed,
    plan_catch_up,
    put_off_s,
    within_grace,
)
from .progress import Progress, no_checkpoint

__all__ = ["JobRunner"]

_job_context = maker(JobContext)
"""``JobContext``, made once per run: every field in order, positionally (its event loop
the run's, which its ``__post_init__`` would look up)."""

logger = logging.getLogger("fastapi_singletonjob.runner")

T = TypeVar("T")

_CLAIM_RETRY_S = 0.05
_ONE_US = timedelta(microseconds=1)
RECORD_AFTER_CANCEL_S = 2.0
"""Longest wait for the checkpoint record of a run cancelled from outside (shutdown): well
within the engine's grace for cancelled runs (``CANCEL_GRACE_S``), after which their locks
are left to expire."""
_MAX_COUNTED = 10**4
"""Most instants counted at once as dropped when a pause ends a catch-up."""

RunEnded = Callable[[str, "float | None"], None]
"""Called with the job's name when a run (or an attempt to start one) has ended, and, when an
interval job's run was put off (the previous leader ran recently), the delay to the next."""


class JobRunner:
    """Starts and supervises the runs of one job on this node."""

    __slots__ = (
        "_all_written",
        "_catching_up",
        "_claimed_term",
        "_closed",
        "_current",
        "_failing",
        "_first",
        "_invoker",
        "_iteration",
        "_leadership",
        "_let_go_timer",
        "_on_end",
        "_opened",
        "_rng",
        "_supervisor",
        "_task_name",
        "_telemetry",
        "_unwritten",
        "clock",
        "lease",
        "policy",
        "progress",
        "spec",
        "stats",
    )

    def __init__(
        self,
        spec: JobSpec,
        *,
        leadership: Leadership,
        clock: Clock,
        executor: Executor | None,
        app: object = None,
        telemetry: Telemetry | None = None,
        progress: Progress | None = None,
        rng: Callable[[], float] = random.random,
        on_end: RunEnded | None = None,
        supervisor: Supervisor | None = None,
    ) -> None:
        self.spec = spec
        self._supervisor = supervisor or Supervisor()
        """Starts the let-go timer (``_let_go_in_time``): the engine's, which logs and
        records a task that dies, and cancels it at teardown."""
        self.progress = progress
        """The job's checkpoint; None with ``checkpoint=False``."""
        if progress is not None:
            progress.watch(self._written)
        self.stats = JobStats()
        """The job's counters and last run, written here only (its ``next_run`` is the
        timer's: ``Ticker.next_run``)."""
        self.lease: TermView = leadership.view(spec.name)
        self._leadership = leadership
        self.clock = clock
        self._rng = rng
        """Uniform in [0, 1): the jitter of the claim's retries (the election's source)."""
        self._on_end = on_end
        self._invoker = Invoker(spec, clock=clock, executor=executor, app=app)
        self._telemetry = telemetry or Telemetry(leadership.node_id)
        self.policy = policy_of(spec.schedule)
        self._task_name = f"singletonjob run {spec.name!r}"
        self._claimed_term: int | None = None
        """The last term whose first instant was claimed (schedules that claim only that)."""
        self._iteration = 0
        self._current: asyncio.Task[None] | None = None
        self._closed = False
        self._unwritten = 0
        """Records of this job's runs the store has not answered yet (``_save_outcome``)."""
        self._all_written: asyncio.Future[None] | None = None
        """Made by ``written`` while records are on their way, resolved when ``_unwritten``
        falls back to 0."""
        self._catching_up = False
        """A ``misfire="catch_up"`` loop is in flight: it runs each instant that comes."""
        self._first: tuple[int, datetime] | None = None
        """(term, instant): the first instant this node ran, or did not, in that term."""
        self._opened: int | None = None
        """The last term whose gap (``_backfill``) was looked at."""
        self._failing: tuple[int, float, str] | None = None
        """(term, since, cause): the runs of that term could not start since that monotonic
        time, as the store's claims or checkpoint calls failed or timed out (the first
        failure's cause: what a let-go names, whichever call then finds the let-go point);
        None once one did."""
        self._let_go_timer: asyncio.Task[None] | None = None
        """Lets the job go when its store calls have failed for a lock expiry, whether or not
        a run comes then to notice (``_let_go_in_time``)."""

    @property
    def current(self) -> asyncio.Task[None] | None:
        """The run in flight (or the catch-up), if any."""
        return self._current

    def close(self) -> None:
        """Shutdown: no run starts any more (the runs in flight go on)."""
        self._closed = True
        if self._let_go_timer is not None:
            self._let_go_timer.cancel()

    def forget_checkpoint(self) -> None:
        """An operator reset the checkpoint: the next run reads it from the store."""
        if self.progress is not None:
            self.progress.forget()

    def stats_copy(self) -> JobStats:
        """A copy of the job's counters and last run, for a snapshot."""
        stats = copy.copy(self.stats)
        stats.dropped = stats.dropped.copy()
        return stats

    def within_grace(self, instant: datetime, now: datetime) -> bool:
        """Whether a run for ``instant`` may still start at ``now``: within ``misfire_grace``,
        or by default until the following instant."""
        return within_grace(self.spec.schedule, self.spec.misfire_grace_s, instant, now)

    def drop(
        self,
        reason: DropReason,
        count: int = 1,
        instant: datetime | None = None,
        last: datetime | None = None,
    ) -> None:
        """Count ``count`` ticks dropped for ``reason``; while this node leads, they go to
        the job's history as one entry, with the reason, when the first one's ``instant`` is
        known (and the last one, ``last``, for more than one, when known)."""
        self.stats.dropped[reason] += count
        token = self.lease.token
        if (
            instant is not None
            and self.progress is not None
            and token is not None
            and self._leadership.is_leader(self.spec.name, token)
        ):
            self._handled(token, instant)
            self.progress.missed(
                token, instant, reason.value, self.time_left(), count=count, last_at=last
            )
        self._telemetry.drop(self.spec.name, reason.value, count)
        logger.debug(
            "job %r dropped %d tick(s) on node %s: %s", self.spec.name, count, self.node, reason
        )

    @property
    def node(self) -> str:
        """This node's id."""
        return self._leadership.node_id

    # -- running --------------------------------------------------------------------------

    def can_start(self) -> bool:
        """Whether ``start`` would start a run now: this node leads the job, which is idle."""
        token = self.lease.token
        return (
            not self._closed
            and self._current is None
            and token is not None
            and self._leadership.is_leader(self.spec.name, token)
        )

    def start(
        self, scheduled_at: datetime, gate: asyncio.Future[float] | None = None
    ) -> asyncio.Task[None] | None:
        """Start a run for the instant ``scheduled_at`` if this node leads and is idle. With
        a ``gate`` (opt-in precision: ``scheduled_at`` is still to come) the run does what
        comes before the job's code now, and the job's code waits for the gate to open (its
        value: how long the run still waits on its own, at shutdown; else 0)."""
        if self._closed:
            return None
        token = self.lease.token
        if token is None or not self._leadership.is_leader(self.spec.name, token):
            self.stats.not_leader += 1
            self._telemetry.drop(self.spec.name, NOT_LEADER)
            return None
        if self._current is not None:
            if self._catching_up:  # its loop runs this instant too, in order: not dropped
                return None
            self.drop(DropReason.OVERLAP, instant=scheduled_at)
            return None
        claim = self.policy.claims_every_instant or (
            not self.policy.after_run and self._claimed_term != token
        )
        started_at = self.clock.now()
        if gate is None:
            self.stats.running_since = started_at
        # The loop's own create_task (its task factory, if any): asyncio.create_task adds two
        # Python calls around it, on every run.
        self._current = run = asyncio.get_running_loop().create_task(
            self._supervise(token, scheduled_at, started_at, claim, gate), name=self._task_name
        )
        # After the task: its first step (up to the job's first await) then comes before the
        # deadline watchdog that this wakes.
        self._leadership.run_started(self.spec.name)
        return run

    # -- what a JobContext asks of its runner ---------------------------------------------

    def is_leader_of(self, token: int) -> bool:
        """Whether this node still leads the job in term ``token``."""
        return self._leadership.is_leader(self.spec.name, token)

    def lost_of(self, token: int) -> asyncio.Event:
        """The "leadership lost" signal of term ``token``."""
        self._leadership.lost_awaited(self.spec.name)
        return self.lease.lost_of(token)

    async def save_state_of(self, ctx: JobContext, value: object) -> None:
        """``ctx.save_state(value)``: a fenced write of the job's state."""
        if self.progress is None:
            raise no_checkpoint(self.spec.name)
        time_left = self.time_left()
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
        elif self.progress.loaded_for(token):  # within a term: no read, no await
            if self.spec.call.sees_context:
                checkpoint = self.progress.cached
                iteration = (checkpoint.iteration if checkpoint is not None else 0) + 1
            else:  # a context nobody sees shows no checkpoint: none is made for it
                iteration = self.progress.iteration + 1
        else:
            sent_at = self.clock.monotonic()
            try:
                load = self.progress.load(token, self.time_left())
                checkpoint = await self._or_let_go(token, load)
            except Exception as exc:
                logger.warning(
                    "job %r: instant %s skipped on node %s: its checkpoint could not be read "
                    "(%r), and running without it could repeat work",
                    self.spec.name,
                    scheduled_at.isoformat(),
                    self.node,
                    exc,
                )
                self._store_failed(token, sent_at, f"its checkpoint could not be read: {exc!r}")
                return DropReason.STORE_ERROR
            self._backfill(token, checkpoint)
            iteration = (checkpoint.iteration if checkpoint is not None else 0) + 1
        self._store_answered()
        return _job_context(
            self.spec.name,
            self.node,
            token,
            scheduled_at,
            started_at,
            iteration,
            checkpoint,
            self,
            asyncio.get_running_loop(),
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
            sent_at = self.clock.monotonic()
            try:
                result = await self._or_let_go(
                    token, self._leadership.claim(job, token, instant_us)
                )
            except ConnectionError:
                result = None
            if result is None and self._store_failed(
                token, sent_at, "its claims were not answered (Redis did not answer in time)"
            ):
                return DropReason.STORE_ERROR
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
                # None of its instants can run while its clock is ahead: once that has
                # lasted a lock expiry, a node whose clock is right takes the job.
                self._store_failed(
                    token,
                    sent_at,
                    "its wall clock is ahead of Redis's by more than a claim allows (fix its "
                    "time sync)",
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
            await self.clock.sleep(delay_s * (0.5 + self._rng()))
            delay_s = min(2 * delay_s, 1.0)

    # -- letting go of a job this node cannot run -----------------------------------------

    async def _or_let_go(self, token: int, call: Awaitable[T]) -> T:
        """``call``'s result; ``ConnectionError`` when it is still out once the job's store
        calls have failed for a lock expiry (then the job is let go: ``_store_failed``)."""
        left_s = self._failing_left_s(token)
        if left_s is None:
            return await call
        if left_s <= 0:
            # Not sent at all: a claim made now would hold an instant that this node, about
            # to let the job go, never runs, and that its successor is then refused.
            if isinstance(call, Coroutine):
                call.close()
            raise ConnectionError(
                f"the job's store calls have failed for a lock expiry ({self.lease.ttl_s:g}s)"
            )
        try:
            return await within(call, left_s)
        except TimeoutError:
            raise ConnectionError(
                f"not answered within a lock expiry ({self.lease.ttl_s:g}s) of the job's "
                "first failing store call"
            ) from None

    def _store_failed(self, token: int, sent_at: float, cause: str) -> bool:
        """A store call of term ``token`` sent at ``sent_at`` failed or timed out; once they
        have for about a lock expiry, the job is let go (``Leadership.let_go``): this node
        cannot do its work, a healthy one should. Whether it was let go."""
        failing = self._failing
        if failing is None or failing[0] != token:
            failing = self._failing = (token, sent_at, cause)
        left_s = self._failing_left_s(token)
        if left_s is not None and left_s > 0:
            timer = self._let_go_timer
            if not self._closed and (timer is None or timer.done()):
                self._let_go_timer = self._supervisor.start(
                    self._let_go_in_time(token, cause),
                    name=f"singletonjob let-go {self.spec.name!r}",
                    forever=False,
                )
            return False
        if self.lease.let_go is None:
            self._leadership.let_go(self.spec.name, failing[2])
        return True

    async def _let_go_in_time(self, token: int, cause: str) -> None:
        """Let the job go a lock expiry after its store calls of term ``token`` began to
        fail, unless a run started meanwhile: the next run would notice too, but a job whose
        instants lie a period apart would then hold on for up to a period more, running
        nothing."""
        while not self._closed and self.is_leader_of(token):
            left_s = self._failing_left_s(token)
            if left_s is None:
                return
            if left_s <= 0:
                self._store_failed(token, self.clock.monotonic(), cause)
                return
            await self.clock.sleep(left_s)

    def _failing_left_s(self, token: int) -> float | None:
        """How long until the store calls of term ``token`` have failed for a lock expiry
        (the let-go point; 0 or less: reached); None while they do not fail."""
        failing = self._failing
        if failing is None or failing[0] != token:
            return None
        return failing[1] + self.lease.ttl_s - self.clock.monotonic()

    def _store_answered(self) -> None:
        """A run started: the store does this job's calls again."""
        self._failing = None

    async def _supervise(
        self,
        token: int,
        scheduled_at: datetime,
        started_at: datetime,
        claim: bool,
        gate: asyncio.Future[float] | None,
    ) -> None:
        resume_in_s: float | None = None
        try:
            resume_in_s = await self.attempt(token, scheduled_at, started_at, claim, gate)
        finally:
            self._ended(resume_in_s)

    async def attempt(
        self,
        token: int,
        scheduled_at: datetime,
        started_at: datetime,
        claim: bool,
        gate: asyncio.Future[float] | None = None,
    ) -> float | None:
        """Claim the instant if asked, read the checkpoint at a term's first run, run; with
        a ``gate``, wait for it (and then the time it says) after the claim. Returns the
        delay to the next run when an interval job's first run of a term was put off (the
        previous leader ran it recently), else None."""
        first_of_term = self.progress is not None and not self.progress.loaded_for(token)
        self._handled(token, scheduled_at)
        begun: JobContext | DropReason | None = None
        if gate is None:
            self.stats.running_since = started_at
        if self.lease.paused:  # a pause that came after the run was asked for: not claimed
            begun = DropReason.PAUSED
        elif claim:
            begun = await self._claim(token, scheduled_at)
        if gate is not None:
            left_s = await gate
            if left_s > 0:
                await self.clock.sleep(left_s)
            started_at = self.stats.running_since = self.clock.now()
        if begun is None:
            if not self.policy.after_run:
                self._leadership.instant_started(self.spec.name, scheduled_at)
            begun = await self._context(token, scheduled_at, started_at)
        if not isinstance(begun, DropReason) and self.lease.paused:
            # Paused while the claim, the gate or the checkpoint read was on its way: the
            # job's code has not begun, so nothing starts (the last check before it).
            begun = DropReason.PAUSED
        resume_in_s = None
        if isinstance(begun, DropReason):
            self.drop(begun, instant=scheduled_at)
        elif first_of_term and self.policy.after_run:
            # A new leader waits out the interval since the previous leader's run.
            resume_in_s = self._put_off(begun.checkpoint)
            if resume_in_s is None:
                await self._run(begun)
        else:
            await self._run(begun)
        self.stats.running_since = None
        return resume_in_s

    def _put_off(self, checkpoint: Checkpoint | None) -> float | None:
        """How long an interval job's first run of a term waits (``misfire.put_off_s``), on
        the store's clock: the record's end and the time of its read, not this node's."""
        last = checkpoint.last_completed_at if checkpoint is not None else None
        now = self.progress.read_at if self.progress is not None else None
        if now is None:
            return None
        delay_s = put_off_s(self.policy.period_s, last, now)
        if delay_s is not None and last is not None:
            logger.info(
                "job %r: its last run ended %.3fs ago; node %s runs it in %.3fs",
                self.spec.name,
                (now - last).total_seconds(),
                self.node,
                delay_s,
            )
        return delay_s

    def _ended(self, resume_in_s: float | None = None) -> None:
        """The run in flight (or the catch-up) has ended: the job is idle again, and for the
        election once its records are written too (``_written``)."""
        self._current = None
        self.stats.running_since = None
        if not self._unwritten:
            self._leadership.run_ended(self.spec.name)
        if self._on_end is not None:
            self._on_end(self.spec.name, resume_in_s)

    # -- misfires -------------------------------------------------------------------------

    def catch_up(self, missed: datetime | None) -> asyncio.Task[None] | None:
        """This node began a term of a cron or custom job: run what its ``misfire`` policy
        says of the instants after the stored last run that no node ran, as one task that
        counts as the run in flight (a tick meanwhile is dropped as an overlap, but for
        ``catch_up``'s loop, which runs it in turn). Without a
        stored run, ``missed`` (the last instant this node saw pass while another led) is
        run once, within its grace."""
        token = self.lease.token
        if self._closed or token is None or self._current is not None or self.progress is None:
            return None
        self._current = task = asyncio.create_task(
            self._catch_up(token, missed), name=self._task_name
        )
        self._leadership.run_started(self.spec.name)
        return task

    async def _catch_up(self, token: int, missed: datetime | None) -> None:
        """The task of ``catch_up`` for term ``token``: run what ``misfire.plan_catch_up``
        says, one run after the other, while the term lasts."""
        assert self.progress is not None
        schedule = self.spec.schedule
        try:
            try:
                checkpoint = await self.progress.load(token, self.time_left())
            except Exception as exc:
                logger.warning(
                    "job %r: node %s could not read its checkpoint (%r); instants missed "
                    "before this term are not run",
                    self.spec.name,
                    self.node,
                    exc,
                )
                return
            now = self.clock.now()
            plan = plan_catch_up(
                schedule,
                misfire=self.spec.misfire,
                grace_s=self.spec.misfire_grace_s,
                last=checkpoint.last_scheduled_at if checkpoint is not None else None,
                missed=missed,
                now=now,
            )
            if plan.run is not None:
                until = plan.run
            elif plan.after is not None:
                until = plan.after + _ONE_US
            else:
                until = now
            if not self._backfill(token, checkpoint, until) and plan.late:
                self.drop(DropReason.LATE, plan.late)
            if plan.run is not None:
                await self.attempt(token, plan.run, now, claim=True)
            cursor, grace_s = plan.after, self.spec.misfire_grace_s
            if cursor is None or grace_s is None:
                return
            self._catching_up = True
            while not self._closed and self.is_leader_of(token):
                now = self.clock.now()
                instant = next_missed(schedule, cursor, now)
                if instant is None:
                    return
                if self.lease.paused:
                    # A pause ends the catch-up: the instants that came are dropped as
                    # paused (as the timer drops those that come while it lasts).
                    count = count_instants(schedule, instant, now, _MAX_COUNTED)
                    last = latest_instant(schedule, instant, now) if count > 1 else None
                    self.drop(DropReason.PAUSED, count, instant, last)
                    return
                if is_late(instant, now, grace_s):
                    self.drop(DropReason.LATE, instant=instant)
                else:
                    await self.attempt(token, instant, now, claim=True)
                cursor = instant
        finally:
            self._catching_up = False
            self._ended()

    # -- the instants before a term that no node ran -------------------------------------

    def _handled(self, token: int, instant: datetime) -> None:
        """This node runs, or records as not run, ``instant`` in term ``token``."""
        first = self._first
        if first is None or first[0] != token or instant < first[1]:
            self._first = (token, instant)

    def _backfill(
        self, token: int, checkpoint: Checkpoint | None, until: datetime | None = None
    ) -> int:
        """At term ``token``'s first read of the checkpoint: find from the schedule the
        instants after where the history stands that no node ran before this term (before
        ``until``, and before the first instant the term ran or did not), and have them
        recorded with the term's next record (``Progress.hold``), as "no leader", or for a
        cron or custom job "misfire skipped" (its misfire policy did not run them). None on
        a job's first term or after a reset (no checkpoint), nor without a history. Returns
        how many instants (0: none, or none looked for)."""
        progress = self.progress
        if progress is None or progress.history <= 0 or self._opened == token:
            return 0
        self._opened = token
        cursor_us = cursor_of(progress.mark, token, self.spec.name)
        if checkpoint is None or cursor_us is None:
            return 0
        cursor = from_unix_us(cursor_us)
        budget = gap_budget(progress.history)
        first = self._first[1] if self._first is not None and self._first[0] == token else None
        reason = DropReason.NO_LEADER
        try:
            if self.policy.after_run:
                last, now = checkpoint.last_completed_at, progress.read_at
                every_s = self.policy.period_s
                if last is None or now is None or not every_s:
                    return 0
                if first is not None:  # this term's own instants (paused) are not the gap's
                    now = min(now, first + timedelta(seconds=every_s))
                entries = interval_gap(
                    every_s, last_completed_at=last, after=cursor, now=now, budget=budget
                )
            else:
                bounds = [moment for moment in (until, first) if moment is not None]
                if not bounds:
                    return 0
                if self.policy.catch_up and self.spec.checkpoint:
                    reason = DropReason.MISFIRE_SKIPPED
                entries = gap(self.spec.schedule, after=cursor, before=min(bounds), budget=budget)
        except Exception:  # a custom schedule's failure is the timer's to report; no gap
            logger.warning(
                "job %r: node %s could not find the instants no node ran before its term",
                self.spec.name,
                self.node,
                exc_info=True,
            )
            return 0
        if not entries:
            return 0
        counted = sum(entry.count or 1 for entry in entries)
        progress.hold(token, [(e.first, e.count, e.last) for e in entries], reason.value)
        self.stats.dropped[reason] += counted
        self._telemetry.drop(self.spec.name, reason.value, counted)
        logger.info(
            "job %r: %d instant(s) from %s were not run by any node before node %s's term "
            "(fencing token %d): recorded as %s",
            self.spec.name,
            counted,
            entries[0].first.isoformat(),
            self.node,
            token,
            reason.value,
        )
        return counted

    def time_left(self) -> float:
        """Seconds left on this node's lease of the job (0 when it does not lead)."""
        return self._leadership.time_left(self.spec.name)

    async def _run(self, ctx: JobContext) -> None:
        outcome: Outcome = Outcome.CANCELLED
        error: BaseException | None = None
        started = self.clock.monotonic()
        with self._telemetry.run_span(ctx) as span:
            ran = True
            most_s: float | None = None  # how long a record may still take (cancelled)
            try:
                outcome, error = await self._invoker.run(ctx)
            except NotStarted:
                ran = False
                span.set_attribute("singletonjob.outcome", DropReason.LEASE_EXPIRED.value)
                self.drop(DropReason.LEASE_EXPIRED, instant=ctx.scheduled_at)
            except asyncio.CancelledError:
                # Cancelled from outside (shutdown, past shutdown_timeout): recorded as such
                # while the term holds (the election renews it until the record is written),
                # then the cancel goes on.
                most_s = RECORD_AFTER_CANCEL_S
                raise
            finally:
                if ran:  # the run ends when the job's code returns: the record goes after
                    duration_s = self.clock.monotonic() - started
                    finished_at = ctx.started_at + timedelta(seconds=duration_s)
                    text = None if error is None else summary(error)
                    self._save_outcome(ctx, outcome, text, finished_at, duration_s, most_s)
                    self._telemetry.run_finished(span, ctx.job, outcome, duration_s, error)
                    self._record(ctx, outcome, text, finished_at, duration_s)

    def _save_outcome(
        self,
        ctx: JobContext,
        outcome: Outcome,
        error: str | None,
        finished_at: datetime,
        duration_s: float,
        most_s: float | None,
    ) -> None:
        """Record the run (which ended at ``finished_at`` after ``duration_s``) in the
        checkpoint and the history, fenced (a term that ended writes nothing), off the run
        path (``Progress.record``), bounded by the time left on the lease (and by
        ``most_s``). Until the store answers, the job counts as busy for the election: a
        handover of it waits for its records, so that the successor reads them."""
        if self.progress is None:
            return
        timeout_s = self._leadership.time_left(self.spec.name)
        if most_s is not None:
            timeout_s = min(timeout_s, most_s)
        self._unwritten += 1
        self.progress.record(
            ctx.fencing_token,
            outcome,
            ctx.scheduled_at,
            finished_at,
            error,
            timeout_s,
            ctx.started_at,
            duration_s,
        )

    def _written(self, token: int, sent_at: float, answered: bool) -> None:
        """The store answered a record of this job's (``answered``), or did not in time
        (``Progress.watch``): ``sent_at`` is when the record was put."""
        self._unwritten -= 1
        if not answered:
            self.stats.unrecorded += 1
            self._store_failed(token, sent_at, "its checkpoint could not be written")
        if self._unwritten:
            return
        if self._all_written is not None:
            if not self._all_written.done():
                self._all_written.set_result(None)
            self._all_written = None
        if self._current is None:
            self._leadership.run_ended(self.spec.name)

    @property
    def unwritten(self) -> int:
        """Records of this job's runs the store has not answered yet."""
        return self._unwritten

    async def written(self) -> None:
        """Wait until the store has answered every record of this job's runs (each is bounded
        by its own deadline)."""
        if self._unwritten:
            if self._all_written is None:
                self._all_written = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._all_written)

    def _record(
        self,
        ctx: JobContext,
        outcome: Outcome,
        text: str | None,
        finished_at: datetime,
        duration_s: float,
    ) -> None:
        self.stats.record(
            RunRecord(ctx.scheduled_at, ctx.started_at, finished_at, duration_s, outcome, text)
        )
        self._invoker.warn_if_long(duration_s, self.policy, self.lease.ttl_s)
        logger.debug(
            "job %r run #%d on node %s: %s in %.3fs",
            ctx.job,
            ctx.iteration,
            ctx.node_id,
            OUTCOME_WORDS[outcome],  # not .value: a lookup, on every run, logged or not
            duration_s,
        )
