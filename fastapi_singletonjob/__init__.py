"""Run a periodic job on exactly one replica of a FastAPI service, elected through Redis."""

from ._checkpoint import Checkpoint
from ._errors import (
    ConfigurationError,
    JobNotFound,
    LeadershipLost,
    ScheduleError,
    SingletonJobError,
    UsageError,
)
from ._history import Occurrence
from ._job.context import JobContext
from ._job.dependencies import job_context
from ._outcomes import DropReason, Outcome
from ._overdue import OverdueEvent
from ._schedule import Cron, FixedRate, Interval, Schedule
from ._singletonjobs import SingletonJobs
from ._version import __version__
from ._web.models import (
    ClusterJob,
    ClusterNode,
    ClusterStatus,
    HealthStatus,
    HistoryEntry,
    JobHealth,
    JobHistory,
    JobReport,
    JobsHealth,
    JobStatus,
    LastRun,
    NodeStatus,
    StoreStatus,
)

__all__ = [
    "Checkpoint",
    "ClusterJob",
    "ClusterNode",
    "ClusterStatus",
    "ConfigurationError",
    "Cron",
    "DropReason",
    "FixedRate",
    "HealthStatus",
    "HistoryEntry",
    "Interval",
    "JobContext",
    "JobHealth",
    "JobHistory",
    "JobNotFound",
    "JobReport",
    "JobStatus",
    "JobsHealth",
    "LastRun",
    "LeadershipLost",
    "NodeStatus",
    "Occurrence",
    "Outcome",
    "OverdueEvent",
    "Schedule",
    "ScheduleError",
    "SingletonJobError",
    "SingletonJobs",
    "StoreStatus",
    "UsageError",
    "__version__",
    "job_context",
]
