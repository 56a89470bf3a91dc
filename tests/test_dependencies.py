"""Job parameters resolved by FastAPI's dependency system, on the memory store and fake clock.

No ``from __future__ import annotations`` here, on purpose: the jobs and dependencies are
defined inside the tests, and FastAPI reads ``Annotated[..., Depends(local_function)]`` when
the job is registered, so the annotations must be objects, not strings naming locals.
"""

import asyncio
import contextlib
import hashlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime
from typing import Annotated, Any

import pytest
from fake_nodes import stop
from fastapi import (
    BackgroundTasks,
    Body,
    Cookie,
    Depends,
    FastAPI,
    Header,
    Path,
    Request,
    Response,
)
from waiting import wait_until

from fastapi_singletonjob import (
    ConfigurationError,
    JobContext,
    Outcome,
    SingletonJobs,
    job_context,
)
from fastapi_singletonjob._job import dependencies as _dependencies
from fastapi_singletonjob._run.runner import JobRunner
from fastapi_singletonjob.testing import FakeClock

START = datetime(2026, 1, 1, tzinfo=UTC)
EVERY_S = 1.0
RUN_TIMEOUT_S = 5.0
"""Real seconds a run may take: sync jobs and sync dependencies run in threads."""


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


@pytest.fixture
async def jobs(clock: FakeClock, request: pytest.FixtureRequest) -> AsyncIterator[SingletonJobs]:
    digest = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:16]
    jobs = SingletonJobs(
        f"memory://{digest}",
        project="deps",
        node_id="a",
        clock=clock,
        heartbeat_interval=1.0,
        lock_expiry=3.0,
        shutdown_timeout=2.0,
    )
    yield jobs
    await stop(jobs, clock)


@contextlib.asynccontextmanager
async def serving(app: FastAPI, clock: FakeClock) -> AsyncIterator[None]:
    """The app's lifespan, left while the fake clock keeps moving."""
    lifespan = app.router.lifespan_context(app)
    await lifespan.__aenter__()
    try:
        yield
    finally:
        task = asyncio.create_task(lifespan.__aexit__(None, None, None))
        while not task.done():
            await clock.advance(0.05)
        await task


def runner(jobs: SingletonJobs, name: str) -> JobRunner:
    assert jobs.engine is not None
    return jobs.engine.runners[name]


def finished(r: JobRunner, runs: int) -> Callable[[], bool]:
    return lambda: r.stats.runs >= runs


def written(r: JobRunner) -> Callable[[], bool]:
    return lambda: r.unwritten == 0


async def next_runs(jobs: SingletonJobs, clock: FakeClock, *names: str) -> None:
    """Advance one period (one fixed-rate tick) and wait, in bounded real time, until each
    of ``names`` has finished one more run; fail with its error if the run failed."""
    runners = [runner(jobs, name) for name in names]
    targets = [r.stats.runs + 1 for r in runners]
    await clock.advance(EVERY_S)
    for r, target in zip(runners, targets, strict=True):
        await wait_until(finished(r, target), RUN_TIMEOUT_S, f"run #{target} of {r.spec.name!r}")
        last = r.stats.last_run
        assert last is not None
        assert last.outcome is Outcome.SUCCESS, f"{r.spec.name!r}: {last.error}"


# -- resolution ---------------------------------------------------------------------------


async def test_depends_and_annotated_depends_nested_sync_and_async(
    jobs: SingletonJobs, clock: FakeClock
) -> None:
    class Repo:
        def __init__(self, conn: str) -> None:
            self.conn = conn

    def settings() -> dict[str, str]:
        return {"dsn": "db://primary"}

    async def connection(cfg: Annotated[dict[str, str], Depends(settings)]) -> str:
        return f"conn to {cfg['dsn']}"

    def repository(conn: Annotated[str, Depends(connection)]) -> Repo:
        return Repo(conn)

    seen: list[tuple[str, str]] = []

    @jobs.fixed_rate("nested", every=EVERY_S)
    async def nested(
        repo: Annotated[Repo, Depends(repository)],
        cfg: dict[str, str] = Depends(settings),  # noqa: B008 - the pre-Annotated style
    ) -> None:
        seen.append((repo.conn, cfg["dsn"]))

    await jobs.start()
    await next_runs(jobs, clock, "nested")
    assert seen == [("conn to db://primary", "db://primary")]


