"""Schedule math: pure functions, tested from tables and seeded random loops in zero real time."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from datetime import UTC, date, datetime, time, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from fastapi_singletonjob._schedule import Cron, FixedRate, Interval, Schedule, quartz_misreading

UTC = UTC
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
ONE_US = timedelta(microseconds=1)
NEW_YORK = ZoneInfo("America/New_York")
IST = timezone(timedelta(hours=5, minutes=30))


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0, sec: int = 0) -> datetime:
    return datetime(year, month, day, hour, minute, sec, tzinfo=UTC)


def at(hour: int, minute: int, second: int = 0, micro: int = 0) -> datetime:
    """A time on 2026-01-15 UTC, far from any DST change."""
    return datetime(2026, 1, 15, hour, minute, second, micro, tzinfo=UTC)


def new_york(hour: int, minute: int, fold: int = 0) -> datetime:
    """A wall time on 2026-11-01 in New York, the fall-back day (01:00-02:00 happens twice)."""
    return datetime(2026, 11, 1, hour, minute, fold=fold, tzinfo=NEW_YORK)


# ---------------------------------------------------------------------------------------------
# FixedRate


@pytest.mark.parametrize(
    ("every_s", "offset_s", "after", "expected"),
    [
        pytest.param(1, 0, at(10, 0), at(10, 0, 1), id="on-grid after is not returned"),
        pytest.param(1, 0, at(10, 0, 0, 1), at(10, 0, 1), id="1us past a tick"),
        pytest.param(1, 0, at(9, 59, 59, 999_999), at(10, 0), id="1us before a tick"),
        pytest.param(0.5, 0.1, at(10, 0), at(10, 0, 0, 100_000), id="offset"),
        pytest.param(0.5, 0.1, at(10, 0, 0, 100_000), at(10, 0, 0, 600_000), id="offset, on-grid"),
        pytest.param(
            0.5, 0.1, at(10, 0, 0, 99_999), at(10, 0, 0, 100_000), id="offset, 1us before"
        ),
        pytest.param(0.001, 0, at(10, 0, 0, 400), at(10, 0, 0, 1_000), id="1ms grid"),
        pytest.param(0.001, 0.0005, at(10, 0, 0, 500), at(10, 0, 0, 1_500), id="1ms grid, offset"),
        pytest.param(0.000_25, 0, at(10, 0, 0, 999), at(10, 0, 0, 1_000), id="250us grid"),
        pytest.param(60, 0, at(10, 0, 30), at(10, 1), id="minute grid"),
        pytest.param(1, -0.25, at(10, 0), at(10, 0, 0, 750_000), id="negative offset wraps"),
        pytest.param(1, 1.25, at(10, 0), at(10, 0, 0, 250_000), id="offset beyond the period"),
        pytest.param(7, 0, EPOCH, utc(1970, 1, 1, 0, 0, 7), id="the epoch is a tick"),
        pytest.param(1, 0, EPOCH - timedelta(milliseconds=500), EPOCH, id="before the epoch"),
        pytest.param(1, 0, at(10, 0).astimezone(IST), at(10, 0, 1), id="non-UTC, on-grid"),
        pytest.param(3600, 0, new_york(1, 30), utc(2026, 11, 1, 6), id="01:30 EDT (fold=0)"),
        pytest.param(
            3600, 0, new_york(1, 30, fold=1), utc(2026, 11, 1, 7), id="01:30 EST (fold=1)"
        ),
    ],
)
def test_fixed_rate_next_fire(
    every_s: float, offset_s: float, after: datetime, expected: datetime
) -> None:
    fired = FixedRate(every_s, offset_s).next_fire(after)
    assert fired == expected
    assert fired.utcoffset() == timedelta(0)


def test_fixed_rate_10000_ticks_land_exactly_on_the_grid() -> None:
    rng = random.Random(20260308)
    for _ in range(5):
        every_us = rng.randint(1, 10_000_000)
        offset_us = rng.randint(0, every_us - 1)
        schedule = FixedRate(every_us / 1_000_000, offset_us / 1_000_000)
        start = EPOCH + rng.randint(0, 60 * 365 * 86_400_000_000) * ONE_US
        tick = schedule.next_fire(start)
        assert start < tick <= start + every_us * ONE_US
        k = ((tick - EPOCH) // ONE_US - offset_us) // every_us
        assert (tick - EPOCH) // ONE_US == offset_us + k * every_us
        for _ in range(10_000):
            # Ask from anywhere in the current period, on-grid included: the next tick comes back.
            jitter_us = 0 if rng.random() < 0.5 else rng.randrange(every_us)
            tick = schedule.next_fire(tick + jitter_us * ONE_US)
            k += 1
            assert (tick - EPOCH) // ONE_US == offset_us + k * every_us, (every_us, offset_us)


def test_fixed_rate_500ms_does_not_drift_over_10000_ticks() -> None:
    schedule = FixedRate(0.5, offset_s=0.1)
    tick = start = at(10, 0)
    for _ in range(10_000):
        tick = schedule.next_fire(tick)
    # 10:00:00.1 is the first tick; the 10,000th is 9,999 half-seconds later, to the microsecond.
    assert tick == at(10, 0, 0, 100_000) + 9_999 * timedelta(milliseconds=500)
    assert schedule.ticks_between(start, tick) == 10_000


@pytest.mark.parametrize(
    ("every_s", "offset_s", "start", "end", "expected"),
    [
        pytest.param(1, 0, at(10, 0), at(10, 0), 0, id="empty"),
        pytest.param(1, 0, at(10, 0), at(10, 0, 1), 1, id="start excluded, end included"),
        pytest.param(1, 0, at(10, 0), at(10, 0, 0, 999_999), 0, id="just short of a tick"),
        pytest.param(1, 0, at(9, 59, 59, 999_999), at(10, 0), 1, id="end on a tick"),
        pytest.param(0.5, 0, at(10, 0), at(10, 0, 10), 20, id="ten seconds of 500ms"),
        pytest.param(0.5, 0.1, at(10, 0), at(10, 0, 1), 2, id="offset"),
        pytest.param(0.001, 0, at(0, 0), at(0, 0) + timedelta(days=1), 86_400_000, id="1ms, 1 day"),
        pytest.param(1, 0, at(10, 0, 5), at(10, 0), 0, id="end before start"),
        pytest.param(1, 0, at(10, 0).astimezone(IST), at(10, 0, 3), 3, id="mixed zones"),
    ],
)
def test_fixed_rate_ticks_between(
    every_s: float, offset_s: float, start: datetime, end: datetime, expected: int
) -> None:
    assert FixedRate(every_s, offset_s).ticks_between(start, end) == expected


def test_fixed_rate_ticks_between_matches_stepping() -> None:
    rng = random.Random(7)
    for _ in range(300):
        every_us = rng.randint(1, 5_000)
        schedule = FixedRate(every_us / 1_000_000, rng.randint(0, 10_000) / 1_000_000)
        start = at(10, 0) + rng.randint(0, 10_000_000) * ONE_US
        end = start + rng.randint(0, 100 * every_us) * ONE_US
        ticks = [schedule.next_fire(start)]
        while ticks[-1] <= end and len(ticks) <= 101:
            ticks.append(schedule.next_fire(ticks[-1]))
        assert schedule.ticks_between(start, end) == len(ticks) - 1


# ---------------------------------------------------------------------------------------------
# Interval


@pytest.mark.parametrize(
    ("every_s", "after", "expected"),
    [
        pytest.param(1, at(10, 0), at(10, 0, 1), id="1s"),
        pytest.param(0.5, at(10, 0, 0, 700_000), at(10, 0, 1, 200_000), id="500ms"),
        pytest.param(0.000_001, at(10, 0), at(10, 0, 0, 1), id="1us"),
        pytest.param(1, at(10, 0).astimezone(IST), at(10, 0, 1), id="non-UTC after"),
        # Wall-clock arithmetic would give 02:30 EST, two real hours later.
        pytest.param(
            3600,
            datetime(2026, 11, 1, 1, 30, tzinfo=NEW_YORK),
            utc(2026, 11, 1, 6, 30),
            id="fall-back keeps real time",
        ),
    ],
)
def test_interval_next_fire(every_s: float, after: datetime, expected: datetime) -> None:
    fired = Interval(every_s).next_fire(after)
    assert fired == expected
    assert fired.utcoffset() == timedelta(0)


# ---------------------------------------------------------------------------------------------
# Cron


@pytest.mark.parametrize(
    ("expression", "zone", "after", "expected"),
    [
        pytest.param(
            "0 3 * * *", "Asia/Singapore", utc(2026, 1, 1), utc(2026, 1, 1, 19), id="03:00 SGT"
        ),
        pytest.param(
            "0 3 * * *",
            "Asia/Singapore",
            utc(2026, 1, 1, 19),
            utc(2026, 1, 2, 19),
            id="after on an occurrence",
        ),
        pytest.param(
            "0 3 * * *",
            "Asia/Singapore",
            utc(2026, 1, 1, 19) - ONE_US,
            utc(2026, 1, 1, 19),
            id="1us before",
        ),
        pytest.param(
            "*/15 * * * *", "UTC", at(10, 14, 59, 999_999), at(10, 15), id="5 fields, 1us before"
        ),
        pytest.param("*/15 * * * *", "UTC", at(10, 15, 0, 1), at(10, 30), id="5 fields, 1us after"),
        pytest.param(
            "* * * * * *",
            "UTC",
            at(10, 0, 0, 500_000),
            at(10, 0, 1),
            id="6 fields, sub-second after",
        ),
        pytest.param(
            "* * * * * *", "UTC", at(10, 0, 0, 999_999), at(10, 0, 1), id="6 fields, 1us before"
        ),
        pytest.param(
            "0 * * * * 15", "UTC", at(10, 0, 15), at(11, 0, 15), id="6th field is seconds"
        ),
        pytest.param(
            "0 * * * * 15", "UTC", at(10, 0, 14, 999_999), at(10, 0, 15), id="6th field, 1us before"
        ),
        pytest.param(
            "*/10 * * * * 30",
            "Europe/Berlin",
            at(10, 0, 30),
            at(10, 10, 30),
            id="6 fields in a zone",
        ),
        pytest.param(
            "0 9 * * mon", "America/New_York", utc(2026, 1, 1), utc(2026, 1, 5, 14), id="weekday"
        ),
        pytest.param(
            "@daily", "Europe/Berlin", utc(2026, 1, 1, 12), utc(2026, 1, 1, 23), id="alias"
        ),
        pytest.param(
            "0 3 * * *",
            "Asia/Singapore",
            datetime(2026, 1, 2, 3, tzinfo=ZoneInfo("Asia/Tokyo")),
            utc(2026, 1, 1, 19),
            id="after in another zone",
        ),
        pytest.param("0 0 29 2 *", "UTC", utc(2026, 1, 1), utc(2028, 2, 29), id="leap day"),
    ],
)
def test_cron_next_fire(expression: str, zone: str, after: datetime, expected: datetime) -> None:
    fired = Cron(expression, zone).next_fire(after)
    assert fired is not None
    assert fired == expected
    assert fired.tzinfo == ZoneInfo(zone)


def fires(schedule: Cron, zone: ZoneInfo, first_day: date, days: int) -> list[datetime]:
    """Every fire time, in UTC, from local midnight of ``first_day`` on, over ``days`` days."""
    start = datetime.combine(first_day, time(0), tzinfo=zone).astimezone(UTC)
    end = datetime.combine(first_day + timedelta(days=days), time(0), tzinfo=zone).astimezone(UTC)
    found: list[datetime] = []
    after = start - ONE_US
    while len(found) < 1_000:
        fired = schedule.next_fire(after)
        assert fired is not None
        assert fired.astimezone(UTC) > after
        after = fired.astimezone(UTC)
        if after >= end:
            return found
        found.append(after)
    raise AssertionError("more fire times than expected")


def per_local_day(instants: list[datetime], zone: ZoneInfo) -> Counter[date]:
    return Counter(t.astimezone(zone).date() for t in instants)


def transitions(zone: ZoneInfo, year: int) -> list[tuple[datetime, timedelta]]:
    """Each UTC instant in ``year`` where the zone's offset changes, with the change."""

    def offset(moment: datetime) -> timedelta:
        value = moment.astimezone(zone).utcoffset()
        assert value is not None
        return value

    found = []
    day = datetime(year, 1, 1, tzinfo=UTC)
    while day.year == year:
        if offset(day) != offset(day + timedelta(days=1)):
            minute = day
            while offset(minute) == offset(day):
                minute += timedelta(minutes=1)
            found.append((minute, offset(minute) - offset(day)))
        day += timedelta(days=1)
    return found


