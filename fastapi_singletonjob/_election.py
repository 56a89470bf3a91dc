"""Leader election: one loop per process keeps the leases of all its jobs.

Every heartbeat, one call to the lease store acquires the free locks and renews the held ones
(one round trip for all jobs). A node counts itself leader of a job only until the lease it
last confirmed would run out, measured on the monotonic clock from when the request was *sent*,
less a safety margin; the loop wakes at that deadline to end the term even when the store does
not answer, and every call is bounded by the time left. Losing leadership is a normal state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ._clock import Clock
from ._store import LeaseReply, LeaseRequest, LeaseStore
from ._telemetry import Telemetry

__all__ = ["Elector", "Lease", "lease_deadline", "next_attempt_delay", "node_of"]

logger = logging.getLogger("fastapi_singletonjob.election")

CLOCK_RATE_ERROR = 1e-3
"""Assumed worst relative rate error between this node's clock and Redis's (NTP: <= 5e-4)."""
MARGIN_FRACTION = 0.01
MIN_MARGIN_S = 0.005
OWNER_SEPARATOR = "#"


def node_of(owner: str | None) -> str | None:
    """The node id part of a lock owner ``"<node id>#<instance nonce>"``."""
    if owner is None:
        return None
    node, sep, _ = owner.rpartition(OWNER_SEPARATOR)
    return node if sep else owner


def lease_deadline(sent_at: float, ttl_s: float) -> float:
    """The last monotonic instant at which a node may act on a lease confirmed by a request
    sent at ``sent_at``: the server's expiry can come no earlier than ``sent_at + ttl_s``."""
    margin = max(MIN_MARGIN_S, ttl_s * MARGIN_FRACTION)
    return sent_at + ttl_s * (1 - CLOCK_RATE_ERROR) - margin


def next_attempt_delay(
    *,
    heartbeat_s: float,
    max_backoff_s: float,
    failures: int,
    leading: bool,
    holder_ttl_s: float | None,
    jitter: float,
) -> float:
    """Seconds until the next election round (pure; ``jitter`` is uniform in [0, 1)).

    - Healthy: one heartbeat less up to 10 % at random, or sooner when a lock held by another
      node expires sooner, so that a dead leader is replaced one lock expiry after its last
      renewal.
    - Failing while leading with a valid lease: keep the heartbeat, or the lease is lost.
    - Failing otherwise: exponential backoff from the heartbeat, capped at ``max_backoff_s``,
      with equal jitter (half fixed, half random) so that replicas do not retry in step.
    """
    if failures == 0:
        # Up to 10 % early, at random: replicas started together drift apart instead of
        # renewing in the same instant (one script per node per round). Never late.
        healthy_s = heartbeat_s * (1.0 - 0.1 * jitter)
        if holder_ttl_s is not None:
            return max(0.0, min(healthy_s, holder_ttl_s + 0.001))
        return healthy_s
    if leading:
        return heartbeat_s
    base = min(max_backoff_s, heartbeat_s * 2.0 ** min(failures, 30))
    return base * (0.5 + 0.5 * jitter)


