"""``python -m example_app.demo --quick``, the README's first command, run as a user would.

Without a TTY it prints one line per change. It must show the six jobs spread over the three
replicas, a pause and a resume through the operators' CLI (exit code 0, no run while paused),
a graceful handover (SIGTERM) and a hard one (SIGKILL) of exactly the signalled leader's jobs,
the hard one waiting for the lease, exit 0, and leave no process behind; on Ctrl-C it must stop
everything it started too. Leftovers are found by a marker in
the environment that every process of the demo inherits (the project name).
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO_TIMEOUT_S = 75.0
QUICK_LOCK_EXPIRY_S = 1.0
"""The lock expiry of ``--quick`` (``example_app.demo.QUICK``)."""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(DEMO_TIMEOUT_S + 5),
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc (Linux)"),
]

JOBS = {
    "price-tick",
    "heartbeat",
    "daily-report",
    "cache-refresh",
    "session-cleanup",
    "metrics-rollup",
}
HANDOVER = re.compile(
    r"^  (?P<cause>graceful stop|hard kill) of (?P<old>replica-\d) \((?P<signal>SIG\w+)\): "
    r"(?P=old) -> (?P<new>replica-\d), leaderless (?P<gap>\d+\.\d+)s \((?P<jobs>[^)]*)\)$",
    re.M,
)
SIGNALLED = re.compile(
    r"  (?P<signal>SIGTERM|SIGKILL) to (?P<name>replica-\d), leader of (?P<jobs>[^(]*) \(", re.M
)
SPREAD = re.compile(r"  every job has a leader, spread over the replicas \((?P<shares>.*)\)$", re.M)
CLI = re.compile(
    r"  \$ python -m fastapi_singletonjob --redis-url redis://127\.0\.0\.1:\d+/0 "
    r"--project (?P<project>\S+) (?P<action>pause|resume) price-tick\n"
    r"(?:.*\n)*?.*    (?P=action)d job 'price-tick' of project '(?P=project)'\n"
    r".*    \(exit code 0\)$",
    re.M,
)
STARTED = re.compile(r"^started (?P<name>\S+) \(pid (?P<pid>\d+)\)", re.M)


def demo_env(marker: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SINGLETONJOB_")}
    env["SINGLETONJOB_PROJECT"] = marker  # the demo's own Redis, and a name to find leftovers by
    env["PYTHONUNBUFFERED"] = "1"
    return env


def processes_with(marker: str) -> list[int]:
    """Pids of live processes whose environment contains ``marker``."""
    needle = f"SINGLETONJOB_PROJECT={marker}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or a zombie
            continue
    return found


def test_the_demo_shows_both_handovers_and_leaves_nothing_behind() -> None:
    marker = f"demo-test-{secrets.token_hex(4)}"
    started = time.monotonic()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "example_app.demo", "--quick"],
            cwd=ROOT,
            env=demo_env(marker),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=DEMO_TIMEOUT_S,
        )
    finally:
        left = processes_with(marker)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    output = result.stdout + result.stderr
    elapsed = time.monotonic() - started
    assert result.returncode == 0, output
    assert left == [], f"processes left running: {left}\n{output}"

    names = {m["name"]: int(m["pid"]) for m in STARTED.finditer(output)}
    assert sorted(names) == ["redis-server", "replica-1", "replica-2", "replica-3"] or sorted(
        names
    ) == ["replica-1", "replica-2", "replica-3", "valkey-server"], output
    assert "no process left running" in output

    # Spread: every replica leads some of the six jobs before anything else happens.
    spread = SPREAD.search(output)
    assert spread is not None, output
    shares = dict(share.split(": ") for share in spread["shares"].split("; "))
    assert sorted(shares) == ["replica-1", "replica-2", "replica-3"], output
    led = [job for jobs in shares.values() for job in jobs.split(", ")]
    assert sorted(led) == sorted(JOBS), output

    # Pause and resume through the CLI, in that order, and no run while paused.
    actions = list(CLI.finditer(output))
    assert [m["action"] for m in actions] == ["pause", "resume"], output
    assert re.search(
        r"  price-tick: paused, as replica-\d answers in /singletonjob/jobs$", output, re.M
    )
    assert re.search(r"  price-tick paused for \d+\.\ds: no new run", output, re.M), output
    assert re.search(r"  price-tick runs again on replica-\d$", output, re.M), output

    # The signals, after the resume; each names the jobs its replica led.
    signalled = {m["signal"]: m for m in SIGNALLED.finditer(output)}
    assert sorted(signalled) == ["SIGKILL", "SIGTERM"], output
    assert spread.start() < actions[0].start() < actions[1].end() < signalled["SIGTERM"].start()
    assert signalled["SIGTERM"].start() < signalled["SIGKILL"].start()
    assert signalled["SIGTERM"]["name"] != signalled["SIGKILL"]["name"], output

    # Each signal moves exactly its replica's jobs (other moves are labelled placement moves).
    handovers = list(HANDOVER.finditer(output))
    for cause, signal_name in (("graceful stop", "SIGTERM"), ("hard kill", "SIGKILL")):
        rows = [m for m in handovers if m["cause"] == cause]
        assert rows, output
        assert {m["signal"] for m in rows} == {signal_name}
        assert {m["old"] for m in rows} == {signalled[signal_name]["name"]}, output
        moved = [job for m in rows for job in m["jobs"].split(", ")]
        assert sorted(moved) == sorted(signalled[signal_name]["jobs"].split(", ")), output
    # The hard handover waits for the lease left at the kill (lock expiry less the time since
    # the last renewal). The graceful one does not wait for the lease, but the engine can
    # bounce a released job to the replica that just left, which placement still prefers for
    # a round, and then the job waits about one lock expiry: hence the looser bound.
    for m in handovers:
        gap = float(m["gap"])
        if m["cause"] == "hard kill":
            assert QUICK_LOCK_EXPIRY_S / 2 < gap < QUICK_LOCK_EXPIRY_S + 2, output
        else:
            assert gap < QUICK_LOCK_EXPIRY_S + 1, output
    assert "TWO LEADERS" not in output and "WARNING" not in output, output
    # one line per change, no screen control codes without a TTY
    assert "\x1b" not in output
    assert re.search(r"^\+\s+\d+\.\d\ds  price-tick ran on replica-\d", output, re.M), output
    assert elapsed < DEMO_TIMEOUT_S


def test_ctrl_c_stops_every_process_it_started() -> None:
    marker = f"demo-test-{secrets.token_hex(4)}"
    process = subprocess.Popen(
        [sys.executable, "-m", "example_app.demo", "--quick", "--duration", "60"],
        cwd=ROOT,
        env=demo_env(marker),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    assert process.stdout is not None
    stdout = process.stdout
    reader = threading.Thread(target=lambda: lines.extend(stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + DEMO_TIMEOUT_S / 2
        while not any(" leads (fencing token " in line for line in lines):
            assert process.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "no leader within the deadline:\n" + "".join(lines)
            time.sleep(0.05)
        assert processes_with(marker), "the cluster runs"
        process.send_signal(signal.SIGINT)
        code = process.wait(DEMO_TIMEOUT_S / 2)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        reader.join(5)
        stdout.close()
        left = processes_with(marker)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    output = "".join(lines)
    assert code == 130, output
    assert left == [], f"processes left running: {left}\n{output}"
    assert "interrupted" in output
    assert "no process left running" in output
