"""The encoding both stores share: the ``RECORD_RUN`` and ``SAVE_STATE`` arguments (checked),
and how the cluster read names jobs and reads a job's last claimed instant. The memory store
checks its arguments with the same functions the Redis store encodes them with, so both
refuse the same values and write the same records."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from .._checkpoint import MAX_ERROR_CHARS, FinishedRun, digits, to_unix_us
from .._config.settings import is_name
from .._lock_value import MAX_TOKEN
from .._outcomes import OUTCOME_WORDS, DropReason
from .membership import MemberRecord

__all__ = [
    "LAST_INSTANT_US",
    "job_names",
    "last_us",
    "retention_ms",
    "RunArgs",
    "run_arg",
    "shorten_error",
    "token_text",
]

logger = logging.getLogger("fastapi_singletonjob.store")

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_US = timedelta(microseconds=1)


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
    """One run's part of ``RECORD_RUN``'s ``ARGV`` (``RunArgs``), checked: ``"<kind>
    <outcome> <scheduled µs> <started µs> <duration µs> <token> <retention ms> <history>
    <job> <node id>"``, a line break, then the error's length in UTF-8 bytes, a colon and the
    error (``"0:"`` for none): a job name has no space, a node id is printable text without
    a line break, so each run ends where its error does. The kind is ``r`` for a run, ``m``
    for a missed instant, whose outcome is then the reason, and whose started and duration
    fields are the last instant it stands for (µs, 0: the same) and how many (0: more than
    were counted). The run's end is not in it: the store stamps it with its own clock. What
    the records of one term share comes after the run's own fields (``RunArgs`` encodes it
    once)."""
    return _own_part(run) + _term_part(run) + _error_part(run.error)


class RunArgs:
    """``RECORD_RUN``'s ``ARGV`` for the runs of many jobs, in one value: their
    ``run_arg``s one after the other, UTF-8. Each term's part of a run (its token,
    retention, history, job and node id, checked) is encoded once per job and term rather
    than once per record, and an instant shared by the records of one call (the jobs of one
    fixed-rate instant) once per call: hundreds of records go in one call, and each costs
    the client a fraction of a tick."""

    __slots__ = ("_terms",)

    def __init__(self) -> None:
        self._terms: dict[str, tuple[int, float, int, str, str]] = {}
        """Per job: the token, retention, history and node id of its last record, and the
        term part they make (``_term_part``). The last three are the same objects from run
        to run (its ``Progress``'s), so they are told apart by identity (a new object only
        costs an encoding more)."""

    def __call__(self, runs: Sequence[FinishedRun]) -> bytes:
        """The ``run_arg`` of each of ``runs``, in order, as one value."""
        terms = self._terms
        words = OUTCOME_WORDS
        parts: list[str] = []
        add = parts.append
        instant: datetime | None = None
        instant_us = 0
        for run in runs:
            (job, token, node_id, outcome, scheduled_at, error, retention, started_at) = run[:8]
            duration_s, history, missed = run[8], run[9], run[10]
            known = terms.get(job)
            if (
                known is None
                or known[0] != token
                or known[1] is not retention
                or known[2] is not history
                or known[3] is not node_id
            ):
                known = terms[job] = (token, retention, history, node_id, _term_part(run))
            word = words.get(outcome)
            if missed is None and started_at is not None and word is not None:
                # A run's own part, inline (hundreds per call): to_unix_us's arithmetic, and
                # a naive instant fails it as there (TypeError: then _own_part says why).
                try:
                    if scheduled_at is not instant:
                        instant_us = (scheduled_at - _EPOCH) // _ONE_US
                        instant = scheduled_at
                    started_us = (started_at - _EPOCH) // _ONE_US
                except TypeError:
                    own = _own_part(run)
                else:
                    took_us = round(duration_s * 1e6)
                    own = f"r {word} {instant_us} {started_us} {took_us if took_us > 0 else 0} "
            else:
                own = _own_part(run)
            add(f"{own}{known[4]}{_error_part(error) if error else '0:'}")
        return "".join(parts).encode()


def _own_part(run: FinishedRun) -> str:
    """``run_arg``'s fields that are the record's own, up to the token, with a space after."""
    if run.missed is None:
        word = OUTCOME_WORDS.get(run.outcome)
        if word is None:
            raise ValueError(f"outcome={run.outcome!r} is not an Outcome")
        started = 0 if run.started_at is None else to_unix_us(run.started_at)
        return (
            f"r {word} {to_unix_us(run.scheduled_at)} {started} "
            f"{max(0, round(run.duration_s * 1e6))} "
        )
    word = DropReason(run.missed).value
    started = 0 if run.last_at is None else to_unix_us(run.last_at)
    count = run.instants
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"instants={count!r} is not a number of instants")
    return f"m {word} {to_unix_us(run.scheduled_at)} {started} {count} "


def _term_part(run: FinishedRun) -> str:
    """``run_arg``'s fields from the token on, which the records of one term share, up to
    the line break before the error."""
    if "\n" in run.node_id:
        raise ValueError(f"node_id={run.node_id!r} has a line break")
    if not is_name(run.job):  # RECORD_RUN builds the job's keys from it
        raise ValueError(f"job={run.job!r} is not a job name")
    return (
        f"{token_text(run.token)} {retention_ms(run.retention_s)} {int(run.history)} "
        f"{run.job} {run.node_id}\n"
    )


def _error_part(error: str | None) -> str:
    """``run_arg``'s last field: the error's length in UTF-8 bytes, a colon, the error."""
    if not error:
        return "0:"
    text = shorten_error(error)
    return f"{len(text) if text.isascii() else len(text.encode())}:{text}"


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
