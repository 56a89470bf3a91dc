"""Replica subprocesses of one test, and real signals sent to them.

The tests that run replicas as processes (``node_proc.py``, ``checkpoint_proc.py``) subclass
:class:`ProcessFleet` with how to start one replica and how to read its journal; starting,
signalling (SIGTERM, SIGKILL, SIGSTOP/SIGCONT), waiting for exits and the log tails for
assertion messages are here, once.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from waiting import wait_until

STARTUP_S = 20.0
"""Interpreters importing FastAPI at once, on a busy machine."""
EXIT_S = 5.0
"""``shutdown_timeout`` (1 s) plus the release, with room to spare."""
POLL_S = 0.01


def now() -> float:
    """The journals' clock: ``CLOCK_MONOTONIC``, shared by every process of the machine."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


@dataclass
class Replica:
    """One replica process and its files."""

    node: str
    proc: subprocess.Popen[bytes]
    journal: Path
    log: Path
    signalled: bool = False
    """Sent SIGTERM or SIGKILL by the test: its exit is expected."""
    killed_at: float | None = None
    """When the test sent SIGKILL (journal clock): a run it left unfinished ends there."""


class ProcessFleet:
    """The replica processes of one test; :meth:`close` kills whatever still runs (resuming
    stopped ones first)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.replicas: dict[str, Replica] = {}

    def spawn(self, node: str, args: Sequence[str]) -> Replica:
        """Start ``args`` as replica ``node``, journalling to ``<node>.jsonl`` (the caller
        passes that path in ``args``: see :meth:`journal_of`) and logging to ``<node>.log``.
        A node whose process exited may be started again (a restart: same id, same files)."""
        previous = self.replicas.get(node)
        assert previous is None or previous.proc.poll() is not None, f"node {node} still runs"
        log = self.workdir / f"{node}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                list(args), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        replica = Replica(node, proc, self.journal_of(node), log)
        self.replicas[node] = replica
        return replica

    def journal_of(self, node: str) -> Path:
        return self.workdir / f"{node}.jsonl"

    def log(self, node: str) -> str:
        path = self.replicas[node].log
        return path.read_text(errors="replace") if path.exists() else ""

    def check_alive(self) -> None:
        """Fail the test when a replica exited that the test did not stop."""
        for replica in self.replicas.values():
            if not replica.signalled and replica.proc.poll() is not None:
                raise AssertionError(f"{replica.node} exited on its own\n{self.describe()}")

    def send(self, node: str, signum: signal.Signals) -> float:
        """Send ``signum`` to ``node``; return when it was sent (journal clock)."""
        replica = self.replicas[node]
        if signum in (signal.SIGTERM, signal.SIGKILL):
            replica.signalled = True
        sent_at = now()
        replica.proc.send_signal(signum)
        if signum == signal.SIGKILL:
            replica.killed_at = sent_at
        return sent_at

    def pause(self, node: str) -> None:
        """SIGSTOP ``node``; returns once the kernel reports it stopped."""
        self._signal_and_wait(node, signal.SIGSTOP, stopped=True)

    def resume(self, node: str) -> None:
        """SIGCONT ``node``; returns once it runs again."""
        self._signal_and_wait(node, signal.SIGCONT, stopped=False)

    def _signal_and_wait(self, node: str, signum: signal.Signals, *, stopped: bool) -> None:
        proc = self.replicas[node].proc
        proc.send_signal(signum)
        # Field 3 of /proc/<pid>/stat, after the ")" that ends the command name, is the state.
        stat = Path(f"/proc/{proc.pid}/stat")
        deadline = time.monotonic() + EXIT_S
        while (stat.read_text().rpartition(")")[2].split()[0] == "T") != stopped:
            assert time.monotonic() < deadline, f"{node} did not react to {signum.name}"
            time.sleep(0.001)

    def exited(self, nodes: Sequence[str] | None = None) -> bool:
        """Whether any of ``nodes`` (default: all) has exited."""
        names = self.replicas if nodes is None else nodes
        return any(self.replicas[node].proc.poll() is not None for node in names)

    async def wait_exit(self, node: str) -> int:
        proc = self.replicas[node].proc
        await wait_until(lambda: proc.poll() is not None, EXIT_S, f"{node} exits", poll_s=POLL_S)
        assert proc.returncode is not None
        return proc.returncode

    async def stop_all(self, ready: Callable[[str], bool] | None = None) -> None:
        """SIGTERM every live replica and check that each exits 0. ``ready(node)``: whether
        the replica handles SIGTERM yet (before, the signal would kill it); waited for first."""
        live = [r.node for r in self.replicas.values() if r.proc.poll() is None]
        if ready is not None:
            await wait_until(
                lambda: all(ready(node) for node in live) or self.exited(live),
                STARTUP_S,
                f"{', '.join(live)} ready for SIGTERM",
                poll_s=POLL_S,
            )
        for node in live:
            self.send(node, signal.SIGTERM)
        for node in live:
            assert await self.wait_exit(node) == 0, self.describe()

    def close(self) -> None:
        for replica in self.replicas.values():
            if replica.proc.poll() is None:
                replica.proc.send_signal(signal.SIGCONT)
                replica.proc.kill()
            replica.proc.wait(EXIT_S)

    def describe(self) -> str:
        """Exit codes and log tails, for assertion messages."""
        parts = []
        for replica in self.replicas.values():
            tail = "\n".join(self.log(replica.node).splitlines()[-15:])
            parts.append(f"--- {replica.node} (exit {replica.proc.poll()}):\n{tail}")
        return "\n".join(parts)
