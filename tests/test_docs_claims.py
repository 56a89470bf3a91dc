"""What the docs say about iteration, catch-up and Redis Cluster, checked against the code: each
test runs the behaviour a sentence describes and checks that the docs say what it does (they
said otherwise before: ``iteration`` was "runs started by this node", catch-up "one instant",
"none from before startup", and Redis Cluster "not supported yet")."""

from __future__ import annotations

import inspect
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from redis.asyncio import RedisCluster

from fastapi_singletonjob import (
    ConfigurationError,
    DropReason,
    JobContext,
    JobReport,
    JobStatus,
    NodeStatus,
    SingletonJobs,
    StoreStatus,
)
from fastapi_singletonjob._config.settings import ENV_PREFIX, ENV_SETTINGS, Settings
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


# -- the API reference and the status router, against the code (issue 29, item 9) -------------


def reference_defaults() -> dict[str, str]:
    """The defaults docs/reference.md states for ``SingletonJobs``' parameters (its
    ``extra.defaults.SingletonJobs`` option, which the parameters template shows)."""
    page = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    block = page.split("          SingletonJobs:\n", 1)[1]
    found: dict[str, str] = {}
    for line in block.splitlines():
        entry = re.fullmatch(r' {12}(\w+): "(.*)"', line)
        if entry is None:
            break
        found[entry.group(1)] = entry.group(2)
    return found


def shown(seconds: float) -> str:
    """A default duration as the reference writes it: ``3 s``, ``30 days``."""
    days = seconds / 86400
    return f"{days:g} days" if days >= 1 and days.is_integer() else f"{seconds:g} s"


def test_the_reference_states_every_singletonjobs_default_as_the_code_has_it() -> None:
    """The signature's ``None`` means "not given" and was shown as "Default: None" for every
    parameter; the reference now states each real default, checked here against the code."""
    stated = reference_defaults()
    parameters = [p for p in inspect.signature(SingletonJobs).parameters if p != "self"]
    assert sorted(stated) == sorted(parameters)
    settings = Settings.build(
        redis_url=None,
        has_client=False,
        project="p",
        node_id="n",
        heartbeat_interval=None,
        lock_expiry=None,
        max_backoff=None,
        shutdown_timeout=None,
        env={},
    )
    code = {
        "redis_url": f"`{settings.redis_url}`",
        "heartbeat_interval": shown(settings.heartbeat_interval_s),
        "lock_expiry": shown(settings.lock_expiry_s),
        "max_backoff": shown(settings.max_backoff_s),
        "shutdown_timeout": shown(settings.shutdown_timeout_s),
        "precision": shown(settings.precision_s),
        "checkpoint_retention": shown(settings.checkpoint_retention_s),
        "placement": f"`{settings.placement}`",
        "history": str(settings.history),
        "project": "required",
    }
    for name, value in code.items():
        assert stated[name].startswith(value), (name, stated[name], value)
    for name in ENV_SETTINGS:
        assert f"`{ENV_PREFIX}{name.upper()}`" in stated[name], name
    with pytest.raises(ConfigurationError, match="project is required"):
        Settings.build(
            redis_url=None,
            has_client=False,
            project=None,
            node_id=None,
            heartbeat_interval=None,
            lock_expiry=None,
            max_backoff=None,
            shutdown_timeout=None,
            env={},
        )
    template = ROOT / "docs" / "templates" / "python" / "material" / "docstring"
    assert "extra" in (template / "parameters.html.jinja").read_text(encoding="utf-8")


def test_the_singletonjobs_docstring_names_every_variable() -> None:
    """``SINGLETONJOB_PLACEMENT`` was missing from the reference's list of variables."""
    listed = (SingletonJobs.__doc__ or "").split(":param", 1)[0]  # the list, not each param
    doc = " ".join(listed.split())
    missing = [n for n in ENV_SETTINGS if f"``{ENV_PREFIX}{n.upper()}``" not in doc]
    assert missing == []


