"""*When* each job runs: one timer for all the jobs of a node.

A single task keeps the next due time of every job in a heap and starts the runs that are due
(``JobRunner.start``); no job has a sleeping task of its own. Waits are on the monotonic clock:
an ``Interval`` job counts its period from the end of the previous run, and a wall-clock
instant (fixed rate, cron, custom) is converted to a monotonic deadline when it is armed and
checked against the wall clock when it comes, re-armed at least every ``MAX_SLEEP_S`` so that
a wall-clock step is noticed within that. A node that wakes after later instants were already
due runs none of them and waits for the next (no burst after a stall); a tick that comes while
a run is going is dropped, never queued.

With ``precision`` (opt-in) the timer wakes that long before each instant and starts the run
then, held at a *gate*: its task is created and its instant claimed (if the schedule claims
it) ahead, and the timer yields to the event loop until the instant comes, then opens the
gate. A job that is busy (or paused, not led, an interval job) when its instant comes within
reach is fired when the instant comes, as without the setting.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
from collections.abc import Callable
from datetime import datetime, timedelta

from .._aio import Pacer
from .._clock import Clock
from .._errors import ScheduleError
from .._outcomes import DropReason
from .._schedule import Cron, FixedRate, Schedule, count_instants, latest_instant
from .runner import JobRunner

__all__ = ["MAX_SLEEP_S", "Ticker"]

logger = logging.getLogger("fastapi_singletonjob.ticker")

MAX_SLEEP_S = 60.0
"""Longest wait before a wall-clock instant is checked against the wall clock again."""
_MAX_COUNTED_TICKS = 10_000
_BATCH = 64
"""Runs started between two yields to the event loop when many jobs share an instant."""
_PURE = (FixedRate, Cron)
"""The schedules whose ``next_fire`` depends on their fields and its argument only: jobs with
equal ones share the math of their next instants (``Ticker._following``)."""


class _Slot:
    """One job's place in the timer: its next instant and what to do when it comes."""

    __slots__ = (
        "armed",
        "due",
        "failure",
        "following",
        "missed",
        "next_run",
        "previous",
        "rank",
        "runner",
        "shared",
        "waiting",
    )

    def __init__(self, runner: JobRunner, now: datetime) -> None:
        self.runner = runner
        self.previous = now
        """The instant the next one is computed from (wall-clock schedules)."""
        self.due: datetime | None = None
        """The next wall-clock instant (None for an ``Interval`` job)."""
        self.following: datetime | None = None
        """The instant after ``due``, computed when ``due`` is armed: no schedule math
        between an instant coming and its run starting."""
        self.armed = 0
        """Generation of the slot's live heap entry; older entries are ignored."""
        self.missed: datetime | None = None
        """The last instant that passed while another node led (caught up on takeover)."""
        self.waiting = False
        """Parked until this node leads (``Interval``) or its run ends."""
        self.rank = runner.policy.period_s or math.inf
        """Among jobs due at the same instant, shorter periods start first: they have the
        least time to spare (rate-monotonic order)."""
        self.next_run: datetime | None = None
        """The next run as the status shows it (None: unknown, or none to come)."""
        self.failure: BaseException | None = None
        """Why the job's schedule failed on this node, if it did: nothing of it fires again."""
        self.shared: Schedule | None = None
        """The one object of the jobs whose schedules are equal and pure (``_PURE``), whose
        instants the timer computes once for all of them; None for a custom schedule."""


