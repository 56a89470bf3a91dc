"""What the docs say about iteration, catch-up and Redis Cluster, checked against the code: each
test runs the behaviour a sentence describes and checks that the docs say what it does (they
said otherwise before: ``iteration`` was "runs started by this node", catch-up "one instant",
"none from before startup", and Redis Cluster "not supported yet")."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

from redis.asyncio import RedisCluster

from fastapi_singletonjob import JobContext, SingletonJobs
from fastapi_singletonjob._config.settings import ENV_PREFIX, ENV_SETTINGS
from fastapi_singletonjob._store.open import open_store
from fastapi_singletonjob._store.redis.cluster import ClusterLeaseStore
from fastapi_singletonjob.testing import FakeClock

ROOT = Path(__file__).parent.parent
START = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def text(name: str) -> str:
    """A doc's text with its line breaks folded, so that a phrase may wrap."""
    return " ".join((ROOT / name).read_text(encoding="utf-8").split())


def node(clock: FakeClock, url: str, name: str) -> SingletonJobs:
    return SingletonJobs(
        url,
        project="claims",
        node_id=name,
        clock=clock,
        heartbeat_interval=1.0,
        lock_expiry=3.0,
        placement="first",
    )


async def test_iteration_counts_the_runs_of_the_whole_cluster() -> None:
    clock = FakeClock(START)
    url = "memory://docs-claims-iteration"
    seen: list[tuple[str, int]] = []
    a, b = node(clock, url, "a"), node(clock, url, "b")
    for jobs in (a, b):

        @jobs.interval("sweep", every=1.0)
        async def sweep(ctx: JobContext) -> None:
            seen.append((ctx.node_id, ctx.iteration))

    await a.start()
    await b.start()
    await clock.advance(4.5)
    await a.stop()  # graceful: b takes the job over at the release notice
    await clock.advance(3.0)
    await b.stop()
    ran_a = [i for n, i in seen if n == "a"]
    ran_b = [i for n, i in seen if n == "b"]
    assert ran_a and ran_b
    assert ran_a == list(range(1, len(ran_a) + 1))
    assert ran_b[0] == ran_a[-1] + 1, "b's first run goes on from a's count"
    for doc in ("README.md", "docs/concepts.md"):
        assert "number in the whole cluster" in text(doc), doc
        assert "runs of this job started by this node" not in text(doc), doc


async def test_catch_up_runs_the_instants_from_before_startup() -> None:
    clock = FakeClock(START)
    url = "memory://docs-claims-catch-up"
    first = node(clock, url, "first")
    runs: list[datetime] = []

    @first.cron("rep", "* * * * * *", misfire="catch_up", misfire_grace=60)
    async def rep(ctx: JobContext) -> None:
        runs.append(ctx.scheduled_at)

    async with first:
        await clock.advance(2.5)
    ran_before = len(runs)
    assert ran_before >= 2
    await clock.advance(5.0)  # the whole fleet is down for 5 s
    fresh = node(clock, url, "fresh")
    fresh.cron("rep", "* * * * * *", misfire="catch_up", misfire_grace=60)(rep)
    started_at = clock.now()
    async with fresh:
        await clock.advance(1.5)
    missed = [instant for instant in runs[ran_before:] if instant < started_at]
    assert len(missed) >= 4, f"instants of the downtime run by the fresh node: {missed}"
    assert all(b - a == timedelta(seconds=1) for a, b in zip(runs, runs[1:], strict=False))
    design = text("docs/design.md")
    assert "also those from before its own startup" in design
    assert "Instants before a node's own startup are not caught up" not in design
    assert "Catch-up covers one instant" not in design


async def test_redis_cluster_is_documented_as_supported() -> None:
    client = RedisCluster(host="127.0.0.1", port=7000)  # not connected: built lazily
    try:
        jobs = SingletonJobs(redis=client, project="claims")
        store = open_store(jobs.settings, [], client=client, clock=jobs.clock)
        assert isinstance(store, ClusterLeaseStore)
        await store.aclose()
        by_url = SingletonJobs("redis+cluster://127.0.0.1:7000,127.0.0.1:7001/", project="claims")
        assert "redis+cluster://" in by_url.store_description
    finally:
        await client.aclose()
    design = text("docs/design.md")
    assert "Redis Cluster is not supported" not in design
    assert "Redis Cluster puts a project on one shard" in design


# Misspellings that tests and docs show on purpose, as what the library warns of.
UNKNOWN_ON_PURPOSE = {"SINGLETONJOB_LOCKEXPIRY", "SINGLETONJOB_COLOUR", "SINGLETONJOB_HAS_CLIENT"}


def test_the_harness_variables_are_not_the_librarys() -> None:
    """The test and bench harness's own variables use a prefix the library does not own
    (``SJTEST_``): a ``SINGLETONJOB_*`` one made the library warn of an unknown variable inside
    the nox sessions that set it. Every ``SINGLETONJOB_*`` name in the tests, the bench, the
    noxfile, CI and the docs is a setting (or a misspelling shown on purpose)."""
    settings = {ENV_PREFIX + name.upper() for name in ENV_SETTINGS}
    places = [ROOT / "noxfile.py", ROOT / ".ci" / "run", ROOT / "README.md"]
    for folder, pattern in (("tests", "*.py"), ("bench", "*.py"), ("docs", "*.md")):
        places += sorted((ROOT / folder).rglob(pattern))
    found = {
        (name, str(place.relative_to(ROOT)))
        for place in places
        for name in re.findall(r"\bSINGLETONJOB_[A-Z][A-Z0-9_]*", place.read_text("utf-8"))
    }
    strays = sorted(f"{name} in {place}" for name, place in found if name not in settings)
    assert [s for s in strays if s.split()[0] not in UNKNOWN_ON_PURPOSE] == []
    assert any(name == "SINGLETONJOB_REDIS_URL" for name, _ in found), "the scan reads the files"
