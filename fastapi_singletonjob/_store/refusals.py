"""Store errors that no retry can mend: Redis answered, and said no. A password missing or
wrong, a database index out of range, a command or key the ACL user may not use. They are told
apart from a Redis that does not answer (which comes back on its own), so that a node says
what to fix, once, at ERROR, and retries slowly until someone does.

Only redis-py's exception types and Redis's own words are read; the texts never hold a
credential (Redis does not echo one, and the fixes name placeholders)."""

from __future__ import annotations

from dataclasses import dataclass

from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

__all__ = ["Refusal", "refusal"]


@dataclass(frozen=True, slots=True)
class Refusal:
    """Redis refused this node, and what to change so that it does not."""

    what: str
    """What Redis said, in words (``a password is required, and the URL gives none``)."""
    fix: str
    """How to fix it (``put the password in the URL: redis://:PASSWORD@host:6379/0``)."""

    def __str__(self) -> str:
        return f"{self.what}: {self.fix}"


_PASSWORD_FORM = "redis://:PASSWORD@host:6379/0, or redis://USER:PASSWORD@host:6379/0"
_ACL_FIX = (
    "give the user the ACL rule of the docs (redis.md, 'Access control'): its commands, the "
    "keys ~singletonjob:{PROJECT}:* and the channel &singletonjob:{PROJECT}:released"
)


def refusal(exc: BaseException) -> Refusal | None:
    """The refusal ``exc`` reports, or None when it is no permanent error (a timeout, a
    connection refused or reset, a Redis loading its data: those pass)."""
    said = str(exc)
    lowered = said.lower()
    if isinstance(exc, AuthenticationError):
        if "without any password configured" in lowered:
            return Refusal(
                "the server has no password set, and the URL gives one",
                "remove the password from the URL (redis://host:6379/0), or set one on the "
                "server (requirepass, or an ACL user)",
            )
        if "invalid username-password" in lowered or "invalid password" in lowered:
            return Refusal(
                "wrong user name or password (WRONGPASS), or the user is disabled",
                f"check them, percent-encoded, in the URL: {_PASSWORD_FORM}; an ACL user "
                "must be 'on'",
            )
        # NOAUTH: "Authentication required", or "HELLO must be called with the client
        # already authenticated" (the RESP3 handshake of a client without a password).
        return Refusal(
            "a password is required, and the URL gives none (NOAUTH)",
            f"put the password in the URL: {_PASSWORD_FORM}",
        )
    if isinstance(exc, NoPermissionError):
        return Refusal(f"the ACL user lacks a permission (NOPERM: {said})", _ACL_FIX)
    if isinstance(exc, ResponseError) and "db index is out of range" in lowered:
        return Refusal(
            "the database index of the URL is out of range",
            "use one below the server's 'databases' setting (16 by default, numbered from "
            "0): redis://host:6379/0",
        )
    return None