class Ticker:
    """The one timer of a node: each job's runner is ``add``-ed before ``run``. Hears from
    the election (``term_started``, ``triggered``, ``checkpoint_reset``: a ``TermListener``)
    and from the runners (``run_ended``), and keeps its own state: each job's next run and
    schedule failure."""

    def __init__(
        self,
        *,
        clock: Clock,
        retire: Callable[[JobRunner], None],
        precision_s: float = 0.0,
    ) -> None:
        self._clock = clock
        self._precision_s = precision_s
        self._retire = retire
        self._heap: list[tuple[float, float, int, int, _Slot]] = []
        """(due at, rank, order, generation, slot): at one instant, shorter periods first."""
        self._instants: dict[datetime, float] = {}
        """The monotonic time of each wall-clock instant armed, so that every job of an
        instant has the very same one and starts in rank order."""
        self._order = itertools.count()
        self._pacer = Pacer(clock, spin_s=precision_s)
        self._coming: list[tuple[float, int, _Slot, asyncio.Future[float] | None]] = []
        """Opt-in precision: the instants within ``precision_s``, in order, each with the
        gate of the run started ahead of it (None: fired when it comes)."""
        self._fired: list[tuple[_Slot, datetime | None]] = []
        """Slots fired since the last yield, to arm once their runs have begun."""
        self._slots: dict[str, _Slot] = {}
        self._shared: dict[Schedule, Schedule] = {}
        """One object per distinct pure schedule (``_Slot.shared``)."""
        self._last: tuple[Schedule | None, datetime | None, datetime | None] = (None, None, None)
        """The last instant computed of a shared schedule: (schedule, after, next instant).
        The jobs of one instant are armed one after the other, so a thousand jobs declared
        alike cost one computation of their next instant, not a thousand."""
        self._stopped = False
        """Set by ``stop_waiting``: a run that ends arms nothing any more."""

    def add(self, runner: JobRunner) -> None:
        """Time the runs of ``runner``'s job (before ``run``)."""
        slot = self._slots[runner.spec.name] = _Slot(runner, self._clock.now())
        schedule = runner.spec.schedule
        if type(schedule) in _PURE:
            slot.shared = self._shared.setdefault(schedule, schedule)

    # -- what the status reads ------------------------------------------------------------

    def next_run(self, job: str) -> datetime | None:
        """When the next run of ``job`` is due, if known."""
        slot = self._slots.get(job)
        return None if slot is None else slot.next_run

    def failure(self, job: str) -> BaseException | None:
        """Why ``job``'s schedule stopped on this node, if it did."""
        slot = self._slots.get(job)
        return None if slot is None else slot.failure

    # -- notifications from the election and the runs -------------------------------------

    def term_started(self, job: str) -> None:
        """This node started a term of ``job``: start a parked interval job, catch up."""
        slot = self._slots.get(job)
        if slot is None:
            return
        runner = slot.runner
        if runner.policy.after_run:
            if slot.waiting and runner.current is None:
                self._arm(slot, 0.0)
            return
        missed, slot.missed = slot.missed, None
        if not runner.policy.catch_up or runner.spec.misfire == "skip" or runner.lease.paused:
            return
        if runner.spec.checkpoint:  # what no node ran is known from the stored last run
            runner.catch_up(missed)
            return
        if missed is None:
            return
        # The previous leader may have died before running this instant: run it now, once;
        # the claim skips it if the previous leader did run it.
        if runner.within_grace(missed, self._clock.now()):
            runner.start(missed)
        else:
            runner.drop(DropReason.LATE)

    def triggered(self, job: str) -> None:
        """An operator asked for one extra run of ``job`` now, and this node leads it: start
        it, unless a run is in flight (then the request is dropped, and logged)."""
        slot = self._slots.get(job)
        if slot is None:
            return
        runner = slot.runner
        if runner.lease.paused:
            logger.warning("job %r is paused: the extra run asked for is dropped", job)
            runner.drop(DropReason.PAUSED)
            return
        if runner.current is not None:
            logger.warning("job %r has a run in flight: the extra run asked for is dropped", job)
            runner.drop(DropReason.OVERLAP)
            return
        logger.info("node %s starts an extra run of job %r, as an operator asked", runner.node, job)
        runner.start(self._clock.now())

    def checkpoint_reset(self, job: str) -> None:
        """An operator reset the checkpoint of ``job``, which this node leads: its runner
        forgets the copy it keeps, and the next run reads the store."""
        slot = self._slots.get(job)
        if slot is not None:
            slot.runner.forget_checkpoint()

    def run_ended(self, job: str, resume_in_s: float | None = None) -> None:
        """A run of ``job`` ended (``JobRunner``'s ``on_end``): an interval job counts its
        period from now, or waits ``resume_in_s`` when its run was put off (the previous
        leader ran recently)."""
        slot = self._slots.get(job)
        if slot is None or self._stopped:
            return
        if slot.runner.policy.after_run and slot.waiting:
            every_s = slot.runner.policy.period_s or 0.0
            if resume_in_s is not None:
                every_s = resume_in_s
            slot.next_run = self._clock.now() + timedelta(seconds=every_s)
            self._arm(slot, every_s)

    # -- the timer ------------------------------------------------------------------------

    async def run(self) -> None:
        """Start due runs until cancelled."""
        for slot in self._slots.values():
            if slot.runner.policy.after_run:
                self._arm(slot, 0.0)
            else:
                self._next_instant(slot)
        await self._pacer.drive(self._step)

    def _step(self) -> float:
        """Start the runs that are due; return how long to wait before the next step."""
        # The runs the previous step started have begun (and short ones ended): now the
        # schedule math of their next instants. A burst of a thousand jobs on one instant
        # never holds a thousand tasks at once, nor holds up the loop's other work.
        self._arm_next()
        if self._coming:
            self._come(self._clock.monotonic())
        for _ in range(_BATCH):
            if self._heap:
                due_at, _, _, armed, slot = self._heap[0]
                left = due_at - self._clock.monotonic()
            else:
                left = MAX_SLEEP_S
            # Opt-in precision: asyncio's timers wake up to a millisecond or two late (epoll
            # rounds its timeout up to whole ms), so wake early, start the run ahead, and wait
            # for the instant by yielding to the other tasks (the pacer's spin).
            if left > self._precision_s:
                if self._fired:
                    return 0.0
                wait = left - self._precision_s
                if self._coming:  # spin (the pacer yields for waits up to precision_s)
                    wait = min(wait, self._coming[0][0] - self._clock.monotonic())
                return wait
            heapq.heappop(self._heap)
            if armed != slot.armed:
                continue
            if slot.due is not None:
                self._instants.pop(slot.due, None)
            if left > 0:
                self._ahead(slot, due_at, armed)
            else:
                self._fire(slot)
        return 0.0

    def _ahead(self, slot: _Slot, due_at: float, armed: int) -> None:
        """Opt-in precision: ``slot``'s instant comes within ``precision_s``. Start its run
        now, held at a gate until the instant, if it can start now; else fire it then."""
        runner, due = slot.runner, slot.due
        gate: asyncio.Future[float] | None = None
        if (
            due is not None
            and not runner.policy.after_run
            and not runner.lease.paused
            and runner.can_start()
            # not a check of the wall clock on the way (MAX_SLEEP_S), nor a clock step
            and (due - self._clock.now()).total_seconds() <= self._precision_s
        ):
            gate = asyncio.get_running_loop().create_future()
            runner.start(due, gate)
            slot.previous, slot.missed = due, None
            self._fired.append((slot, slot.following))
        self._coming.append((due_at, armed, slot, gate))

    def _come(self, now: float) -> None:
        """Open the gates of the instants that came; fire the other instants that came."""
        while self._coming and self._coming[0][0] <= now:
            _, armed, slot, gate = self._coming.pop(0)
            if gate is not None:
                if not gate.done():  # (cancelled with its run's task)
                    gate.set_result(0.0)
            elif armed == slot.armed:
                self._fire(slot)

    def _arm_next(self) -> None:
        """Arm the next instant of each job whose run ``_fire`` just started."""
        if not self._fired:
            return
        fired, self._fired = self._fired, []
        for slot, following in fired:
            self._due(slot, following)

    def _arm(self, slot: _Slot, delay_s: float) -> None:
        self._arm_at(slot, self._clock.monotonic() + delay_s)

    def _arm_at(self, slot: _Slot, due_at: float) -> None:
        slot.armed += 1
        slot.waiting = False
        was_first = not self._heap or due_at < self._heap[0][0]
        entry = (due_at, slot.rank, next(self._order), slot.armed, slot)
        heapq.heappush(self._heap, entry)
        if was_first:
            self._pacer.ring()

    def _fire(self, slot: _Slot) -> None:
        runner = slot.runner
        if runner.policy.after_run:
            self._fire_interval(slot)
            return
        due = slot.due
        assert due is not None
        now = self._clock.now()
        if now < due:  # armed early by design (MAX_SLEEP_S) or the wall clock stepped back
            self._arm_instant(slot, due)
            return
        grace_s = runner.spec.misfire_grace_s
        following = slot.following
        try:
            if following is not None and following <= now:
                count = count_instants(runner.spec.schedule, due, now, _MAX_COUNTED_TICKS)
                last = latest_instant(runner.spec.schedule, due, now)  # a stall: rare
                runner.drop(DropReason.LATE, count, due, last)
                slot.previous = now
                self._next_instant(slot)
                return
            if grace_s is not None and (now - due).total_seconds() > grace_s:
                runner.drop(DropReason.LATE, instant=due)
            elif runner.lease.paused and runner.lease.token is not None:
                runner.drop(DropReason.PAUSED, instant=due)
            else:
                started = runner.start(due)
                catch_up = runner.policy.catch_up and started is None
                slot.missed = due if catch_up and runner.lease.token is None else None
        except Exception as exc:
            self._crash(slot, exc)
            return
        slot.previous = due
        self._fired.append((slot, following))

    def _fire_interval(self, slot: _Slot) -> None:
        runner = slot.runner
        if runner.lease.token is None:
            slot.waiting = True  # until term_started
            slot.next_run = None
            return
        if runner.lease.paused:
            runner.drop(DropReason.PAUSED, instant=self._clock.now())
            every_s = runner.policy.period_s or 0.0
            slot.next_run = self._clock.now() + timedelta(seconds=every_s)
            self._arm(slot, every_s)
            return
        slot.next_run = None  # known once this run has ended
        slot.waiting = True  # until run_ended
        if runner.start(self._clock.now()) is None:
            self.run_ended(runner.spec.name)

    def _next_instant(self, slot: _Slot) -> None:
        try:
            due = self._following(slot, slot.previous)
        except Exception as exc:
            self._crash(slot, exc)
            return
        self._due(slot, due)

    def _due(self, slot: _Slot, due: datetime | None) -> None:
        runner = slot.runner
        slot.due = due
        slot.next_run = due
        if due is None:
            logger.info("job %r has no more fire times on node %s", runner.spec.name, runner.node)
            self._retire(runner)
            return
        try:
            slot.following = self._following(slot, due)
        except Exception as exc:
            self._crash(slot, exc)
            return
        self._arm_instant(slot, due)

    def _following(self, slot: _Slot, after: datetime) -> datetime | None:
        """``slot``'s next instant after ``after``: computed, or that of the job armed just
        before when both share their schedule (``_Slot.shared``)."""
        shared = slot.shared
        if shared is not None:
            schedule, since, instant = self._last
            if schedule is shared and since == after:
                return instant
        instant = _next_fire(slot.runner, after)
        if shared is not None:
            self._last = (shared, after, instant)
        return instant

    def _arm_instant(self, slot: _Slot, due: datetime) -> None:
        due_at = self._instants.get(due)
        if due_at is None:
            # The wall clock read right before the monotonic one: an instant read any earlier
            # (before the schedule math) would fire that much late.
            left_s = (due - self._clock.now()).total_seconds()
            if left_s >= MAX_SLEEP_S:  # a check of the wall clock on the way, not the instant
                self._arm(slot, MAX_SLEEP_S)
                return
            due_at = self._instants[due] = self._clock.monotonic() + left_s
            if len(self._instants) > 2 * len(self._slots) + 16:  # instants no longer armed
                self._instants = {due: due_at}
        self._arm_at(slot, due_at)

    def _crash(self, slot: _Slot, exc: Exception) -> None:
        runner = slot.runner
        slot.failure = exc
        slot.next_run = None
        slot.armed += 1  # nothing of this job fires again
        logger.error(
            "the schedule of job %r failed on node %s; the job stops on this node",
            runner.spec.name,
            runner.node,
            exc_info=exc,
        )
        self._retire(runner)

    def stop_waiting(self) -> None:
        """Forget every pending instant (shutdown): nothing starts after this but the runs
        already held at their gates, each on its instant."""
        self._heap.clear()
        self._fired.clear()
        now = self._clock.monotonic()
        for due_at, _, _, gate in self._coming:
            if gate is not None and not gate.done():
                # A run held there may have claimed its instant: it waits for it on its own
                # and runs, and shutdown drains it as any run in flight.
                gate.set_result(max(due_at - now, 0.0))
        self._coming.clear()
        self._stopped = True
        for slot in self._slots.values():
            slot.armed += 1
            slot.waiting = False
        self._pacer.ring()


def _next_fire(runner: JobRunner, after: datetime) -> datetime | None:
    """The schedule's next instant after ``after``, refused unless it is strictly later: a
    schedule that does not move forward would spin the timer or drop every instant."""
    due = runner.spec.schedule.next_fire(after)
    if due is not None and not due > after:
        raise ScheduleError(
            f"the schedule's next_fire({after.isoformat()}) returned {due.isoformat()}, which "
            "is not later; next_fire must return an instant strictly after its argument, or "
            "None when there is none",
            job=runner.spec.name,
        )
    return due
