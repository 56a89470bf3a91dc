"""Leader election: one loop per process keeps the leases of all its jobs.

Every heartbeat, one call to the lease store acquires the free locks and renews the held ones
(one round trip for all jobs). A node counts itself leader of a job only until the lease it
last confirmed would run out, measured on the monotonic clock from when the request was *sent*,
less a safety margin; the loop wakes at that deadline to end the term even when the store does
not answer, and every call is bounded by the time left. Losing leadership is a normal state.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from .._aio import Alarm, Supervisor, within
from .._checkpoint import to_unix_us
from .._clock import Clock
from .._lock_value import OWNER_SEPARATOR
from .._store.base import ClaimResult, LeaseReply, LeaseRequest, ReleaseListener, Store
from .._store.membership import Membership
from .._store.refusals import Refusal, refusal
from .._telemetry import Telemetry
from .._timing import call_timeout_s, next_attempt_delay, refused_backoff_s
from .definitions import DefinitionCheck
from .interest import Interest, soonest_end_s
from .lease import Lease, LeaseView
from .placement import Spreader
from .terms import TermListener, Terms

__all__ = ["NOTICE_BURST", "ElectionStatus", "Elector", "NoticeBudget"]

logger = logging.getLogger("fastapi_singletonjob.election")

NOTICE_BURST = 2
"""How many rounds release-channel messages may wake at once after a quiet spell; beyond it,
one per heartbeat (``NoticeBudget``)."""


_CLAIM_ROUND_TRIPS = 3
"""A claim waits at least this many of the election's last round trips (``Elector.claim``)."""


class NoticeBudget:
    """How many extra rounds the release channel may still wake: a token bucket of
    ``NOTICE_BURST`` rounds, refilled one per heartbeat. Whatever arrives on the channel (a
    handover, an operator's control, junk from a client that may only ``PUBLISH``), it costs
    Redis at most one extra round per heartbeat per node over time; the burst lets the few
    notices of one handover go at once (an operator's control, then the holder's release; a
    shutdown's release of its idle jobs, then of a drained run's)."""

    __slots__ = ("_at", "_heartbeat_s", "_tokens")

    _SLACK = 1e-9
    """A token this close to whole counts whole: a wait computed from the budget, slept on a
    fake clock, must never end a hair too early for good."""

    def __init__(self, heartbeat_s: float) -> None:
        self._heartbeat_s = heartbeat_s
        self._tokens = float(NOTICE_BURST)
        self._at = float("-inf")

    def _refill(self, now: float) -> None:
        if now > self._at:
            gained = (now - self._at) / self._heartbeat_s
            self._tokens = min(float(NOTICE_BURST), self._tokens + gained)
            self._at = now

    def take(self, now: float) -> bool:
        """Spend one woken round now, if there is one to spend."""
        self._refill(now)
        if self._tokens >= 1.0 - self._SLACK:
            self._tokens = max(0.0, self._tokens - 1.0)
            return True
        return False

    def wait_s(self, now: float) -> float:
        """Seconds until a woken round may be spent (0: now)."""
        self._refill(now)
        if self._tokens >= 1.0 - self._SLACK:
            return 0.0
        return (1.0 - self._tokens) * self._heartbeat_s


@dataclass(frozen=True, slots=True)
class ElectionStatus:
    """The election's view of the store at one instant (monotonic times)."""

    failures: int
    """Failed rounds in a row (0: the last round reached the store)."""
    last_error: str | None
    refused: Refusal | None
    """The last round's error, when it is one that no retry mends (Redis said no)."""
    last_success_at: float | None
    """When the last successful round was sent."""
    last_round_at: float | None
    """When the loop last finished a round, successful or not."""
    round_trip_s: float | None


