"""The CLI's own checks (issue 27, item 8): text read from Redis reaches the terminal escaped,
never raw (the table, the checkpoint, the errors; ``--json`` is escaped by ``json.dumps``), and
``--timeout`` and ``watch --interval`` refuse numbers that cannot work with argparse's usage
error (exit 2) instead of "Redis did not answer" or a busy loop. The end-to-end CLI runs, in a
subprocess, are in test_operations_processes.py."""

from __future__ import annotations

import asyncio
import io
import json
import os
from datetime import UTC, datetime

import pytest
from waiting import wait_until

from fastapi_singletonjob import SingletonJobs
from fastapi_singletonjob._cli import EXIT_NO_JOB, EXIT_OK, EXIT_USAGE, main, printable, render
from fastapi_singletonjob._web.models import ClusterJob, ClusterNode, ClusterStatus

HOSTILE = (
    "\x1b]0;owned\x07\x1b[2J\x1b]52;c;Y3VybCBldmlsLnNofHNo\x07"  # OSC title, clear, clipboard
    "\x9b31m\x7f\x00\r\t\u202egnp.exe\u2028\x85end"  # C1 CSI, DEL, NUL, CR, TAB, RLO, LS, NEL
)


def raw_controls(text: str) -> list[str]:
    """The characters of ``text`` that would reach a terminal raw: all non-printable ones but
    the line ends the CLI writes itself."""
    return [c for c in text if not c.isprintable() and c != "\n"]


def test_printable_escapes_every_control_character_and_keeps_spaces() -> None:
    shown = printable(HOSTILE + " a b")
    assert raw_controls(shown) == [] and "\n" not in shown
    assert shown.endswith(" a b")
    assert "\\x1b]0;owned\\x07" in shown and "\\x9b" in shown and "\\x7f" in shown
    assert "\\u202e" in shown and "\\u2028" in shown and "\\x85" in shown
    assert printable("plain text, ünïcödé") == "plain text, ünïcödé"


def test_the_table_escapes_what_came_from_redis() -> None:
    now = datetime(2026, 12, 1, tzinfo=UTC)
    view = ClusterStatus(
        project="p",
        observed_at=now,
        nodes=[
            ClusterNode(
                node_id=HOSTILE,
                owner=HOSTILE,
                version=HOSTILE,
                started_at=now,
                last_seen=now,
                expires_in_s=1.0,
                jobs=[HOSTILE],
                leads=[HOSTILE],
            )
        ],
        jobs=[
            ClusterJob(
                name=HOSTILE,
                schedule=HOSTILE,
                nodes=[HOSTILE],
                leader=HOSTILE,
                fencing_token=1,
                lease_time_left_s=1.0,
                paused=False,
                last_instant=None,
                checkpoint=None,
            )
        ],
    )
    table = render(view)
    assert raw_controls(table) == []
    assert table.count("\n") == 7  # the CLI's own lines only: title, blank, 2 + blank, 2
    assert table.count("\\x1b]0;owned") == 6  # node id, version, leads, job, schedule, leader


@pytest.mark.parametrize(
    "argv",
    [
        ["--timeout", "0", "status"],
        ["--timeout", "-1", "status"],
        ["--timeout", "nan", "status"],
        ["--timeout", "inf", "status"],
        ["status", "--timeout", "soon"],
        ["watch", "--interval", "-1"],
        ["watch", "--interval", "0"],
        ["watch", "--interval", "0.01"],
        ["watch", "--interval", "nan"],
    ],
)
def test_numbers_that_cannot_work_are_usage_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # No Redis at this port: the check comes before any connection.
    code = main(["--redis-url", "redis://127.0.0.1:9/0", "--project", "p", *argv])
    assert code == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("usage: singletonjob") and "error: argument --" in err, err
    assert "did not answer" not in err


@pytest.mark.redis
async def test_a_stored_error_reaches_the_terminal_escaped(
    redis_url: str, unique_project: str
) -> None:
    jobs = SingletonJobs(
        redis_url, project=unique_project, node_id="n1", heartbeat_interval=0.1, lock_expiry=0.5
    )

    @jobs.interval("fetch", every=60)
    async def fetch() -> None:
        raise ValueError(f"upstream said: {HOSTILE}")

    async def failed() -> bool:
        stored = await jobs.checkpoint("fetch")
        return stored is not None and stored.last_error is not None

    await jobs.start()
    try:
        await wait_until(failed, 10.0, "the failed run's record")
        args = ["--redis-url", redis_url, "--project", unique_project]
        out = io.StringIO()
        code = await asyncio.to_thread(main, [*args, "checkpoint", "fetch"], out)
        assert code == EXIT_OK
        text = out.getvalue()
        assert raw_controls(text) == [], text
        (line,) = [line for line in text.splitlines() if line.startswith("last_error")]
        assert "upstream said: \\x1b]0;owned\\x07" in line

        out = io.StringIO()
        code = await asyncio.to_thread(main, [*args, "checkpoint", "fetch", "--json"], out)
        assert code == EXIT_OK
        assert raw_controls(out.getvalue()) == [] and out.getvalue().isascii()
        assert json.loads(out.getvalue())["last_error"] == f"ValueError: upstream said: {HOSTILE}"

        out = io.StringIO()
        assert await asyncio.to_thread(main, [*args, "status"], out) == EXIT_OK
        assert raw_controls(out.getvalue()) == []
    finally:
        await jobs.stop()


# -- a newcomer's mistakes are told in the CLI's own terms (issue 29, item 11) -------------------


@pytest.fixture
def no_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No ``SINGLETONJOB_*`` variable of the developer's or the CI's reaches the CLI."""
    for name in list(os.environ):
        if name.upper().startswith("SINGLETONJOB_"):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        pytest.param(
            ["status"],
            "project is required: it namespaces every Redis key, and a shared default would let "
            "unrelated deployments elect each other; pass --project 'myapp' or set "
            "SINGLETONJOB_PROJECT",
            id="no-project",
        ),
        pytest.param(
            ["status", "--project", "my app"],
            "--project 'my app' is not a valid project name; use 1-100 characters: letters, "
            "digits, '-', '_' or '.', starting with a letter or digit, e.g. --project 'myapp'",
            id="bad-project",
        ),
        pytest.param(
            ["--project", "p", "--redis-url", "localhost:6379", "status"],
            "--redis-url 'localhost:6379' is not supported; use redis://host:port/db",
            id="bad-redis-url",
        ),
    ],
)
def test_configuration_errors_speak_of_the_flags(
    argv: list[str],
    said: str,
    no_environment: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"singletonjob: {said}"), err
    assert "project=" not in err and "redis_url=" not in err


def test_a_setting_from_the_environment_keeps_its_variable(
    no_environment: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    no_environment.setenv("SINGLETONJOB_PROJECT", "my app")
    assert main(["status"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("singletonjob: project (from SINGLETONJOB_PROJECT='my app'): "), err
    assert "--project 'my app'" not in err  # no flag was given


@pytest.mark.parametrize("command", ["pause", "resume", "trigger", "step-down", "checkpoint"])
def test_an_unknown_job_is_not_said_to_be_registered_here(
    command: str, no_environment: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--redis-url", "memory://cli-unknown-job", "--project", "p", command, "nosuch"]
    assert main(argv) == EXIT_NO_JOB
    err = capsys.readouterr().err
    assert err == (
        "singletonjob: no job named 'nosuch' is registered by a live node or stored in project "
        "'p'; known jobs: none\n"
    )