LORD_HOWE = ZoneInfo("Australia/Lord_Howe")
LORD_HOWE_2026 = transitions(LORD_HOWE, 2026)
LH_FALL_BACK = LORD_HOWE_2026[0][0].astimezone(LORD_HOWE).date()
LH_SPRING_FORWARD = LORD_HOWE_2026[1][0].astimezone(LORD_HOWE).date()


def test_lord_howe_shifts_by_30_minutes_twice_in_2026() -> None:
    assert [shift for _, shift in LORD_HOWE_2026] == [-timedelta(minutes=30), timedelta(minutes=30)]
    assert (date(2026, 4, 5), date(2026, 10, 4)) == (LH_FALL_BACK, LH_SPRING_FORWARD)


@pytest.mark.parametrize(
    ("expression", "zone_name", "day", "local_fires"),
    [
        # Spring forward: a time in the skipped hour runs once, when the gap ends.
        pytest.param(
            "30 2 * * *", "America/New_York", date(2026, 3, 8), ["03:00:00-04:00"], id="NY gap"
        ),
        pytest.param(
            "30 1 * * *", "Europe/London", date(2026, 3, 29), ["02:00:00+01:00"], id="London gap"
        ),
        pytest.param(
            "15 2 * * *", "Australia/Lord_Howe", LH_SPRING_FORWARD, ["02:30:00+11:00"], id="LH gap"
        ),
        # Fall back: a fixed time runs in the first copy of the repeated hour only.
        pytest.param(
            "30 1 * * *", "America/New_York", date(2026, 11, 1), ["01:30:00-04:00"], id="NY repeat"
        ),
        pytest.param(
            "30 1 * * *",
            "Europe/London",
            date(2026, 10, 25),
            ["01:30:00+01:00"],
            id="London repeat",
        ),
        pytest.param(
            "45 1 * * *", "Australia/Lord_Howe", LH_FALL_BACK, ["01:45:00+11:00"], id="LH repeat"
        ),
        # The hour field decides: a fixed hour with a wildcard minute is still a fixed-time job.
        pytest.param(
            "*/20 1 * * * 5",
            "America/New_York",
            date(2026, 11, 1),
            ["01:00:05-04:00", "01:20:05-04:00", "01:40:05-04:00"],
            id="NY repeat, fixed hour, 6 fields",
        ),
    ],
)
def test_cron_fixed_time_runs_once_across_dst(
    expression: str, zone_name: str, day: date, local_fires: list[str]
) -> None:
    zone = ZoneInfo(zone_name)
    found = fires(Cron(expression, zone_name), zone, day - timedelta(days=1), 3)
    on_day = [t.astimezone(zone) for t in found if t.astimezone(zone).date() == day]
    assert [t.isoformat()[11:] for t in on_day] == local_fires
    counts = per_local_day(found, zone)
    assert counts == {
        d: len(local_fires) for d in (day - timedelta(days=1), day, day + timedelta(days=1))
    }


