"""A registered job: its validated definition, and how to call its function for one run."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_type_hints

from ._context import JobContext
from ._exceptions import ConfigurationError
from ._schedule import Schedule

__all__ = ["JobSpec", "LeadershipLostPolicy"]

LeadershipLostPolicy = Literal["finish", "cancel"]
ScheduleKind = Literal["interval", "fixed_rate", "cron", "custom"]


@dataclass(frozen=True)
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
        context_parameters(self)  # fails now, not at the first tick

    @property
    def is_async(self) -> bool:
        """Whether the function is a coroutine function (run on the loop, not in a thread)."""
        return inspect.iscoroutinefunction(self.func) or inspect.iscoroutinefunction(
            getattr(self.func, "__call__", None)  # noqa: B004 - async callable objects
        )


def context_parameters(spec: JobSpec) -> list[str]:
    """Names of the parameters that receive the :class:`JobContext`; reject any other
    parameter that has no default, since nothing could fill it at run time."""
    try:
        signature = inspect.signature(spec.func)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"cannot read the signature of {spec.func!r}: {exc}", job=spec.name, field="func"
        ) from exc
    try:
        hints = get_type_hints(spec.func)
    except Exception:  # an annotation imported only under TYPE_CHECKING: read the raw text
        hints = {name: p.annotation for name, p in signature.parameters.items()}
    names = []
    for parameter in signature.parameters.values():
        if hints.get(parameter.name) in (JobContext, "JobContext"):
            names.append(parameter.name)
        elif parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        elif parameter.default is parameter.empty:
            raise ConfigurationError(
                f"parameter {parameter.name!r} of {spec.func.__qualname__} cannot be resolved: "
                "annotate it as JobContext, or give it a default value",
                job=spec.name,
                field=parameter.name,
            )
    return names


def bind_call(spec: JobSpec) -> Callable[[JobContext], tuple[tuple[Any, ...], dict[str, Any]]]:
    """Return a function that builds the call arguments of ``spec.func`` for one run."""
    names = context_parameters(spec)

    def arguments(ctx: JobContext) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (), dict.fromkeys(names, ctx)

    return arguments
