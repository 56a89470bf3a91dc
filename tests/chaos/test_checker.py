"""The checker itself, on hand-made journals: a check that cannot fail proves nothing."""

from __future__ import annotations

import json
from pathlib import Path

from .checker import (
    Event,
    JournalReader,
    Run,
    Write,
    build_runs,
    duplicates,
    gaps,
    max_concurrent,
    missed_instants,
    overlap_s,
    stale_writes,
    terms,
)


def run(node: str, token: int, scheduled: float, start: float, end: float | None) -> Run:
    return Run("j", node, 1, token, f"{node}:{start}", scheduled, start, end)


def test_sweep_counts_concurrency_and_overlap() -> None:
    runs = [run("a", 1, 0, 0.0, 1.0), run("b", 2, 1, 0.5, 1.5), run("a", 1, 2, 1.5, 2.0)]
    assert max_concurrent(runs) == 2
    assert overlap_s(runs) == 0.5
    back_to_back = [run("a", 1, 0, 0.0, 1.0), run("b", 2, 1, 1.0, 2.0)]
    assert max_concurrent(back_to_back) == 1  # [start, end): touching is not overlapping
    assert overlap_s(back_to_back) == 0.0


def test_duplicates_and_missed_instants_on_a_grid() -> None:
    runs = [run("a", 1, 10.0, 0, 0.1), run("b", 2, 10.0, 1, 1.1), run("b", 2, 10.3, 2, 2.1)]
    assert duplicates(runs) == {10.0: 2}
    assert missed_instants(runs, 0.1, 10.0, 10.3) == [10.1, 10.2]


def test_gaps_are_longest_first() -> None:
    runs = [run("a", 1, 0, 0.0, 1.0), run("a", 1, 1, 1.2, 1.3), run("a", 1, 2, 3.0, 3.1)]
    assert [round(g, 3) for g, _ in gaps(runs)] == [1.7, 0.2]


def test_stale_writes_count_late_and_rejected() -> None:
    old = run("a", 1, 0, 0.0, 3.0)
    new = run("b", 2, 1, 1.0, 2.0)
    old.writes = [Write(0.1, 0.11, True), Write(1.5, 1.51, False), Write(2.5, 2.51, False)]
    new.writes = [Write(1.1, 1.11, True)]
    assert stale_writes([old, new]) == (2, 2)


def test_journal_reader_builds_runs_and_terms(tmp_path: Path) -> None:
    path = tmp_path / "n.jsonl"
    rows = [
        {"ev": "lead", "node": "a", "pid": 7, "t": 0.5, "job": "j", "token": 3},
        {"ev": "start", "node": "a", "pid": 7, "t": 1.0, "job": "j", "token": 3, "run": "r1",
         "scheduled": 100.0},
        {"ev": "write", "node": "a", "pid": 7, "t": 1.2, "job": "j", "token": 3, "run": "r1",
         "ok": True, "sent": 1.1},
        {"ev": "end", "node": "a", "pid": 7, "t": 1.5, "job": "j", "token": 3, "run": "r1",
         "outcome": "ok"},
        {"ev": "start", "node": "a", "pid": 7, "t": 2.0, "job": "j", "token": 3, "run": "r2",
         "scheduled": 101.0},
    ]  # fmt: skip
    text = "".join(json.dumps(row) + "\n" for row in rows)
    path.write_text(text[:-20])  # the last line is still being written
    reader = JournalReader(path)
    assert [e.ev for e in reader.poll()] == ["lead", "start", "write", "end"]
    path.write_text(text)
    events = reader.poll()
    assert isinstance(events[-1], Event) and events[-1].run == "r2"
    runs = build_runs(events, {7: 2.4}, default_cutoff=9.0)
    assert [(r.run, r.end, r.outcome) for r in runs] == [
        ("r1", 1.5, "ok"),
        ("r2", 2.4, "unfinished"),
    ]
    assert runs[0].writes == [Write(1.1, 1.2, True)]
    assert [(t.node, t.token) for t in terms(events, "j")] == [("a", 3)]
