"""``jobs.router`` through HTTP (httpx over ASGI, the app's lifespan entered): the status API
of two nodes on a real Redis, the probes under Redis faults and dead loops, prefixes, the
application's own auth, OpenAPI, and no secret in any answer."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import httpx
import pytest
from fastapi import Depends, FastAPI, Header, HTTPException
from fastapi.params import Depends as DependsParam
from openapi_spec_validator import validate
from servers import RedisServerFactory
from waiting import wait_until

from fastapi_singletonjob import Checkpoint, ClusterStatus, JobContext, SingletonJobs
from fastapi_singletonjob._config.settings import Settings
from fastapi_singletonjob._engine.snapshot import EngineSnapshot, EngineState, StoreSnapshot
from fastapi_singletonjob._history import Occurrence
from fastapi_singletonjob._job.spec import JobSpec
from fastapi_singletonjob._web.router import create_router
from fastapi_singletonjob.testing import FakeClock

HEARTBEAT_S = 0.05
LOCK_EXPIRY_S = 0.5
MAX_BACKOFF_S = 0.3
PREFIX = "/singletonjob"
SETTLE_S = 5.0
"""Bound on waits for a state that a healthy node reaches within a few heartbeats."""
PASSWORD = "s3cret-pw"
WRONG_PASSWORD = "wr0ng-s3cret"

Json = dict[str, Any]


def make_jobs(url: str, project: str, node_id: str) -> SingletonJobs:
    """A node with a job that succeeds, one that always fails, and a disabled one; first-come
    leadership, so that a follower of a job never led it (tests/test_spread.py moves jobs)."""
    jobs = SingletonJobs(
        url,
        project=project,
        node_id=node_id,
        heartbeat_interval=HEARTBEAT_S,
        lock_expiry=LOCK_EXPIRY_S,
        max_backoff=MAX_BACKOFF_S,
        shutdown_timeout=1.0,
        placement="first",
    )

    @jobs.interval("tick", every=0.05)
    async def tick(ctx: JobContext) -> None:
        pass

    @jobs.fixed_rate("boom", every=0.05)
    async def boom() -> None:
        raise RuntimeError("downstream is down")

    @jobs.cron("off", "0 3 * * *", enabled=False)
    async def off() -> None:
        raise AssertionError("disabled")

    return jobs


def make_app(
    jobs: SingletonJobs,
    prefixes: Sequence[str] = (PREFIX,),
    dependencies: Sequence[DependsParam] = (),
) -> FastAPI:
    app = FastAPI(lifespan=jobs.lifespan)
    for prefix in prefixes:
        app.include_router(jobs.router, prefix=prefix, dependencies=list(dependencies))
    return app


def client_of(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node")


@contextlib.asynccontextmanager
async def serve(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan entered, and a client to it; both closed on exit."""
    async with app.router.lifespan_context(app), client_of(app) as client:
        yield client


async def get_json(client: httpx.AsyncClient, path: str, status: int = 200) -> Json:
    response = await client.get(path)
    assert response.status_code == status, response.text
    body: Json = response.json()
    return body


