"""Terms: this node's leases of all its jobs, and the only code that changes them.

The election (``_election/elector.py``) sends the rounds and hands each reply to ``Terms.apply``; a
term starts when a reply confirms a lock this node wrote and ends at its deadline, when
another holder shows up, or on release. Everything else (the runner, the ticker, the status
snapshot) reads a lease through ``LeaseView``, which has no setters, and reports runs back
through ``run_started``/``instant_started``/``run_ended``; the election asks for everything
else it changes (a release, a step-down, a rest, a resignation) through the methods here. A
``TermListener`` given at construction hears of each term that starts, each trigger and each
checkpoint reset.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Protocol

from .._clock import Clock
from .._lock_value import node_of
from .._odd import odd_value
from .._store.base import LeaseReply
from .._telemetry import Telemetry
from .._timing import WATCH_STEP_S, leaderless_s, lease_deadline
from .lease import Lease, LeaseView

__all__ = ["TermListener", "Terms"]

logger = logging.getLogger("fastapi_singletonjob.election")

_Previous = tuple[float | None, float | None]
"""A lock's (observed_at, holder_ttl_s) before the reply being applied."""


class TermListener(Protocol):
    """Hears of terms as they start, and of the operators' requests to a term (the timer,
    ``_run/ticker.py``, is one)."""

    def term_started(self, job: str) -> None:
        """This node started a term of ``job``."""

    def triggered(self, job: str) -> None:
        """An operator asked this node, the leader of ``job``, for one extra run now."""

    def checkpoint_reset(self, job: str) -> None:
        """An operator reset the checkpoint of ``job``, which this node leads: the copy of it
        kept for the term is stale."""