@pytest.mark.parametrize(
    ("expression", "zone_name", "day", "fires_on_day", "fires_on_other_days"),
    [
        pytest.param(
            "0 * * * *", "America/New_York", date(2026, 3, 8), 23, 24, id="NY 1h, 23h day"
        ),
        pytest.param(
            "0 * * * *", "America/New_York", date(2026, 11, 1), 25, 24, id="NY 1h, 25h day"
        ),
        pytest.param(
            "*/30 * * * *", "Europe/London", date(2026, 3, 29), 46, 48, id="London, 23h day"
        ),
        pytest.param(
            "*/30 * * * *", "Europe/London", date(2026, 10, 25), 50, 48, id="London, 25h day"
        ),
        pytest.param(
            "*/15 * * * *", "Australia/Lord_Howe", LH_SPRING_FORWARD, 94, 96, id="LH, 23.5h"
        ),
        pytest.param("*/15 * * * *", "Australia/Lord_Howe", LH_FALL_BACK, 98, 96, id="LH, 24.5h"),
    ],
)
def test_cron_wildcard_hour_keeps_real_time_spacing_across_dst(
    expression: str, zone_name: str, day: date, fires_on_day: int, fires_on_other_days: int
) -> None:
    zone = ZoneInfo(zone_name)
    found = fires(Cron(expression, zone_name), zone, day - timedelta(days=1), 3)
    counts = per_local_day(found, zone)
    assert counts[day] == fires_on_day
    assert counts[day - timedelta(days=1)] == counts[day + timedelta(days=1)] == fires_on_other_days
    steps = {later - earlier for earlier, later in zip(found, found[1:], strict=False)}
    assert steps == {timedelta(days=1) / fires_on_other_days}


