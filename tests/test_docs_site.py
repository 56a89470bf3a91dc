"""The documentation site (issue 29, item 10) in a real headless Chromium at 1280 and 414 px.

The site is built once with ``mkdocs build --strict`` into a tmp dir and served by a stdlib
``http.server`` on a loopback port. On the configuration reference (its wide table of
``SINGLETONJOB_*`` identifiers) and on pages with wide code blocks, at a desktop's and a
phone's width: nothing makes the page scroll sideways, every code block shows its content or
scrolls inside its own box, and no identifier in a table cell is broken across lines.
Screenshots go to the test's tmp dir; their paths are printed (``pytest -s``).
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browser import Browser, chromium_or_skip

ROOT = Path(__file__).parent.parent
PAGES = ("configuration", "getting-started", "redis")
"""The configuration table, and two pages with long commands and code lines."""
SHOT_HEIGHT = 2400
"""The top of each page is enough to see its tables and code blocks (a whole page is slow)."""
VIEWPORTS = {"desktop": (1280, 900, False), "phone": (414, 896, True)}

MEASURE = """(() => {
  const scroller = document.scrollingElement;
  const page = {scrollWidth: scroller.scrollWidth, innerWidth: window.innerWidth};
  const cut = [];
  for (const code of document.querySelectorAll("pre > code")) {
    const overflowX = getComputedStyle(code).overflowX;
    const pre = code.parentElement;
    const preX = getComputedStyle(pre).overflowX;
    const scrolls = (el, x) => el.scrollWidth <= el.clientWidth || x === "auto" || x === "scroll";
    if (!scrolls(code, overflowX) || !scrolls(pre, preX)) {
      cut.push({text: code.textContent.slice(0, 60), scrollWidth: code.scrollWidth,
                clientWidth: code.clientWidth, overflowX: overflowX});
    }
  }
  const broken = [];
  for (const code of document.querySelectorAll("td code, th code")) {
    const text = code.textContent;
    if (!/\\s/.test(text) && code.getClientRects().length > 1) {
      broken.push({text: text, lines: code.getClientRects().length});
    }
  }
  const tablesWider = [];
  for (const table of document.querySelectorAll(".md-typeset table")) {
    const box = table.closest(".md-typeset__scrollwrap") || table;
    const column = table.closest(".md-content").getBoundingClientRect();
    const rect = box.getBoundingClientRect();
    const overflowX = getComputedStyle(box).overflowX;
    const outside = rect.right > column.right + 1 || rect.left < column.left - 1;
    const hidden = box.scrollWidth > box.clientWidth && !["auto", "scroll"].includes(overflowX);
    if (outside || hidden) {
      tablesWider.push({right: rect.right, columnRight: column.right,
                        scrollWidth: box.scrollWidth, clientWidth: box.clientWidth,
                        overflowX: overflowX});
    }
  }
  const tables = [...document.querySelectorAll(".md-typeset__scrollwrap")].map(
    (box) => [box.scrollWidth, box.clientWidth]);
  return {page: page, tables: tables, cut: cut, broken: broken, tablesWider: tablesWider,
          codeBlocks: document.querySelectorAll("pre > code").length,
          tableCodes: document.querySelectorAll("td code").length};
})()"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The site built from this tree, served on loopback: its base URL. Skips without
    mkdocs (README's test command installs the ``test`` extra only; ``.ci/run`` installs the
    ``docs`` extra too, and under ``CI=true`` a missing mkdocs fails)."""
    chromium_or_skip()  # no build for a browser that is not there
    if importlib.util.find_spec("mkdocs") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true: the docs site test needs mkdocs (pip install -e '.[docs]')")
        pytest.skip("the docs site needs mkdocs: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(out)],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=60,
    )

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_code_blocks_and_tables_fit_their_column(site: str, tmp_path: Path) -> None:
    executable = chromium_or_skip()
    problems: dict[str, Any] = {}
    with Browser.start(tmp_path, executable) as browser:
        for label, (width, height, mobile) in VIEWPORTS.items():
            page = browser.new_page(width=width, height=height, mobile=mobile)
            for name in PAGES:
                page.navigate(f"{site}/{name}/")
                found = page.evaluate(MEASURE)
                shot = tmp_path / f"{name}-{width}px.png"
                page.screenshot(shot, max_height=SHOT_HEIGHT)
                print(f"screenshot {label} {width}px {name}: {shot}")
                print(f"  measured: {found}")
                assert found["codeBlocks"] > 0 or name == "configuration", found
                if name == "configuration":
                    assert found["tableCodes"] > 10, found
                key = f"{name} at {width}px"
                if found["page"]["scrollWidth"] > found["page"]["innerWidth"]:
                    problems[f"{key}: page scrolls sideways"] = found["page"]
                wide = [t for t in found["tables"] if t[0] > t[1]]
                if not mobile and wide:  # on a desktop, every table is read without scrolling
                    problems[f"{key}: tables scroll sideways [scrollWidth, clientWidth]"] = wide
                if found["cut"]:
                    problems[f"{key}: code blocks cut"] = found["cut"]
                if found["broken"]:
                    problems[f"{key}: identifiers broken across lines"] = found["broken"]
                if found["tablesWider"]:
                    problems[f"{key}: tables wider than their column"] = found["tablesWider"]
    assert not problems, problems
