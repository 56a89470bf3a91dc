"""OpenTelemetry traces and metrics, through the API package only.

The application chooses the SDK and exporters; without one, every call here is a no-op of the
OpenTelemetry API (measured in the benchmarks). Metric attributes are bounded: the job name,
and an outcome, drop reason or change kind from a fixed set. The node is identified by the
application's OpenTelemetry resource (``service.instance.id``), and on spans.

=========================================  =========  =======  ==============================
instrument                                 kind       unit     attributes
=========================================  =========  =======  ==============================
``singletonjob.runs``                      counter    {run}    job, outcome
``singletonjob.run.duration``              histogram  s        job, outcome
``singletonjob.tick.lateness``             histogram  s        job
``singletonjob.ticks.dropped``             counter    {tick}   job, reason
``singletonjob.leader``                    gauge      1        job
``singletonjob.paused``                    gauge      1        job
``singletonjob.overdue``                   gauge      1        job
``singletonjob.overdue.spells``            counter    {spell}  job
``singletonjob.leadership.changes``        counter    {change} job, change
``singletonjob.leaderless.duration``       histogram  s        job
``singletonjob.election.duration``         histogram  s        (none)
``singletonjob.election.failures``         counter    {round}  error
=========================================  =========  =======  ==============================
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import (
    INVALID_SPAN,
    ProxyTracerProvider,
    Span,
    SpanKind,
    Status,
    StatusCode,
)

try:  # the API's stand-in until an SDK sets a provider (a private name: guarded)
    from opentelemetry.metrics._internal import _ProxyMeterProvider
except ImportError:  # pragma: no cover - another opentelemetry-api layout
    _ProxyMeterProvider = metrics.NoOpMeterProvider  # type: ignore[assignment,misc]

from ._outcomes import DropReason, Outcome
from ._version import __version__

if TYPE_CHECKING:
    from ._job.context import JobContext

__all__ = ["NOT_LEADER", "Telemetry"]

INSTRUMENTATION = "fastapi_singletonjob"

ATTR_JOB = "singletonjob.job"
ATTR_NODE = "singletonjob.node_id"
ATTR_TOKEN = "singletonjob.fencing_token"
ATTR_SCHEDULED = "singletonjob.scheduled_at"
ATTR_LATENESS = "singletonjob.lateness_s"
ATTR_ITERATION = "singletonjob.iteration"
ATTR_OUTCOME = "singletonjob.outcome"
ATTR_REASON = "singletonjob.reason"
ATTR_CHANGE = "singletonjob.change"
ATTR_ERROR = "error.type"

SPAN_RUN = "singletonjob.run"
NOT_LEADER = "not_leader"
"""Drop reason of a tick that came while another node led the job."""
CHANGES = ("acquired", "lost", "released")
SECONDS_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 300.0,
)  # fmt: skip
"""Histogram boundaries in seconds, from sub-millisecond lateness to a five-minute run (the
SDK's default boundaries are meant for milliseconds)."""


class _Instruments:
    """The instruments of one meter provider, shared by every ``Telemetry`` that uses it.

    Made once for the global provider: its stand-in keeps every meter ever asked of it, so a
    set per ``SingletonJobs`` would pile up in a process that makes many (a test suite)."""

    def __init__(self, meter_provider: metrics.MeterProvider | None) -> None:
        meter = metrics.get_meter(INSTRUMENTATION, __version__, meter_provider)
        self.runs = meter.create_counter(
            "singletonjob.runs", unit="{run}", description="Runs finished, by outcome."
        )
        self.run_duration = _seconds(meter, "singletonjob.run.duration", "How long runs took.")
        self.lateness = _seconds(
            meter,
            "singletonjob.tick.lateness",
            "Start of a run minus the instant it was scheduled for.",
        )
        self.dropped = meter.create_counter(
            "singletonjob.ticks.dropped",
            unit="{tick}",
            description="Ticks that started no run, by reason.",
        )
        self.changes = meter.create_counter(
            "singletonjob.leadership.changes",
            unit="{change}",
            description="Leadership terms this node acquired, lost or released.",
        )
        self.leaderless = _seconds(
            meter,
            "singletonjob.leaderless.duration",
            "Time a job had no live leader before this node took it over (estimated by the "
            "new leader).",
        )
        self.election_duration = _seconds(
            meter,
            "singletonjob.election.duration",
            "Round-trip time of one election round (all jobs of the node).",
        )
        self.election_failures = meter.create_counter(
            "singletonjob.election.failures",
            unit="{round}",
            description="Election rounds that failed, by error type.",
        )
        self.overdue_spells = meter.create_counter(
            "singletonjob.overdue.spells",
            unit="{spell}",
            description="Overdue spells that began, counted once cluster-wide: by the node "
            "that noticed (and called on_overdue).",
        )
        self.sources: weakref.WeakSet[Telemetry] = weakref.WeakSet()
        """The ``Telemetry`` objects whose leadership the gauge reports."""
        meter.create_observable_gauge(
            "singletonjob.leader",
            callbacks=[self._observe_leaders],
            unit="1",
            description="1 while this node leads the job, else 0.",
        )
        meter.create_observable_gauge(
            "singletonjob.paused",
            callbacks=[self._observe_paused],
            unit="1",
            description="1 while an operator has paused the job (jobs.pause), else 0.",
        )
        meter.create_observable_gauge(
            "singletonjob.overdue",
            callbacks=[self._observe_overdue],
            unit="1",
            description="1 while the job is overdue (its spell as stored, the same on every "
            "node that watches it), else 0.",
        )

    def _observe_overdue(self, options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(int(overdue), {ATTR_JOB: job})
            for source in list(self.sources)
            for job, overdue in source.overdue()
        ]

    def _observe_paused(self, options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(int(paused), {ATTR_JOB: job})
            for source in list(self.sources)
            for job, paused in source.paused()
        ]

    def _observe_leaders(self, options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(int(leads), {ATTR_JOB: job})
            for source in list(self.sources)
            for job, leads in source.leading()
        ]


def _seconds(meter: metrics.Meter, name: str, description: str) -> metrics.Histogram:
    """A histogram of durations in seconds, with buckets from 0.5 ms to five minutes."""
    return meter.create_histogram(
        name, unit="s", description=description, explicit_bucket_boundaries_advisory=SECONDS_BUCKETS
    )


_global_instruments: _Instruments | None = None


def _instruments(meter_provider: metrics.MeterProvider | None) -> _Instruments:
    global _global_instruments
    if meter_provider is not None:
        return _Instruments(meter_provider)
    if _global_instruments is None:
        _global_instruments = _Instruments(None)
    return _global_instruments


def _nobody_leads() -> Iterable[tuple[str, bool]]:
    return ()


class Telemetry:
    """The instruments of one ``SingletonJobs``; providers default to the global ones."""

    def __init__(
        self,
        node_id: str,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
    ) -> None:

        self._node_id = node_id
        self._explicit_traces = tracer_provider is not None
        self._explicit_metrics = meter_provider is not None
        self.tracing = True
        """Whether spans go anywhere (decided at ``register``, when the engine starts)."""
        self.metering = True
        """Whether metrics go anywhere (decided at ``register``)."""
        self._tracer = trace.get_tracer(INSTRUMENTATION, __version__, tracer_provider)
        instruments = _instruments(meter_provider)
        self._sources = instruments.sources
        self.runs = instruments.runs
        self.run_duration = instruments.run_duration
        self.lateness = instruments.lateness
        self.dropped = instruments.dropped
        self.changes = instruments.changes
        self.leaderless = instruments.leaderless
        self.election_duration = instruments.election_duration
        self.election_failures = instruments.election_failures
        self.overdue_spells = instruments.overdue_spells
        self.leading: Callable[[], Iterable[tuple[str, bool]]] = _nobody_leads
        """(job, leads) of every job of the running engine, for the leader gauge."""
        self.paused: Callable[[], Iterable[tuple[str, bool]]] = _nobody_leads
        """(job, paused) of every job of the running engine, for the paused gauge."""
        self.overdue: Callable[[], Iterable[tuple[str, bool]]] = _nobody_leads
        """(job, overdue) of every job the running engine watches, for the overdue gauge."""

    def register(
        self,
        jobs: Sequence[str],
        leading: Callable[[], Iterable[tuple[str, bool]]],
        paused: Callable[[], Iterable[tuple[str, bool]]] = lambda: (),
        overdue: Callable[[], Iterable[tuple[str, bool]]] = lambda: (),
        watched: Sequence[str] = (),
    ) -> None:
        """Start every per-job series at zero, so that dashboards show zeros, not gaps."""
        self._detect()
        self.leading = leading
        self.paused = paused
        self.overdue = overdue
        self._sources.add(self)
        if not self.metering:
            return
        for job in jobs:
            for outcome in Outcome:
                self.runs.add(0, {ATTR_JOB: job, ATTR_OUTCOME: outcome.value})
            for reason in (*(r.value for r in DropReason), NOT_LEADER):
                self.dropped.add(0, {ATTR_JOB: job, ATTR_REASON: reason})
            for change in CHANGES:
                self.changes.add(0, {ATTR_JOB: job, ATTR_CHANGE: change})
        for job in watched:
            self.overdue_spells.add(0, {ATTR_JOB: job})

    def unregister(self) -> None:
        """The engine stopped: the leader gauge no longer reports (nor holds) it."""
        self._sources.discard(self)
        self.leading = self.paused = self.overdue = _nobody_leads

    # -- runs -------------------------------------------------------------------------------

    def _detect(self) -> None:
        """Note whether spans and metrics go anywhere: a provider was passed, or an SDK was
        installed by the time the engine starts. Read once: the API reads the environment on
        every ``get_*_provider()`` call, too slow for the tick path."""
        self.tracing = self._explicit_traces or not isinstance(
            trace.get_tracer_provider(), _NO_TRACES
        )
        self.metering = self._explicit_metrics or not isinstance(
            metrics.get_meter_provider(), _NO_METRICS
        )

    def run_span(self, ctx: JobContext) -> contextlib.AbstractContextManager[Span]:
        """The span of one run, current while the job's code runs (its spans nest under it).

        Without an SDK (or passed providers) it is a shared do-nothing context: no
        attributes are built and no span is started on the tick path."""
        tracing = self.tracing
        if not (tracing or self.metering):
            return _NO_SPAN
        return self._run_span(ctx, tracing)

    @contextlib.contextmanager
    def _run_span(self, ctx: JobContext, tracing: bool) -> Iterator[Span]:
        lateness_s = (ctx.started_at - ctx.scheduled_at).total_seconds()
        self.lateness.record(max(lateness_s, 0.0), {ATTR_JOB: ctx.job})
        if not tracing:
            yield INVALID_SPAN
            return
        attributes: dict[str, Any] = {
            ATTR_JOB: ctx.job,
            ATTR_NODE: ctx.node_id,
            ATTR_TOKEN: ctx.fencing_token,
            ATTR_SCHEDULED: _iso(ctx.scheduled_at),
            ATTR_LATENESS: lateness_s,
            ATTR_ITERATION: ctx.iteration,
        }
        with self._tracer.start_as_current_span(
            SPAN_RUN,
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            yield span

    def run_finished(
        self, span: Span, job: str, outcome: Outcome, duration_s: float, error: BaseException | None
    ) -> None:
        """Count a finished run and close its span's story."""
        if span is INVALID_SPAN and not self.metering:
            return
        attributes = {ATTR_JOB: job, ATTR_OUTCOME: outcome.value}
        self.runs.add(1, attributes)
        self.run_duration.record(duration_s, attributes)
        span.set_attribute(ATTR_OUTCOME, outcome.value)
        if error is not None:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        elif outcome is not Outcome.SUCCESS:
            span.set_status(Status(StatusCode.ERROR, outcome.value))

    def drop(self, job: str, reason: str, count: int = 1) -> None:
        """Count ticks that started no run."""
        if self.metering:
            self.dropped.add(count, {ATTR_JOB: job, ATTR_REASON: reason})

    def overdue_spell(self, job: str) -> None:
        """Count an overdue spell of ``job`` that this node's check opened."""
        if self.metering:
            self.overdue_spells.add(1, {ATTR_JOB: job})

    # -- election ---------------------------------------------------------------------------

    def change(self, job: str, change: str) -> None:
        """Count a leadership change of this node: acquired, lost or released."""
        self.changes.add(1, {ATTR_JOB: job, ATTR_CHANGE: change})

    def leaderless_for(self, job: str, seconds: float) -> None:
        """Record how long ``job`` had no live leader before this node acquired it."""
        self.leaderless.record(max(seconds, 0.0), {ATTR_JOB: job})

    def election_round(self, seconds: float, error: BaseException | None) -> None:
        """Record one election round."""
        if error is None:
            self.election_duration.record(seconds)
        else:
            self.election_failures.add(1, {ATTR_ERROR: type(error).__name__})


_NO_TRACES = (ProxyTracerProvider, trace.NoOpTracerProvider)
_NO_METRICS = (_ProxyMeterProvider, metrics.NoOpMeterProvider)
_NO_SPAN: contextlib.AbstractContextManager[Span] = contextlib.nullcontext(INVALID_SPAN)


def _iso(value: datetime) -> str:
    return value.isoformat()
