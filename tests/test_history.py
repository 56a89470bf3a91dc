"""A job's run history (issue 30, item 1): its last runs and the instants its leader did not
run, with the reason, kept in Redis, the same from every replica, written in the record's own
script call. On a fake clock with the memory store, then on a real redis-server."""

from __future__ import annotations

import asyncio
import io
import json
from datetime import timedelta

import httpx
import pytest
from fake_nodes import stop
from fastapi import FastAPI
from servers import RedisServer
from test_runner import Factory, clock, make
from waiting import wait_until

from fastapi_singletonjob import (
    ConfigurationError,
    DropReason,
    JobContext,
    Occurrence,
    SingletonJobs,
)
from fastapi_singletonjob._cli import main as cli
from fastapi_singletonjob._store import keys as _keys
from fastapi_singletonjob.testing import FakeClock

__all__ = ["clock", "make"]


async def test_runs_and_their_outcomes_newest_first(make: Factory, clock: FakeClock) -> None:
    jobs = make()
    outcomes = iter([None, "boom", None])

    @jobs.fixed_rate("tick", every=1.0)
    async def tick(ctx: JobContext) -> None:
        await clock.sleep(0.25)
        error = next(outcomes, None)
        if error:
            raise RuntimeError(error)

    await jobs.start()
    await clock.advance(3.5)
    entries = await jobs.history("tick")
    assert [entry.outcome for entry in entries] == ["success", "failed", "success"]
    newest, failed, oldest = entries
    assert newest.scheduled_at - oldest.scheduled_at == timedelta(seconds=2)
    assert failed.error == "RuntimeError: boom" and newest.error is None
    assert all(not entry.missed and entry.node_id == "a" for entry in entries)
    assert all(entry.duration_s == pytest.approx(0.25) for entry in entries)
    assert all(entry.started_at == entry.scheduled_at for entry in entries)
    assert len({entry.fencing_token for entry in entries}) == 1
    assert [entry.scheduled_at for entry in await jobs.history("tick", limit=2)] == [
        newest.scheduled_at,
        failed.scheduled_at,
    ]


async def test_an_instant_not_run_is_kept_with_its_reason(make: Factory, clock: FakeClock) -> None:
    """A run that outlasts its period drops the next tick (overlap); a paused job's
    instants are paused: each is an entry, with the reason in words."""
    jobs = make()

    @jobs.fixed_rate("slow", every=1.0)
    async def slow(ctx: JobContext) -> None:
        if ctx.iteration == 1:
            await clock.sleep(1.5)

    await jobs.start()
    await clock.advance(2.2)
    await jobs.pause("slow")
    await clock.advance(2.0)
    entries = list(reversed(await jobs.history("slow")))
    kinds = [(entry.missed, entry.reason or entry.outcome) for entry in entries]
    assert kinds[:2] == [(True, DropReason.OVERLAP.value), (False, "success")], kinds
    assert (True, DropReason.PAUSED.value) in kinds[2:], kinds
    assert all(entry.duration_s is None for entry in entries if entry.missed)


async def test_the_history_is_bounded_and_can_be_off(make: Factory, clock: FakeClock) -> None:
    jobs = make(history=3)

    @jobs.fixed_rate("kept", every=1.0)
    async def kept() -> None:
        pass

    @jobs.fixed_rate("own", every=1.0, history=1)
    async def own() -> None:
        pass

    @jobs.fixed_rate("none", every=1.0, history=0)
    async def none() -> None:
        pass

    @jobs.fixed_rate("no-checkpoint", every=1.0, checkpoint=False)
    async def no_checkpoint() -> None:
        pass

    await jobs.start()
    await clock.advance(6.5)
    assert len(await jobs.history("kept")) == 3
    assert len(await jobs.history("own")) == 1
    assert await jobs.history("none") == []
    assert await jobs.history("no-checkpoint") == []


@pytest.mark.parametrize("value", [-1, 10_001, 1.5, True, "100"])
def test_a_bad_history_is_refused_naming_the_job(value: object) -> None:
    jobs = SingletonJobs("memory://", project="p")
    with pytest.raises(ConfigurationError) as caught:
        jobs.fixed_rate("tick", every=1.0, history=value)  # type: ignore[arg-type]
    assert (caught.value.job, caught.value.field) == ("tick", "history")
    assert "history=100" in str(caught.value)
    with pytest.raises(ConfigurationError) as caught:
        SingletonJobs("memory://", project="p", history=value)  # type: ignore[arg-type]
    assert caught.value.field == "history"


