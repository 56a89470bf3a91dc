"""Values in Redis that no script of this library writes, as the readers report them.

Anything that can write a project's keys may leave one there: an operator's ``redis-cli``, a
stray tool, a future version. No reader raises for it (one that did would stop the election
round of every job, or the cluster view): the parse helper of each stored value
(``membership``, ``keys``, ``records``, ``redis.controls``) reads it as absent and reports it
here, which logs a WARNING once per process for each place and value, however often it is
read (a view polled every second, an election round every heartbeat). The script that owns the
key deletes or replaces it (``_store.redis.scripts``); ``ELECT`` tells its caller what it
deleted, which ``deleted`` logs.
"""

from __future__ import annotations

import logging

__all__ = ["MAX_REMEMBERED", "SHOWN_CHARS", "deleted", "forget", "level", "odd_type", "odd_value"]

logger = logging.getLogger("fastapi_singletonjob.store")

MAX_REMEMBERED = 1000
"""How many places and values are remembered as reported; past that, each new one is logged at
DEBUG only, so that a writer of endless odd values can neither grow the set nor flood the log."""

SHOWN_CHARS = 40
"""An odd value is shown cut to this many characters."""

_reported: set[tuple[str, str]] = set()


def odd_value(where: str, value: str, treated: str) -> None:
    """Report that ``where`` (a key, or an entry of one) holds ``value``, which no script of
    this library writes, and how the reader treats it (``treated``)."""
    shown = repr(value[:SHOWN_CHARS]) + ("\u2026" if len(value) > SHOWN_CHARS else "")
    _once(where, shown, treated)


def odd_type(key: str, treated: str) -> None:
    """Report that ``key`` is of another Redis type than the library's (a list where a hash
    belongs), and how the reader treats it (``treated``)."""
    _once(key, "a key of another type", treated)


def deleted(what: str) -> None:
    """``ELECT`` deleted or replaced ``what`` (its own words: the key or entry, and the value it
    held cut to 40 bytes), which no script of this library writes; each is said once, as it
    happens once."""
    shown = what if what.isprintable() else repr(what)[1:-1]
    logger.warning("the election deleted %s (no node of this library writes that)", shown)


def level(where: str, shown: str) -> int:
    """The level to report ``shown``, found in ``where``, at: WARNING the first time in this
    process (of the first ``MAX_REMEMBERED``), DEBUG after."""
    seen = (where, shown)
    if seen in _reported or len(_reported) >= MAX_REMEMBERED:
        return logging.DEBUG
    _reported.add(seen)
    return logging.WARNING


def forget() -> None:
    """Forget what was reported (each test starts afresh, as a new process would)."""
    _reported.clear()


def _once(where: str, shown: str, treated: str) -> None:
    logger.log(
        level(where, shown),
        "%s holds %s, not a value this library writes: %s",
        where,
        shown,
        treated,
    )
