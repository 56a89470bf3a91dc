"""``OverdueWatch``: each node's check of the jobs it watches, against what the cluster
stores, at a coarse cadence; the one node whose check opens a job's overdue spell tells
``on_overdue``.

A node watches the jobs enabled on it, and those registered on it with ``enabled=False`` and
an ``on_overdue`` of their own (an observer: it never leads them). One ``Store.check_overdue``
call per check for all of them (every ``check_s``: the engine checks once per lock expiry,
the time a failover may take anyway, so a spell opens at most that long after its deadline,
and 500 jobs cost one call per 10 s by default): the store says
each job's anchor (its last run as stored), whether it is paused and its spell, and opens or
ends spells by the deadlines this node computed at the previous check from the anchors it
read then (``_overdue.overdue_at``), so every decision is taken on the store's clock against
the data it was computed from. What the watch learns is what ``/jobs``, the metric and the
status show: the spell as stored, the same on every node.

A callback runs as a task of its own, bounded by ``callback_timeout_s``; one that raises or
hangs is logged and forgotten: it never delays a check, the election or a run.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .._aio import within
from .._clock import Clock
from .._job.spec import JobSpec
from .._overdue import Anchor, OverdueCallback, OverdueEvent, default_grace_s, overdue_at
from .._schedule import policy_of
from .._store.base import OverdueCheck, OverdueReply, Store
from .._telemetry import Telemetry

__all__ = ["CALLBACK_TIMEOUT_S", "OverdueWatch", "watches"]

logger = logging.getLogger("fastapi_singletonjob.overdue")

CALLBACK_TIMEOUT_S = 30.0
"""Longest an ``on_overdue`` call may take (then it is given up on, and said so)."""


def watches(spec: JobSpec) -> bool:
    """Whether a node with ``spec`` watches the job: it is enabled there, or it has an
    ``on_overdue`` of its own (an observer); and the cluster stores its starts (its checkpoint,
    or a claim of each instant: an interval or sub-second fixed-rate job with
    ``checkpoint=False`` stores none, so it would look silent however it runs)."""
    stored = spec.checkpoint or policy_of(spec.schedule).claims_every_instant
    return stored and (spec.enabled or spec.on_overdue is not None)


@dataclass(slots=True)
class _Watched:
    """One watched job as this node last checked it."""

    spec: JobSpec
    grace_s: float | None
    callback: OverdueCallback | None
    anchor: str = ""
    deadline: datetime | None = None
    since: datetime | None = None
    """From when this node counts (its first check, or the first after a pause)."""
    overdue_since: datetime | None = None
    last_started_at: datetime | None = None
    judged: tuple[str, datetime] | None = None
    """The anchor and ``since`` the deadline was computed from: ``next_fire`` is asked again
    only when one of them changes (a custom schedule may be slow, or count its calls)."""


class OverdueWatch:
    """The overdue checks of one node (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        specs: Sequence[JobSpec],
        *,
        node_id: str,
        heartbeat_s: float,
        lock_expiry_s: float,
        retention_s: float,
        clock: Clock,
        on_overdue: OverdueCallback | None = None,
        telemetry: Telemetry | None = None,
        check_s: float | None = None,
        callback_timeout_s: float = CALLBACK_TIMEOUT_S,
        stopped: Callable[[str], object] = lambda job: None,
    ) -> None:
        self._store = store
        self._node_id = node_id
        self._clock = clock
        self._retention_s = retention_s
        self._telemetry = telemetry
        self.check_s = heartbeat_s if check_s is None else check_s
        """How often the node checks (one store call each time)."""
        self._callback_timeout_s = callback_timeout_s
        self._stopped = stopped
        """Why a job's schedule stopped on this node (the timer's ``failure``), if it did:
        such a job is not judged here (its schedule cannot be trusted)."""
        self._jobs = {
            spec.name: _Watched(
                spec,
                _grace_s(spec, spec.lock_expiry_s or lock_expiry_s, heartbeat_s),
                spec.on_overdue or on_overdue,
            )
            for spec in specs
            if watches(spec)
        }
        self._calls: set[asyncio.Task[None]] = set()
        self.checks = 0
        """Checks answered so far."""

    @property
    def jobs(self) -> list[str]:
        """The jobs this node watches."""
        return list(self._jobs)

    def overdue(self) -> Mapping[str, datetime | None]:
        """Each watched job's open spell (since when it is overdue), as last checked."""
        return {name: job.overdue_since for name, job in self._jobs.items()}

    async def run(self) -> None:
        """Check every ``check_s`` until cancelled; a failed check is logged and retried at
        the next."""
        if not self._jobs:
            await asyncio.Event().wait()  # nothing to watch: idle until cancelled
        failing = False
        while True:
            try:
                await self.check()
                if failing:
                    logger.info("node %s: the overdue check answers again", self._node_id)
                failing = False
            except Exception as exc:  # whatever the store raises: the next check retries
                if not failing:
                    logger.warning(
                        "node %s: the overdue check failed: %r (retried every %gs)",
                        self._node_id,
                        exc,
                        self.check_s,
                    )
                failing = True
            await self._clock.sleep(self.check_s)

    async def check(self) -> OverdueReply:
        """One check of every watched job (one store call)."""
        checks = [
            OverdueCheck(name, job.anchor, job.deadline, job.callback is not None)
            for name, job in self._jobs.items()
        ]
        timeout_s = max(self.check_s, 1.0)
        reply = await within(
            self._store.check_overdue(checks, retention_s=self._retention_s, timeout_s=timeout_s),
            timeout_s,
        )
        self.checks += 1
        for job, state in zip(self._jobs.values(), reply.jobs, strict=True):
            if state.paused or job.since is None:
                job.since = reply.now  # a pause, or the first look, starts the count afresh
            job.anchor = state.anchor.text
            job.last_started_at = state.anchor.base(after_run=False)
            job.deadline = None if state.paused else self._deadline(job, state.anchor)
            was = job.overdue_since
            job.overdue_since = None if state.spell is None else state.spell[0]
            if was is not None and job.overdue_since is None:
                logger.info("job %r is no longer overdue", job.spec.name)
            if state.opened and job.overdue_since is not None:
                self._opened(job)
            if state.tell and job.overdue_since is not None:
                self._tell(job)
        return reply

    def _deadline(self, job: _Watched, anchor: Anchor) -> datetime | None:
        assert job.since is not None
        if self._stopped(job.spec.name) is not None:
            return None
        judged = (anchor.text, job.since)
        if job.judged == judged:
            return job.deadline
        job.judged = judged
        try:
            return overdue_at(job.spec.schedule, anchor, since=job.since, grace_s=job.grace_s)
        except Exception as exc:  # a custom schedule that raises: its timer says so too
            logger.debug("job %r: no overdue deadline: %r", job.spec.name, exc)
            return None

    def _opened(self, job: _Watched) -> None:
        """This node's check opened ``job``'s spell: say so, count it."""
        assert job.overdue_since is not None
        name = job.spec.name
        logger.warning(
            "job %r is overdue since %s: no run started in its period plus %s (last start "
            "known: %s)",
            name,
            job.overdue_since.isoformat(),
            "its grace" if job.grace_s is None else f"{job.grace_s:g}s",
            "none" if job.last_started_at is None else job.last_started_at.isoformat(),
        )
        if self._telemetry is not None:
            self._telemetry.overdue_spell(name)

    def _tell(self, job: _Watched) -> None:
        """This node's check took the telling of ``job``'s spell: call its ``on_overdue``."""
        assert job.overdue_since is not None and job.callback is not None
        name = job.spec.name
        event = OverdueEvent(name, job.overdue_since, job.last_started_at, self._node_id)
        task = asyncio.create_task(
            self._call(job.callback, event), name=f"singletonjob on_overdue {name!r}"
        )
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _call(self, callback: OverdueCallback, event: OverdueEvent) -> None:
        """Call ``callback`` (a coroutine function on the loop, a function in a thread),
        bounded; whatever it raises is logged, never passed on."""
        try:
            await within(_invoke(callback, event), self._callback_timeout_s)
        except TimeoutError:
            logger.error(
                "job %r: on_overdue did not return within %gs; given up on",
                event.job,
                self._callback_timeout_s,
            )
        except Exception:
            logger.exception("job %r: on_overdue raised", event.job)

    async def aclose(self) -> None:
        """Cancel the callbacks still running (at shutdown)."""
        for task in list(self._calls):
            task.cancel()
        if self._calls:
            await asyncio.wait(self._calls, timeout=1.0)


async def _invoke(callback: Callable[[OverdueEvent], Any], event: OverdueEvent) -> None:
    if inspect.iscoroutinefunction(callback) or inspect.iscoroutinefunction(
        getattr(callback, "__call__", None)  # noqa: B004 - callable objects
    ):
        await callback(event)
        return
    result = await asyncio.to_thread(callback, event)
    if inspect.isawaitable(result):
        await result


def _grace_s(spec: JobSpec, lock_expiry_s: float, heartbeat_s: float) -> float | None:
    """The job's grace: its ``overdue_grace``, else a failover's length for fixed-rate and
    interval jobs, its ``misfire_grace`` for cron and custom ones (None: until the instant
    after)."""
    if spec.overdue_grace_s is not None:
        return spec.overdue_grace_s
    if spec.kind in ("fixed_rate", "interval"):
        return default_grace_s(lock_expiry_s, heartbeat_s)
    return spec.misfire_grace_s
