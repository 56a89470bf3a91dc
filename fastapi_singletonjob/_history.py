"""A job's run history: its last occurrences, cluster-wide, newest first.

One Redis list per job (``_store.keys.job_key``, kind ``history``), next to its checkpoint and
written only by its leader, in the same fenced script call that records each run
(``RECORD_RUN``: no round trip of its own): an entry per run, and one per instant the leader
did not run, with the reason. The list keeps the last ``history`` entries (``DEFAULT_HISTORY``;
0 keeps none) and expires with the checkpoint. Each entry is one JSON object of short keys,
written by the script (and by the memory store, in ``history_entry``, the same way):

=======  ==========================================================================
key      content
=======  ==========================================================================
``k``    ``"run"``, or ``"missed"``: an instant the leader did not run
``at``   the run's tick or cron instant, µs since the epoch (as the node saw it)
``st``   when the run's code began (µs, the node's clock); a missed instant: absent
``end``  when the store recorded it (µs, the store's clock: Redis ``TIME``)
``d``    the run's duration in µs, as the node measured it; a missed instant: absent
``n``    the node that ran it, or that did not
``t``    the fencing token of its term, as text (tokens take 64 bits)
``o``    the run's outcome (``Outcome``), or the missed instant's reason (``DropReason``)
``e``    the run's error, shortened (``MAX_ERROR_CHARS``); absent after a success
``c``    a missed entry that stands for more than one instant: how many, from ``at``
         on (0: more than were counted); absent for one
``to``   with ``c``: the last instant it stands for (µs), when known
=======  ==========================================================================

Where the history stands is kept in the checkpoint record (field ``history``, written by
``RECORD_RUN`` with each entry): ``"<latest µs>:<token>:<before µs>"``, the latest instant an
entry stands for, the term that wrote it, and the latest instant of the terms before it
(``""`` when none). A new leader reads it with the checkpoint (``cursor_of``) and records the
instants of the schedule after it that no node ran (``_run.misfire.gap``: "no leader", or
"misfire skipped" where a misfire policy chose not to run them); those of its own term are
not taken for another's, even when its first entries reach Redis before its read.

Reading never raises for what it finds: an entry that is not one is left out, and said once
(``_odd``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ._checkpoint import from_unix_us
from ._errors import ConfigurationError
from ._odd import odd_value
from ._outcomes import DropReason, Outcome

__all__ = [
    "DEFAULT_HISTORY",
    "MAX_HISTORY",
    "MISSED_REASONS",
    "Occurrence",
    "check_history",
    "check_limit",
    "cursor_of",
    "history_entry",
    "next_mark",
    "parse_entries",
]

logger = logging.getLogger(__name__)

DEFAULT_HISTORY = 100
"""Occurrences kept per job by default: about 20 KB of Redis per job at 200 bytes each."""
MAX_HISTORY = 10_000
"""The most a job keeps (a list trimmed at each write: its cost grows with it)."""

MISSED_REASONS: dict[str, str] = {
    DropReason.OVERLAP.value: "the previous run was still going (ticks are dropped, never queued)",
    DropReason.LATE.value: "the leader woke after the instant's grace (a stall): not replayed",
    DropReason.LEASE_EXPIRED.value: "the leader's lease ran out before the run could start",
    DropReason.ALREADY_RUN.value: "another leader had already run this instant",
    DropReason.CLOCK_AHEAD.value: "the leader's wall clock was ahead of Redis's: not run",
    DropReason.STORE_ERROR.value: "Redis did not answer the instant's claim within its grace",
    DropReason.PAUSED.value: "an operator had paused the job",
    DropReason.NO_LEADER.value: "no node led the job (its leader was killed or stopping): "
    "recorded by the next leader",
    DropReason.MISFIRE_SKIPPED.value: "no node led the job, and the next leader did not run "
    "it, as misfire= says",
}
"""Why an instant did not run, in a line, by reason (``Occurrence.reason``)."""


@dataclass(frozen=True, slots=True)
class Occurrence:
    """One entry of a job's history: a run, or an instant its leader did not run."""

    scheduled_at: datetime
    """The run's tick or cron instant (UTC)."""
    missed: bool
    """True for an instant that did not run (``reason`` says why), False for a run."""
    node_id: str
    """The node that ran it, or that did not."""
    fencing_token: int
    """The leadership term it belongs to."""
    recorded_at: datetime
    """When the store recorded it, on the store's clock."""
    started_at: datetime | None = None
    """When the run's code began, on its node's clock; None for a missed instant."""
    duration_s: float | None = None
    """How long the run took, as its node measured it; None for a missed instant."""
    outcome: str | None = None
    """The run's outcome (``"success"``, ``"failed"``, ``"timeout"``, ``"cancelled"``)."""
    reason: str | None = None
    """Why the instant did not run (a ``DropReason`` value; ``MISSED_REASONS`` explains it)."""
    error: str | None = None
    """The run's error, shortened; None after a success."""
    count: int | None = 1
    """How many instants the entry stands for: 1, or, for an entry that sums up instants
    not run from ``scheduled_at`` on, how many (None: more than were counted)."""
    last_at: datetime | None = None
    """With a ``count`` above 1: the last instant it stands for, when known."""


