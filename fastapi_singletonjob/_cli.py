"""The ``singletonjob`` command (also ``python -m fastapi_singletonjob``): the cluster view and
the operators' controls from a shell, with no job definitions: jobs are known from the live
nodes' membership records and the stored keys.

Exit codes: 0 done; 2 bad usage or configuration (argparse's own code too); 3 Redis did not
answer; 4 no such job; 1 anything else (a bug: reported in one line, no traceback).

What it prints comes from Redis (job names, node ids, errors, states), which anything that can
write the project's keys controls: every control character and other non-printable one in it
is written escaped (``\x1b``, ``\u202e``), never raw, so stored text cannot move the cursor,
retitle the window or write the clipboard of the operator's terminal. ``--json`` output is
ASCII with every control character escaped by ``json.dumps``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TextIO

from redis.exceptions import ResponseError

from ._admin import AdminClient, StoreFactory, opened_for_the_call
from ._aio import within
from ._clock import SYSTEM_CLOCK
from ._config.redact import redact_url
from ._config.settings import Settings
from ._election.definitions import FIX
from ._errors import ConfigurationError, JobNotFound
from ._history import MAX_HISTORY, MISSED_REASONS, check_limit
from ._store.base import DEFAULT_CONTROL_TIMEOUT_S, STORE_ERRORS
from ._store.open import open_store
from ._store.refusals import refusal
from ._web.models import ClusterStatus

__all__ = ["EXIT_ERROR", "EXIT_NO_JOB", "EXIT_OK", "EXIT_UNREACHABLE", "EXIT_USAGE", "main"]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_NO_JOB = 4

NODE_ID = "singletonjob-cli"
"""The node id the CLI signs its pauses with."""

FLAGS = {"redis_url": "--redis-url", "project": "--project"}
"""The settings the CLI takes as flags, which its errors name (not as keyword arguments)."""

_ACTIONS: dict[str, tuple[Callable[[AdminClient, str], Awaitable[None]], str]] = {
    "pause": (AdminClient.pause, "paused"),
    "resume": (AdminClient.resume, "resumed"),
    "trigger": (AdminClient.trigger, "asked the leader for one extra run of"),
    "step-down": (AdminClient.step_down, "asked the leader to hand over"),
}


@dataclass(frozen=True)
class _Project:
    """What a command works on: the project's admin client and the store it uses."""

    name: str
    store_description: str
    stores: StoreFactory
    admin: AdminClient

    @classmethod
    def of(cls, settings: Settings) -> _Project:
        """The project of ``settings``, with no jobs registered: each call opens the store
        and closes it after."""
        stores = opened_for_the_call(
            lambda: open_store(settings, (), client=None, clock=SYSTEM_CLOCK)
        )
        admin = AdminClient(
            stores, project=settings.project, jobs=(), clock=SYSTEM_CLOCK, node_id=NODE_ID
        )
        return cls(settings.project, redact_url(settings.redis_url or ""), stores, admin)


MIN_WATCH_INTERVAL_S = 0.1
"""The shortest refresh of ``watch``: each one reads the whole cluster view from Redis."""


