"""``ctx.save_state`` in a sync job (``def``, run in a worker thread): it blocks the thread
until the state is durable, with the fencing, size limit and errors of the async one (issue
27, item 5: it used to return a coroutine nobody awaited, and saved nothing). On the fake
clock with the memory store, then once on a real redis-server."""

from __future__ import annotations

import asyncio
import threading

import pytest
from fake_nodes import kill
from test_checkpoints import Factory, clock, make

from fastapi_singletonjob import (
    ConfigurationError,
    JobContext,
    LeadershipLost,
    SingletonJobs,
    UsageError,
)
from fastapi_singletonjob.testing import FakeClock

WAIT_S = 10.0  # real seconds a test waits for a worker thread, on a busy machine

__all__ = ["clock", "make"]  # fixtures


async def wait_for(event: threading.Event) -> None:
    """Wait for a worker thread's signal, leaving the loop free to serve its saves."""
    assert await asyncio.to_thread(event.wait, WAIT_S), "the sync job did not get there"


async def test_a_sync_jobs_save_is_durable_when_the_call_returns(
    make: Factory, clock: FakeClock
) -> None:
    jobs = make()
    seen: list[object] = []
    stored_during_run: list[object] = []
    done = threading.Event()
    loop = asyncio.get_running_loop()

    @jobs.interval("export", every=100.0)
    def export(ctx: JobContext) -> None:
        result = ctx.save_state({"cursor": 7})
        seen.append(result)
        # Durable on return: another reader sees it before the run ends.
        read = asyncio.run_coroutine_threadsafe(jobs.checkpoint("export"), loop).result()
        stored_during_run.append(None if read is None else read.state)
        done.set()

    await jobs.start()
    await clock.settle()
    await wait_for(done)
    await clock.advance(0.1)
    assert stored_during_run == [{"cursor": 7}]
    assert len(seen) == 1 and not asyncio.iscoroutine(seen[0])
    await seen[0]  # type: ignore[misc]  # already done: awaiting it is harmless
    stored = await jobs.checkpoint("export")
    assert stored is not None and stored.state == {"cursor": 7} and stored.iteration == 1


async def test_a_sync_job_gets_the_same_errors_as_an_async_one(
    make: Factory, clock: FakeClock
) -> None:
    jobs = make()
    errors: dict[str, BaseException] = {}
    done = {name: threading.Event() for name in ("picky", "fast")}

    @jobs.interval("picky", every=100.0)
    def picky(ctx: JobContext) -> None:
        for name, value in {"set": {1, 2}, "big": "x" * (64 * 1024), "nan": float("nan")}.items():
            try:
                ctx.save_state(value)
            except ConfigurationError as exc:
                errors[name] = exc
        done["picky"].set()

    @jobs.interval("fast", every=100.0, checkpoint=False)
    def fast(ctx: JobContext) -> None:
        try:
            ctx.save_state(1)
        except UsageError as exc:
            errors["opted-out"] = exc
        done["fast"].set()

    await jobs.start()
    await clock.settle()
    for event in done.values():
        await wait_for(event)
    await clock.advance(0.1)
    assert sorted(errors) == ["big", "nan", "opted-out", "set"]
    assert all("picky" in str(errors[name]) for name in ("big", "nan", "set"))
    assert "checkpoint=False" in str(errors["opted-out"])
    stored = await jobs.checkpoint("picky")
    assert stored is not None and stored.state is None


async def test_a_sync_jobs_save_after_its_term_ended_raises_and_changes_nothing(
    make: Factory, clock: FakeClock
) -> None:
    a, b = make("a"), make("b")
    clock.thread_wait_s = 0  # a's run is held in its thread while time advances
    errors: list[BaseException] = []
    saved_first, resume, finished = threading.Event(), threading.Event(), threading.Event()

    @a.interval("long", every=100.0)
    def long_a(ctx: JobContext) -> None:
        ctx.save_state("a-start")
        saved_first.set()
        resume.wait(WAIT_S)  # meanwhile a is cut off and b takes over
        try:
            ctx.save_state("a-late")
        except LeadershipLost as exc:
            errors.append(exc)
        finished.set()

    @b.interval("long", every=100.0)
    async def long_b(ctx: JobContext) -> None:
        await ctx.save_state("b")

    await a.start()
    await clock.settle()
    await wait_for(saved_first)
    await b.start()
    kill(a)  # a's run goes on, but a renews nothing any more
    await clock.advance(10.0)
    taken_over = await b.checkpoint("long")
    assert taken_over is not None and taken_over.state == "b"
    resume.set()
    await wait_for(finished)
    assert len(errors) == 1 and "long" in str(errors[0])
    stored = await b.checkpoint("long")
    assert stored is not None and stored.state == "b" and stored.node_id == "b"


@pytest.mark.redis
async def test_a_sync_jobs_state_carries_to_the_next_run_on_redis(
    redis_url: str, unique_project: str
) -> None:
    jobs = SingletonJobs(
        redis_url, project=unique_project, node_id="n1", heartbeat_interval=0.1, lock_expiry=0.5
    )
    seen: list[object] = []
    three = threading.Event()

    @jobs.interval("export", every=0.05)
    def export(ctx: JobContext) -> None:
        cursor = ctx.checkpoint.state if ctx.checkpoint else None
        seen.append(cursor)
        ctx.save_state((cursor if isinstance(cursor, int) else 0) + 100)
        if len(seen) >= 3:
            three.set()

    await jobs.start()
    try:
        await wait_for(three)
    finally:
        await jobs.stop()
    assert seen[:3] == [None, 100, 200]
    stored = await jobs.checkpoint("export")
    assert stored is not None and stored.state == 100 * len(seen)
