"""The lifespan as FastAPI's and Starlette's ``lifespan=``, nested, and its failure paths."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from starlette.applications import Starlette

from fastapi_singletonjob import JobContext, SingletonJobs


def make_jobs(url: str, ran: asyncio.Event) -> SingletonJobs:
    jobs = SingletonJobs(url, project="lifespan", heartbeat_interval=0.05, lock_expiry=0.3)

    @jobs.fixed_rate("tick", every=0.02)
    async def tick(ctx: JobContext) -> None:
        ran.set()

    return jobs


async def test_fastapi_lifespan_runs_jobs_and_serves() -> None:
    ran = asyncio.Event()
    jobs = make_jobs("memory://fastapi", ran)
    app = FastAPI(lifespan=jobs.lifespan)

    @app.get("/ping")
    def ping() -> dict[str, str]:
        return {"node": jobs.node_id}

    async with app.router.lifespan_context(app):
        assert jobs.engine is not None
        await asyncio.wait_for(ran.wait(), 5)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/ping")).json() == {"node": jobs.node_id}
    assert jobs.engine is None


async def test_nested_in_the_applications_own_lifespan() -> None:
    ran = asyncio.Event()
    jobs = make_jobs("memory://nested", ran)
    order: list[str] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        order.append("app startup")
        async with jobs.lifespan(app):
            order.append("jobs started")
            yield
        order.append("jobs stopped")

    app = FastAPI(lifespan=lifespan)
    async with app.router.lifespan_context(app):
        await asyncio.wait_for(ran.wait(), 5)
    assert order == ["app startup", "jobs started", "jobs stopped"]


async def test_plain_starlette() -> None:
    ran = asyncio.Event()
    jobs = make_jobs("memory://starlette", ran)
    app = Starlette(lifespan=jobs.lifespan)
    async with app.router.lifespan_context(app):
        await asyncio.wait_for(ran.wait(), 5)
    assert jobs.engine is None


async def test_startup_returns_at_once_when_redis_is_unreachable() -> None:
    jobs = SingletonJobs(
        "redis://127.0.0.1:1/0", project="down", heartbeat_interval=0.2, lock_expiry=1
    )

    @jobs.interval("never", every=1)
    async def never() -> None:
        raise AssertionError("no leader without Redis")

    began = time.monotonic()
    async with jobs:
        assert time.monotonic() - began < 1.0
        engine = jobs.engine
        assert engine is not None
        for _ in range(100):
            if engine.elector.failures:
                break
            await asyncio.sleep(0.02)
        assert engine.elector.failures >= 1
        assert engine.elector.last_error is not None
        assert not engine.elector.is_leader("never")


async def test_a_failing_body_still_stops_the_jobs() -> None:
    ran = asyncio.Event()
    jobs = make_jobs("memory://body", ran)
    app = FastAPI(lifespan=jobs.lifespan)
    with pytest.raises(RuntimeError, match="body failed"):
        async with app.router.lifespan_context(app):
            await asyncio.wait_for(ran.wait(), 5)
            raise RuntimeError("body failed")
    assert jobs.engine is None


async def test_start_twice_is_an_error_and_stop_is_idempotent() -> None:
    jobs = make_jobs("memory://twice", asyncio.Event())
    async with jobs:
        with pytest.raises(RuntimeError, match="already started"):
            await jobs.start()
    await jobs.stop()
    assert jobs.engine is None


async def test_registering_after_startup_is_refused() -> None:
    jobs = make_jobs("memory://late", asyncio.Event())
    async with jobs:
        with pytest.raises(ValueError, match="before startup"):

            @jobs.interval("late", every=1)
            async def late() -> None:
                pass


async def test_memory_instances_of_one_process_elect_one_leader_even_with_one_node_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    running = 0
    peak = 0
    instances = []
    for _ in range(3):
        jobs = SingletonJobs(
            "memory://twins",
            project="twins",
            node_id="same-name",
            heartbeat_interval=0.02,
            lock_expiry=0.1,
        )

        @jobs.fixed_rate("tick", every=0.01)
        async def tick() -> None:
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.005)
            running -= 1

        instances.append(jobs)
    async with contextlib.AsyncExitStack() as stack:
        for jobs in instances:
            await stack.enter_async_context(jobs)
        await asyncio.sleep(0.3)
        leaders = [
            jobs for jobs in instances if jobs.engine and jobs.engine.elector.is_leader("tick")
        ]
        assert len(leaders) == 1
    assert peak == 1
    assert any("uses node id 'same-name' too" in r.getMessage() for r in caplog.records)
