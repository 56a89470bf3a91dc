"""``jobs.admin_router``: the operators' actions, apart from the read-only ``jobs.router``.

Nothing here is protected by the library: include it behind the application's own
authentication, for example::

    app.include_router(jobs.admin_router, prefix="/ops", dependencies=[Depends(require_admin)])
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Literal

from fastapi import APIRouter, HTTPException, status
from pydantic import BaseModel, Field

from .._errors import JobNotFound
from .._store.base import STORE_ERRORS

if TYPE_CHECKING:
    from .._singletonjobs import SingletonJobs

__all__ = ["ActionResult", "create_admin_router"]

Action = Literal["pause", "resume", "trigger", "step-down"]


class ActionResult(BaseModel):
    """What an admin action did."""

    job: str
    action: Action
    accepted: bool = Field(
        description="Stored in Redis and pushed to every node; the leader acts on it at its "
        "next election round."
    )


def create_admin_router(jobs: SingletonJobs) -> APIRouter:
    """Build the admin router of ``jobs``."""
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
