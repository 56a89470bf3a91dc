"""``AdminClient``: what an operator asks of a project besides running its jobs, from any
replica, started or not, or from a shell: the cluster view, each job's checkpoint, and the
controls (pause, resume, trigger, step-down).

A client-side handle to the project's keys (as arq's ``Job`` is to a job's): ``SingletonJobs``
delegates to one, the admin router calls it through ``SingletonJobs``, and the CLI builds one
with no job definitions at all.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import AbstractAsyncContextManager

from ._checkpoint import Checkpoint
from ._clock import Clock
from ._errors import JobNotFound
from ._history import DEFAULT_HISTORY, Occurrence, check_limit
from ._store import keys as _keys
from ._store.base import Store
from ._web.models import ClusterStatus
from ._web.views import cluster_view

__all__ = ["AdminClient", "StoreFactory", "opened_for_the_call", "require_registered"]

StoreFactory = Callable[[], AbstractAsyncContextManager[Store]]
"""How an ``AdminClient`` gets a store for one call: the running engine's, or one opened for
the call and closed after it (``opened_for_the_call``)."""


def opened_for_the_call(open_store: Callable[[], Store]) -> StoreFactory:
    """A ``StoreFactory`` that opens a store with ``open_store`` for each call and closes it
    after."""

    @contextlib.asynccontextmanager
    async def opened() -> AsyncIterator[Store]:
        store = open_store()
        try:
            yield store
        finally:
            await store.aclose()

    return opened


def require_registered(job: str, registered: Collection[str]) -> None:
    """Raise ``JobNotFound`` unless ``job`` is one of the ``registered`` names."""
    if job not in registered:
        raise JobNotFound(
            f"no job named {job!r} is registered; registered jobs: "
            f"{', '.join(sorted(registered)) or 'none'}",
            field="job",
        )


class AdminClient:
    """The cluster view, the checkpoints and the operators' controls of one project.

    :param stores: gives the store for each call (see ``StoreFactory``).
    :param project: the project namespace.
    :param jobs: the names of the jobs registered here (none in the CLI); read at each call,
        so a live view (the keys of a dict still being filled) is fine. A control may also
        name a job only a live node registered; a checkpoint must be of a job registered here.
    :param clock: stamps a pause (``at``).
    :param node_id: signs a pause (``by``).
    """

    def __init__(
        self,
        stores: StoreFactory,
        *,
        project: str,
        jobs: Collection[str],
        clock: Clock,
        node_id: str,
    ) -> None:
        self._stores = stores
        self._project = project
        self._jobs = jobs
        self._clock = clock
        self._node_id = node_id

    async def cluster_status(self) -> ClusterStatus:
        """Every live node and every job of the project (the registered ones too), as stored
        (two round trips)."""
        async with self._stores() as store:
            data = await store.read_cluster(self._jobs)
        return cluster_view(self._project, data)

    async def pause(self, job: str) -> None:
        """Pause ``job`` cluster-wide (see ``SingletonJobs.pause``)."""
        value = _keys.paused_value(self._clock.now(), self._node_id)
        await self._control(job, _keys.control_field("paused", job), value)

    async def resume(self, job: str) -> None:
        """Undo ``pause``."""
        await self._control(job, _keys.control_field("paused", job), None)

    async def trigger(self, job: str) -> None:
        """Ask ``job``'s leader for one extra run now (see ``SingletonJobs.trigger``)."""
        await self._control(job, _keys.control_field("trigger", job), "1")

    async def step_down(self, job: str) -> None:
        """Ask ``job``'s leader to hand it over (see ``SingletonJobs.step_down``)."""
        await self._control(job, _keys.control_field("step-down", job), "1")

    async def checkpoint(self, job: str) -> Checkpoint | None:
        """``job``'s checkpoint as stored; None before its first run."""
        require_registered(job, self._jobs)
        async with self._stores() as store:
            return await store.read_checkpoint(job)

    async def history(self, job: str, limit: int = DEFAULT_HISTORY) -> list[Occurrence]:
        """``job``'s last ``limit`` occurrences as stored, newest first (``_history``)."""
        require_registered(job, self._jobs)
        async with self._stores() as store:
            return await store.read_history(job, limit=check_limit(limit))

    async def reset_checkpoint(self, job: str) -> bool:
        """Delete ``job``'s checkpoint (unfenced); True if there was one."""
        require_registered(job, self._jobs)
        async with self._stores() as store:
            return await store.reset_checkpoint(job)

    async def _control(self, job: str, field: str, value: str | None) -> None:
        """Set (None: delete) ``field`` of the controls, for a job registered here or by a
        live node, or named by a stored lock or control."""
        async with self._stores() as store:
            if job not in self._jobs:
                known = (await store.read_cluster()).jobs
                if job not in known:
                    # "here" only where jobs are registered: the CLI registers none.
                    here = "here, " if self._jobs else ""
                    raise JobNotFound(
                        f"no job named {job!r} is registered {here}by a live node or stored in "
                        f"project {self._project!r}; known jobs: "
                        f"{', '.join(sorted({*known, *self._jobs})) or 'none'}",
                        field="job",
                    )
            await store.set_control(field, value)

    def __repr__(self) -> str:
        return f"AdminClient(project={self._project!r}, node_id={self._node_id!r})"
