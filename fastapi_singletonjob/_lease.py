"""A job's lease as this node sees it, and lock values: the one place that builds and parses
``"<fencing token>|<owner id>"`` (the Lua scripts in ``_scripts.py`` write the same form), and
owner ids ``"<node id>#<instance nonce>"``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

__all__ = [
    "MAX_TOKEN",
    "OWNER_SEPARATOR",
    "SHOWN_VALUE_CHARS",
    "Lease",
    "LeaseView",
    "is_lock_value",
    "lock_value",
    "node_of",
    "parse_lock_value",
    "shown_lock_value",
]

MAX_TOKEN = 2**63 - 1
"""The largest fencing token a lock value can carry (a signed 64-bit integer)."""
_MAX_TOKEN_DIGITS = len(str(MAX_TOKEN))  # 19; also keeps int() far below Python's digit limit
SHOWN_VALUE_CHARS = 100
"""A lock value that this library did not write is shown cut to this many characters."""

OWNER_SEPARATOR = "#"


def node_of(owner: str | None) -> str | None:
    """The node id part of a lock owner ``"<node id>#<instance nonce>"``."""
    if owner is None:
        return None
    node, sep, _ = owner.rpartition(OWNER_SEPARATOR)
    return node if sep else owner


def lock_value(token: int, owner: str) -> str:
    """The lock value of ``owner``'s term ``token`` (as the ``ELECT`` script writes it)."""
    return f"{token}|{owner}"


def parse_lock_value(value: str | None) -> tuple[int | None, str | None]:
    """Split ``"<token>|<owner id>"``; a value written by something else has no token.

    The token must be 1 to 19 ASCII digits and fit a signed 64-bit integer, the owner id must
    not be empty: anything else, however long or odd, is returned whole as ``(None, value)``
    and never raises.
    """
    if value is None:
        return None, None
    token, sep, owner = value.partition("|")
    if (
        sep
        and owner
        and 0 < len(token) <= _MAX_TOKEN_DIGITS
        and token.isascii()
        and token.isdigit()
        and 0 < int(token) <= MAX_TOKEN
    ):
        return int(token), owner
    return None, value


def is_lock_value(value: str | None) -> bool:
    """True for a value of the form this library writes, ``"<token>|<owner id>"``: only
    such a value can be a node's own, to renew, claim with or release."""
    return parse_lock_value(value)[0] is not None


def shown_lock_value(value: str) -> str:
    """``value`` fit for logs and status: unprintable characters escaped, cut to
    ``SHOWN_VALUE_CHARS`` characters (then ending in an ellipsis)."""
    shown = value if value.isprintable() else repr(value)[1:-1]
    if len(shown) > SHOWN_VALUE_CHARS:
        return shown[:SHOWN_VALUE_CHARS] + "\u2026"
    return shown


_ENDED = asyncio.Event()
_ENDED.set()  # waited on only while set, so never bound to an event loop


class LeaseView(Protocol):
    """A lease as everything but the election sees it: read-only (``Terms`` writes it)."""

    @property
    def job(self) -> str: ...
    @property
    def ttl_s(self) -> float: ...
    @property
    def token(self) -> int | None:
        """Fencing token of this node's current term; None while it does not lead."""

    @property
    def holder(self) -> str | None:
        """Node id of the lock's holder, as last observed."""

    @property
    def holder_token(self) -> int | None: ...
    @property
    def paused(self) -> bool:
        """Whether an operator paused the job (as the last election reply said)."""

    def lost_of(self, token: int) -> asyncio.Event:
        """The "leadership lost" signal of the term ``token``."""


@dataclass(eq=False, slots=True)
class Lease:
    """This node's view of one job's lock; changed only by ``Terms`` (``_terms.py``)."""

    job: str
    ttl_s: float
    retention_s: float | None = None
    """How long the job's checkpoint outlives this node's last renewal; None: no checkpoint."""
    token: int | None = None
    """Fencing token of this node's current term; None while it does not lead."""
    value: str | None = None
    """The lock value this node last held, for a compare-and-delete release."""
    deadline: float = float("-inf")
    """Monotonic instant until which this node may act as leader."""
    holder: str | None = None
    holder_token: int | None = None
    holder_ttl_s: float | None = None
    observed_at: float | None = None
    """Monotonic time of the request that last reported on this lock."""
    terms: int = 0
    wanted: bool = True
    acquire_error: str | None = None
    """Why the last attempt to acquire the free lock failed, if it did."""
    lost_event: asyncio.Event | None = None
    """The current term's "leadership lost" signal, made when first asked for (``lost``)."""
    running: bool = False
    """True while a run of the job is in flight on this node (reported by the runner)."""
    ended_token: int | None = None
    """Token of the last term this node ended: a late reply renewing that term's value does
    not start it again (a term, once ended, stays ended; the lock then expires)."""
    last_started: datetime | None = None
    """Instant of the last run this node started (reported by the runner);
    recorded in the store on release, so that a successor never runs it again."""
    paused: bool = False
    """Paused by an operator (``jobs.pause``), as the last election reply said: no new run."""
    stepping_down: bool = False
    """An operator asked this node to hand the job over: released once no run is in flight."""
    rest_until: float = float("-inf")
    """Monotonic instant until which this node does not compete for the job (after a
    step-down, so that another node takes it over)."""

    def lost_of(self, token: int) -> asyncio.Event:
        """The "leadership lost" signal of the term ``token``: this term's, or a set one when
        that term has ended (a later term has a signal of its own)."""
        return self.lost if self.token == token else _ENDED

    @property
    def lost(self) -> asyncio.Event:
        """The current term's "leadership lost" signal: a fresh event per term, set when the
        term ends (and already set while the node leads no term). Made on first use: an
        ``asyncio.Event`` costs ~0.7 KB, and most terms of most jobs never need one."""
        if self.lost_event is None:
            self.lost_event = asyncio.Event()
            if self.token is None:
                self.lost_event.set()
        return self.lost_event
