"""A leader that cannot do a job's work lets it go (issue 26, item 1), on a fake clock: the
store answers node a's election but not its claims, so its runs cannot start; within about a
lock expiry it releases the job, which the healthy node b takes over, and says why in its
status, in ``GET /health/jobs`` and in a WARNING log line. No instant runs twice."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest
from fake_nodes import stop
from fastapi import FastAPI
from test_runner import START, Factory, Journal, clock, engine, journal, make

from fastapi_singletonjob import JobContext
from fastapi_singletonjob._store.base import ClaimResult
from fastapi_singletonjob.testing import FakeClock

__all__ = ["clock", "journal", "make"]

HEARTBEAT_S = 1.0
LOCK_EXPIRY_S = 3.0
MOVE_BOUND_S = LOCK_EXPIRY_S + 2 * HEARTBEAT_S
"""From the first claim that failed to node b's first run: a lock expiry of failing claims,
then the release at the next round and b's takeover at its notice (two heartbeats of slack)."""


def fail_claims(jobs: Any, clock: FakeClock, after_s: float = 0.5) -> list[float]:
    """Make the store of ``jobs`` fail every claim ``after_s`` after it was asked (a dead
    connection whose call times out), while it still answers the election. Returns when each
    claim was asked."""
    store = engine(jobs).store
    asked: list[float] = []

    async def failing(job: str, value: str, instant_us: int, **kwargs: Any) -> ClaimResult:
        asked.append(clock.monotonic())
        await clock.sleep(after_s)
        raise ConnectionError("Redis did not answer the claim in time")

    store.claim = failing  # type: ignore[method-assign]
    return asked


async def test_a_leader_whose_claims_fail_lets_the_job_go_to_a_healthy_node(
    make: Factory, clock: FakeClock, journal: Journal, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = make("a"), make("b")

    @a.cron("tick", "* * * * * *")
    @b.cron("tick", "* * * * * *")
    async def tick(ctx: JobContext) -> None:
        journal.begin(ctx).ended = clock.monotonic()

    await a.start()
    await clock.advance(0.1)
    await b.start()
    await clock.advance(2.0)
    assert engine(a).elector.is_leader("tick") and {r.node for r in journal.runs} == {"a"}
    asked = fail_claims(a, clock)
    failing_at = clock.monotonic()
    with caplog.at_level(logging.WARNING, logger="fastapi_singletonjob"):
        moved_at = None
        for _ in range(int(3 * MOVE_BOUND_S / 0.05)):
            await clock.advance(0.05)
            if moved_at is None and any(r.node == "b" for r in journal.runs):
                moved_at = clock.monotonic()
            if moved_at is not None and clock.monotonic() > moved_at + 3.0:
                break
    assert asked, "node a's claims were not asked"
    assert moved_at is not None, "the job never moved to the healthy node"
    print(f"moved {moved_at - asked[0]:.2f}s after the first failing claim")
    assert moved_at - asked[0] <= MOVE_BOUND_S
    assert moved_at - failing_at <= MOVE_BOUND_S + 1.0  # the first claim comes within a second
    # b runs every instant after the move, and none ran twice.
    instants = [r.scheduled_at for r in journal.runs]
    assert len(instants) == len(set(instants))
    assert len([r for r in journal.runs if r.started > moved_at]) >= 2
    # a says why: status, /health/jobs, and a WARNING naming the job and the cause.
    assert not engine(a).elector.is_leader("tick")
    (status,) = a.status("tick").jobs
    assert status.let_go is not None and "claims" in status.let_go
    assert b.status("tick").jobs[0].let_go is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("lets job 'tick' go" in m and "claims" in m for m in warnings), warnings
    app = FastAPI()
    app.include_router(a.router, prefix="/sj")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://a") as client:
        body = (await client.get("/sj/health/jobs")).json()
    (job,) = body["jobs"]
    assert job["name"] == "tick" and job["status"] == "let_go" and "claims" in job["cause"]
    assert body["status"] == "ok"  # the election is healthy: only the job was let go
    await stop(b, clock)


async def test_a_single_node_whose_claims_fail_lets_go_and_takes_the_job_back(
    make: Factory, clock: FakeClock, journal: Journal
) -> None:
    """Alone, the node rests out of the job's election for a lock expiry and then leads it
    again (the let-go cleared), so its runs resume once the claims are answered."""
    a = make("a")

    @a.cron("tick", "* * * * * *")
    async def tick(ctx: JobContext) -> None:
        journal.begin(ctx).ended = clock.monotonic()

    await a.start()
    await clock.advance(2.0)
    store = engine(a).store
    claim = store.claim
    fail_claims(a, clock)
    let_go = None
    for _ in range(200):
        await clock.advance(0.05)
        let_go = let_go or a.status("tick").jobs[0].let_go
        if let_go:
            break
    assert let_go is not None
    store.claim = claim  # type: ignore[method-assign]
    healed_at = clock.monotonic()
    for _ in range(200):
        await clock.advance(0.05)
    assert a.status("tick").jobs[0].let_go is None and engine(a).elector.is_leader("tick")
    after = [r for r in journal.runs if r.started > healed_at]
    assert after and after[0].started - healed_at <= LOCK_EXPIRY_S + 2 * HEARTBEAT_S
    assert after[0].scheduled_at > START
    await asyncio.sleep(0)


async def test_the_job_is_let_go_a_lock_expiry_after_its_claims_fail_not_at_its_next_instant(
    make: Factory, clock: FakeClock, journal: Journal
) -> None:
    """A cron job every minute whose claims time out: node a lets it go a lock expiry after
    the first was asked (node b leads it long before the next instant), and a, letting it go,
    asks no claim more (one would hold an instant that a never runs, and that b is then
    refused)."""
    a, b = make("a"), make("b")

    # A grace shorter than the lock expiry: the instant's claim is given up before the job is
    # let go, and no run comes for a minute to notice that the claims still fail.
    @a.cron("minutely", "* * * * *", misfire_grace=0.5)
    @b.cron("minutely", "* * * * *", misfire_grace=0.5)
    async def minutely(ctx: JobContext) -> None:
        journal.begin(ctx).ended = clock.monotonic()

    await a.start()
    await clock.advance(0.1)
    await b.start()
    await clock.advance(1.0)
    assert engine(a).elector.is_leader("minutely")
    asked = fail_claims(a, clock, after_s=HEARTBEAT_S)  # the claims' deadline
    b_leads_at = None
    for _ in range(int(70 / 0.05)):
        await clock.advance(0.05)
        if asked and engine(b).elector.is_leader("minutely"):
            b_leads_at = clock.monotonic()
            break
    assert asked, "node a never claimed the minute's instant"
    assert b_leads_at is not None, "the job never moved to the healthy node"
    print(f"b leads {b_leads_at - asked[0]:.2f}s after a's claim was asked")
    assert b_leads_at - asked[0] <= MOVE_BOUND_S  # not a minute later, at the next instant
    assert a.status("minutely").jobs[0].let_go is not None
    assert all(at < asked[0] + LOCK_EXPIRY_S for at in asked), asked
    await stop(b, clock)
