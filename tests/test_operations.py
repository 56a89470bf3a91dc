"""Operating the cluster on the in-process store and a fake clock (zero real time): membership,
pause, resume, trigger, step-down, the cluster view, and the admin router behind the app's
auth. The same on a real Redis with real processes: ``test_operations_processes.py``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Annotated

import httpx
import pytest
from fake_nodes import kill, stop
from fastapi import Depends, FastAPI, Header, HTTPException
from openapi_spec_validator import validate
from servers import free_port

from fastapi_singletonjob import ClusterStatus, DropReason, JobNotFound, SingletonJobs
from fastapi_singletonjob.testing import FakeClock

HEARTBEAT_S = 1.0
LOCK_EXPIRY_S = 3.0
TOKEN = "let-me-in"

Runs = list[tuple[str, str]]
Pair = tuple[SingletonJobs, SingletonJobs, Runs]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(datetime(2026, 1, 1, tzinfo=UTC))


def node(clock: FakeClock, url: str, node_id: str, runs: Runs) -> SingletonJobs:
    """A node with one fixed-rate job and one interval job, recording (node, job) per run."""
    jobs = SingletonJobs(
        url,
        project="ops",
        node_id=node_id,
        clock=clock,
        heartbeat_interval=HEARTBEAT_S,
        lock_expiry=LOCK_EXPIRY_S,
        max_backoff=2.0,
        placement="first",  # who leads what is set by these tests (test_spread.py: spread)
    )

    @jobs.fixed_rate("tick", every=10.0)
    async def tick() -> None:
        runs.append((node_id, "tick"))

    @jobs.interval("sweep", every=10.0)
    async def sweep() -> None:
        runs.append((node_id, "sweep"))

    return jobs


@pytest.fixture
async def pair(clock: FakeClock) -> AsyncIterator[Pair]:
    """Node a started first (it leads both jobs), then node b."""
    runs: Runs = []
    url = f"memory://ops-{id(clock)}"
    a, b = node(clock, url, "a", runs), node(clock, url, "b", runs)
    await a.start()
    await clock.advance(0.5)
    await b.start()
    await clock.advance(0.5)
    try:
        yield a, b, runs
    finally:
        await b.stop()
        await a.stop()


def leader(view: ClusterStatus, job: str) -> str | None:
    return next(x.leader for x in view.jobs if x.name == job)


async def test_cluster_status_is_the_same_from_every_node_and_before_startup(
    pair: Pair, clock: FakeClock
) -> None:
    a, b, _ = pair
    outsider = SingletonJobs(f"memory://ops-{id(clock)}", project="ops", clock=clock)
    views = [await x.cluster_status() for x in (a, b, outsider)]
    assert views[0] == views[1] == views[2]
    view = views[0]
    assert [(n.node_id, n.jobs, n.leads) for n in view.nodes] == [
        ("a", ["sweep", "tick"], ["sweep", "tick"]),
        ("b", ["sweep", "tick"], []),
    ]
    tick = next(x for x in view.jobs if x.name == "tick")
    assert (tick.leader, tick.paused, tick.nodes) == ("a", False, ["a", "b"])
    assert tick.schedule == "fixed rate every 10s"
    assert tick.lease_time_left_s is not None and 0 < tick.lease_time_left_s <= LOCK_EXPIRY_S
    assert all(n.version and n.expires_in_s > 0 for n in view.nodes)


async def test_a_stopped_node_leaves_the_view_at_once_and_a_dead_one_at_expiry(
    pair: Pair, clock: FakeClock
) -> None:
    a, b, _ = pair
    await stop(b, clock)
    assert [n.node_id for n in (await a.cluster_status()).nodes] == ["a"]
    await b.start()  # the fixture stops it again
    await clock.advance(HEARTBEAT_S)
    assert [n.node_id for n in (await a.cluster_status()).nodes] == ["a", "b"]
    kill(b)  # nothing deleted: its record stays until it expires
    await clock.advance(LOCK_EXPIRY_S - HEARTBEAT_S)
    assert [n.node_id for n in (await a.cluster_status()).nodes] == ["a", "b"]
    await clock.advance(2 * HEARTBEAT_S)
    assert [n.node_id for n in (await a.cluster_status()).nodes] == ["a"]


async def test_pause_from_a_follower_stops_new_runs_until_resumed(
    pair: Pair, clock: FakeClock
) -> None:
    a, b, runs = pair
    assert runs == [("a", "sweep")], "tick's first instant is at 10 s"
    await b.pause("tick")
    await b.pause("sweep")
    await clock.settle()  # the notice wakes a's election at once: one round, no heartbeat
    assert a.status("tick").jobs[0].paused and b.status("tick").jobs[0].paused
    await clock.advance(30.0)
    assert runs == [("a", "sweep")], "no run while paused"
    assert a.status("tick").jobs[0].dropped[DropReason.PAUSED] == 3
    view = await a.cluster_status()
    assert all(job.paused and job.paused_at is not None for job in view.jobs)
    await a.resume("tick")
    await a.resume("sweep")
    await clock.advance(10.0)
    assert runs.count(("a", "tick")) == 1 and runs.count(("a", "sweep")) == 2
    assert not (await b.cluster_status()).jobs[0].paused


async def test_pause_survives_a_restart_of_every_node(pair: Pair, clock: FakeClock) -> None:
    a, b, runs = pair
    await a.pause("tick")
    await b.stop()
    await a.stop()
    runs.clear()
    await b.start()  # b now leads, from its first round: paused in the same reply
    await a.start()
    await clock.advance(25.0)
    assert ("b", "tick") not in runs and ("b", "sweep") in runs


async def test_trigger_runs_once_on_the_leader(pair: Pair, clock: FakeClock) -> None:
    a, b, runs = pair
    runs.clear()
    await b.trigger("tick")
    await clock.settle()
    assert runs == [("a", "tick")]
    await clock.advance(5.0)  # more rounds: the request was consumed
    assert runs == [("a", "tick")]
    assert not next(x for x in (await b.cluster_status()).jobs if x.name == "tick").pending


async def test_trigger_while_a_run_is_in_flight_is_dropped(clock: FakeClock) -> None:
    runs: Runs = []
    jobs = node(clock, f"memory://ops-busy-{id(clock)}", "a", runs)

    @jobs.interval("slow", every=100.0)
    async def slow() -> None:
        await clock.sleep(5.0)
        runs.append(("a", "slow"))

    await jobs.start()
    try:
        await clock.advance(1.0)  # slow's first run is in flight
        await jobs.trigger("slow")
        await clock.advance(10.0)
        assert runs.count(("a", "slow")) == 1
        assert jobs.status("slow").jobs[0].dropped[DropReason.OVERLAP] == 1
    finally:
        await jobs.stop()


async def test_step_down_hands_over_and_does_not_take_it_back_at_once(
    pair: Pair, clock: FakeClock
) -> None:
    a, b, _ = pair
    await b.step_down("tick")
    await clock.settle()  # a's woken round consumes it and releases; b's woken round takes it
    assert leader(await a.cluster_status(), "tick") == "b"
    assert leader(await a.cluster_status(), "sweep") == "a", "only that job moved"
    await clock.advance(3 * LOCK_EXPIRY_S)
    assert leader(await a.cluster_status(), "tick") == "b"


async def test_step_down_of_the_only_node_takes_it_back_after_one_lock_expiry(
    clock: FakeClock,
) -> None:
    jobs = node(clock, f"memory://ops-alone-{id(clock)}", "a", [])
    await jobs.start()
    try:
        await clock.advance(0.5)
        await jobs.step_down("tick")
        await clock.settle()
        assert leader(await jobs.cluster_status(), "tick") is None
        await clock.advance(LOCK_EXPIRY_S + HEARTBEAT_S)
        assert leader(await jobs.cluster_status(), "tick") == "a"
    finally:
        await jobs.stop()


async def test_unknown_jobs_raise_a_clear_error(pair: Pair, clock: FakeClock) -> None:
    a, _, _ = pair
    outsider = SingletonJobs(f"memory://ops-{id(clock)}", project="ops", clock=clock)
    await outsider.pause("tick")  # known from the live nodes' records
    await outsider.resume("tick")
    for call in (a.pause, a.resume, a.trigger, a.step_down, outsider.trigger):
        with pytest.raises(JobNotFound, match=r"no job named 'nope'.*known jobs: sweep, tick"):
            await call("nope")


# -- the admin router --------------------------------------------------------------------


async def require_admin(authorization: Annotated[str | None, Header()] = None) -> None:
    if authorization != f"Bearer {TOKEN}":
        raise HTTPException(401, "admin token required")


def admin_app(jobs: SingletonJobs) -> FastAPI:
    app = FastAPI()
    app.include_router(jobs.router, prefix="/sj")
    app.include_router(jobs.admin_router, prefix="/sj", dependencies=[Depends(require_admin)])
    return app


async def test_admin_routes_refuse_without_the_apps_auth_and_act_with_it(
    pair: Pair, clock: FakeClock
) -> None:
    a, b, _ = pair
    app = admin_app(b)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://b") as client:
        for action in ("pause", "resume", "trigger", "step-down"):
            refused = await client.post(f"/sj/jobs/tick/{action}")
            assert refused.status_code == 401, refused.text
        assert not (await a.cluster_status()).jobs[1].paused, "nothing happened"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        done = await client.post("/sj/jobs/tick/pause", headers=auth)
        missing = await client.post("/sj/jobs/nope/pause", headers=auth)
        served = (await client.get("/sj/cluster")).json()
        # Nothing mutating on jobs.router.
        assert (await client.post("/sj/jobs/tick")).status_code == 405
    assert done.status_code == 200 and done.json() == {
        "job": "tick",
        "action": "pause",
        "accepted": True,
    }
    assert missing.status_code == 404 and "no job named 'nope'" in missing.json()["detail"]
    assert served == (await a.cluster_status()).model_dump(mode="json")
    assert next(x for x in served["jobs"] if x["name"] == "tick")["paused"] is True


def test_openapi_schema_with_both_routers_is_valid(clock: FakeClock) -> None:
    jobs = node(clock, "memory://ops-openapi", "a", [])
    schema = admin_app(jobs).openapi()
    validate(schema)
    assert {"ClusterStatus", "ClusterNode", "ClusterJob", "ActionResult"} <= set(
        schema["components"]["schemas"]
    )
    for action in ("pause", "resume", "trigger", "step-down"):
        assert set(schema["paths"][f"/sj/jobs/{{name}}/{action}"]) == {"post"}
    assert set(schema["paths"]["/sj/cluster"]) == {"get"}


async def test_step_down_waits_for_the_run_in_flight(clock: FakeClock) -> None:
    url = f"memory://ops-inflight-{id(clock)}"
    spans: list[tuple[str, float, float]] = []

    def slow_node(node_id: str) -> SingletonJobs:
        jobs = node(clock, url, node_id, [])

        @jobs.interval("slow", every=1.0)
        async def slow() -> None:
            start = clock.monotonic()
            await clock.sleep(5.0)
            spans.append((node_id, start, clock.monotonic()))

        return jobs

    a, b = slow_node("a"), slow_node("b")
    await a.start()
    await clock.advance(0.5)
    await b.start()
    try:
        await clock.advance(1.0)  # a's first run of slow is in flight until 5 s
        await b.step_down("slow")
        await clock.advance(2.0)
        assert leader(await b.cluster_status(), "slow") == "a", "not in the middle of a run"
        await clock.advance(5.0)
        assert leader(await b.cluster_status(), "slow") == "b"
        await clock.advance(10.0)
    finally:
        await stop(b, clock)
        await stop(a, clock)
    runs = sorted(spans, key=lambda x: x[1])
    assert runs[0][0] == "a" and {x[0] for x in runs[1:]} == {"b"}
    assert all(x[2] <= y[1] for x, y in zip(runs, runs[1:], strict=False)), "no overlap"


async def test_step_down_goes_when_the_run_ends_though_every_round_falls_in_a_run(
    clock: FakeClock,
) -> None:
    """Each node renews on its own beat, a fixed phase of the heartbeat: the leader's rounds
    can all fall inside the runs of a job whose period is the heartbeat. The step-down, which
    waits for the run in flight, goes when that run ends, not at a round between runs that
    never comes."""
    url = f"memory://ops-phase-{id(clock)}"

    def busy_node(node_id: str) -> SingletonJobs:
        jobs = node(clock, url, node_id, [])

        @jobs.fixed_rate("busy", every=HEARTBEAT_S)
        async def busy() -> None:
            await clock.sleep(0.6 * HEARTBEAT_S)  # runs on [k, k + 0.6) of each second

        return jobs

    a, b = busy_node("a"), busy_node("b")
    await a.start()
    assert a.engine is not None
    a.engine.elector._phase = 0.3  # a's rounds at k + 0.3: always in a run of busy
    await clock.advance(0.5)
    await b.start()
    try:
        await clock.advance(3.0 - (clock.monotonic() % 1.0) + 0.3)  # at k + 0.3: in a run
        assert leader(await b.cluster_status(), "busy") == "a"
        await b.step_down("busy")
        await clock.advance(0.1)
        assert leader(await b.cluster_status(), "busy") == "a", "not in the middle of a run"
        await clock.advance(0.4)  # the run ended at k + 0.6
        assert leader(await b.cluster_status(), "busy") == "b"
    finally:
        await stop(b, clock)
        await stop(a, clock)


async def test_admin_routes_and_cluster_answer_503_when_redis_does_not() -> None:
    jobs = SingletonJobs(f"redis://:hunter2@127.0.0.1:{free_port()}/0", project="ops", node_id="a")

    @jobs.interval("sweep", every=10.0)
    async def sweep() -> None:
        pass

    app = admin_app(jobs)
    transport = httpx.ASGITransport(app=app)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://a") as client:
        paused = await client.post("/sj/jobs/sweep/pause", headers=headers)
        view = await client.get("/sj/cluster")
    for response in (paused, view):
        assert response.status_code == 503, response.text
        assert "Redis did not answer" in response.text and "hunter2" not in response.text
