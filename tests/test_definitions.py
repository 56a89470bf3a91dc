"""Two services on one ``project`` (issue 29, item 2): a job of one name with another
schedule on another node is said, not silently run on the leader's schedule only. A WARNING
on each node names the job, both schedules, the other node and the fix, once however many
rounds; ``GET /cluster`` and ``singletonjob status`` list the schedules with their nodes; the
end of it is said with how long it lasted. Identical definitions, and job sets that differ
only by jobs one node lacks (a rolling deploy), flag nothing. On the fake clock and the
in-process store, then once on a real redis-server."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from fake_nodes import stop
from fastapi import FastAPI
from servers import RedisServer
from waiting import wait_until

from fastapi_singletonjob import ClusterStatus, SingletonJobs
from fastapi_singletonjob._cli import EXIT_OK, main, render
from fastapi_singletonjob._election.definitions import FIX
from fastapi_singletonjob.testing import FakeClock

HEARTBEAT_S = 1.0
LOCK_EXPIRY_S = 3.0
DIFFERS = "differs between nodes"


def service(
    url: str,
    node_id: str,
    cleanup_every_s: float,
    *,
    clock: FakeClock | None = None,
    extra: str | None = None,
    heartbeat_s: float = HEARTBEAT_S,
    lock_expiry_s: float = LOCK_EXPIRY_S,
    project: str = "myapp",
) -> SingletonJobs:
    """A service of ``project`` with a ``cleanup`` job every ``cleanup_every_s`` and,
    with ``extra``, a job of that name of its own."""
    jobs = SingletonJobs(
        url,
        project=project,
        node_id=node_id,
        heartbeat_interval=heartbeat_s,
        lock_expiry=lock_expiry_s,
        max_backoff=2.0,
        clock=clock,
    )

    @jobs.interval("cleanup", every=cleanup_every_s)
    async def cleanup() -> None:
        pass

    if extra is not None:

        @jobs.interval(extra, every=60)
        async def own() -> None:
            pass

    return jobs


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and DIFFERS in r.getMessage()
    ]


def reads(jobs: SingletonJobs) -> int:
    """How many reads of other members' records the node made."""
    engine = jobs.engine
    assert engine is not None
    return engine.elector.definitions._reads


async def cluster_over_http(jobs: SingletonJobs) -> ClusterStatus:
    app = FastAPI()
    app.include_router(jobs.router, prefix="/singletonjob")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.get("/singletonjob/cluster")
    assert response.status_code == 200, response.text
    return ClusterStatus.model_validate(response.json())


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(datetime(2026, 1, 1, tzinfo=UTC))


