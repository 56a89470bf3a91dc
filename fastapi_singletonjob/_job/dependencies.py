"""Job parameters resolved per run by FastAPI's own dependency system.

A job function is declared like a route: ``Depends(...)`` and ``Annotated[..., Depends(...)]``
parameters, sync or async, nested, cached per run, ``yield`` dependencies entered before the
run and closed after it (also when it fails or is cancelled), and
``app.dependency_overrides`` honoured. A parameter annotated ``JobContext`` receives the
run's context. Everything that only an HTTP request can supply (path, query, header, cookie or
body parameters without a default, ``Request``, ``Response``, ``BackgroundTasks``...) is
rejected when the job is registered, with the job and the parameter named; a plain parameter
with a default keeps its default.

FastAPI's ``get_dependant``/``solve_dependencies`` are internal but stable across the versions
``pyproject.toml`` admits (tested at both ends of the range). The run gets a synthetic request
scope carrying the application, so that overrides apply; its exit stack is the run's own.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Annotated, Any, get_type_hints

from fastapi import Depends
from fastapi.dependencies.models import Dependant
from fastapi.dependencies.utils import get_dependant, solve_dependencies
from starlette.requests import Request

from .._errors import ConfigurationError, UsageError
from .context import JobContext

__all__ = ["JobCall", "callable_name", "job_context"]

_CURRENT: contextvars.ContextVar[JobContext] = contextvars.ContextVar("singletonjob_context")

# What a Dependant field means, for the error message.
_REQUEST_ONLY = {
    "path_params": "a path parameter",
    "query_params": "a query parameter",
    "header_params": "a header",
    "cookie_params": "a cookie",
    "body_params": "a request body",
}
_REQUEST_OBJECTS = {
    "request_param_name": "the Request",
    "websocket_param_name": "the WebSocket",
    "http_connection_param_name": "the HTTP connection",
    "response_param_name": "the Response",
    "background_tasks_param_name": "BackgroundTasks",
}


async def job_context() -> JobContext:
    """A dependency that gives the current run's ``JobContext``, for use inside your
    own dependencies: ``ctx: Annotated[JobContext, Depends(job_context)]``. (A job function
    itself just annotates a parameter ``JobContext``.) It is ``async`` so that FastAPI
    resolves it on the event loop, without a thread hop."""
    try:
        return _CURRENT.get()
    except LookupError:
        raise UsageError(
            "job_context is only available while a job runs: declare it in a dependency of a "
            "job, as `ctx: Annotated[JobContext, Depends(job_context)]`"
        ) from None


class JobCall:
    """How to call one job function: its parameters, resolved per run."""

    __slots__ = ("_context_only", "_dependant", "func", "job", "sees_context", "trivial")

    def __init__(self, job: str, func: Callable[..., Any]) -> None:
        self.job = job
        self.func = func
        hints = _annotations(func)
        shim = _shim(job, func, hints)
        try:
            dependant = get_dependant(path="", call=shim)
        except Exception as exc:  # FastAPI rejects the signature itself
            raise ConfigurationError(
                f"the parameters of {callable_name(func)} or of its dependencies cannot be "
                f"resolved: {exc}; a dependency that needs the run's context declares "
                "`ctx: Annotated[JobContext, Depends(job_context)]`",
                job=job,
                field="func",
            ) from exc
        _reject_request_parameters(job, func, dependant, hints)
        self._context_only = tuple(
            dep.name for dep in dependant.dependencies if dep.call is job_context
        )
        # No dependency but the context: skip FastAPI's machinery on the tick path.
        self.trivial = len(self._context_only) == len(dependant.dependencies) and not any(
            getattr(dependant, field, None) for field in _REQUEST_ONLY
        )
        self.sees_context = not self.trivial or any(self._context_only)
        """Whether the function or a dependency of it can see the run's ``JobContext`` (a
        parameter, ``job_context``): else nothing of it is made only to be shown (the runner
        makes no ``Checkpoint`` for it)."""
        # A trivial call is never solved: keep none of FastAPI's objects (~1.5 KB a job).
        self._dependant: Dependant | None = None if self.trivial else dependant

    def context_arguments(self, ctx: JobContext) -> dict[str, Any]:
        """The keyword arguments of a ``trivial`` call: the context, where it is asked for."""
        return {name: ctx for name in self._context_only if name is not None}

    async def arguments(
        self, ctx: JobContext, app: object, stack: AsyncExitStack
    ) -> dict[str, Any]:
        """Resolve the keyword arguments of one run; ``yield`` dependencies close with
        ``stack``."""
        if self.trivial:
            return self.context_arguments(ctx)
        token = _CURRENT.set(ctx)
        stack.callback(_CURRENT.reset, token)
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "GET",
            "scheme": "http",
            "path": f"/singletonjob/{self.job}",
            "raw_path": f"/singletonjob/{self.job}".encode(),
            "root_path": "",
            "query_string": b"",
            "headers": [],
            "client": None,
            "server": None,
            "state": {},
            # where FastAPI versions look for the stack that closes `yield` dependencies
            "fastapi_astack": stack,
            "fastapi_inner_astack": stack,
            "fastapi_function_astack": stack,
        }
        if app is not None:
            scope["app"] = app
        overrides = app if hasattr(app, "dependency_overrides") else None
        assert self._dependant is not None  # only trivial calls have none; they returned above
        solved = await solve_dependencies(
            request=Request(scope),
            dependant=self._dependant,
            dependency_overrides_provider=overrides,
            async_exit_stack=stack,
            embed_body_fields=False,
        )
        if solved.errors:
            raise RuntimeError(f"job {self.job!r}: dependencies failed: {solved.errors}")
        return dict(solved.values)


def callable_name(func: Callable[..., Any]) -> str:
    """How a message names a job function or a dependency: its qualified name, else its
    ``repr`` (a ``functools.partial``, a callable object)."""
    return getattr(func, "__qualname__", repr(func))


def _shim(job: str, func: Callable[..., Any], hints: dict[str, Any]) -> Callable[..., Any]:
    """A stand-in with ``func``'s signature, annotations resolved, and ``JobContext``
    parameters turned into a dependency on the run's context."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"cannot read the signature of {func!r}: {exc}", job=job, field="func"
        ) from exc
    parameters = []
    for parameter in signature.parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.kind is parameter.POSITIONAL_ONLY:
            raise ConfigurationError(
                f"parameter {parameter.name!r} of {callable_name(func)} is positional-only; job "
                "parameters are passed by name",
                job=job,
                field=parameter.name,
            )
        annotation = hints.get(parameter.name, parameter.annotation)
        if annotation is JobContext or annotation == "JobContext":
            annotation = Annotated[JobContext, Depends(job_context)]
            parameter = parameter.replace(default=inspect.Parameter.empty)
        # Keyword-only: parameters are passed by name, and a context parameter that lost its
        # default may then follow parameters that have one.
        parameters.append(
            parameter.replace(annotation=annotation, kind=inspect.Parameter.KEYWORD_ONLY)
        )

    def shim(**kwargs: Any) -> None:  # never called: it only carries the signature
        raise AssertionError("not callable")

    shim.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    shim.__qualname__ = callable_name(func)
    return shim


