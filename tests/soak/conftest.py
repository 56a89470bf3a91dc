"""Fixtures of the soak runs: they skip unless ``SJTEST_SOAK=1`` (``nox -s soak``), and
the session's measurements print as a distribution in pytest's summary.

The ``redis_server`` and ``unique_project`` fixtures come from ``tests/conftest.py``. Set
``SJTEST_SOAK_RUNS=N`` for N runs of each scenario, ``SJTEST_SOAK_REPORT=path.json``
to keep every measured run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .measure import ENABLE_ENV, REPORT_ENV, Measurements, enabled

MEASUREMENTS = Measurements()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "soak: a scenario run many times on real servers (tests/soak, nox -s soak)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason=f"soak: runs with `nox -s soak` ({ENABLE_ENV}=1)")
    for item in items:
        if here in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.soak)
            item.add_marker(pytest.mark.redis)
            if not enabled():
                item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not MEASUREMENTS.scenarios:
        return
    terminalreporter.section("soak measurements")
    for line in MEASUREMENTS.lines():
        terminalreporter.write_line(line)
    path = os.environ.get(REPORT_ENV)
    if path:
        MEASUREMENTS.dump(Path(path))
        terminalreporter.write_line(f"written to {path}")


@pytest.fixture
def measurements() -> Measurements:
    """``measurements.add(scenario, run, time_s, bound_s=..., limit_s=...)``."""
    return MEASUREMENTS
