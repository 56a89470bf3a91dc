"""The example service: six singleton jobs with FastAPI dependencies, and the status router.

Environment:

- ``SINGLETONJOB_REDIS_URL``: the Redis to elect through, e.g. ``redis://localhost:6379/0``.
  Unset, the app uses ``memory://``, which elects within this one process only, so that it runs
  on a machine with no Redis. Start several copies against one Redis to watch the election.
- ``SINGLETONJOB_PROJECT``: the key namespace (default ``example``).
- ``HEARTBEAT_FILE``: where the ``heartbeat`` job writes (default
  ``<temp dir>/singletonjob-example-<project>.heartbeat``).
- Every other ``SINGLETONJOB_*`` setting is read by the library itself.
"""

# No `from __future__ import annotations` here: the jobs below refer to dependencies defined
# inside create_app(), and FastAPI (for jobs as for routes) resolves string annotations
# against the module's globals only.

import logging
import math
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

from fastapi import Depends, FastAPI

from fastapi_singletonjob import JobContext, SingletonJobs

__all__ = [
    "Counters",
    "HeartbeatFile",
    "PriceBook",
    "PriceFeed",
    "ReportSender",
    "add_housekeeping_jobs",
    "SessionStore",
    "app",
    "create_app",
    "get_price_feed",
]

logger = logging.getLogger("example_app")
SESSION_TTL_S = 30.0


@dataclass
class Counters:
    """How often each job ran in this process (``app.state.counters``)."""

    price_ticks: int = 0
    heartbeats: int = 0
    reports: int = 0
    cache_refreshes: int = 0
    session_cleanups: int = 0
    rollups: int = 0


class PriceFeed:
    """A stand-in for a market-data client: quotes that drift slowly with the time."""

    async def latest(self) -> dict[str, float]:
        """The current quotes."""
        drift = math.sin(time.time() / 60) / 1000
        return {"EURUSD": round(1.08 + drift, 5), "GBPUSD": round(1.27 - drift, 5)}


def get_price_feed() -> PriceFeed:
    """The ``price-tick`` job's feed; tests replace it through ``app.dependency_overrides``."""
    return PriceFeed()


@dataclass
class PriceBook:
    """The latest quotes, written with the writer's fencing token (``app.state.price_book``).

    A write that carries a smaller token than the last accepted one comes from a leader whose
    term has ended, and is refused: the pattern a real database would apply with
    ``UPDATE ... WHERE fence <= :token``.
    """

    quotes: dict[str, float] = field(default_factory=dict)
    fencing_token: int = 0
    written_at: datetime | None = None
    refused: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def write(self, quotes: dict[str, float], *, fencing_token: int) -> bool:
        """Store ``quotes`` unless a newer term already wrote; return whether it was stored."""
        with self._lock:
            if fencing_token < self.fencing_token:
                self.refused += 1
                return False
            self.quotes = dict(quotes)
            self.fencing_token = fencing_token
            self.written_at = datetime.now(UTC)
            return True


