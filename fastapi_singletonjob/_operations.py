"""What an application or an operator asks of a set of jobs besides running them: the status
router, the status of this node, and each job's checkpoint, from any replica.
``SingletonJobs`` inherits it."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, cast

from fastapi import APIRouter

from ._checkpoint import Checkpoint
from ._errors import JobNotFound
from ._router import create_router
from ._status import NodeStatus, node_status

if TYPE_CHECKING:
    from ._backend import Store
    from ._engine import Engine
    from ._job import JobSpec
    from ._jobs import SingletonJobs

__all__ = ["Operations"]


class Operations:
    """The status and checkpoint calls of ``SingletonJobs``."""

    _specs: dict[str, JobSpec]
    _engine: Engine | None

    def _open_store(self) -> Store:
        raise NotImplementedError  # SingletonJobs opens the store its settings name

    @functools.cached_property
    def router(self) -> APIRouter:
        """The status API and health probes: ``app.include_router(jobs.router, prefix=...)``.

        ``GET /jobs``, ``GET /jobs/{name}``, ``GET /health`` (readiness) and
        ``GET /health/live`` (liveness); see ``fastapi_singletonjob._router``.
        """
        return create_router(cast("SingletonJobs", self))

    def status(self, job: str | None = None) -> NodeStatus:
        """A snapshot of this node and its jobs (or only ``job``), as the router serves it."""
        if job is not None:
            self._known(job)
        return node_status(cast("SingletonJobs", self), only=job)

    async def checkpoint(self, job: str) -> Checkpoint | None:
        """``job``'s checkpoint as stored, the same from every replica; None before its first
        run. Works before startup too (it opens a connection for the call)."""
        self._known(job)
        async with self._store() as store:
            return await store.read_checkpoint(job)

    async def reset_checkpoint(self, job: str) -> bool:
        """Delete ``job``'s checkpoint (an operator's action, not fenced): its next run starts
        from iteration 1 and no state. True if there was one."""
        self._known(job)
        async with self._store() as store:
            return await store.reset_checkpoint(job)

    def _known(self, job: str) -> None:
        if job not in self._specs:
            raise JobNotFound(
                f"no job named {job!r} is registered; registered jobs: "
                f"{', '.join(sorted(self._specs)) or 'none'}",
                field="job",
            )

    @contextlib.asynccontextmanager
    async def _store(self) -> AsyncIterator[Store]:
        """The running engine's store, or one opened for the call."""
        if self._engine is not None:
            yield self._engine.store
            return
        store = self._open_store()
        try:
            yield store
        finally:
            await store.aclose()
