"""The encoding both stores share: the ``RECORD_RUN`` and ``SAVE_STATE`` arguments (checked),
and how the cluster read names jobs and reads a job's last claimed instant. The memory store
checks its arguments with the same functions the Redis store encodes them with, so both
refuse the same values and write the same records."""

from __future__ import annotations

import logging
import math
from datetime import UTC, datetime

from .._checkpoint import MAX_ERROR_CHARS, FinishedRun, digits, to_unix_us
from .._lock_value import MAX_TOKEN
from .._outcomes import DropReason, Outcome
from .membership import MemberRecord

__all__ = [
    "LAST_INSTANT_US",
    "job_names",
    "last_us",
    "retention_ms",
    "run_arg",
    "shorten_error",
    "token_text",
]

logger = logging.getLogger("fastapi_singletonjob.store")


def shorten_error(error: str | None) -> str:
    """``error`` cut to ``MAX_ERROR_CHARS``, as text Redis takes ("" for none)."""
    if not error:
        return ""
    if len(error) > MAX_ERROR_CHARS:
        error = error[: MAX_ERROR_CHARS - 1] + "\u2026"
    return error.encode(errors="replace").decode()  # a lone surrogate would fail the write


def token_text(token: int) -> str:
    """A fencing token as the scripts take it; ``ValueError`` for anything else."""
    if isinstance(token, bool) or not isinstance(token, int) or not 0 < token <= MAX_TOKEN:
        raise ValueError(f"token={token!r} is not a fencing token (1 to {MAX_TOKEN})")
    return str(token)


def retention_ms(retention_s: float) -> str:
    """A checkpoint retention in whole milliseconds (at least 1) as the scripts take it;
    ``ValueError`` unless it is a positive, finite number of seconds."""
    if not (isinstance(retention_s, (int, float)) and 0 < retention_s < math.inf):
        raise ValueError(f"retention_s={retention_s!r} must be a positive number of seconds")
    return str(max(1, round(retention_s * 1000)))


def run_arg(run: FinishedRun) -> str:
    """The ``ARGV`` entry of ``RECORD_RUN`` for ``run``, checked: one string, so that a call
    with hundreds of records costs redis-py's encoding four values per record (its three keys
    and this), not ten: ``"<kind> <token> <outcome> <scheduled µs> <retention ms> <started µs>
    <duration µs> <history> <node id>"``, a line break and the error, possibly empty (a node
    id is printable text, without a line break). The kind is ``r`` for a run, ``m`` for a
    missed instant, whose outcome is then the reason, and whose started and duration fields
    are the last instant it stands for (µs, 0: the same) and how many (0: more than were
    counted). The run's end is not in it: the store stamps it with its own clock."""
    if run.missed is None:
        kind, word = "r", Outcome(run.outcome).value
        started = 0 if run.started_at is None else to_unix_us(run.started_at)
        duration_us = max(0, round(run.duration_s * 1e6))
    else:
        kind, word = "m", DropReason(run.missed).value
        started = 0 if run.last_at is None else to_unix_us(run.last_at)
        count = run.instants
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"instants={count!r} is not a number of instants")
        duration_us = count
    return (
        f"{kind} {token_text(run.token)} {word} {to_unix_us(run.scheduled_at)} "
        f"{retention_ms(run.retention_s)} {started} {duration_us} {int(run.history)} "
        f"{run.node_id}\n{shorten_error(run.error)}"
    )


def job_names(members: list[tuple[MemberRecord, datetime]], controls: dict[str, str]) -> set[str]:
    """The jobs the cluster read reports: those a live member registered, and those a control
    names (the part of its field after the colon)."""
    names = {job for record, _ in members for job in record.jobs}
    names.update(key.partition(":")[2] for key in controls)
    names.discard("")
    return names


LAST_INSTANT_US = to_unix_us(datetime.max.replace(tzinfo=UTC))
"""The latest instant a ``last`` key can name and still be shown (9999-12-31, µs)."""


def last_us(raw: str | None) -> int | None:
    """A job's last claimed instant (µs) from its ``last`` key, None when it has none, or when
    what it holds is not an instant this library writes (written by hand or by another tool:
    non-ASCII digits, a number past year 9999, text), which is logged at DEBUG: the next claim
    or release of the job replaces it."""
    if not raw:
        return None
    head = raw.partition(":")[0]
    try:
        instant = digits(head, len(str(LAST_INSTANT_US)))
    except ValueError:
        instant = LAST_INSTANT_US + 1
    if instant > LAST_INSTANT_US:
        logger.debug("a last key holds %r, not an instant: read as none", raw[:40])
        return None
    return instant
