"""Fixtures that give tests real redis-server processes, started and stopped by the suite.

The helpers live in ``servers.py`` and ``fault_proxy.py`` next to this file; ``tests/`` has
no ``__init__.py``, so pytest's default ``prepend`` import mode puts it on ``sys.path`` and
tests import them as ``from servers import RedisServer``.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from servers import RedisServer, RedisServerFactory

from fastapi_singletonjob import _odd


@pytest.fixture(autouse=True)
def _odd_values_reported_afresh() -> None:
    """The library says once per process that a stored value is odd (``_odd``): each test
    hears it as a fresh process would, whatever ran before it."""
    _odd.forget()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server shared by the whole run.

    Tests isolate themselves with unique key names (see ``unique_project``); nothing flushes
    it between tests. Never inject faults into it: use ``fresh_redis`` for that.
    """
    with RedisServer.start(data_dir=tmp_path_factory.mktemp("redis-shared")) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the shared server (``redis://127.0.0.1:<port>/0``)."""
    if not redis_server.running:
        pytest.fail(
            "the shared redis-server has died; a test killed it or crashed it (use fresh_redis "
            f"for fault injection). Log tail:\n{redis_server.log_tail()}"
        )
    return redis_server.url


@pytest.fixture
def fresh_redis(tmp_path: Path) -> Iterator[RedisServerFactory]:
    """Factory of dedicated servers for tests that kill, pause or restart Redis.

    ``server = fresh_redis(appendonly=False, extra_args=())``; every server it started is
    killed when the test ends, paused or not. Logs stay in the test's ``tmp_path``.
    """
    with contextlib.ExitStack() as stack:
        count = 0

        def start(*, appendonly: bool = False, extra_args: Sequence[str] = ()) -> RedisServer:
            nonlocal count
            count += 1
            server = RedisServer.start(
                appendonly=appendonly, extra_args=extra_args, data_dir=tmp_path / f"redis-{count}"
            )
            return stack.enter_context(server)

        yield start


@pytest.fixture
def unique_project() -> str:
    """A project name no other test uses, such as ``t-1a2b3c4d``."""
    return f"t-{secrets.token_hex(4)}"
