"""A real headless Chromium for tests, driven over the DevTools protocol on a pipe.

``chromium --remote-debugging-pipe`` reads protocol messages from file descriptor 3 and writes
to 4, each a JSON object ended by a NUL byte: no websocket, no port, no Python dependency
(Puppeteer's pipe transport works the same way). ``--dump-dom`` and ``--screenshot`` alone
cannot set a phone's viewport or measure the page, so the tests speak the protocol:

    with Browser.start(tmp_path) as browser:
        page = browser.new_page(width=414, height=896, mobile=True)
        page.navigate("http://127.0.0.1:8000/ui")
        width = page.evaluate("document.documentElement.scrollWidth")

Every call is synchronous and bounded (``CALL_S``); run them in a thread
(``asyncio.to_thread``) when the page's server runs on the test's event loop.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = ["CHROMIUM", "Browser", "Page", "chromium_or_skip"]

CHROMIUM = "chromium"
"""Debian's package and command (``apt-get install --no-install-recommends chromium``)."""
CALL_S = 10.0
"""Bound on each protocol call, and on each page load."""
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-pipe",
)

Json = dict[str, Any]


def chromium_or_skip() -> str:
    """The chromium executable; skips the test when there is none, except under CI=true,
    where ``.ci/run`` installs it and its absence is a failure."""
    path = shutil.which(CHROMIUM)
    if path is None:
        reason = (
            "chromium is not installed (the status page's browser test needs it: "
            "apt-get install -y --no-install-recommends chromium)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; under CI=true .ci/run installs it")
        pytest.skip(reason)
    return path


class Browser:
    """One Chromium process and its protocol pipe."""

    def __init__(self, process: subprocess.Popen[bytes], to_browser: int, from_browser: int):
        self._process = process
        self._to = to_browser
        self._from = from_browser
        self._buffer = b""
        self._next_id = 0
        self._events: list[Json] = []

    @classmethod
    @contextlib.contextmanager
    def start(cls, workdir: Path, executable: str = CHROMIUM) -> Iterator[Browser]:
        """Start Chromium with a fresh profile under ``workdir``; kill it on exit."""
        profile = workdir / "chromium-profile"
        profile.mkdir(parents=True, exist_ok=True)
        to_read, to_browser = os.pipe()
        from_browser, to_write = os.pipe()

        def wire_pipes() -> None:  # in the child: the protocol's fds 3 and 4
            # Copies above both first: either end may itself be fd 3 or 4.
            high_read = fcntl.fcntl(to_read, fcntl.F_DUPFD, 10)
            high_write = fcntl.fcntl(to_write, fcntl.F_DUPFD, 10)
            os.dup2(high_read, 3)
            os.dup2(high_write, 4)

        with (workdir / "chromium.log").open("wb") as log:
            process = subprocess.Popen(
                [executable, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                pass_fds=(3, 4),  # as wire_pipes numbers them, in the child
                preexec_fn=wire_pipes,
            )
        os.close(to_read)
        os.close(to_write)
        browser = cls(process, to_browser, from_browser)
        try:
            yield browser
        finally:
            with contextlib.suppress(OSError, TimeoutError, EOFError, RuntimeError):
                browser.call("Browser.close", timeout_s=2.0)
            try:
                process.wait(timeout=3.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            os.close(to_browser)
            os.close(from_browser)

    def call(
        self,
        method: str,
        params: Json | None = None,
        *,
        session: str | None = None,
        timeout_s: float = CALL_S,
    ) -> Json:
        """Send one command and return its result (events that come first are kept)."""
        self._next_id += 1
        message: Json = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._to, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._receive(deadline, method)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                result: Json = reply["result"]
                return result
            self._events.append(reply)

    def wait_event(self, method: str, *, session: str, timeout_s: float = CALL_S) -> Json:
        """The first event ``method`` of ``session`` not yet taken, waiting for it."""
        deadline = time.monotonic() + timeout_s
        while True:
            for event in self._events:
                if event.get("method") == method and event.get("sessionId") == session:
                    self._events.remove(event)
                    return event
            self._events.append(self._receive(deadline, method))

    def events(self, method: str, *, session: str) -> list[Json]:
        """Every event ``method`` of ``session`` received so far, taken."""
        found = [
            e for e in self._events if (e.get("method"), e.get("sessionId")) == (method, session)
        ]
        self._events = [e for e in self._events if e not in found]
        return found

    def new_page(self, *, width: int, height: int, mobile: bool, scale: float = 1.0) -> Page:
        """A new tab with the viewport of a phone (``mobile``: the viewport meta tag is
        honoured, as on a phone) or of a desktop window."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        page = Page(self, session)
        page.resize(width=width, height=height, mobile=mobile, scale=scale)
        for domain in ("Page", "Network", "Log"):
            self.call(f"{domain}.enable", session=session)
        return page

    def _receive(self, deadline: float, waiting_for: str) -> Json:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from], [], [], left)[0]:
                raise TimeoutError(f"chromium did not answer {waiting_for} in time")
            chunk = os.read(self._from, 1 << 16)
            if not chunk:
                raise EOFError(f"chromium exited (code {self._process.poll()})")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        parsed: Json = json.loads(message)
        return parsed


class Page:
    """One tab."""

    def __init__(self, browser: Browser, session: str) -> None:
        self._browser = browser
        self.session = session

    def call(self, method: str, params: Json | None = None) -> Json:
        """A protocol command addressed to this tab."""
        return self._browser.call(method, params, session=self.session)

    def resize(self, *, width: int, height: int, mobile: bool, scale: float = 1.0) -> None:
        """Emulate a viewport of ``width`` × ``height`` CSS pixels."""
        metrics = {"width": width, "height": height, "deviceScaleFactor": scale, "mobile": mobile}
        self.call("Emulation.setDeviceMetricsOverride", metrics)

    def navigate(self, url: str) -> None:
        """Load ``url`` and wait for its load event."""
        self.events("Page.loadEventFired")
        reply = self.call("Page.navigate", {"url": url})
        if reply.get("errorText"):
            raise RuntimeError(f"loading {url}: {reply['errorText']}")
        self._browser.wait_event("Page.loadEventFired", session=self.session)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript ``expression`` in the page (JSON-serialisable)."""
        reply = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in reply:
            raise RuntimeError(f"{expression!r} raised: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def events(self, method: str) -> list[Json]:
        """The events ``method`` of this tab received so far (``Network.requestWillBeSent``,
        ``Log.entryAdded``, ...), taken."""
        return self._browser.events(method, session=self.session)

    def screenshot(self, path: Path, *, max_height: int | None = None) -> bytes:
        """A PNG of the whole page (not only the viewport), or of its top ``max_height``
        CSS pixels, written to ``path``."""
        width, height = self.evaluate(
            "[document.documentElement.scrollWidth, document.documentElement.scrollHeight]"
        )
        if max_height is not None:
            height = min(height, max_height)
        clip = {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}
        reply = self.call(
            "Page.captureScreenshot",
            {"format": "png", "captureBeyondViewport": True, "clip": clip},
        )
        data = base64.b64decode(reply["data"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return data