def _seconds(text: str) -> float:
    """An argparse ``type``: a positive, finite number of seconds."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} must be a finite number of seconds above 0, such as 5"
        )
    return seconds


def _watch_interval(text: str) -> float:
    """An argparse ``type``: seconds between refreshes, at least ``MIN_WATCH_INTERVAL_S``."""
    seconds = _seconds(text)
    if seconds < MIN_WATCH_INTERVAL_S:
        raise argparse.ArgumentTypeError(
            f"{text!r} is below {MIN_WATCH_INTERVAL_S:g}s: each refresh reads the whole "
            f"cluster from Redis; use {MIN_WATCH_INTERVAL_S:g} or more, such as 2"
        )
    return seconds


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # Accepted before and after the command; SUPPRESS keeps a later default from erasing an
    # earlier value.
    common.add_argument(
        "--redis-url",
        default=argparse.SUPPRESS,
        help="the project's Redis (default: SINGLETONJOB_REDIS_URL, else redis://localhost:6379/0)",
    )
    common.add_argument(
        "--project", default=argparse.SUPPRESS, help="the project (default: SINGLETONJOB_PROJECT)"
    )
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="print JSON for scripts"
    )
    common.add_argument(
        "--timeout",
        type=_seconds,
        default=argparse.SUPPRESS,
        help=f"seconds to wait for Redis, above 0 (default {DEFAULT_CONTROL_TIMEOUT_S:g})",
    )
    parser = argparse.ArgumentParser(
        prog="singletonjob",
        parents=[common],
        description="See and operate the jobs of a fastapi-singletonjob project.",
        epilog="exit codes: 0 done, 2 bad usage or configuration, 3 Redis did not answer or "
        "refused (a password, a database index, an ACL permission), "
        "4 no such job, 1 any other error",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("status", parents=[common], help="nodes and jobs, as a table")
    watch = commands.add_parser("watch", parents=[common], help="the status, refreshed")
    watch.add_argument(
        "--interval",
        type=_watch_interval,
        default=2.0,
        help=f"seconds between refreshes, at least {MIN_WATCH_INTERVAL_S:g} (default 2)",
    )
    for name, help_text in (
        ("pause", "pause a job cluster-wide (survives restarts)"),
        ("resume", "resume a paused job"),
        ("trigger", "one extra run now, on the current leader"),
        ("step-down", "the leader hands the job over to another node"),
    ):
        command = commands.add_parser(name, parents=[common], help=help_text)
        command.add_argument("job")
    checkpoint = commands.add_parser("checkpoint", parents=[common], help="a job's checkpoint")
    checkpoint.add_argument("job")
    checkpoint.add_argument("--state", action="store_true", help="also print its state")
    history = commands.add_parser(
        "history", parents=[common], help="a job's last runs and missed instants, newest first"
    )
    history.add_argument("job")
    history.add_argument("--limit", type=_limit, default=20, help="how many entries (default 20)")
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    out = out or sys.stdout
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse has already printed
        return int(exc.code or 0)
    try:
        settings = Settings.build(
            redis_url=getattr(args, "redis_url", None),
            has_client=False,
            project=getattr(args, "project", None),
            node_id=NODE_ID,
            heartbeat_interval=None,
            lock_expiry=None,
            max_backoff=None,
            shutdown_timeout=None,
            flags=FLAGS,
        )
    except ConfigurationError as exc:
        _say(sys.stderr, f"singletonjob: {exc}")
        return EXIT_USAGE
    project = _Project.of(settings)
    try:
        return asyncio.run(_run(project, args, out))
    except KeyboardInterrupt:
        return EXIT_OK
    except BrokenPipeError:  # the reader went away (`singletonjob watch --json | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # as Python's docs do
        return EXIT_OK
    except JobNotFound as exc:
        _say(sys.stderr, f"singletonjob: {exc}")
        return EXIT_NO_JOB
    except STORE_ERRORS as exc:
        _say(sys.stderr, f"singletonjob: Redis at {project.store_description} {_failed(exc)}")
        return EXIT_UNREACHABLE
    except Exception as exc:
        _say(sys.stderr, f"singletonjob: unexpected error: {type(exc).__name__}: {exc}")
        return EXIT_ERROR


def _failed(exc: BaseException) -> str:
    """What went wrong with a store call: Redis refused it (it answered: a password, a
    database index, an ACL; say what to fix), or it did not answer."""
    refused = refusal(exc)
    if refused is not None:
        return f"refused: {refused}"
    said = f"{type(exc).__name__}: {exc}".rstrip(": ")
    if isinstance(exc, ResponseError):
        return f"refused the call: {said}"
    return f"did not answer: {said}"


async def _run(project: _Project, args: argparse.Namespace, out: TextIO) -> int:
    timeout_s = getattr(args, "timeout", DEFAULT_CONTROL_TIMEOUT_S)
    as_json = getattr(args, "json", False)
    if args.command in ("status", "watch"):
        while True:
            view = await within(project.admin.cluster_status(), timeout_s)
            if as_json:
                _say(out, json.dumps(view.model_dump(mode="json")))
            else:
                if args.command == "watch":
                    out.write("\x1b[H\x1b[2J")  # home, clear screen
                out.write(render(view))
                out.flush()
            if args.command == "status":
                return EXIT_OK
            await asyncio.sleep(args.interval)
    if args.command == "checkpoint":
        return await _checkpoint(project, args.job, args.state, as_json, timeout_s, out)
    if args.command == "history":
        return await _history(project, args.job, args.limit, as_json, timeout_s, out)
    act, done = _ACTIONS[args.command]
    await within(act(project.admin, args.job), timeout_s)
    if as_json:
        result = {"job": args.job, "action": args.command, "accepted": True}
        _say(out, json.dumps(result))
    else:
        _say(out, f"{done} job {args.job!r} of project {project.name!r}")
    return EXIT_OK


async def _require_known(project: _Project, job: str, timeout_s: float) -> None:
    """``JobNotFound`` unless a live node registered ``job`` or the store holds it (the CLI
    has no jobs of its own)."""
    view = await within(project.admin.cluster_status(), timeout_s)
    if job not in {x.name for x in view.jobs}:
        known = ", ".join(x.name for x in view.jobs) or "none"
        raise JobNotFound(
            f"no job named {job!r} is registered by a live node or stored in project "
            f"{project.name!r}; known jobs: {known}",
            field="job",
        )


async def _history(
    project: _Project, job: str, limit: int, as_json: bool, timeout_s: float, out: TextIO
) -> int:
    async with project.stores() as store:
        entries = await within(store.read_history(job, limit=limit), timeout_s)
    if not entries:  # a stored history names a job, even with no node live
        await _require_known(project, job, timeout_s)
    if as_json:
        rows = [dataclasses.asdict(entry) for entry in entries]
        _say(out, json.dumps({"job": job, "entries": rows}, default=_when))
        return EXIT_OK
    if not entries:
        _say(out, f"job {job!r} has no history")
    for entry in entries:
        if entry.missed:
            what = f"missed   {entry.reason}: {MISSED_REASONS.get(entry.reason or '', '')}"
            if entry.count != 1:
                many = "more than could be counted" if entry.count is None else entry.count
                until = f" to {_when(entry.last_at)}" if entry.last_at is not None else ""
                what += f" ({many} instants{until})"
        else:
            took = f"{(entry.duration_s or 0.0) * 1000:.1f} ms"
            what = f"{entry.outcome:<8} {took}" + (f"  {entry.error}" if entry.error else "")
        _say(out, f"{_when(entry.scheduled_at)}  {entry.node_id}  #{entry.fencing_token}  {what}")
    return EXIT_OK


async def _checkpoint(
    project: _Project, job: str, with_state: bool, as_json: bool, timeout_s: float, out: TextIO
) -> int:
    await _require_known(project, job, timeout_s)
    async with project.stores() as store:
        checkpoint = await within(store.read_checkpoint(job), timeout_s)
    if checkpoint is None:
        _say(out, "null" if as_json else f"job {job!r} has no checkpoint")
        return EXIT_OK
    fields: dict[str, object] = {
        "iteration": checkpoint.iteration,
        "last_scheduled_at": checkpoint.last_scheduled_at,
        "last_completed_at": checkpoint.last_completed_at,
        "last_outcome": checkpoint.last_outcome,
        "last_error": checkpoint.last_error,
        "node_id": checkpoint.node_id,
        "fencing_token": checkpoint.fencing_token,
    }
    if with_state:
        fields["state"] = checkpoint.state
    if as_json:
        _say(out, json.dumps(fields, default=_when))
    else:
        for key, value in fields.items():
            shown = json.dumps(value) if key == "state" else _when(value)
            _say(out, f"{key + ':':19} {shown}")
    return EXIT_OK


def _limit(text: str) -> int:
    """``--limit``: a whole number of entries from 1 to ``MAX_HISTORY``."""
    try:
        return check_limit(int(text))
    except (ValueError, ConfigurationError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number from 1 to {MAX_HISTORY}"
        ) from None


def _say(stream: TextIO, text: str) -> None:
    """Write one line; what came from Redis in it is escaped (``printable``)."""
    stream.write(printable(text) + "\n")
    stream.flush()


def printable(text: str) -> str:
    """``text`` with every character that is not printable escaped as Python writes it in a
    string literal (``\x1b``, ``\x7f``, ``\x9b``, ``\u202e``, ``\n``): C0 and C1 controls,
    DEL, line and paragraph separators, format characters such as bidirectional overrides.
    Plain spaces stay."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escaped(c) for c in text)


