"""One replica of a service, as a subprocess, and the journal its job writes.

Run as a script, it is a replica: one ``SingletonJobs`` with a fixed-rate job every 50 ms that
journals each run, until SIGTERM, on which it stops gracefully (the library installs no signal
handlers: the application owns them) and exits 0::

    python tests/node_proc.py --url redis://... --project p --node n1 --journal n1.jsonl

Each run appends two JSON lines, one as it starts (``"end": null``) and one as it ends, so
that a run cut short by SIGKILL is still on record. Times are ``CLOCK_MONOTONIC`` seconds,
comparable across the processes of one machine. Imported, this module reads journals back
and checks them.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

JOB = "tick"
EVERY_S = 0.05
RUN_S = 0.01
HEARTBEAT_S = 0.1
LOCK_EXPIRY_S = 0.5
SHUTDOWN_TIMEOUT_S = 1.0


def now() -> float:
    """The journal's clock: ``CLOCK_MONOTONIC``, shared by every process of the machine."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


# --- reading and checking journals --------------------------------------------------------------


@dataclass
class Run:
    """One run of the job; ``end`` is None while it runs (or if its process was killed)."""

    node: str
    token: int
    scheduled: float
    start: float
    end: float | None = None
    job: str = JOB

    def ended_by(self, fallback: float) -> float:
        """The end, or ``fallback`` (when the process died) for a run with none."""
        return self.end if self.end is not None else fallback


def read_journal(path: Path) -> list[Run]:
    """The runs in one journal, in start order; a run's end line completes its start line."""
    runs: dict[tuple[str, str, float], Run] = {}
    if not path.exists():
        return []
    for line in path.read_text().splitlines():
        if not line.endswith("}"):
            continue  # a line still being written
        row = json.loads(line)
        run = Run(row["node"], int(row["token"]), row["scheduled"], row["start"], row["end"])
        run.job = row.get("job", JOB)
        runs[(run.node, run.job, run.start)] = run
    return sorted(runs.values(), key=lambda r: r.start)


def max_concurrent(runs: Iterable[Run], unfinished_end: float = float("inf")) -> int:
    """The most runs in progress at one instant (sweep over the ``[start, end)`` intervals)."""
    events = []
    for run in runs:
        events += [(run.start, 1), (run.ended_by(unfinished_end), -1)]
    current = peak = 0
    for _, delta in sorted(events):  # at a tie, an end (-1) sorts before a start
        current += delta
        peak = max(peak, current)
    return peak


def overlap_s(runs: Iterable[Run], unfinished_end: float = float("inf")) -> float:
    """Total time during which two or more runs were in progress at once."""
    events = []
    for run in runs:
        events += [(run.start, 1), (run.ended_by(unfinished_end), -1)]
    total, current, since = 0.0, 0, 0.0
    for at, delta in sorted(events):
        if current >= 2:
            total += at - since
        current += delta
        since = at
    return total


def tokens_in_order(runs: Sequence[Run]) -> bool:
    """True when fencing tokens never go down in start order."""
    ordered = sorted(runs, key=lambda r: r.start)
    return all(a.token <= b.token for a, b in itertools.pairwise(ordered))


def first_and_last(runs: Iterable[Run]) -> dict[str, tuple[Run, Run]]:
    """Per node: its first and its last run."""
    spans: dict[str, tuple[Run, Run]] = {}
    for run in sorted(runs, key=lambda r: r.start):
        first = spans[run.node][0] if run.node in spans else run
        spans[run.node] = (first, run)
    return spans


# --- the replica ---------------------------------------------------------------------------------


async def serve(
    url: str,
    project: str,
    node: str,
    journal: Path,
    *,
    heartbeat_s: float = HEARTBEAT_S,
    lock_expiry_s: float = LOCK_EXPIRY_S,
    ready: Path | None = None,
    every_s: float = EVERY_S,
    job_count: int = 1,
    overdue_journal: Path | None = None,
) -> None:
    """Run the replica until SIGTERM, then stop gracefully; create ``ready`` once started.
    (The benchmarks run this same replica with their own settings.) With ``overdue_journal``,
    its ``on_overdue`` appends each event told to it there, one JSON line each."""
    from fastapi_singletonjob import JobContext, OverdueEvent, SingletonJobs

    def overdue(event: OverdueEvent) -> None:
        assert overdue_journal is not None
        row = {"job": event.job, "node": event.node_id, "since": event.overdue_since.timestamp()}
        with open(overdue_journal, "a") as out:
            out.write(json.dumps(row) + "\n")

    jobs = SingletonJobs(
        redis_url=url,
        project=project,
        node_id=node,
        heartbeat_interval=heartbeat_s,
        lock_expiry=lock_expiry_s,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        on_overdue=None if overdue_journal is None else overdue,
    )
    fd = os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(row: dict[str, object]) -> None:
        os.write(fd, (json.dumps(row) + "\n").encode())  # one write: lines never interleave

    async def tick(ctx: JobContext) -> None:
        row: dict[str, object] = {
            "job": ctx.job,
            "node": ctx.node_id,
            "token": ctx.fencing_token,
            "scheduled": ctx.scheduled_at.timestamp(),
            "start": now(),
            "end": None,
        }
        write(row)
        await asyncio.sleep(RUN_S)
        write({**row, "end": now()})

    names = [JOB] if job_count == 1 else [f"{JOB}-{i:02d}" for i in range(job_count)]
    for name in names:
        jobs.fixed_rate(name, every=every_s)(tick)

    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    try:
        await jobs.start()
        if ready is not None:
            os.close(os.open(ready, os.O_WRONLY | os.O_CREAT, 0o644))
        await stopping.wait()
        await jobs.stop()
    finally:
        os.close(fd)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run the replica."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--project", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--journal", required=True, type=Path)
    parser.add_argument("--every", type=float, default=EVERY_S, help="the job's period, s")
    parser.add_argument("--jobs", type=int, default=1, help="how many such jobs (tick-00 ...)")
    parser.add_argument("--overdue-journal", type=Path, help="where on_overdue writes, if any")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(created).3f {args.node} %(name)s %(levelname)s %(message)s",
    )
    asyncio.run(
        serve(
            args.url,
            args.project,
            args.node,
            args.journal,
            every_s=args.every,
            job_count=args.jobs,
            overdue_journal=args.overdue_journal,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
