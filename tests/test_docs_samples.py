"""Every ```python block of README.md and docs/*.md runs as written, or says in visible text
that it is a fragment.

A block that runs as written needs nothing the reader cannot see: it is executed alone. A
fragment (a few lines that use the app's ``jobs``, or stand-ins for the reader's own code) is
executed with the hidden preludes its HTML comment names (below), and must say so to the
reader: the paragraph right before it starts with ``*Fragment:*`` and says what it leans on,
for example ``*Fragment:* `jobs` is the app's `SingletonJobs`.`` A block that needs hidden
code without that paragraph fails, and so does an unmarked block that does not run.

Each block is executed as a module of its own (a fresh namespace, registered in sys.modules
while it runs, as dataclasses and pydantic expect), then:

- the ``test_*`` functions it defines are called (awaited when async);
- every FastAPI or Starlette app it defines gets its lifespan run briefly, and a GET on the
  readiness probe ``/singletonjob/health`` when it serves the router; without an app, every
  ``SingletonJobs`` it defines is started and stopped (``async with jobs:``);
- an ERROR logged by the library (a job run that failed), or a store it cannot reach, fails
  the sample.

Samples talk to the shared test Redis: ``redis://localhost:6379/0`` in the code is replaced
with its URL, and ``SINGLETONJOB_REDIS_URL`` points at it.

An HTML comment on the lines right before a block changes how it runs:

- ``<!-- sample: setup NAME ... -->``: run the named preludes of ``SETUPS`` first (the names a
  fragment takes from the text around it: ``jobs``, stand-ins for the reader's own code...);
  only for a block marked ``*Fragment:*``;
- ``<!-- sample: continue -->``: run the previous block of the page first, in the same module
  (a fragment that goes on with the code above it); only for a block marked ``*Fragment:*``;
- ``<!-- sample: raises ExceptionName -->``: the block must raise that exception;
- ``<!-- sample: errors-expected -->``: its jobs fail on purpose (an example of a failure);
- ``<!-- sample: skip REASON -->``: compiled, not run (keep these rare, with a reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import re
import sqlite3
import sys
import textwrap
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from starlette.applications import Starlette

from fastapi_singletonjob import SingletonJobs
from fastapi_singletonjob._config.settings import ENV_PREFIX, ENV_SETTINGS

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LIFESPAN_RUN_S = 0.1
LOCAL_REDIS = re.compile(r"redis://localhost:6379(?:/0)?\b")

FENCE = re.compile(
    r"^(?P<indent>[ ]*)```python[^\n]*\n(?P<code>.*?)^(?P=indent)```[ ]*$", re.S | re.M
)
MARKER = re.compile(r"^\s*<!--\s*sample:\s*(?P<kind>[\w-]+)\s*(?P<arg>.*?)\s*-->\s*$")
FRAGMENT = re.compile(r"^\*Fragment:\*\s+(?P<says>\S.*)$")
"""The visible mark of a fragment: the paragraph right before the block starts with it."""
OTHER_PYTHON_FENCE = re.compile(r"^[ ]*```[ ]*(?:py|py3|python3|pycon|ipython)\b", re.M)
"""Python fenced under another name, which this test would not see."""

STAND_INS = """
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass
class Settings:
    feed_url: str = "https://feed.example"
    database_url: str = "sqlite://"
    status_token: str = "s3cret"


settings = Settings()


class PriceFeed:
    def __init__(self, url: str = "https://feed.example") -> None:
        self.url = url

    async def latest(self) -> dict[str, float]:
        return {"EURUSD": 1.08}


STORED: list[tuple[dict[str, float], int]] = []


async def store_prices(quotes: dict[str, float], *, fencing_token: int) -> None:
    STORED.append((quotes, fencing_token))


def touch_heartbeat_file() -> None:
    pass


async def send_report(*, day: object) -> None:
    pass


class Session:
    async def __aenter__(self) -> "Session":
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    async def store_prices(self, quotes: dict[str, float], *, fencing_token: int) -> None:
        pass

    async def commit(self) -> None:
        pass

    async def rollback(self) -> None:
        pass

    async def close(self) -> None:
        pass


