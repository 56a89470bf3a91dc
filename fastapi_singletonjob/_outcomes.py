"""What happened to each job on this node: counters and the last run, read by the status API."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime

__all__ = ["OUTCOME_WORDS", "DropReason", "JobStats", "Outcome", "RunRecord"]


class Outcome(str, enum.Enum):
    """How a run ended."""

    SUCCESS = "success"
    FAILED = "failed"
    """The job raised an exception (logged with its traceback)."""
    TIMEOUT = "timeout"
    """The run took longer than the job's ``timeout`` and was cancelled."""
    CANCELLED = "cancelled"
    """Cancelled because leadership was lost (``on_leadership_lost="cancel"``) or at shutdown."""


OUTCOME_WORDS: dict[str, str] = {outcome: outcome.value for outcome in Outcome}
"""Each outcome's word, found by the outcome or by its value (a ``str`` enum): a lookup costs
the run path less than the enum's ``value`` property."""


class DropReason(str, enum.Enum):
    """Why a tick did not start a run on a node that leads the job (``NO_LEADER`` and
    ``MISFIRE_SKIPPED``: on any node, as the next leader finds it)."""

    OVERLAP = "overlap"
    """The previous run was still going: the tick is dropped, never queued."""
    LATE = "late"
    """The node woke after later ticks were already due (a stall): they are not replayed."""
    LEASE_EXPIRED = "lease_expired"
    """The lease ran out between the tick and the start of the run."""
    ALREADY_RUN = "already_run"
    """Another leader already ran this cron (or custom schedule) instant."""
    CLOCK_AHEAD = "clock_ahead"
    """The instant is ahead of the store's clock: this node's wall clock is wrong. Not run,
    so that a node far in the future cannot claim, and so silence, the instants to come."""
    STORE_ERROR = "store_error"
    """The instant could not be claimed in Redis before its grace ran out: skipped, so that
    it never runs twice."""
    PAUSED = "paused"
    """An operator paused the job (``jobs.pause``): its ticks are skipped until it resumes."""
    NO_LEADER = "no_leader"
    """No node led the job at the instant (its leader was killed or stopping, the lease not
    yet expired): found from the schedule, and recorded, by the next leader."""
    MISFIRE_SKIPPED = "misfire_skipped"
    """A cron or custom instant that no node led at, which the next leader did not run, as its
    ``misfire`` policy says (``skip``; ``run_once``: all but the latest; ``catch_up``: past
    ``misfire_grace``)."""


@dataclass(slots=True)
class RunRecord:
    """One finished run."""

    scheduled_at: datetime
    started_at: datetime
    finished_at: datetime
    duration_s: float
    outcome: Outcome
    error: str | None = None
    """``ExceptionType: message`` of a failed run, shortened."""


@dataclass(slots=True)
class JobStats:
    """Counters of one job on this node since startup."""

    runs: int = 0
    failures: int = 0
    timeouts: int = 0
    cancelled: int = 0
    dropped: Counter[DropReason] = field(default_factory=Counter)
    """Dropped ticks by reason (a missing reason counts 0)."""
    not_leader: int = 0
    """Ticks that came while another node led the job (normal on followers)."""
    unrecorded: int = 0
    """Runs whose checkpoint record the store did not answer in time, or failed (whether it
    was written is unknown); each is logged, and the run itself was not touched."""
    running_since: datetime | None = None
    last_run: RunRecord | None = None
    next_run: datetime | None = None

    @property
    def dropped_total(self) -> int:
        """All dropped ticks, whatever the reason."""
        return sum(self.dropped.values())

    def record(self, run: RunRecord) -> None:
        """Count a finished run."""
        self.runs += 1
        self.running_since = None
        self.last_run = run
        if run.outcome is Outcome.FAILED:
            self.failures += 1
        elif run.outcome is Outcome.TIMEOUT:
            self.timeouts += 1
        elif run.outcome is Outcome.CANCELLED:
            self.cancelled += 1
