"""Every Redis key and channel the library uses, built in one place.

All keys of one project share the hash tag ``{project}``, so that one script can touch all of
them in a single round trip, also on Redis Cluster (they live in one hash slot).

A key may hold what no script writes (``_odd``): its readers read that as absent, and
the script that owns the key deletes or replaces it (``_store.redis.scripts``); a lock value
of another form, or a lock key of another type, is foreign and stays until it goes.

=============================================  ======  =============================================
key                                            type    content
=============================================  ======  =============================================
``singletonjob:{<project>}:<job>:lock``        string  ``<fencing token>|<node id>#<nonce>``, with a
                                                       TTL of the job's lock expiry (the lease); any
                                                       other value, or another type, is foreign,
                                                       nobody's to renew
``singletonjob:{<project>}:<job>:fence``       string  the last fencing token granted; no TTL, so
                                                       tokens keep growing across terms
``singletonjob:{<project>}:<job>:last``        string  the latest cron/custom instant a leader
                                                       started, in µs since the epoch, never written
                                                       more than ``max_ahead_us`` ahead of the
                                                       server clock; no TTL
``singletonjob:{<project>}:<job>:checkpoint``  hash    the job's checkpoint (``_checkpoint``), every
                                                       field a string: ``iteration``,
                                                       ``last_scheduled_us`` and
                                                       ``last_completed_us`` (µs since the epoch;
                                                       the latter on the server clock, stamped by
                                                       ``RECORD_RUN``),
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
``singletonjob:{<project>}:<job>:history``     list    the job's last runs and missed instants,
                                                       newest first, one JSON object each
                                                       (``_history``); written by
                                                       ``RECORD_RUN`` (fenced, trimmed to the
                                                       job's ``history``), TTL the checkpoint
                                                       retention from the last entry
``singletonjob:{<project>}:<job>:overdue``     string  the job's open overdue spell (``_overdue``):
                                                       ``<since µs>:<anchor>``, the anchor being
                                                       the stored values it was judged from; set
                                                       and deleted only by ``OVERDUE``, TTL the
                                                       checkpoint retention
``singletonjob:{<project>}:released``          pubsub  a node publishes here when it releases locks
                                                       (the count), and an operator's call when it
                                                       changes a control (``control``): both wake
                                                       every node's election for a round at once
``singletonjob:{<project>}:nodes``             hash    membership: owner id (``<node>#<nonce>``) ->
                                                       the node's record as JSON (``membership``):
                                                       node id, version, started at, its jobs and
                                                       their schedules as text, its record TTL;
                                                       written by ``ELECT`` when the node's record
                                                       changed or is missing
``singletonjob:{<project>}:nodes:expiry``      zset    owner id -> when its record expires, in ms
                                                       of the server clock; each ``ELECT`` pushes
                                                       it back and drops the owners already past
                                                       it, or more than ``MAX_RECORD_TTL_S`` ahead
                                                       (from the three membership keys)
``singletonjob:{<project>}:nodes:placement``   hash    owner id -> ``<joined>|<jobs digest>``: when
                                                       the owner's record appeared (ms of the
                                                       server clock) and a digest of its job names
                                                       and of its jobs with their schedules
                                                       (``membership.jobs_digest``); ``#epoch``
                                                       -> a counter that ``ELECT`` raises whenever
                                                       an owner joins or leaves; a node reads the
                                                       hash only when the epoch it knows is not the
                                                       current one (``_election.placement``)
``singletonjob:{<project>}:controls``          hash    operators' controls, no TTL:
                                                       ``paused:<job>`` -> JSON (``at``, ``by``),
                                                       present while the job is paused;
                                                       ``trigger:<job>``, ``step-down:<job>``
                                                       and ``reset:<job>`` (left by a checkpoint
                                                       reset while the job has a leader) ->
                                                       ``1``, a request the job's leader
                                                       consumes (deletes) in its next ``ELECT``
=============================================  ======  =============================================
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Literal, get_args

from .._odd import odd_value

__all__ = [
    "Control",
    "JobKey",
    "ProjectKey",
    "control_field",
    "job_key",
    "job_prefix",
    "parse_control_field",
    "parse_paused",
    "paused_value",
    "project_key",
    "release_channel",
]

PREFIX = "singletonjob"

JobKey = Literal["lock", "fence", "last", "checkpoint", "history", "overdue"]
"""The keys of one job (``<job>:<kind>`` in the table): ``lock`` its lease, present while some
node leads it; ``fence`` the last fencing token granted; ``last`` the latest instant a leader
claimed (started); ``checkpoint`` its checkpoint record (a hash; see ``_checkpoint``);
``history`` its last occurrences (a list; see ``_history``); ``overdue`` its open overdue
spell (see ``_overdue``)."""

ProjectKey = Literal["nodes", "nodes:expiry", "nodes:placement", "controls"]
"""The keys the jobs of one project share: ``nodes`` the hash of the live nodes' membership
records (owner id -> JSON); ``nodes:expiry`` the sorted set of their expiries (owner id ->
server time in ms); ``nodes:placement`` the hash of when each member joined and which jobs it
runs (a digest), and the epoch; ``controls`` the hash of operators' controls (``Control``)."""