def check_history(value: object, *, job: str | None = None) -> int:
    """Validate a ``history`` setting: a whole number of entries from 0 (none) to
    ``MAX_HISTORY``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_HISTORY:
        raise ConfigurationError(
            f"history={value!r} must be a whole number of runs to keep, from 0 (keep none) to "
            f"{MAX_HISTORY}; pass e.g. history={DEFAULT_HISTORY} (the default)",
            job=job,
            field="history",
        )
    return value


def check_limit(limit: object) -> int:
    """Validate how many entries a history read asks for: 1 to ``MAX_HISTORY``."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_HISTORY:
        raise ConfigurationError(
            f"limit={limit!r} must be a whole number of entries from 1 to {MAX_HISTORY}; "
            f"pass e.g. limit={DEFAULT_HISTORY}",
            field="limit",
        )
    return limit


def history_entry(
    *,
    missed: bool,
    scheduled_us: int,
    started_us: int,
    duration_us: int,
    recorded_us: int,
    node_id: str,
    token: str,
    outcome: str,
    error: str,
    count: int = 1,
    last_us: int = 0,
) -> str:
    """The JSON text of one entry, as ``RECORD_RUN`` writes it (the memory store's copy)."""
    entry: dict[str, Any] = {"k": "missed" if missed else "run", "at": scheduled_us}
    if not missed:
        entry.update(st=started_us, d=duration_us)
    entry.update(end=recorded_us, n=node_id, t=token, o=outcome)
    if error:
        entry["e"] = error
    if missed and count != 1:
        entry["c"] = count
        if last_us > scheduled_us:
            entry["to"] = last_us
    return json.dumps(entry, ensure_ascii=False, separators=(",", ":"))


def next_mark(mark: str | None, token: str, latest_us: int) -> str:
    """The checkpoint's ``history`` field after an entry of term ``token`` that stands for
    instants up to ``latest_us`` (as ``RECORD_RUN`` writes it: the memory store's copy)."""
    at, by, before = _mark(mark)
    if by != token:  # a new term's first entry: what came before it is kept apart
        before = at
    if at is None or latest_us > at:
        at = latest_us
    return f"{at}:{token}:{'' if before is None else before}"


def cursor_of(mark: str | None, token: int, job: str = "") -> int | None:
    """The latest instant (µs) the history accounts for before term ``token``, read from
    job ``job``'s checkpoint's ``history`` field; None when it has none (a first term, a
    reset checkpoint, a record from before this field, or a value no script writes, which
    is said once: the next entry replaces it)."""
    at, by, before = _mark(mark)
    if mark and at is None:
        odd_value(f"the history mark of job {job!r}", mark, "read as none: no gap is looked for")
    return before if by == str(token) else at


def _mark(mark: str | None) -> tuple[int | None, str, int | None]:
    parts = (mark or "").split(":")
    if len(parts) != 3 or not all(p.isascii() and p.isdigit() for p in parts[:2]):
        return None, "", None
    before = parts[2]
    if before and not (before.isascii() and before.isdigit()):
        return None, "", None
    return int(parts[0]), parts[1], int(before) if before else None


def parse_entries(job: str, raw: list[Any]) -> list[Occurrence]:
    """The occurrences in ``raw`` (a history list as read, newest first); an entry that is not
    one is left out, and said once."""
    out = []
    for item in raw:
        text = item.decode(errors="replace") if isinstance(item, bytes) else str(item)
        occurrence = _parse(text)
        if occurrence is None:
            odd_value(f"the history of job {job!r}", text, "left out of the history read")
        else:
            out.append(occurrence)
    return out


def _parse(text: str) -> Occurrence | None:
    try:
        entry = json.loads(text)
        if not isinstance(entry, dict) or entry.get("k") not in ("run", "missed"):
            return None
        missed = entry["k"] == "missed"
        node, token, word = entry["n"], entry["t"], entry["o"]
        if not (isinstance(node, str) and isinstance(word, str) and isinstance(token, str)):
            return None
        if not (token.isascii() and token.isdigit()):
            return None
        error = entry.get("e")
        started = None if missed else from_unix_us(_whole(entry["st"]))
        duration = None if missed else _whole(entry["d"]) / 1e6
        return Occurrence(
            scheduled_at=from_unix_us(_whole(entry["at"])),
            missed=missed,
            node_id=node,
            fencing_token=int(token),
            recorded_at=from_unix_us(_whole(entry["end"])),
            started_at=started,
            duration_s=duration,
            outcome=None if missed else Outcome(word).value,
            reason=DropReason(word).value if missed else None,
            error=error if isinstance(error, str) else None,
            count=_count(entry.get("c", 1)) if missed else 1,
            last_at=from_unix_us(_whole(entry["to"])) if missed and "to" in entry else None,
        )
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
        return None


def _count(value: object) -> int | None:
    count = _whole(value)
    return count or None


def _whole(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a whole number of µs")
    return value