NUMBERS = {"four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9}


def test_status_router_counts_and_lists_its_routes() -> None:
    jobs = SingletonJobs("memory://docs-claims-routes", project="routes")
    routes = [r for r in jobs.router.routes if isinstance(r, APIRoute)]
    gets = sorted(r.path for r in routes if "GET" in (r.methods or set()))
    assert len(gets) == len(routes), "jobs.router changes nothing: GET routes only"
    page = text("docs/status-router.md")
    said = re.search(r"`APIRouter` with (\w+) `GET` routes", page)
    assert said is not None and NUMBERS[said.group(1)] == len(gets), said
    for path in gets:
        assert f"| `GET {path}` |" in page, path
    for match in re.finditer(r"\ball (\w+) routes\b|\bThe (\w+) routes\b", page):
        word = match.group(1) or match.group(2)
        assert word not in NUMBERS or NUMBERS[word] == len(gets), match.group(0)


def test_status_router_fields_cover_the_models() -> None:
    """Every field of the models ``GET /jobs`` answers with, and every drop reason
    (``state`` and ``clock_ahead`` were missing), has its row."""
    page = (ROOT / "docs" / "status-router.md").read_text(encoding="utf-8")
    fields = page.split("## Fields", 1)[1]
    rows = {
        name
        for row in re.findall(r"^\| (.+?) \|", fields, re.M)
        for name in re.findall(r"`(\w+)`", row)
    }
    for model in (NodeStatus, StoreStatus, JobStatus):
        missing = sorted(set(model.model_fields) - rows)
        assert missing == [], (model.__name__, missing)
    dropped = next(row for row in fields.splitlines() if row.startswith("| `dropped_ticks`"))
    missing = [reason.value for reason in DropReason if f"`{reason.value}`" not in dropped]
    assert missing == []


async def test_status_router_shows_health_as_it_answers_in_an_outage() -> None:
    """``GET /health`` is 200 ``degraded`` while Redis does not answer (``/health/jobs`` is
    503): the page showed 503 ``unavailable``."""
    jobs = SingletonJobs(
        "redis://127.0.0.1:9/0", project="outage", heartbeat_interval=0.1, lock_expiry=0.5
    )
    app = FastAPI()
    app.include_router(jobs.router)
    async with (
        jobs,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node") as http,
    ):
        ready, strict = await http.get("/health"), await http.get("/health/jobs")
    assert (ready.status_code, ready.json()["status"]) == (200, "degraded")
    assert strict.status_code == 503
    page = (ROOT / "docs" / "status-router.md").read_text(encoding="utf-8")
    section = page.split("### `GET /health`\n", 1)[1].split("\n### ", 1)[0]
    outage = [m for m in re.finditer(r'"status": "(\w+)",\n\s+"reason": "the lease store', section)]
    assert outage, "the section shows the outage"
    assert {m.group(1) for m in outage} == {"degraded"}


def test_a_sample_test_that_needs_redis_says_so() -> None:
    """A ``test_*`` in a sample that talks to ``redis://localhost`` fails in the reader's
    suite without a Redis: the text before it says so (operations.md's admin router test did
    not)."""
    fence = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
    silent = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        source = page.read_text(encoding="utf-8")
        for block in fence.finditer(source):
            code = block.group(1)
            if not re.search(r"^(async )?def test_", code, re.M) or "redis://localhost" not in code:
                continue
            before = source[: block.start()].rsplit("\n\n", 1)[-1]
            if "needs a redis" not in (before + code).lower():
                silent.append(f"{page.name}: {code.splitlines()[0]}")
    assert silent == []


def test_status_router_examples_have_every_field() -> None:
    """The ``GET /jobs`` and ``GET /jobs/{name}`` examples show every field of the answer (the
    page omitted ``state``)."""
    page = (ROOT / "docs" / "status-router.md").read_text(encoding="utf-8")
    for heading, model in (
        ("### `GET /jobs`\n", NodeStatus),
        ("### `GET /jobs/{name}`\n", JobReport),
    ):
        section = page.split(heading, 1)[1].split("\n### ", 1)[0]
        example = json.loads(section.split("```json\n", 1)[1].split("\n```", 1)[0])
        assert set(example) == set(model.model_fields), heading
        assert set(example["store"]) == set(StoreStatus.model_fields), heading