def test_cron_hour_step_fires_in_both_copies_of_a_repeated_hour() -> None:
    berlin = ZoneInfo("Europe/Berlin")  # 2026-10-25: 02:00-03:00 happens twice
    found = fires(Cron("0 */2 * * *", "Europe/Berlin"), berlin, date(2026, 10, 25), 1)
    local = [t.astimezone(berlin).isoformat()[11:] for t in found]
    assert local[:3] == ["00:00:00+02:00", "02:00:00+02:00", "02:00:00+01:00"]
    assert len(local) == 13


def test_cron_new_york_fall_back_wildcard_fires_in_both_folds() -> None:
    found = fires(Cron("*/30 * * * *", "America/New_York"), NEW_YORK, date(2026, 11, 1), 1)
    local = [t.astimezone(NEW_YORK) for t in found]
    assert [t.isoformat() for t in local if t.hour == 1] == [
        "2026-11-01T01:00:00-04:00",
        "2026-11-01T01:30:00-04:00",
        "2026-11-01T01:00:00-05:00",
        "2026-11-01T01:30:00-05:00",
    ]


@pytest.mark.parametrize(
    ("expression", "after", "expected"),
    [
        pytest.param(
            "30 1 * * *", new_york(1, 30), utc(2026, 11, 2, 6, 30), id="fixed, on EDT 01:30"
        ),
        pytest.param("30 1 * * *", new_york(1, 45), utc(2026, 11, 2, 6, 30), id="fixed, EDT 01:45"),
        pytest.param(
            "30 1 * * *", new_york(1, 0, fold=1), utc(2026, 11, 2, 6, 30), id="fixed, EST 01:00"
        ),
        pytest.param(
            "*/30 * * * *", new_york(1, 45), utc(2026, 11, 1, 6), id="wildcard, EDT 01:45"
        ),
        pytest.param(
            "*/30 * * * *", new_york(1, 30, fold=1), utc(2026, 11, 1, 7), id="wildcard, EST 01:30"
        ),
    ],
)
def test_cron_strictly_after_inside_the_repeated_hour(
    expression: str, after: datetime, expected: datetime
) -> None:
    fired = Cron(expression, "America/New_York").next_fire(after)
    assert fired is not None
    assert fired.astimezone(UTC) == expected
    # The result carries the right fold, so its own offset is the real one.
    assert fired.utcoffset() == fired.astimezone(UTC).astimezone(NEW_YORK).utcoffset()


