"""Reads the replicas' journals and computes what the chaos rows assert (pure functions).

Inputs are :class:`Event` rows as the replicas wrote them (``replica.py``); a :class:`Run` is
one job run built from its ``start``, ``write`` and ``end`` events. A run with no ``end`` was
cut short (SIGKILL) or is still going (a paused or live process): it counts as running until
a cut-off the caller gives per process (its kill time, or "now").
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "Event",
    "JournalReader",
    "Run",
    "Term",
    "Write",
    "build_runs",
    "duplicates",
    "first_accepted",
    "gaps",
    "max_concurrent",
    "missed_instants",
    "overlap_s",
    "stale_writes",
    "terms",
    "writes_sent_after",
]

_US = 1_000_000


@dataclass(frozen=True)
class Event:
    """One journal line."""

    ev: str
    node: str
    pid: int
    t: float
    job: str | None
    token: int | None
    run: str | None
    data: Mapping[str, Any]

    @classmethod
    def parse(cls, line: str) -> Event:
        """Parse one JSON line."""
        row = json.loads(line)
        return cls(
            ev=row["ev"],
            node=row["node"],
            pid=int(row["pid"]),
            t=float(row["t"]),
            job=row.get("job"),
            token=row.get("token"),
            run=row.get("run"),
            data=row,
        )


class JournalReader:
    """Reads a journal file incrementally; a line still being written waits for its end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[Event] = []
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[Event]:
        """Read what was appended since the last call; return every event so far."""
        try:
            with open(self.path, "rb") as file:
                file.seek(self._offset)
                data = file.read()
        except FileNotFoundError:
            return self.events
        self._offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        self.events.extend(Event.parse(line.decode()) for line in lines if line.strip())
        return self.events


class Write(NamedTuple):
    """One fenced write to the witness: when it was sent and answered, and whether the
    register accepted it."""

    sent: float
    done: float
    ok: bool


@dataclass
class Run:
    """One run of one job on one node."""

    job: str
    node: str
    pid: int
    token: int
    run: str
    scheduled: float
    start: float
    end: float | None = None
    outcome: str | None = None
    writes: list[Write] = field(default_factory=list)
    """Each fenced write, in order."""

    def ended_by(self, cutoff: float) -> float:
        """The end, or ``cutoff`` for a run that never journaled one."""
        return self.end if self.end is not None else cutoff


def build_runs(
    events: Iterable[Event], cutoffs: Mapping[int, float], default_cutoff: float
) -> list[Run]:
    """Runs in start order. A run without an ``end`` lasts until its process's cut-off
    (``cutoffs[pid]``, e.g. the SIGKILL time) or ``default_cutoff``."""
    runs: dict[str, Run] = {}
    for event in events:
        if event.run is None or event.job is None:
            continue
        if event.ev == "start":
            assert event.token is not None
            runs[event.run] = Run(
                event.job,
                event.node,
                event.pid,
                event.token,
                event.run,
                float(event.data["scheduled"]),
                event.t,
            )
        elif event.run in runs:
            run = runs[event.run]
            if event.ev == "end":
                run.end, run.outcome = event.t, str(event.data["outcome"])
            elif event.ev == "write":
                sent = float(event.data.get("sent", event.t))
                run.writes.append(Write(sent, event.t, bool(event.data["ok"])))
    ordered = sorted(runs.values(), key=lambda r: r.start)
    for run in ordered:
        if run.end is None:
            run.end = max(run.start, cutoffs.get(run.pid, default_cutoff))
            run.outcome = "unfinished"
    return ordered


def _sweep(runs: Iterable[Run]) -> list[tuple[float, int]]:
    events: list[tuple[float, int]] = []
    for run in runs:
        end = run.end if run.end is not None else float("inf")
        if end > run.start:
            events += [(run.start, 1), (end, -1)]
    return sorted(events)  # at a tie an end (-1) sorts before a start: [start, end)


def max_concurrent(runs: Iterable[Run]) -> int:
    """The most runs in progress at one instant."""
    current = peak = 0
    for _, delta in _sweep(runs):
        current += delta
        peak = max(peak, current)
    return peak


def overlap_s(runs: Iterable[Run]) -> float:
    """Total time during which two or more runs were in progress at once."""
    total, current, since = 0.0, 0, 0.0
    for at, delta in _sweep(runs):
        if current >= 2:
            total += at - since
        current += delta
        since = at
    return total


def duplicates(runs: Iterable[Run]) -> dict[float, int]:
    """Scheduled instants that started more than one run: ``{instant: runs}``."""
    counts: dict[int, int] = {}
    for run in runs:
        key = round(run.scheduled * _US)
        counts[key] = counts.get(key, 0) + 1
    return {key / _US: n for key, n in counts.items() if n > 1}


def missed_instants(runs: Sequence[Run], every_s: float, start: float, end: float) -> list[float]:
    """Grid instants (multiples of ``every_s`` since the epoch) within ``[start, end]``
    (wall-clock seconds) that no run was scheduled for."""
    every_us = round(every_s * _US)
    seen = {round(run.scheduled * _US) for run in runs}
    first = -(-round(start * _US) // every_us)
    last = round(end * _US) // every_us
    return [k * every_us / _US for k in range(first, last + 1) if k * every_us not in seen]


def gaps(runs: Sequence[Run]) -> list[tuple[float, float]]:
    """``(idle seconds, at)`` between consecutive runs (end of one to start of the next),
    longest first."""
    ordered = sorted(runs, key=lambda r: r.start)
    found = []
    for before, after in zip(ordered, ordered[1:], strict=False):
        found.append((after.start - before.ended_by(after.start), after.start))
    return sorted(found, reverse=True)


@dataclass(frozen=True)
class Term:
    """A leadership term as the library journaled it (``lead`` event)."""

    node: str
    token: int
    t: float


def terms(events: Iterable[Event], job: str) -> list[Term]:
    """Every term of ``job`` in the order they began; one per distinct token."""
    found: dict[int, Term] = {}
    for event in events:
        if event.ev == "lead" and event.job == job and event.token is not None:
            found.setdefault(event.token, Term(event.node, event.token, event.t))
    return sorted(found.values(), key=lambda term: term.t)


def stale_writes(runs: Sequence[Run]) -> tuple[int, int]:
    """``(late, rejected)`` fenced writes. *Late*: made by a run after a run of a greater
    token had started (a stale leader still at work); *rejected*: refused by the register
    because a greater token had already written. Every late write that comes after the newer
    term's first write is rejected; only those racing it can get through."""
    starts = sorted((run.start, run.token) for run in runs)
    times = [start for start, _ in starts]
    highest: list[int] = []  # highest token among the runs started so far
    for _, token in starts:
        highest.append(max(token, highest[-1]) if highest else token)
    late = rejected = 0
    for run in runs:
        for write in run.writes:
            rejected += not write.ok
            index = bisect.bisect_left(times, write.sent)
            if index and highest[index - 1] > run.token:
                late += 1
    return late, rejected


def first_accepted(runs: Iterable[Run], above: int) -> float:
    """When the first accepted write of a term newer than ``above`` was answered."""
    return min(w.done for r in runs if r.token > above for w in r.writes if w.ok)


def writes_sent_after(run: Run, instant: float) -> list[Write]:
    """The writes of ``run`` sent after ``instant``."""
    return [w for w in run.writes if w.sent > instant]
