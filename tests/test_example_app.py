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

from example_app.main import Counters, PriceBook, PriceFeed, create_app, get_price_feed

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0
ALL_JOBS = [
    "cache-refresh",
    "daily-report",
    "heartbeat",
    "metrics-rollup",
    "price-tick",
    "session-cleanup",
]
"""The example app's jobs, sorted."""


async def test_lifespan_runs_the_jobs_and_the_routes_answer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SINGLETONJOB_REDIS_URL", "memory://")
    monkeypatch.setenv("SINGLETONJOB_PROJECT", "example-test")
    monkeypatch.setenv("HEARTBEAT_FILE", str(tmp_path / "heartbeat"))
    app = create_app()
    counters: Counters = app.state.counters
    book: PriceBook = app.state.price_book
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
            "jobs": ALL_JOBS,
        }
        # price-tick fires every 500 ms on the epoch grid; heartbeat as soon as the node leads
        await wait_until(lambda: counters.price_ticks >= 2, 5.0, "two price ticks")
        await wait_until(lambda: counters.heartbeats >= 1, 5.0, "a heartbeat")
        await wait_until(
            lambda: min(counters.cache_refreshes, counters.session_cleanups, counters.rollups) >= 1,
            5.0,
            "a run of each new job",
        )

        status = (await client.get("/singletonjob/jobs")).json()
        assert status["project"] == "example-test"
        assert status["node_id"] == app.state.jobs.node_id
        assert status["store"]["url"] == "memory://"
        by_name = {job["name"]: job for job in status["jobs"]}
        assert sorted(by_name) == ALL_JOBS
        tick = by_name["price-tick"]
        assert tick["is_leader"] is True
        assert tick["last_run"]["outcome"] == "success"
        # the jobs got their dependencies, and wrote with this node's fencing token
        assert set(book.quotes) == {"EURUSD", "GBPUSD"}
        assert book.fencing_token == tick["fencing_token"]
        line = read_text(app.state.heartbeat_path)
        assert f"token={by_name['heartbeat']['fencing_token']}" in line
        assert line.startswith(app.state.jobs.node_id)
        prices = (await client.get("/prices")).json()
        assert prices["fencing_token"] == book.fencing_token

        health = await client.get("/singletonjob/health")
        assert health.status_code == 200
        assert health.json() == {"status": "ok", "reason": None, "node_id": status["node_id"]}
        assert (await client.get("/singletonjob/health/live")).status_code == 200
    assert app.state.jobs.engine is None, "the lifespan stopped the jobs"
    assert counters.reports == 0
    # the heartbeat's `yield` dependency moved each run's file into place
    assert files_in(tmp_path) == ["heartbeat"]


def files_in(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


class FixedFeed(PriceFeed):
    async def latest(self) -> dict[str, float]:
        return {"EURUSD": 1.5}


async def test_a_dependency_override_reaches_the_jobs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SINGLETONJOB_REDIS_URL", "memory://")
    monkeypatch.setenv("SINGLETONJOB_PROJECT", "example-override")
    monkeypatch.setenv("HEARTBEAT_FILE", str(tmp_path / "heartbeat"))
    app = create_app()
    app.dependency_overrides[get_price_feed] = FixedFeed
    book: PriceBook = app.state.price_book
    async with app.router.lifespan_context(app):
        await wait_until(lambda: app.state.counters.price_ticks >= 1, 5.0, "a price tick")
    assert book.quotes == {"EURUSD": 1.5}


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
        "HEARTBEAT_FILE": str(tmp_path / "heartbeat"),
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
        base = f"http://127.0.0.1:{port}"
        response = wait_for_http(process, f"{base}/", log)
        assert response.status_code == 200
        assert response.json()["jobs"] == ALL_JOBS
        deadline = time.monotonic() + 5.0
        while "price-tick #1 " not in log.read_text():
            assert time.monotonic() < deadline, f"price-tick never ran:\n{log.read_text()}"
            time.sleep(0.05)
        jobs = httpx.get(f"{base}/singletonjob/jobs", timeout=5.0)
        assert jobs.status_code == 200
        assert [job["name"] for job in jobs.json()["jobs"]] == [
            "price-tick",
            "heartbeat",
            "daily-report",
            "cache-refresh",
            "session-cleanup",
            "metrics-rollup",
        ]
        health = httpx.get(f"{base}/singletonjob/health", timeout=5.0)
        assert health.status_code == 200, health.text
        assert health.json()["status"] == "ok"
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
