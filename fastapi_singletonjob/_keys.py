"""Every Redis key and channel the library uses, built in one place.

All keys of one project share the hash tag ``{project}``, so that one script can touch all of
them in a single round trip, also on Redis Cluster (they live in one hash slot).

=============================================  ======  =============================================
key                                            type    content
=============================================  ======  =============================================
``singletonjob:{<project>}:<job>:lock``        string  ``<fencing token>|<node id>#<nonce>``, with a
                                                       TTL of the job's lock expiry (the lease); any
                                                       other value is foreign, nobody's to renew
``singletonjob:{<project>}:<job>:fence``       string  the last fencing token granted; no TTL, so
                                                       tokens keep growing across terms
``singletonjob:{<project>}:<job>:last``        string  the latest cron/custom instant a leader
                                                       started, in µs since the epoch, never written
                                                       more than ``max_ahead_us`` ahead of the
                                                       server clock; no TTL
``singletonjob:{<project>}:<job>:checkpoint``  hash    the job's checkpoint (``_checkpoint``), every
                                                       field a string: ``iteration``,
                                                       ``last_scheduled_us`` and
                                                       ``last_completed_us`` (µs since the epoch),
                                                       ``last_outcome``, ``last_error``,
                                                       ``node_id``, ``fencing_token``, ``state``
                                                       (JSON text); a field that is None is absent.
                                                       Written only by the fenced scripts
                                                       ``RECORD_RUN`` and ``SAVE_STATE``, which set
                                                       its TTL to the checkpoint retention;
                                                       ``ELECT`` is to refresh that TTL for each
                                                       lock it holds or takes, so that a record
                                                       expires only when no node led its job for a
                                                       whole retention (the job was removed, or the
                                                       fleet was down that long)
``singletonjob:{<project>}:released``          pubsub  a node publishes here when it releases locks
                                                       (the count), and an operator's call when it
                                                       changes a control (``control``): both wake
                                                       every node's election for a round at once
``singletonjob:{<project>}:nodes``             hash    membership: owner id (``<node>#<nonce>``) ->
                                                       the node's record as JSON (``_membership``):
                                                       node id, version, started at, its jobs and
                                                       their schedules as text, its record TTL;
                                                       written by ``ELECT`` when the node's record
                                                       changed or is missing
``singletonjob:{<project>}:nodes:expiry``      zset    owner id -> when its record expires, in ms
                                                       of the server clock; each ``ELECT`` pushes
                                                       it back and drops the records of the owners
                                                       already past it (from both keys)
``singletonjob:{<project>}:nodes:placement``   hash    owner id -> ``<joined>|<jobs digest>``: when
                                                       the owner's record appeared (ms of the
                                                       server clock) and a digest of its job names
                                                       (``_membership``); ``#epoch`` -> a counter
                                                       that ``ELECT`` raises whenever an owner
                                                       joins or leaves; a node reads the hash only
                                                       when the epoch it knows is not the current
                                                       one (``_placement``)
``singletonjob:{<project>}:controls``          hash    operators' controls, no TTL:
                                                       ``paused:<job>`` -> JSON (``at``, ``by``),
                                                       present while the job is paused;
                                                       ``trigger:<job>`` and ``step-down:<job>``
                                                       -> ``1``, a request the job's leader
                                                       consumes (deletes) in its next ``ELECT``
=============================================  ======  =============================================
"""

from __future__ import annotations

__all__ = [
    "checkpoint_key",
    "controls_key",
    "fence_key",
    "last_key",
    "lock_key",
    "members_key",
    "member_expiry_key",
    "paused_field",
    "placement_key",
    "release_channel",
    "step_down_field",
    "trigger_field",
]

PREFIX = "singletonjob"


def _tag(project: str) -> str:
    return f"{PREFIX}:{{{project}}}"


def lock_key(project: str, job: str) -> str:
    """The lease key of ``job``: present while some node leads it."""
    return f"{_tag(project)}:{job}:lock"


def fence_key(project: str, job: str) -> str:
    """The key holding the last fencing token granted for ``job``."""
    return f"{_tag(project)}:{job}:fence"


def last_key(project: str, job: str) -> str:
    """The key holding the latest instant of ``job`` that a leader claimed (started)."""
    return f"{_tag(project)}:{job}:last"


def checkpoint_key(project: str, job: str) -> str:
    """The key of ``job``'s checkpoint record (a hash; see ``_checkpoint``)."""
    return f"{_tag(project)}:{job}:checkpoint"


def release_channel(project: str) -> str:
    """The pub/sub channel on which releases of ``project``'s locks are announced."""
    return f"{_tag(project)}:released"


def members_key(project: str) -> str:
    """The hash of the live nodes' membership records (owner id -> JSON)."""
    return f"{_tag(project)}:nodes"


def member_expiry_key(project: str) -> str:
    """The sorted set of membership expiries (owner id -> server time in ms)."""
    return f"{_tag(project)}:nodes:expiry"


def placement_key(project: str) -> str:
    """The hash of when each member joined and which jobs it runs (a digest), and the epoch."""
    return f"{_tag(project)}:nodes:placement"


def controls_key(project: str) -> str:
    """The hash of operators' controls: paused jobs, pending triggers and step-downs."""
    return f"{_tag(project)}:controls"


def paused_field(job: str) -> str:
    """The field of ``controls_key`` present while ``job`` is paused."""
    return f"paused:{job}"


def trigger_field(job: str) -> str:
    """The field of ``controls_key`` asking ``job``'s leader for one extra run."""
    return f"trigger:{job}"


def step_down_field(job: str) -> str:
    """The field of ``controls_key`` asking ``job``'s leader to hand it over."""
    return f"step-down:{job}"
