"""What a follower asks about in an election round: so that Redis does not pay for followers.

A node asks about the jobs it leads in every round. About a job whose lock is free, or whose
holder is unknown, it asks in every round too: it competes for it. A job held by another node
is *watched* by one node only, the first of the job's placement order that is not the holder
(``Placement.watcher``: the preferred node, or the next one when the preferred node leads).
The watcher asks when the holder's lease, as last seen, may end before its next round, and
about all its watched jobs every half lock expiry (a lock lost in Redis under a stopped
holder is found within that), so that it takes the job over one lock expiry after the
holder's last renewal. The other nodes ask about it only:

- after a release notice that names it (a handover, a step-down, an operator's control);
- in a round that asks about everything: the first, one after a failed round, one after a
  notice that names no job (a subscription that replaced a failed one);
- in the *survey*, a few jobs per round in turn, so that each node sees each job at least
  once per half lock expiry times the number of members: its status shows holders at most
  that old, and Redis's cost of it does not grow with the number of replicas.

A job whose holder is not a live member (a node that left the membership, one whose membership
expired, a value not of this library's) is asked about by every node in every round until it
sees a live holder: after a crash, every node learns who took the dead node's jobs over, and a
graceful stop (which leaves the membership before it releases) is found within a heartbeat even
when its release notice is lost. A step-down or a placement move leaves its node a member: when
its notice is lost, the watcher finds the free lock at its next check, within half a lock
expiry plus a heartbeat. When the holder and its watcher die together, the
job waits for the watcher's membership to expire (one lock expiry), then the next node in the
order watches it. Without a membership (a store that keeps none, or before the first round
read it) a node watches every job.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from .._clock import Clock
from .lease import Lease
from .placement import Spreader

__all__ = ["Interest", "asks_about", "soonest_end_s"]


def soonest_end_s(leases: Iterable[Lease], now: float, round_trip_s: float) -> float | None:
    """Seconds until the soonest end of a lease held by another node that this node competes
    for, each as its latest reply showed it less the time since (the round trip aside: a
    lease seen in the round just ended counts whole), or None."""
    left = [
        lease.holder_ttl_s - max(0.0, now - lease.observed_at - round_trip_s)
        for lease in leases
        if lease.token is None
        and lease.wanted
        and lease.rest_until <= now
        and lease.holder is not None
        and lease.holder_ttl_s is not None
        and lease.observed_at is not None
    ]
    return min(left) if left else None


def asks_about(
    holder: str | None,
    observed_at: float | None,
    holder_ttl_s: float | None,
    now: float,
    heartbeat_s: float,
) -> bool:
    """Whether a follower asks about a job in this round: when its lock is free or unknown,
    or when the holder's lease, as last seen (``holder_ttl_s`` left at ``observed_at``), may
    end before the next round. A lock held elsewhere with time to spare is left out: its
    holder renews it, a release is pushed (the round after a notice asks about every job),
    and the next round, within a heartbeat, asks early enough to wake at its end. So
    followers do not make Redis look at every job every heartbeat."""
    if holder is None or observed_at is None or holder_ttl_s is None:
        return True
    return observed_at + holder_ttl_s <= now + 1.1 * heartbeat_s


class Interest:
    """One node's choice, round by round, of the jobs held elsewhere that it asks about."""

    def __init__(
        self,
        jobs: Sequence[str],
        *,
        spreader: Spreader | None,
        heartbeat_s: float,
        shortest_ttl_s: float,
        clock: Clock,
    ) -> None:
        self._jobs = list(jobs)
        self._spreader = spreader
        self._heartbeat_s = heartbeat_s
        self._check_every_s = shortest_ttl_s / 2
        self._clock = clock
        self._everything = True
        """Ask about every job in the next round (the first, and after a blind notice)."""
        self._noticed: set[str] = set()
        """Jobs named by notices since the last round."""
        self._check_at = float("-inf")
        """When the watcher next asks about all its watched jobs."""
        self._surveyed_at: float | None = None
        self._cursor = 0
        # What the current round asks about besides what it always asks about.
        self._all = False
        self._checking = False
        self._this_round: set[str] = set()

    def everything(self) -> None:
        """Ask about every job in the next round (a notice that names no job)."""
        self._everything = True

    def notice(self, jobs: Iterable[str]) -> None:
        """Ask about ``jobs`` in the next round, whatever their seen leases."""
        self._noticed.update(jobs)

    def begin(self, failures: int) -> None:
        """Decide what the round about to be sent asks about besides the usual."""
        now = self._clock.monotonic()
        self._all = self._everything or failures > 0
        self._everything = False
        self._checking = self._all or now >= self._check_at
        if self._checking:
            self._check_at = now + self._check_every_s
        self._this_round, self._noticed = self._noticed, set()
        self._this_round.update(self._survey(now))

    def asks(self, lease: Lease, now: float) -> bool:
        """Whether the round asks about ``lease``, which this node does not lead."""
        if self.refreshes(lease.job):
            return True
        if self._spreader is not None and self._spreader.gone(lease.holder):
            return True  # its holder left: a release without a notice is found at once
        if not self.watches(lease):
            return False
        return self._checking or asks_about(
            lease.holder, lease.observed_at, lease.holder_ttl_s, now, self._heartbeat_s
        )

    def refreshes(self, job: str) -> bool:
        """Whether the round asks about ``job`` whatever this node knows of its lease: a
        notice named it, the survey came to it, or the round asks about everything."""
        return self._all or job in self._this_round

    def watches(self, lease: Lease) -> bool:
        """Whether this node watches ``lease``'s lock (see the module's text)."""
        return self._spreader is None or self._spreader.watches(lease.job, lease.holder)

    def _survey(self, now: float) -> list[str]:
        """The next jobs in turn: enough that each comes once per half lock expiry times
        the number of members."""
        if self._surveyed_at is None or not self._jobs:
            self._surveyed_at = now
            return []
        members = self._spreader.placement.members if self._spreader is not None else 1
        period_s = self._check_every_s * members
        count = math.floor(len(self._jobs) * (now - self._surveyed_at) / period_s)
        if count <= 0:
            return []
        if count >= len(self._jobs):
            self._surveyed_at, count = now, len(self._jobs)
        else:  # the rest of the time counts towards the next round's share
            self._surveyed_at += count * period_s / len(self._jobs)
        start, self._cursor = self._cursor, (self._cursor + count) % len(self._jobs)
        return [self._jobs[(start + i) % len(self._jobs)] for i in range(count)]
