"""Placement: which live node should lead each job, so that leadership spreads evenly over
the replicas (``placement="spread"``) and a join or a leave moves few jobs besides its own.

Every node computes the same answer from the same membership: the jobs are shared out over the
nodes that run them (``share_out``), each node the same number give or take one, each job to a
node high in its rendezvous ranking (highest ``hash(job, node)`` first), so that a join or a
leave changes the preferred node of its own share and of a few jobs more (the shares of all
nodes change with it). A node that has just joined is not counted until it has kept its
membership for ``settle_s`` (about one lock expiry), so that a pod in a crash loop does not
pull jobs back and forth; when no node has settled yet (a cold start), every live node counts.

The election uses the answer two ways. A node takes a free lock at once only for a job it is
preferred for (or one no live node prefers); for the others it leaves the preferred node a
heartbeat from when it first found the lock free (unless that node let the lock go itself),
so a pushed release goes to the right node and replicas started together take their own jobs.
And while the nodes lead two jobs apart or more, a node hands a job between runs to the node
it is preferred for when that node leads fewer jobs and one of the two is off its share (this
node above, or that node below), at most ``moves_per_round`` (or half its excess over its fair
share) per round: every move takes a job to its place, so the moves end, with the leads within
one job of each other, and a balanced cluster does not move at all (``Placement.to_hand_over``).
Hashing alone (each job to the first node of its ranking) is not even: 12 jobs on 3 nodes came
out 5/6/1 for about one id triple in six, and a hand-over only to that node, when it led two
jobs fewer, left them so for good (issue 26, item 3).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._lock_value import node_of
from .._store.membership import same_jobs
from .lease import Lease

if TYPE_CHECKING:
    from .._clock import Clock
    from .._store.membership import Membership

__all__ = [
    "Candidate",
    "Placement",
    "Spreader",
    "rank",
    "share_out",
]

DEFAULT_MOVES_PER_ROUND = 2


@dataclass(frozen=True, slots=True)
class Candidate:
    """A live node as placement sees it."""

    node_id: str
    jobs: frozenset[str]
    """The jobs it registered and runs (enabled)."""
    settled: bool
    """Whether it has kept its membership long enough to be preferred."""


def _weight(job: str, node_id: str) -> int:
    digest = hashlib.blake2b(f"{job}\0{node_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank(job: str, node_ids: Iterable[str]) -> list[str]:
    """``node_ids`` in ``job``'s order of preference (rendezvous hashing; ties, which need
    equal 64-bit hashes, by id)."""
    return sorted(node_ids, key=lambda node: (-_weight(job, node), node))


def share_out(jobs: Iterable[str], runners: Mapping[str, frozenset[str]]) -> dict[str, str]:
    """Which node leads each of ``jobs`` that a node of ``runners`` (node id -> the jobs it
    runs) runs: each node as many as the others, give or take one, each job on a node high in
    its rendezvous ranking.

    The (job, node) pairs, highest ``hash(job, node)`` first, give each job to the first node
    of its pairs that still has room: ``len(jobs) // len(nodes)`` jobs each, one more for the
    first ``len(jobs) % len(nodes)`` nodes to reach that. A node that joins or leaves
    changes the room of every node, so a few jobs besides its share change hands in the
    answer too (on average about 1 with 12 jobs and 4 with 200, from 3 nodes to 4); the
    election moves none of them while the leads are balanced (``Placement.to_hand_over``).
    When the nodes run different jobs, a job whose every runner is full goes to the first
    of its ranking."""
    todo = sorted({job for job in jobs if any(job in run for run in runners.values())})
    nodes = [node for node, run in runners.items() if any(job in run for job in todo)]
    if not todo:
        return {}
    floor, extra = divmod(len(todo), len(nodes))
    pairs = sorted(
        (-_weight(job, node), node, job) for node in nodes for job in todo if job in runners[node]
    )
    leaders: dict[str, str] = {}
    counts: Counter[str] = Counter()
    for _, node, job in pairs:
        if job in leaders:
            continue
        if counts[node] == floor and extra > 0:
            extra -= 1  # one of the nodes that lead one more
        elif counts[node] >= floor:
            continue
        leaders[job] = node
        counts[node] += 1
    for job in todo:
        if job not in leaders:  # only with job sets that differ
            leaders[job] = rank(job, (node for node in nodes if job in runners[node]))[0]
    return leaders


class Placement:
    """One node's view of who should lead what, rebuilt from each membership it reads."""

    __slots__ = ("_counted", "_fair", "_live", "_moves", "_node_id", "_order", "_shares")

    def __init__(self, node_id: str, *, moves_per_round: int = DEFAULT_MOVES_PER_ROUND) -> None:
        if moves_per_round < 1:
            raise ValueError(f"moves_per_round={moves_per_round!r} must be at least 1")
        self._node_id = node_id
        self._moves = moves_per_round
        self._order: dict[str, tuple[str, ...]] = {}
        """Job -> its first two nodes: the node ``share_out`` gives it to, then the others that
        may lead it in rank order (the settled ones first)."""
        self._shares: dict[str, int] = {}
        """Node id -> how many jobs ``share_out`` gives it, for each node the jobs are shared
        out over: those that run one of them and have settled (all, when none has)."""
        self._counted = False
        """Whether this node is one of those."""
        self._fair = 0
        """This node's fair share: its share when counted, else its jobs over the nodes
        that may lead them, rounded up."""
        self._live: frozenset[str] = frozenset()
        """The live nodes of the last update."""

    def update(self, candidates: Iterable[Candidate], jobs: Iterable[str]) -> None:
        """Recompute the preferred node of each of ``jobs`` (this node's) from the live
        ``candidates`` (this node among them, or not yet)."""
        live = list(candidates)
        settled = [candidate for candidate in live if candidate.settled] or live
        later = [candidate for candidate in live if candidate not in settled]
        jobs = list(jobs)
        leaders = share_out(jobs, {candidate.node_id: candidate.jobs for candidate in settled})
        self._order = {}
        for job in jobs:
            order = [leaders[job]] if job in leaders else []
            order += [
                node
                for node in rank(job, (c.node_id for c in settled if job in c.jobs))[:2]
                if node not in order
            ]
            if len(order) < 2:  # only unsettled nodes run it: any live one will do
                order += rank(job, (c.node_id for c in later if job in c.jobs))[: 2 - len(order)]
            if order:
                self._order[job] = tuple(order[:2])
        self._shares = {c.node_id: 0 for c in settled if any(job in c.jobs for job in jobs)}
        self._shares.update(Counter(leaders.values()))
        self._counted = self._node_id in self._shares
        self._fair = (
            self._shares[self._node_id]
            if self._counted
            else -(-len(self._order) // max(1, len(settled)))
        )
        self._live = frozenset(candidate.node_id for candidate in live)

    @property
    def live(self) -> frozenset[str]:
        """The live nodes of the last update."""
        return self._live

    @property
    def members(self) -> int:
        """How many live nodes the last update counted (at least 1)."""
        return max(1, len(self._live))

    def preferred(self, job: str) -> str | None:
        """The node that should lead ``job``; None when no membership names it."""
        order = self._order.get(job)
        return order[0] if order else None

    def watcher(self, job: str, holder: str) -> str | None:
        """The node that watches ``job``'s lock while ``holder`` holds it: the first node of
        the job's order that is not the holder (the preferred node, or the next when the
        preferred node leads); None when the membership names no other node for it, or not
        the holder (a node gone, or not of this library): then every node watches it."""
        if holder not in self._live:
            return None
        for node in self._order.get(job, ()):
            if node != holder:
                return node
        return None

    def may_take(self, job: str, seen_free_before: bool) -> bool:
        """Whether this node asks for ``job``'s free lock in this round: at once when it is the
        preferred node (or none is known), else only once the lock was already free in its
        previous round (the preferred node had its chance)."""
        preferred = self.preferred(job)
        return preferred is None or preferred == self._node_id or seen_free_before

    def to_hand_over(
        self, led: Iterable[str], idle: Mapping[str, bool], counts: Mapping[str, int]
    ) -> list[str]:
        """The jobs this node should hand over now, each to its preferred node, among those
        it leads that have no run in flight (``idle[job]``); ``counts``: jobs led per node
        id, as this node last saw them. Nothing moves while the nodes the jobs are shared
        out over lead within one job of each other. Else a job goes when its preferred node
        leads fewer jobs than this one and either this node leads more than its share or
        that node less than its own; at most ``moves_per_round`` or half its excess over its
        fair share per round (a node that took every job on a cold start spreads them in a
        few rounds). The jobs of the node furthest below its share go first, then by name.

        So every move takes a job to the node it is shared out to, from a node that leads
        more than that one: the gap between the most and the fewest jobs led never grows,
        there are no moves back and forth while the membership stays the same, and the
        moves end. They end balanced: while two nodes differ by two jobs, a node above its
        share leads a job preferred by a node that leads fewer, or a node below its share is
        preferred for a job led by one that leads more. And what is balanced stays in
        place: one job on three nodes never moves. A node that has not settled has no share
        (it is not counted): it hands a job over only to a node that leads two fewer, so
        that the cold start of a few nodes that settle a heartbeat apart does not send jobs
        to the first one settled and back."""
        counts = dict(counts)
        led = list(led)
        most = max(self._moves, (len(led) - self._fair) // 2)
        queues: dict[str, list[str]] = {}
        for job in sorted(led):
            target = self.preferred(job)
            if target is not None and target != self._node_id and idle.get(job, False):
                queues.setdefault(target, []).append(job)
        moving: list[str] = []
        while len(moving) < most and not self._balanced(counts):
            mine = counts.get(self._node_id, 0)
            targets = [
                target
                for target, jobs in queues.items()
                if jobs and self._may_move(mine, counts.get(target, 0), target)
            ]
            if not targets:
                break
            target = min(targets, key=lambda node: (self._below(node, counts), node))
            moving.append(queues[target].pop(0))
            counts[self._node_id] = mine - 1
            counts[target] = counts.get(target, 0) + 1
        return moving

    def _balanced(self, counts: Mapping[str, int]) -> bool:
        """Whether the nodes the jobs are shared out over lead within one job of each other
        (as ``counts`` has it); never for a node that is not one of them."""
        if not self._counted:
            return False
        led = [counts.get(node, 0) for node in self._shares]
        return max(led) - min(led) <= 1

    def _below(self, node: str, counts: Mapping[str, int]) -> tuple[int, int]:
        """How far ``node`` leads below its share, and how few it leads: who gets a job
        first."""
        led = counts.get(node, 0)
        return led - self._shares.get(node, 0), led

    def _may_move(self, mine: int, theirs: int, target: str) -> bool:
        """Whether a job goes from this node, which leads ``mine`` jobs, to its preferred
        node ``target``, which leads ``theirs``."""
        if not self._counted:
            return theirs + 2 <= mine
        return theirs < mine and (mine > self._fair or theirs < self._shares.get(target, 0))


class Spreader:
    """``placement="spread"`` inside one node's election: reads the membership that each
    ``ELECT`` call brings back (``Membership.peers``), and tells the election which free locks
    to take, which jobs to hand over, and when a round should come at once."""

    __slots__ = (
        "_changed_at",
        "_clock",
        "_departed",
        "_free_since",
        "_heartbeat_s",
        "_key",
        "_let_go",
        "_membership",
        "_moved_away",
        "_waiting",
        "_node_id",
        "_placement",
        "_settle_ms",
    )

    def __init__(
        self,
        node_id: str,
        *,
        membership: Callable[[], Membership | None],
        settle_s: float,
        heartbeat_s: float,
        clock: Clock,
    ) -> None:
        self._node_id = node_id
        self._membership = membership
        self._settle_ms = settle_s * 1000
        self._let_go: dict[str, tuple[str, float]] = {}
        self._free_since: dict[str, float] = {}
        """Job -> when the round that first found its lock free was sent (its lock has been
        free in every round that asked about it since)."""
        """Job -> the node that let its lock go, and until when (monotonic) that counts."""
        self._moved_away: set[str] = set()
        self._waiting: set[str] = set()
        """The jobs this node handed over for placement and has not led since."""
        self._heartbeat_s = heartbeat_s
        self._clock = clock
        self._placement = Placement(node_id)
        self._key: tuple[str, frozenset[str]] | None = None
        self._changed_at = float("-inf")
        self._departed: frozenset[str] = frozenset()
        """The nodes that left the membership at the last change, until ``take_departed``."""

    @property
    def placement(self) -> Placement:
        return self._placement

    def refresh(self, leases: Mapping[str, Lease]) -> None:
        """Recompute the preferences when the members, or which of them have settled,
        changed since the last call."""
        member = self._membership()
        if member is None or member.server_ms is None:
            return
        settled = frozenset(
            owner
            for owner, (joined_ms, _) in member.peers.items()
            if joined_ms + self._settle_ms <= member.server_ms
        )
        if (member.epoch, settled) == self._key:
            return
        self._key = (member.epoch, settled)
        self._changed_at = self._clock.monotonic()
        self._let_go.clear()
        mine = frozenset(job for job, lease in leases.items() if lease.wanted)
        candidates: dict[str, Candidate] = {}
        for owner, (_, digest) in sorted(member.peers.items()):
            node = node_of(owner) or owner
            jobs = mine if same_jobs(digest, member.digest) else frozenset()
            settled_here = owner in settled or candidates.get(node, _NOBODY).settled
            candidates[node] = Candidate(node, jobs, settled_here)
        before = self._placement.live
        self._placement.update(candidates.values(), mine)
        self._departed |= before - self._placement.live

    def gone(self, holder: str | None) -> bool:
        """Whether ``holder`` (a node id) holds a lock but is not a live member: it left (a
        graceful stop leaves the membership before it releases), its membership expired, or
        it is not of this library. Its locks are asked about in every round, so that one
        released without a notice is found within a heartbeat. False before the membership
        was read."""
        return (
            self._key is not None
            and holder is not None
            and holder != self._node_id
            and holder not in self._placement.live
        )

    def take_departed(self) -> frozenset[str]:
        """The nodes that left the membership since the last call."""
        departed, self._departed = self._departed, frozenset()
        return departed

    def take(self, lease: Lease) -> bool:
        """Whether this node takes ``lease``'s lock when it is free, in this round: not
        before its first round told it who the members are (then, at once where it is the
        preferred node), so that replicas started together do not leave every job to the
        first one to ask. A lock preferred elsewhere is taken once the preferred node had its
        chance: a round found the lock free a heartbeat ago already (not: this node last saw
        its holder a heartbeat ago, which may be long before a release that all nodes see at
        the same notice), or that node let it go itself."""
        member = self._membership()
        if member is not None and member.server_ms is None:
            return False
        now = self._clock.monotonic()
        free_since = self._free_since.get(lease.job)
        seen_free = lease.holder is None and (
            (free_since is not None and now - free_since >= 0.9 * self._heartbeat_s)
            or self._let_go_by_preferred(lease.job, now)
        )
        return self._placement.may_take(lease.job, seen_free)

    def observed(
        self, leases: Mapping[str, Lease], holders: Mapping[str, str | None], sent_at: float
    ) -> None:
        """After a round sent at ``sent_at`` that asked about the jobs of ``holders`` (each
        with its holder before the round, by node id): note since when each lock is free, and
        each lock whose holder let it go (released it, or let it lapse). Until the membership
        changes, or for one lock expiry at most, that job is not handed back to that node, so
        that it does not bounce back to a node that is stopping or dead but still a member."""
        until = self._clock.monotonic() + self._settle_ms / 1000
        for job, before in holders.items():
            if leases[job].holder is None and leases[job].token is None:
                self._free_since.setdefault(job, sent_at)
            else:
                self._free_since.pop(job, None)
            if leases[job].token is not None:
                self._moved_away.discard(job)
            if before not in (None, self._node_id, leases[job].holder):
                self._let_go[job] = (before, until)

    def watches(self, job: str, holder: str | None) -> bool:
        """Whether this node keeps an eye on ``job``'s lock held by ``holder`` (a node id;
        None: free or unknown, which every node watches): it is the job's watcher, or the
        membership names none (not read yet, or no other node runs the job)."""
        if holder is None or holder == self._node_id:
            return True
        watcher = self._placement.watcher(job, holder)
        return watcher is None or watcher == self._node_id

    def back_in(self, job: str) -> bool:
        """Whether this node, having handed ``job`` over for placement, is its preferred
        node again (the membership changed): it may take the job before its rest ends."""
        return job in self._moved_away and self._placement.preferred(job) == self._node_id

    def to_hand_over(self, leases: Mapping[str, Lease]) -> list[str]:
        """The jobs to release now for their preferred nodes (none in the heartbeat after
        the preferences changed, so that every node has seen the same change; none to a
        node that just let the job go)."""
        now = self._clock.monotonic()
        if now - self._changed_at < self._heartbeat_s:
            return []
        led = [
            job
            for job, lease in leases.items()
            if lease.token is not None and lease.wanted and not self._let_go_by_preferred(job, now)
        ]
        idle = {
            job: not (lease.running or lease.stepping_down)
            for job, lease in leases.items()
            if lease.token is not None
        }
        counts = Counter(
            lease.holder for lease in leases.values() if lease.wanted and lease.holder is not None
        )
        wanted = self._placement.to_hand_over(led, dict.fromkeys(idle, True), counts)
        moving = [job for job in wanted if idle[job]]
        self._waiting = {job for job in wanted if not idle[job]}
        self._moved_away.update(moving)
        return moving

    def waits_for(self, job: str) -> bool:
        """Whether a move of ``job`` waits for its run in flight to end (then a round should
        come at once: a node whose rounds fall in the runs of its jobs must still move them)."""
        return job in self._waiting

    def _let_go_by_preferred(self, job: str, now: float) -> bool:
        node, until = self._let_go.get(job, ("", now))
        return until > now and node == self._placement.preferred(job)

    def wants_round(self, leases: Mapping[str, Lease], looked_at: Mapping[str, str | None]) -> bool:
        """Whether a free lock that this round only looked at (``looked_at``: job -> its
        holder before the round) should be taken at once, in a round that comes now: this
        node is the preferred one now, or the preferred node itself let the lock go (it
        stopped, or it died and its lock ran out), so that first come is fair."""
        for job, holder_before in looked_at.items():
            lease = leases[job]
            if lease.holder is not None or lease.token is not None:
                continue
            preferred = self._placement.preferred(job)
            if preferred == self._node_id or (preferred is not None and holder_before == preferred):
                return True
        return False


_NOBODY = Candidate("", frozenset(), False)
