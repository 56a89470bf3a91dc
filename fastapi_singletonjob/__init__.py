"""Run a periodic job on exactly one replica of a FastAPI service, elected through Redis."""

from ._checkpoint import Checkpoint
from ._cluster_view import ClusterJob, ClusterNode, ClusterStatus
from ._context import JobContext
from ._dependencies import job_context
from ._errors import (
    ConfigurationError,
    JobNotFound,
    LeadershipLost,
    ScheduleError,
    SingletonJobError,
    UsageError,
)
from ._jobs import SingletonJobs
from ._schedule import Cron, FixedRate, Interval, Schedule
from ._state import DropReason, Outcome
from ._status import HealthStatus, JobReport, JobStatus, LastRun, NodeStatus, StoreStatus

__version__ = "0.1.0"

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
    "Interval",
    "JobContext",
    "JobNotFound",
    "JobReport",
    "JobStatus",
    "LastRun",
    "LeadershipLost",
    "NodeStatus",
    "Outcome",
    "Schedule",
    "ScheduleError",
    "SingletonJobError",
    "SingletonJobs",
    "StoreStatus",
    "UsageError",
    "__version__",
    "job_context",
]
