"""The overdue callback on a real redis-server with a real replica process (issue 30, item 2):
it fires once when the only replica is SIGSTOPped, and the spell ends when it resumes.

Who observes: the job's only replica is a ``node_proc`` process (fixed rate every 50 ms,
heartbeat 0.1 s, lock expiry 0.5 s), which watches the job too and has an ``on_overdue`` of
its own (journalled); the observer is a ``SingletonJobs`` in the test process, a real node on
the same Redis with the job registered ``enabled=False`` and an ``on_overdue``: it never leads
the job, so the job stays silent while the replica is stopped. The replica's watch is frozen
with it; the observer's check opens the spell and is told; when the replica resumes, it finds
the spell told and does not call back again.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import node_proc
import pytest
from node_proc import EVERY_S, HEARTBEAT_S, JOB, LOCK_EXPIRY_S, read_journal
from process_fleet import POLL_S, STARTUP_S, ProcessFleet
from waiting import wait_until

from fastapi_singletonjob import JobContext, OverdueEvent, SingletonJobs
from fastapi_singletonjob._run.overdue import OverdueWatch

pytestmark = pytest.mark.redis

GRACE_S = LOCK_EXPIRY_S + 2 * HEARTBEAT_S
"""The default grace of a fixed-rate job: a lock expiry plus two heartbeats."""


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[ProcessFleet]:
    replicas = ProcessFleet(tmp_path)
    try:
        yield replicas
    finally:
        replicas.close()


async def test_overdue_is_told_once_while_the_only_replica_is_stopped(
    fleet: ProcessFleet, redis_url: str, unique_project: str, tmp_path: Path
) -> None:
    told = tmp_path / "replica-overdue.jsonl"
    fleet.spawn(
        "r1",
        [
            sys.executable,
            node_proc.__file__,
            *("--url", redis_url, "--project", unique_project, "--node", "r1"),
            *("--journal", str(fleet.journal_of("r1")), "--overdue-journal", str(told)),
        ],
    )
    events: list[OverdueEvent] = []
    observer = SingletonJobs(
        redis_url,
        project=unique_project,
        node_id="observer",
        heartbeat_interval=HEARTBEAT_S,
        lock_expiry=LOCK_EXPIRY_S,
    )

    @observer.fixed_rate(JOB, every=EVERY_S, enabled=False, on_overdue=events.append)
    async def tick(ctx: JobContext) -> None:
        raise AssertionError("the observer never runs the job")

    journal = fleet.journal_of("r1")
    await wait_until(
        lambda: len(read_journal(journal)) >= 10 or fleet.exited(),
        STARTUP_S,
        "the replica's runs",
        poll_s=POLL_S,
    )
    fleet.check_alive()
    await observer.start()  # once the replica runs: its start-up is not a silence
    stopped = False
    try:
        await wait_until(lambda: watch(observer).checks >= 2, 5.0, "the observer's checks")
        assert events == []

        def overdue_since() -> object:
            return observer.status(JOB).jobs[0].overdue_since

        fleet.pause("r1")
        stopped = True
        ran = read_journal(journal)
        await wait_until(lambda: len(events) == 1, 5.0, "the overdue callback", poll_s=POLL_S)
        (event,) = events
        assert event.node_id == "observer" and event.job == JOB
        assert event.last_started_at is not None
        # The last run the replica recorded before it stopped (its last one, or the one
        # before when the stop came between a run and its record).
        assert event.last_started_at.timestamp() in {run.scheduled for run in ran[-3:]}
        assert event.overdue_since == event.last_started_at + timedelta(seconds=EVERY_S + GRACE_S)
        assert overdue_since() == event.overdue_since
        assert (await observer.cluster_status()).jobs[0].overdue_since == event.overdue_since
        await wait_until(
            lambda: observer.engine is not None and observer.engine.overdue.checks > 0, 1.0
        )
        checks = observer.engine.overdue.checks if observer.engine else 0
        # The spell stays open, and told once, for as long as the replica is stopped.
        await wait_until(
            lambda: observer.engine is not None and observer.engine.overdue.checks >= checks + 5,
            5.0,
            "five more checks",
            poll_s=POLL_S,
        )
        assert len(events) == 1 and overdue_since() == event.overdue_since

        fleet.resume("r1")
        stopped = False
        await wait_until(lambda: overdue_since() is None, 5.0, "the spell's end", poll_s=POLL_S)
        assert (await observer.cluster_status()).jobs[0].overdue_since is None
        resumed_runs = len(read_journal(journal))
        await wait_until(
            lambda: len(read_journal(journal)) >= resumed_runs + 10,
            5.0,
            "the replica's runs after the resume",
            poll_s=POLL_S,
        )
        assert len(events) == 1 and overdue_since() is None
        told_replica = (
            [json.loads(line) for line in told.read_text().splitlines()] if told.exists() else []
        )
        assert told_replica == []  # the replica found the spell told: no second call
    finally:
        if stopped:
            fleet.resume("r1")
        await observer.stop()
        await fleet.stop_all()


def watch(jobs: SingletonJobs) -> OverdueWatch:
    assert jobs.engine is not None
    return jobs.engine.overdue
