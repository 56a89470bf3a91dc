"""Fixtures of the chaos suite: a :class:`Cluster` per test and the session's measurements.

The ``redis_server`` (witness), ``fresh_redis`` (faulted store) and ``unique_project`` fixtures
come from ``tests/conftest.py``. Set ``SJTEST_CHAOS_REPORT=path.json`` to keep every
measured number of the run (the terminal summary prints them too).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from servers import RedisServer, RedisServerFactory

from .harness import HTTP_TIMEOUT_S, Cluster, Results

REPORT_ENV = "SJTEST_CHAOS_REPORT"

RESULTS = Results()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "chaos: a fault-injection row of docs/reliability.md (tests/chaos)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.chaos)
            item.add_marker(pytest.mark.redis)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not RESULTS.rows:
        return
    terminalreporter.section("chaos measurements")
    for line in RESULTS.lines():
        terminalreporter.write_line(line)
    path = os.environ.get(REPORT_ENV)
    if path:
        RESULTS.dump(Path(path))
        terminalreporter.write_line(f"written to {path}")


@pytest.fixture
def record() -> Results:
    """``record.add(row, test, **metrics)``: keep a row's measured numbers."""
    return RESULTS


@pytest.fixture
async def cluster(
    tmp_path: Path,
    redis_server: RedisServer,
    fresh_redis: RedisServerFactory,
    unique_project: str,
) -> AsyncIterator[Cluster]:
    """The processes of one chaos test; every one of them is killed at teardown."""
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S, headers={"Connection": "close"}) as client:
        group = Cluster(
            tmp_path, unique_project, witness=redis_server, servers=fresh_redis, http=client
        )
        try:
            yield group
        finally:
            await group.aclose()
