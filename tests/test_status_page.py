"""The status page (issue 30, item 3): ``GET {prefix}/ui`` and ``/ui/jobs/{name}``.

In a real headless Chromium, on a real redis-server: what the page shows (a paused job, the
overdue column, a failed run's error, a missed instant's reason), that a phone's 414 px do not
scroll sideways, that it loads nothing but itself and runs no script; and a screenshot for
docs/operations.md. Without a browser: the HTML's escaping, its headers, the 404, and the page
of a node whose Redis does not answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import os
import re
import socket
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from browser import Browser, chromium_or_skip
from fastapi import FastAPI
from servers import RedisServerFactory
from waiting import wait_until

from fastapi_singletonjob import SingletonJobs
from fastapi_singletonjob._web import page as status_page
from fastapi_singletonjob._web.models import ClusterJob, ClusterNode, HistoryEntry
from fastapi_singletonjob._web.page import STRIP_ENTRIES

PREFIX = "/sj"
PHONE_WIDTH = 414
SCREENSHOT = Path(__file__).parent.parent / "docs" / "images" / "status-page.png"
UPDATE_SCREENSHOT = "SJTEST_UPDATE_SCREENSHOT"
"""Set to 1 to write the screenshot to docs/images (else it goes to the test's tmp_path)."""
HOSTILE = "pricing API answered 502: <script>document.title='pwned'</script> & \"retry\""
"""An error text that would run a script if the page did not escape it."""
SETTLE_S = 10.0

Json = dict[str, Any]


def replica(url: str, project: str, node_id: str, release: asyncio.Event) -> SingletonJobs:
    """A node with a healthy job, one failing every third run with ``HOSTILE`` in its error,
    one to pause, one whose runs outlast its period (overlap), one whose first run hangs until
    ``release`` (overdue), and a nightly cron job."""
    jobs = SingletonJobs(
        url,
        project=project,
        node_id=node_id,
        heartbeat_interval=0.2,
        lock_expiry=1.0,
        shutdown_timeout=1.0,
        placement="first",
    )

    @jobs.fixed_rate("price-tick", every=0.1)
    async def price_tick() -> None:
        pass

    calls = itertools.count()

    @jobs.fixed_rate("export", every=0.1)
    async def export() -> None:
        if next(calls) % 3 == 1:
            raise RuntimeError(HOSTILE)

    @jobs.interval("sweep", every=0.05)
    async def sweep() -> None:
        pass

    @jobs.fixed_rate("slow-report", every=0.1)
    async def slow_report() -> None:
        await asyncio.sleep(0.15)

    @jobs.fixed_rate("stuck-import", every=0.1, overdue_grace=0.1)
    async def stuck_import() -> None:
        await release.wait()

    @jobs.cron("nightly", "0 3 * * *")
    async def nightly() -> None:
        pass

    return jobs


def app_of(jobs: SingletonJobs) -> FastAPI:
    app = FastAPI()
    app.include_router(jobs.router, prefix=PREFIX)
    return app


@contextlib.asynccontextmanager
async def http_server(app: FastAPI) -> AsyncIterator[str]:
    """``app`` served by uvicorn on this event loop at a free local port: its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await wait_until(lambda: server.started, SETTLE_S, "uvicorn serves")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


async def overdue(jobs: SingletonJobs) -> bool:
    """Whether the cluster view has stuck-import's overdue spell open."""
    view = await jobs.cluster_status()
    return any(job.overdue_since is not None for job in view.jobs if job.name == "stuck-import")


async def strip_full(jobs: SingletonJobs, job: str) -> bool:
    return len(await jobs.history(job, limit=STRIP_ENTRIES)) == STRIP_ENTRIES


async def history_has(jobs: SingletonJobs, job: str, word: str) -> bool:
    return any(word in (e.reason, e.outcome) for e in await jobs.history(job, limit=30))


# What the test reads of the page, in the page: every job card's badges, its rows (label:
# text), its strip's cells, and the page's own facts (width, scripts, title).
READ_PAGE = """JSON.stringify({
  scrollWidth: Math.max(document.documentElement.scrollWidth, document.body.scrollWidth),
  clientWidth: document.documentElement.clientWidth,
  innerWidth: window.innerWidth,
  title: document.title,
  scripts: document.querySelectorAll('script').length,
  text: document.body.innerText,
  jobs: Object.fromEntries([...document.querySelectorAll('article.job')].map(card => [
    card.dataset.job, {
      badges: [...card.querySelectorAll('.badge')].map(b => b.textContent),
      rows: Object.fromEntries([...card.querySelectorAll('dt')].map(
        dt => [dt.textContent, dt.nextElementSibling.innerText])),
      strip: [...card.querySelectorAll('.strip .cell')].map(
        c => ({kind: c.className.replace('cell ', ''), title: c.title})),
    }])),
})"""


def browse(base: str, workdir: Path, executable: str, screenshot: Path) -> tuple[Json, Json, Json]:
    """In Chromium: the overview at a phone's width, the failing job's page, then the overview
    at a desktop's width, screenshotted. Returns what each showed, and the requests made."""
    with Browser.start(workdir, executable) as browser:
        tab = browser.new_page(width=PHONE_WIDTH, height=896, mobile=True, scale=2)
        tab.navigate(f"{base}{PREFIX}/ui?refresh=0")
        phone = json.loads(tab.evaluate(READ_PAGE))
        tab.navigate(f"{base}{PREFIX}/ui/jobs/export?refresh=0")
        detail = json.loads(tab.evaluate(READ_PAGE))
        detail["entries"] = tab.evaluate(
            "[...document.querySelectorAll('.entry')].map(e => e.innerText)"
        )
        requests = [e["params"]["request"]["url"] for e in tab.events("Network.requestWillBeSent")]
        logged = [e["params"]["entry"] for e in tab.events("Log.entryAdded")]
        tab.resize(width=960, height=700, mobile=False)
        tab.navigate(f"{base}{PREFIX}/ui?refresh=0")
        png = tab.screenshot(screenshot)
        return phone, detail, {"requests": requests, "logged": logged, "png": len(png)}


@pytest.mark.redis
async def test_the_page_in_a_real_browser_shows_each_jobs_state(
    redis_url: str, unique_project: str, tmp_path: Path
) -> None:
    executable = chromium_or_skip()
    release = asyncio.Event()
    web1, web2 = (replica(redis_url, unique_project, n, release) for n in ("web-1", "web-2"))
    await web1.start()
    try:
        leads_all = lambda: all(job.is_leader for job in web1.status().jobs)  # noqa: E731
        await wait_until(leads_all, SETTLE_S, "web-1 leads every job")
        await web2.start()
        await wait_until(lambda: web1.status("sweep").jobs[0].runs >= 2, SETTLE_S, "sweep ran")
        await web1.pause("sweep")
        for job, word in (("export", "failed"), ("sweep", "paused"), ("slow-report", "overlap")):
            seen = functools.partial(history_has, web1, job, word)
            await wait_until(seen, SETTLE_S, f"{job}: {word}")
        await wait_until(functools.partial(overdue, web1), SETTLE_S, "stuck-import is overdue")
        shot = tmp_path / "page.png"
        if os.environ.get(UPDATE_SCREENSHOT) == "1":  # for the docs: every strip full
            shot = SCREENSHOT
            for job in ("price-tick", "export", "sweep", "slow-report"):
                full = functools.partial(strip_full, web1, job)
                await wait_until(full, SETTLE_S, f"{job}'s strip full")
        async with http_server(app_of(web1)) as base:
            phone, detail, traffic = await asyncio.to_thread(
                browse, base, tmp_path, executable, shot
            )
    finally:
        release.set()
        await web2.stop()
        await web1.stop()

    # A phone's width: nothing wider than the screen, so nothing to scroll sideways.
    assert phone["scrollWidth"] <= phone["clientWidth"] == PHONE_WIDTH, phone
    assert phone["innerWidth"] == PHONE_WIDTH, "the layout viewport grew past the screen"
    assert detail["scrollWidth"] <= detail["clientWidth"] == PHONE_WIDTH, detail
    assert detail["innerWidth"] == PHONE_WIDTH
    cards = phone["jobs"]
    names = ["price-tick", "export", "sweep", "slow-report", "stuck-import", "nightly"]
    assert list(cards) == names
    for card in cards.values():
        assert card["rows"]["Leader"].startswith("web-1"), card
    stuck = cards.pop("stuck-import")
    assert [b for b in stuck["badges"] if b.startswith("overdue ")], stuck
    assert re.fullmatch(r"since \d\d:\d\d:\d\dZ \([\d.]+\s\w+ ago\)", stuck["rows"]["Overdue"])
    assert all(card["rows"]["Overdue"] == "no" for card in cards.values()), cards
    assert not any(b.startswith("overdue") for card in cards.values() for b in card["badges"])
    assert "paused" in cards["sweep"]["badges"]
    assert cards["sweep"]["rows"]["Paused"].startswith("yes, since")
    assert cards["price-tick"]["rows"]["Paused"] == "no" and not cards["price-tick"]["badges"]
    assert "2 live nodes" in phone["text"]

    # A failed run's error, as text: shown, not run.
    assert cards["export"]["rows"]["Last failure"].endswith(f"RuntimeError: {HOSTILE}")
    assert any(f"RuntimeError: {HOSTILE}" in cell["title"] for cell in cards["export"]["strip"])
    assert {"o-failed", "o-success"} <= {cell["kind"] for cell in cards["export"]["strip"]}
    assert phone["scripts"] == 0 and "pwned" not in phone["title"]
    assert detail["scripts"] == 0 and "pwned" not in detail["title"]
    assert any(f"RuntimeError: {HOSTILE}" in entry for entry in detail["entries"])

    # A missed instant's reason: on hover in the strip, and in words on the card.
    paused = [c for c in cards["sweep"]["strip"] if c["kind"] == "o-missed"]
    assert paused and "not run: paused\nan operator had paused the job" in paused[-1]["title"]
    overlap = [c["title"] for c in cards["slow-report"]["strip"] if c["kind"] == "o-missed"]
    assert any("not run: overlap\nthe previous run was still going" in t for t in overlap)
    assert "overlap" in cards["slow-report"]["rows"]["Last not run"]
    nightly = cards["nightly"]["rows"]["Next run"]
    assert "03:00" in nightly and "(in " in nightly, nightly

    # Offline: the pages asked for nothing but themselves; no CSP or other error was logged.
    paths = {url.split("?")[0].removeprefix(base) for url in traffic["requests"]}
    assert paths <= {f"{PREFIX}/ui", f"{PREFIX}/ui/jobs/export", "/favicon.ico"}, traffic
    assert [e for e in traffic["logged"] if e.get("level") == "error"] == [], traffic["logged"]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and traffic["png"] > 10_000


# -- without a browser ----------------------------------------------------------------------


async def test_the_html_escapes_what_redis_holds_and_answers_404_for_an_unknown_job() -> None:
    """On the memory store: a failed run's error with markup in it, a job's 404 with markup
    in the asked name; the page's type and headers."""
    jobs = SingletonJobs("memory://status-page-html", project="html", node_id="n<1>")

    @jobs.fixed_rate("export", every=0.02)
    async def export() -> None:
        raise RuntimeError(HOSTILE)

    await jobs.start()
    try:

        async def five_failures() -> bool:
            return len(await jobs.history("export", limit=5)) == 5

        await wait_until(five_failures, SETTLE_S, "five failed runs")
        transport = httpx.ASGITransport(app=app_of(jobs))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            overview = await client.get(f"{PREFIX}/ui")
            one = await client.get(f"{PREFIX}/ui/jobs/export", params={"limit": 5})
            missing = await client.get(f"{PREFIX}/ui/jobs/<img src=x onerror=alert(1)>")
            bad = await client.get(f"{PREFIX}/ui", params={"refresh": -1})
    finally:
        await jobs.stop()
    for answer in (overview, one, missing):
        assert answer.headers["content-type"] == "text/html; charset=utf-8"
        assert answer.headers["content-security-policy"] == status_page.CONTENT_SECURITY_POLICY
        assert answer.headers["cache-control"] == "no-store"
        assert "<script" not in answer.text.lower()
        assert '<meta name="viewport" content="width=device-width, initial-scale=1">' in (
            answer.text
        )
    assert overview.status_code == one.status_code == 200
    escaped = "answered 502: &lt;script&gt;document.title=&#x27;pwned&#x27;&lt;/script&gt;"
    assert f"{escaped} &amp; &quot;retry&quot;" in overview.text
    assert escaped in one.text and one.text.count('class="entry"') == 5
    assert "n&lt;1&gt;" in overview.text and "n<1>" not in overview.text
    assert '<meta http-equiv="refresh" content="10">' in overview.text
    assert missing.status_code == 404
    assert "&lt;img src=x onerror=alert(1)&gt;" in missing.text and "<img" not in missing.text
    assert "Known jobs: export." in missing.text
    assert bad.status_code == 422


async def test_without_redis_the_page_is_this_nodes_view_and_a_503() -> None:
    """Redis down (nothing listens): the page still answers, 503, with a banner naming the
    error type, this node's jobs, and the URL without its password."""
    jobs = SingletonJobs("redis://:hunter2@127.0.0.1:1/0", project="down", node_id="n1")

    @jobs.interval("sweep", every=1.0)
    async def sweep() -> None:
        pass

    await jobs.start()
    try:
        transport = httpx.ASGITransport(app=app_of(jobs))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            answer = await client.get(f"{PREFIX}/ui")
            one = await client.get(f"{PREFIX}/ui/jobs/sweep")
    finally:
        await jobs.stop()
    assert answer.status_code == one.status_code == 503
    assert "Redis did not answer (ConnectionError)" in answer.text
    assert 'data-job="sweep"' in answer.text and "Redis did not answer" in one.text
    assert "hunter2" not in answer.text + one.text
    assert "redis://***@127.0.0.1:1/0" in answer.text


def test_an_overdue_job_gets_a_badge_and_its_time() -> None:
    """An overdue job (``overdue_since``, issue 30 item 2) gets a badge and its time."""
    now = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    stored = ClusterJob.model_validate(
        {
            "name": "export",
            "schedule": "fixed rate every 1s",
            "nodes": ["web-1"],
            "leader": "web-1",
            "fencing_token": 3,
            "lease_time_left_s": 8.0,
            "paused": False,
        }
    )
    ran = now - timedelta(seconds=90)
    entry = HistoryEntry.model_validate(
        {
            "scheduled_at": ran,
            "kind": "run",
            "node_id": "web-1",
            "fencing_token": 3,
            "recorded_at": ran,
            "outcome": "success",
        }
    )

    def render(overdue: datetime | None) -> str:
        job = status_page.PageJob("export", stored, None, [entry], overdue=overdue)
        data = status_page.PageData("p", "web-1", "memory://", now, [], [job])
        return status_page.overview(data, refresh_s=0)

    late = render(now - timedelta(seconds=30))
    assert '<span class="badge overdue">overdue 30\u00a0s</span>' in late
    assert 'since <time datetime="2026-12-02T11:59:30.000Z"' in late
    on_time = render(None)
    assert "badge overdue" not in on_time and "<dt>Overdue</dt><dd>no</dd>" in on_time
    assert '<meta http-equiv="refresh"' not in on_time


class Markup(HTMLParser):
    """The tags and attribute names of a page, and its text, as a browser's parser sees them."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.tags: set[str] = set()
        self.attributes: set[str] = set()
        self.text: list[str] = []
        self.feed(page)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        self.attributes.update(name for name, _ in attrs)
        self.text.extend(value for _, value in attrs if value)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def test_every_text_from_redis_is_escaped_wherever_the_page_writes_it() -> None:
    """Every string of the models that Redis can hold, set to markup that would add a tag or
    an event handler: the three pages have only their own tags and attributes, and show the
    markup as text."""
    now = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    bad = "x\" onmouseover='alert(1)' <img src=x onerror=alert(2)>"
    node = ClusterNode.model_validate(
        {
            "node_id": bad,
            "owner": bad,
            "version": bad,
            "started_at": now,
            "last_seen": now,
            "expires_in_s": 1.0,
            "jobs": [bad],
            "leads": [bad],
        }
    )
    stored = ClusterJob.model_validate(
        {
            "name": bad,
            "schedule": bad,
            "nodes": [bad],
            "leader": bad,
            "fencing_token": 1,
            "lease_time_left_s": 1.0,
            "paused": True,
            "paused_at": now,
            "checkpoint": {
                "iteration": 1,
                "last_completed_at": now,
                "last_scheduled_at": now,
                "last_outcome": bad,
                "last_error": bad,
                "node_id": bad,
                "fencing_token": 1,
                "has_state": False,
            },
        }
    )
    entries = [
        HistoryEntry.model_validate(
            {
                "scheduled_at": now,
                "kind": "run",
                "node_id": bad,
                "fencing_token": 1,
                "recorded_at": now,
                "outcome": "failed",
                "error": bad,
            }
        ),
        HistoryEntry.model_validate(
            {
                "scheduled_at": now,
                "kind": "missed",
                "node_id": bad,
                "fencing_token": 1,
                "recorded_at": now,
                "reason": "paused",
                "reason_text": bad,
            }
        ),
    ]
    with_history = status_page.PageJob(bad, stored, None, entries, overdue=now)
    without = status_page.PageJob(bad, stored, None, None, history_note=bad)
    data = status_page.PageData(bad, bad, bad, now, [node], [with_history], bad, [bad])
    pages = [
        status_page.overview(data, refresh_s=5),
        status_page.job_page(data, refresh_s=0),
        status_page.overview(dataclasses.replace(data, jobs=[without]), refresh_s=0),
        status_page.not_found(bad, [bad]),
    ]
    own_tags = {"html", "head", "meta", "title", "style", "body", "header", "h1", "h2", "p", "b"}
    own_tags |= {"a", "section", "ul", "ol", "li", "main", "article", "span", "dl", "dt", "dd"}
    own_tags |= {"time", "code", "div", "footer"}
    for text in pages:
        markup = Markup(text)
        assert markup.tags <= own_tags, markup.tags - own_tags
        assert not {a for a in markup.attributes if a.startswith("on")}, markup.attributes
        assert markup.attributes <= {"lang", "charset", "name", "content", "http-equiv", "id"} | {
            "class",
            "title",
            "href",
            "datetime",
            "data-job",
            "role",
            "aria-label",
        }
        assert any(bad in piece for piece in markup.text)


@pytest.mark.redis
async def test_a_redis_that_does_not_answer_delays_the_page_by_one_bounded_read(
    fresh_redis: RedisServerFactory, unique_project: str
) -> None:
    """Redis SIGSTOPped: the page answers 503 with this node's view after the cluster read's
    bound, and does not wait again for each job's history."""
    server = fresh_redis()
    jobs = SingletonJobs(
        server.url, project=unique_project, node_id="n1", heartbeat_interval=0.2, lock_expiry=1.0
    )
    for name in ("a", "b", "c"):
        jobs.interval(name, every=60)(noop)
    await jobs.start()
    try:
        await wait_until(lambda: jobs.status("a").jobs[0].is_leader, SETTLE_S, "n1 leads")
        transport = httpx.ASGITransport(app=app_of(jobs))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            server.pause()
            try:
                began = time.monotonic()
                answer = await client.get(f"{PREFIX}/ui")
                took_s = time.monotonic() - began
            finally:
                server.resume()
    finally:
        await jobs.stop()
    assert answer.status_code == 503
    assert "Redis did not answer (TimeoutError)" in answer.text
    assert answer.text.count('class="job"') == 3
    assert status_page.PAGE_READ_S <= took_s < status_page.PAGE_READ_S + 0.5, took_s


async def noop() -> None:
    pass
