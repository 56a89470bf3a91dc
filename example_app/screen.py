"""How the demo shows the cluster: a live screen on a terminal, one line per change elsewhere.

The screen is plain ANSI: each frame moves the cursor back up over the previous one and
rewrites it, so the terminal's scrollback keeps what came before. A line the terminal wrapped
itself would throw the redraw off, so the table's lines are cut to the terminal's width and
the events, whose ends matter (the fencing token, the leaderless time), are wrapped here onto
indented lines.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import textwrap
import time
from collections import deque
from collections.abc import Sequence
from typing import TextIO

from .cluster import Process
from .viewer import JobView, Tracker, ago

_RESET = "\x1b[0m"
_GREEN, _YELLOW, _RED, _DIM, _BOLD = "\x1b[32m", "\x1b[33m", "\x1b[31m", "\x1b[2m", "\x1b[1m"
EVENTS_SHOWN = 8


class Output:
    """One line per change (the form for pipes, files and CI logs)."""

    def __init__(self, stream: TextIO, started: float) -> None:
        self.stream = stream
        self.started = started

    def stamp(self) -> str:
        """Seconds since the demo started, as ``+  12.34s``."""
        return f"+{time.monotonic() - self.started:7.2f}s"

    def say(self, message: str) -> None:
        """A line that is not part of the live view (setup, summary)."""
        print(message, file=self.stream, flush=True)

    def event(self, kind: str, message: str) -> None:
        """Something changed: ``kind`` is ``"demo"``, ``"leader"`` or ``"run"``."""
        print(f"{self.stamp()}  {message}", file=self.stream, flush=True)

    def frame(self, header: Sequence[str], replicas: Sequence[Process], tracker: Tracker) -> None:
        """Redraw the live view; nothing to do without a terminal."""

    def close(self) -> None:
        """Leave the terminal as it was."""


class Screen(Output):
    """A live view redrawn in place on a terminal."""

    def __init__(self, stream: TextIO, started: float) -> None:
        super().__init__(stream, started)
        self.color = "NO_COLOR" not in os.environ
        self.events: deque[str] = deque(maxlen=EVENTS_SHOWN)
        self._drawn = 0
        stream.write("\x1b[?25l")  # hide the cursor while redrawing

    def say(self, message: str) -> None:
        self._erase()
        super().say(message)

    def event(self, kind: str, message: str) -> None:
        if kind != "run":  # runs show in the table; the log keeps the story
            self.events.append(f"{self.stamp()}  {message}")

    def frame(self, header: Sequence[str], replicas: Sequence[Process], tracker: Tracker) -> None:
        size = shutil.get_terminal_size()
        width = max(40, size.columns - 1)
        lines: list[tuple[str, str]] = [(line, _BOLD if i == 0 else _DIM) for i, line in
                                         enumerate(header)]  # fmt: skip
        lines.append(("", ""))
        lines.append((f"{'REPLICA':<11} {'PID':>7} {'PORT':>6}  STATE", _BOLD))
        for p in replicas:
            state = p.state()
            color = _GREEN if state == "up" else _YELLOW if "stopping" in state else _RED
            lines.append((f"{p.name:<11} {p.pid:>7} {p.port:>6}  {state}", color))
        lines.append(("", ""))
        lines.append((f"{'JOB':<16} {'LEADER':<38} {'TOKEN':>17}  LAST RUN", _BOLD))
        now = time.monotonic()
        for view in tracker.views.values():
            lines.append(_job_line(view, tracker.leaderless_for(view.name, now)))
        lines.append(("", ""))
        lines.append(("EVENTS", _BOLD))
        # The frame must fit the terminal: the cursor cannot move back above its top row. The
        # newest events that fit, each wrapped to the width (under its time stamp's column).
        room = size.lines - len(lines) - 1
        shown: list[str] = []
        for event in reversed(self.events):
            rows = wrap_event(event, width)
            if len(shown) + len(rows) > room:
                break
            shown[:0] = rows
        lines.extend((row, "") for row in shown)
        self._erase()
        out = []
        for text, color in lines:
            text = text[:width]
            out.append(f"{color}{text}{_RESET}" if color and self.color else text)
        self.stream.write("\n".join(out) + "\n")
        self.stream.flush()
        self._drawn = len(out)

    def _erase(self) -> None:
        if self._drawn:
            # Up to the first line of the last frame, then clear to the end of the screen.
            self.stream.write(f"\x1b[{self._drawn}F\x1b[J")
            self._drawn = 0

    def close(self) -> None:
        self._drawn = 0  # the last frame stays on the screen
        self.stream.write("\x1b[?25h")
        self.stream.flush()


def wrap_event(event: str, width: int) -> list[str]:
    """An event line as rows of at most ``width`` columns, the rows after the first indented
    under the text that follows the time stamp (``+  12.34s  ``)."""
    stamp = re.match(r"\+\s*[\d.]+s\s+", event)
    indent = " " * (stamp.end() if stamp is not None and stamp.end() < width // 2 else 0)
    return textwrap.wrap(
        event, width, subsequent_indent=indent, break_long_words=True, break_on_hyphens=False
    ) or [""]


def _job_line(view: JobView, leaderless_s: float | None) -> tuple[str, str]:
    if view.leader is not None:
        leader, color = view.leader, _GREEN
    elif len(view.leaders) > 1:
        leader, color = "TWO: " + ", ".join(view.leaders), _RED
    else:
        leader, color = "none", _YELLOW
        if leaderless_s is not None:
            leader += f" for {leaderless_s:.1f}s"
        if view.holder is not None and view.holder_ttl_s is not None:
            leader += f" ({view.holder}'s lock: >={max(0.0, view.holder_ttl_s):.1f}s)"
    if view.paused:
        leader += " (paused)"
    if view.last_run is None:
        last = f"never; next {view.next_run}" if view.next_run else "never"
    else:
        node, started_at, runs, outcome = view.last_run
        last = f"{ago(started_at):5.1f}s ago on {node} (run {runs}, {outcome})"
    token = "" if view.token is None else str(view.token)
    return f"{view.name:<16} {leader:<38} {token:>17}  {last}", color


def make_output(started: float, stream: TextIO | None = None) -> Output:
    """A :class:`Screen` on a terminal (unless ``TERM=dumb``), else line output."""
    stream = stream or sys.stdout
    if stream.isatty() and os.environ.get("TERM") != "dumb":
        return Screen(stream, started)
    return Output(stream, started)
