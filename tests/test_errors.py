"""The public API raises only the library's own errors, each in its place in the tree."""

from __future__ import annotations

import asyncio

import pytest

import fastapi_singletonjob as sj
from fastapi_singletonjob import (
    ConfigurationError,
    JobNotFound,
    LeadershipLost,
    ScheduleError,
    SingletonJobError,
    SingletonJobs,
    UsageError,
    job_context,
)
from fastapi_singletonjob.testing import FakeClock


def test_the_error_tree() -> None:
    for error in (ConfigurationError, ScheduleError, UsageError, LeadershipLost):
        assert issubclass(error, SingletonJobError)
    assert issubclass(JobNotFound, UsageError)
    # Also the built-in kinds callers may already catch.
    assert issubclass(ConfigurationError, ValueError)
    assert issubclass(UsageError, RuntimeError)
    assert issubclass(JobNotFound, KeyError)


def test_the_errors_are_exported() -> None:
    names = {"JobNotFound", "LeadershipLost", "ScheduleError", "UsageError"}
    assert names <= set(sj.__all__)


def test_an_unknown_job_is_a_job_not_found_naming_the_known_ones() -> None:
    jobs = SingletonJobs("memory://errors", project="errors")

    @jobs.interval("known", every=1.0)
    async def known() -> None:
        pass

    with pytest.raises(JobNotFound, match=r"no job named 'unknown'.*known") as raised:
        jobs.status("unknown")
    assert raised.value.field == "job"
    assert str(raised.value).startswith("no job named")  # not quoted as a KeyError would be


async def test_a_control_of_an_unknown_job_names_where_jobs_are_known() -> None:
    jobs = SingletonJobs("memory://errors-control", project="errors")

    @jobs.interval("known", every=1.0)
    async def known() -> None:
        pass

    with pytest.raises(JobNotFound) as raised:
        await jobs.pause("unknown")
    assert str(raised.value) == (
        "no job named 'unknown' is registered here, by a live node or stored in project "
        "'errors'; known jobs: known"
    )


async def test_starting_twice_is_a_usage_error() -> None:
    clock = FakeClock()
    jobs = SingletonJobs("memory://errors-twice", project="errors", clock=clock)
    await jobs.start()
    try:
        with pytest.raises(UsageError, match="already started"):
            await jobs.start()
    finally:
        task = asyncio.create_task(jobs.stop())
        while not task.done():
            await clock.advance(0.05)


async def test_job_context_outside_a_run_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="only available while a job runs"):
        await job_context()