class Terms:
    """The leases of one node, by job name, and the rules by which its terms start and end."""

    def __init__(
        self,
        leases: Sequence[Lease],
        *,
        node_id: str,
        owner: str,
        clock: Clock,
        telemetry: Telemetry,
        listener: TermListener | None = None,
    ) -> None:
        self.leases = {lease.job: lease for lease in leases}
        self._node_id = node_id
        self._owner = owner
        self._clock = clock
        self._telemetry = telemetry
        self._warned_twin = False
        self._watchdog_polls = False
        self._acquiring = True
        self._listener = listener

    @property
    def acquiring(self) -> bool:
        """False once the node has begun shutting down (``stop_acquiring``): it keeps the
        terms it has (their runs are in flight) and starts none."""
        return self._acquiring

    def stop_acquiring(self) -> None:
        """Shutdown: start no new term from now on."""
        self._acquiring = False

    # -- reads ----------------------------------------------------------------------------

    @property
    def watchdog_polls(self) -> bool:
        """Whether a run in flight may wait on ``leadership_lost``, so that the deadline
        watchdog checks every ``WATCH_STEP_S`` (see ``watchdog_sleep_s``)."""
        return self._watchdog_polls

    def view(self, job: str) -> LeaseView:
        """The read-only view of ``job``'s lease."""
        return self.leases[job]

    def is_leader(self, job: str, token: int | None = None) -> bool:
        """True while this node's lease of ``job`` (of term ``token``, if given) is valid."""
        lease = self.leases.get(job)
        if lease is None or lease.token is None:
            return False
        if token is not None and lease.token != token:
            return False
        if self._clock.monotonic() < lease.deadline:
            return True
        # Seen expired before the watchdog woke (a suspend, a blocked loop): end the term now,
        # so that `leadership_lost` is never behind what `is_leader` says.
        self.expire()
        return False

    def time_left(self, job: str) -> float:
        """Seconds left on this node's lease of ``job`` (0 when it does not lead)."""
        lease = self.leases[job]
        if lease.token is None:
            return 0.0
        return max(0.0, lease.deadline - self._clock.monotonic())

    def holder_time_left(self, job: str) -> float | None:
        """Seconds the current holder's lock of ``job`` has left, as last observed (an
        underestimate), or None when unknown, without expiry, or last seen longer ago than
        it had left (a follower does not ask about every job held elsewhere:
        ``_election.interest``)."""
        lease = self.leases[job]
        if lease.token is not None:
            return self.time_left(job)
        if lease.holder_ttl_s is None or lease.observed_at is None:
            return None
        left = lease.holder_ttl_s - (self._clock.monotonic() - lease.observed_at)
        return left if left > 0 else None

    # -- what the election decides -------------------------------------------------------

    def freed(self, job: str, at: float) -> None:
        """This node released ``job``'s lock by a call sent at ``at``: the lock was free then,
        this node holds no value of it any more, and no longer counts as its holder
        (placement counts each node's jobs)."""
        lease = self.leases[job]
        lease.value = None
        lease.holder = lease.holder_token = lease.holder_ttl_s = None
        lease.observed_at = at

    def resign(self, job: str) -> None:
        """Stop competing for ``job`` for good (its lock is released next)."""
        self.leases[job].wanted = False

    def rest(self, job: str) -> None:
        """Stay out of ``job``'s election for one lock expiry from now (it is being handed
        over: another node, not this one, takes it)."""
        lease = self.leases[job]
        lease.rest_until = self._clock.monotonic() + lease.ttl_s

    def let_go(self, job: str, cause: str) -> None:
        """This node cannot do ``job``'s work (its runs could not start for about a lock
        expiry: ``cause``): hand it over as a step-down does, once no run is in flight, so
        that a healthy node takes it; this node rests out of its election for a lock expiry
        and says why (``let_go``) until it leads the job again. The election itself stays
        up, and so do the other jobs (client-go's healthz watchdog, per job)."""
        lease = self.leases[job]
        if lease.token is None or lease.let_go is not None:
            return
        lease.let_go = cause
        lease.stepping_down = True
        logger.warning(
            "node %s lets job %r go (fencing token %d) for another node to run: %s",
            self._node_id,
            job,
            lease.token,
            cause,
        )
        self._telemetry.change(job, "let_go")

    def step_downs_due(self) -> list[str]:
        """The jobs an operator asked this node to step down from that have no run in
        flight now, with a term to hand over; each request is then done with."""
        jobs = []
        for lease in self.leases.values():
            if lease.stepping_down and not lease.running:
                lease.stepping_down = False
                if lease.token is not None:
                    jobs.append(lease.job)
        return jobs

    # -- what the runner reports ----------------------------------------------------------

    def run_started(self, job: str) -> None:
        """A run of ``job`` is in flight (the deadline watchdog then checks more often)."""
        self.leases[job].running = True

    def instant_started(self, job: str, instant: datetime) -> None:
        """A run for ``instant`` started: recorded on release, so that a successor never runs
        it again."""
        self.leases[job].last_started = instant

    def run_ended(self, job: str) -> None:
        """The run of ``job`` in flight has ended."""
        self.leases[job].running = False

    # -- replies --------------------------------------------------------------------------

    def apply(self, replies: Sequence[LeaseReply], sent_at: float, notice_at: float | None) -> None:
        """Apply the store's replies to a round sent at ``sent_at`` (monotonic), each in
        isolation: one odd reply must never stop the election of the other jobs."""
        for reply in replies:
            lease = self.leases.get(reply.job)
            if lease is None:
                continue
            try:
                self._apply(lease, reply, sent_at, notice_at)
            except Exception:
                logger.exception(
                    "node %s could not apply the store's reply for job %r",
                    self._node_id,
                    reply.job,
                )

    def _apply(
        self, lease: Lease, reply: LeaseReply, sent_at: float, notice_at: float | None
    ) -> None:
        previous = (lease.observed_at, lease.holder_ttl_s)
        # A free lock this node only looked at (placement): the last sight of its holder is
        # kept, for the leaderless estimate of the term that follows.
        looked = not reply.held and reply.value is None and reply.error is None
        lease.holder, lease.holder_token = node_of(reply.holder), reply.token
        if reply.value is not None and reply.token is None:
            odd_value(
                f"the lock of job {lease.job!r}",
                reply.value,
                "foreign: no node takes the job until it is deleted or expires",
            )
        if not looked or lease.observed_at is None:
            lease.observed_at = sent_at
        if reply.error is not None and reply.error != lease.acquire_error:
            logger.warning(
                "node %s could not acquire job %r: %s", self._node_id, lease.job, reply.error
            )
        lease.acquire_error = reply.error
        if reply.paused != lease.paused:
            lease.paused = reply.paused
            logger.info(
                "node %s: job %r is %s",
                self._node_id,
                lease.job,
                "paused: no new run starts" if reply.paused else "resumed",
            )
        if reply.held:
            self._apply_held(lease, reply, sent_at, previous, notice_at)
            self._apply_requests(lease, reply)
            return
        twin = reply.holder != self._owner and lease.holder == self._node_id
        if twin and not self._warned_twin:
            self._warned_twin = True
            logger.warning(
                "another instance uses node id %r too; give each replica its own node_id "
                "(the lock still elects only one of them)",
                self._node_id,
            )
        if not looked:
            lease.holder_ttl_s = reply.ttl_s
        if lease.token is not None:
            self.end(lease, f"the lock is now held by {lease.holder!r}")

    def _apply_held(
        self,
        lease: Lease,
        reply: LeaseReply,
        sent_at: float,
        previous: _Previous,
        notice_at: float | None,
    ) -> None:
        lease.holder_ttl_s = None
        token = reply.token
        if token is None or reply.value is None:
            # A store that says "held" for a value this library did not write is broken or
            # tampered with: never count it as a term (it has no fencing token to give).
            logger.error(
                "node %s: the store reported job %r as held with a foreign lock value; "
                "not leading it",
                self._node_id,
                lease.job,
            )
            if lease.token is not None:
                self.end(lease, "the lock holds a value this library did not write")
            return
        lease.value = reply.value
        if lease.token is None and not self._acquiring:
            lease.wanted = False  # shutting down: never a new term; released after the round
        if not lease.wanted:
            return  # resigned while this round was in flight: released right after it
        if lease.token is None and token == lease.ended_token:
            # The reply to a renewal sent before the term ended (its deadline passed while the
            # reply was on its way): the runs were told leadership was lost, so the term stays
            # ended. Not renewed again, the lock expires and a new term gets a new token.
            return
        if lease.token is not None and lease.token != token:
            self.end(lease, f"the lock was re-created with token {token}")
        lease.deadline = lease_deadline(sent_at, lease.ttl_s)
        if lease.token is None and lease.deadline > self._clock.monotonic():
            self._start(lease, token, sent_at, previous, notice_at)

    def _apply_requests(self, lease: Lease, reply: LeaseReply) -> None:
        """An operator's trigger, step-down or checkpoint reset, consumed by this reply: acted
        on only while this node leads (a trigger or step-down that reaches a node without a
        term is dropped, logged; a reset needs nothing then, as a term reads the checkpoint
        at its first run)."""
        if reply.checkpoint_reset and lease.token is not None and self._listener is not None:
            logger.info(
                "node %s: the checkpoint of job %r was reset; its next run reads it again",
                self._node_id,
                lease.job,
            )
            self._listener.checkpoint_reset(lease.job)
        if not (reply.triggered or reply.step_down):
            return
        if lease.token is None:
            logger.warning(
                "node %s: an operator's %s of job %r came while this node does not lead it; "
                "dropped",
                self._node_id,
                "trigger" if reply.triggered else "step-down",
                lease.job,
            )
            return
        if reply.step_down:
            logger.info(
                "node %s hands job %r over, as an operator asked, once no run is in flight",
                self._node_id,
                lease.job,
            )
            lease.stepping_down = True
        if reply.triggered and self._listener is not None:
            self._listener.triggered(lease.job)

    # -- term boundaries ------------------------------------------------------------------

    def _start(
        self,
        lease: Lease,
        token: int,
        sent_at: float,
        previous: _Previous,
        notice_at: float | None,
    ) -> None:
        lease.token = token
        lease.terms += 1
        lease.let_go = None
        lease.lost_event = None  # a fresh one, when first asked for
        logger.info(
            "node %s became leader of job %r (fencing token %d)", self._node_id, lease.job, token
        )
        self._telemetry.change(lease.job, "acquired")
        gap = leaderless_s(sent_at, *previous, lease_ttl_s=lease.ttl_s, notice_at=notice_at)
        if gap is not None:
            self._telemetry.leaderless_for(lease.job, gap)
        if self._listener is not None:
            self._listener.term_started(lease.job)

    def watchdog_sleep_s(self, idle_s: float) -> float:
        """End the terms whose deadline has passed; return how long the deadline watchdog may
        sleep: until the next deadline, and at most ``WATCH_STEP_S`` while a run in flight may
        wait on its term's ``leadership_lost`` (``watchdog_polls``), else at most ``idle_s``."""
        self.expire()
        now = self._clock.monotonic()
        held = [x for x in self.leases.values() if x.token is not None]
        self._watchdog_polls = any(x.running and x.lost_event is not None for x in held)
        step = WATCH_STEP_S if self._watchdog_polls else idle_s
        return max(min([step, *(x.deadline - now for x in held)]), 0.0)

    def expire(self) -> None:
        """End every term whose deadline has passed."""
        now = self._clock.monotonic()
        for lease in self.leases.values():
            if lease.token is not None and now >= lease.deadline:
                self.end(lease, "its lease ran out before it could be renewed")

    def end(self, lease: Lease, why: str | None) -> None:
        """End this node's term of ``lease``: lost (``why`` says how), or released (None)."""
        self._telemetry.change(lease.job, "lost" if why is not None else "released")
        if why is not None:
            logger.warning(
                "node %s lost leadership of job %r (fencing token %s): %s",
                self._node_id,
                lease.job,
                lease.token,
                why,
            )
        lease.ended_token = lease.token
        lease.token = None
        lease.deadline = float("-inf")
        if lease.lost_event is not None:
            lease.lost_event.set()
