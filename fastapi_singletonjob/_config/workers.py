"""Whether this process is one of several workers of a server (uvicorn ``--workers``, gunicorn,
hypercorn): ``memory://`` elects within one process, so each worker would run every job.

Read from what those servers leave behind, never from a guess: the parent process's command
line (a uvicorn or hypercorn with ``--workers`` spawns its workers, a gunicorn master forks
them), this process's own (a forked gunicorn worker keeps its master's), and the environment
they read or set (``SERVER_SOFTWARE=gunicorn/...``, ``GUNICORN_CMD_ARGS``, ``WEB_CONCURRENCY``).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Workers", "memory_store_warning", "parent_argv", "several_workers", "this_process"]

_SERVERS = ("uvicorn", "gunicorn", "hypercorn")
_SHORT_FLAG = {"gunicorn": "-w", "hypercorn": "-w"}
"""The servers whose worker count has a short flag too (uvicorn has only ``--workers``)."""


@dataclass(frozen=True)
class Workers:
    """A server that runs this process as one of its workers."""

    server: str
    """``uvicorn``, ``gunicorn`` or ``hypercorn``."""
    count: int | None
    """How many workers it runs (None: more than one may, the number was not found)."""
    how: str
    """Where that was seen, in the user's words (``uvicorn --workers 2``)."""

    def describe(self) -> str:
        """``one of 2 workers of uvicorn --workers 2``."""
        if self.count is None:
            return f"a worker of {self.how} (which may run several)"
        return f"one of {self.count} workers of {self.how}"


def _server_of(argv: Sequence[str]) -> str | None:
    """The server an argv runs: ``uvicorn ...``, ``python -m uvicorn ...``,
    ``.../bin/gunicorn ...``."""
    for i, arg in enumerate(argv[:3]):
        name = Path(arg).name
        if name in _SERVERS:
            return name
        if arg == "-m" and i + 1 < len(argv) and argv[i + 1] in _SERVERS:
            return argv[i + 1]
    return None


def _count_in(argv: Sequence[str], server: str) -> tuple[int, str] | None:
    """The worker count an argv gives (the last one wins, as in argparse and click), with the
    flag as the user wrote it (``-w 4``, ``--workers 2``)."""
    short = _SHORT_FLAG.get(server)
    found: tuple[int, str] | None = None
    for i, arg in enumerate(argv):
        flag, value = arg, argv[i + 1] if i + 1 < len(argv) else ""
        if arg.startswith("--workers="):
            flag, _, value = arg.partition("=")
        elif short is not None and arg.startswith(short) and arg != short:
            flag, value = short, arg[len(short) :]
        if flag in ("--workers", short) and value.isdigit():
            found = (int(value), f"{flag} {value}")
    return found


def _count_of(server: str, argv: Sequence[str], env: Mapping[str, str]) -> tuple[int, str] | None:
    """The worker count of ``server`` run with ``argv`` in ``env``, and how it was given
    (``uvicorn --workers 2``): its flag, else the variables it reads (gunicorn:
    ``GUNICORN_CMD_ARGS``, then ``WEB_CONCURRENCY``; uvicorn: ``WEB_CONCURRENCY``)."""
    counted = _count_in(argv, server)
    if counted is not None:
        return counted[0], f"{server} {counted[1]}"
    if server == "gunicorn" and "GUNICORN_CMD_ARGS" in env:
        try:
            counted = _count_in(shlex.split(env["GUNICORN_CMD_ARGS"]), server)
        except ValueError:
            counted = None
        if counted is not None:
            return counted[0], f"GUNICORN_CMD_ARGS='{counted[1]}' gunicorn"
    if server in ("gunicorn", "uvicorn") and env.get("WEB_CONCURRENCY", "").isdigit():
        count = env["WEB_CONCURRENCY"]
        return int(count), f"WEB_CONCURRENCY={count} {server}"
    return None


def several_workers(
    env: Mapping[str, str], argv: Sequence[str], parent: Sequence[str] | None
) -> Workers | None:
    """The server of which this process is one of several workers, or None.

    :param env: this process's environment.
    :param argv: this process's command line (a forked gunicorn worker's is its master's).
    :param parent: the parent process's command line, if it can be read.

    A uvicorn or hypercorn running one worker serves in its own process, so a parent of that
    name is a multi-worker (or ``--reload``) supervisor; one worker, or ``--reload``, is not
    several. A gunicorn worker is known by ``SERVER_SOFTWARE``, which its master sets; gunicorn
    runs one worker by default, but a configuration file may say more, so a gunicorn whose
    count is nowhere to be read is reported with the count unknown."""
    gunicorn = env.get("SERVER_SOFTWARE", "").startswith("gunicorn/")
    for line in (parent, argv):
        if line is None:
            continue
        server = _server_of(line)
        if server == "uvicorn" and "--reload" in line:
            return None  # uvicorn --reload runs one worker, whatever --workers says
        if server is None or (server == "gunicorn") != gunicorn:
            continue
        if server != "gunicorn" and line is argv:
            continue  # a uvicorn or hypercorn process itself serves alone or supervises
        counted = _count_of(server, line, env)
        if counted is None:
            if server == "gunicorn":
                return Workers(server, None, "gunicorn")
            continue
        count, flag = counted
        if count > 1:
            return Workers(server, count, flag)
        return None
    if gunicorn:
        counted = _count_of("gunicorn", (), env)
        if counted is None:
            return Workers("gunicorn", None, "gunicorn")
        if counted[0] > 1:
            return Workers("gunicorn", counted[0], counted[1])
    return None


def parent_argv() -> list[str] | None:
    """The parent process's command line (Linux's ``/proc``), or None where it cannot be read."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part] or None


def this_process() -> Workers | None:
    """:func:`several_workers` for this process."""
    return several_workers(os.environ, sys.argv, parent_argv())


def memory_store_warning(url: str, workers: Workers | None, pid: int) -> str:
    """What a node on ``memory://`` says at startup: it elects within this process only, and
    when this process is one of several workers, which server runs them and what to do."""
    said = (
        f"redis_url={url!r} elects within this process only: every worker and replica runs "
        "every job"
    )
    if workers is None:
        return (
            f"{said}. That is right for one process (development, tests); for several workers "
            "or replicas, give them one Redis: SINGLETONJOB_REDIS_URL=redis://HOST:6379/0"
        )
    count = "each of them" if workers.count is None else f"each of the {workers.count}"
    return (
        f"{said}, and this process (pid {pid}) is {workers.describe()}: {count} runs every job "
        "on its own, at the same time. Give the workers one Redis "
        "(SINGLETONJOB_REDIS_URL=redis://HOST:6379/0), or run one worker"
    )
