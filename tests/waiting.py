"""Bounded waiting for real-time tests: poll a condition, never sleep and hope."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

POLL_S = 0.005


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]],
    timeout_s: float,
    what: str = "the condition",
    *,
    poll_s: float = POLL_S,
) -> float:
    """Poll ``predicate`` (sync or async) until it is true; return the ``time.monotonic()``
    at which it was first seen true. Fails the test after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return time.monotonic()
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s:g} s: {what}")
        await asyncio.sleep(poll_s)
