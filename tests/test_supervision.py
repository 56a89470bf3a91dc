"""Supervision of the library's background tasks: a task that dies (cancelled, raising, or
returning though it must run until stopped) is logged at ERROR once, with its name, and named
in the snapshot's ``failed_tasks``, which liveness reports; a shutdown is no death. On the
fake clock and the memory store."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime

import pytest
from test_router import PREFIX, get_json, make_app, serve
from test_runner import Factory, clock, engine, make

from fastapi_singletonjob import SingletonJobs
from fastapi_singletonjob.testing import FakeClock

__all__ = ["clock", "make"]  # fixtures

TASKS = ("election", "timer", "release listener", "deadline watchdog")
"""The background tasks of a started node, by the end of their names."""


def task_named(name: str) -> asyncio.Task[object]:
    tasks = [task for task in asyncio.all_tasks() if task.get_name() == name]
    assert len(tasks) == 1, f"{name!r}: {sorted(t.get_name() for t in asyncio.all_tasks())}"
    return tasks[0]


async def started(make: Factory, clock: FakeClock) -> SingletonJobs:
    jobs = make()

    @jobs.interval("tick", every=1.0)
    async def tick() -> None:
        pass

    await jobs.start()
    await clock.advance(2.0)
    assert engine(jobs).snapshot().failed_tasks == {}
    return jobs


def errors_naming(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR and name in r.getMessage()]


@pytest.mark.parametrize("task", TASKS)
async def test_a_cancelled_task_is_named_in_failed_tasks(
    task: str, make: Factory, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    jobs = await started(make, clock)
    name = f"singletonjob a {task}"
    victim = task_named(name)
    victim.cancel()
    await clock.advance(1.0)
    assert victim.cancelled()
    assert engine(jobs).snapshot().failed_tasks == {name: "CancelledError()"}
    assert len(errors_naming(caplog, name)) == 1


async def test_an_election_loop_that_raises_is_named_with_its_error(
    make: Factory,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    jobs = await started(make, clock)
    name = "singletonjob a election"

    async def broken() -> float:
        raise RuntimeError("library bug")

    monkeypatch.setattr(engine(jobs).elector, "round", broken)
    await clock.advance(2.0)
    election = engine(jobs).election_task
    assert election is not None and election.done()
    assert engine(jobs).snapshot().failed_tasks == {name: "RuntimeError('library bug')"}
    # Logged when it died, not left for the shutdown; and once (not again at shutdown).
    assert len(errors_naming(caplog, name)) == 1
    await engine(jobs).stop()
    assert len(errors_naming(caplog, name)) == 1


async def test_a_deadline_watchdog_that_raises_is_named_with_its_error(
    make: Factory, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = await started(make, clock)
    terms = engine(jobs).elector.terms

    def broken(idle_s: float) -> float:
        raise RuntimeError("library bug")

    monkeypatch.setattr(terms, "watchdog_sleep_s", broken)
    await clock.advance(2.0)  # each round moves the deadlines: the watchdog wakes
    failed = engine(jobs).snapshot().failed_tasks
    assert failed == {"singletonjob a deadline watchdog": "RuntimeError('library bug')"}
    assert not task_named("singletonjob a election").done(), "the election goes on"


class Once:
    """A custom schedule with one instant: the job then retires (hands its lock over)."""

    def __init__(self, at: datetime) -> None:
        self.at = at

    def next_fire(self, after: datetime) -> datetime | None:
        return self.at if after < self.at else None


async def test_a_retirement_that_raises_is_named_with_its_error(
    make: Factory, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = make()

    @jobs.schedule("once", Once(clock.now()))
    async def once() -> None:
        pass

    async def broken(jobs: object) -> None:
        raise RuntimeError("library bug")

    await jobs.start()
    monkeypatch.setattr(engine(jobs).elector, "resign", broken)
    await clock.advance(3.0)
    failed = engine(jobs).snapshot().failed_tasks
    assert failed == {"singletonjob retire 'once'": "RuntimeError('library bug')"}


async def test_a_shutdown_is_no_death(make: Factory, clock: FakeClock) -> None:
    jobs = await started(make, clock)
    node = engine(jobs)
    await node.stop()
    assert node.snapshot().failed_tasks == {}
    for task in TASKS:
        assert not [t for t in asyncio.all_tasks() if t.get_name() == f"singletonjob a {task}"]


LIVENESS_REASONS = {
    "election": "the election loop has stopped",
    "timer": "the timer has stopped",
    "release listener": (
        "the background task 'singletonjob a release listener' failed: CancelledError()"
    ),
    "deadline watchdog": (
        "the background task 'singletonjob a deadline watchdog' failed: CancelledError()"
    ),
}


@pytest.mark.parametrize("task", TASKS)
async def test_liveness_names_a_killed_task(task: str, clock: FakeClock) -> None:
    """The whole path, through the router a deployment mounts: any library task killed turns
    ``/health/live`` 503, naming the task."""
    jobs = SingletonJobs(
        "memory://supervision-live",
        project="live",
        node_id="a",
        clock=clock,
        heartbeat_interval=1.0,
        lock_expiry=3.0,
    )

    @jobs.interval("tick", every=1.0)
    async def tick() -> None:
        pass

    async with serve(make_app(jobs)) as client:
        await clock.advance(2.0)
        assert (await get_json(client, f"{PREFIX}/health/live"))["status"] == "ok"
        task_named(f"singletonjob a {task}").cancel()
        await clock.advance(1.0)
        live = await get_json(client, f"{PREFIX}/health/live", 503)
    assert (live["status"], live["reason"]) == ("unavailable", LIVENESS_REASONS[task])