def answers(client: httpx.AsyncClient, path: str, status: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return (await client.get(path)).status_code == status

    return check


async def ready(client: httpx.AsyncClient, prefix: str = PREFIX) -> None:
    await wait_until(answers(client, f"{prefix}/health/jobs", 200), SETTLE_S, "the node is ready")


def parse(instant: str) -> datetime:
    return datetime.fromisoformat(instant.replace("Z", "+00:00"))


# -- two nodes on the shared Redis --------------------------------------------------------


def leads(client: httpx.AsyncClient, *names: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        node = await get_json(client, f"{PREFIX}/jobs")
        return all(job["is_leader"] for job in node["jobs"] if job["name"] in names)

    return check


async def test_two_nodes_agree_on_leader_and_token_and_exactly_one_leads(
    redis_url: str, unique_project: str
) -> None:
    a = make_jobs(redis_url, unique_project, "node-a")
    b = make_jobs(redis_url, unique_project, "node-b")
    nodes: list[Json] = []
    async with serve(make_app(a)) as client_a:
        # node-a starts alone and takes every lock; node-b then follows in every job
        await wait_until(leads(client_a, "tick", "boom"), SETTLE_S, "node-a leads every job")
        async with serve(make_app(b)) as client_b:

            async def agreed() -> bool:
                nodes[:] = [await get_json(c, f"{PREFIX}/jobs") for c in (client_a, client_b)]
                return all(job["leader"] for node in nodes for job in node["jobs"][:2])

            await wait_until(agreed, SETTLE_S, "node-b knows who leads")
            follower_health = await get_json(client_b, f"{PREFIX}/health")

    assert follower_health == {"status": "ok", "reason": None, "node_id": "node-b"}, (
        "followers are ready too"
    )
    views = {node["node_id"]: {job["name"]: job for job in node["jobs"]} for node in nodes}
    for name in ("tick", "boom"):
        on_a, on_b = views["node-a"][name], views["node-b"][name]
        assert on_a["leader"] == on_b["leader"] == "node-a"
        assert on_a["fencing_token"] == on_b["fencing_token"] >= 1
        assert (on_a["is_leader"], on_b["is_leader"]) == (True, False)
        for view in (on_a, on_b):
            assert 0 < view["lease_time_left_s"] <= LOCK_EXPIRY_S
    for node, node_id in zip(nodes, ("node-a", "node-b"), strict=True):
        assert (node["project"], node["node_id"], node["started"]) == (
            unique_project,
            node_id,
            True,
        )
        assert node["store"]["url"] == redis_url
        assert node["store"]["reachable"] is True
        assert node["store"]["error"] is None
        assert [job["name"] for job in node["jobs"]] == ["tick", "boom", "off"]


async def test_the_leader_shows_its_runs_failures_and_a_disabled_job(
    redis_url: str, unique_project: str
) -> None:
    a = make_jobs(redis_url, unique_project, "node-a")
    b = make_jobs(redis_url, unique_project, "node-b")
    async with serve(make_app(a)) as client_a, serve(make_app(b)) as client_b:
        clients = {"node-a": client_a, "node-b": client_b}

        async def job(node: str, name: str) -> Json:
            view: Json = (await get_json(clients[node], f"{PREFIX}/jobs/{name}"))["job"]
            return view

        async def leader_of(name: str) -> str:
            views = {node: await job(node, name) for node in clients}
            (node,) = [node for node, view in views.items() if view["is_leader"]]
            return node

        async def counted(node: str, name: str, field: str, at_least: int) -> bool:
            return bool((await job(node, name))[field] >= at_least)

        async def has_one_leader(name: str) -> bool:
            views = [await job(node, name) for node in clients]
            return [view["is_leader"] for view in views].count(True) == 1

        await wait_until(lambda: has_one_leader("tick"), SETTLE_S, "'tick' has one leader")
        await wait_until(lambda: has_one_leader("boom"), SETTLE_S, "'boom' has one leader")
        tick_leader, boom_leader = await leader_of("tick"), await leader_of("boom")
        await wait_until(
            lambda: counted(tick_leader, "tick", "runs", 2), SETTLE_S, "two runs of 'tick'"
        )
        await wait_until(
            lambda: counted(boom_leader, "boom", "failures", 2), SETTLE_S, "two failures"
        )
        tick = await job(tick_leader, "tick")
        boom = await job(boom_leader, "boom")
        tick_follower = await job(next(n for n in clients if n != tick_leader), "tick")
        boom_follower = await job(next(n for n in clients if n != boom_leader), "boom")
        disabled = [await job(node, "off") for node in clients]

    assert tick["schedule"] == "interval every 50ms"
    assert tick["kind"] == "interval"
    last = tick["last_run"]
    assert last["outcome"] == "success"
    assert last["error"] is None
    assert parse(last["scheduled_at"]) <= parse(last["started_at"]) <= parse(last["finished_at"])
    assert 0 <= last["duration_s"] < 1
    # an interval job's next run is only known once the current one ended: until then it
    # shows the instant of the run in flight (or just finished)
    assert tick["next_run"] is not None
    assert parse(tick["next_run"]) >= parse(last["scheduled_at"])
    assert tick["failures"] == 0
    assert tick_follower["runs"] == 0
    assert tick_follower["last_run"] is None
    assert tick_follower["leader"] == tick_leader

    assert boom["kind"] == "fixed_rate"
    assert boom["failures"] >= 2
    assert boom["failures"] == boom["runs"]
    assert boom["last_run"]["outcome"] == "failed"
    assert boom["last_run"]["error"] == "RuntimeError: downstream is down"
    assert boom_follower["failures"] == boom_follower["runs"] == 0
    assert boom_follower["not_leader_ticks"] >= 1, "the follower counts the ticks it skipped"
    assert boom_follower["leader"] == boom_leader

    for off in disabled:
        assert off["enabled"] is False
        assert off["kind"] == "cron"
        assert off["schedule"] == 'cron "0 3 * * *" UTC'
        assert (off["leader"], off["is_leader"], off["fencing_token"]) == (None, False, None)
        assert (off["runs"], off["last_run"], off["next_run"]) == (0, None, None)


async def test_one_job_and_the_404_for_an_unknown_name(redis_url: str, unique_project: str) -> None:
    jobs = make_jobs(redis_url, unique_project, "node-a")
    async with serve(make_app(jobs)) as client:
        await ready(client)
        report = await get_json(client, f"{PREFIX}/jobs/tick")
        missing = await client.get(f"{PREFIX}/jobs/nope")
    assert set(report) == {"project", "node_id", "started", "state", "store", "job"}
    assert (report["project"], report["node_id"]) == (unique_project, "node-a")
    assert report["job"]["name"] == "tick"
    assert missing.status_code == 404
    assert missing.json() == {"detail": "no job named 'nope'; known jobs: boom, off, tick"}


# -- mounting and the application's own dependencies --------------------------------------


async def test_mounted_under_two_prefixes() -> None:
    jobs = make_jobs("memory://router-prefixes", "prefixes", "node-a")
    app = make_app(jobs, prefixes=("/ops", "/internal/singletonjob"))
    async with serve(app) as client:
        await ready(client, "/ops")
        for prefix in ("/ops", "/internal/singletonjob"):
            assert (await get_json(client, f"{prefix}/jobs"))["node_id"] == "node-a"
            assert (await get_json(client, f"{prefix}/jobs/tick"))["job"]["name"] == "tick"
            assert (await get_json(client, f"{prefix}/health"))["status"] == "ok"
            assert (await get_json(client, f"{prefix}/health/live"))["status"] == "ok"
        for path in ("/jobs", "/health", f"{PREFIX}/jobs"):
            assert (await client.get(path)).status_code == 404, path


def require_token(authorization: Annotated[str | None, Header()] = None) -> None:
    """The application's own auth: 401 without credentials, 403 with wrong ones."""
    if authorization is None:
        raise HTTPException(401, "credentials required", headers={"WWW-Authenticate": "Bearer"})
    if authorization != "Bearer let-me-in":
        raise HTTPException(403, "forbidden")


async def test_an_auth_dependency_attached_at_include_time_guards_every_route() -> None:
    jobs = make_jobs("memory://router-auth", "auth", "node-a")
    app = make_app(jobs, dependencies=[Depends(require_token)])
    good = {"Authorization": "Bearer let-me-in"}
    async with serve(app) as client:

        async def ready_with_credentials() -> bool:
            return (await client.get(f"{PREFIX}/health", headers=good)).status_code == 200

        await wait_until(ready_with_credentials, SETTLE_S, "the node is ready")
        for path in ("/jobs", "/jobs/tick", "/health", "/health/live"):
            anonymous = await client.get(PREFIX + path)
            assert anonymous.status_code == 401, path
            assert anonymous.headers["www-authenticate"] == "Bearer"
            wrong = await client.get(PREFIX + path, headers={"Authorization": "Bearer guess"})
            assert wrong.status_code == 403, path
            allowed = await client.get(PREFIX + path, headers=good)
            assert allowed.status_code == 200, (path, allowed.text)
            assert allowed.json()["node_id"] == "node-a"
        unknown = await client.get(f"{PREFIX}/jobs/nope")
        assert unknown.status_code == 401, "auth comes before the lookup"


# -- readiness ----------------------------------------------------------------------------


async def test_both_probes_fail_before_startup() -> None:
    jobs = make_jobs("memory://router-not-started", "early", "node-a")
    async with client_of(make_app(jobs)) as client:  # no lifespan: never started
        for path in ("/health", "/health/live"):
            body = await get_json(client, PREFIX + path, 503)
            assert body == {"status": "unavailable", "reason": "not started", "node_id": "node-a"}
        node = await get_json(client, f"{PREFIX}/jobs")
    assert node["started"] is False
    assert node["store"]["reachable"] is False


async def test_readiness_waits_for_the_first_answer_of_the_store(
    fresh_redis: RedisServerFactory, unique_project: str
) -> None:
    server = fresh_redis()
    server.pause()  # accepts connections, answers nothing
    jobs = make_jobs(server.url, unique_project, "node-a")
    async with serve(make_app(jobs)) as client:
        engine = jobs.engine
        assert engine is not None
        await wait_until(lambda: engine.elector.failures >= 1, SETTLE_S, "a round timed out")
        body = await get_json(client, f"{PREFIX}/health/jobs", 503)
        assert body["status"] == "unavailable"
        assert body["reason"].startswith("the lease store has not answered yet")
        degraded = await get_json(client, f"{PREFIX}/health")  # 200: HTTP is served
        assert sorted(job["status"] for job in body.pop("jobs")) == ["disabled", "ok", "ok"]
        assert degraded == {**body, "status": "degraded"}
        assert (await get_json(client, f"{PREFIX}/health/live"))["status"] == "ok"
        server.resume()
        await ready(client)
        assert (await get_json(client, f"{PREFIX}/health/jobs"))["reason"] is None


async def test_readiness_fails_one_lock_expiry_after_redis_died_while_liveness_holds(
    fresh_redis: RedisServerFactory, unique_project: str
) -> None:
    server = fresh_redis()
    jobs = make_jobs(server.url, unique_project, "node-a")
    async with serve(make_app(jobs)) as client:
        await ready(client)
        server.kill()
        killed_at = time.monotonic()
        live: list[int] = []

        async def unready() -> bool:
            live.append((await client.get(f"{PREFIX}/health/live")).status_code)
            return (await client.get(f"{PREFIX}/health/jobs")).status_code == 503

        noticed_at = await wait_until(
            unready, LOCK_EXPIRY_S + 2.0, "readiness fails after one lock expiry"
        )
        body = await get_json(client, f"{PREFIX}/health/jobs", 503)
        degraded = await get_json(client, f"{PREFIX}/health")
        node = await get_json(client, f"{PREFIX}/jobs")
        live.append((await client.get(f"{PREFIX}/health/live")).status_code)
    assert noticed_at - killed_at > LOCK_EXPIRY_S - 2 * HEARTBEAT_S, "no flap on one failed round"
    assert body["reason"].startswith("the lease store last answered")
    assert degraded["status"] == "degraded" and degraded["reason"].startswith("the lease store")
    assert "lock_expiry=0.5s" in body["reason"]
    assert "Error" in body["reason"], "names the store's error"
    assert set(live) == {200}, "an unreachable Redis is not a liveness failure"
    assert node["store"]["reachable"] is False
    assert node["store"]["consecutive_failures"] >= 1
    assert node["store"]["error"]
    assert not any(job["is_leader"] for job in node["jobs"])


# -- liveness -----------------------------------------------------------------------------


class Crash(BaseException):
    """Escapes the election loop's ``except Exception``, as a bug in it would."""


@pytest.mark.parametrize("how", ["cancelled", "crashed"])
async def test_liveness_fails_when_the_election_loop_is_dead(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = make_jobs(f"memory://router-dead-{how}", "dead", "node-a")
    async with serve(make_app(jobs)) as client:
        await ready(client)
        engine = jobs.engine
        assert engine is not None
        task = engine.election_task
        assert task is not None
        if how == "cancelled":
            task.cancel()
        else:

            async def crash(*args: object) -> None:
                raise Crash("bug")

            monkeypatch.setattr(engine.elector._store, "elect", crash)
        await asyncio.wait({task}, timeout=SETTLE_S)
        assert task.done()
        live = await get_json(client, f"{PREFIX}/health/live", 503)
        readiness = await get_json(client, f"{PREFIX}/health", 503)
    assert live == {
        "status": "unavailable",
        "reason": "the election loop has stopped",
        "node_id": "node-a",
    }
    assert readiness["reason"] == "the election loop is not running"


class Broken:
    """A custom schedule that raises."""

    def next_fire(self, after: datetime) -> datetime | None:
        raise ArithmeticError("bad schedule")


async def test_a_custom_schedule_that_raises_is_reported_but_not_a_liveness_failure() -> None:
    """The user's schedule code fails the same way after a restart: restarting the pod (and
    its other jobs) would not help, so the status reports it and liveness stays ok."""
    jobs = make_jobs("memory://router-broken", "broken", "node-a")

    @jobs.schedule("broken", Broken())
    async def broken() -> None:
        raise AssertionError("never runs")

    async with serve(make_app(jobs)) as client:

        async def reported() -> bool:
            job = (await get_json(client, f"{PREFIX}/jobs/broken"))["job"]
            return job["error"] is not None

        await wait_until(reported, SETTLE_S, "the schedule failure is reported")
        live = await get_json(client, f"{PREFIX}/health/live")
        job = (await get_json(client, f"{PREFIX}/jobs/broken"))["job"]
        readiness = await get_json(client, f"{PREFIX}/health")
    assert live["status"] == "ok"
    assert job["error"] == "ArithmeticError('bad schedule')"
    assert job["is_leader"] is False, "the lock was resigned"
    assert readiness["status"] == "ok", "readiness is about the election, not one job"


async def test_liveness_fails_when_a_builtin_schedule_loop_died(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    jobs = make_jobs("memory://router-died", "died", "node-a")
    async with serve(make_app(jobs)) as client:
        assert jobs.engine is not None
        failure = {"boom": RuntimeError("library bug")}.get
        monkeypatch.setattr(jobs.engine.ticker, "failure", failure)
        live = await get_json(client, f"{PREFIX}/health/live", 503)
    assert live["reason"] == "the schedule of job 'boom' failed: RuntimeError('library bug')"


class RunningSource:
    """A ``StatusSource`` double: a running node with no jobs, a store that answers, and the
    background tasks that ``failed_tasks`` says died."""

    project = "double"
    node_id = "node-d"
    store_description = "memory://double"

    def __init__(self, failed_tasks: dict[str, str]) -> None:
        self.failed_tasks = failed_tasks
        self.settings = Settings.build(
            redis_url="memory://double",
            has_client=False,
            project=self.project,
            node_id=self.node_id,
            heartbeat_interval=1.0,
            lock_expiry=3.0,
            max_backoff=2.0,
            shutdown_timeout=1.0,
            env={},
        )
        self.jobs: dict[str, JobSpec] = {}

    def snapshot(self) -> EngineSnapshot | None:
        store = StoreSnapshot(
            last_success_s_ago=0.1, round_trip_s=0.001, failures=0, last_error=None
        )
        return EngineSnapshot(
            state=EngineState.RUNNING,
            election_alive=True,
            timer_alive=True,
            last_round_s_ago=0.1,
            longest_lease_s=3.0,
            store=store,
            jobs={},
            failed_tasks=self.failed_tasks,
        )

    async def checkpoint(self, job: str) -> Checkpoint | None:
        raise AssertionError("no job, no checkpoint read")

    async def cluster_status(self) -> ClusterStatus:
        raise AssertionError("not asked")

    async def history(self, job: str, limit: int) -> list[Occurrence]:
        raise AssertionError("not asked")

    async def probe_store(self, within_s: float) -> bool:
        raise AssertionError("the store answers: no probe")


async def test_liveness_fails_when_a_background_task_died() -> None:
    """A dead background task of the library (``EngineSnapshot.failed_tasks``) comes back
    only with a restart: liveness names it (the first by name) and its error; readiness,
    about the election, stays ok."""
    failed = {"release-listener": "RuntimeError('bug')", "deadline-watchdog": "KeyError('x')"}
    dead, healthy = FastAPI(), FastAPI()
    dead.include_router(create_router(RunningSource(failed)), prefix=PREFIX)
    healthy.include_router(create_router(RunningSource({})), prefix=PREFIX)
    async with client_of(dead) as client:
        live = await get_json(client, f"{PREFIX}/health/live", 503)
        ready = await get_json(client, f"{PREFIX}/health")
    async with client_of(healthy) as client:
        live_again = await get_json(client, f"{PREFIX}/health/live")
    assert live == {
        "status": "unavailable",
        "reason": "the background task 'deadline-watchdog' failed: KeyError('x')",
        "node_id": "node-d",
    }
    assert ready == {"status": "ok", "reason": None, "node_id": "node-d"}
    assert live_again["status"] == "ok"


class RefusedSource(RunningSource):
    """A running node whose last round was 11 s ago, Redis refusing it or not: past the
    wedge threshold of a node that backs off ``max_backoff`` (2 * (3 + 2) s), within that of
    one that Redis refuses, which backs off twice as long (2 * (3 + 4) s)."""

    def __init__(self, refused: str | None) -> None:
        super().__init__({})
        self.refused = refused

    def snapshot(self) -> EngineSnapshot | None:
        snap = super().snapshot()
        assert snap is not None
        store = StoreSnapshot(
            last_success_s_ago=None,
            round_trip_s=None,
            failures=5,
            last_error="AuthenticationError: ...",
            refused=self.refused,
        )
        return dataclasses.replace(snap, store=store, last_round_s_ago=11.0)

    async def probe_store(self, within_s: float) -> bool:
        return False


async def test_a_refused_node_backs_off_longer_and_is_not_called_wedged() -> None:
    for refused, live_code in (("wrong password: fix it", 200), (None, 503)):
        app = FastAPI()
        app.include_router(create_router(RefusedSource(refused)), prefix=PREFIX)
        async with client_of(app) as client:
            await get_json(client, f"{PREFIX}/health/live", live_code)
            ready = await get_json(client, f"{PREFIX}/health")
        assert ready["status"] == "degraded"
        if refused is not None:
            assert ready["reason"] == f"Redis refuses this node, no retry mends it: {refused}"


# -- no secret ----------------------------------------------------------------------------


ALL_PATHS = (
    f"{PREFIX}/jobs",
    f"{PREFIX}/jobs/tick",
    f"{PREFIX}/jobs/nope",
    f"{PREFIX}/health",
    f"{PREFIX}/health/jobs",
    f"{PREFIX}/health/live",
    f"{PREFIX}/ui",
    f"{PREFIX}/ui/jobs/tick",
    "/openapi.json",
)


async def bodies(client: httpx.AsyncClient) -> str:
    return "\n".join([(await client.get(path)).text for path in ALL_PATHS])


@pytest.mark.parametrize("form", ["userinfo", "query"])
async def test_no_password_in_any_answer_even_when_redis_refuses_it(
    fresh_redis: RedisServerFactory, unique_project: str, form: str
) -> None:
    server = fresh_redis(extra_args=["--requirepass", PASSWORD])
    assert server.password == PASSWORD

    def url(password: str) -> str:
        if form == "userinfo":
            return f"redis://:{password}@127.0.0.1:{server.port}/0"
        return f"redis://127.0.0.1:{server.port}/0?password={password}"

    good = make_jobs(url(PASSWORD), unique_project, "good")
    bad = make_jobs(url(WRONG_PASSWORD), unique_project, "bad")
    async with serve(make_app(good)) as client_good, serve(make_app(bad)) as client_bad:
        await ready(client_good)
        engine = bad.engine
        assert engine is not None
        await wait_until(lambda: engine.elector.failures >= 1, SETTLE_S, "auth refused")
        text = await bodies(client_good) + await bodies(client_bad)
        refused = await get_json(client_bad, f"{PREFIX}/jobs")
        reason = (await get_json(client_bad, f"{PREFIX}/health/jobs", 503))["reason"]
        store_url = (await get_json(client_good, f"{PREFIX}/jobs"))["store"]["url"]
    assert "uth" in refused["store"]["error"], "the refusal is shown (AuthenticationError)"
    assert reason.startswith("Redis refuses this node, no retry mends it: wrong user name")
    assert "127.0.0.1" in store_url and "***" in store_url
    assert PASSWORD not in text
    assert WRONG_PASSWORD not in text


# -- OpenAPI and the Python API -----------------------------------------------------------


async def test_openapi_schema_is_valid_and_names_the_response_models() -> None:
    jobs = make_jobs("memory://router-openapi", "openapi", "node-a")
    app = make_app(jobs, dependencies=[Depends(require_token)])
    async with client_of(app) as client:
        served = await get_json(client, "/openapi.json")
    schema = app.openapi()
    assert served == schema
    validate(schema)
    models = schema["components"]["schemas"]
    assert {"NodeStatus", "JobReport", "HealthStatus", "JobStatus", "LastRun"} <= set(models)

    def model_of(path: str, status: str) -> str:
        responses = schema["paths"][PREFIX + path]["get"]["responses"]
        ref: str = responses[status]["content"]["application/json"]["schema"]["$ref"]
        return ref.rpartition("/")[2]

    assert model_of("/jobs", "200") == "NodeStatus"
    assert model_of("/jobs/{name}", "200") == "JobReport"
    assert "404" in schema["paths"][f"{PREFIX}/jobs/{{name}}"]["get"]["responses"]
    for probe in ("/health", "/health/live"):
        assert model_of(probe, "200") == model_of(probe, "503") == "HealthStatus"
    assert model_of("/health/jobs", "200") == model_of("/health/jobs", "503") == "JobsHealth"


def fake_clock_jobs(clock: FakeClock, url: str) -> SingletonJobs:
    return SingletonJobs(
        url,
        project="fake",
        node_id="node-a",
        clock=clock,
        heartbeat_interval=1.0,
        lock_expiry=3.0,
        max_backoff=2.0,
    )


async def test_liveness_fails_while_the_election_loop_is_wedged() -> None:
    clock = FakeClock(datetime(2026, 1, 1, tzinfo=UTC))
    jobs = fake_clock_jobs(clock, "memory://router-wedged")
    async with serve(make_app(jobs)) as client:
        await clock.advance(1.0)
        assert (await get_json(client, f"{PREFIX}/health/live"))["status"] == "ok"
        # the loop cannot take a round for longer than one call (bounded by the lease) and one
        # full backoff, twice over (2 * (3 + 2) = 10 s) without being stuck
        clock.stall(9.0)
        assert (await get_json(client, f"{PREFIX}/health/live"))["status"] == "ok"
        clock.stall(2.0)
        # 11 s or 12 s: the node's random phase may put its second round after the first 1 s
        assert jobs.engine is not None
        silent_s = jobs.engine.snapshot().last_round_s_ago
        wedged = await get_json(client, f"{PREFIX}/health/live", 503)
        await clock.advance(0.0)  # the loop gets to run again
        recovered = await get_json(client, f"{PREFIX}/health/live")
    assert 11.0 <= silent_s <= 12.0
    assert wedged["reason"] == f"the election loop has not completed a round for {silent_s:.1f}s"
    assert recovered["status"] == "ok"


async def test_the_readiness_probe_waits_on_the_injected_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Engine.probe_store`` PINGs the store, wakes the election and polls for its round on the
    clock it was given: on a ``FakeClock`` it waits, bounded, in zero real time."""
    clock = FakeClock(datetime(2026, 1, 1, tzinfo=UTC))
    jobs = fake_clock_jobs(clock, "memory://router-probe")
    async with jobs:
        await clock.advance(1.0)
        engine = jobs.engine
        assert engine is not None
        elect = engine.store.elect

        async def refused(*args: Any, **kwargs: Any) -> Any:
            raise ConnectionError("refused")

        monkeypatch.setattr(engine.store, "elect", refused)
        began = time.monotonic()
        failing = asyncio.create_task(engine.probe_store(1.0))
        await clock.advance(0.9)
        assert not failing.done(), "it waits for the round on the fake clock"
        await clock.advance(0.2)
        assert failing.done() and failing.result() is False
        monkeypatch.setattr(engine.store, "elect", elect)
        answering = asyncio.create_task(engine.probe_store(1.0))
        await clock.advance(0.05)
        assert answering.done() and answering.result() is True
        elapsed_s = time.monotonic() - began
    assert elapsed_s < 0.9, "no real time spent waiting"


async def test_status_returns_what_get_jobs_serves() -> None:
    clock = FakeClock(datetime(2026, 1, 1, tzinfo=UTC))
    jobs = fake_clock_jobs(clock, "memory://router-status")
    release = asyncio.Event()

    @jobs.fixed_rate("tick", every=1.0)
    async def tick() -> None:
        pass

    @jobs.fixed_rate("slow", every=1.0)
    async def slow() -> None:
        await release.wait()

    @jobs.fixed_rate("off", every=1.0, enabled=False)
    async def off() -> None:
        pass

    async with serve(make_app(jobs, prefixes=("",))) as client:
        await clock.advance(3.5)  # runs at 1, 2, 3; the clock stands still while we compare
        served = await get_json(client, "/jobs")
        one = await get_json(client, "/jobs/tick")
        # The router adds each job's checkpoint, read from the store; status() makes no call.
        checkpoints = {job["name"]: job.pop("checkpoint") for job in served["jobs"]}
        one_checkpoint = one["job"].pop("checkpoint")
        assert [job.checkpoint for job in jobs.status().jobs] == [None, None, None]
        assert (
            jobs.status().model_dump(mode="json", exclude={"jobs": {"__all__": {"checkpoint"}}})
            == served
        )
        only = jobs.status("tick").model_dump(
            mode="json", exclude={"jobs": {"__all__": {"checkpoint"}}}
        )
        with pytest.raises(KeyError, match="nope"):
            jobs.status("nope")
        release.set()
        await clock.settle()
    tick_view, slow_view, off_view = served["jobs"]
    assert (tick_view["runs"], tick_view["running"], tick_view["running_since"]) == (3, False, None)
    assert tick_view["next_run"] == "2026-01-01T00:00:04Z"
    assert tick_view["lease_time_left_s"] > 0
    assert (slow_view["runs"], slow_view["running"]) == (0, True)
    assert slow_view["running_since"] == "2026-01-01T00:00:01Z"
    assert slow_view["dropped_ticks"] == 2, "the ticks at 2 and 3 came while it ran"
    assert slow_view["dropped"] == {
        "overlap": 2,
        "late": 0,
        "lease_expired": 0,
        "already_run": 0,
        "clock_ahead": 0,
        "store_error": 0,
        "paused": 0,
        "no_leader": 0,
        "misfire_skipped": 0,
    }
    assert off_view["enabled"] is False
    assert checkpoints["tick"]["iteration"] == 3 and one_checkpoint == checkpoints["tick"]
    assert checkpoints["tick"]["last_scheduled_at"] == "2026-01-01T00:00:03Z"
    assert checkpoints["tick"]["node_id"] == "node-a" and "state" not in checkpoints["tick"]
    assert checkpoints["slow"] is None and checkpoints["off"] is None, "nothing recorded yet"
    assert served["store"]["last_contact_s_ago"] is not None
    assert only.pop("jobs") == [one.pop("job")]
    assert only == one


# -- layering -----------------------------------------------------------------------------

WEB = Path(__file__).parent.parent / "fastapi_singletonjob" / "_web"


def test_the_web_layer_imports_neither_the_facade_nor_the_engine() -> None:
    """``_web`` reads a ``StatusSource`` and calls ``AdminActions``: it imports neither
    ``SingletonJobs``, the admin client, the CLI nor the engine, not even for types (an
    ``if TYPE_CHECKING:`` import counts), so no import cycle runs through it."""
    forbidden = {"_singletonjobs", "_admin", "_cli", "_engine.engine", "_engine"}
    found: list[tuple[str, str]] = []
    for path in sorted(WEB.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = (node.module or "").removeprefix("fastapi_singletonjob.")
                names = {module, *(f"{module}.{a.name}".lstrip(".") for a in node.names)}
                if names & forbidden:
                    found.append((path.name, module))
    assert found == []


async def test_status_after_stop_keeps_what_the_runs_did() -> None:
    """``status()`` after ``stop()`` showed no runs (issue 29, item 11): a test that stops the
    node and then reads its counters saw zeros. They stay until the next start, which counts
    from zero again ("since startup"); nothing is running or due."""
    clock = FakeClock(datetime(2026, 3, 1, tzinfo=UTC))
    jobs = SingletonJobs("memory://router-after-stop", project="after-stop", clock=clock)

    @jobs.interval("sweep", every=1.0)
    async def sweep() -> None:
        pass

    await jobs.start()
    await clock.advance(3.5)
    await jobs.stop()
    status = jobs.status()
    (job,) = status.jobs
    assert (status.started, status.state) == (False, "stopped")
    assert job.runs == 4 and job.last_run is not None and job.last_run.outcome == "success"
    assert job.next_run is None and not job.running and not job.is_leader
    assert jobs.status("sweep").jobs[0].runs == 4
    await jobs.start()
    assert jobs.status().jobs[0].runs in (0, 1)  # the new engine's own count
    await jobs.stop()