Control = Literal["paused", "trigger", "step-down", "reset"]
"""The fields of the ``controls`` hash, one of each per job (``<control>:<job>``): ``paused``
present while the job is paused; ``trigger`` asks the job's leader for one extra run;
``step-down`` asks the job's leader to hand it over; ``reset`` tells the job's leader that its
checkpoint was reset (it forgets the copy it keeps)."""


def _tag(project: str) -> str:
    return f"{PREFIX}:{{{project}}}"


def job_key(project: str, job: str, kind: JobKey) -> str:
    """The key ``kind`` of ``job`` (see ``JobKey``): ``job_prefix``, the job, ``:``, the kind."""
    return f"{_tag(project)}:{job}:{kind}"


def job_prefix(project: str) -> str:
    """What the keys of every job of ``project`` begin with (``job_key``), for a script that
    builds them from the job names (``RECORD_RUN``)."""
    return f"{_tag(project)}:"


def project_key(project: str, name: ProjectKey) -> str:
    """The key ``name`` of ``project``, shared by its jobs (see ``ProjectKey``)."""
    return f"{_tag(project)}:{name}"


def release_channel(project: str) -> str:
    """The pub/sub channel on which releases of ``project``'s locks are announced."""
    return f"{_tag(project)}:released"


def control_field(control: Control, job: str) -> str:
    """The field of the ``controls`` key that holds ``control`` for ``job`` (see ``Control``)."""
    return f"{control}:{job}"


def parse_control_field(field: str) -> tuple[Control, str] | None:
    """The control and the job that a field of the ``controls`` key names; None for a field
    that ``control_field`` did not write (no colon, a control this version does not know)."""
    control, sep, job = field.partition(":")
    for known in get_args(Control):
        if sep and control == known:
            return known, job
    return None


def paused_value(at: datetime, by: str) -> str:
    """The value of a ``paused:<job>`` control: JSON with ``at`` (when, ISO 8601) and ``by``
    (the node id of the caller). Only its presence pauses the job; the rest is for people."""
    return json.dumps({"at": at.isoformat(), "by": by})


def parse_paused(job: str, value: str | None) -> datetime | None:
    """When the ``paused:<job>`` control ``value`` says ``job`` was paused; None without a
    value, or for one that ``paused_value`` did not write (set by hand, say: reported once,
    ``odd``; the job is paused all the same)."""
    if value is None:
        return None
    try:
        at = datetime.fromisoformat(json.loads(value)["at"])
    except (ValueError, TypeError, KeyError, RecursionError):
        at = None
    if at is None or at.tzinfo is None:
        odd_value(
            f"the control {control_field('paused', job)!r}",
            value,
            "the job is paused (the field's presence pauses it), since when is unknown",
        )
        return None
    return at