async def test_a_dependency_used_twice_is_called_once_per_run(
    jobs: SingletonJobs, clock: FakeClock
) -> None:
    calls = 0

    def counter() -> int:
        nonlocal calls
        calls += 1
        return calls

    def doubled(n: Annotated[int, Depends(counter)]) -> int:
        return 2 * n

    seen: list[tuple[int, int, int]] = []

    @jobs.fixed_rate("cached", every=EVERY_S)
    async def cached(
        n: Annotated[int, Depends(counter)],
        twice: Annotated[int, Depends(doubled)],
        fresh: Annotated[int, Depends(counter, use_cache=False)],
    ) -> None:
        seen.append((n, twice, fresh))

    await jobs.start()
    await next_runs(jobs, clock, "cached")
    # `n` and `doubled` share one call; `use_cache=False` asks for a second one
    assert calls == 2
    await next_runs(jobs, clock, "cached")
    assert calls == 4, "the cache lives for one run only"
    assert seen == [(1, 2, 2), (3, 6, 4)]


async def test_a_sync_job_gets_async_dependencies_and_an_async_job_sync_ones(
    jobs: SingletonJobs, clock: FakeClock
) -> None:
    loop_thread = threading.get_ident()
    threads: dict[str, int] = {}

    async def on_the_loop() -> int:
        return threading.get_ident()

    def in_a_thread() -> int:
        return threading.get_ident()

    @jobs.fixed_rate("sync-job", every=EVERY_S)
    def sync_job(dep_thread: Annotated[int, Depends(on_the_loop)], ctx: JobContext) -> None:
        threads["async dependency"] = dep_thread
        threads["sync job"] = threading.get_ident()
        assert ctx.job == "sync-job"

    @jobs.fixed_rate("async-job", every=EVERY_S)
    async def async_job(dep_thread: Annotated[int, Depends(in_a_thread)]) -> None:
        threads["sync dependency"] = dep_thread
        threads["async job"] = threading.get_ident()

    await jobs.start()
    await next_runs(jobs, clock, "sync-job", "async-job")
    assert threads["async dependency"] == loop_thread
    assert threads["async job"] == loop_thread
    assert threads["sync job"] != loop_thread
    assert threads["sync dependency"] != loop_thread


async def test_a_plain_parameter_with_a_default_gets_its_default(
    jobs: SingletonJobs, clock: FakeClock
) -> None:
    seen: list[tuple[int, str, str | None]] = []

    @jobs.fixed_rate("defaults", every=EVERY_S)
    def defaults(
        ctx: JobContext,
        limit: int = 50,
        label: str = "nightly",
        tenant: Annotated[str | None, Header()] = None,
    ) -> None:
        seen.append((limit, label, tenant))

    await jobs.start()
    await next_runs(jobs, clock, "defaults")
    assert seen == [(50, "nightly", None)]


# -- yield dependencies -------------------------------------------------------------------