class Database:
    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, url: str = "sqlite://") -> AsyncIterator["Database"]:
        yield cls()

    async def execute(self, query: str, *args: object) -> None:
        pass


def connect_database() -> contextlib.AbstractAsyncContextManager[Database]:
    return Database.connect()


class Client:
    pass


def get_client() -> Client:
    return Client()


@dataclass
class AuditLog:
    job: str
    fencing_token: int


async def index_batch(batch: int, *, fencing_token: int) -> None:
    pass


class Feed:
    async def export_after(self, cursor: object) -> int:
        return 0 if cursor is None else int(str(cursor)) + 1


def get_feed() -> Feed:
    return Feed()
"""

SETUPS = {
    # Stand-ins for the reader's own code that the samples call: a feed, a database, settings.
    "stand-ins": STAND_INS,
    # The `jobs` that most fragments on a page refer to.
    "jobs": """
from datetime import timedelta
from typing import Annotated

from fastapi import Depends, FastAPI
from fastapi_singletonjob import JobContext, SingletonJobs

jobs = SingletonJobs("redis://localhost:6379/0", project="myapp")
""",
    # ... and the app that runs them (without the router: fragments include it their way).
    "app": """
app = FastAPI(lifespan=jobs.lifespan)
""",
    # The routes of a plain Starlette app.
    "routes": """
from starlette.routing import Route

routes: list[Route] = []
""",
    # The imports of a FastAPI module, for fragments that show a few lines of one.
    "imports": """
import contextlib
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Annotated

import httpx
from fastapi import Depends, FastAPI, Header, HTTPException, Request, status
from starlette.applications import Starlette
from starlette.routing import Mount

from fastapi_singletonjob import JobContext, SingletonJobs, job_context
""",
}


@dataclass
class Sample:
    """One ```python block and the markers before it."""

    path: Path
    line: int
    code: str
    setups: list[str] = field(default_factory=list)
    raises: str | None = None
    skip: str | None = None
    errors_expected: bool = False
    continues: Sample | None = None
    """The block this one goes on from (``continue``)."""
    fragment: str | None = None
    """What the visible ``*Fragment:*`` paragraph before the block says; None without one."""

    @property
    def id(self) -> str:
        return f"{shown_path(self.path)}:{self.line}"

    @property
    def hidden_code(self) -> list[str]:
        """What runs before the block that the reader does not see next to it."""
        return [f"setup {name}" for name in self.setups] + (
            ["the block above (continue)"] if self.continues else []
        )


def shown_path(path: Path) -> str:
    """A page's path as tracebacks and test ids show it: relative to the repository."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def paragraph_before(lines: list[str]) -> str:
    """The paragraph that ends with the last of ``lines``, joined into one line ('' when
    the lines end with something else, such as a code fence)."""
    paragraph: list[str] = []
    for line in reversed(lines):
        if not line.strip() or line.strip().startswith("```"):
            break
        paragraph.insert(0, line.strip())
    return " ".join(paragraph)


def unmarked(sample: Sample) -> str | None:
    """Why ``sample`` breaks the rule: it needs hidden code but does not say it is a
    fragment (None when it keeps the rule)."""
    if not sample.hidden_code or sample.fragment is not None:
        return None
    return (
        f"{sample.id}: the block runs only with code the reader cannot see next to it "
        f"({', '.join(sample.hidden_code)}); make it run as written, or start the paragraph "
        "right before it with '*Fragment:*' and say what it leans on"
    )


def extract(path: Path) -> Iterator[Sample]:
    """The python blocks of one Markdown file, with their markers."""
    text = path.read_text(encoding="utf-8")
    previous: Sample | None = None
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        sample = Sample(path, line, textwrap.dedent(match["code"]))
        before = text[: match.start()].splitlines()
        while before and (not before[-1].strip() or MARKER.match(before[-1])):
            marker = MARKER.match(before.pop())
            if marker is None:
                continue
            kind, arg = marker["kind"], marker["arg"]
            if kind == "setup":
                unknown = set(arg.split()) - set(SETUPS)
                assert not unknown, f"{sample.id}: unknown setup {unknown}"
                sample.setups = arg.split() + sample.setups
            elif kind == "raises":
                sample.raises = arg
            elif kind == "skip":
                assert arg, f"{sample.id}: say why the sample is skipped"
                sample.skip = arg
            elif kind == "errors-expected":
                sample.errors_expected = True
            elif kind == "continue":
                assert previous is not None, f"{sample.id}: nothing to continue"
                sample.continues = previous
            else:
                raise AssertionError(f"{sample.id}: unknown marker {kind!r}")
        visible = FRAGMENT.match(paragraph_before(before))
        sample.fragment = visible["says"] if visible else None
        yield sample
        previous = sample


