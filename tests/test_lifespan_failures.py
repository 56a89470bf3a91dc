"""Lifespan failures reach the server, and the jobs stop, wherever the failure happens.

The tests play the server's side of the ASGI lifespan protocol by hand, as uvicorn does: send
``lifespan.startup``, read the answer, send ``lifespan.shutdown``, read the answer, and see
whether the application call returned or raised. For every place a failure can come from, with
both ``FastAPI(lifespan=...)`` and ``Starlette(lifespan=...)``, the server must be told
``lifespan.startup.failed`` or ``lifespan.shutdown.failed`` with the error in the message
(never "complete", never silence), the error must be re-raised, and no task of the library may
be left running. The memory store keeps the whole matrix well under a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
import traceback
from collections.abc import AsyncIterator, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
from fastapi import FastAPI
from starlette.applications import Starlette
from waiting import wait_until

from fastapi_singletonjob import JobContext, SingletonJobs
from fastapi_singletonjob._election.elector import Elector
from fastapi_singletonjob._engine.engine import Engine
from fastapi_singletonjob._store.memory import MemoryLeaseStore

Message = MutableMapping[str, Any]

ANSWER_TIMEOUT_S = 2.0
"""Longest wait for the application to answer one message (it takes milliseconds)."""


class Where(str, enum.Enum):
    """Where the failure happens, in the order a lifespan runs."""

    APP_STARTUP = "app-startup"
    """The application's own startup code, before it enters ``jobs.lifespan``."""
    STORE_OPEN = "jobs-start-store"
    """``SingletonJobs.start``: opening the lease store fails."""
    ELECTION_CRASH = "jobs-start-election"
    """``SingletonJobs.start``: the election loop dies as it starts."""
    APP_BODY = "app-body"
    """A task of the application fails while it serves, between startup and shutdown."""
    APP_SHUTDOWN_INSIDE = "app-shutdown-inside"
    """The application's shutdown code inside ``jobs.lifespan``, before the jobs stop."""
    APP_SHUTDOWN_AFTER = "app-shutdown-after"
    """The application's shutdown code after ``jobs.lifespan`` has exited."""
    ENGINE_STOP_LATE = "jobs-stop-late"
    """``SingletonJobs.stop``: ``Engine.stop`` raises after it has done its work."""
    ENGINE_STOP_EARLY = "jobs-stop-early"
    """``SingletonJobs.stop``: ``Engine.stop`` raises before it has done anything."""

    @property
    def at_startup(self) -> bool:
        """Whether the failure comes before the application has started."""
        return self in (Where.APP_STARTUP, Where.STORE_OPEN, Where.ELECTION_CRASH)


class Boom(RuntimeError):
    """The injected failure."""


def boom(where: Where) -> Boom:
    return Boom(f"injected failure at {where.value}")


FRAMEWORKS: dict[str, Callable[..., Any]] = {"fastapi": FastAPI, "starlette": Starlette}


def library_tasks() -> list[asyncio.Task[Any]]:
    """The library's tasks that have not finished (they are all named ``singletonjob ...``)."""
    return [
        t for t in asyncio.all_tasks() if t.get_name().startswith("singletonjob") and not t.done()
    ]


@dataclass
class Seen:
    """What the application's lifespan observed while it ran."""

    engine_started: bool = False
    store_closes: int = 0
    tasks_while_serving: list[str] = field(default_factory=list)
    fail_body: asyncio.Event = field(default_factory=asyncio.Event)


