"""Claims of instants on Redis: ``CLAIM`` calls, coalesced (``batch``), for
``RedisLeaseStore``."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from redis.commands.core import AsyncScript
from redis.exceptions import ReadOnlyError

from ..._lock_value import is_lock_value
from .. import keys as _keys
from ..base import DEFAULT_MAX_AHEAD_US, ClaimResult
from .batch import Batcher

if TYPE_CHECKING:
    from ..._errors import StoreReadOnly

__all__ = ["RedisClaims"]


class RedisClaims:
    """The ``claim`` method of ``RedisLeaseStore``: one ``CLAIM`` script call, with the
    claims of other jobs made while this node's previous one was in flight."""

    _project: str
    _claim: AsyncScript
    _claim_batcher: Batcher[tuple[str, list[str]], int]  # of _claim_all, built by the store
    _read_only: Callable[[str], Awaitable[StoreReadOnly]]

    async def claim(
        self, job: str, value: str, instant_us: int, *, max_ahead_us: int = DEFAULT_MAX_AHEAD_US
    ) -> ClaimResult:
        """See ``Store.claim``: one script call, judged on the Redis server's clock,
        with the claims of other jobs made while this node's previous claim was in flight."""
        if not is_lock_value(value):
            return ClaimResult.NOT_HOLDER
        reply = await self._claim_batcher.submit(
            (job, [value, str(instant_us), str(max_ahead_us)]), math.inf
        )
        return ClaimResult(int(reply))

    async def _claim_all(
        self, claims: Sequence[tuple[str, list[str]]], timeout_s: float
    ) -> list[int]:
        """One ``CLAIM`` call for ``claims`` (job, ARGV): one reply each. Unbounded, as a
        claim has always been: the pool's socket timeouts bound it."""
        keys = [
            _keys.job_key(self._project, job, kind)
            for job, _ in claims
            for kind in ("lock", "last")
        ]
        args = [arg for _, claim_args in claims for arg in claim_args]
        try:
            replies: list[int] = await self._claim(keys=keys, args=args)
        except ReadOnlyError as exc:
            raise await self._read_only("a read-only replica") from exc
        return replies
