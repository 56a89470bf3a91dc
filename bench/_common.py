"""What every benchmark family shares: statistics, the machine, child processes, Redis servers.

Times that cross process boundaries are ``CLOCK_MONOTONIC`` seconds (:func:`now`), the clock of
``tests/node_proc.py``'s journals, or Unix wall time where Redis tokens (server time in µs) are
compared. Every process and server a family starts is stopped in a ``finally``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import IO, TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # tests/servers.py and tests/node_proc.py: imported, not copied

if TYPE_CHECKING:
    # Checked alone, mypy cannot see tests/; checked with tests/, the ignores are unused.
    import node_proc  # type: ignore[import-not-found,unused-ignore]
    from servers import (  # type: ignore[import-not-found,unused-ignore]
        RedisServer,
        find_redis_server,
        free_port,
    )

_LAZY = {
    "node_proc": ("node_proc", None),
    "RedisServer": ("servers", "RedisServer"),
    "find_redis_server": ("servers", "find_redis_server"),
    "free_port": ("servers", "free_port"),
}


def __getattr__(name: str) -> Any:
    """Import tests/servers.py and tests/node_proc.py on first use: they import redis, which
    the many child processes that need neither should not pay for at startup."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


__all__ = [
    "ROOT",
    "Child",
    "RedisServer",
    "downsample",
    "find_redis_server",
    "free_port",
    "machine",
    "now",
    "optional",
    "percentile",
    "redis_version",
    "spawn",
    "say",
    "log",
    "node_proc",
    "stats",
    "stop_children",
    "write_json",
]

Json = dict[str, Any]


def now() -> float:
    """``CLOCK_MONOTONIC`` seconds: comparable across the processes of one machine."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


# -- statistics --------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def stats(values: Sequence[float], digits: int = 3) -> Json:
    """p50, p99, max, min and the count of ``values`` (rounded to ``digits``)."""
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None, "min": None}
    return {
        "n": len(values),
        "p50": round(percentile(values, 50), digits),
        "p99": round(percentile(values, 99), digits),
        "max": round(max(values), digits),
        "min": round(min(values), digits),
    }


def median(values: Iterable[float]) -> float:
    """The median of ``values`` (NaN when empty)."""
    return percentile(list(values), 50)


def downsample(values: Sequence[float], points: int = 400) -> list[list[float]]:
    """``[index, value]`` pairs: per bucket of consecutive values, the bucket's maximum, so
    that a plot of a long series keeps its spikes."""
    if not values:
        return []
    size = max(1, math.ceil(len(values) / points))
    return [[i, round(max(values[i : i + size]), 4)] for i in range(0, len(values), size)]


# -- the machine ---------------------------------------------------------------------------------


def redis_version(server: RedisServer) -> str:
    """``redis_version`` from ``INFO server``."""
    with server.client() as client:
        return str(client.info("server")["redis_version"])


def _version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def machine() -> Json:
    """The machine and software the figures come from."""
    with __getattr__("RedisServer").start() as server:
        version = redis_version(server)
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "redis_server": version,
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "packages": {
            name: _version(name)
            for name in (
                "fastapi-singletonjob",
                "redis",
                "fastapi",
                "apscheduler",
                "fastapi-utils",
                "opentelemetry-api",
                "opentelemetry-sdk",
                "matplotlib",
            )
        },
    }


def optional(module: str) -> ModuleType | None:
    """Import an optional peer (``bench`` extra); None when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


# -- child processes -----------------------------------------------------------------------------


class Child:
    """A ``python -m bench.<module> ...`` subprocess with its stdin/stdout as pipes."""

    def __init__(self, name: str, args: Sequence[str], log: Path) -> None:
        self.name = name
        self.log = log
        with open(log, "ab") as err:
            self.proc: subprocess.Popen[str] = subprocess.Popen(
                [sys.executable, *args],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                bufsize=1,
            )

    @property
    def stdin(self) -> IO[str]:
        assert self.proc.stdin is not None
        return self.proc.stdin

    @property
    def stdout(self) -> IO[str]:
        assert self.proc.stdout is not None
        return self.proc.stdout

    def send(self, line: str) -> None:
        """Write one line to the child's stdin."""
        self.stdin.write(line + "\n")
        self.stdin.flush()

    def expect(self, word: str) -> str:
        """Read stdout lines until one starts with ``word``; return it (fail on EOF)."""
        while True:
            line = self.stdout.readline()
            if not line:
                raise RuntimeError(
                    f"{self.name} exited (code {self.proc.poll()}) before saying {word!r}:\n"
                    + self.tail()
                )
            if line.startswith(word):
                return line.strip()

    def tail(self, lines: int = 20) -> str:
        """The last lines of the child's stderr log."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def signal(self, signum: signal.Signals) -> None:
        """Send ``signum`` if the child still runs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def wait(self, timeout_s: float) -> int | None:
        """Wait up to ``timeout_s`` for the child to exit; its code, or None."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None


def spawn(name: str, module: str, args: Sequence[str], log: Path) -> Child:
    """Start ``python -m <module> <args>`` from the project root."""
    return Child(name, ["-m", module, *args], log)


def stop_children(children: Iterable[Child], timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL whatever still runs after ``timeout_s``; reap all."""
    children = list(children)
    for child in children:
        child.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        if child.wait(max(0.0, deadline - time.monotonic())) is None:
            child.proc.kill()
            child.proc.wait()
        for stream in (child.proc.stdin, child.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


@contextlib.contextmanager
def children_stopped(children: list[Child]) -> Iterator[list[Child]]:
    """Stop every child in the list (also those appended later) on the way out."""
    try:
        yield children
    finally:
        stop_children(children)


def say(line: str) -> None:
    """Write one protocol line to stdout for the parent (``ready``, ``done``, a JSON object)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def log(message: str) -> None:
    """A progress line on stderr."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def write_json(path: Path, data: object) -> None:
    """Write ``data`` as indented JSON."""
    path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
