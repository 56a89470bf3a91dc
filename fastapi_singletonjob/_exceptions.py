"""Errors raised by fastapi-singletonjob.

The hierarchy, so that callers can see what they can catch::

    SingletonJobError
    └── ConfigurationError (also a ValueError)
            a setting or a job registration is invalid; raised at definition or startup,
            never at the first tick

Failures of Redis are not raised to the application: the election retries them with
backoff, logs them, and shows them in the status.

Losing leadership is not an error: it is a normal state, logged and shown in the status,
and a run that must stop because of it is cancelled (``asyncio.CancelledError``).
"""

from __future__ import annotations

__all__ = ["ConfigurationError", "SingletonJobError"]


class SingletonJobError(Exception):
    """Base class of every error this library raises."""


class ConfigurationError(SingletonJobError, ValueError):
    """Raised at definition or startup when a setting or a job registration is invalid.

    The message names the job (when there is one), the field, the bad value and the fix.
    """

    def __init__(self, message: str, *, job: str | None = None, field: str | None = None) -> None:
        self.job = job
        self.field = field
        super().__init__(f"job {job!r}: {message}" if job is not None else message)
