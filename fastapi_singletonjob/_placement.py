"""Placement: which live node should lead each job, so that leadership spreads over the
replicas (``placement="spread"``) and a join or a leave moves only the jobs it must.

Every node computes the same answer from the same membership: for each job, the nodes that
registered it are ranked by rendezvous hashing (highest ``hash(job, node)`` first), and the
first of them leads. Adding a node moves only the jobs it now ranks first for (about 1/N of
them); removing one moves only its own. A node that has just joined is not preferred until it
has kept its membership for ``settle_s`` (about one lock expiry), so that a pod in a crash loop
does not pull jobs back and forth; when no node has settled yet (a cold start), every live
node counts.

The election uses the answer two ways. A node takes a free lock at once only for a job it is
preferred for (or one no live node prefers); for the others it leaves the preferred node one
round first, so a pushed release goes to the right node. And a node that leads a job preferred
elsewhere hands it over between runs, at most ``moves_per_round`` per round, so that a join
does not empty a node in one heartbeat.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["Candidate", "Placement", "rank"]

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


class Placement:
    """One node's view of who should lead what, rebuilt from each membership it reads."""

    __slots__ = ("_moves", "_node_id", "_preferred")

    def __init__(self, node_id: str, *, moves_per_round: int = DEFAULT_MOVES_PER_ROUND) -> None:
        if moves_per_round < 1:
            raise ValueError(f"moves_per_round={moves_per_round!r} must be at least 1")
        self._node_id = node_id
        self._moves = moves_per_round
        self._preferred: dict[str, str] = {}

    def update(self, candidates: Iterable[Candidate], jobs: Iterable[str]) -> None:
        """Recompute the preferred node of each of ``jobs`` (this node's) from the live
        ``candidates`` (this node among them, or not yet)."""
        live = list(candidates)
        settled = [candidate for candidate in live if candidate.settled] or live
        self._preferred = {}
        for job in jobs:
            able = [candidate.node_id for candidate in settled if job in candidate.jobs]
            if not able:  # only unsettled nodes run it: any live one will do
                able = [candidate.node_id for candidate in live if job in candidate.jobs]
            if able:
                self._preferred[job] = rank(job, able)[0]

    def preferred(self, job: str) -> str | None:
        """The node that should lead ``job``; None when no membership names it."""
        return self._preferred.get(job)

    def may_take(self, job: str, seen_free_before: bool) -> bool:
        """Whether this node asks for ``job``'s free lock in this round: at once when it is the
        preferred node (or none is known), else only once the lock was already free in its
        previous round (the preferred node had its chance)."""
        preferred = self._preferred.get(job)
        return preferred is None or preferred == self._node_id or seen_free_before

    def to_hand_over(self, led: Iterable[str], idle: Mapping[str, bool]) -> list[str]:
        """The jobs this node leads but another node is preferred for, and that have no run
        in flight (``idle[job]``): at most ``moves_per_round`` of them, in name order."""
        moving = [
            job
            for job in sorted(led)
            if idle.get(job, False) and self._preferred.get(job, self._node_id) != self._node_id
        ]
        return moving[: self._moves]
