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
=============================================  ======  =============================================
"""

from __future__ import annotations

__all__ = ["checkpoint_key", "fence_key", "last_key", "lock_key", "release_channel"]

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
