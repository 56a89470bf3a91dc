"""The health probes: readiness and liveness, as policy over an engine's snapshot.

The policy is pure: it reads the snapshot and the settings. The one thing a probe does besides
(readiness, when the store seems in trouble) is a single explicit call on the source,
``probe_store``, which PINGs the store and brings the election's next round forward.
"""

from __future__ import annotations

from .._engine.snapshot import EngineSnapshot, EngineState
from .._timing import refused_backoff_s
from .models import Health
from .source import StatusSource

__all__ = ["PROBE_WAIT_S", "liveness", "readiness"]

PROBE_WAIT_S = 1.0
"""Longest a readiness probe waits for the store, and then the election, to answer again."""


async def readiness(source: StatusSource, *, strict: bool) -> tuple[Health, str | None]:
    """Whether this node is ready, and why not: ``unavailable`` before startup, while
    draining, or when the election loop is dead. Trouble with the store (not reached within a
    lock expiry) makes it ``unavailable`` when ``strict``, else ``degraded``. Before saying so,
    a PING checks the store now (the election may be waiting out its backoff) and, when it
    answers, wakes the election: readiness returns with the store, not a backoff later.
    Followers are ready too: readiness never depends on leading."""
    snap = source.snapshot()
    if snap is None:
        return "unavailable", "not started"
    reason = _not_serving(snap)
    if reason is not None:
        return "unavailable", reason
    reason = _store_trouble(snap, source.settings.lock_expiry_s)
    if reason is None:
        return "ok", None
    if await source.probe_store(PROBE_WAIT_S):
        return "ok", None
    return ("unavailable" if strict else "degraded"), reason


def _not_serving(snap: EngineSnapshot) -> str | None:
    if snap.state is EngineState.DRAINING:
        return "draining: the node is shutting down and takes no new runs"
    if snap.state is not EngineState.RUNNING:
        return str(snap.state.value)
    if not snap.election_alive:
        return "the election loop is not running"
    return None


def _store_trouble(snap: EngineSnapshot, expiry_s: float) -> str | None:
    store = snap.store
    if store.refused is not None:
        return f"Redis refuses this node, no retry mends it: {store.refused}"
    if store.last_success_s_ago is None:
        return f"the lease store has not answered yet ({store.last_error or 'connecting'})"
    if store.last_success_s_ago > expiry_s:
        return (
            f"the lease store last answered {store.last_success_s_ago:.1f}s ago, more than "
            f"lock_expiry={expiry_s:g}s ({store.last_error or 'no answer'})"
        )
    return None


async def liveness(source: StatusSource) -> tuple[Health, str | None]:
    """``ok``, or ``unavailable`` with the reason a loop of the library is dead or wedged, or
    one of its background tasks died (``EngineSnapshot.failed_tasks``). An unreachable store
    is *not* a liveness failure: restarting would not fix it."""
    reason = _dead(source)
    return ("ok", None) if reason is None else ("unavailable", reason)


def _dead(source: StatusSource) -> str | None:
    snap = source.snapshot()
    if snap is None:
        return "not started"
    if not snap.election_alive:
        return "the election loop has stopped"
    if snap.state is EngineState.RUNNING and not snap.timer_alive:
        return "the timer has stopped"
    if snap.failed_tasks:
        name = min(snap.failed_tasks)
        return f"the background task {name!r} failed: {snap.failed_tasks[name]}"
    settings = source.settings
    # The longest a healthy loop can take between rounds is one call (bounded by the longest
    # lease) and one full backoff (longer while Redis refuses the node); twice that leaves room.
    backoff_s = settings.max_backoff_s
    if snap.store.refused is not None:
        backoff_s = refused_backoff_s(backoff_s)
    wedged_after_s = 2 * (max(snap.longest_lease_s, settings.lock_expiry_s) + backoff_s)
    if snap.last_round_s_ago > wedged_after_s:
        return f"the election loop has not completed a round for {snap.last_round_s_ago:.1f}s"
    specs = source.jobs
    for name, job in snap.jobs.items():
        # A schedule that raised is the user's code failing (a custom schedule): a restart
        # would fail again and disturb the node's other jobs, so only /jobs reports it.
        if job.error is not None and specs[name].kind != "custom":
            return f"the schedule of job {name!r} failed: {job.error!r}"
    return None
