"""The example service: three singleton jobs and one route.

Environment:

- ``SINGLETONJOB_REDIS_URL``: the Redis to elect through, e.g. ``redis://localhost:6379/0``.
  Unset, the app uses ``memory://``, which elects within this one process only, so that it runs
  on a machine with no Redis. Start several copies against one Redis to watch the election.
- ``SINGLETONJOB_PROJECT``: the key namespace (default ``example``).
- Every other ``SINGLETONJOB_*`` setting is read by the library itself.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlsplit

from fastapi import FastAPI

from fastapi_singletonjob import JobContext, SingletonJobs

__all__ = ["Counters", "app", "create_app"]

logger = logging.getLogger("example_app")


@dataclass
class Counters:
    """How often each job ran in this process (``app.state.counters``)."""

    price_ticks: int = 0
    heartbeats: int = 0
    reports: int = 0


def describe_store(url: str) -> str:
    """Where the leases live, without the credentials a URL may carry."""
    parts = urlsplit(url)
    if parts.scheme == "memory":
        return "memory:// (this process only: no election across replicas)"
    where = parts.path if parts.scheme == "unix" else f"{parts.hostname}:{parts.port or 6379}"
    return f"{parts.scheme}://{where}"


def create_app() -> FastAPI:
    """Build the app and its jobs from the environment."""
    redis_url = os.environ.get("SINGLETONJOB_REDIS_URL") or "memory://"
    jobs = SingletonJobs(
        redis_url=redis_url,
        project=os.environ.get("SINGLETONJOB_PROJECT", "example"),
    )
    counters = Counters()
    logger.info("lease store: %s; node id: %s", describe_store(redis_url), jobs.node_id)

    @jobs.fixed_rate("price-tick", every=timedelta(milliseconds=500))
    async def price_tick(ctx: JobContext) -> None:
        # Ticks sit on a grid shared by every replica; the fencing token identifies this
        # node's leadership term, so a downstream store can refuse writes from an older term.
        counters.price_ticks += 1
        logger.info(
            "price-tick #%d for %s UTC on %s (fencing token %d)",
            ctx.iteration,
            ctx.scheduled_at.time().isoformat(timespec="milliseconds"),
            ctx.node_id,
            ctx.fencing_token,
        )

    @jobs.interval("heartbeat", every=timedelta(seconds=1))
    def heartbeat() -> None:
        # A plain `def` runs in a worker thread of its own, never on the event loop.
        counters.heartbeats += 1
        logger.info(
            "heartbeat #%d in thread %s", counters.heartbeats, threading.current_thread().name
        )

    @jobs.cron("daily-report", "0 3 * * *", timezone="Asia/Singapore")
    async def daily_report(ctx: JobContext) -> None:
        counters.reports += 1
        logger.info("daily report for %s", ctx.scheduled_at.date().isoformat())

    app = FastAPI(title="fastapi-singletonjob example", lifespan=jobs.lifespan)
    app.state.jobs = jobs
    app.state.counters = counters

    @app.get("/")
    async def index() -> dict[str, str | list[str]]:
        """This replica's node id and the jobs it competes for."""
        return {"node_id": jobs.node_id, "jobs": sorted(jobs.jobs)}

    return app


app = create_app()
"""The app for ``uvicorn example_app.main:app``."""
