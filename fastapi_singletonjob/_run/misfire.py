"""What a new leader does about the runs that no node made, as pure functions of the stored
checkpoint, the schedule and the time (no clock read, no I/O; tested from tables): which of a
cron or custom job's missed instants it runs (``misfire="skip" | "run_once" | "catch_up"``),
and how long an interval job's first run of a term waits, so that it keeps its spacing from
the previous leader's last run (measured on the store's clock); and which instants before a
term no node ran (``gap``), which its leader records in the job's history. ``JobRunner``
carries the plan out: each run goes through ``JobRunner.attempt``, so each instant is claimed
in the store first and none runs twice."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from .._checkpoint import to_unix_us
from .._job.spec import MisfirePolicy
from .._schedule import FixedRate, Schedule, count_instants, latest_instant

__all__ = [
    "MAX_GAP_ENTRIES",
    "CatchUp",
    "Missed",
    "gap",
    "gap_budget",
    "interval_gap",
    "is_late",
    "next_missed",
    "plan_catch_up",
    "put_off_s",
    "within_grace",
]

_MAX_COUNTED_LATE = 10**4
MAX_GAP_ENTRIES = 50
"""Most history entries one gap adds (half the history when that is less)."""
_MAX_GAP_WALK = 100
"""Most ``next_fire`` calls in one walk of a gap (a cron step costs 0.1 to 0.3 ms: a gap is
found once per term, and must not hold up the election's loop)."""
_MAX_GAP_WINDOWS = 4
_ONE_US = timedelta(microseconds=1)


@dataclass(frozen=True, slots=True)
class Missed:
    """One history entry of a gap: an instant no node ran, or a run of them."""

    first: datetime
    count: int = 1
    """How many instants it stands for, from ``first`` on; 0: more than were counted."""
    last: datetime | None = None
    """With more than one: the last of them, when known."""


def gap_budget(history: int) -> int:
    """How many entries a gap may add to a history that keeps ``history``: half of it, at
    least 1 and at most ``MAX_GAP_ENTRIES``, so that the runs before the gap stay in view."""
    return max(1, min(history // 2, MAX_GAP_ENTRIES))


def gap(schedule: Schedule, *, after: datetime, before: datetime, budget: int) -> list[Missed]:
    """The history entries for the instants ``t`` of ``schedule`` with ``after < t < before``,
    oldest first, at most ``budget`` of them: each instant its own entry, or, when there are
    more, the latest ``budget - 1`` each and the ones before them as one entry that counts
    them (exactly for schedules with ``ticks_between``, such as fixed rate; others are
    walked up to ``_MAX_GAP_WALK`` instants, and a longer gap's first entry says "more")."""
    if budget < 1 or before <= after:
        return []
    walked, complete = _walk(schedule, after, before)
    if complete and len(walked) <= budget:
        return [Missed(instant) for instant in walked]
    keep = budget - 1
    if complete:
        older, newest = walked[: len(walked) - keep], walked[len(walked) - keep :]
        summary = Missed(older[0], len(older), older[-1] if len(older) > 1 else None)
        return [summary, *(Missed(instant) for instant in newest)]
    window = _window(schedule, after, before, keep, walked) if keep else []
    newest = window[-keep:] if keep else []
    stop = newest[0] if newest else before
    fast = getattr(schedule, "ticks_between", None)
    if fast is not None:  # a grid: counted, and its last instant found, at no cost
        count = int(fast(after, stop - _ONE_US))
        last = latest_instant(schedule, walked[0], stop - _ONE_US)
    else:
        count = 0
        last = window[-keep - 1] if len(window) > keep else None
    summary = Missed(walked[0], count, last)
    return [summary, *(Missed(instant) for instant in newest)]


def interval_gap(
    every_s: float,
    *,
    last_completed_at: datetime,
    after: datetime,
    now: datetime,
    budget: int,
) -> list[Missed]:
    """``gap`` for an interval job. Its instants are the starts its runs would have had,
    had a leader kept the spacing from the stored last run's end (``every_s`` apart after
    ``last_completed_at``, the runs taking no time), on the store's clock; a new leader
    whose first run starts at ``now`` (that clock) stands for the last of them before
    ``now``, so those missed are the ones an ``every_s`` or more before it, after
    ``after`` (where the history stands)."""
    every_us = max(1, round(every_s * 1e6))
    grid = FixedRate(every_s, offset_s=(to_unix_us(last_completed_at) % every_us) / 1e6)
    start = max(last_completed_at, after)
    return gap(grid, after=start, before=now - timedelta(seconds=every_s) + _ONE_US, budget=budget)


def _walk(schedule: Schedule, after: datetime, before: datetime) -> tuple[list[datetime], bool]:
    """The instants after ``after`` and before ``before``, up to ``_MAX_GAP_WALK`` of them,
    and whether that is all of them."""
    found: list[datetime] = []
    instant = after
    while len(found) < _MAX_GAP_WALK:
        following = schedule.next_fire(instant)
        if following is None or following >= before or following <= instant:
            return found, True
        found.append(following)
        instant = following
    return found, False


def _window(
    schedule: Schedule, after: datetime, before: datetime, keep: int, walked: list[datetime]
) -> list[datetime]:
    """The instants of a window that ends at ``before`` and holds at least the last ``keep``
    of a gap too long to walk (when the schedule is regular enough to be found in
    ``_MAX_GAP_WINDOWS`` tries): sized from the walked instants, narrowed or widened."""
    span = (walked[-1] - after) * ((keep + 1.5) / len(walked))
    found: list[datetime] = []
    for _ in range(_MAX_GAP_WINDOWS):
        start = max(after, before - span)
        found, complete = _walk(schedule, start, before)
        if not complete:
            span /= 2
        elif len(found) > keep or start == after:
            break
        else:
            span *= 2
    return found


def within_grace(
    schedule: Schedule, grace_s: float | None, instant: datetime, now: datetime
) -> bool:
    """Whether a run for ``instant`` may still start at ``now``: within ``grace_s``
    (``misfire_grace``), or without one until the schedule's following instant."""
    if grace_s is not None:
        return (now - instant).total_seconds() <= grace_s
    following = schedule.next_fire(instant)
    return following is None or now < following


def is_late(instant: datetime, now: datetime, grace_s: float) -> bool:
    """Whether ``instant``, caught up at ``now``, is past its grace of ``grace_s``."""
    return now - instant > timedelta(seconds=grace_s)


@dataclass(frozen=True, slots=True)
class CatchUp:
    """What a new leader of a cron or custom job does about the instants no node ran."""

    run: datetime | None = None
    """The one missed instant to run now, if any (``run_once``, or no stored last run)."""
    late: int = 0
    """How many missed instants are dropped as past their grace."""
    after: datetime | None = None
    """With ``catch_up``: then run, in order, each instant after this one that has come
    (``next_missed``), dropping those past their grace (``is_late``); None: nothing more."""


def plan_catch_up(
    schedule: Schedule,
    *,
    misfire: MisfirePolicy,
    grace_s: float | None,
    last: datetime | None,
    missed: datetime | None,
    now: datetime,
) -> CatchUp:
    """The plan of a term that begins at ``now``, with ``last`` the instant of the stored
    last run (on any node), if any. Without one, ``missed`` (the last instant this node saw
    pass while another node led) is run once, within its grace. ``misfire="skip"`` never
    gets here (it runs none)."""
    if last is None or misfire == "run_once":
        instant = missed if last is None else latest_instant(schedule, last, now)
        if instant is None:
            return CatchUp()
        if within_grace(schedule, grace_s, instant, now):
            return CatchUp(run=instant)
        return CatchUp(late=1)
    if grace_s is None:
        raise ValueError("misfire='catch_up' needs a misfire_grace")  # checked by JobOptions
    horizon = now - timedelta(seconds=grace_s)
    if horizon <= last:
        return CatchUp(after=last)
    oldest = schedule.next_fire(last)
    late = 0
    if oldest is not None and oldest < horizon:
        late = count_instants(schedule, oldest, horizon, _MAX_COUNTED_LATE)
    return CatchUp(late=late, after=horizon)


def next_missed(schedule: Schedule, cursor: datetime, now: datetime) -> datetime | None:
    """The catch-up's next instant after ``cursor``, if it has come by ``now``; None when the
    catch-up is over (no instant left, one still to come, or a schedule that does not move
    forward)."""
    instant = schedule.next_fire(cursor)
    if instant is None or instant > now or instant <= cursor:
        return None
    return instant


def put_off_s(
    period_s: float | None, last_completed_at: datetime | None, now: datetime
) -> float | None:
    """How long an interval job's first run of a term waits, because the stored last run (on
    any node) ended less than ``period_s`` before ``now``; None: it runs now.

    ``last_completed_at`` and ``now`` are on one clock, the store's: ``RECORD_RUN`` stamps
    the end with the server's time, and the new leader reads that time with the record, so
    no node's wall clock enters. The wait is at most ``period_s``: a record stamped ahead of
    ``now`` (a server clock stepped back, a record an older version wrote with its node's
    clock) delays the job by one period, not by the distance."""
    if last_completed_at is None or period_s is None:
        return None
    since_s = (now - last_completed_at).total_seconds()
    if since_s >= period_s:
        return None
    return period_s - max(since_s, 0.0)
