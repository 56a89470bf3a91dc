"""Lock values: the one place that builds and parses ``"<fencing token>|<owner id>"`` (the
Lua scripts in ``_store/redis/scripts.py`` write the same form), and owner ids
``"<node id>#<instance nonce>"``."""

from __future__ import annotations

__all__ = [
    "MAX_TOKEN",
    "OWNER_SEPARATOR",
    "SHOWN_VALUE_CHARS",
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
    be printable and not empty (a node id is printable, its nonce hex digits): anything else,
    however long or odd, is returned whole as ``(None, value)`` and never raises.
    """
    if value is None:
        return None, None
    token, sep, owner = value.partition("|")
    if (
        sep
        and owner
        and owner.isprintable()
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
