"""One replica whose jobs keep checkpoints (issue 12), as a subprocess, and its journal.

Run as a script, it is a replica: one ``SingletonJobs`` with the jobs of one ``--mode``, until
SIGTERM, on which it stops gracefully and exits 0 (the library installs no signal handlers:
the application owns them)::

    python tests/checkpoint_proc.py --url redis://... --project p --node n1 \
        --journal n1.jsonl --mode counter

Modes:

- ``counter``: interval job ``counter`` every 50 ms that resumes from ``n``, its state (0 before
  the first save), and saves ``n + 1``: the cursor pattern of docs/checkpoints.md.
- ``stale``: the same as job ``stale``, holding ``STALE_BODY_S`` between reading ``n`` and saving
  ``n + 1`` (long enough to SIGSTOP the process there). A refused save is journaled, with the
  record as stored right after the refusal, and re-raised.
- ``cron``: one cron job every 2 s per misfire policy (``CRON_JOBS``).
- ``spaced``: interval job ``spaced`` every 1 s.

With ``--wait-for PATH`` the replica journals ``loaded`` and starts its jobs only once PATH
exists: a replica whose interpreter start-up (a second or two) is paid before a fleet's
downtime ends, so that it starts at a chosen instant.

Every row is one JSON line, written with one ``write`` (rows of one file never interleave, and
a SIGKILL leaves whole rows only): ``loaded`` (its SIGTERM handler is installed: before it,
SIGTERM kills the process) and ``started`` (its jobs are), then per run
``run`` as the run begins, ``saving`` and ``saved`` or ``lost`` around ``save_state``, and
``end``. The rows of a run carry its ``start``. Times: ``mono`` and ``start`` are
``CLOCK_MONOTONIC`` seconds, comparable across the processes of one machine; ``wall``,
``scheduled``, ``started_at`` and ``cp_completed`` are Unix seconds. Imported, this module
reads journals back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastapi_singletonjob import JobContext, LeadershipLost, SingletonJobs

MODES = ("counter", "stale", "cron", "spaced")
COUNTER_JOB = "counter"
STALE_JOB = "stale"
SPACED_JOB = "spaced"
EVERY_S = 0.05
"""Period of the ``counter`` and ``stale`` jobs."""
STEP_S = 0.005
"""The ``counter`` job's pause before its save, so that a SIGKILL can land mid-run."""
AFTER_SAVE_S = 0.02
"""The ``counter`` job's pause after its save: a SIGKILL there lands in the window that
docs/checkpoints.md documents (the state saved, the run not recorded)."""
STALE_BODY_S = 0.3
SPACED_EVERY_S = 1.0
CRON_EVERY_S = 2.0
CRON = "* * * * * */2"
"""Every 2 s: croniter's 6th field is the seconds (``"*/2 * * * * *"`` would fire every second
of every other minute)."""
CATCH_UP_GRACE_S = 10.0
CRON_JOBS: dict[str, Literal["skip", "run_once", "catch_up"]] = {
    "cron-skip": "skip",
    "cron-once": "run_once",
    "cron-catchup": "catch_up",
}
"""Job name -> its ``misfire`` policy."""
HEARTBEAT_S = 0.1
LOCK_EXPIRY_S = 0.5
SHUTDOWN_TIMEOUT_S = 1.0
WAIT_POLL_S = 0.005


def now() -> float:
    """The journal's clock: ``CLOCK_MONOTONIC``, shared by every process of the machine."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


# --- reading journals ----------------------------------------------------------------------------


@dataclass
class Run:
    """One run as its journal tells it; the fields after ``cp_token`` are None until (unless)
    the run got that far."""

    node: str
    job: str
    start: float
    """When the run began (journal clock); with ``node``, it names the run."""
    token: int
    iteration: int
    """``ctx.iteration``."""
    cp_iteration: int | None
    """``ctx.checkpoint.iteration``, None without a checkpoint."""
    n: int | None
    """The state the run resumed from (``counter``, ``stale``)."""
    scheduled: float
    """``ctx.scheduled_at``."""
    started_at: float
    """``ctx.started_at``."""
    cp_completed: float | None
    """``ctx.checkpoint.last_completed_at``."""
    cp_scheduled: float | None
    """``ctx.checkpoint.last_scheduled_at``."""
    cp_node: str | None
    cp_token: int | None
    leader_at_save: bool | None = None
    """``ctx.is_leader`` right before ``save_state`` (``stale``)."""
    saving: float | None = None
    """When ``save_state`` was called (journal clock)."""
    saved: int | None = None
    """The value ``save_state`` stored, once it returned."""
    saved_at: float | None = None
    """When it returned (journal clock)."""
    lost: dict[str, Any] | None = None
    """The ``lost`` row: ``save_state`` raised ``LeadershipLost``."""
    end: float | None = None
    end_wall: float | None = None

    def label(self) -> str:
        """A short description for assertion messages."""
        return (
            f"{self.job}@{self.node} token={self.token} it={self.iteration} n={self.n} "
            f"saved={self.saved} lost={self.lost is not None} end={self.end is not None}"
        )


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every whole row of a journal, in the order written."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.endswith("}"):  # else a row still being written
            row: dict[str, Any] = json.loads(line)
            rows.append(row)
    return rows


def read_runs(path: Path) -> list[Run]:
    """The runs in a journal, in start order, each completed by its later rows."""
    runs: dict[float, Run] = {}
    for row in read_rows(path):
        event = row["event"]
        if event == "run":
            fields = {k: v for k, v in row.items() if k not in ("event", "mono", "wall")}
            runs[row["start"]] = Run(**fields)
            continue
        run = runs.get(row.get("start", -1.0))
        if run is None:
            continue
        if event == "saving":
            run.saving, run.leader_at_save = row["mono"], row["is_leader"]
        elif event == "saved":
            run.saved, run.saved_at = row["n"], row["mono"]
        elif event == "lost":
            run.lost = row
        elif event == "end":
            run.end, run.end_wall = row["mono"], row["wall"]
    return sorted(runs.values(), key=lambda r: r.start)


# --- the replica ---------------------------------------------------------------------------------


class Journal:
    """Appends rows to the journal file, one ``write`` per row."""

    def __init__(self, path: Path, node: str) -> None:
        self.node = node
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, event: str, **fields: object) -> None:
        row = {"event": event, "node": self.node, "mono": now(), "wall": time.time(), **fields}
        os.write(self._fd, (json.dumps(row) + "\n").encode())

    def begin(self, ctx: JobContext, n: int | None = None) -> float:
        """Journal the start of a run; return its ``start``."""
        start = now()
        cp = ctx.checkpoint
        self.write(
            "run",
            job=ctx.job,
            start=start,
            token=ctx.fencing_token,
            iteration=ctx.iteration,
            cp_iteration=None if cp is None else cp.iteration,
            n=n,
            scheduled=ctx.scheduled_at.timestamp(),
            started_at=ctx.started_at.timestamp(),
            cp_completed=(
                None if cp is None or cp.last_completed_at is None
                else cp.last_completed_at.timestamp()
            ),
            cp_scheduled=(
                None if cp is None or cp.last_scheduled_at is None
                else cp.last_scheduled_at.timestamp()
            ),
            cp_node=None if cp is None else cp.node_id,
            cp_token=None if cp is None else cp.fencing_token,
        )  # fmt: skip
        return start

    def close(self) -> None:
        os.close(self._fd)


def resumed_from(ctx: JobContext) -> int:
    """The count stored in the job's state as the run began (0 before the first save)."""
    state = ctx.checkpoint.state if ctx.checkpoint else None
    if state is None:
        return 0
    if not isinstance(state, int):
        raise TypeError(f"the state of job {ctx.job!r} is {state!r}, not a count")
    return state


