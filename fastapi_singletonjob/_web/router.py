"""``jobs.router``: the status API and the health probes, as a FastAPI ``APIRouter``.

Mount it under any prefix, and attach the application's own dependencies (authentication)
where it is included::

    app.include_router(jobs.router, prefix="/singletonjob", dependencies=[Depends(auth)])
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, HTTPException, Query, Response, status
from fastapi.responses import HTMLResponse

from .._history import DEFAULT_HISTORY, MAX_HISTORY
from .._store.base import STORE_ERRORS
from . import page
from .health import liveness, readiness
from .models import (
    ClusterStatus,
    Health,
    HealthStatus,
    HistoryEntry,
    JobHistory,
    JobReport,
    JobsHealth,
    NodeStatus,
)
from .source import StatusSource
from .views import add_checkpoints, job_report, jobs_health, node_status

__all__ = ["create_router"]

_UNAVAILABLE: dict[int | str, dict[str, Any]] = {
    status.HTTP_503_SERVICE_UNAVAILABLE: {"model": HealthStatus, "description": "Not healthy"}
}


_ONE_JOB_FROM_REDIS: dict[int | str, dict[str, Any]] = {
    status.HTTP_404_NOT_FOUND: {"description": "No job of that name"},
    status.HTTP_503_SERVICE_UNAVAILABLE: {"description": "Redis did not answer"},
}
"""The answers besides 200 of a route about one job that reads Redis (its history, its page)."""


def create_router(jobs: StatusSource) -> APIRouter:
    """Build the status router of ``jobs`` (a ``SingletonJobs``, or any ``StatusSource``).

    The handlers are ``async def`` on purpose: they run on the event loop, between its steps,
    so a snapshot never mixes state from before and after a leadership change.
    """
    router = APIRouter(tags=["singletonjob"])

    @router.get("/jobs", response_model=NodeStatus, summary="This node and all its jobs")
    async def list_jobs() -> NodeStatus:
        """The node, whether Redis answers, and for each job: schedule, leader, lease, runs,
        and its checkpoint as stored in Redis."""
        snapshot = node_status(jobs)
        await add_checkpoints(jobs, snapshot.jobs)
        return snapshot

    @router.get(
        "/jobs/{name}",
        response_model=JobReport,
        summary="One job",
        responses={status.HTTP_404_NOT_FOUND: {"description": "No job of that name"}},
    )
    async def get_job(name: str) -> JobReport:
        """The node, whether Redis answers, and one job."""
        if name not in jobs.jobs:
            known = ", ".join(sorted(jobs.jobs)) or "none"
            raise HTTPException(
                status.HTTP_404_NOT_FOUND, f"no job named {name!r}; known jobs: {known}"
            )
        snapshot = node_status(jobs, only=name)
        await add_checkpoints(jobs, snapshot.jobs)
        return job_report(snapshot)

    @router.get(
        "/jobs/{name}/history",
        response_model=JobHistory,
        summary="One job's last runs and missed instants",
        responses=_ONE_JOB_FROM_REDIS,
    )
    async def job_history(
        name: str, limit: int = Query(DEFAULT_HISTORY, ge=1, le=MAX_HISTORY)
    ) -> JobHistory:
        """The job's last `limit` occurrences as stored in Redis, newest first, the same from
        every replica: each run (instant, start, duration, node, fencing token, outcome,
        error) and each instant its leader did not run, with the reason."""
        if name not in jobs.jobs:
            known = ", ".join(sorted(jobs.jobs)) or "none"
            raise HTTPException(
                status.HTTP_404_NOT_FOUND, f"no job named {name!r}; known jobs: {known}"
            )
        try:
            entries = await jobs.history(name, limit)
        except STORE_ERRORS as exc:
            raise HTTPException(
                status.HTTP_503_SERVICE_UNAVAILABLE, f"Redis did not answer: {type(exc).__name__}"
            ) from None
        return JobHistory(job=name, entries=[HistoryEntry.of(entry) for entry in entries])

    @router.get("/cluster", response_model=ClusterStatus, summary="Every node and job")
    async def cluster() -> ClusterStatus:
        """Every live node and every job of the project, as stored in Redis: the same from
        every replica. Read-only; the actions are on `jobs.admin_router`."""
        try:
            return await jobs.cluster_status()
        except STORE_ERRORS as exc:
            raise HTTPException(
                status.HTTP_503_SERVICE_UNAVAILABLE, f"Redis did not answer: {type(exc).__name__}"
            ) from None

    _add_page(router, jobs)

    _add_probe(
        router,
        "ready",
        "/health",
        "Readiness probe: serve HTTP, report degraded jobs",
        "503 before startup, while draining, or when the election loop is dead; 200 otherwise, "
        "with status `degraded` and the reason while Redis has not answered for a lock "
        "expiry: a Redis outage does not take the service out of rotation. Followers are "
        "ready too.",
        lambda: readiness(jobs, strict=False),
        jobs,
    )

    @router.get(
        "/health/jobs",
        response_model=JobsHealth,
        summary="Readiness probe: not ready while the job system is down; each job's health",
        responses={
            status.HTTP_503_SERVICE_UNAVAILABLE: {"model": JobsHealth, "description": "Not ready"}
        },
        name="ready_jobs",
    )
    async def ready_jobs(response: Response) -> JobsHealth:
        """As `/health`, but 503 (not `degraded`) while Redis has not answered for a lock
        expiry: for replicas that exist to run the jobs. Lists, per job, whether this node
        can run it: `ok`, or `let_go` with the cause when this node let it go because its
        runs could not start (a job let go does not make the node unready: another node
        runs it)."""
        health, reason = await readiness(jobs, strict=True)
        if health == "unavailable":
            response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
        return JobsHealth(
            status=health, reason=reason, node_id=jobs.settings.node_id, jobs=jobs_health(jobs)
        )

    _add_probe(
        router,
        "live",
        "/health/live",
        "Liveness probe",
        "503 only when a loop of the library is dead or wedged (restarting would help); an "
        "unreachable Redis does not fail it.",
        lambda: liveness(jobs),
        jobs,
    )
    return router


REFRESH_S = 10
"""How often the status page reloads itself by default (``?refresh=``; 0 stops it)."""


def _add_page(router: APIRouter, jobs: StatusSource) -> None:
    """The status page: HTML for a person, read-only, from the same reads as the JSON routes."""
    refresh_query = Query(
        REFRESH_S, ge=0, le=3600, description="Seconds between reloads of the page; 0: none."
    )

    @router.get(
        "/ui",
        response_class=HTMLResponse,
        summary="Status page: every job, its leader, pause, next run and last runs (HTML)",
        responses={status.HTTP_503_SERVICE_UNAVAILABLE: {"description": "Redis did not answer"}},
        name="status_page",
    )
    async def status_page(refresh: int = refresh_query) -> HTMLResponse:
        """Every job with its leader, whether it is paused or overdue, its next run and a
        strip of its last runs coloured by outcome (each with its instant, outcome, error or
        the reason it did not run, on hover), from the cluster view and the histories. A
        server-rendered page with no script; 503 with this node's own view when Redis does
        not answer."""
        data = await page.read_page(jobs, limit=page.STRIP_ENTRIES)
        return _html(page.overview(data, refresh_s=refresh), data)

    @router.get(
        "/ui/jobs/{name}",
        response_class=HTMLResponse,
        summary="Status page of one job: every occurrence in its history (HTML)",
        responses=_ONE_JOB_FROM_REDIS,
        name="status_page_job",
    )
    async def status_page_job(
        name: str,
        refresh: int = refresh_query,
        limit: int = Query(DEFAULT_HISTORY, ge=1, le=MAX_HISTORY),
    ) -> HTMLResponse:
        """One job's card and its last `limit` occurrences, newest first, each with its
        outcome and error, or the reason it did not run."""
        data = await page.read_page(jobs, only=name, limit=limit)
        if not data.jobs:
            return _html(page.not_found(name, data.known), data, status.HTTP_404_NOT_FOUND)
        return _html(page.job_page(data, refresh_s=refresh), data)


def _html(text: str, data: page.PageData, code: int | None = None) -> HTMLResponse:
    if code is None:
        code = status.HTTP_503_SERVICE_UNAVAILABLE if data.store_error else status.HTTP_200_OK
    headers = {
        "Content-Security-Policy": page.CONTENT_SECURITY_POLICY,
        "Cache-Control": "no-store",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }
    return HTMLResponse(text, status_code=code, headers=headers)


def _add_probe(
    router: APIRouter,
    name: str,
    path: str,
    summary: str,
    description: str,
    check: Callable[[], Awaitable[tuple[Health, str | None]]],
    jobs: StatusSource,
) -> None:
    """Add the probe ``name`` at ``path``: what ``check`` says; 503 when unavailable."""

    async def probe(response: Response) -> HealthStatus:
        health, reason = await check()
        if health == "unavailable":
            response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
        return HealthStatus(status=health, reason=reason, node_id=jobs.settings.node_id)

    router.add_api_route(
        path,
        probe,
        methods=["GET"],
        response_model=HealthStatus,
        summary=summary,
        description=description,
        responses=_UNAVAILABLE,
        name=name,
    )