# ---------------------------------------------------------------------------------------------
# Validation and display


@pytest.mark.parametrize(
    ("kwargs", "field", "bad", "hint"),
    [
        ({"expression": "61 * * * *"}, "expression", "'61 * * * *'", "minute field"),
        ({"expression": "* * * *"}, "expression", "'* * * *'", "5 fields"),
        ({"expression": "*/0 * * * *"}, "expression", "'*/0 * * * *'", "step of 0"),
        ({"expression": "0 0 31 2 *"}, "expression", "'0 0 31 2 *'", "never fires"),
        ({"expression": "0 0 1 1 * 0 2026"}, "expression", "'0 0 1 1 * 0 2026'", "7 fields"),
        ({"expression": 5}, "expression", "5", "must be a string"),
        ({"expression": "R 3 * * *"}, "expression", "'R 3 * * *'", "random value (R)"),
        ({"expression": "0 3 * * R"}, "expression", "'0 3 * * R'", "day of week field"),
        ({"expression": "H/15 * * * *"}, "expression", "'H/15 * * * *'", "'0/15 * * * *'"),
        (
            {"expression": "0 3 * * *", "timezone": "Mars/Olympus"},
            "timezone",
            "'Mars/Olympus'",
            "IANA",
        ),
        ({"expression": "0 3 * * *", "timezone": None}, "timezone", "None", "must be a string"),
    ],
)
def test_cron_rejects_bad_input(kwargs: dict[str, Any], field: str, bad: str, hint: str) -> None:
    with pytest.raises(ValueError) as caught:
        Cron(**kwargs)
    message = str(caught.value)
    assert f"{field}={bad}" in message
    assert hint in message


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("61 * * * *", "has 61 in its minute field ('61'), which takes 0-59"),
        ("0-61 * * * *", "has 61 in its minute field ('0-61'), which takes 0-59"),
        ("1,2,99 * * * *", "has 99 in its minute field ('1,2,99'), which takes 0-59"),
        ("* 24 * * *", "has 24 in its hour field ('24'), which takes 0-23"),
        ("* * 0 * *", "has 0 in its day of month field ('0'), which takes 1-31"),
        ("* * 32 * *", "has 32 in its day of month field ('32'), which takes 1-31"),
        ("* * * 13 *", "has 13 in its month field ('13'), which takes 1-12, or jan-dec"),
        ("* * * * 8", "has 8 in its day of week field ('8'), which takes 0-7 (0 and 7 are Sun"),
        ("* * * * * 60", "has 60 in its second field ('60'), which takes 0-59"),
        ("*/0 * * * *", "has a step of 0 in its minute field ('*/0'); a step is 1 or more"),
        ("* * * * * ?", "has '?' in its second field, which only day of month and day of week"),
    ],
)
def test_a_refused_cron_field_is_named_with_its_range_and_the_bad_value(
    expression: str, reason: str
) -> None:
    with pytest.raises(ValueError) as caught:
        Cron(expression)
    assert str(caught.value).startswith(f"expression={expression!r} {reason}")
    assert "Quartz" not in str(caught.value)