SAMPLES = [sample for path in FILES for sample in extract(path)]


def test_samples_are_found() -> None:
    assert len(SAMPLES) >= 20
    skipped = [s.id for s in SAMPLES if s.skip]
    assert len(skipped) <= 3, f"too many skipped samples: {skipped}"


def test_every_block_runs_as_written_or_says_it_is_a_fragment() -> None:
    problems = [problem for sample in SAMPLES if (problem := unmarked(sample))]
    assert not problems, "\n".join(problems)


def test_python_blocks_are_fenced_as_python() -> None:
    for path in FILES:
        text = path.read_text(encoding="utf-8")
        for match in OTHER_PYTHON_FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            raise AssertionError(
                f"{shown_path(path)}:{line}: fence Python as ```python, which this test runs"
            )


@contextlib.contextmanager
def module(name: str) -> Iterator[types.ModuleType]:
    """A fresh module, in sys.modules while the sample runs."""
    mod = types.ModuleType(name)
    mod.__file__ = f"<{name}>"
    sys.modules[name] = mod
    try:
        yield mod
    finally:
        del sys.modules[name]


@contextlib.contextmanager
def environment() -> Iterator[None]:
    """Restore os.environ after a sample that sets variables."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


async def run_briefly(namespace: dict[str, object]) -> None:
    for name, value in list(namespace.items()):
        if name.startswith("test_") and inspect.isfunction(value):
            result = value()
            if inspect.isawaitable(result):
                await result
    apps = [v for v in namespace.values() if isinstance(v, Starlette)]
    for app in apps:
        async with app.router.lifespan_context(app):
            await asyncio.sleep(LIFESPAN_RUN_S)
            paths = app.openapi()["paths"] if isinstance(app, FastAPI) else {}
            if "/singletonjob/health" in paths:
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
                    ready = await client.get("/singletonjob/health")  # Redis reached
                    assert ready.status_code == 200, ready.text
    if not apps:
        for jobs in [v for v in namespace.values() if isinstance(v, SingletonJobs)]:
            async with jobs:
                await asyncio.sleep(LIFESPAN_RUN_S)


def compiled(block: Sample, redis_url: str) -> types.CodeType:
    """The block's code, pointed at the test's Redis."""
    # Padded to where the block starts, so that tracebacks show the file's lines;
    # dont_inherit: not this file's `from __future__ import annotations`.
    code = "\n" * block.line + LOCAL_REDIS.sub(redis_url, block.code)
    return compile(code, shown_path(block.path), "exec", dont_inherit=True)


async def run_sample(sample: Sample, redis_url: str) -> None:
    """Execute ``sample`` (after the blocks it continues and the preludes it names), then run
    briefly what it defines: its tests, its apps, its ``SingletonJobs``."""
    chain = [sample]
    while chain[0].continues is not None:
        chain.insert(0, chain[0].continues)
    name = "docs_sample_" + re.sub(r"\W", "_", sample.id)
    with environment(), module(name) as mod:
        for block in chain:
            prelude = LOCAL_REDIS.sub(redis_url, "\n".join(SETUPS[s] for s in block.setups))
            exec(compile(prelude, "<setup>", "exec", dont_inherit=True), mod.__dict__)
            if block is sample and sample.raises:
                with pytest.raises(Exception) as raised:
                    exec(compiled(block, redis_url), mod.__dict__)
                assert type(raised.value).__name__ == sample.raises, raised.value
                return
            exec(compiled(block, redis_url), mod.__dict__)
        try:
            await run_briefly(mod.__dict__)
        finally:
            for value in mod.__dict__.values():
                if isinstance(value, sqlite3.Connection):
                    value.close()  # what a sample opened at module level


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.id)
async def test_sample_runs(
    sample: Sample,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    problem = unmarked(sample)
    assert problem is None, problem
    if sample.skip:
        compiled(sample, redis_url)  # at least it parses
        pytest.skip(sample.skip)
    for name in list(os.environ):
        if name.startswith("SINGLETONJOB_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SINGLETONJOB_REDIS_URL", redis_url)
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.WARNING, logger="fastapi_singletonjob")
    await run_sample(sample, redis_url)
    logged = [r for r in caplog.records if r.name.startswith("fastapi_singletonjob")]
    unreachable = [r.getMessage() for r in logged if "cannot reach the lease store" in r.msg]
    assert not unreachable, f"{sample.id}: the sample's jobs did not reach Redis: {unreachable}"
    errors = [r.getMessage() for r in logged if r.levelno >= logging.ERROR]
    if not sample.errors_expected:
        assert not errors, f"{sample.id}: the library logged errors: {errors}"


# -- the rule itself, on a page written here --------------------------------------------------

PAGE = """\
# A page

