"""Small asyncio helpers that the engine needs in several places, written once, and the
``Supervisor`` that starts and watches its background tasks."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Collection, Coroutine, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar

from ._clock import Clock, SystemClock, WaitsForThreads

__all__ = [
    "Alarm",
    "Pacer",
    "Supervisor",
    "abort_all",
    "call_in_thread",
    "cancel_and_wait",
    "wait_all",
    "within",
]

logger = logging.getLogger("fastapi_singletonjob")

T = TypeVar("T")

UNWIND_S = 1.0
"""How long a cancelled ``within`` waits for its call to unwind before the cancel goes on."""
OVERRUN_S = 1.0
"""How long past its deadline a store call in flight may take to give up (its own bound, which
drops its connection, normally ends it on time) before the caller that coalesces calls
(``_store.redis.batch.Batcher``, ``_run.recorder.Recorder``) abandons it and sends the next
one anyway: nothing waits for good behind a call that may never return."""


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Alarm:
    """A sleep that another task can cut short with ``ring``: the ticker's one timer.

    On the system clock a wait costs one future and one timer handle, no task; on any other
    clock (a test's ``FakeClock``) it sleeps on that clock. A ``ring`` while nobody waits
    makes the next wait return at once, so no ring is ever lost.
    """

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._native = isinstance(clock, SystemClock)
        self._future: asyncio.Future[None] | None = None
        self._rung = False

    async def wait(self, seconds: float) -> None:
        """Sleep ``seconds`` on the clock, or until ``ring``."""
        if self._rung:
            self._rung = False
            return
        loop = asyncio.get_running_loop()
        future = self._future = loop.create_future()
        if self._native:
            handle = loop.call_later(max(seconds, 0.0), _resolve, future)
            try:
                await future
            finally:
                handle.cancel()
                self._future = None
            return
        sleeper = asyncio.ensure_future(self._clock.sleep(seconds))
        sleeper.add_done_callback(lambda _: _resolve(future))
        try:
            await future
        finally:
            sleeper.cancel()
            self._future = None

    def ring(self) -> None:
        """End the current wait now, or the next one as soon as it begins."""
        if self._future is not None:
            _resolve(self._future)
        else:
            self._rung = True


class Pacer:
    """Calls a step function again and again, each time after the delay its previous call
    returned (0: once the other ready tasks have run), or soon after ``ring``: the ticker's
    one timer.

    On the system clock the step runs straight from the event loop's timer callback, with no
    task to wake in between, so a run the step starts begins one loop iteration after its
    instant, as the body of a bare ``asyncio.sleep`` loop does; a delay of at most
    ``spin_s`` is waited by yielding to the other ready tasks, step after step, not by the
    loop's timer (which wakes up to a millisecond or two late). On any other clock (a test's
    ``FakeClock``) a loop sleeps on that clock, each delay exactly.
    """

    def __init__(self, clock: Clock, spin_s: float = 0.0) -> None:
        self._clock = clock
        self._spin_s = spin_s
        self._alarm = Alarm(clock)
        self._handle: asyncio.Handle | None = None
        self._stepping = False
        self._call: Callable[[], None] | None = None

    async def drive(self, step: Callable[[], float]) -> None:
        """Call ``step`` until cancelled, or until it raises (then raise that)."""
        if not isinstance(self._clock, SystemClock):
            while True:
                delay = step()
                await (asyncio.sleep(0) if delay <= 0 else self._alarm.wait(delay))
        loop = asyncio.get_running_loop()
        failed: asyncio.Future[None] = loop.create_future()

        def call() -> None:
            self._stepping = True
            try:
                delay = step()
            except Exception as exc:  # the driving task re-raises it
                if not failed.done():
                    failed.set_exception(exc)
                return
            finally:
                self._stepping = False
            if delay <= self._spin_s:
                self._handle = loop.call_soon(call)
            else:
                self._handle = loop.call_later(delay, call)

        self._call = call
        self._handle = loop.call_soon(call)
        try:
            await failed
        finally:
            self._call = None
            if self._handle is not None:
                self._handle.cancel()

    def ring(self) -> None:
        """Step again soon, whatever the last step asked for. A ring from inside a step
        changes nothing: the delay that step returns is computed after it."""
        if self._call is None:
            self._alarm.ring()
        elif not self._stepping:
            assert self._handle is not None
            self._handle.cancel()
            self._handle = asyncio.get_running_loop().call_soon(self._call)


async def wait_all(
    tasks: Collection[asyncio.Future[Any]], timeout_s: float, clock: Clock, *, first: bool = False
) -> set[asyncio.Future[Any]]:
    """Wait for ``tasks`` (with ``first``, for the first of them) up to ``timeout_s`` on
    ``clock``; return those still pending."""
    pending = {task for task in tasks if not task.done()}
    if not pending or timeout_s <= 0:
        return pending
    timer = asyncio.ensure_future(clock.sleep(timeout_s))
    try:
        while pending and not timer.done():
            await asyncio.wait({*pending, timer}, return_when=asyncio.FIRST_COMPLETED)
            before = len(pending)
            pending = {task for task in pending if not task.done()}
            if first and len(pending) < before:
                break
    finally:
        timer.cancel()
    return pending


async def within(call: Awaitable[T], timeout_s: float) -> T:
    """Await ``call`` for at most ``timeout_s`` seconds (``TimeoutError`` after that): the
    one way the library bounds a call. A cancel of the caller is never swallowed (on Python <
    3.12, ``asyncio.wait_for`` can return the result of a call that completes just as the
    caller is cancelled, and a task being shut down would go on); and as the call runs as a
    task of its own, a cancelled caller waits at most ``UNWIND_S`` for it to unwind, where
    ``asyncio.timeout`` would wait for as long as the call takes to."""
    task = asyncio.ensure_future(call)
    try:
        await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        # The call's outcome is not wanted, but it unwinds before the cancel goes on (a Redis
        # call gives its connection back to the pool, which the caller may be about to close),
        # for a bounded time, and an error it ends with is not left unretrieved.
        task.add_done_callback(_discard)
        task.cancel()
        await asyncio.wait({task}, timeout=UNWIND_S)
        raise
    if not task.done():
        task.add_done_callback(_discard)
        task.cancel()
        await asyncio.wait({task})
        raise TimeoutError
    return task.result()


def _discard(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def cancel_and_wait(task: asyncio.Future[None]) -> None:
    """Cancel ``task`` and wait until it has ended (what it ended with is its supervisor's
    business: see ``Supervisor``).

    The cancel is repeated: on Python < 3.12, ``asyncio.wait_for`` can swallow a cancel that
    lands just as the awaited call completes, and the task would go on. Waiting with
    ``asyncio.wait`` never raises, so a cancel aimed at the caller itself is not swallowed.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    _discard(task)