class Elector:
    """Runs the election rounds for all leases of one node."""

    def __init__(
        self,
        *,
        store: Store,
        node_id: str,
        leases: Sequence[Lease],
        heartbeat_s: float,
        max_backoff_s: float,
        clock: Clock,
        rng: Callable[[], float] = random.random,
        telemetry: Telemetry | None = None,
        placement: Literal["spread", "first"] = "first",
        settle_s: float | None = None,
        supervisor: Supervisor | None = None,
        listener: TermListener | None = None,
    ) -> None:
        self._store = store
        self._supervisor = supervisor or Supervisor()
        """Starts the loop's helpers (the release listener, the deadline watchdog): one that
        dies is recorded there, not lost."""
        self.node_id = node_id
        # The identity written into locks: the node id plus a per-instance nonce, so that two
        # processes configured with the same node id can never both believe they hold a lock.
        self.owner = f"{node_id}{OWNER_SEPARATOR}{secrets.token_hex(4)}"
        self._telemetry = telemetry or Telemetry(node_id)
        self.terms = Terms(
            leases,
            node_id=node_id,
            owner=self.owner,
            clock=clock,
            telemetry=self._telemetry,
            listener=listener,
        )
        self.leases = self.terms.leases
        # The queries each run asks, answered by the terms themselves (no frame of ours):
        # whether this node's lease of a job (of a term, if given) is valid, and its time
        # left (0 when it does not lead).
        self.is_leader = self.terms.is_leader
        self.time_left = self.terms.time_left
        self._heartbeat_s = heartbeat_s
        ttls = [lease.ttl_s for lease in self.leases.values()] or [heartbeat_s]
        self._shortest_ttl_s, self._longest_ttl_s = min(ttls), max(ttls)
        self._max_backoff_s = max_backoff_s
        self._clock = clock
        self._rng = rng
        self._phase = rng()  # where in each heartbeat this node's rounds fall
        self._wake = Alarm(clock)
        """Rung when a round should come now (``_round_due``), or when a notice waits for
        the budget (``_notice_waits``): the pause between rounds recomputes its end."""
        self._round_due = False
        self._notice_waits = False
        """Notices came that the budget did not let wake a round: the next round, at the
        latest when the budget allows one, asks about what they named."""
        self._notices = NoticeBudget(heartbeat_s)
        self._deadlines_moved = Alarm(clock)
        """Rung when a deadline moved or a run may wait on ``leadership_lost``: the watchdog
        recomputes its sleep."""
        self._notice_at: float | None = None
        self.failures = 0
        self.last_error: str | None = None
        self.refused: Refusal | None = None
        """Redis refused the last round (a password, a database index, an ACL): no retry
        mends it, so the rounds back off longer and the ERROR says what to fix."""
        self.last_success_at: float | None = None
        """Monotonic time the last successful round was sent."""
        self.last_round_at: float | None = None
        """Monotonic time the loop last finished a round (alive or not, it came back)."""
        self.round_trip_s: float | None = None
        self._spreader = Spreader(
            node_id,
            membership=lambda: store.membership,
            settle_s=self._longest_ttl_s if settle_s is None else settle_s,
            heartbeat_s=heartbeat_s,
            clock=clock,
        )
        """The placement order of each job: who leads it with ``placement="spread"``, and
        with either placement who watches it while another node holds it."""
        self._placing = self._spreader if placement == "spread" else None
        """The spreader when it also decides who leads (``placement="spread"``), else None."""
        self.definitions = DefinitionCheck(
            node_id=node_id, owner=self.owner, clock=clock, retry_s=self._longest_ttl_s
        )
        """Whether the other members define this node's jobs alike (two services on one
        project): the records it reads, the differences it logs."""
        self._reading: asyncio.Task[None] | None = None
        """The read of the records ``definitions`` asked for, while it runs."""
        self._interest = Interest(
            list(self.leases),
            spreader=self._spreader,
            heartbeat_s=heartbeat_s,
            shortest_ttl_s=self._shortest_ttl_s,
            clock=clock,
        )

    # -- queries --------------------------------------------------------------------------

    def view(self, job: str) -> LeaseView:
        """The read-only view of ``job``'s lease."""
        return self.terms.view(job)

    def holder_time_left(self, job: str) -> float | None:
        """Seconds the current holder's lock of ``job`` has left, as last observed
        (``Terms.holder_time_left``)."""
        return self.terms.holder_time_left(job)

    def status(self) -> ElectionStatus:
        """The election's view of the store now."""
        return ElectionStatus(
            failures=self.failures,
            last_error=self.last_error,
            refused=self.refused,
            last_success_at=self.last_success_at,
            last_round_at=self.last_round_at,
            round_trip_s=self.round_trip_s,
        )

    async def claim(self, job: str, token: int, instant_us: int) -> ClaimResult | None:
        """Claim ``job``'s instant for this node's term ``token`` (see ``Store.claim``);
        None when the store did not answer within a heartbeat (three of the election's round
        trips if longer: a Redis far away; the time left on the lease if less)."""
        lease = self.leases[job]
        left = lease.deadline - self._clock.monotonic()
        if lease.token != token or lease.value is None or left <= 0:
            return ClaimResult.NOT_HOLDER
        # A heartbeat: the claims that fire together go in one call, which the store answers
        # in milliseconds; a claim whose request or reply was lost is retried then (and
        # recognised as this term's own), not after the whole lease (a lock expiry of
        # instants lost to one lost packet). The store's own bound drops a connection that
        # does not answer in time.
        left = min(left, max(self._heartbeat_s, _CLAIM_ROUND_TRIPS * (self.round_trip_s or 0)))
        try:
            claim = self._store.claim(job, lease.value, instant_us, timeout_s=left)
            return await within(claim, left)
        except Exception as exc:
            logger.warning(
                "node %s could not claim an instant of job %r: %r", self.node_id, job, exc
            )
            return None

    def let_go(self, job: str, cause: str) -> None:
        """``job``'s runs cannot start on this node (``cause``): hand it over, as a
        step-down (``Terms.let_go``), in a round at once once no run is in flight."""
        self.terms.let_go(job, cause)
        if not self.leases[job].running:
            self._round_now()

    def run_started(self, job: str) -> None:
        """A run of ``job`` started (the watchdog: see ``lost_awaited``)."""
        self.terms.run_started(job)
        if self.leases[job].lost_event is not None:
            self.lost_awaited(job)

    def lost_awaited(self, job: str) -> None:
        """A run of ``job`` may wait on its term's ``leadership_lost``: while one is in flight,
        the watchdog checks the deadline every ``WATCH_STEP_S``, so that a suspend cannot
        delay the signal. Runs that never ask for it cost the watchdog no wake-up."""
        if not self.terms.watchdog_polls and self.leases[job].running:
            self._deadlines_moved.ring()

    def instant_started(self, job: str, instant: datetime) -> None:
        """A run of ``job`` for ``instant`` started (``Terms.instant_started``)."""
        self.terms.instant_started(job, instant)

    def run_ended(self, job: str) -> None:
        """A run of ``job`` ended: a handover that waited for it (a step-down, a placement
        move) goes now, in a round at once, not at the next round that falls between runs."""
        self.terms.run_ended(job)
        spread = self._placing
        if self.leases[job].stepping_down or (spread is not None and spread.waits_for(job)):
            self._round_now()

    def retry_now(self) -> None:
        """Run a round now instead of waiting out the backoff (the store answers again)."""
        self._round_now()

    def _round_now(self) -> None:
        self._round_due = True
        self._wake.ring()

    def wake(self, jobs: frozenset[str] | None = None) -> None:
        """A message on the release channel: ``jobs`` were released somewhere or an operator
        named them (None: the notice named no job, or a subscription replaced a failed one).
        The next round asks about them, whatever their seen leases; it comes now if the
        notice budget allows (``NoticeBudget``), else as soon as it does, or at the next
        round due anyway. A notice that names none of this node's jobs changes nothing."""
        if jobs is not None:
            jobs = jobs & self.leases.keys()
            if not jobs:
                return
            self._interest.notice(jobs)
        else:
            self._interest.everything()
        now = self._clock.monotonic()
        if self._notices.take(now):
            self._notice_at = now
            self._round_now()
        else:  # merged: the pause ends when the budget allows a round
            self._notice_waits = True
            self._wake.ring()

    # -- the loop -------------------------------------------------------------------------

    async def run(self, ready: asyncio.Event | None = None) -> None:
        """Run election rounds until cancelled; set ``ready`` once the loop is going. Its two
        helpers, the release listener and the deadline watchdog, run as tasks of the
        supervisor for as long as the loop does."""
        start = self._supervisor.start
        helpers = [
            start(
                listen_for_releases(
                    self._store,
                    self.wake,
                    # Within two lease times a silently dead connection is an error and is
                    # replaced, so handovers stay pushed instead of degrading to polling; not
                    # tighter, or a slow link (a round trip above a heartbeat) would
                    # reconnect in a loop.
                    keepalive_s=self._longest_ttl_s,
                    retry_delay=self._listener_delay,
                    clock=self._clock,
                    node_id=self.node_id,
                ),
                name=f"singletonjob {self.node_id} release listener",
            ),
            start(self._watchdog(), name=f"singletonjob {self.node_id} deadline watchdog"),
        ]
        try:
            if ready is not None:
                ready.set()
            while True:
                delay = await self.round()
                await self._pause(delay)  # or at a notice; terms end at their deadlines
        finally:
            reading = [self._reading] if self._reading is not None else []
            await self._supervisor.cancel(helpers + reading)

    async def _pause(self, delay_s: float) -> None:
        """Wait ``delay_s`` until the next round, or less: until a round is asked for now,
        or until the notice budget allows the round that merged notices wait for."""
        until = self._clock.monotonic() + delay_s
        while not self._round_due:
            now = self._clock.monotonic()
            left_s = until - now
            if self._notice_waits:
                budget_s = self._notices.wait_s(now)
                if budget_s <= 0 and self._notices.take(now):
                    self._notice_at = now
                    break
                left_s = min(left_s, budget_s)
            if left_s <= 0:
                break
            await self._wake.wait(left_s)
        # The round about to go asks about every notice merged so far.
        self._round_due = self._notice_waits = False

    async def _watchdog(self) -> None:
        # Ends each term at its deadline even while a round is waiting on a slow store, so
        # that runs with on_leadership_lost="cancel" stop on time, whatever the round does.
        # Woken whenever a deadline moves: a term that starts from a slow reply has a deadline
        # sooner than the sleep computed before it.
        while True:
            await self._deadlines_moved.wait(self.terms.watchdog_sleep_s(self._heartbeat_s))

    async def round(self) -> float:
        """One acquire-or-renew round for all leases; returns the delay until the next."""
        self.terms.expire()
        now = self._clock.monotonic()
        self._spreader.refresh(self.leases)
        self._interest.begin(self.failures)  # which jobs held elsewhere it asks about
        resting = {job for job, lease in self.leases.items() if self._rests(lease, now)}
        requests = [
            LeaseRequest(
                lease.job,
                lease.ttl_s,
                lease.value if lease.token is not None else None,
                lease.retention_s,
                lease.token is not None
                or (
                    lease.job not in resting
                    and (self._placing is None or self._placing.take(lease))
                ),
            )
            for lease in self.leases.values()
            if lease.wanted
            and (self.terms.acquiring or lease.token is not None)
            and (lease.token is not None or self._competes(lease, now, lease.job in resting))
        ]
        holders = {request.job: self.leases[request.job].holder for request in requests}
        sent_at = self._clock.monotonic()
        timeout_s = call_timeout_s(self._longest_ttl_s, self._heartbeat_s)
        try:
            # A node with a membership record renews it in every round, jobs or not.
            if requests or self._store.membership is not None:
                replies = await within(self._store.elect(self.owner, requests), timeout_s)
            else:  # no job to elect: still find out whether the store answers
                await within(self._store.ping(), timeout_s)
                replies = []
        except Exception as exc:  # any failure of the store is retried with backoff
            self._telemetry.election_round(self._clock.monotonic() - sent_at, exc)
            self._on_failure(exc)
        else:
            self._telemetry.election_round(self._clock.monotonic() - sent_at, None)
            self._on_success(sent_at, replies)
            self._compare_definitions()
        finally:
            self.last_round_at = self._clock.monotonic()
        resigned = [x.job for x in self.leases.values() if not x.wanted and x.value is not None]
        if resigned:
            await self.release(resigned)
        self._spreader.refresh(self.leases)
        departed = self._spreader.take_departed()
        if self._placing is not None:
            self._placing.observed(self.leases, holders, sent_at)
        await self._hand_over()
        if self.failures == 0 and any(
            lease.token is None and lease.wanted and lease.holder in departed
            for lease in self.leases.values()
        ):
            # A holder left the membership (a graceful stop does, before it releases): the
            # next round, now, asks about its jobs, so that a release whose notice is lost is
            # found within a heartbeat of the leave.
            return 0.0
        if self._placing is not None:
            looked_at = {
                request.job: holders[request.job]
                for request in requests
                if not request.take and request.job not in resting
            }
            if self.failures == 0 and self._placing.wants_round(self.leases, looked_at):
                return 0.0  # a free lock this round only looked at is this node's now
        self.terms.expire()
        # Rounds are spaced from send to send: on a link whose round trip is a large part of a
        # heartbeat, a pause counted from the reply would space renewals by the round trip plus
        # a heartbeat, and a lease whose deadline comes before the next reply would lapse.
        return max(0.0, self._delay(sent_at) - (self._clock.monotonic() - sent_at))

    def _rests(self, lease: Lease, now: float) -> bool:
        """Whether this node stays out of ``lease``'s election: for one lock expiry after it
        handed the job over, unless it was a placement move and this node is now preferred."""
        spread = self._placing
        return lease.rest_until > now and not (spread is not None and spread.back_in(lease.job))

    def _competes(self, lease: Lease, now: float, resting: bool) -> bool:
        """Whether a follower asks about ``lease`` in this round: while it rests, only to
        look (never to take), until it sees who took the job over and whenever a notice
        names the job (or the survey comes to it), so that placement counts right the jobs
        of the node that took it and of the next one, should that node hand it on; else as
        ``Interest.asks`` decides."""
        if resting:
            return lease.holder is None or self._interest.refreshes(lease.job)
        return self._interest.asks(lease, now)

    async def _hand_over(self) -> None:
        """Release, between runs, the jobs an operator asked this node to step down from and,
        with ``placement="spread"``, those a less busy node is preferred for: the others take
        each over at the notice, and this node stays out of their election for one lock
        expiry, so that another node, not this one, takes it."""
        jobs = self.terms.step_downs_due()
        if self._placing is not None:
            for job in self._placing.to_hand_over(self.leases):
                preferred = self._placing.placement.preferred(job)
                logger.info("node %s hands job %r over to node %s", self.node_id, job, preferred)
                jobs.append(job)
        for job in jobs:
            self.terms.rest(job)
        if jobs:
            await self.release(jobs)

    def _compare_definitions(self) -> None:
        """Compare this node's job definitions with the other members' (``DefinitionCheck``):
        at once from the records read, or once the records it asks for are read, in a task
        of their own, so that the election round never waits for them."""
        member = self._store.membership
        if member is None or member.left or member.server_ms is None:
            return
        if self._reading is not None and not self._reading.done():
            return
        owners = self.definitions.to_read(member)
        if not owners:
            self.definitions.update(member, self._leader_of)
            return
        self._reading = self._supervisor.start(
            self._read_definitions(member, owners),
            name=f"singletonjob {self.node_id} definitions read",
            forever=False,
        )

    async def _read_definitions(self, member: Membership, owners: list[str]) -> None:
        timeout_s = call_timeout_s(self._longest_ttl_s, self._heartbeat_s)
        try:
            records = await within(self._store.read_members(owners, timeout_s=timeout_s), timeout_s)
        except Exception as exc:  # asked again later: the comparison is no election's business
            logger.debug("node %s could not read the records of %s: %r", self.node_id, owners, exc)
            records = {}
        self.definitions.read(member, owners, records)
        self.definitions.update(member, self._leader_of)

    def _leader_of(self, job: str) -> str | None:
        lease = self.leases.get(job)
        return None if lease is None else lease.holder

    def _on_success(self, sent_at: float, replies: list[LeaseReply]) -> None:
        if self.failures:
            logger.info(
                "node %s reaches the lease store again after %d failed rounds",
                self.node_id,
                self.failures,
            )
        self.failures = 0
        self.last_error = None
        self.refused = None
        self.last_success_at = sent_at
        self.round_trip_s = self._clock.monotonic() - sent_at
        self.terms.apply(replies, sent_at, self._notice_at)
        self._deadlines_moved.ring()

    def _on_failure(self, exc: BaseException) -> None:
        self.failures += 1
        refused, before = refusal(exc), self.refused
        self.refused = refused
        if refused is not None:
            self.last_error = f"{type(exc).__name__}: {refused}"
            if refused != before:
                backoff_s = refused_backoff_s(self._max_backoff_s)
                logger.error(
                    "node %s: Redis refused the election (attempt %d): %s. No retry mends "
                    "this: the node retries every %g-%g s until it is fixed",
                    self.node_id,
                    self.failures,
                    refused,
                    backoff_s / 2,
                    backoff_s,
                )
            return
        self.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        log = logger.warning if self.failures == 1 or before is not None else logger.debug
        log(
            "node %s cannot reach the lease store (attempt %d): %s",
            self.node_id,
            self.failures,
            self.last_error,
        )

    def _delay(self, sent_at: float) -> float:
        leading = any(lease.token is not None for lease in self.leases.values())
        now, rtt = self._clock.monotonic(), self.round_trip_s or 0.0
        return next_attempt_delay(
            heartbeat_s=self._heartbeat_s,
            max_backoff_s=self._max_backoff_s,
            failures=self.failures,
            leading=leading,
            holder_ttl_s=soonest_end_s(
                filter(self._interest.watches, self.leases.values()), now, rtt
            ),
            jitter=self._rng(),
            sent_at=sent_at,
            phase=self._phase,
            refused=self.refused is not None,
        )

    def _listener_delay(self) -> float:
        # A heartbeat, no backoff: a subscription attempt is a connection, cheap for Redis,
        # and its success wakes the election out of its own backoff when Redis is back.
        return self._heartbeat_s * (0.5 + 0.5 * self._rng())

    # -- shutdown -------------------------------------------------------------------------

    def stop_acquiring(self) -> None:
        """Shutdown: from now on no new term, and so no new run; the terms held are kept
        (their runs are in flight) until released."""
        self.terms.stop_acquiring()

    async def resign(self, jobs: Sequence[str]) -> None:
        """Stop competing for ``jobs`` for good (their schedule ended or failed, or this node
        is shutting down) and hand their locks to the other nodes at once."""
        for job in jobs:
            self.terms.resign(job)
        await self.release(jobs)

    async def release(self, jobs: Sequence[str] | None = None, timeout_s: float = 2.0) -> int:
        """Release the locks this node holds (of ``jobs``, default all) and notify the others.

        Local leadership ends first, so no run starts on a lock being handed over. Errors are
        logged, not raised: an unreleased lock simply expires.
        """
        values: dict[str, str] = {}
        last_us: dict[str, int] = {}
        for lease in self.leases.values():
            if (jobs is None or lease.job in jobs) and lease.value is not None:
                if lease.token is not None:
                    self.terms.end(lease, None)
                values[lease.job] = lease.value
                if lease.last_started is not None:
                    last_us[lease.job] = to_unix_us(lease.last_started)
        if not values:
            return 0
        sent_at = self._clock.monotonic()
        try:
            released = await within(self._store.release(self.owner, values, last_us), timeout_s)
        except Exception as exc:
            logger.warning(
                "node %s could not release its locks (%s); they expire on their own: %r",
                self.node_id,
                ", ".join(values),
                exc,
            )
            return 0
        for job in values:
            self.terms.freed(job, sent_at)
        jobs_text = ", ".join(values)
        if released == len(values):
            logger.info("node %s released leadership of %s", self.node_id, jobs_text)
        else:  # a lock that expired or was taken over meanwhile is not deleted
            logger.info(
                "node %s released %d of its locks (%s); the others were no longer its own",
                self.node_id,
                released,
                jobs_text,
            )
        return released


async def listen_for_releases(
    store: Store,
    on_release: ReleaseListener,
    *,
    keepalive_s: float,
    retry_delay: Callable[[], float],
    clock: Clock,
    node_id: str,
) -> None:
    """Keep a release subscription up until cancelled: resubscribe ``retry_delay()`` seconds
    after it failed. The subscription is an optimisation (polling goes on meanwhile), so
    failures are logged at DEBUG only."""
    while True:
        try:
            await store.listen_releases(on_release, keepalive_s=keepalive_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.debug("release listener of node %s failed: %r", node_id, exc)
        await clock.sleep(retry_delay())
