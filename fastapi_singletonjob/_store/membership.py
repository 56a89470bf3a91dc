"""Membership: what each node tells the others about itself, inside its election round.

Every ``ELECT`` call keeps the caller's record in the project's ``nodes`` hash and pushes back
its expiry (``nodes:expiry``, on the server clock); records past their expiry are dropped by
whichever node calls next. The record is sent whole only when it is new, when it changed (a
job retired: its schedule ended or failed) or when Redis lost it, so a round costs the same
bytes whatever the number of jobs. Readers (the cluster view, the CLI) learn from the records
which nodes are alive and which jobs exist, without job definitions of their own.

Each node's placement entry carries the digest of its jobs (``jobs_digest``), which every node
reads with the placement when the membership changes: by its names part, placement knows which
nodes run the same jobs; by the whole, a node knows which members define them otherwise and
reads only their records to compare the schedules (``_election.definitions``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

from .._checkpoint import digits
from .._config.settings import MAX_DURATION_S
from .._odd import deleted, odd_value
from .._version import __version__

__all__ = [
    "DROPPED",
    "MAX_RECORD_TTL_S",
    "VERSION",
    "MemberRecord",
    "Membership",
    "jobs_digest",
    "same_definitions",
    "same_jobs",
]

MAX_RECORD_TTL_S = MAX_DURATION_S
"""The longest a record lives without a renewal: the longest lock expiry the settings accept.
``ELECT`` drops an owner whose expiry lies further ahead (no call wrote it), and the cluster
read leaves it out."""

DROPPED = "#dropped"
"""The field of the pairs, after the placement hash in an ``ELECT`` reply, that say what the
call deleted (``_store.redis.scripts``)."""

_JOINED_DIGITS = 15
"""A placement entry's join time: server ms since the epoch, up to 15 digits (year 33658)."""

VERSION = __version__
"""The library's version, as this node announces it."""


@dataclass(frozen=True)
class MemberRecord:
    """One node's membership record, as stored (JSON) in the ``nodes`` hash."""

    node_id: str
    owner: str
    """The owner id written into this node's locks (``<node id>#<nonce>``)."""
    version: str
    started_at: datetime
    jobs: dict[str, str] = field(default_factory=dict)
    """The node's enabled jobs, each with its schedule as text."""
    ttl_s: float = 0.0
    """How long the record lives without a renewal."""

    def to_json(self) -> str:
        """The record as the store keeps it."""
        return json.dumps(
            {
                "node_id": self.node_id,
                "owner": self.owner,
                "version": self.version,
                "started_at": self.started_at.isoformat(),
                "jobs": self.jobs,
                "ttl_s": self.ttl_s,
            },
            separators=(",", ":"),
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, owner: str, text: str) -> MemberRecord | None:
        """Parse a stored record; None for one that is not a record as ``to_json`` writes
        it (bad JSON, JSON of another shape, another owner, a time without its offset, a
        lifetime that is not 0 to ``MAX_RECORD_TTL_S``), reported once (``odd``), so that one
        odd entry never hides the other nodes."""
        try:
            data = json.loads(text)
            jobs = data.get("jobs") or {}
            record = cls(
                node_id=str(data["node_id"]),
                owner=owner,
                version=str(data.get("version", "")),
                started_at=datetime.fromisoformat(str(data["started_at"])),
                jobs={str(name): str(schedule) for name, schedule in jobs.items()},
                ttl_s=float(data.get("ttl_s", 0.0)),
            )
            if (
                str(data.get("owner", owner)) != owner
                or record.started_at.tzinfo is None
                or not 0 <= record.ttl_s <= MAX_RECORD_TTL_S
            ):
                raise ValueError("another owner, no offset, or a lifetime out of range")
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError):
            odd_value(
                f"the record of {owner[:100]!r} in nodes",
                text,
                "that node is left out of the cluster view",
            )
            return None
        return record


def jobs_digest(jobs: Mapping[str, str]) -> str:
    """A short digest of a node's jobs (name -> schedule as text): 8 hex digits of the names,
    then 8 of the names with their schedules (16 in all, as long as the names' digest alone
    was: an election call carries it, and costs the same bytes). Nodes with equal first halves
    run the same jobs (``same_jobs``: placement); nodes with equal digests define them alike
    too (``same_definitions``); only when those differ does a node read the other's record to
    compare the schedules job by job (``_election.definitions``)."""
    names = "\n".join(sorted(jobs)).encode()
    both = "\n".join(f"{name}\t{jobs[name]}" for name in sorted(jobs)).encode()
    return _digest(names) + _digest(both)


