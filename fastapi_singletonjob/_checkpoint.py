"""Checkpoints: a job's progress, stored next to its lock and written only by its leader.

One Redis hash per job (``_store.keys.job_key``, kind ``checkpoint``), every field a string, a field
that is None left out:

=====================  ====================================================================
field                  content
=====================  ====================================================================
``iteration``          successful runs, cluster-wide (``HINCRBY``: exact up to 2^63 - 1)
``last_scheduled_us``  the last recorded run's tick or cron instant, µs since the epoch
``last_completed_us``  when that run ended (whatever its outcome), µs since the epoch, on
                       the store's clock: Redis ``TIME`` as ``RECORD_RUN`` writes it
``last_outcome``       ``success``, ``failed``, ``timeout`` or ``cancelled`` (``Outcome``)
``last_error``         its error, at most ``MAX_ERROR_CHARS`` characters; none after a success
``node_id``            the node that wrote last
``fencing_token``      the term that wrote last
``state``              the job's state: the JSON text ``encode_state`` made, byte for byte
``history``            where the run history stands (``_history``: the mark a new leader
                       reads with the record; not part of ``Checkpoint``)
=====================  ====================================================================

Which clock each time is on. ``last_completed_us`` is the store's, never a node's: the
server's ``TIME`` when ``RECORD_RUN`` records the run (the memory store: its clock's
``now()``), a few milliseconds after the run's end on the node. A new leader of an interval
job measures the time since it on that clock too (``Store.load_checkpoint`` reads the
server's time with the record), so the handover keeps the job's spacing whatever the nodes'
wall clocks say. ``last_scheduled_us`` is the run's instant as its node saw it: for cron
and custom jobs (whose ``misfire`` policy a new leader applies from it) an instant claimed
against the server's clock, which ``CLAIM`` refuses more than a second
(``_store.base.DEFAULT_MAX_AHEAD_US``) ahead of it; for fixed-rate and interval jobs the
node's grid instant or start, shown but never acted on.

A hash of strings rather than one JSON document, because Lua's cjson would round µs times
(16 digits) and tokens to 14 significant digits and cannot tell ``[]`` from ``{}``; as
strings, every value comes back exactly as written.

Writes are fenced: ``RECORD_RUN`` and ``SAVE_STATE`` (``_store.redis.scripts``) write only
while the job's lock holds a value of the caller's term, checked inside Redis
(``_store.redis.checkpoints``; the memory store mimics them). Each sets the record's TTL to the
checkpoint retention, and every renewal of the lock by ``ELECT`` pushes it back, so that only
the record of a job no node leads any more expires. ``MemoryLeaseStore`` does the same on its
injected clock.

A record that is not one (a key of another type, a hash without a whole-number
``iteration``) reads as no checkpoint (None), with a warning, and the next fenced write
replaces it: readers and writers agree on what counts as a record. In a record, a field that
does not parse reads as None, with a warning. Reading never raises for what it finds.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias, Union

from ._errors import ConfigurationError
from ._lock_value import MAX_TOKEN
from ._odd import level
from ._outcomes import Outcome

if TYPE_CHECKING:
    pass

__all__ = [
    "DEFAULT_CHECKPOINT_RETENTION_S",
    "DEFAULT_CHECKPOINT_TIMEOUT_S",
    "DEFAULT_MAX_STATE_BYTES",
    "MAX_ERROR_CHARS",
    "Checkpoint",
    "FinishedRun",
    "Recorded",
    "StateSave",
    "JSONValue",
    "ITERATION_DIGITS",
    "checked",
    "digits",
    "encode_state",
    "from_unix_us",
    "not_a_record",
    "to_unix_us",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_STATE_BYTES = 64 * 1024
"""Largest state ``encode_state`` accepts by default: bytes of its UTF-8 JSON text."""
MAX_ERROR_CHARS = 500
"""A run's error is stored cut to this many characters (ending in an ellipsis)."""
DEFAULT_CHECKPOINT_RETENTION_S = 30 * 24 * 3600.0
"""How long a record outlives the last node that led its job: 30 days, so that a fleet
stopped for a long weekend or a holiday keeps its cursors, while the record of a removed job
(a few hundred bytes to ``DEFAULT_MAX_STATE_BYTES``) goes within a month."""
DEFAULT_CHECKPOINT_TIMEOUT_S = 5.0
"""Bound of one checkpoint call to Redis when the caller gives none; then ``ConnectionError``."""