def _annotations(func: Callable[..., Any]) -> dict[str, Any]:
    """The parameters' annotations, evaluated where possible. One that cannot be evaluated
    (a name imported only under ``TYPE_CHECKING``) stays text, without spoiling the others."""
    try:
        return get_type_hints(func, include_extras=True)
    except Exception:
        pass
    try:
        raw = inspect.get_annotations(func)
    except TypeError:
        return {}
    namespace = getattr(inspect.unwrap(func), "__globals__", {})
    resolved: dict[str, Any] = {}
    for name, annotation in raw.items():
        if isinstance(annotation, str):
            try:
                annotation = get_type_hints(
                    _Holder(annotation), globalns=namespace, include_extras=True
                )["value"]
            except Exception:
                pass
        resolved[name] = annotation
    return resolved


class _Holder:
    """Lets ``get_type_hints`` evaluate one annotation text on its own."""

    def __init__(self, text: str) -> None:
        self.__annotations__ = {"value": text}


def _reject_request_parameters(
    job: str, func: Callable[..., Any], dependant: Dependant, hints: dict[str, Any]
) -> None:
    unresolved = {name: text for name, text in hints.items() if isinstance(text, str)}
    for owner, field, what in _request_needs(dependant, callable_name(func)):
        if what is _BARE_CONTEXT:
            raise ConfigurationError(
                f"parameter {field!r} of {owner} is a bare JobContext, which only the job "
                f"function itself receives; in a dependency declare `{field}: "
                "Annotated[JobContext, Depends(job_context)]`",
                job=job,
                field=field,
            )
        hint = ""
        if owner == callable_name(func) and field in unresolved:
            hint = (
                f" (its annotation {unresolved[field]!r} could not be evaluated, so a Depends "
                "inside it was not seen: define or import the names it uses at module level)"
            )
        raise ConfigurationError(
            f"parameter {field!r} of {owner} would be {what} of an HTTP request, but jobs run "
            "outside requests; use Depends(...) with a dependency that needs no request, or "
            f"JobContext{hint}",
            job=job,
            field=field,
        )


_BARE_CONTEXT = "a bare JobContext"


def _is_context(param: Any) -> bool:
    annotation = getattr(getattr(param, "field_info", None), "annotation", None)
    return annotation is JobContext or getattr(param, "type_", None) is JobContext


def _required(param: Any) -> bool:
    required = getattr(param, "required", None)
    if isinstance(required, bool):
        return required
    return bool(param.field_info.is_required())


def _request_needs(dependant: Dependant, owner: str) -> list[tuple[str, str, str]]:
    found = []
    for attribute, what in _REQUEST_ONLY.items():
        for param in getattr(dependant, attribute, None) or []:
            if _is_context(param):
                # A bare JobContext in a dependency is not injected (only the job function's
                # own parameters are): say how to ask for it.
                found.append((owner, param.name, _BARE_CONTEXT))
            elif _required(param):  # an optional one simply takes its default
                found.append((owner, param.name, what))
    for attribute, what in _REQUEST_OBJECTS.items():
        name = getattr(dependant, attribute, None)
        if name:
            found.append((owner, name, what))
    for sub in dependant.dependencies:
        if sub.call is not None:
            found += _request_needs(sub, callable_name(sub.call))
    return found