@dataclass(eq=False)
class Lease:
    """This node's view of one job's lock."""

    job: str
    ttl_s: float
    token: int | None = None
    """Fencing token of this node's current term; None while it does not lead."""
    value: str | None = None
    """The lock value this node last held, for a compare-and-delete release."""
    deadline: float = float("-inf")
    """Monotonic instant until which this node may act as leader."""
    holder: str | None = None
    holder_token: int | None = None
    holder_ttl_s: float | None = None
    observed_at: float | None = None
    """Monotonic time of the request that last reported on this lock."""
    terms: int = 0
    wanted: bool = True
    acquire_error: str | None = None
    """Why the last attempt to acquire the free lock failed, if it did."""
    """False once the job has stopped for good: its lease is no longer requested."""
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    """The current term's "leadership lost" signal; a fresh event per term."""
    leading: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while this node holds a term (the deadline may still pass before the loop sees it)."""


class Elector:
    """Runs the election rounds for all leases of one node."""

    def __init__(
        self,
        *,
        store: LeaseStore,
        node_id: str,
        leases: Sequence[Lease],
        heartbeat_s: float,
        max_backoff_s: float,
        clock: Clock,
        rng: Callable[[], float] = random.random,
        telemetry: Telemetry | None = None,
    ) -> None:
        self._store = store
        self.node_id = node_id
        # The identity written into locks: the node id plus a per-instance nonce, so that two
        # processes configured with the same node id can never both believe they hold a lock.
        self.owner = f"{node_id}{OWNER_SEPARATOR}{secrets.token_hex(4)}"
        self._warned_twin = False
        self.leases = {lease.job: lease for lease in leases}
        self._heartbeat_s = heartbeat_s
        self._max_backoff_s = max_backoff_s
        self._clock = clock
        self._rng = rng
        self._wake = asyncio.Event()
        self._telemetry = telemetry or Telemetry(node_id)
        self._notice_at: float | None = None
        self.failures = 0
        self.last_error: str | None = None
        self.last_success_at: float | None = None
        """Monotonic time the last successful round was sent."""
        self.last_round_at: float | None = None
        """Monotonic time the loop last finished a round (alive or not, it came back)."""
        self.round_trip_s: float | None = None

    # -- queries --------------------------------------------------------------------------

    def is_leader(self, job: str, token: int | None = None) -> bool:
        """True while this node's lease of ``job`` (of term ``token``, if given) is valid."""
        lease = self.leases.get(job)
        if lease is None or lease.token is None:
            return False
        if token is not None and lease.token != token:
            return False
        return self._clock.monotonic() < lease.deadline

    def time_left(self, job: str) -> float:
        """Seconds left on this node's lease of ``job`` (0 when it does not lead)."""
        lease = self.leases[job]
        if lease.token is None:
            return 0.0
        return max(0.0, lease.deadline - self._clock.monotonic())

    def holder_time_left(self, job: str) -> float | None:
        """Seconds the current holder's lock of ``job`` has left, as last observed (an
        underestimate), or None when unknown or without expiry."""
        lease = self.leases[job]
        if lease.token is not None:
            return self.time_left(job)
        if lease.holder_ttl_s is None or lease.observed_at is None:
            return None
        return max(0.0, lease.holder_ttl_s - (self._clock.monotonic() - lease.observed_at))

    async def claim(self, job: str, token: int, instant_us: int) -> int | None:
        """Claim ``job``'s instant for this node's term ``token`` (see ``LeaseStore.claim``);
        None when the store did not answer within the time left on the lease."""
        lease = self.leases[job]
        left = lease.deadline - self._clock.monotonic()
        if lease.token != token or lease.value is None or left <= 0:
            return -1
        try:
            return await asyncio.wait_for(
                self._store.claim(job, lease.value, instant_us), min(left, self._heartbeat_s)
            )
        except Exception as exc:
            logger.warning(
                "node %s could not claim an instant of job %r: %r", self.node_id, job, exc
            )
            return None

    def wake(self) -> None:
        """Run a round now (a lock was released somewhere)."""
        self._notice_at = self._clock.monotonic()
        self._wake.set()

    # -- the loop -------------------------------------------------------------------------

    async def run(self, ready: asyncio.Event | None = None) -> None:
        """Run election rounds until cancelled; set ``ready`` once the loop is going."""
        helpers = [
            asyncio.create_task(
                self._listen(), name=f"singletonjob {self.node_id} release listener"
            ),
            asyncio.create_task(
                self._watch_deadlines(), name=f"singletonjob {self.node_id} lease deadlines"
            ),
        ]
        try:
            if ready is not None:
                ready.set()
            while True:
                delay = await self.round()
                await self._pause(delay)
        finally:
            for helper in helpers:
                helper.cancel()
            for helper in helpers:
                with contextlib.suppress(asyncio.CancelledError):
                    await helper

    async def _watch_deadlines(self) -> None:
        # Ends each term at its deadline even while a round is waiting on a slow store, so
        # that runs with on_leadership_lost="cancel" stop on time, whatever the round does.
        while True:
            self._expire()
            now = self._clock.monotonic()
            left = [x.deadline - now for x in self.leases.values() if x.token is not None]
            await self._clock.sleep(min([self._heartbeat_s, *(max(d, 0.0) for d in left)]))

    async def round(self) -> float:
        """One acquire-or-renew round for all leases; returns the delay until the next."""
        self._expire()
        requests = [
            LeaseRequest(lease.job, lease.ttl_s, lease.value if lease.token is not None else None)
            for lease in self.leases.values()
            if lease.wanted
        ]
        sent_at = self._clock.monotonic()
        try:
            if requests:
                replies = await asyncio.wait_for(
                    self._store.elect(self.owner, requests), self._call_timeout(sent_at)
                )
            else:  # no job to elect: still find out whether the store answers
                await asyncio.wait_for(self._store.ping(), self._call_timeout(sent_at))
                replies = []
        except Exception as exc:  # any failure of the store is retried with backoff
            self._telemetry.election_round(self._clock.monotonic() - sent_at, exc)
            self._on_failure(exc)
        else:
            self._telemetry.election_round(self._clock.monotonic() - sent_at, None)
            self._on_success(sent_at, replies)
        finally:
            self.last_round_at = self._clock.monotonic()
        resigned = [x.job for x in self.leases.values() if not x.wanted and x.value is not None]
        if resigned:
            await self.release(resigned)
        self._expire()
        return self._delay()

    def _call_timeout(self, sent_at: float) -> float:
        # An answer is useful only while the leases it grants are: past the deadline of the
        # longest of them it grants nothing. Terms end at their own deadlines meanwhile
        # (_watch_deadlines), so a slow store cannot keep a stale leader going; and a round
        # trip longer than a heartbeat still renews.
        ttl_s = max((lease.ttl_s for lease in self.leases.values()), default=self._heartbeat_s)
        return max(lease_deadline(sent_at, ttl_s) - sent_at, self._heartbeat_s / 10)

    def _on_success(self, sent_at: float, replies: list[LeaseReply]) -> None:
        if self.failures:
            logger.info(
                "node %s reaches the lease store again after %d failed rounds",
                self.node_id,
                self.failures,
            )
        self.failures = 0
        self.last_error = None
        self.last_success_at = sent_at
        self.round_trip_s = self._clock.monotonic() - sent_at
        for reply in replies:
            self._apply(self.leases[reply.job], reply, sent_at)

    def _apply(self, lease: Lease, reply: LeaseReply, sent_at: float) -> None:
        previous = (lease.observed_at, lease.holder_ttl_s)
        lease.holder, lease.holder_token = node_of(reply.holder), reply.token
        lease.observed_at = sent_at
        if reply.error is not None:
            if reply.error != lease.acquire_error:
                logger.warning(
                    "node %s could not acquire job %r: %s", self.node_id, lease.job, reply.error
                )
            lease.acquire_error = reply.error
        else:
            lease.acquire_error = None
        if not reply.held:
            twin = reply.holder != self.owner and lease.holder == self.node_id
            if twin and not self._warned_twin:
                self._warned_twin = True
                logger.warning(
                    "another instance uses node id %r too; give each replica its own node_id "
                    "(the lock still elects only one of them)",
                    self.node_id,
                )
            lease.holder_ttl_s = reply.ttl_s
            if lease.token is not None:
                self._end_term(lease, f"the lock is now held by {lease.holder!r}")
            return
        lease.holder_ttl_s = None
        lease.value = reply.value
        if not lease.wanted:
            return  # resigned while this round was in flight: released right after it
        token = reply.token if reply.token is not None else 0
        if lease.token is not None and lease.token != token:
            self._end_term(lease, f"the lock was re-created with token {token}")
        lease.deadline = lease_deadline(sent_at, lease.ttl_s)
        if lease.token is None and lease.deadline > self._clock.monotonic():
            lease.token = token
            lease.terms += 1
            lease.lost = asyncio.Event()
            lease.leading.set()
            logger.info(
                "node %s became leader of job %r (fencing token %d)", self.node_id, lease.job, token
            )
            self._telemetry.change(lease.job, "acquired")
            gap = self._leaderless(lease, sent_at, *previous)
            if gap is not None:
                self._telemetry.leaderless_for(lease.job, gap)

    def _leaderless(
        self, lease: Lease, acquired_at: float, observed_at: float | None, ttl_s: float | None
    ) -> float | None:
        """Estimate how long the job had no live leader before this node acquired it: since
        the release notice, or since the previous holder's last renewal (its lock's expiry,
        as last observed, less the lease time). None without an earlier observation."""
        if observed_at is None or ttl_s is None:
            return None
        if self._notice_at is not None and observed_at <= self._notice_at <= acquired_at:
            return acquired_at - self._notice_at
        return max(0.0, acquired_at - (observed_at + ttl_s - lease.ttl_s))

    def _on_failure(self, exc: BaseException) -> None:
        self.failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        log = logger.warning if self.failures == 1 else logger.debug
        log(
            "node %s cannot reach the lease store (attempt %d): %s",
            self.node_id,
            self.failures,
            self.last_error,
        )

    def _expire(self) -> None:
        now = self._clock.monotonic()
        for lease in self.leases.values():
            if lease.token is not None and now >= lease.deadline:
                self._end_term(lease, "its lease ran out before it could be renewed")

    def _end_term(self, lease: Lease, why: str | None) -> None:
        """End this node's term of ``lease``: lost (``why`` says how), or released (None)."""
        self._telemetry.change(lease.job, "lost" if why is not None else "released")
        if why is not None:
            logger.warning(
                "node %s lost leadership of job %r (fencing token %s): %s",
                self.node_id,
                lease.job,
                lease.token,
                why,
            )
        lease.token = None
        lease.deadline = float("-inf")
        lease.leading.clear()
        lease.lost.set()

    def _delay(self) -> float:
        leading = any(lease.token is not None for lease in self.leases.values())
        holder_ttls = [
            lease.holder_ttl_s
            for lease in self.leases.values()
            if lease.token is None and lease.holder_ttl_s is not None
        ]
        return next_attempt_delay(
            heartbeat_s=self._heartbeat_s,
            max_backoff_s=self._max_backoff_s,
            failures=self.failures,
            leading=leading,
            holder_ttl_s=min(holder_ttls) if holder_ttls else None,
            jitter=self._rng(),
        )

    async def _pause(self, delay: float) -> None:
        # Wake early for a release notice; terms end at their deadlines in _watch_deadlines.
        if self._wake.is_set():
            self._wake.clear()
            return
        sleeper = asyncio.ensure_future(self._clock.sleep(delay))
        waker = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
            waker.cancel()
            self._wake.clear()

    async def _listen(self) -> None:
        failures = 0
        while True:
            try:
                await self._store.listen_releases(self.wake)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the subscription is an optimisation; polling goes on
                failures += 1
                logger.debug("release listener of node %s failed: %r", self.node_id, exc)
            await self._clock.sleep(
                next_attempt_delay(
                    heartbeat_s=self._heartbeat_s,
                    max_backoff_s=self._max_backoff_s,
                    failures=max(failures, 1),
                    leading=False,
                    holder_ttl_s=None,
                    jitter=self._rng(),
                )
            )

    # -- shutdown -------------------------------------------------------------------------

    async def resign(self, job: str) -> None:
        """Stop competing for ``job`` for good (its schedule ended or its loop died) and hand
        its lock to the other nodes, so that a job nobody runs is not kept locked."""
        self.leases[job].wanted = False
        await self.release([job])

    async def release(self, jobs: Sequence[str] | None = None, timeout_s: float = 2.0) -> int:
        """Release the locks this node holds (of ``jobs``, default all) and notify the others.

        Local leadership ends first, so no run starts on a lock being handed over. Errors are
        logged, not raised: an unreleased lock simply expires.
        """
        values: dict[str, str] = {}
        for lease in self.leases.values():
            if (jobs is None or lease.job in jobs) and lease.value is not None:
                if lease.token is not None:
                    self._end_term(lease, None)
                values[lease.job] = lease.value
        if not values:
            return 0
        try:
            released = await asyncio.wait_for(self._store.release(self.owner, values), timeout_s)
        except Exception as exc:
            logger.warning(
                "node %s could not release its locks (%s); they expire on their own: %r",
                self.node_id,
                ", ".join(values),
                exc,
            )
            return 0
        for job in values:
            self.leases[job].value = None
        logger.info("node %s released leadership of %s", self.node_id, ", ".join(values))
        return released
