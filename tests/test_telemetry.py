"""OpenTelemetry spans and metrics, read back through the SDK's in-memory exporters."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from fastapi_singletonjob import JobContext, SingletonJobs
from fastapi_singletonjob.testing import FakeClock

START = datetime(2026, 1, 1, tzinfo=UTC)


class Otel:
    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])

    def points(self, name: str) -> list[tuple[dict[str, Any], Any]]:
        """(attributes, point) of every data point of the metric ``name``."""
        data = self.reader.get_metrics_data()
        found = []
        assert data is not None
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        for point in metric.data.data_points:
                            found.append((dict(point.attributes or {}), point))
        return found

    def value(self, name: str, **attributes: str) -> Any:
        matches = [
            p for a, p in self.points(name) if all(a.get(k) == v for k, v in attributes.items())
        ]
        assert len(matches) == 1, (name, attributes, self.points(name))
        point = matches[0]
        return getattr(point, "value", None) if hasattr(point, "value") else point.count

    def run_spans(self) -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if s.name == "singletonjob.run"]


@pytest.fixture
def otel() -> Otel:
    return Otel()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


Factory = Callable[..., SingletonJobs]


@pytest.fixture
async def make(
    clock: FakeClock, otel: Otel, request: pytest.FixtureRequest
) -> AsyncIterator[Factory]:
    made: list[SingletonJobs] = []
    url = f"memory://{abs(hash(request.node.nodeid))}"

    def factory(node_id: str = "a", **kwargs: Any) -> SingletonJobs:
        jobs = SingletonJobs(
            url,
            project="otel",
            node_id=node_id,
            clock=clock,
            heartbeat_interval=kwargs.pop("heartbeat_interval", 1.0),
            lock_expiry=kwargs.pop("lock_expiry", 3.0),
            tracer_provider=otel.tracer_provider,
            meter_provider=otel.meter_provider,
            **kwargs,
        )
        made.append(jobs)
        return jobs

    yield factory
    for jobs in made:
        task = asyncio.create_task(jobs.stop())
        while not task.done():
            await clock.advance(0.05)
        await task


async def test_one_span_per_run_with_the_run_facts(
    make: Factory, clock: FakeClock, otel: Otel
) -> None:
    jobs = make(node_id="node-1")
    inner = trace.get_tracer("user", tracer_provider=otel.tracer_provider)

    @jobs.fixed_rate("tick", every=1.0)
    async def tick(ctx: JobContext) -> None:
        with inner.start_as_current_span("user-work"):
            await clock.sleep(0.25)

    await jobs.start()
    await clock.advance(2.5)
    runs = otel.run_spans()
    assert len(runs) == 2
    first = runs[0]
    attributes = dict(first.attributes or {})
    assert attributes["singletonjob.job"] == "tick"
    assert attributes["singletonjob.node_id"] == "node-1"
    assert attributes["singletonjob.fencing_token"] == 1
    assert attributes["singletonjob.scheduled_at"] == "2026-01-01T00:00:01+00:00"
    assert attributes["singletonjob.lateness_s"] == 0.0
    assert attributes["singletonjob.outcome"] == "success"
    assert first.status.status_code is StatusCode.UNSET
    user = [s for s in otel.spans.get_finished_spans() if s.name == "user-work"]
    assert len(user) == 2
    assert user[0].parent is not None
    assert user[0].parent.span_id == first.context.span_id, "user spans nest under the run"


async def test_a_failing_run_records_the_error_on_its_span(
    make: Factory, clock: FakeClock, otel: Otel
) -> None:
    jobs = make()

    @jobs.fixed_rate("boom", every=1.0)
    async def boom() -> None:
        raise ValueError("bad price")

    await jobs.start()
    await clock.advance(1.0)
    (span,) = otel.run_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "ValueError: bad price"
    assert [e.name for e in span.events] == ["exception"]
    assert otel.value("singletonjob.runs", **{"singletonjob.outcome": "failed"}) == 1


async def test_series_start_at_zero_for_every_registered_job(
    make: Factory, clock: FakeClock, otel: Otel
) -> None:
    jobs = make()

    @jobs.cron("report", "0 3 * * *")
    async def report() -> None:
        pass

    await jobs.start()
    await clock.advance(0.1)
    outcomes = {
        a["singletonjob.outcome"]: p.value
        for a, p in otel.points("singletonjob.runs")
        if a["singletonjob.job"] == "report"
    }
    assert outcomes == {"success": 0, "failed": 0, "timeout": 0, "cancelled": 0}
    reasons = {a["singletonjob.reason"] for a, _ in otel.points("singletonjob.ticks.dropped")}
    assert reasons == {
        "overlap",
        "late",
        "lease_expired",
        "already_run",
        "clock_ahead",
        "store_error",
        "paused",
        "not_leader",
    }
    assert otel.value("singletonjob.leader", **{"singletonjob.job": "report"}) == 1


async def test_run_metrics_drops_and_lateness(make: Factory, clock: FakeClock, otel: Otel) -> None:
    jobs = make()

    @jobs.fixed_rate("slow", every=1.0)
    async def slow() -> None:
        await clock.sleep(2.5)

    await jobs.start()
    await clock.advance(10.0)
    runs = otel.value("singletonjob.runs", **{"singletonjob.outcome": "success"})
    assert runs >= 2
    duration = otel.value("singletonjob.run.duration", **{"singletonjob.outcome": "success"})
    assert duration == runs
    overlap = otel.value("singletonjob.ticks.dropped", **{"singletonjob.reason": "overlap"})
    assert overlap >= 2 * runs
    lateness = [p for a, p in otel.points("singletonjob.tick.lateness")]
    assert lateness and lateness[0].count >= runs and lateness[0].max == 0.0
    assert list(lateness[0].explicit_bounds[:3]) == [0.0005, 0.001, 0.0025], "buckets in seconds"


async def test_failover_between_two_nodes(make: Factory, clock: FakeClock, otel: Otel) -> None:
    a, b = make("a"), make("b")
    for jobs in (a, b):

        @jobs.fixed_rate("tick", every=0.5)
        async def tick() -> None:
            pass

    await a.start()
    await clock.settle()
    await b.start()
    await clock.advance(2.0)
    assert otel.value("singletonjob.leader", **{"singletonjob.job": "tick"}) == 1
    task = asyncio.create_task(a.stop())
    while not task.done():
        await clock.advance(0.01)
    await clock.advance(1.0)
    changes = {
        a_["singletonjob.change"]: p.value
        for a_, p in otel.points("singletonjob.leadership.changes")
    }
    assert changes == {"acquired": 2, "lost": 0, "released": 1}
    (gap,) = [p for _, p in otel.points("singletonjob.leaderless.duration")]
    assert gap.count == 1
    assert gap.max < 0.06, "a graceful handover leaves the job leaderless for a moment only"
    rounds = [p for _, p in otel.points("singletonjob.election.duration")]
    assert rounds and rounds[0].count >= 2


async def test_hard_kill_leaderless_time_is_about_one_expiry(
    make: Factory, clock: FakeClock, otel: Otel
) -> None:
    a, b = make("a"), make("b")
    for jobs in (a, b):

        @jobs.fixed_rate("tick", every=0.5)
        async def tick() -> None:
            pass

    await a.start()
    await clock.settle()
    await b.start()
    await clock.advance(2.0)
    engine = a.engine
    assert engine is not None and engine.election_task is not None
    engine.election_task.cancel()  # the leader stops renewing, as if killed
    await clock.advance(5.0)
    assert b.engine is not None and b.engine.elector.is_leader("tick")
    (gap,) = [p for _, p in otel.points("singletonjob.leaderless.duration")]
    assert 2.9 <= gap.max <= 3.1  # lock expiry (3 s) after the last renewal


async def test_election_failures_are_counted(
    make: Factory, clock: FakeClock, otel: Otel, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = make()

    @jobs.interval("job", every=1.0)
    async def job() -> None:
        pass

    await jobs.start()
    engine = jobs.engine
    assert engine is not None

    async def down(*args: object) -> object:
        raise ConnectionError("down")

    monkeypatch.setattr(engine.elector._store, "elect", down)
    await clock.advance(3.0)
    assert otel.value("singletonjob.election.failures", **{"error.type": "ConnectionError"}) >= 2


async def test_long_runs_are_warned_about_once_with_the_fix(
    make: Factory, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    jobs = make()

    @jobs.fixed_rate("slow", every=1.0)
    async def slow() -> None:
        await clock.sleep(2.9)

    await jobs.start()
    with caplog.at_level(logging.WARNING, logger="fastapi_singletonjob"):
        await clock.advance(12.0)
    messages = [r.getMessage() for r in caplog.records if "a run took" in r.getMessage()]
    assert len(messages) == 2, messages
    assert "290% of its period every=1s" in messages[0] and "lengthen `every`" in messages[0]
    assert "lock_expiry=3s" in messages[1] and "raise lock_expiry" in messages[1]


async def test_a_stopped_engine_is_not_held_by_the_global_meter_provider() -> None:
    """Without providers, instruments come from OpenTelemetry's global stand-in, which keeps
    every meter asked of it for the life of the process: neither the engines nor a set of
    instruments per SingletonJobs may pile up there."""
    import gc
    import weakref

    from opentelemetry import metrics

    def meters() -> int:
        return len(getattr(metrics.get_meter_provider(), "_meters", ()))

    engines: list[weakref.ref[object]] = []
    before = None
    for round_ in range(3):
        jobs = SingletonJobs("memory://", project=f"leak-{round_}", clock=FakeClock(START))

        @jobs.interval("job", every=1)
        async def job() -> None:
            pass

        async with jobs:
            assert jobs.engine is not None
            engines.append(weakref.ref(jobs.engine))
        before = meters() if before is None else before
    gc.collect()
    assert [ref() for ref in engines] == [None, None, None]
    assert meters() == before


async def test_paused_gauge_follows_pause_and_resume(
    make: Factory, clock: FakeClock, otel: Otel
) -> None:
    jobs = make()

    @jobs.cron("report", "0 3 * * *")
    async def report() -> None:
        pass

    await jobs.start()
    await clock.advance(0.1)
    assert otel.value("singletonjob.paused", **{"singletonjob.job": "report"}) == 0
    await jobs.pause("report")
    await clock.settle()  # the notice wakes the election: one round
    assert otel.value("singletonjob.paused", **{"singletonjob.job": "report"}) == 1
    await jobs.resume("report")
    await clock.settle()
    assert otel.value("singletonjob.paused", **{"singletonjob.job": "report"}) == 0


async def test_overdue_gauge_and_spells(make: Factory, clock: FakeClock, otel: Otel) -> None:
    """``singletonjob.overdue`` is 1 on the nodes that watch the job while its spell is open;
    ``singletonjob.overdue.spells`` counts the spell once, on the node that opened it."""
    from fake_nodes import kill

    told: list[object] = []
    leader, observer = make("a"), make("b")

    async def tell(event: object) -> None:
        told.append(event)

    async def tick() -> None:
        pass

    leader.fixed_rate("tick", every=1.0)(tick)
    observer.fixed_rate("tick", every=1.0, enabled=False, on_overdue=tell)(tick)
    await leader.start()
    await observer.start()
    await clock.advance(3.5)
    job = {"singletonjob.job": "tick"}
    assert otel.value("singletonjob.overdue", **job) == 0
    assert otel.value("singletonjob.overdue.spells", **job) == 0
    kill(leader)
    await clock.advance(12.0)
    assert len(told) == 1
    assert otel.value("singletonjob.overdue", **job) == 1
    assert otel.value("singletonjob.overdue.spells", **job) == 1