@pytest.mark.parametrize(
    "extras",
    [
        pytest.param(("report", "import"), id="two-services"),
        pytest.param((None, None), id="same-job-names"),
    ],
)
async def test_another_schedule_of_one_job_is_warned_once_flagged_and_its_end_said(
    clock: FakeClock, caplog: pytest.LogCaptureFixture, extras: tuple[str | None, str | None]
) -> None:
    """Two services each with a job of its own (their job sets differ anyway), or with the
    same job names (only the schedule digest tells them apart)."""
    caplog.set_level(logging.INFO, logger="fastapi_singletonjob")
    url = f"memory://defs-{id(clock)}"
    a = service(url, "a-1", 10.0, clock=clock, extra=extras[0])
    b = service(url, "b-1", 2.0, clock=clock, extra=extras[1])
    await a.start()
    await clock.advance(0.5)
    await b.start()
    try:
        await clock.advance(20 * HEARTBEAT_S)  # twenty rounds each
        said = warnings_of(caplog)
        assert len(said) == 2, said  # one on each node, not one per round
        [on_b] = [text for text in said if "this node (b-1)" in text]
        assert "job 'cleanup'" in on_b and "node a-1 announces 'interval every 10s'" in on_b
        assert "this node (b-1) 'interval every 2s'" in on_b and FIX in on_b
        assert "node a-1 leads it now, so this node's schedule does not run" in on_b
        [on_a] = [text for text in said if "this node (a-1)" in text]
        assert "node b-1 announces 'interval every 2s'" in on_a
        assert "this node leads it now, so the schedule of node b-1 does not run" in on_a

        view = await cluster_over_http(b)
        assert view == await a.cluster_status()
        cleanup = next(job for job in view.jobs if job.name == "cleanup")
        assert cleanup.leader == "a-1" and cleanup.schedule == "interval every 10s"
        assert [(v.schedule, v.nodes) for v in cleanup.conflicts] == [
            ("interval every 10s", ["a-1"]),
            ("interval every 2s", ["b-1"]),
        ]
        others = [job for job in view.jobs if job.name != "cleanup"]
        assert [job.name for job in others] == sorted(x for x in extras if x is not None)
        assert all(job.conflicts == [] for job in others)  # one node each: no difference

        shown = render(view)  # what `singletonjob status` prints
        [row] = [line for line in shown.splitlines() if line.startswith("cleanup ")]
        assert "interval every 10s (differs, see below)" in row
        assert "SCHEDULES THAT DIFFER between nodes" in shown
        assert "interval every 10s  on a-1" in shown and "interval every 2s  on b-1" in shown
        assert "Give each service its own project=" in shown
        dumped = json.loads(json.dumps(view.model_dump(mode="json")))  # `status --json`
        assert next(j for j in dumped["jobs"] if j["name"] == "cleanup")["conflicts"] == [
            {"schedule": "interval every 10s", "nodes": ["a-1"]},
            {"schedule": "interval every 2s", "nodes": ["b-1"]},
        ]

        began = clock.monotonic()
        await stop(b, clock)
        await clock.advance(2 * HEARTBEAT_S)
        ended = [r.getMessage() for r in caplog.records if "no longer differs" in r.getMessage()]
        assert len(ended) == 1, ended
        assert "job 'cleanup'" in ended[0] and "node b-1 left" in ended[0]
        lasted_s = float(ended[0].rsplit("differed for ", 1)[1].removesuffix(" s"))
        assert 19.0 <= lasted_s <= 20.0 + clock.monotonic() - began
        assert len(warnings_of(caplog)) == 2
    finally:
        await b.stop()
        await a.stop()


@pytest.mark.parametrize(
    "extra_b",
    [
        pytest.param(None, id="identical"),
        pytest.param("import", id="a-job-one-node-lacks"),
    ],
)
async def test_alike_definitions_flag_nothing(
    clock: FakeClock, caplog: pytest.LogCaptureFixture, extra_b: str | None
) -> None:
    """The same jobs on both nodes: no warning, no flag, and no read of the other's record
    (the digests match). A job that one node lacks, as in a rolling deploy that adds one: no
    warning nor flag either (one read, to compare the job both run)."""
    caplog.set_level(logging.INFO, logger="fastapi_singletonjob")
    url = f"memory://defs-{id(clock)}"
    a = service(url, "a-1", 10.0, clock=clock)
    b = service(url, "a-2", 10.0, clock=clock, extra=extra_b)
    await a.start()
    await b.start()
    try:
        await clock.advance(10 * HEARTBEAT_S)
        assert warnings_of(caplog) == []
        view = await a.cluster_status()
        assert all(job.conflicts == [] for job in view.jobs)
        assert "DIFFER" not in render(view)
        expected = 0 if extra_b is None else 1
        assert (reads(a), reads(b)) == (expected, expected)
    finally:
        await b.stop()
        await a.stop()


