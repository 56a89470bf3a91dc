"""What the web layer reads and calls, as Protocols: a ``SingletonJobs`` satisfies them
structurally (``AdminActions``) or through its ``StatusView`` (``StatusSource``), so nothing
in ``_web`` imports it (or the engine), and a test can serve the routers from a double.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from .._checkpoint import Checkpoint
from .._config.settings import Settings
from .._engine.snapshot import EngineSnapshot
from .._history import Occurrence
from .._job.spec import JobSpec
from .models import ClusterStatus

__all__ = ["AdminActions", "StatusSource"]


class StatusSource(Protocol):
    """What the status router, its views and the health probes need of a set of jobs."""

    @property
    def store_description(self) -> str:
        """Where the leases are kept, without credentials."""
        ...

    @property
    def settings(self) -> Settings:
        """The settings (read at each request: startup may give a forked worker a new node
        id): the project, the node id, and for the probes the lock expiry and the backoff."""
        ...

    @property
    def jobs(self) -> Mapping[str, JobSpec]:
        """The registered jobs by name, in registration order."""
        ...

    def snapshot(self) -> EngineSnapshot | None:
        """A consistent picture of the running engine; None before startup and after
        shutdown."""
        ...

    async def checkpoint(self, job: str) -> Checkpoint | None:
        """``job``'s checkpoint as stored; None before its first run."""
        ...

    async def cluster_status(self) -> ClusterStatus:
        """Every live node and every job of the project, as stored."""
        ...

    async def history(self, job: str, limit: int) -> list[Occurrence]:
        """``job``'s last ``limit`` occurrences as stored, newest first."""
        ...

    async def probe_store(self, within_s: float) -> bool:
        """Whether the store answers now and, woken by that, the election completes a round,
        each within ``within_s``: the readiness probe's one call with side effects (a PING,
        and an election round brought forward). False before startup."""
        ...


class AdminActions(Protocol):
    """What the admin router calls: the operators' controls, by job name. Each raises
    ``JobNotFound`` for a job nobody registered, and one of ``STORE_ERRORS`` when the store
    does not answer."""

    async def pause(self, job: str) -> None:
        """Pause ``job`` cluster-wide."""
        ...

    async def resume(self, job: str) -> None:
        """Undo ``pause``."""
        ...

    async def trigger(self, job: str) -> None:
        """Ask ``job``'s leader for one extra run now."""
        ...

    async def step_down(self, job: str) -> None:
        """Ask ``job``'s leader to hand it over."""
        ...