Runs as written:

```python
ANSWER = 42
```

No mark, and it does not run on its own:

```python
print(UNDEFINED_NAME)
```

A fragment that hides what it needs:

<!-- sample: setup jobs -->
```python
@jobs.interval("x", every=60)
async def x() -> None: ...
```

*Fragment:* `jobs` is the app's `SingletonJobs`.

<!-- sample: setup jobs -->
```python
@jobs.interval("y", every=60)
async def y() -> None: ...
```

*Fragment:* goes on from the block above.

<!-- sample: continue -->
```python
assert y is not None
```
"""


@pytest.fixture
def page(tmp_path: Path) -> list[Sample]:
    path = tmp_path / "page.md"
    path.write_text(PAGE, encoding="utf-8")
    return list(extract(path))


def test_the_rule_finds_the_visible_marks(page: list[Sample]) -> None:
    assert [sample.fragment for sample in page] == [
        None,
        None,
        None,
        "`jobs` is the app's `SingletonJobs`.",
        "goes on from the block above.",
    ]
    assert [unmarked(sample) is None for sample in page] == [True, True, False, True, True]
    problem = unmarked(page[2])
    assert problem is not None
    assert "page.md:18" in problem and "setup jobs" in problem


async def test_the_rule_fails_an_unmarked_block_that_does_not_run(
    page: list[Sample], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SINGLETONJOB_REDIS_URL", "memory://")
    await run_sample(page[0], "memory://")
    with pytest.raises(NameError, match="UNDEFINED_NAME"):
        await run_sample(page[1], "memory://")


# -- the pages agree with the code ---------------------------------------------------------


def test_the_configuration_reference_lists_every_setting_and_keyword() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    settings = set(inspect.signature(SingletonJobs.__init__).parameters) - {"self"}
    for name in settings:
        assert f"| `{name}` |" in page, f"SingletonJobs({name}=...) is not in the settings table"
    for name in ENV_SETTINGS:  # pinned to the arguments of Settings.build by test_config
        variable = f"`{ENV_PREFIX}{name.upper()}`"
        assert f"| `{name}` | {variable} |" in page, f"{variable} is not documented"
    decorators = ("interval", "fixed_rate", "cron", "schedule")
    keywords = {
        name
        for decorator in decorators
        for name in inspect.signature(getattr(SingletonJobs, decorator)).parameters
    } - {"self", "name"}
    for name in keywords:
        assert f"| `{name}` |" in page, f"the per-job keyword {name!r} is not documented"


def github_anchor(heading: str) -> str:
    """The id GitHub (and the docs site, see mkdocs.yml) gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {github_anchor(m[1]) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_the_readme_links_to_pages_and_headings_that_exist() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", readme)
    local = [(target, anchor) for target, anchor in links if "://" not in target]
    assert len(local) > 10
    for target, anchor in local:
        path = ROOT / target
        assert path.exists(), f"README links to {target}, which does not exist"
        if anchor:
            assert anchor in anchors(path), f"README links to {target}#{anchor}: no such heading"
