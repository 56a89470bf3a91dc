"""Schedules: when a job fires next.

Every schedule answers one question, ``next_fire(after)``, as a pure function of its input (no
clock reads, sleeps or I/O). The library ships three shapes:

- ``Interval``: run, then wait ``every_s`` after the run ends (the runner passes that end).
- ``FixedRate``: a grid aligned to the Unix epoch (plus an offset), so every replica shares the
  phase and a failover keeps the cadence. Integer-microsecond math: it never drifts.
- ``Cron``: a cron expression (croniter) in an IANA time zone; a daylight-saving change never
  runs a fixed-time job twice.

Anything with a ``next_fire`` method is a ``Schedule``, so users can bring their own.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Protocol, runtime_checkable
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, CroniterError, croniter

__all__ = [
    "CLAIM_EVERY_TICK_MIN_PERIOD_S",
    "Cron",
    "FixedRate",
    "Interval",
    "Policy",
    "Schedule",
    "count_instants",
    "latest_instant",
    "policy_of",
    "quartz_misreading",
]

CLAIM_EVERY_TICK_MIN_PERIOD_S = 1.0
"""Fixed-rate ticks at least this far apart are each claimed in the store before they run (a
round trip per tick is cheap at that rate); faster ones claim the first tick of each term."""

_UTC = UTC
_EPOCH = datetime(1970, 1, 1, tzinfo=_UTC)
_ONE_US = timedelta(microseconds=1)
_US_PER_S = 1_000_000
# Any expression that fires at all fires within a few years of any date, so one search from a
# fixed anchor tells "never fires" apart without reading the clock.
_VALIDATION_ANCHOR = datetime(2000, 1, 1, tzinfo=_UTC)
# Bounds the skip loop in Cron.next_fire. The longest repeated hour is 2 h (Antarctica/Troll);
# a fixed-hour job firing every second has 7,200 candidates in it to skip.
_MAX_CRON_CANDIDATES = 10_000
_DRAWN_FIELD = re.compile(r"(?P<kind>[HhRr])(?:\((?P<range>\d+-\d+)\))?(?P<step>/\d+)?")
"""A field croniter draws a value for (its ``hash_expression_re``): ``R`` (random) or ``H``
(hashed), with an optional ``(a-b)`` range and ``/step``. It matches whole fields only, as
croniter does: any other use of those letters is not a cron field, and croniter refuses it."""
_CRON_FIELDS = ("minute", "hour", "day of month", "month", "day of week", "second")
_CRON_RANGES = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 7), (0, 59))
"""The numbers croniter takes in each field (``_CRON_FIELDS``)."""
_CRON_RANGE_NAMES = ("", "", "", ", or jan-dec", " (0 and 7 are Sunday), or sun-sat", "")
_CRON_ORDER = "minute hour day-of-month month day-of-week second"
_CRON_HELP = (
    "(5 fields: minute hour day month weekday, optional 6th field seconds); "
    "see https://crontab.guru"
)
_QUARTZ_FIELDS = ("second", "minute", "hour", "day of month", "month", "day of week")
"""Quartz's and Spring's order: seconds first (and a 7th field, the year, which no 6-field
expression has)."""
_QUARTZ_WEEKDAY = re.compile(r"(?<![/#\d])\d+")
"""A day-of-week number in a Quartz field (not a step after ``/`` nor an nth after ``#``):
Quartz counts 1-7 from Sunday, cron 0-6."""


@runtime_checkable
class Schedule(Protocol):
    """Anything that says when a job fires next; pass your own object to a decorator."""

    def next_fire(self, after: datetime) -> datetime | None:
        """Return the first fire time strictly later than ``after``, or None when there is none.

        ``after`` is timezone-aware; the result must be timezone-aware too (any zone).
        """
        ...


@dataclass(frozen=True, slots=True)
class Policy:
    """How the engine treats a schedule's instants. Each schedule states its own, so the
    engine never branches on schedule classes; a custom schedule may set a ``policy``
    attribute, else it gets ``Policy()`` (every instant claimed, a missed one caught up)."""

    after_run: bool = False
    """The next instant counts from the end of the previous run, waited on the monotonic
    clock (``Interval``); otherwise instants are wall-clock times from ``next_fire``."""
    claims_every_instant: bool = True
    """Claim each instant in the store before running it, so that none runs twice across
    leaders. Without it, the first instant of each leadership term is claimed."""
    period_s: float | None = None
    """The nominal period, for the warning about runs that take most of it."""
    catch_up: bool = True
    """A node that takes over runs the last instant missed during the takeover, once, if it
    is still within ``misfire_grace``."""


_DEFAULT_POLICY = Policy()


@functools.lru_cache(maxsize=256)
def _policy(*, after_run: bool, claims: bool, period_s: float, catch_up: bool) -> Policy:
    """One shared ``Policy`` per distinct value (1,000 jobs of one period share one)."""
    return Policy(
        after_run=after_run, claims_every_instant=claims, period_s=period_s, catch_up=catch_up
    )


def policy_of(schedule: Schedule) -> Policy:
    """The schedule's policy: its ``policy`` attribute, or the default for custom ones."""
    policy = getattr(schedule, "policy", None)
    return policy if isinstance(policy, Policy) else Policy()


_MAX_WALKED = 100
"""Most instants ``count_instants`` walks one by one: each step of a cron schedule builds a
croniter (a fraction of a millisecond), and after a wall-clock step of an hour a per-second
job would otherwise block the event loop for seconds, long enough to lose its leases."""


def latest_instant(schedule: Schedule, after: datetime, now: datetime) -> datetime | None:
    """The last instant ``t`` of ``schedule`` with ``after < t <= now``, or None.

    Searched back from ``now`` in doubling windows (1 ms, 2 ms, ... up to ``after``), then
    walked forward through the first window that holds one: a daily cron after months of
    downtime costs a few dozen ``next_fire`` calls, not one per instant missed."""
    if now <= after:
        return None
    span = timedelta(milliseconds=1)
    while True:
        start = max(after, now - span)
        found = schedule.next_fire(start)
        if found is not None and found <= now:
            break
        if start == after:
            return None
        span *= 2
    for _ in range(_MAX_WALKED):
        following = schedule.next_fire(found)
        if following is None or following > now or following <= found:
            break
        found = following
    return found


def count_instants(schedule: Schedule, start: datetime, end: datetime, limit: int) -> int:
    """Count the instants ``t`` with ``start <= t <= end`` (at most ``limit``), ``start`` being
    one of them: the ticks a stalled node skips. Schedules without ``ticks_between`` are
    walked, and counted up to ``_MAX_WALKED`` only."""
    fast = getattr(schedule, "ticks_between", None)
    if fast is not None:
        return min(limit, 1 + int(fast(start, end)))
    limit = min(limit, _MAX_WALKED)
    count, instant = 1, schedule.next_fire(start)
    while instant is not None and instant <= end and count < limit:
        count, instant = count + 1, schedule.next_fire(instant)
    return count


@dataclass(frozen=True, slots=True)
class Interval:
    """Run, then wait ``every_s`` seconds after the run ends before the next one."""

    every_s: float
    _every_us: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_every_us", _positive_us("every_s", self.every_s))

    @property
    def policy(self) -> Policy:
        """Waited from the end of each run on the monotonic clock; nothing to claim."""
        return _policy(after_run=True, claims=False, period_s=self.every_s, catch_up=False)

    def next_fire(self, after: datetime) -> datetime:
        """Return ``after`` (the end of the previous run) plus ``every_s``, in UTC."""
        # Arithmetic on an aware datetime keeps its wall clock, not real time, so go through UTC:
        # otherwise 01:30 EDT + 1 h on a fall-back night would come out 2 h later.
        return _require_aware(after).astimezone(_UTC) + self._every_us * _ONE_US

    def __str__(self) -> str:
        return f"interval every {_format_us(self._every_us)}"


@dataclass(frozen=True, slots=True)
class FixedRate:
    """Fire at every instant ``UNIX_EPOCH + offset_s + k * every_s`` for integer ``k``.

    The grid depends only on ``every_s`` and ``offset_s``, never on when a node started, so all
    replicas agree on it. Both are rounded to whole microseconds (datetime's resolution) and all
    math is on integers, so tick ten million is exactly where it should be.
    """

    every_s: float
    offset_s: float = 0.0
    _every_us: int = field(init=False, repr=False, compare=False)
    _offset_us: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        every_us = _positive_us("every_s", self.every_s)
        offset_us = round(_finite("offset_s", self.offset_s) * _US_PER_S) % every_us
        object.__setattr__(self, "_every_us", every_us)
        object.__setattr__(self, "_offset_us", offset_us)

    @property
    def policy(self) -> Policy:
        """Sub-second ticks claim the first tick of each term, slower ones every tick."""
        claims = self.every_s >= CLAIM_EVERY_TICK_MIN_PERIOD_S
        return _policy(after_run=False, claims=claims, period_s=self.every_s, catch_up=False)

    def next_fire(self, after: datetime) -> datetime:
        """Return the first grid instant strictly later than ``after``, in UTC."""
        k = self._index(after) + 1
        return _EPOCH + (self._offset_us + k * self._every_us) * _ONE_US

    def ticks_between(self, start: datetime, end: datetime) -> int:
        """Count the grid instants ``t`` with ``start < t <= end`` (0 when ``end <= start``).

        The runner uses it to count the ticks dropped while a run overran.
        """
        return max(0, self._index(end, "end") - self._index(start, "start"))

    def _index(self, moment: datetime, name: str = "after") -> int:
        """Return the ``k`` of the last grid instant at or before ``moment``."""
        return (_epoch_us(moment, name) - self._offset_us) // self._every_us

    def __str__(self) -> str:
        text = f"fixed rate every {_format_us(self._every_us)}"
        return f"{text} offset {_format_us(self._offset_us)}" if self._offset_us else text


@dataclass(frozen=True, slots=True)
class Cron:
    """Fire on a cron expression evaluated in an IANA time zone (UTC unless given).

    ``expression`` has 5 fields (minute hour day month weekday) or 6, where the 6th field is
    SECONDS at the end (croniter's convention: ``"*/10 * * * * 30"`` fires at second 30 of every
    10th minute). croniter's aliases (``@daily``, ``@hourly``, ...) work; 7-field (year)
    expressions and fields croniter draws (``R``, ``H``) do not. Across daylight-saving
    changes (Vixie cron's rule):

    - spring forward: a job whose time falls in the skipped hour runs once, when it ends;
    - fall back: a job whose hour field starts with ``*`` (``*``, ``*/2``) keeps real-time
      spacing and fires in both copies of the repeated hour; any other job is a fixed-time job
      and fires in the first copy only.

    ``next_fire`` returns times in the job's zone, with ``fold`` set. Python ignores ``fold``
    when both sides of ``==``, ``<`` or ``-`` share a tzinfo, so compare them in UTC.
    """

    expression: str
    timezone: str = "UTC"
    _zone: ZoneInfo = field(init=False, repr=False, compare=False)
    _fixed_time: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        expression = _require_str("expression", self.expression, "'0 3 * * *'")
        zone_name = _require_str("timezone", self.timezone, "'Europe/Berlin'")
        _require_deterministic(expression)
        try:
            fields = croniter(expression, _VALIDATION_ANCHOR).expressions
        except CroniterError as exc:
            raise ValueError(_refusal(expression)) from exc
        if len(fields) not in (5, 6):
            raise ValueError(
                f"expression={expression!r} has {len(fields)} fields, which is not supported "
                f"{_CRON_HELP}"
            )
        try:
            zone = ZoneInfo(zone_name)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise ValueError(
                f"timezone={zone_name!r} is not a known IANA time zone; use a name such as "
                "'Europe/Berlin' or 'UTC' (where the system has no time zone database, "
                "install the 'tzdata' package)"
            ) from exc
        object.__setattr__(self, "_zone", zone)
        object.__setattr__(self, "_fixed_time", not fields[1].startswith("*"))
        if self.next_fire(_VALIDATION_ANCHOR) is None:
            raise ValueError(
                f"expression={expression!r} never fires: no date matches it (such as day 31 "
                "of a month that has 30 days or fewer); check the day, month and weekday fields"
            )

    @property
    def policy(self) -> Policy:
        """Every instant claimed; a missed one caught up within ``misfire_grace``."""
        return _DEFAULT_POLICY

    def next_fire(self, after: datetime) -> datetime | None:
        """Return the first fire time strictly later than ``after``, in the job's zone.

        None when croniter finds no later match (an expression that never fires is rejected
        when the ``Cron`` is built, so in practice this does not happen).
        """
        after_utc = _require_aware(after).astimezone(_UTC)
        # croniter works in the zone of its start time, so hand it one in the job's zone.
        candidates = croniter(self.expression, after_utc.astimezone(self._zone))
        for _ in range(_MAX_CRON_CANDIDATES):
            try:
                candidate: datetime = candidates.get_next(datetime)
            except CroniterBadDateError:
                return None
            # Compare in UTC: with one shared tzinfo Python would ignore fold.
            if candidate.astimezone(_UTC) <= after_utc:
                continue  # defensive: croniter versions differ around DST changes
            if self._fixed_time and _is_second_of_repeated(candidate, self._zone):
                continue  # croniter fires a fixed time in both copies of a repeated hour
            return candidate
        raise RuntimeError(
            f"{self}: no fire time found after {after.isoformat()} within "
            f"{_MAX_CRON_CANDIDATES} candidates; please report this as a bug"
        )

    def __str__(self) -> str:
        return f'cron "{self.expression}" {self.timezone}'


def _require_deterministic(expression: str) -> None:
    """Refuse the fields whose value croniter draws instead of reading it: every replica must
    compute the same instants, and ``next_fire`` must give the same answer each time.

    ``R`` is drawn at random each time an expression is read (``next_fire`` reads it at every
    call), so replicas, and the calls of one replica, disagree. ``H`` is derived from a hash
    id by a formula that croniter has changed between releases, so replicas on different
    versions would disagree during a rolling upgrade; the fix, a value written out, is as
    easy as it is safe."""
    fields = expression.split()
    for index, text in enumerate(fields):
        drawn = _DRAWN_FIELD.fullmatch(text)
        if drawn is None or index >= len(_CRON_FIELDS):
            continue
        name = _CRON_FIELDS[index]
        # Written out: H(a-b)/s -> a-b/s, H(a-b) -> a, H/s -> first/s, H -> first.
        span, step = drawn["range"], drawn["step"] or ""
        if span is None:
            value = f"{_CRON_RANGES[index][0]}{step}"
        else:
            value = span + step if step else span.partition("-")[0]
        example = " ".join(value if i == index else f for i, f in enumerate(fields))
        if drawn["kind"] in "Rr":
            why = (
                "croniter's random value (R), drawn anew each time the expression is read: "
                "replicas, and each next fire time, would disagree"
            )
        else:
            why = (
                "croniter's hashed value (H), derived by a formula that has changed between "
                "croniter releases: replicas on different versions would disagree"
            )
        raise ValueError(
            f"expression={expression!r} has {text!r} in its {name} field, which is {why}; "
            f"write the {name} to run at, e.g. expression={example!r}"
        )


def quartz_misreading(expression: str) -> str | None:
    """What a 6-field expression written in Quartz's order (seconds first) means here, where
    the seconds come last, and how to write it; None for any other expression.

    The mark of one is a second field (the 6th) of ``*`` under a minute field (the 1st) that is
    not: here it fires every second of each minute it matches, 60 runs in a row, which is
    rarely meant (and can be said as ``0-59`` when it is), while in Quartz that 6th field is
    the day of week. ``"0 */5 * * * *"`` (Quartz: every 5 minutes) fires here every second of
    minute 0 of every fifth hour."""
    fields = expression.split()
    if len(fields) != 6 or fields[5] != "*" or fields[0] == "*":
        return None
    here = _named_fields(_CRON_FIELDS[:5], fields[:5])
    quartz = _named_fields(_QUARTZ_FIELDS, fields)
    rewritten = _from_quartz(fields)
    fix = (
        f"expression={rewritten!r}"
        if rewritten is not None
        else f"the same fields with the seconds last ({_CRON_ORDER})"
    )
    return (
        f"expression={expression!r} has 6 fields, and the 6th is the second (croniter's order: "
        f"{_CRON_ORDER}): it fires every second of each minute with {here}: 60 runs in a row, a "
        f"second apart. Written for Quartz or Spring (seconds first) it means {quartz}: for "
        f"that, write {fix}; to fire every second as written, write the second field as 0-59"
    )


def _named_fields(names: tuple[str, ...], fields: list[str]) -> str:
    """The fields that select something (not ``*`` or ``?``), by name: ``minute='0'``."""
    pairs = zip(names, fields, strict=True)
    named = [f"{name}={text!r}" for name, text in pairs if text not in ("*", "?")]
    return " ".join(named) or "every field '*'"


def _from_quartz(fields: list[str]) -> str | None:
    """The 6 ``fields`` read in Quartz's order, written in croniter's: the second moved last
    (dropped when it is 0), ``?`` as ``*``, days of the week counted from 0; None when that is
    not a valid expression either."""
    second, *rest = ["*" if text == "?" else text for text in fields]
    rest[4] = _QUARTZ_WEEKDAY.sub(lambda number: str(int(number[0]) - 1), rest[4])
    written = " ".join(rest if second == "0" else [*rest, second])
    try:
        croniter(written, _VALIDATION_ANCHOR)
    except CroniterError:
        return None
    return written


def _refusal(expression: str) -> str:
    """Why croniter refused ``expression``, as precisely as can be told (a value out of its
    field's range, a step of 0, else the general form), and its form here when it reads as a
    Quartz expression (seconds first)."""
    fields = expression.split()
    reason = _field_problem(fields) or f"is not a valid cron expression {_CRON_HELP}"
    message = f"expression={expression!r} {reason}"
    rewritten = _from_quartz(fields) if len(fields) == 6 and fields[0] != "*" else None
    if rewritten is not None:
        message += (
            f"; if it is in Quartz's order (seconds first: "
            f"{_named_fields(_QUARTZ_FIELDS, fields)}), write expression={rewritten!r}, in "
            f"croniter's order ({_CRON_ORDER})"
        )
    return message


def _field_problem(fields: list[str]) -> str | None:
    """The first value of ``fields`` outside its field's range, or step of 0, said of the
    field; None when there is neither."""
    for index, text in enumerate(fields[: len(_CRON_FIELDS)]):
        name, (low, high) = _CRON_FIELDS[index], _CRON_RANGES[index]
        if text == "?" and name not in ("day of month", "day of week"):
            return f"has '?' in its {name} field, which only day of month and day of week take"
        for item in text.split(","):
            values, _, step = item.partition("/")
            if step.isdigit() and int(step) == 0:
                return f"has a step of 0 in its {name} field ({text!r}); a step is 1 or more"
            for value in values.split("-"):
                if value.isdigit() and not low <= int(value) <= high:
                    return (
                        f"has {value} in its {name} field ({text!r}), which takes "
                        f"{low}-{high}{_CRON_RANGE_NAMES[index]}"
                    )
    return None


def _is_second_of_repeated(moment: datetime, zone: ZoneInfo) -> bool:
    """Tell whether ``moment`` is the second occurrence of a wall time the zone repeats."""
    local = moment.astimezone(_UTC).astimezone(zone)  # sets fold from the real instant
    return local.fold == 1 and local.replace(fold=0).utcoffset() != local.utcoffset()


def _require_aware(value: datetime, name: str = "after") -> datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(
            f"{name}={value!r} must be timezone-aware; pass e.g. datetime.now(timezone.utc)"
        )
    return value


def _require_str(name: str, value: object, example: str) -> str:
    if not isinstance(value, str):
        raise ValueError(
            f"{name}={value!r} must be a string ({type(value).__name__} given), "
            f"such as {name}={example}"
        )
    return value


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(
            f"{name}={value!r} must be a finite number of seconds (int or float), such as "
            f"{name}=0.5; convert a timedelta with .total_seconds()"
        )
    return float(value)


def _positive_us(name: str, value: object) -> int:
    micros = round(_finite(name, value) * _US_PER_S)
    if micros <= 0:
        raise ValueError(
            f"{name}={value!r} must be positive, at least one microsecond, such as {name}=0.5"
        )
    return micros


def _epoch_us(moment: datetime, name: str) -> int:
    """Return whole microseconds since the Unix epoch, exactly (no float timestamp)."""
    return (_require_aware(moment, name) - _EPOCH) // _ONE_US


def _format_us(micros: int) -> str:
    if micros % _US_PER_S == 0:
        return f"{micros // _US_PER_S}s"
    if micros >= _US_PER_S:
        return f"{micros / _US_PER_S}s"
    if micros % 1000 == 0:
        return f"{micros // 1000}ms"
    if micros >= 1000:
        return f"{micros / 1000}ms"
    return f"{micros}us"
