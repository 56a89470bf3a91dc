"""The example app: its lifespan runs the jobs in-process, and ``python -m example_app`` serves
HTTP as a real process that exits 0 on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from waiting import wait_until

from example_app.main import Counters, create_app

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0


async def test_lifespan_runs_the_jobs_and_the_route_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SINGLETONJOB_REDIS_URL", "memory://")
    monkeypatch.setenv("SINGLETONJOB_PROJECT", "example-test")
    app = create_app()
    counters: Counters = app.state.counters
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://example") as client,
    ):
        response = await client.get("/")
        assert response.status_code == 200
        body = response.json()
        assert body == {
            "node_id": app.state.jobs.node_id,
            "jobs": ["daily-report", "heartbeat", "price-tick"],
        }
        # price-tick fires every 500 ms on the epoch grid; heartbeat as soon as the node leads
        await wait_until(lambda: counters.price_ticks >= 2, 5.0, "two price ticks")
        await wait_until(lambda: counters.heartbeats >= 1, 5.0, "a heartbeat")
    assert app.state.jobs.engine is None, "the lifespan stopped the jobs"
    assert counters.reports == 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for_http(process: subprocess.Popen[bytes], url: str, log: Path) -> httpx.Response:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the app exited with {process.returncode}:\n{log.read_text()}")
        try:
            return httpx.get(url, timeout=1.0)
        except httpx.TransportError:
            time.sleep(0.05)
    pytest.fail(f"no HTTP answer from {url} within {START_TIMEOUT_S}s:\n{log.read_text()}")


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM is POSIX")
def test_python_m_example_app_serves_and_exits_0_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "example_app.log"
    env = {
        **os.environ,
        "PORT": str(port),
        "SINGLETONJOB_REDIS_URL": "memory://",
        "SINGLETONJOB_PROJECT": "example-test",
    }
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "example_app"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        response = wait_for_http(process, f"http://127.0.0.1:{port}/", log)
        assert response.status_code == 200
        assert response.json()["jobs"] == ["daily-report", "heartbeat", "price-tick"]
        deadline = time.monotonic() + 5.0
        while "price-tick #1 " not in log.read_text():
            assert time.monotonic() < deadline, f"price-tick never ran:\n{log.read_text()}"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the app did not exit within {STOP_TIMEOUT_S}s:\n{log.read_text()}")
        assert code == 0, log.read_text()
        output = log.read_text()
        assert "memory://" in output
        assert "released leadership of" in output
        assert "Application shutdown complete" in output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
