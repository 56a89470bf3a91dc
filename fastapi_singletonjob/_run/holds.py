"""Which run held the event loop: each step of an ``async def`` job's code (from one ``await``
that suspends to the next) is timed on the real clock, and a step that holds the loop for
``HOLD_WARN_S`` or more (a blocking call inside ``async def``: ``time.sleep``, a sync client,
heavy CPU work) is named in a WARNING, once per job. While a step holds the loop nothing else
of the process runs: not the other jobs' timers and runs, not the lease renewals; so the
slow-run warnings of the other jobs then say which run held it (``held_during``), instead of
blaming themselves."""

from __future__ import annotations

import collections
import logging
import time
import types
from collections.abc import Callable, Coroutine, Generator
from typing import Any, NamedTuple

__all__ = ["HOLD_WARN_S", "Hold", "held_during", "timed_steps"]

logger = logging.getLogger("fastapi_singletonjob.runner")

HOLD_WARN_S = 0.25
"""A step of a job's code that holds the event loop this long (real seconds) is named."""
_KEPT = 64


class Hold(NamedTuple):
    """One step of a job's code that held the event loop."""

    job: str
    run: int
    """The run's ``iteration``."""
    ended_at: float
    """``time.perf_counter()`` when the step returned."""
    held_s: float


_holds: collections.deque[Hold] = collections.deque(maxlen=_KEPT)
"""The last holds in this process (one event loop runs a node's jobs)."""


def held_during(last_s: float, *, besides: str) -> Hold | None:
    """The longest hold of a job other than ``besides`` in the last ``last_s`` real seconds."""
    since = time.perf_counter() - last_s
    holds = [h for h in _holds if h.job != besides and h.ended_at >= since]
    return max(holds, key=lambda h: h.held_s, default=None)


@types.coroutine
def timed_steps(
    coro: Coroutine[Any, Any, None], job: str, run: int, warned: Callable[[], bool]
) -> Generator[Any, Any, None]:
    """``await timed_steps(coro, ...)``: drive ``coro`` (a job's code) as its awaiting task
    would, timing each step; a step of ``HOLD_WARN_S`` or more is kept (``held_during``) and
    logged (at WARNING unless ``warned()``, which says whether the job was named before).
    A generator-based coroutine: no object of its own on the run path beside its frame, and
    a step that holds nothing costs two clock reads."""
    clock = time.perf_counter
    value: Any = None
    error: BaseException | None = None
    while True:
        began = clock()
        try:
            yielded = coro.send(value) if error is None else coro.throw(error)
        except StopIteration:
            if clock() - began >= HOLD_WARN_S:
                _held(job, run, began, warned)
            return
        except BaseException:
            if clock() - began >= HOLD_WARN_S:
                _held(job, run, began, warned)
            raise
        if clock() - began >= HOLD_WARN_S:
            _held(job, run, began, warned)
        try:
            value, error = (yield yielded), None
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:  # a cancel thrown in by the task: pass it on
            value, error = None, exc


def _held(job: str, run: int, began: float, warned: Callable[[], bool]) -> None:
    ended = time.perf_counter()
    held_s = ended - began
    _holds.append(Hold(job, run, ended, held_s))
    logger.log(
        logging.DEBUG if warned() else logging.WARNING,
        "job %r run #%d held the event loop for %.3fs without an await that suspends (a "
        "blocking call inside async def: time.sleep, a sync client, heavy CPU work); "
        "nothing else of this process ran meanwhile, not the other jobs nor the lease "
        "renewals: await an async version, or make the job a plain def (it then runs in a "
        "thread)",
        job,
        run,
        held_s,
    )