@pytest.mark.parametrize(
    ("quartz", "rewritten"),
    [
        ("0 */5 * * * ?", "*/5 * * * *"),
        ("0 0 12 ? * MON-FRI", "0 12 * * MON-FRI"),
        ("0 0 12 ? * 2-6", "0 12 * * 1-5"),  # Quartz counts the weekdays 1-7 from Sunday
        ("0 15 10 ? * 6#3", "15 10 * * 5#3"),
        ("0 30 9 * * *", "30 9 * * *"),  # here: hour 30
        ("30 0 0 25 12 ?", "0 0 25 12 * 30"),
    ],
)
def test_a_refused_quartz_expression_is_told_its_form_here(quartz: str, rewritten: str) -> None:
    with pytest.raises(ValueError) as caught:
        Cron(quartz)
    message = str(caught.value)
    assert message.startswith(f"expression={quartz!r} ")
    assert f"if it is in Quartz's order (seconds first: second='{quartz.split()[0]}'" in message
    assert f"write expression={rewritten!r}" in message
    Cron(rewritten)  # the form it suggests is valid here


def test_a_quartz_every_five_minutes_is_read_here_as_every_second_and_warned_of() -> None:
    quartz = "0 */5 * * * *"
    cron, after = Cron(quartz), at(4, 59, 59)
    fires: list[datetime] = []
    while len(fires) < 61:
        fired = cron.next_fire(after)
        assert fired is not None
        fires.append(after := fired)
    # What the warning says it means here: every second of minute 0 of every fifth hour.
    assert fires[:60] == [at(5, 0, second) for second in range(60)]
    assert fires[60] == at(10, 0, 0)
    warning = quartz_misreading(quartz)
    assert warning is not None
    assert warning.startswith(f"expression={quartz!r} has 6 fields, and the 6th is the second")
    assert "every second of each minute with minute='0' hour='*/5': 60 runs in a row" in warning
    assert "it means second='0' minute='*/5': for that, write expression='*/5 * * * *'" in warning
    assert "write the second field as 0-59" in warning
    # The Quartz meaning, written as suggested, fires every 5 minutes.
    assert Cron("*/5 * * * *").next_fire(at(4, 59, 59)) == at(5, 0)
    assert Cron("*/5 * * * *").next_fire(at(5, 0)) == at(5, 5)


@pytest.mark.parametrize(
    ("expression", "rewritten"),
    [
        ("0 */5 * * * *", "*/5 * * * *"),
        ("0 0 3 * * *", "0 3 * * *"),
        ("*/10 * * * * *", "* * * * * */10"),
        ("15 */2 * * * *", "*/2 * * * * 15"),
    ],
)
def test_quartz_misreading_names_the_form_here(expression: str, rewritten: str) -> None:
    warning = quartz_misreading(expression)
    assert warning is not None and f"write expression={rewritten!r}" in warning
    Cron(expression)  # valid here: warned of, not refused
    Cron(rewritten)


