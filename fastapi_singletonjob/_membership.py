"""Membership: what each node tells the others about itself, inside its election round.

Every ``ELECT`` call keeps the caller's record in the project's ``nodes`` hash and pushes back
its expiry (``nodes:expiry``, on the server clock); records past their expiry are dropped by
whichever node calls next. The record is sent whole only when it is new or Redis lost it, so a
round costs the same bytes whatever the number of jobs. Readers (the cluster view, the CLI)
learn from the records which nodes are alive and which jobs exist, without job definitions of
their own.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
from dataclasses import dataclass, field
from datetime import datetime

__all__ = ["VERSION", "MemberRecord", "Membership"]

logger = logging.getLogger("fastapi_singletonjob.membership")


def _version() -> str:
    try:
        return importlib.metadata.version("fastapi-singletonjob")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


VERSION = _version()
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
        """Parse a stored record; None (logged at DEBUG) for one that is not a record, so
        that one odd entry never hides the other nodes."""
        try:
            data = json.loads(text)
            jobs = data.get("jobs") or {}
            return cls(
                node_id=str(data["node_id"]),
                owner=owner,
                version=str(data.get("version", "")),
                started_at=datetime.fromisoformat(str(data["started_at"])),
                jobs={str(name): str(schedule) for name, schedule in jobs.items()},
                ttl_s=float(data.get("ttl_s", 0.0)),
            )
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            logger.debug("membership record of %r is not a record: %r", owner, exc)
            return None


class Membership:
    """This node's record and whether the store has it: sent whole only when needed."""

    def __init__(self, record: MemberRecord) -> None:
        self.record = record
        self._json = record.to_json()
        self.stored = False
        """True once an election call stored the record and none since reported it missing."""

    @property
    def ttl_ms(self) -> int:
        """The record's lifetime without a renewal, in whole milliseconds."""
        return max(1, round(self.record.ttl_s * 1000))

    def payload(self) -> str:
        """What the next call sends: the record, or "" when the store has it already."""
        return "" if self.stored else self._json

    def confirmed(self, present: bool) -> None:
        """Apply a call's answer: ``present`` is False when the store lost the record."""
        self.stored = present