def yield_dependency(kind: str, journal: list[str]) -> Callable[..., Any]:
    """A ``yield`` dependency (sync or async) that journals its entry and its exit, with the
    exception thrown into it if any."""
    if kind == "async":

        async def resource_async() -> AsyncIterator[str]:
            journal.append("enter")
            try:
                yield "resource"
            except BaseException as exc:
                journal.append(f"exit {type(exc).__name__}")
                raise
            journal.append("exit")

        return resource_async

    def resource_sync() -> Iterator[str]:
        journal.append("enter")
        try:
            yield "resource"
        except BaseException as exc:
            journal.append(f"exit {type(exc).__name__}")
            raise
        journal.append("exit")

    return resource_sync


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_yield_dependency_is_closed_after_a_successful_run(
    jobs: SingletonJobs, clock: FakeClock, kind: str
) -> None:
    journal: list[str] = []
    resource = yield_dependency(kind, journal)

    @jobs.fixed_rate("ok", every=EVERY_S)
    async def ok(value: Annotated[str, Depends(resource)]) -> None:
        journal.append(f"run with {value}")

    await jobs.start()
    await next_runs(jobs, clock, "ok")
    assert journal == ["enter", "run with resource", "exit"]
    await next_runs(jobs, clock, "ok")
    assert journal[3:] == ["enter", "run with resource", "exit"], "entered anew per run"


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_yield_dependency_is_closed_after_the_job_raises(
    jobs: SingletonJobs, clock: FakeClock, kind: str
) -> None:
    journal: list[str] = []
    resource = yield_dependency(kind, journal)

    @jobs.fixed_rate("boom", every=EVERY_S)
    async def boom(value: Annotated[str, Depends(resource)]) -> None:
        journal.append("run")
        raise RuntimeError("downstream is down")

    await jobs.start()
    await clock.advance(EVERY_S)
    stats = runner(jobs, "boom").stats
    await wait_until(lambda: stats.runs == 1, RUN_TIMEOUT_S, "the failed run is recorded")
    assert journal == ["enter", "run", "exit RuntimeError"], "closed before the run counted"
    assert stats.failures == 1
    assert stats.last_run is not None
    assert stats.last_run.outcome is Outcome.FAILED
    assert stats.last_run.error == "RuntimeError: downstream is down"


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_yield_dependency_is_closed_when_the_run_is_cancelled_by_its_timeout(
    jobs: SingletonJobs, clock: FakeClock, kind: str
) -> None:
    journal: list[str] = []
    resource = yield_dependency(kind, journal)

    @jobs.fixed_rate("hang", every=10.0, timeout=1.5)
    async def hang(value: Annotated[str, Depends(resource)]) -> None:
        journal.append("run")
        await clock.sleep(100)
        journal.append("never")

    await jobs.start()
    await clock.advance(10.0)
    await wait_until(lambda: "run" in journal, RUN_TIMEOUT_S, "the run started")
    stats = runner(jobs, "hang").stats
    assert stats.runs == 0
    await clock.advance(1.5)
    await wait_until(lambda: stats.runs == 1, RUN_TIMEOUT_S, "the timed-out run is recorded")
    # FastAPI 0.115 closes a sync generator dependency with GeneratorExit, recent ones throw
    # the CancelledError into it: either way its teardown ran before the run was counted.
    assert journal[:2] == ["enter", "run"]
    assert journal[2:] in (["exit CancelledError"], ["exit GeneratorExit"]), journal
    assert stats.timeouts == 1
    assert stats.last_run is not None
    assert stats.last_run.outcome is Outcome.TIMEOUT


async def test_a_failing_dependency_fails_the_run_and_closes_those_already_entered(
    jobs: SingletonJobs, clock: FakeClock
) -> None:
    journal: list[str] = []
    resource = yield_dependency("async", journal)

    def broken() -> str:
        raise LookupError("no such tenant")

    @jobs.fixed_rate("never-runs", every=EVERY_S)
    async def never_runs(
        value: Annotated[str, Depends(resource)], other: Annotated[str, Depends(broken)]
    ) -> None:
        journal.append("run")

    await jobs.start()
    await clock.advance(EVERY_S)
    stats = runner(jobs, "never-runs").stats
    await wait_until(lambda: stats.runs == 1, RUN_TIMEOUT_S, "the failed run is recorded")
    assert journal == ["enter", "exit LookupError"], "the job itself never ran"
    assert stats.failures == 1
    assert stats.last_run is not None
    assert stats.last_run.error == "LookupError: no such tenant"


# -- overrides ----------------------------------------------------------------------------


async def test_overrides_set_on_the_app_after_startup_apply_from_the_next_run(
    jobs: SingletonJobs, clock: FakeClock
) -> None:
    def greeting() -> str:
        return "real"

    def punctuation() -> str:
        return "."

    def sentence(mark: Annotated[str, Depends(punctuation)]) -> str:
        return f"hello{mark}"

    seen: list[tuple[str, str]] = []

    @jobs.fixed_rate("greet", every=EVERY_S)
    async def greet(
        word: Annotated[str, Depends(greeting)], text: Annotated[str, Depends(sentence)]
    ) -> None:
        seen.append((word, text))

    app = FastAPI(lifespan=jobs.lifespan)
    async with serving(app, clock):
        await next_runs(jobs, clock, "greet")
        app.dependency_overrides[greeting] = lambda: "fake"
        app.dependency_overrides[punctuation] = lambda: "!"  # nested: also overridden
        await next_runs(jobs, clock, "greet")
        app.dependency_overrides.clear()
        await next_runs(jobs, clock, "greet")
    assert seen == [("real", "hello."), ("fake", "hello!"), ("real", "hello.")]


# -- JobContext ---------------------------------------------------------------------------