def _escaped(char: str) -> str:
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def _when(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def _ago(now: datetime, then: datetime | None) -> str:
    if then is None:
        return "-"
    seconds = (now - then).total_seconds()
    return f"{seconds:.1f}s ago" if seconds < 120 else then.strftime("%Y-%m-%d %H:%M:%SZ")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
        for row in [header, *rows]
    ]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def render(view: ClusterStatus) -> str:
    """The status as two tables, nodes and jobs."""
    now = view.observed_at
    nodes = [
        (n.node_id, n.version, _ago(now, n.started_at), _ago(now, n.last_seen), ", ".join(n.leads))
        for n in view.nodes
    ]
    jobs = []
    for job in view.jobs:
        checkpoint = job.checkpoint
        last = checkpoint.last_completed_at if checkpoint else job.last_instant
        jobs.append(
            (
                job.name,
                (job.schedule or "-") + (" (differs, see below)" if job.conflicts else ""),
                job.leader or "-",
                "-" if job.lease_time_left_s is None else f"{job.lease_time_left_s:.1f}s",
                "yes" if job.paused else "no",
                _ago(now, last),
                (checkpoint.last_outcome if checkpoint else None) or "-",
                "no" if job.overdue_since is None else f"since {_ago(now, job.overdue_since)}",
            )
        )
    return (
        f"project {printable(repr(view.project))} at {now.isoformat()}\n\n"
        + _table(("NODE", "VERSION", "STARTED", "LAST SEEN", "LEADS"), nodes)
        + "\n"
        + _table(
            ("JOB", "SCHEDULE", "LEADER", "LEASE LEFT", "PAUSED", "LAST RUN", "OUTCOME", "OVERDUE"),
            jobs,
        )
        + _differences(view)
    )


def _differences(view: ClusterStatus) -> str:
    """The jobs whose schedules differ between the live nodes, each schedule with its nodes
    (empty when there are none)."""
    differing = [job for job in view.jobs if job.conflicts]
    if not differing:
        return ""
    lines = ["", "SCHEDULES THAT DIFFER between nodes (only the leader's runs):"]
    for job in differing:
        lines.append(f"  job {job.name!r}, led by {job.leader or 'no node'}:")
        lines += [
            f"    {variant.schedule}  on {', '.join(variant.nodes)}" for variant in job.conflicts
        ]
    lines.append(
        f"  Two services on one project? {FIX[0].upper()}{FIX[1:]}; during a rolling deploy "
        "that changes a schedule this lasts until the last old replica is gone."
    )
    return "\n".join(printable(line) for line in lines) + "\n"