class HeartbeatFile:
    """One heartbeat line, written to a temporary file and moved into place when the run
    succeeds (see :func:`create_app`'s ``open_heartbeat``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tmp = path.with_name(path.name + ".tmp")
        self._file = self._tmp.open("w", encoding="utf-8")

    def write(self, ctx: JobContext) -> None:
        """Record who leads the job, in which term, and when."""
        self._file.write(
            f"{ctx.node_id} token={ctx.fencing_token} at={ctx.started_at.isoformat()}\n"
        )

    def commit(self) -> None:
        """Replace the heartbeat file with what was written (atomic on POSIX)."""
        self._file.close()
        os.replace(self._tmp, self.path)

    def discard(self) -> None:
        """Drop what was written; the previous heartbeat stays."""
        self._file.close()
        self._tmp.unlink(missing_ok=True)


class ReportSender:
    """A stand-in for an e-mail or chat client."""

    def __init__(self, book: PriceBook) -> None:
        self._book = book

    async def send(self, *, day: str, fencing_token: int) -> None:
        """Send the daily report; the token lets the receiver drop a report from a stale
        leader."""
        logger.info(
            "daily report for %s: %s (fencing token %d)", day, self._book.quotes, fencing_token
        )


class SessionStore:
    """Login sessions in memory, each with its expiry (``app.state.sessions``)."""

    def __init__(self) -> None:
        self._expiry: dict[str, float] = {}
        self._lock = threading.Lock()

    def open(self, token: str, *, ttl_s: float) -> None:
        """Add a session that expires ``ttl_s`` from now."""
        with self._lock:
            self._expiry[token] = time.monotonic() + ttl_s

    def purge_expired(self) -> int:
        """Drop the expired sessions; return how many were dropped."""
        now = time.monotonic()
        with self._lock:
            expired = [token for token, at in self._expiry.items() if at <= now]
            for token in expired:
                del self._expiry[token]
        return len(expired)

    def __len__(self) -> int:
        return len(self._expiry)


def describe_store(url: str) -> str:
    """Where the leases live, without the credentials a URL may carry."""
    parts = urlsplit(url)
    if parts.scheme == "memory":
        return "memory:// (this process only: no election across replicas)"
    where = parts.path if parts.scheme == "unix" else f"{parts.hostname}:{parts.port or 6379}"
    return f"{parts.scheme}://{where}"


def add_housekeeping_jobs(
    jobs: SingletonJobs, counters: Counters, sessions: SessionStore, rates: dict[str, float]
) -> None:
    """The three small jobs next to the main ones: a cache reload, a cleanup, a rollup."""

    @jobs.fixed_rate("cache-refresh", every=timedelta(seconds=2))
    async def cache_refresh(feed: Annotated[PriceFeed, Depends(get_price_feed)]) -> None:
        # The quotes that /prices falls back to when the book is empty, reloaded in one step.
        counters.cache_refreshes += 1
        rates.clear()
        rates.update(await feed.latest())

    @jobs.interval("session-cleanup", every=timedelta(seconds=1))
    async def session_cleanup(ctx: JobContext) -> None:
        counters.session_cleanups += 1
        dropped = sessions.purge_expired()
        if dropped:
            logger.info("session-cleanup #%d dropped %d expired sessions", ctx.iteration, dropped)

    @jobs.interval("metrics-rollup", every=timedelta(seconds=2))
    async def metrics_rollup(ctx: JobContext) -> None:
        counters.rollups += 1
        logger.info(
            "metrics-rollup #%d: %d price ticks, %d heartbeats, %d live sessions on %s",
            ctx.iteration,
            counters.price_ticks,
            counters.heartbeats,
            len(sessions),
            ctx.node_id,
        )


def create_app() -> FastAPI:
    """Build the app and its jobs from the environment."""
    redis_url = os.environ.get("SINGLETONJOB_REDIS_URL") or "memory://"
    project = os.environ.get("SINGLETONJOB_PROJECT", "example")
    heartbeat_path = Path(
        os.environ.get("HEARTBEAT_FILE")
        or Path(tempfile.gettempdir()) / f"singletonjob-example-{project}.heartbeat"
    )
    jobs = SingletonJobs(redis_url=redis_url, project=project)
    counters = Counters()
    book = PriceBook()
    sessions = SessionStore()
    rates: dict[str, float] = {}
    logger.info("lease store: %s; node id: %s", describe_store(redis_url), jobs.node_id)

    # Dependencies of the jobs, resolved per run by FastAPI as for a route. A job runs outside
    # any request, so they take no Request: app-wide objects come from this closure.
    def get_price_book() -> PriceBook:
        return book

    def open_heartbeat() -> Iterator[HeartbeatFile]:
        # A `yield` dependency: opened before the run, closed after it, failed or not.
        sink = HeartbeatFile(heartbeat_path)
        try:
            yield sink
        except BaseException:
            sink.discard()
            raise
        sink.commit()

    async def get_report_sender(
        price_book: Annotated[PriceBook, Depends(get_price_book)],
    ) -> ReportSender:
        return ReportSender(price_book)

    @jobs.fixed_rate("price-tick", every=timedelta(milliseconds=500))
    async def price_tick(
        ctx: JobContext,
        feed: Annotated[PriceFeed, Depends(get_price_feed)],
        price_book: Annotated[PriceBook, Depends(get_price_book)],
    ) -> None:
        # Ticks sit on a grid shared by every replica; the fencing token identifies this
        # node's leadership term, so the book refuses writes from an older term.
        counters.price_ticks += 1
        stored = price_book.write(await feed.latest(), fencing_token=ctx.fencing_token)
        logger.info(
            "price-tick #%d for %s UTC on %s (fencing token %d)%s",
            ctx.iteration,
            ctx.scheduled_at.time().isoformat(timespec="milliseconds"),
            ctx.node_id,
            ctx.fencing_token,
            "" if stored else ": refused, a newer term has written",
        )

    @jobs.interval("heartbeat", every=timedelta(seconds=1))
    def heartbeat(ctx: JobContext, sink: Annotated[HeartbeatFile, Depends(open_heartbeat)]) -> None:
        # A plain `def` runs in a worker thread of its own, never on the event loop; its
        # dependencies were resolved on the event loop before the thread started.
        counters.heartbeats += 1
        sink.write(ctx)
        logger.info(
            "heartbeat #%d in thread %s", counters.heartbeats, threading.current_thread().name
        )

    @jobs.cron("daily-report", "0 3 * * *", timezone="Asia/Singapore")
    async def daily_report(
        ctx: JobContext, sender: Annotated[ReportSender, Depends(get_report_sender)]
    ) -> None:
        counters.reports += 1
        await sender.send(day=ctx.scheduled_at.date().isoformat(), fencing_token=ctx.fencing_token)

    add_housekeeping_jobs(jobs, counters, sessions, rates)

    app = FastAPI(title="fastapi-singletonjob example", lifespan=jobs.lifespan)
    app.include_router(jobs.router, prefix="/singletonjob")
    app.state.jobs = jobs
    app.state.counters = counters
    app.state.price_book = book
    app.state.sessions = sessions
    app.state.heartbeat_path = heartbeat_path

    @app.get("/")
    async def index() -> dict[str, str | list[str]]:
        """This replica's node id and the jobs it competes for."""
        return {"node_id": jobs.node_id, "jobs": sorted(jobs.jobs)}

    @app.post("/sessions")
    async def open_session() -> dict[str, str | float]:
        """A session that expires in 30 s (the ``session-cleanup`` job drops it)."""
        token = secrets.token_urlsafe(16)
        sessions.open(token, ttl_s=SESSION_TTL_S)
        return {"token": token, "expires_in_s": SESSION_TTL_S}

    @app.get("/prices")
    async def prices() -> dict[str, Any]:
        """The latest quotes this process stored, and the term that wrote them."""
        return {
            "quotes": book.quotes or dict(rates),
            "fencing_token": book.fencing_token,
            "written_at": book.written_at,
        }

    return app


app = create_app()
"""The app for ``uvicorn example_app.main:app``."""