JobFunc = Callable[[JobContext], Awaitable[None]]


def define(jobs: SingletonJobs, mode: str, journal: Journal) -> None:
    """Register the jobs of ``mode``."""
    if mode == "counter":

        @jobs.interval(COUNTER_JOB, every=EVERY_S)
        async def counter(ctx: JobContext) -> None:
            n = resumed_from(ctx)
            start = journal.begin(ctx, n)
            await asyncio.sleep(STEP_S)
            try:
                await ctx.save_state(n + 1)
            except LeadershipLost as exc:
                journal.write("lost", start=start, error=str(exc))
                raise
            journal.write("saved", start=start, n=n + 1)
            await asyncio.sleep(AFTER_SAVE_S)
            journal.write("end", start=start)

    elif mode == "stale":

        @jobs.interval(STALE_JOB, every=EVERY_S)
        async def stale(ctx: JobContext) -> None:
            n = resumed_from(ctx)
            start = journal.begin(ctx, n)
            await asyncio.sleep(STALE_BODY_S)
            # No await between this check and save_state's own: with is_leader True, a
            # refusal can only come from the fence inside Redis.
            journal.write("saving", start=start, is_leader=ctx.is_leader)
            try:
                await ctx.save_state(n + 1)
            except LeadershipLost as exc:
                stored = await jobs.checkpoint(STALE_JOB)
                journal.write(
                    "lost",
                    start=start,
                    error=str(exc),
                    stored_node=None if stored is None else stored.node_id,
                    stored_token=None if stored is None else stored.fencing_token,
                    stored_state=None if stored is None else stored.state,
                )
                raise
            journal.write("saved", start=start, n=n + 1)
            journal.write("end", start=start)

    elif mode == "cron":
        for name, policy in CRON_JOBS.items():
            grace = CATCH_UP_GRACE_S if policy == "catch_up" else None
            jobs.cron(name, CRON, misfire=policy, misfire_grace=grace)(cron_job(journal))

    elif mode == "spaced":

        @jobs.interval(SPACED_JOB, every=SPACED_EVERY_S)
        async def spaced(ctx: JobContext) -> None:
            start = journal.begin(ctx)
            journal.write("end", start=start)

    else:
        raise ValueError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")


def cron_job(journal: Journal) -> JobFunc:
    async def run(ctx: JobContext) -> None:
        start = journal.begin(ctx)
        journal.write("end", start=start)

    return run


async def serve(args: argparse.Namespace) -> None:
    """Run the replica until SIGTERM, then stop gracefully."""
    jobs = SingletonJobs(
        redis_url=args.url,
        project=args.project,
        node_id=args.node,
        heartbeat_interval=args.heartbeat,
        lock_expiry=args.lock_expiry,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        placement="first",  # the tests count the handovers their faults cause
    )
    journal = Journal(args.journal, args.node)
    define(jobs, args.mode, journal)
    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    try:
        journal.write("loaded")
        while args.wait_for is not None and not args.wait_for.exists():
            if stopping.is_set():
                return
            await asyncio.sleep(WAIT_POLL_S)
        await jobs.start()
        journal.write("started")
        await stopping.wait()
        await jobs.stop()
        journal.write("stopped")
    finally:
        journal.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run the replica."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--project", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--journal", required=True, type=Path)
    parser.add_argument("--mode", required=True, choices=MODES)
    parser.add_argument("--heartbeat", type=float, default=HEARTBEAT_S)
    parser.add_argument("--lock-expiry", type=float, default=LOCK_EXPIRY_S)
    parser.add_argument("--wait-for", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(created).3f {args.node} %(name)s %(levelname)s %(message)s",
    )
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