async def test_job_context_parameters_in_any_position_alongside_depends(
    jobs: SingletonJobs, clock: FakeClock
) -> None:
    def one() -> int:
        return 1

    def two() -> int:
        return 2

    seen: list[tuple[JobContext, JobContext, JobContext, int, int]] = []

    @jobs.fixed_rate("mixed", every=EVERY_S)
    async def mixed(
        first: JobContext,
        a: Annotated[int, Depends(one)],
        middle: JobContext,
        b: int = Depends(two),
        *,
        last: JobContext,
    ) -> None:
        seen.append((first, middle, last, a, b))

    assert not jobs.jobs["mixed"].call.trivial
    await jobs.start()
    await next_runs(jobs, clock, "mixed")
    await next_runs(jobs, clock, "mixed")
    (first, middle, last, a, b), second = seen
    assert first is middle is last
    assert (first.job, first.node_id, first.fencing_token, first.iteration) == ("mixed", "a", 1, 1)
    assert first.scheduled_at == datetime(2026, 1, 1, 0, 0, 1, tzinfo=UTC)
    assert (a, b) == (1, 2)
    assert second[0].iteration == 2, "each run gets its own context"


async def test_jobs_with_only_a_context_skip_fastapis_machinery(
    jobs: SingletonJobs, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, object]] = []

    @jobs.fixed_rate("bare", every=EVERY_S)
    async def bare() -> None:
        seen.append(("bare", None))

    @jobs.fixed_rate("ctx-only", every=EVERY_S)
    def ctx_only(context: JobContext, again: JobContext) -> None:
        assert context is again
        seen.append(("ctx-only", context.job))

    assert jobs.jobs["bare"].call.trivial
    assert jobs.jobs["ctx-only"].call.trivial

    async def no_solving(**kwargs: object) -> None:
        raise AssertionError("solve_dependencies called for a trivial job")

    monkeypatch.setattr(_dependencies, "solve_dependencies", no_solving)
    await jobs.start()
    await next_runs(jobs, clock, "bare", "ctx-only")
    assert sorted(seen) == [("bare", None), ("ctx-only", "ctx-only")]


async def test_only_code_that_can_see_the_context_is_shown_a_checkpoint(
    jobs: SingletonJobs, clock: FakeClock
) -> None:
    """The runner makes a run's ``Checkpoint`` only for code that can see its context (a
    parameter, or a dependency: ``job_context``); a job that takes none counts its runs the
    same, exactly, in the stored record."""
    shown: list[JobContext] = []

    @jobs.fixed_rate("bare", every=EVERY_S)
    async def bare() -> None:
        pass

    @jobs.fixed_rate("takes-ctx", every=EVERY_S)
    async def takes_ctx(ctx: JobContext) -> None:
        shown.append(ctx)

    def stamp(ctx: Annotated[JobContext, Depends(job_context)]) -> int:
        return ctx.iteration

    @jobs.fixed_rate("through-a-dependency", every=EVERY_S)
    async def through(iteration: Annotated[int, Depends(stamp)]) -> None:
        pass

    calls = {name: jobs.jobs[name].call for name in ("bare", "takes-ctx", "through-a-dependency")}
    assert {name: call.sees_context for name, call in calls.items()} == {
        "bare": False,
        "takes-ctx": True,
        "through-a-dependency": True,
    }
    await jobs.start()
    for _ in range(3):
        await next_runs(jobs, clock, *calls)

    assert [ctx.iteration for ctx in shown] == [1, 2, 3]
    assert [ctx.checkpoint.iteration if ctx.checkpoint else 0 for ctx in shown] == [0, 1, 2]
    for name in calls:
        await wait_until(written(runner(jobs, name)), RUN_TIMEOUT_S, f"{name}'s records")
        stored = await jobs.checkpoint(name)
        assert stored is not None and stored.iteration == 3, name


# -- refused at registration --------------------------------------------------------------


async def wants_query(q: int) -> None:
    raise AssertionError("never runs")


async def wants_request(request: Request) -> None:
    raise AssertionError("never runs")


async def wants_response(response: Response) -> None:
    raise AssertionError("never runs")


async def wants_background(bg: BackgroundTasks) -> None:
    raise AssertionError("never runs")


async def wants_body(payload: Annotated[dict[str, int], Body()]) -> None:
    raise AssertionError("never runs")


