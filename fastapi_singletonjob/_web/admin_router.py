"""``jobs.admin_router``: the operators' actions, apart from the read-only ``jobs.router``.

Nothing here is protected by the library: include it behind the application's own
authentication, for example::

    app.include_router(jobs.admin_router, prefix="/ops", dependencies=[Depends(require_admin)])
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, HTTPException, status

from .._errors import JobNotFound
from .._store.base import STORE_ERRORS
from .models import Action, ActionResult
from .source import AdminActions

__all__ = ["create_admin_router"]


def create_admin_router(jobs: AdminActions) -> APIRouter:
    """Build the admin router of ``jobs`` (a ``SingletonJobs``, or any ``AdminActions``)."""
    router = APIRouter(tags=["singletonjob admin"])
    actions: dict[Action, tuple[Callable[[str], Awaitable[None]], str]] = {
        "pause": (jobs.pause, "Pause a job cluster-wide (survives restarts)"),
        "resume": (jobs.resume, "Resume a paused job"),
        "trigger": (jobs.trigger, "One extra run now, on the current leader"),
        "step-down": (jobs.step_down, "The leader hands the job over to another node"),
    }
    for action, (call, summary) in actions.items():
        _add_action(router, action, call, summary)
    return router


def _add_action(
    router: APIRouter, action: Action, call: Callable[[str], Awaitable[None]], summary: str
) -> None:
    async def act(name: str) -> ActionResult:
        try:
            await call(name)
        except JobNotFound as exc:
            raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from None
        except STORE_ERRORS as exc:
            raise HTTPException(
                status.HTTP_503_SERVICE_UNAVAILABLE, f"Redis did not answer: {type(exc).__name__}"
            ) from None
        return ActionResult(job=name, action=action, accepted=True)

    router.add_api_route(
        f"/jobs/{{name}}/{action}",
        act,
        methods=["POST"],
        response_model=ActionResult,
        summary=summary,
        name=f"singletonjob_{action.replace('-', '_')}",
        responses={
            status.HTTP_404_NOT_FOUND: {"description": "No job of that name"},
            status.HTTP_503_SERVICE_UNAVAILABLE: {"description": "Redis did not answer"},
        },
    )
