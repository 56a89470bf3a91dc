"""Overdue jobs: when a job that should have started a run has not, as pure functions of what
the cluster stores and the job's schedule (no clock reads, no Redis).

A job is *overdue* once no run started within its period plus a grace after its last known
start: the instant ``next_fire(base) + grace``, where

- ``base`` is the latest start the cluster knows (``Anchor``): for an interval job the end of
  its last run (``last_completed_us``, on the store's clock: its next run is due ``every``
  after it), for the others the latest of its last recorded instant (``last_scheduled_us``)
  and its last claimed one (the ``last`` key, written as a run starts); never earlier than
  ``since``, when the watching node began to watch (or saw the job resumed), so that neither a
  fleet that was down nor a pause makes a job overdue at once;
- ``grace`` is the job's ``overdue_grace`` when it has one, else for fixed-rate and interval
  jobs ``default_grace_s`` (a lock expiry plus two heartbeats: the longest a normal failover
  takes, so that one never makes a job overdue), for cron and custom jobs their
  ``misfire_grace`` (a run may still start that late), and without one the time until the
  instant after (the run may start until then).

The *spell* of an overdue job is identified by its anchor (the stored values it was judged
from): it opens once, cluster-wide, and ends when a run's record or claim changes the anchor
(``_store.redis.scripts.OVERDUE``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TypeAlias

from ._schedule import Schedule, policy_of

__all__ = [
    "Anchor",
    "OverdueCallback",
    "OverdueEvent",
    "default_grace_s",
    "overdue_at",
    "parse_anchor",
    "parse_spell",
    "spell_value",
]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class OverdueEvent:
    """What ``on_overdue`` is told when a job's overdue spell begins (once, cluster-wide)."""

    job: str
    overdue_since: datetime
    """When the job became overdue: its last start, plus its period, plus the grace (UTC)."""
    last_started_at: datetime | None
    """The latest start the cluster knows of (UTC); None when no run is stored."""
    node_id: str
    """The node that noticed it and calls the callback."""


OverdueCallback: TypeAlias = Callable[[OverdueEvent], "Awaitable[None] | None"]
"""``on_overdue=``: a function or coroutine function of an ``OverdueEvent``."""


@dataclass(frozen=True, slots=True)
class Anchor:
    """What the cluster stores of a job's last run, as the overdue check reads it."""

    scheduled_us: int | None = None
    """The checkpoint's ``last_scheduled_us``: the last recorded run's instant."""
    completed_us: int | None = None
    """The checkpoint's ``last_completed_us``: when that run's record was written (store)."""
    claimed_us: int | None = None
    """The ``last`` key: the latest instant a leader claimed as it started it."""
    text: str = ",,"
    """The three as stored, joined by commas: the spell's identity."""

    def base(self, after_run: bool) -> datetime | None:
        """The latest start the cluster knows: for an interval job (``after_run``) the end of
        its last run, else its latest recorded or claimed instant."""
        if after_run:
            micros = self.completed_us if self.completed_us is not None else self.scheduled_us
        else:
            known = [us for us in (self.scheduled_us, self.claimed_us) if us is not None]
            micros = max(known) if known else None
        return None if micros is None else _EPOCH + timedelta(microseconds=micros)

    @property
    def empty(self) -> bool:
        """Nothing stored: the job never ran (or its record expired)."""
        return self.text == ",,"


def _micros(text: str) -> int | None:
    return int(text) if text.isdigit() and len(text) <= 18 else None


def parse_anchor(text: str) -> Anchor:
    """The ``Anchor`` of ``text`` as the ``OVERDUE`` script builds it (three fields, each
    digits or empty); a field that holds something else reads as none."""
    parts = (text.split(",") + ["", "", ""])[:3]
    scheduled, completed, claimed = (_micros(part) for part in parts)
    return Anchor(scheduled, completed, claimed, text)


def spell_value(since: datetime, told: bool, anchor: Anchor) -> str:
    """The value of a job's ``overdue`` key: ``<since, µs>:<told, 0 or 1>:<anchor>``."""
    since_us = (since - _EPOCH) // timedelta(microseconds=1)
    return f"{since_us}:{int(told)}:{anchor.text}"


def parse_spell(value: str | None) -> tuple[datetime, bool, str] | None:
    """When a spell began, whether a node took its telling, and its anchor's text, from an
    ``overdue`` key's value; None for none, or for a value of another form (the next check
    deletes it)."""
    if not value:
        return None
    since, _, rest = value.partition(":")
    told, sep, anchor = rest.partition(":")
    micros = _micros(since)
    if not sep or micros is None or told not in ("0", "1"):
        return None
    return _EPOCH + timedelta(microseconds=micros), told == "1", anchor


def default_grace_s(lock_expiry_s: float, heartbeat_s: float) -> float:
    """The grace of a fixed-rate or interval job without ``overdue_grace``: a lock expiry
    plus two heartbeats, the longest a failover takes (the dead lease runs out, then the next
    round of a follower takes it), so that no normal failover makes a job overdue."""
    return lock_expiry_s + 2 * heartbeat_s


def overdue_at(
    schedule: Schedule,
    anchor: Anchor,
    *,
    since: datetime,
    grace_s: float | None,
) -> datetime | None:
    """When the job is overdue if no new run starts: ``next_fire(base) + grace`` (see the
    module docstring), ``base`` no earlier than ``since``; ``grace_s`` None means until the
    instant after the next (cron and custom jobs without ``misfire_grace``). None when the
    schedule has no next instant (it ended): never overdue."""
    policy = policy_of(schedule)
    base = anchor.base(policy.after_run)
    base = since if base is None or base < since else base
    due = schedule.next_fire(base)
    if due is None:
        return None
    due = due.astimezone(UTC)
    if grace_s is not None:
        return due + timedelta(seconds=grace_s)
    following = schedule.next_fire(due)
    return None if following is None else following.astimezone(UTC)