def inject(where: Where, jobs: SingletonJobs, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the library itself fail at ``where``, if that is a place inside the library."""
    if where is Where.STORE_OPEN:

        def no_store() -> None:
            raise boom(where)

        monkeypatch.setattr(jobs, "_open_store", no_store)
    elif where is Where.ELECTION_CRASH:

        async def crash(self: Elector, ready: asyncio.Event | None = None) -> None:
            raise boom(where)

        monkeypatch.setattr(Elector, "run", crash)
    elif where in (Where.ENGINE_STOP_LATE, Where.ENGINE_STOP_EARLY):
        real_stop = Engine.stop

        async def failing_stop(self: Engine) -> None:
            if where is Where.ENGINE_STOP_LATE:
                await real_stop(self)
            raise boom(where)

        monkeypatch.setattr(Engine, "stop", failing_stop)


def build_app(
    framework: str, where: Where, monkeypatch: pytest.MonkeyPatch, seen: Seen
) -> tuple[Any, SingletonJobs]:
    """An application of ``framework`` whose lifespan nests ``jobs.lifespan`` and fails at
    ``where``."""
    jobs = SingletonJobs(
        f"memory://lifespan-failures-{framework}-{where.value}",
        project="lifespan-failures",
        heartbeat_interval=0.05,
        lock_expiry=0.15,
        shutdown_timeout=0.5,
    )

    @jobs.fixed_rate("tick", every=0.01)
    async def tick(ctx: JobContext) -> None:
        pass

    inject(where, jobs, monkeypatch)
    real_aclose = MemoryLeaseStore.aclose

    async def counting_aclose(self: MemoryLeaseStore) -> None:
        seen.store_closes += 1
        await real_aclose(self)

    monkeypatch.setattr(MemoryLeaseStore, "aclose", counting_aclose)

    async def fail_when_told() -> None:
        await seen.fail_body.wait()
        raise boom(Where.APP_BODY)

    @contextlib.asynccontextmanager
    async def lifespan(app: object) -> AsyncIterator[None]:
        if where is Where.APP_STARTUP:
            raise boom(where)
        async with jobs.lifespan(app):
            seen.engine_started = jobs.engine is not None
            seen.tasks_while_serving = sorted(t.get_name() for t in library_tasks())
            # The usual way an application runs its own background work while it serves.
            async with anyio.create_task_group() as background:
                background.start_soon(fail_when_told)
                yield
                background.cancel_scope.cancel()
            if where is Where.APP_SHUTDOWN_INSIDE:
                raise boom(where)
        if where is Where.APP_SHUTDOWN_AFTER:
            raise boom(where)

    return FRAMEWORKS[framework](lifespan=lifespan), jobs


class LifespanServer:
    """The server's side of the lifespan protocol, driven step by step by the test."""

    def __init__(self, app: Any) -> None:
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._arrived = asyncio.Event()
        self.messages: list[Message] = []
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        self.call: asyncio.Future[None] = asyncio.ensure_future(
            app(scope, self._inbox.get, self._send)
        )

    @property
    def sent(self) -> list[str]:
        """The types of the messages the application sent, in order."""
        return [message["type"] for message in self.messages]

    async def _send(self, message: Message) -> None:
        self.messages.append(message)
        self._arrived.set()

    def tell(self, message_type: str) -> None:
        """Send ``message_type`` without waiting for an answer."""
        self._inbox.put_nowait({"type": message_type})

    async def ask(self, message_type: str | None) -> Message:
        """Send ``message_type`` (None: send nothing) and return the application's answer."""
        count = len(self.messages)
        if message_type is not None:
            self.tell(message_type)
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        # The application sends its answer before its call ends, so once the call has ended
        # every answer it gave is in self.messages.
        while len(self.messages) == count and not self.call.done():
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                break
            arrived = asyncio.ensure_future(self._arrived.wait())
            either: set[asyncio.Future[Any]] = {arrived, self.call}
            await asyncio.wait(either, timeout=left_s, return_when="FIRST_COMPLETED")
            arrived.cancel()
            self._arrived.clear()
        if len(self.messages) == count:
            raise AssertionError(
                f"no answer to {message_type} within {ANSWER_TIMEOUT_S}s; sent so far: "
                f"{self.sent}; application call ended: {self.call.done()}"
            )
        return self.messages[count]

    async def outcome_or_cancelled(self) -> None:
        """Wait for the application call to end, whichever way."""
        done, _ = await asyncio.wait({self.call}, timeout=ANSWER_TIMEOUT_S)
        assert done, f"the application call did not end; sent so far: {self.sent}"

    async def outcome(self) -> BaseException | None:
        """Wait for the application call to end; what it raised, if anything."""
        done, _ = await asyncio.wait({self.call}, timeout=ANSWER_TIMEOUT_S)
        assert done, f"the application call did not end; sent so far: {self.sent}"
        return self.call.exception()


@pytest.fixture
async def no_leftover_tasks() -> AsyncIterator[None]:
    """Cancel whatever library task a failing test left, so that it cannot leak into later
    tests (the tests themselves assert that there is none)."""
    yield
    leftovers = library_tasks()
    for task in leftovers:
        task.cancel()
    if leftovers:
        await asyncio.wait(leftovers, timeout=ANSWER_TIMEOUT_S)


def where_params() -> list[Any]:
    return [pytest.param(w, id=w.value) for w in Where]


@pytest.mark.usefixtures("no_leftover_tasks")
@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
@pytest.mark.parametrize("where", where_params())
async def test_a_lifespan_failure_is_reported_and_the_jobs_stop(
    framework: str, where: Where, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = Seen()
    app, jobs = build_app(framework, where, monkeypatch, seen)
    before = set(asyncio.all_tasks())
    server = LifespanServer(app)

    answer = await server.ask("lifespan.startup")
    if where.at_startup:
        expected = "lifespan.startup.failed"
        assert not seen.engine_started
    else:
        assert answer["type"] == "lifespan.startup.complete", answer
        assert seen.engine_started
        # The library really ran: election, release listener and timer.
        assert any("election" in name for name in seen.tasks_while_serving), seen
        assert any("timer" in name for name in seen.tasks_while_serving), seen
        if where is Where.APP_BODY:
            seen.fail_body.set()
            answer = await server.ask(None)  # the application reports it unprompted
        else:
            answer = await server.ask("lifespan.shutdown")
        expected = "lifespan.shutdown.failed"

    error = await server.outcome()
    assert answer["type"] == expected, (answer, server.sent)
    assert f"injected failure at {where.value}" in answer.get("message", ""), answer
    if where.at_startup:
        assert server.sent == ["lifespan.startup.failed"]
    else:
        assert server.sent == ["lifespan.startup.complete", "lifespan.shutdown.failed"]
    # Re-raised to the server, not swallowed.
    assert error is not None, f"the application call returned normally; sent {server.sent}"
    raised = "".join(traceback.format_exception(error))
    assert f"injected failure at {where.value}" in raised, raised
    # The jobs are stopped, the store they opened is closed, and nothing is left running.
    assert jobs.engine is None
    opened = where not in (Where.APP_STARTUP, Where.STORE_OPEN)
    assert seen.store_closes == (1 if opened else 0), seen
    assert library_tasks() == [], library_tasks()
    pending = [t for t in asyncio.all_tasks() - before if not t.done()]
    assert pending == [], pending


@pytest.mark.usefixtures("no_leftover_tasks")
@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
async def test_a_cancelled_shutdown_still_stops_the_jobs(framework: str) -> None:
    """A server (or ``asyncio.run`` on Ctrl-C) may cancel the lifespan while the jobs drain a
    run in flight: the shutdown must still end every task of the library."""
    jobs = SingletonJobs(
        f"memory://lifespan-cancelled-{framework}",
        project="lifespan-failures",
        heartbeat_interval=0.05,
        lock_expiry=0.15,
        shutdown_timeout=5.0,
    )
    running = asyncio.Event()

    @jobs.interval("slow", every=1.0)
    async def slow() -> None:
        running.set()
        await asyncio.Event().wait()  # until cancelled

    server = LifespanServer(FRAMEWORKS[framework](lifespan=jobs.lifespan))
    assert (await server.ask("lifespan.startup"))["type"] == "lifespan.startup.complete"
    await asyncio.wait_for(running.wait(), ANSWER_TIMEOUT_S)
    server.tell("lifespan.shutdown")

    def draining() -> bool:  # the stop waits for the run
        return jobs.engine is not None and jobs.status().state == "draining"

    await wait_until(draining, ANSWER_TIMEOUT_S, "the shutdown drains the run")
    server.call.cancel()
    await server.outcome_or_cancelled()

    assert "lifespan.shutdown.complete" not in server.sent, server.sent
    assert jobs.engine is None
    assert library_tasks() == [], library_tasks()
