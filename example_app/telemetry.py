"""Optional OpenTelemetry for the example: the application, not the library, picks the SDK.

``OTEL_METRICS_EXPORTER=prometheus`` serves metrics on ``:9464/metrics`` (needs
``opentelemetry-sdk`` and ``opentelemetry-exporter-prometheus``); ``OTEL_METRICS_EXPORTER=console``
prints metrics and spans (needs ``opentelemetry-sdk``). Unset: the library's instruments are
the API's no-ops.
"""

from __future__ import annotations

import importlib
import logging
import os

logger = logging.getLogger("example_app")


def setup_telemetry() -> str | None:
    """Install global tracer and meter providers as ``OTEL_METRICS_EXPORTER`` asks; return
    the exporter's name, or None when telemetry stays off."""
    exporter = os.environ.get("OTEL_METRICS_EXPORTER", "").strip().lower()
    if exporter in ("", "none"):
        return None
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        ConsoleMetricExporter,
        MetricReader,
        PeriodicExportingMetricReader,
    )
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

    reader: MetricReader
    if exporter == "prometheus":
        prometheus = importlib.import_module("opentelemetry.exporter.prometheus")
        client = importlib.import_module("prometheus_client")
        port = int(os.environ.get("OTEL_EXPORTER_PROMETHEUS_PORT", "9464"))
        client.start_http_server(port=port, addr="127.0.0.1")
        reader = prometheus.PrometheusMetricReader()
        logger.info("metrics served at http://127.0.0.1:%d/metrics", port)
    elif exporter == "console":
        reader = PeriodicExportingMetricReader(
            ConsoleMetricExporter(), export_interval_millis=10_000
        )
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        trace.set_tracer_provider(tracer_provider)
    else:
        raise SystemExit(f"OTEL_METRICS_EXPORTER={exporter!r}: use 'prometheus' or 'console'")
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    return exporter