@pytest.mark.parametrize(
    "expression",
    [
        "*/5 * * * * 0",  # seconds last, as here: every 5 minutes at second 0
        "30 */2 * * * 0",  # 00:30:00 of every second hour
        "0 */5 * * * 0-59",  # every second, said so
        "* * * * * *",  # every second in both orders
        "0 */5 * * *",
        "@hourly",
    ],
)
def test_quartz_misreading_leaves_seconds_last_expressions_alone(expression: str) -> None:
    assert quartz_misreading(expression) is None


@pytest.mark.parametrize(
    ("kind", "kwargs", "text"),
    [
        (Interval, {"every_s": 0}, "every_s=0 must be positive"),
        (Interval, {"every_s": 1e-7}, "every_s=1e-07 must be positive"),
        (FixedRate, {"every_s": -1}, "every_s=-1 must be positive"),
        (FixedRate, {"every_s": float("inf")}, "every_s=inf must be a finite number"),
        (FixedRate, {"every_s": timedelta(seconds=1)}, ".total_seconds()"),
        (FixedRate, {"every_s": True}, "every_s=True must be a finite number"),
        (FixedRate, {"every_s": 1, "offset_s": float("nan")}, "offset_s=nan must be a finite"),
    ],
)
def test_periods_reject_bad_input(kind: type[Any], kwargs: dict[str, Any], text: str) -> None:
    with pytest.raises(ValueError) as caught:
        kind(**kwargs)
    assert text in str(caught.value)


@pytest.mark.parametrize(
    "call",
    [
        lambda naive: Interval(1).next_fire(naive),
        lambda naive: FixedRate(1).next_fire(naive),
        lambda naive: FixedRate(1).ticks_between(naive, at(10, 0)),
        lambda naive: FixedRate(1).ticks_between(at(10, 0), naive),
        lambda naive: Cron("* * * * *").next_fire(naive),
    ],
)
def test_naive_datetimes_are_rejected(call: Callable[[datetime], object]) -> None:
    with pytest.raises(ValueError, match="must be timezone-aware"):
        call(datetime(2026, 1, 15, 10, 0))


@pytest.mark.parametrize(
    ("schedule", "text"),
    [
        (Interval(1), "interval every 1s"),
        (Interval(0.5), "interval every 500ms"),
        (Interval(90), "interval every 90s"),
        (Interval(1.5), "interval every 1.5s"),
        (FixedRate(0.5), "fixed rate every 500ms"),
        (FixedRate(0.5, offset_s=0.1), "fixed rate every 500ms offset 100ms"),
        (FixedRate(0.000_25), "fixed rate every 250us"),
        (Cron("0 3 * * *", "Asia/Singapore"), 'cron "0 3 * * *" Asia/Singapore'),
        (Cron("*/5 * * * *"), 'cron "*/5 * * * *" UTC'),
    ],
)
def test_str(schedule: Schedule, text: str) -> None:
    assert str(schedule) == text


def test_schedules_compare_and_hash_by_their_fields() -> None:
    assert Cron("0 3 * * *", "UTC") == Cron("0 3 * * *")
    assert FixedRate(0.5, 0.1) != FixedRate(0.5)
    assert len({Interval(1), Interval(1), Interval(2)}) == 2
    assert repr(Cron("0 3 * * *")) == "Cron(expression='0 3 * * *', timezone='UTC')"


class EveryOtherDay:
    """A user-defined schedule: no base class, just the method."""

    def next_fire(self, after: datetime) -> datetime | None:
        return after + timedelta(days=2)


class NotASchedule:
    def fire_next(self, after: datetime) -> datetime:
        return after


def test_user_classes_are_schedules() -> None:
    mine: Schedule = EveryOtherDay()  # mypy checks the structure, isinstance the runtime side
    assert isinstance(mine, Schedule)
    assert not isinstance(NotASchedule(), Schedule)
    for builtin in (Interval(1), FixedRate(1), Cron("* * * * *")):
        assert isinstance(builtin, Schedule)


def test_every_cron_expression_accepted_gives_one_answer() -> None:
    """What replicas compute must not depend on a draw: ``next_fire`` of an accepted
    expression is the same on every call (``R`` was drawn anew at each one)."""
    after = datetime(2026, 12, 1, tzinfo=UTC)
    for expression in ("0 3 * * *", "*/7 1-5 * * mon-fri", "@daily", "0 0 L * *"):
        schedule = Cron(expression)
        assert len({schedule.next_fire(after) for _ in range(20)}) == 1, expression
