"""What a new leader runs of the instants no node ran, and how long an interval job's first
run waits: pure functions (``_run/misfire.py``), tested from tables."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from fastapi_singletonjob._job.spec import MisfirePolicy
from fastapi_singletonjob._run.misfire import (
    CatchUp,
    is_late,
    next_missed,
    plan_catch_up,
    put_off_s,
    within_grace,
)
from fastapi_singletonjob._schedule import FixedRate

T0 = datetime(2026, 1, 1, tzinfo=UTC)
EVERY_10S = FixedRate(10.0)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.mark.parametrize(
    ("misfire", "grace_s", "last", "missed", "now", "plan"),
    [
        # No stored last run: the instant this node saw pass, once, within its grace.
        ("run_once", None, None, None, 25, CatchUp()),
        ("run_once", None, None, at(20), 25, CatchUp(run=at(20))),
        ("run_once", None, None, at(10), 25, CatchUp(late=1)),  # past the following one
        ("run_once", 3.0, None, at(20), 25, CatchUp(late=1)),  # past misfire_grace
        ("catch_up", 10.0, None, at(20), 25, CatchUp(run=at(20))),
        # run_once: the latest instant after the stored run.
        ("run_once", None, at(0), None, 35, CatchUp(run=at(30))),
        ("run_once", None, at(30), None, 35, CatchUp()),
        ("run_once", 2.0, at(0), None, 35, CatchUp(late=1)),
        # catch_up: the instants within the grace are run in order after ``after``.
        ("catch_up", 60.0, at(0), None, 35, CatchUp(after=at(0))),
        ("catch_up", 12.0, at(0), None, 35, CatchUp(late=2, after=at(23))),
        ("catch_up", 10.0, at(30), None, 35, CatchUp(after=at(30))),
    ],
)
def test_plan_catch_up(
    misfire: MisfirePolicy,
    grace_s: float | None,
    last: datetime | None,
    missed: datetime | None,
    now: float,
    plan: CatchUp,
) -> None:
    got = plan_catch_up(
        EVERY_10S, misfire=misfire, grace_s=grace_s, last=last, missed=missed, now=at(now)
    )
    assert got == plan


@pytest.mark.parametrize(
    ("cursor", "now", "instant"),
    [(0, 35, at(10)), (23, 35, at(30)), (30, 35, None), (30, 40, at(40))],
)
def test_next_missed(cursor: float, now: float, instant: datetime | None) -> None:
    assert next_missed(EVERY_10S, at(cursor), at(now)) == instant


class Stuck:
    """A schedule that does not move forward."""

    def next_fire(self, after: datetime) -> datetime | None:
        return after


def test_next_missed_ends_a_catch_up_that_would_not_move_forward() -> None:
    assert next_missed(Stuck(), at(0), at(35)) is None


@pytest.mark.parametrize(
    ("instant", "now", "grace_s", "late"),
    [(10, 20, 10.0, False), (10, 20.001, 10.0, True), (10, 10, 0.0, False)],
)
def test_is_late(instant: float, now: float, grace_s: float, late: bool) -> None:
    assert is_late(at(instant), at(now), grace_s) is late


@pytest.mark.parametrize(
    ("grace_s", "instant", "now", "within"),
    [
        (None, 10, 19.9, True),  # until the following instant
        (None, 10, 20, False),
        (3.0, 10, 13, True),
        (3.0, 10, 13.1, False),
    ],
)
def test_within_grace(grace_s: float | None, instant: float, now: float, within: bool) -> None:
    assert within_grace(EVERY_10S, grace_s, at(instant), at(now)) is within


@pytest.mark.parametrize(
    ("period_s", "last_completed", "now", "delay_s"),
    [
        (10.0, None, 5, None),  # no run stored
        (None, 0, 5, None),  # not an interval job
        (10.0, 0, 10, None),  # a whole period ago: run now
        (10.0, 0, 25, None),
        (10.0, 0, 4, 6.0),
        (10.0, 3.5, 4, 9.5),
        (10.0, 86400, 4, 10.0),  # stamped ahead of the store's clock: at most one period
        (10.0, 4, 4, 10.0),
    ],
)
def test_put_off_s(
    period_s: float | None, last_completed: float | None, now: float, delay_s: float | None
) -> None:
    last = None if last_completed is None else at(last_completed)
    assert put_off_s(period_s, last, at(now)) == delay_s