JSONValue: TypeAlias = Union[  # noqa: UP007 (a recursive alias needs the string references)
    None, bool, int, float, str, list["JSONValue"], dict[str, "JSONValue"]
]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_US = timedelta(microseconds=1)
ITERATION_DIGITS = 18  # HINCRBY's 64 bits; the scripts repair a longer count the same way


class FinishedRun(NamedTuple):
    """A run to record in its job's checkpoint, fenced by its term (``record_runs``). Its end
    is not in it: the store stamps the record with its own clock when it writes it."""

    job: str
    token: int
    """The fencing token of the term that ran it."""
    node_id: str
    outcome: Outcome
    scheduled_at: datetime
    error: str | None
    """What the run raised, in a line; cut to ``MAX_ERROR_CHARS`` when stored."""
    retention_s: float
    """How long the record outlives the last write while no node leads the job."""
    started_at: datetime | None = None
    """When the run's code began (its history entry), on this node's clock."""
    duration_s: float = 0.0
    """How long the run took (its history entry)."""
    history: int = 0
    """How many entries the job's history keeps (``_history``); 0: none, nothing added."""
    missed: str | None = None
    """Not a run but an instant the leader did not run, and why (a ``DropReason`` value):
    only a history entry, the checkpoint is left as it is."""
    instants: int = 1
    """A missed entry: how many instants it stands for, from ``scheduled_at`` on (0: more
    than were counted)."""
    last_at: datetime | None = None
    """A missed entry of more than one instant: the last one, when known."""


@dataclass(frozen=True, slots=True)
class Recorded:
    """What the store says of the runs one ``record_runs`` call recorded."""

    at: datetime
    """The store's clock when it wrote them: their records' ``last_completed_at``."""
    iterations: list[int | None]
    """For each run, in order: its job's ``iteration`` after the write, or None when its
    term no longer held the lock (nothing written)."""


@dataclass(frozen=True, slots=True)
class StateSave:
    """A state to store in its job's checkpoint, fenced by its term (``save_state``)."""

    job: str
    token: int
    """The fencing token of the term that saves it."""
    node_id: str
    state_json: str
    """The state as ``encode_state`` made it."""
    retention_s: float


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A job's progress as stored in Redis, the same from every replica."""

    iteration: int
    """Successful runs of the job, cluster-wide, across restarts and leaders (0 while the first
    run has only saved state)."""
    last_completed_at: datetime | None = None
    """When the last recorded run ended (UTC), whatever its outcome, by the store's clock
    (Redis ``TIME`` when the run was recorded), not by the clock of the node that ran it."""
    last_scheduled_at: datetime | None = None
    """The tick or cron instant of that run (UTC)."""
    last_outcome: str | None = None
    """How it ended: ``"success"``, ``"failed"``, ``"timeout"`` or ``"cancelled"``."""
    last_error: str | None = None
    """Its error, at most ``MAX_ERROR_CHARS`` characters; None after a success."""
    node_id: str | None = None
    """The node that wrote the record last."""
    fencing_token: int | None = None
    """The leadership term that wrote the record last."""
    state: JSONValue = None
    """The job's state as last saved (a JSON value), or None."""


def to_unix_us(moment: datetime) -> int:
    """Whole µs since the Unix epoch of an aware ``moment``, exactly."""
    if moment.tzinfo is None:
        raise ValueError(f"{moment!r} has no time zone; pass an aware datetime")
    return (moment - _EPOCH) // _ONE_US


def from_unix_us(us: int) -> datetime:
    """The aware UTC instant ``us`` µs after the Unix epoch (``to_unix_us``'s inverse)."""
    return _EPOCH + us * _ONE_US


def digits(text: str, most: int = len(str(MAX_TOKEN))) -> int:
    if not (0 < len(text) <= most and text.isascii() and text.isdigit()):
        raise ValueError(f"{text[:30]!r} is not a whole number of at most {most} digits")
    return int(text)


# Field of the hash -> (attribute of Checkpoint, parser of the field's text).
_FIELDS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "last_completed_us": ("last_completed_at", lambda text: from_unix_us(digits(text))),
    "last_scheduled_us": ("last_scheduled_at", lambda text: from_unix_us(digits(text))),
    "last_outcome": ("last_outcome", str),
    "last_error": ("last_error", str),
    "node_id": ("node_id", str),
    "fencing_token": ("fencing_token", digits),
    "state": ("state", json.loads),
}


