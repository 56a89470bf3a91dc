"""What an application or an operator asks of a set of jobs besides running them: the status
and admin routers, the status of this node and of the cluster, each job's checkpoint, and the
controls (pause, resume, trigger, step-down), from any replica, started or not.
``SingletonJobs`` inherits it."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, cast

from fastapi import APIRouter

from ._checkpoint import Checkpoint
from ._errors import JobNotFound
from ._store import keys as _keys
from ._store.base import Store
from ._web.admin_router import create_admin_router
from ._web.cluster_view import ClusterStatus, cluster_status
from ._web.router import create_router
from ._web.status import NodeStatus, node_status

if TYPE_CHECKING:
    from ._clock import Clock
    from ._config.settings import Settings
    from ._engine.engine import Engine
    from ._job.spec import JobSpec
    from ._singletonjobs import SingletonJobs
    from ._store.base import Store

__all__ = ["Operations"]


class Operations:
    """The status and checkpoint calls of ``SingletonJobs``."""

    _specs: dict[str, JobSpec]
    _engine: Engine | None
    _clock: Clock
    settings: Settings

    def _open_store(self) -> Store:
        raise NotImplementedError  # SingletonJobs opens the store its settings name

    @functools.cached_property
    def router(self) -> APIRouter:
        """The status API and health probes: ``app.include_router(jobs.router, prefix=...)``.

        ``GET /jobs``, ``GET /jobs/{name}``, ``GET /health`` (readiness) and
        ``GET /health/live`` (liveness); see ``fastapi_singletonjob._router``.
        """
        return create_router(cast("SingletonJobs", self))

    @functools.cached_property
    def admin_router(self) -> APIRouter:
        """The operators' actions: ``POST /jobs/{name}/pause``, ``/resume``, ``/trigger`` and
        ``/step-down``. Include it behind the application's own authentication::

            app.include_router(jobs.admin_router, dependencies=[Depends(require_admin)])
        """
        return create_admin_router(cast("SingletonJobs", self))

    async def cluster_status(self) -> ClusterStatus:
        """Every live node and every job of the project, as stored in Redis: the same from
        every replica (two round trips). Works before startup too."""
        async with self._store() as store:
            data = await store.read_cluster(self._specs)
        return cluster_status(self.settings.project, data)

    async def pause(self, job: str) -> None:
        """Pause ``job`` cluster-wide: its leader starts no new run (a run in flight goes on)
        from its next election round, which this call wakes at once. Stored in Redis, so it
        stays paused across restarts until ``resume``."""
        value = json.dumps({"at": self._clock.now().isoformat(), "by": self.settings.node_id})
        await self._control(job, _keys.control_field("paused", job), value)

    async def resume(self, job: str) -> None:
        """Undo ``pause``: the job's next instant runs as usual."""
        await self._control(job, _keys.control_field("paused", job), None)

    async def trigger(self, job: str) -> None:
        """Ask ``job``'s current leader for one extra run now (dropped, and logged on the
        leader, when a run is in flight or the job is paused). Taken once, by the leader's
        next election round, which this call wakes at once."""
        await self._control(job, _keys.control_field("trigger", job), "1")

    async def step_down(self, job: str) -> None:
        """Ask ``job``'s leader to hand it over: it releases the lock once no run is in
        flight, another node takes it over at the release notice, and the node that stepped
        down stays out of that job's election for one lock expiry."""
        await self._control(job, _keys.control_field("step-down", job), "1")

    async def _control(self, job: str, field: str, value: str | None) -> None:
        async with self._store() as store:
            controls = store
            if job not in self._specs:
                known = (await controls.read_cluster()).jobs
                if job not in known:
                    raise JobNotFound(
                        f"no job named {job!r} is registered here or by a live node; known "
                        f"jobs: {', '.join(sorted({*known, *self._specs})) or 'none'}",
                        field="job",
                    )
            await controls.set_control(field, value)

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