def test_the_history_setting_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SINGLETONJOB_HISTORY", "7")
    assert SingletonJobs("memory://", project="p").settings.history == 7
    monkeypatch.setenv("SINGLETONJOB_HISTORY", "lots")
    with pytest.raises(ConfigurationError) as caught:
        SingletonJobs("memory://", project="p")
    assert "SINGLETONJOB_HISTORY" in str(caught.value)


async def test_a_handover_keeps_one_history_across_nodes(make: Factory, clock: FakeClock) -> None:
    """Node a stops gracefully, b takes over: one history, a's runs then b's, tokens
    increasing, and no instant twice."""
    a, b = make("a"), make("b")
    for jobs in (a, b):

        @jobs.fixed_rate("tick", every=1.0)
        async def tick() -> None:
            pass

    await a.start()
    await clock.advance(0.5)
    await b.start()
    await clock.advance(2.0)
    await stop(a, clock)
    await clock.advance(3.0)
    entries = list(reversed(await b.history("tick")))
    nodes = [entry.node_id for entry in entries if not entry.missed]
    assert nodes[0] == "a" and nodes[-1] == "b" and nodes == sorted(nodes), nodes
    tokens = [entry.fencing_token for entry in entries]
    assert tokens == sorted(tokens) and len(set(tokens)) == 2
    instants = [entry.scheduled_at for entry in entries if not entry.missed]
    assert len(instants) == len(set(instants))


@pytest.mark.redis
async def test_on_redis_two_replicas_read_the_same_history_and_serve_it(
    redis_url: str, redis_server: RedisServer, unique_project: str
) -> None:
    """On a real redis-server: a's runs, a graceful stop, b's runs; both replicas, the
    status route and the CLI read one history; an entry is a small JSON object."""

    def replica(node: str) -> SingletonJobs:
        jobs = SingletonJobs(
            redis_url,
            project=unique_project,
            node_id=node,
            heartbeat_interval=0.2,
            lock_expiry=1.0,
            placement="first",
        )

        @jobs.fixed_rate("tick", every=0.1)
        async def tick() -> None:
            pass

        return jobs

    a, b = replica("a"), replica("b")
    await a.start()
    await b.start()
    try:
        await wait_until(lambda: a.status("tick").jobs[0].runs >= 5, 10.0, "a ran")
        await a.stop()
        await wait_until(lambda: b.status("tick").jobs[0].runs >= 5, 10.0, "b ran")
        await b.stop()
        from_a, from_b = await a.history("tick"), await b.history("tick")
        assert from_a == from_b and all(isinstance(e, Occurrence) for e in from_a)
        runs = [entry for entry in reversed(from_a) if not entry.missed]
        assert {entry.node_id for entry in runs} == {"a", "b"}
        assert [entry.node_id for entry in runs] == sorted(entry.node_id for entry in runs)
        assert len({entry.scheduled_at for entry in runs}) == len(runs)

        app = FastAPI()
        app.include_router(b.router, prefix="/sj")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://b") as client:
            body = (await client.get("/sj/jobs/tick/history", params={"limit": 3})).json()
            missing = await client.get("/sj/jobs/nosuch/history")
        assert body["job"] == "tick"
        assert [e["node_id"] for e in body["entries"]] == [e.node_id for e in from_a[:3]]
        assert [e["kind"] for e in body["entries"]] == [
            "missed" if e.missed else "run" for e in from_a[:3]
        ]
        assert missing.status_code == 404

        out = io.StringIO()
        argv = ["history", "tick", "--json", "--limit", "2"]
        argv += ["--redis-url", redis_url, "--project", unique_project]
        code = await asyncio.to_thread(cli, argv, out)
        assert code == 0, out.getvalue()
        printed = json.loads(out.getvalue())
        assert [e["node_id"] for e in printed["entries"]] == [e.node_id for e in from_a[:2]]

        key = _keys.job_key(unique_project, "tick", "history")
        with redis_server.client() as client:
            size = client.memory_usage(key)
            length = client.llen(key)
            entry_bytes = len(client.lindex(key, 0) or b"")
        print(f"history: {length} entries, {size} bytes in Redis, {entry_bytes} bytes per entry")
        assert 0 < entry_bytes < 300
    finally:
        await a.stop()
        await b.stop()