def same_jobs(digest: str, other: str) -> bool:
    """Whether two ``jobs_digest`` values are of the same job names."""
    return digest[:_HALF] == other[:_HALF]


def same_definitions(digest: str, other: str) -> bool:
    """Whether two ``jobs_digest`` values are of the same jobs with the same schedules."""
    return digest == other


_HALF = 8
"""Hex digits in each half of a jobs digest (32 bits: two different job sets, or two
definitions, look alike about once in four billion pairs)."""


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=_HALF // 2).hexdigest()


class Membership:
    """This node's record and whether the store has it (sent whole only when needed), and
    the placement facts each election call brings back: the server's clock, and who is a
    member since when, running which jobs (read again only when the epoch changes)."""

    def __init__(self, record: MemberRecord) -> None:
        self.record = record
        self._json = record.to_json()
        self.digest = jobs_digest(record.jobs)
        self.stored = False
        """True once an election call stored the record as it is now and none since reported
        it missing."""
        self._version = 0
        """Raised by each ``update``."""
        self._sent_version = 0
        """The version the last ``payload`` was taken from: a call sent before an update
        confirms the record it carried, not the new one."""
        self.epoch = ""
        """The placement epoch of ``peers``; "" before the first call."""
        self.peers: dict[str, tuple[int, str]] = {}
        """Owner id -> (joined at, server ms; jobs digest), for every live member."""
        self.server_ms: int | None = None
        """The server's clock at the last call, in ms since the epoch."""
        self.left = False
        """Set when the node leaves (a graceful stop): election calls no longer keep the
        record, so that the others see the leave before this node releases its locks."""

    def placed(self, server_ms: int, epoch: str, flat: Sequence[str]) -> None:
        """Apply a call's placement part: the server time, the epoch, and the placement
        hash flat (field, value, ...) when the epoch changed (else empty), followed by what
        the call deleted, as (``DROPPED``, what) pairs, each logged."""
        self.server_ms = server_ms
        placement = []
        for name, value in zip(flat[::2], flat[1::2], strict=True):
            if name == DROPPED:
                deleted(value)
            else:
                placement.append((name, value))
        if epoch == self.epoch or not placement:
            return
        peers = {}
        for owner, value in placement:
            if owner.startswith("#"):
                continue
            entry = _placement_entry(value)
            if entry is not None:
                peers[owner] = entry
            else:
                odd_value(
                    f"the entry {owner[:100]!r} of nodes:placement",
                    value,
                    "it is left out of placement",
                )
        self.epoch, self.peers = epoch, peers

    @property
    def ttl_ms(self) -> int:
        """The record's lifetime without a renewal, in whole milliseconds."""
        return max(1, round(self.record.ttl_s * 1000))

    def update(self, record: MemberRecord) -> None:
        """Announce ``record`` instead from the next call on: it is sent whole, and the store
        refreshes the jobs digest of this node's placement entry (keeping its join time), so
        that every node places the jobs by what this one runs now."""
        if record == self.record:
            return
        self.record = record
        self._json = record.to_json()
        self.digest = jobs_digest(record.jobs)
        self._version += 1
        self.stored = False

    def drop_jobs(self, jobs: Iterable[str]) -> None:
        """Stop announcing ``jobs`` (they retired on this node: it no longer runs them)."""
        gone = set(jobs)
        kept = {name: text for name, text in self.record.jobs.items() if name not in gone}
        self.update(replace(self.record, jobs=kept))

    def payload(self) -> str:
        """What the next call sends: the record, or "" when the store has it already."""
        self._sent_version = self._version
        return "" if self.stored else self._json

    def confirmed(self, present: bool) -> None:
        """Apply a call's answer: ``present`` is False when the store lost the record. A
        call sent before the last ``update`` leaves the new record still to send."""
        self.stored = present and self._sent_version == self._version


def _placement_entry(value: str) -> tuple[int, str] | None:
    """``"<joined, server ms>|<jobs digest>"`` parsed, or None for anything else (a value
    written by hand or by another tool: no ``|``, non-ASCII digits, a huge number)."""
    joined, sep, digest = value.partition("|")
    try:
        return (digits(joined, _JOINED_DIGITS), digest) if sep else None
    except ValueError:
        return None
