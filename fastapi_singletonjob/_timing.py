"""Election timing as pure functions of their inputs: how long a confirmed lease may be acted
on, and when to try the next round. No clock reads, no I/O: tested from tables."""

from __future__ import annotations

__all__ = [
    "CLOCK_RATE_ERROR",
    "MARGIN_FRACTION",
    "MIN_MARGIN_S",
    "REFUSED_BACKOFF_FACTOR",
    "WATCH_STEP_S",
    "lease_deadline",
    "leaderless_s",
    "next_attempt_delay",
    "refused_backoff_s",
    "until_beat_s",
]

CLOCK_RATE_ERROR = 1e-3
"""Assumed worst relative rate error between this node's clock and Redis's (NTP: <= 5e-4)."""
MARGIN_FRACTION = 0.01
MIN_MARGIN_S = 0.005
REFUSED_BACKOFF_FACTOR = 2.0
"""How many ``max_backoff`` a node that Redis refuses waits at most between rounds."""
WATCH_STEP_S = 0.1
"""Longest sleep of the deadline watchdog while a run of a job this node leads is in flight
(``Lease.running``) and its term's ``leadership_lost`` was asked for (by the run, or by the
``on_leadership_lost="cancel"`` policy): the run may wait on it. Lease deadlines are on
CLOCK_BOOTTIME, which counts a system suspend, but asyncio's timers run on CLOCK_MONOTONIC,
which does not: after a resume the watchdog notices a deadline that passed during the
suspend within this step, not a whole timer later."""


def lease_deadline(sent_at: float, ttl_s: float) -> float:
    """The last monotonic instant at which a node may act on a lease confirmed by a request
    sent at ``sent_at``: the server's expiry can come no earlier than ``sent_at + ttl_s``."""
    margin = max(MIN_MARGIN_S, ttl_s * MARGIN_FRACTION)
    return sent_at + ttl_s * (1 - CLOCK_RATE_ERROR) - margin


def call_timeout_s(longest_ttl_s: float, heartbeat_s: float) -> float:
    """How long an election call may take. An answer is useful only while the leases it
    grants are: past the deadline of the longest of them it grants nothing. Terms end at
    their own deadlines meanwhile, so a slow store cannot keep a stale leader going; and a
    round trip longer than a heartbeat still renews."""
    return max(lease_deadline(0.0, longest_ttl_s), heartbeat_s / 10)


def until_beat_s(sent_at: float, heartbeat_s: float, phase: float) -> float:
    """Seconds from a round sent at ``sent_at`` to the node's next beat: the point of its
    own grid (``phase`` of a heartbeat, ``phase`` in [0, 1), plus whole heartbeats) that comes
    within a heartbeat of the send (at least a hundredth of a heartbeat after it).

    Each node keeps its own grid, whatever extra rounds it runs (after a release notice, at a
    lease's end): replicas that start together, or that a notice woke together, do not go on
    renewing together, so Redis sees their scripts spread over the heartbeat, not in bursts.
    A renewal is never more than a heartbeat after the previous one."""
    offset = (sent_at / heartbeat_s - phase) % 1.0
    return heartbeat_s * max(1.0 - offset, 0.01)


def next_attempt_delay(
    *,
    heartbeat_s: float,
    max_backoff_s: float,
    failures: int,
    jitter: float,
    leading: bool = False,
    holder_ttl_s: float | None = None,
    sent_at: float = 0.0,
    phase: float = 0.0,
    refused: bool = False,
) -> float:
    """Seconds until the next election round (pure; ``jitter`` is uniform in [0, 1)).

    - Healthy: at the node's next beat after the round sent at ``sent_at`` (``until_beat_s``
      with ``phase``: at most a heartbeat), or sooner
      when a lock held by another node expires sooner, so that a dead leader is replaced one
      lock expiry after its last renewal.
    - Failing while leading with a valid lease: keep the heartbeat, or the lease is lost.
    - Failing otherwise: exponential backoff from the heartbeat, capped at ``max_backoff_s``,
      with equal jitter (half fixed, half random) so that replicas do not retry in step.
    - Refused (``refused``: Redis said no to a password, a database index, an ACL), not
      leading: ``refused_backoff_s``, with the same jitter; no retry mends that, and the
      release listener, which tries every heartbeat, wakes the election once it is fixed.
    """
    if failures == 0:
        healthy_s = until_beat_s(sent_at, heartbeat_s, phase)
        if holder_ttl_s is not None:
            return max(0.0, min(healthy_s, holder_ttl_s + 0.001))
        return healthy_s
    if leading:
        return heartbeat_s
    if refused:
        return refused_backoff_s(max_backoff_s) * (0.5 + 0.5 * jitter)
    base = min(max_backoff_s, heartbeat_s * 2.0 ** min(failures, 30))
    return base * (0.5 + 0.5 * jitter)


def refused_backoff_s(max_backoff_s: float) -> float:
    """The longest pause between the election rounds of a node that Redis refuses: twice
    ``max_backoff`` (60 s by default)."""
    return REFUSED_BACKOFF_FACTOR * max_backoff_s


def leaderless_s(
    acquired_at: float,
    observed_at: float | None,
    holder_ttl_s: float | None,
    *,
    lease_ttl_s: float,
    notice_at: float | None,
) -> float | None:
    """Estimate how long a job had no live leader before this node acquired it at
    ``acquired_at``: since the release notice (``notice_at``), or since the previous holder's
    last renewal (its lock's expiry as last observed, less the lease time). None without an
    earlier observation."""
    if observed_at is None or holder_ttl_s is None:
        return None
    if notice_at is not None and observed_at <= notice_at <= acquired_at:
        return acquired_at - notice_at
    return max(0.0, acquired_at - (observed_at + holder_ttl_s - lease_ttl_s))
