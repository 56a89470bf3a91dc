"""A registered job: its validated definition, and how to call its function for one run."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ._dependencies import JobCall
from ._errors import ConfigurationError
from ._schedule import Schedule

__all__ = ["JobSpec", "LeadershipLostPolicy"]

LeadershipLostPolicy = Literal["finish", "cancel"]
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
    call: JobCall = field(init=False, repr=False, compare=False)
    """How the function's parameters are resolved for a run."""

    def __post_init__(self) -> None:
        if not callable(self.func):
            raise ConfigurationError(
                f"the decorated object {self.func!r} is not callable; decorate a function",
                job=self.name,
                field="func",
            )
        if self.on_leadership_lost not in ("finish", "cancel"):
            raise ConfigurationError(
                f"on_leadership_lost={self.on_leadership_lost!r} is not one of 'finish' "
                "(let the run end) or 'cancel' (cancel it when the lease ends)",
                job=self.name,
                field="on_leadership_lost",
            )
        if not isinstance(self.enabled, bool):
            raise ConfigurationError(
                f"enabled={self.enabled!r} must be True or False", job=self.name, field="enabled"
            )
        # Resolve the parameters now, so that a bad one fails at registration, not at a tick.
        object.__setattr__(self, "call", JobCall(self.name, self.func))

    @property
    def is_async(self) -> bool:
        """Whether the function is a coroutine function (run on the loop, not in a thread)."""
        return inspect.iscoroutinefunction(self.func) or inspect.iscoroutinefunction(
            getattr(self.func, "__call__", None)  # noqa: B004 - async callable objects
        )