async def wants_path(item_id: Annotated[int, Path()]) -> None:
    raise AssertionError("never runs")


async def wants_cookie(session: Annotated[str, Cookie()]) -> None:
    raise AssertionError("never runs")


async def wants_header(x_tenant: Annotated[str, Header()]) -> None:
    raise AssertionError("never runs")


def client_address(request: Request) -> str:
    return str(request.client)


def audit_log(address: Annotated[str, Depends(client_address)]) -> str:
    return address


async def wants_it_deep_down(audit: Annotated[str, Depends(audit_log)]) -> None:
    raise AssertionError("never runs")


@pytest.mark.parametrize(
    ("func", "parameter", "owner", "what"),
    [
        (wants_query, "q", "wants_query", "a query parameter"),
        (wants_request, "request", "wants_request", "the Request"),
        (wants_response, "response", "wants_response", "the Response"),
        (wants_background, "bg", "wants_background", "BackgroundTasks"),
        (wants_body, "payload", "wants_body", "a request body"),
        (wants_path, "item_id", "wants_path", "a path parameter"),
        (wants_cookie, "session", "wants_cookie", "a cookie"),
        (wants_header, "x_tenant", "wants_header", "a header"),
        (wants_it_deep_down, "request", "client_address", "the Request"),
    ],
)
async def test_parameters_only_a_request_can_supply_are_refused_at_registration(
    func: Callable[..., Any], parameter: str, owner: str, what: str
) -> None:
    jobs = SingletonJobs("memory://refused", project="deps")
    with pytest.raises(ConfigurationError) as caught:
        jobs.fixed_rate("bad-job", every=1.0)(func)
    message = str(caught.value)
    assert "'bad-job'" in message
    assert f"parameter {parameter!r} of {owner}" in message
    assert what in message
    assert "outside requests" in message, "says why, and how to fix it"
    assert (caught.value.job, caught.value.field) == ("bad-job", parameter)
    assert "bad-job" not in jobs.jobs


async def test_a_positional_only_parameter_is_refused_at_registration() -> None:
    jobs = SingletonJobs("memory://refused", project="deps")

    async def positional(limit: int = 5, /) -> None:
        raise AssertionError("never runs")

    with pytest.raises(ConfigurationError, match=r"'pos'.*'limit'.*positional-only"):
        jobs.interval("pos", every=1.0)(positional)


def test_a_dependency_gets_the_context_through_job_context() -> None:
    from typing import Annotated

    from fastapi import Depends

    from fastapi_singletonjob import JobContext, job_context

    seen: list[str] = []

    async def label(ctx: Annotated[JobContext, Depends(job_context)]) -> str:
        return f"{ctx.job}#{ctx.iteration}"

    clock = FakeClock()
    jobs = SingletonJobs("memory://ctx-dep", project="p", clock=clock)

    @jobs.fixed_rate("tick", every=1.0)
    async def tick(name: Annotated[str, Depends(label)]) -> None:
        seen.append(name)

    async def scenario() -> None:
        await jobs.start()
        await clock.advance(2.5)
        task = asyncio.create_task(jobs.stop())
        while not task.done():
            await clock.advance(0.05)

    asyncio.run(scenario())
    assert seen == ["tick#1", "tick#2"]


def test_a_dependency_declaring_a_bare_job_context_points_to_job_context() -> None:
    from fastapi import Depends

    from fastapi_singletonjob import ConfigurationError, JobContext

    def needs(ctx: JobContext) -> str:
        return ctx.job

    jobs = SingletonJobs("memory://ctx-bad", project="p")
    with pytest.raises(ConfigurationError, match="Depends\\(job_context\\)"):

        @jobs.interval("j", every=1)
        async def j(x: str = Depends(needs)) -> None:
            pass


def test_an_unresolvable_annotation_is_named_in_the_error() -> None:
    class Feed:
        pass

    def get_feed() -> Feed:
        return Feed()

    jobs = SingletonJobs("memory://unresolved", project="p")
    with pytest.raises(ConfigurationError) as raised:

        @jobs.interval("feed", every=1)
        async def feed_job(feed: "Annotated[Feed, Depends(get_feed)]") -> None:
            pass

    message = str(raised.value)
    assert "parameter 'feed'" in message
    assert "'Annotated[Feed, Depends(get_feed)]' could not be evaluated" in message
    assert "at module level" in message