@pytest.mark.redis
async def test_two_services_on_one_redis_project_are_told_apart(
    redis_server: RedisServer, redis_url: str, unique_project: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two ``SingletonJobs`` in one process on a real redis-server, one project, two
    schedules of ``cleanup``: both warn once, ``cluster_status`` flags the job, and the CLI's
    ``status`` (its own connection, its own event loop) shows it. Each node read the other's
    record once (one ``HMGET`` of the ``nodes`` hash each, seen by the server), however many
    rounds."""
    caplog.set_level(logging.INFO, logger="fastapi_singletonjob")
    # The slow log with no threshold logs every command, a script's own too (the OVERDUE
    # script's HMGETs of checkpoints, from client "?:0"): count a client's reads of records.
    with redis_server.client() as client:
        client.config_set("slowlog-log-slower-than", 0)
        client.config_set("slowlog-max-len", 100_000)
        client.slowlog_reset()

    def hmgets() -> int:
        with redis_server.client() as client:
            entries = client.slowlog_get(100_000)
        commands = [
            entry["command"].decode().split()
            for entry in entries
            if entry["client_address"] != b"?:0"  # a script's own commands
        ]
        return sum(
            1
            for c in commands
            if len(c) > 1 and c[0].upper() == "HMGET" and c[1].endswith(":nodes")
        )

    before = hmgets()

    def make(node_id: str, every_s: float, extra: str) -> SingletonJobs:
        return service(
            redis_url,
            node_id,
            every_s,
            extra=extra,
            heartbeat_s=0.1,
            lock_expiry_s=0.5,
            project=unique_project,
        )

    a, b = make("a-1", 10.0, "report"), make("b-1", 2.0, "import")
    await a.start()
    await b.start()
    try:
        await wait_until(lambda: len(warnings_of(caplog)) >= 2, 5.0, "a warning on each node")
        view = await a.cluster_status()
        cleanup = next(job for job in view.jobs if job.name == "cleanup")
        assert sorted((v.schedule, tuple(v.nodes)) for v in cleanup.conflicts) == [
            ("interval every 10s", ("a-1",)),
            ("interval every 2s", ("b-1",)),
        ]
        out = io.StringIO()
        args = ["--redis-url", redis_url, "--project", unique_project, "status"]
        assert await asyncio.to_thread(main, args, out) == EXIT_OK
        assert "SCHEDULES THAT DIFFER" in out.getvalue(), out.getvalue()
        assert "interval every 2s  on b-1" in out.getvalue()
        await asyncio.sleep(0.5)  # five more rounds each: still one warning per node
        assert len(warnings_of(caplog)) == 2, warnings_of(caplog)
        assert hmgets() - before == 2
    finally:
        await b.stop()
        await a.stop()


class EveryMinute:
    """A custom schedule with the default ``repr`` (its memory address differs per instance)."""

    def next_fire(self, after: datetime) -> datetime | None:
        return after.replace(second=0, microsecond=0) + timedelta(minutes=1)


async def test_custom_schedules_compare_without_addresses_and_misfire_settings_count(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Two nodes with one custom schedule class (two instances, two addresses) agree; a
    ``misfire`` setting that changes which instants a new leader runs is a difference."""
    caplog.set_level(logging.INFO, logger="fastapi_singletonjob")
    url = f"memory://defs-{id(clock)}"
    nodes = []
    for node_id, misfire in (("a-1", "run_once"), ("a-2", "run_once"), ("b-1", "skip")):
        jobs = SingletonJobs(
            url, project="myapp", node_id=node_id, clock=clock, heartbeat_interval=HEARTBEAT_S
        )

        @jobs.schedule("minutely", EveryMinute(), misfire=misfire)  # type: ignore[arg-type]
        async def minutely_job() -> None:
            pass

        @jobs.cron("nightly", "0 3 * * *", misfire_grace=600.0)
        async def nightly_job() -> None:
            pass

        nodes.append(jobs)
    a1, a2, b1 = nodes
    await a1.start()
    await a2.start()
    try:
        await clock.advance(5 * HEARTBEAT_S)
        assert warnings_of(caplog) == [] and (reads(a1), reads(a2)) == (0, 0)
        view = await a1.cluster_status()
        minutely = next(job for job in view.jobs if job.name == "minutely")
        assert minutely.conflicts == [] and minutely.schedule is not None
        assert " at 0x" not in minutely.schedule and "EveryMinute object" in minutely.schedule
        nightly = next(job for job in view.jobs if job.name == "nightly")
        assert nightly.schedule == 'cron "0 3 * * *" UTC, misfire_grace=600s'

        await b1.start()
        await clock.advance(5 * HEARTBEAT_S)
        said = warnings_of(caplog)
        assert len(said) == 3, said  # b-1 about a-1 and a-2 in one line, each a-* about b-1
        [on_b] = [text for text in said if "this node (b-1)" in text]
        assert "nodes a-1, a-2 announce" in on_b and "misfire='skip'" in on_b
        view = await a1.cluster_status()
        minutely = next(job for job in view.jobs if job.name == "minutely")
        assert [v.nodes for v in minutely.conflicts] == [["a-1", "a-2"], ["b-1"]]
        assert next(job for job in view.jobs if job.name == "nightly").conflicts == []
    finally:
        for jobs in reversed(nodes):
            await jobs.stop()