def _parse(fields: Mapping[str, str | bytes]) -> tuple[Checkpoint | None, list[str]]:
    """The checkpoint in a record's fields (None when it is not a record), and the names of
    the fields that did not parse and read as None."""
    try:
        raw = fields["iteration"]
        iteration = digits(raw.decode() if isinstance(raw, bytes) else raw, ITERATION_DIGITS)
    except (KeyError, ValueError):
        return None, ["iteration"]
    values: dict[str, Any] = {}
    bad = []
    for name, (attribute, parse) in _FIELDS.items():
        value = fields.get(name)
        if value is not None:
            try:
                values[attribute] = parse(value.decode() if isinstance(value, bytes) else value)
            except (ValueError, OverflowError, RecursionError):  # UnicodeError is a ValueError
                bad.append(name)
    return Checkpoint(iteration, **values), bad


def checked(job: str, fields: Mapping[str, str | bytes] | None) -> Checkpoint | None:
    """``_parse``, saying what was wrong with the record, if anything."""
    if not fields:
        return None
    checkpoint, bad = _parse(fields)
    if checkpoint is None:
        not_a_record(job, "a hash without a whole-number iteration")
    elif bad:
        logger.log(
            level(f"the checkpoint of job {job!r}", ", ".join(bad)),
            "the checkpoint of job %r has fields that do not parse (%s): they read as None "
            "until a write replaces them; reset the checkpoint to start afresh",
            job,
            ", ".join(bad),
        )
    return checkpoint


def not_a_record(job: str, what: str) -> None:
    """Say once (``_odd.level``: a view polled every second reads it each time) that the
    checkpoint key of ``job`` holds ``what``, which is no record."""
    logger.log(
        level(f"the checkpoint key of job {job!r}", what),
        "the checkpoint key of job %r holds %s, not a record this library writes: it reads as "
        "no checkpoint, and the job's next fenced write replaces it (reset the checkpoint to "
        "delete it now)",
        job,
        what,
    )


def encode_state(job: str, value: object, max_bytes: int = DEFAULT_MAX_STATE_BYTES) -> str:
    """The JSON text of ``value``, a job's state, or ``ConfigurationError`` saying why not.

    ``value`` must come back from JSON equal to itself: dicts with str keys, lists, str, int,
    float (finite), bool and None, nested at will; a tuple, a non-str key or a datetime is
    refused rather than silently changed. Its UTF-8 text may take at most ``max_bytes``.
    Call it before any Redis traffic: a bad value fails without a round trip.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ConfigurationError(
            f"max_state_bytes={max_bytes!r} must be a whole number of bytes of at least 1, "
            f"such as {DEFAULT_MAX_STATE_BYTES} (the default)",
            job=job,
            field="max_state_bytes",
        )
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        size = len(text.encode())
        same = size > max_bytes or json.loads(text) == value
    except (TypeError, ValueError, RecursionError):
        same = False
    if not same:
        reason = _not_json(value) or "it does not come back from JSON equal to itself"
        raise ConfigurationError(
            f"save_state() takes a JSON value, and {reason}; pass dicts with str "
            "keys, lists, str, int, finite float, bool and None, such as "
            '{"after_id": 1234}',
            job=job,
            field="state",
        )
    if size > max_bytes:
        raise ConfigurationError(
            f"the state takes {size} bytes as JSON, more than the limit of {max_bytes} bytes; "
            "save a cursor (an id or a timestamp to resume from) rather than the data itself, "
            "or raise max_state_bytes",
            job=job,
            field="state",
        )
    return text


def _not_json(value: object) -> str:
    """Where and why ``value`` is not a JSON value that round-trips, for the error message."""
    try:
        return _why_not_json(value, "the state", frozenset())
    except UnicodeEncodeError:
        return "a str in it has a lone surrogate (it is not valid Unicode)"
    except RecursionError:
        return "it is nested too deeply"


def _why_not_json(value: object, path: str, seen: frozenset[int]) -> str:
    if id(value) in seen:
        return f"{path} contains itself"
    if isinstance(value, (dict, list)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(value, dict) and not isinstance(key, str):
                return f"{path} has the key {key!r} ({type(key).__name__}, not str)"
            found = _why_not_json(item, f"{path}[{key!r}]", seen | {id(value)})
            if found:
                return found
        return ""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{path} is {value!r}"
    if isinstance(value, str):
        value.encode()  # raises for a lone surrogate: JSON text is UTF-8
    if value is None or isinstance(value, (str, bool, int, float)):
        return ""
    return f"{path} is of type {type(value).__name__}"
