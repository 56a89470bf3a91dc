"""Errors raised by fastapi-singletonjob; the public API raises only these.

The hierarchy, so that callers can see what they can catch::

    SingletonJobError
    ├── ConfigurationError (also a ValueError)
    │       a setting or a job registration is invalid; raised at definition or startup,
    │       never at the first tick
    ├── ScheduleError
    │       a custom schedule misbehaved at run time (its ``next_fire`` did not move
    │       forward); the job stops on this node and the status shows the error
    ├── UsageError (also a RuntimeError)
    │   │   the API was called in a state where it cannot work (started twice, ...)
    │   └── JobNotFound (also a KeyError)
    │           no job of that name is registered
    └── LeadershipLost
            this node no longer leads the job whose run asked for a fenced action

Failures of Redis are not raised to the application: the election retries them with
backoff, logs them, and shows them in the status. Losing leadership is a normal state, logged
and shown in the status; a run that must stop because of it is cancelled
(``asyncio.CancelledError``).
"""

from __future__ import annotations

__all__ = [
    "ConfigurationError",
    "JobNotFound",
    "LeadershipLost",
    "ScheduleError",
    "SingletonJobError",
    "UsageError",
]


class SingletonJobError(Exception):
    """Base class of every error this library raises."""


class _JobError(SingletonJobError):
    def __init__(self, message: str, *, job: str | None = None, field: str | None = None) -> None:
        self.job = job
        self.field = field
        super().__init__(f"job {job!r}: {message}" if job is not None else message)


class ConfigurationError(_JobError, ValueError):
    """Raised at definition or startup when a setting or a job registration is invalid.

    The message names the job (when there is one), the field, the bad value and the fix.
    """


class ScheduleError(_JobError):
    """A schedule gave an answer the engine cannot use; the job stops on this node."""


class UsageError(_JobError, RuntimeError):
    """The API was called in a state where it cannot work; the message says what to do."""


class JobNotFound(UsageError, KeyError):
    """No job of that name is registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class LeadershipLost(_JobError):
    """This node's term of the job has ended (its lease ran out or another node holds it)."""


class StoreReadOnly(ConnectionError):
    """The store refuses the writes an election needs: it is a replica, not the primary.

    A ``ConnectionError``, so that callers that retry connection failures retry this too; a
    type of its own, so that they can say what to fix.
    """


class StoreMismatch(ConnectionError):
    """The server is not the kind the store was set up for: a Redis Cluster node reached
    through a single-Redis URL or client, or the reverse. A ``ConnectionError`` like
    ``StoreReadOnly``: the election retries it, readiness shows it."""
