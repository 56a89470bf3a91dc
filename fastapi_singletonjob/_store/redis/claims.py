"""Claims of instants on Redis: the ``CLAIM`` script, its ``KEYS``/``ARGV`` and its reply, with
the claims made while one is in flight coalesced into the next call (``_store.redis.batch``)."""

from __future__ import annotations

from collections.abc import Sequence

from redis.exceptions import ReadOnlyError

from ..._clock import Clock
from ..._lock_value import is_lock_value
from .. import keys as _keys
from ..base import DEFAULT_CLAIM_TIMEOUT_S, DEFAULT_MAX_AHEAD_US, ClaimResult
from . import scripts as _scripts
from .batch import Batcher
from .connect import bounded
from .topology import Topology

__all__ = ["RedisClaims"]


class RedisClaims:
    """``Store.claim`` on Redis: one ``CLAIM`` script call on the topology's calls client,
    with the claims of other jobs made while this node's previous one was in flight."""

    def __init__(self, topology: Topology, project: str, *, clock: Clock) -> None:
        self._topology = topology
        self._project = project
        self._script = topology.calls.register_script(_scripts.CLAIM)
        self._batcher: Batcher[tuple[str, list[str]], int] = Batcher(
            self._claim_all, clock=clock, unanswered=self._unanswered
        )

    def _unanswered(self, item: tuple[str, list[str]], timeout_s: float) -> ConnectionError:
        """The error of a claim whose deadline passed (see ``Batcher``), as ``_claim_all``
        says it."""
        return ConnectionError(
            f"Redis at {self._topology.shown} did not answer the claims of {[item[0]]!r} "
            f"within {timeout_s:g}s (whether they were made is unknown)"
        )

    async def claim(
        self,
        job: str,
        value: str,
        instant_us: int,
        *,
        max_ahead_us: int = DEFAULT_MAX_AHEAD_US,
        timeout_s: float = DEFAULT_CLAIM_TIMEOUT_S,
    ) -> ClaimResult:
        """See ``Store.claim``: one script call, judged on the Redis server's clock,
        with the claims of other jobs made while this node's previous claim was in flight;
        ``ConnectionError`` when not answered within ``timeout_s``."""
        if not is_lock_value(value):
            return ClaimResult.NOT_HOLDER
        reply = await self._batcher.submit(
            (job, [value, str(instant_us), str(max_ahead_us)]), timeout_s
        )
        return ClaimResult(int(reply))

    async def _claim_all(
        self, claims: Sequence[tuple[str, list[str]]], timeout_s: float
    ) -> list[int]:
        """One ``CLAIM`` call for ``claims`` (job, ARGV): one reply each, within
        ``timeout_s`` (the shortest time left of the claims in it), else ``ConnectionError``
        and the connection is dropped (``connect.bounded``)."""
        keys = [
            _keys.job_key(self._project, job, kind)
            for job, _ in claims
            for kind in ("lock", "last")
        ]
        args = [arg for _, claim_args in claims for arg in claim_args]
        try:
            replies: list[int] = await bounded(
                self._script(keys=keys, args=args), timeout_s, self._topology
            )
        except TimeoutError as exc:
            jobs = sorted({job for job, _ in claims})
            raise ConnectionError(
                f"Redis at {self._topology.shown} did not answer the claims of {jobs!r} "
                f"within {timeout_s:g}s (whether they were made is unknown)"
            ) from exc
        except ReadOnlyError as exc:
            raise await self._topology.read_only("a read-only replica") from exc
        return replies

    async def aclose(self) -> None:
        """Fail the claims not answered yet (``ConnectionError``)."""
        await self._batcher.aclose()