class Supervisor:
    """Starts the long-lived background tasks of one engine (the election loop and its
    helpers, the timer, retirements), each named, and keeps the record of those that died.

    A task that ends with an exception, at any time, died. A task started ``forever`` (it
    runs until stopped) also died when it ends in any other way, cancelled or returning,
    before ``stop`` and unless ended through ``cancel``. Each death is logged at ERROR once,
    with the task's name, and recorded in ``failed`` (task name: ``repr`` of the error),
    which liveness reports: only a restart brings such a task back.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self._ending: set[asyncio.Task[None]] = set()
        """Tasks ended on purpose (``cancel``): their cancel is no death."""
        self._failed: dict[str, str] = {}
        self._stopping = False

    @property
    def failed(self) -> Mapping[str, str]:
        """The tasks that died, by name: ``repr`` of what they ended with."""
        return dict(self._failed)

    @property
    def tasks(self) -> frozenset[asyncio.Task[None]]:
        """The tasks started here that are still running."""
        return frozenset(self._tasks)

    def start(
        self, coro: Coroutine[Any, Any, None], *, name: str, forever: bool = True
    ) -> asyncio.Task[None]:
        """Start ``coro`` as the task ``name``; ``forever``: it must run until stopped."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._ended, forever=forever))
        return task

    def stop(self) -> None:
        """The engine is stopping: from now on a task that is cancelled or returns did not
        die (one that raises did)."""
        self._stopping = True

    async def cancel(self, tasks: Iterable[asyncio.Task[None]]) -> None:
        """End ``tasks`` on purpose: cancel them all, then wait for each to end."""
        pending = [task for task in tasks if not task.done()]
        self._ending.update(pending)
        for task in pending:
            task.cancel()
        for task in pending:
            await cancel_and_wait(task)

    async def aclose(self) -> None:
        """Stop, and cancel and wait for every task still running (the engine's teardown)."""
        self.stop()
        await self.cancel(self._tasks)

    def _ended(self, task: asyncio.Task[None], *, forever: bool) -> None:
        self._tasks.discard(task)
        on_purpose = self._stopping or task in self._ending
        self._ending.discard(task)
        if task.cancelled():
            if not forever or on_purpose:
                return
            error: BaseException = asyncio.CancelledError()
            logger.error("task %s was cancelled, though it must run until stopped", task.get_name())
        else:
            exc = task.exception()
            if exc is None:
                if not forever or on_purpose:
                    return
                error = RuntimeError("returned, though it must run until stopped")
                logger.error("task %s returned, though it must run until stopped", task.get_name())
            else:
                error = exc
                logger.error("task %s had failed", task.get_name(), exc_info=exc)
        self._failed[task.get_name()] = repr(error)


async def abort_all(tasks: Sequence[asyncio.Future[None] | None], grace_s: float) -> None:
    """Cancel every task still running and wait for them up to ``grace_s`` (real time)."""
    pending = [task for task in tasks if task is not None and not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=grace_s)


async def call_in_thread(
    executor: Executor | None,
    call: Callable[[], object],
    *,
    on_cancel: Callable[[], object],
    clock: object = None,
) -> None:
    """Run ``call`` in ``executor`` and wait for it. A thread cannot be interrupted: when the
    caller is cancelled, ``on_cancel`` is called and the wait goes on until the thread
    returns (so no second run of the same job starts meanwhile), then the cancel goes on.
    A ``clock`` that waits for threads (a test's ``FakeClock``) is told of the thread."""
    thread = asyncio.get_running_loop().run_in_executor(executor, call)
    if isinstance(clock, WaitsForThreads):
        clock.thread_started(thread)
    try:
        await asyncio.shield(thread)
    except asyncio.CancelledError:
        on_cancel()
        while not thread.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(thread)
        raise
