"""A registered job: its validated definition, and how to call its function for one run."""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from typing import Any, Literal

from .._config.settings import MIN_PERIOD_S, Duration, check_expiry, check_name, to_seconds
from .._errors import ConfigurationError
from .._history import check_history
from .._overdue import OverdueCallback
from .._schedule import Cron, FixedRate, Interval, Schedule, quartz_misreading
from .dependencies import JobCall, callable_name

__all__ = [
    "JobOptions",
    "JobSpec",
    "LeadershipLostPolicy",
    "MisfirePolicy",
    "cron_schedule",
    "custom_schedule",
    "fixed_rate_schedule",
    "interval_schedule",
]

logger = logging.getLogger("fastapi_singletonjob")

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
"""The memory address in an object's default ``repr``."""

MIN_MISFIRE_GRACE_S = 0.05
"""A run starts a few milliseconds after its instant (timer resolution, the event loop's
other work): a shorter ``misfire_grace`` would drop most or all instants as late."""

LeadershipLostPolicy = Literal["finish", "cancel"]
MisfirePolicy = Literal["skip", "run_once", "catch_up"]
ScheduleKind = Literal["interval", "fixed_rate", "cron", "custom"]


@dataclass(frozen=True, slots=True)
class JobSpec:
    """Everything known about a job when it is registered; validated on construction."""

    name: str
    func: Callable[..., Any]
    schedule: Schedule
    kind: ScheduleKind
    enabled: bool = True
    timeout_s: float | None = None
    on_leadership_lost: LeadershipLostPolicy = "finish"
    lock_expiry_s: float | None = None
    """Per-job lease time; None means the ``SingletonJobs`` setting."""
    misfire_grace_s: float | None = None
    """How late a run may still start after its instant; None: until the next instant."""
    misfire: MisfirePolicy = "run_once"
    """What a new leader does with the instants no node ran (cron and custom schedules)."""
    checkpoint: bool = True
    """Keep the job's checkpoint in the store (one fenced write per run)."""
    history: int | None = None
    """How many occurrences the job's history keeps (``_history``); None: the
    ``SingletonJobs``'s ``history``. A job with ``checkpoint=False`` keeps none."""
    on_overdue: OverdueCallback | None = None
    """Told when the job's overdue spell begins (``_overdue``); None: ``SingletonJobs``'s."""
    overdue_grace_s: float | None = None
    """How long past its due start the job may still start a run before it is overdue; None:
    the default of its kind (``_overdue``)."""
    call: JobCall = field(init=False, repr=False, compare=False)
    """How the function's parameters are resolved for a run."""

    def __post_init__(self) -> None:
        if not callable(self.func):
            raise ConfigurationError(
                f"the decorated object {self.func!r} is not callable; decorate a function",
                job=self.name,
                field="func",
            )
        _refuse_generator(self.name, self.func)
        if self.on_leadership_lost not in ("finish", "cancel"):
            raise ConfigurationError(
                f"on_leadership_lost={self.on_leadership_lost!r} is not one of 'finish' "
                "(let the run end) or 'cancel' (cancel it when the lease ends)",
                job=self.name,
                field="on_leadership_lost",
            )
        for name in ("enabled", "checkpoint"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigurationError(
                    f"{name}={value!r} must be True or False", job=self.name, field=name
                )
        if self.on_overdue is not None and not callable(self.on_overdue):
            raise ConfigurationError(
                f"on_overdue={self.on_overdue!r} is not callable; pass a function or coroutine "
                "function that takes an OverdueEvent",
                job=self.name,
                field="on_overdue",
            )
        if self.misfire not in ("skip", "run_once", "catch_up"):
            raise ConfigurationError(
                f"misfire={self.misfire!r} is not one of 'skip' (run none of the missed "
                "instants), 'run_once' (run the latest, once) or 'catch_up' (run each, in order)",
                job=self.name,
                field="misfire",
            )
        if self.misfire == "catch_up" and self.misfire_grace_s is None:
            raise ConfigurationError(
                "misfire='catch_up' needs misfire_grace, how far back missed instants are "
                "still run (e.g. misfire_grace=timedelta(hours=6))",
                job=self.name,
                field="misfire_grace",
            )
        if self.misfire == "catch_up" and not self.checkpoint:
            raise ConfigurationError(
                "misfire='catch_up' finds the missed instants from the checkpoint; remove "
                "checkpoint=False or choose misfire='run_once'",
                job=self.name,
                field="misfire",
            )
        # Resolve the parameters now, so that a bad one fails at registration, not at a tick.
        object.__setattr__(self, "call", JobCall(self.name, self.func))

    @property
    def announced(self) -> str:
        """The job's schedule as this node announces it to the others (``MemberRecord.jobs``),
        which compare it with their own: the schedule as text, then the settings that change
        which instants run when they are not the defaults (``misfire``, ``misfire_grace``).
        A custom schedule's default ``repr`` loses its memory address, which differs from
        process to process."""
        text = _ADDRESS.sub("", str(self.schedule))
        if self.misfire != "run_once":
            text += f", misfire={self.misfire!r}"
        if self.misfire_grace_s is not None:
            text += f", misfire_grace={self.misfire_grace_s:g}s"
        return text

    @property
    def is_async(self) -> bool:
        """Whether the function is a coroutine function (run on the loop, not in a thread)."""
        return any(map(inspect.iscoroutinefunction, _called(self.func)))


def _called(func: Callable[..., Any]) -> tuple[object, ...]:
    """What runs when ``func`` is called: itself, and the ``__call__`` of a callable object.
    (``inspect`` sees through a ``functools.partial`` by itself.)"""
    return func, getattr(func, "__call__", None)  # noqa: B004 - callable objects


def _refuse_generator(job: str, func: Callable[..., Any]) -> None:
    """Refuse a generator function: calling it only makes a generator, so its body would
    never run, and each run would be recorded as a success."""
    called = _called(func)
    if any(map(inspect.isasyncgenfunction, called)):
        kind, fix = "an async generator function (an `async def` with `yield`)", "async def"
    elif any(map(inspect.isgeneratorfunction, called)):
        kind, fix = "a generator function (a `def` with `yield`)", "def"
    else:
        return
    raise ConfigurationError(
        f"func={callable_name(func)} is {kind}: calling it only makes a generator, so its "
        "body would never run and every run would be recorded as a success; remove the "
        f"`yield` and write a plain `{fix}` (what a job returns is ignored), and move a "
        "resource that the run opens and closes into a `yield` dependency: Depends(...)",
        job=job,
        field="func",
    )


# -- definitions, validated where the user writes them -------------------------------------


def interval_schedule(name: str, every: Duration) -> Interval:
    """The schedule of ``jobs.interval(name, every)``."""
    return Interval(to_seconds(every, field="every", job=name, minimum_s=MIN_PERIOD_S))


def fixed_rate_schedule(name: str, every: Duration, offset: Duration) -> FixedRate:
    """The schedule of ``jobs.fixed_rate(name, every, offset=...)``."""
    every_s = to_seconds(every, field="every", job=name, minimum_s=MIN_PERIOD_S)
    offset_s = to_seconds(offset, field="offset", job=name, allow_zero=True)
    if offset_s >= every_s:
        raise ConfigurationError(
            f"offset={offset_s:g}s must be shorter than every={every_s:g}s",
            job=name,
            field="offset",
        )
    return FixedRate(every_s, offset_s)


def cron_schedule(name: str, expression: str, timezone: str) -> Cron:
    """The schedule of ``jobs.cron(name, expression, timezone=...)``; a warning when the
    expression reads as one written in Quartz's order (seconds first)."""
    try:
        cron = Cron(expression, timezone)
    except ValueError as exc:
        field = "timezone" if "timezone=" in str(exc) else "expression"
        raise ConfigurationError(str(exc), job=name, field=field) from None
    misreading = quartz_misreading(expression)
    if misreading is not None:
        logger.warning("job %r: %s", name, misreading)
    return cron


def custom_schedule(name: str, schedule: Schedule) -> Schedule:
    """The schedule of ``jobs.schedule(name, schedule)``: any object with ``next_fire``."""
    if not callable(getattr(schedule, "next_fire", None)):
        raise ConfigurationError(
            f"schedule={schedule!r} has no next_fire(after) method; pass an object "
            "that returns the next fire time after a given aware datetime, or None",
            job=name,
            field="schedule",
        )
    return schedule


@dataclass(frozen=True, slots=True)
class JobOptions:
    """The options every kind of job takes, in seconds; ``parse`` validates them, and
    ``misfiring`` adds those of the jobs whose instants can be missed (cron, custom)."""

    enabled: bool
    on_leadership_lost: LeadershipLostPolicy
    checkpoint: bool
    timeout_s: float | None
    lock_expiry_s: float | None
    misfire_grace_s: float | None = None
    misfire: MisfirePolicy = "run_once"
    history: int | None = None
    on_overdue: OverdueCallback | None = None
    overdue_grace_s: float | None = None

    @classmethod
    def parse(
        cls,
        name: str,
        enabled: bool,
        on_leadership_lost: LeadershipLostPolicy,
        checkpoint: bool,
        timeout: Duration | None,
        lock_expiry: Duration | None,
        heartbeat_s: float,
        history: int | None = None,
        on_overdue: OverdueCallback | None = None,
        overdue_grace: Duration | None = None,
    ) -> JobOptions:
        """Validate the options of job ``name`` as the user gave them, and its name (the
        others are checked by ``JobSpec``)."""
        check_name(name, field="name", what="job")
        timeout_s = None if timeout is None else to_seconds(timeout, field="timeout", job=name)
        expiry_s = None
        if lock_expiry is not None:
            expiry_s = to_seconds(lock_expiry, field="lock_expiry", job=name)
            check_expiry(expiry_s, heartbeat_s, field="lock_expiry", job=name)
        kept = None if history is None else check_history(history, job=name)
        grace_s = None
        if overdue_grace is not None:
            grace_s = to_seconds(overdue_grace, field="overdue_grace", job=name, allow_zero=True)
        return cls(
            enabled,
            on_leadership_lost,
            checkpoint,
            timeout_s,
            expiry_s,
            history=kept,
            on_overdue=on_overdue,
            overdue_grace_s=grace_s,
        )

    def misfiring(
        self, name: str, misfire_grace: Duration | None, misfire: MisfirePolicy
    ) -> JobOptions:
        """These options with job ``name``'s misfire policy, validated."""
        return replace(self, misfire_grace_s=to_grace_s(misfire_grace, name), misfire=misfire)

    def spec(
        self, name: str, func: Callable[..., Any], schedule: Schedule, kind: ScheduleKind
    ) -> JobSpec:
        """The job ``name`` that runs ``func`` on ``schedule`` with these options (the
        fields of both classes have the same names)."""
        options = {option.name: getattr(self, option.name) for option in fields(self)}
        return JobSpec(name=name, func=func, schedule=schedule, kind=kind, **options)


def to_grace_s(misfire_grace: Duration | None, job: str) -> float | None:
    """Validate a job's ``misfire_grace``: None (until the next instant), or at least
    ``MIN_MISFIRE_GRACE_S`` seconds."""
    if misfire_grace is None:
        return None
    seconds = (
        misfire_grace.total_seconds() if isinstance(misfire_grace, timedelta) else misfire_grace
    )
    number = isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
    if number and seconds < MIN_MISFIRE_GRACE_S:  # zero and negatives too: never "on time"
        raise ConfigurationError(
            f"misfire_grace={misfire_grace!r} would drop every instant, or most, as late: a "
            "run always starts a few milliseconds after its instant; pass at least "
            f"misfire_grace={MIN_MISFIRE_GRACE_S:g} (e.g. misfire_grace=1), or leave it unset "
            "to let a run start until the next instant",
            job=job,
            field="misfire_grace",
        )
    return to_seconds(misfire_grace, field="misfire_grace", job=job)
