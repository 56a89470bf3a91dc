"""Definitions: whether the other members define this node's jobs as it does.

Two services deployed with one ``project`` share every key: a job of one name is elected once
for both, and only its leader's schedule runs, the other service's code never (issue 29). So a
node compares its jobs with the other members': a job of the same name with another schedule
(as ``JobSpec.announced`` writes it: kind, period, offset, expression and zone, misfire
settings) gets a WARNING that names the job, both schedules, the other nodes and the fix, once
for as long as it lasts, and an INFO line with how long it lasted when it ends. A job that
only one of them runs is no difference: a rolling deploy that adds a job has it on the new
replicas only.

It costs the election nothing: each member's placement entry, which every ``ELECT`` reply
brings back when the membership changes, carries the digest of its jobs with their schedules
(``jobs_digest``). Only a member whose digest differs from this node's has its record read
(``Store.read_members``, one ``HMGET``), once per member and digest, outside the election
round, in a task of its own: a slow read never delays a renewal.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .._clock import Clock
from .._lock_value import node_of
from .._store.membership import MemberRecord, Membership, same_definitions

__all__ = ["FIX", "DefinitionCheck", "Difference"]

logger = logging.getLogger("fastapi_singletonjob.election")

FIX = "give each service its own project=, or make the job definitions match"
"""What the warning tells the operator to do."""

SHOWN_NODES = 5
"""A warning names this many of the other nodes at most, then says how many more."""


@dataclass(frozen=True, slots=True, order=True)
class Difference:
    """Job ``job`` runs on ``schedule`` at node ``node_id``, not on this node's schedule."""

    job: str
    node_id: str
    schedule: str


class DefinitionCheck:
    """One node's comparison of its job definitions with the other members' (see the module's
    docstring). The elector calls ``to_read`` after each successful round, reads the records
    it names and hands them to ``read``, then calls ``update``, which logs what changed."""

    def __init__(self, *, node_id: str, owner: str, clock: Clock, retry_s: float) -> None:
        self._node_id = node_id
        self._owner = owner
        self._clock = clock
        self._retry_s = retry_s
        self._records: dict[str, tuple[str, dict[str, str]]] = {}
        """Owner id -> the digest its record was read at, and its jobs with their schedules."""
        self._not_before: dict[str, float] = {}
        """Owner id -> when (monotonic) a record not found, or a failed read, is asked again."""
        self._active: dict[Difference, float] = {}
        """Each difference found, and since when (monotonic)."""
        self._key: tuple[object, ...] | None = None
        """What ``update`` last compared: it compares again only when that changed."""
        self._reads = 0

    @property
    def differences(self) -> list[Difference]:
        """The differences that last now."""
        return sorted(self._active)

    def to_read(self, member: Membership) -> list[str]:
        """The owner ids of the members whose records to read now: their digest is not this
        node's, and their record was not read at that digest (nor asked in vain lately)."""
        now = self._clock.monotonic()
        return sorted(
            owner
            for owner, (_, digest) in member.peers.items()
            if owner != self._owner
            and not same_definitions(digest, member.digest)
            and self._records.get(owner, ("", {}))[0] != digest
            and self._not_before.get(owner, now) <= now
        )

    def read(
        self, member: Membership, owners: list[str], records: Mapping[str, MemberRecord]
    ) -> None:
        """The records found of ``owners`` (as ``to_read`` gave them); one not found (or a
        failed read: none found) is asked again ``retry_s`` later."""
        retry_at = self._clock.monotonic() + self._retry_s
        for owner in owners:
            record = records.get(owner)
            peer = member.peers.get(owner)
            if record is None or peer is None:
                self._not_before[owner] = retry_at
                continue
            self._records[owner] = (peer[1], dict(record.jobs))
            self._not_before.pop(owner, None)
        self._reads += 1

    def update(self, member: Membership, leader: Callable[[str], str | None]) -> None:
        """Compare this node's jobs with the records read, and log each difference that
        begins (WARNING, one per job and schedule, naming the nodes) and each that ends
        (INFO, with how long it lasted). ``leader(job)``: the node id of the job's leader
        as last seen, None when unknown."""
        key = (member.epoch, member.digest, self._reads)
        if key == self._key:
            return
        self._key = key
        peers = member.peers
        for owner in [owner for owner in self._records if owner not in peers]:
            del self._records[owner]
            self._not_before.pop(owner, None)
        mine = member.record.jobs
        found = {
            Difference(job, node_of(owner) or owner, theirs)
            for owner, (_, jobs) in self._records.items()
            if not same_definitions(peers[owner][1], member.digest)
            for job, theirs in jobs.items()
            if job in mine and mine[job] != theirs
        }
        now = self._clock.monotonic()
        live = {node_of(owner) or owner for owner in peers}
        for ended in sorted(set(self._active) - found):
            self._ended(ended, now - self._active.pop(ended), ended.node_id in live, mine)
        begun = sorted(found - set(self._active))
        for difference in begun:
            self._active[difference] = now
        groups: dict[tuple[str, str], list[str]] = {}
        for difference in begun:
            groups.setdefault((difference.job, difference.schedule), []).append(difference.node_id)
        for (job, theirs), nodes in groups.items():
            self._began(job, mine[job], theirs, nodes, leader(job))

    def _began(
        self, job: str, ours: str, theirs: str, nodes: list[str], leader: str | None
    ) -> None:
        shown = ", ".join(nodes[:SHOWN_NODES])
        if len(nodes) > SHOWN_NODES:
            shown += f" and {len(nodes) - SHOWN_NODES} more"
        who, verb = (
            (f"node {shown}", "announces") if len(nodes) == 1 else (f"nodes {shown}", "announce")
        )
        if leader == self._node_id:
            runs = f"this node leads it now, so the schedule of {who} does not run"
        elif leader in nodes:
            runs = f"node {leader} leads it now, so this node's schedule does not run"
        elif leader is not None:
            runs = f"node {leader} leads it now"
        else:
            runs = "one node leads it"
        logger.warning(
            "the schedule of job %r differs between nodes: %s %s %r, this node "
            "(%s) %r. They elect one leader for it and only the leader's schedule runs (%s). "
            "If these are two services on one project, %s; during a rolling deploy that "
            "changes the schedule this lasts until the last old replica is gone",
            job,
            who,
            verb,
            theirs,
            self._node_id,
            ours,
            runs,
            FIX,
        )

    def _ended(
        self, difference: Difference, lasted_s: float, still_live: bool, mine: Mapping[str, str]
    ) -> None:
        if not still_live:
            why = f"node {difference.node_id} left"
        elif difference.job not in mine:
            why = "this node no longer runs it"
        else:
            why = "the schedules match now"
        logger.info(
            "the schedule of job %r no longer differs between node %s (%r) and this node "
            "(%s): %s; it differed for %.1f s",
            difference.job,
            difference.node_id,
            difference.schedule,
            self._node_id,
            why,
            lasted_s,
        )
