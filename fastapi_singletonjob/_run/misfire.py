"""What a new leader does about the runs that no node made, as pure functions of the stored
checkpoint, the schedule and the time (no clock read, no I/O; tested from tables): which of a
cron or custom job's missed instants it runs (``misfire="skip" | "run_once" | "catch_up"``),
and how long an interval job's first run of a term waits, so that it keeps its spacing from
the previous leader's last run (measured on the store's clock). ``JobRunner`` carries the
plan out: each run goes through ``JobRunner.attempt``, so each instant is claimed in the store
first and none runs twice."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from .._job.spec import MisfirePolicy
from .._schedule import Schedule, count_instants, latest_instant

__all__ = ["CatchUp", "is_late", "next_missed", "plan_catch_up", "put_off_s", "within_grace"]

_MAX_COUNTED_LATE = 10**4


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
