"""Whether a process is one of several workers of a server, read from its parent's command line,
its own and its environment (``_config/workers.py``): ``memory://`` there runs every job in
every worker, which a node must say loudly. The real ``uvicorn --workers 2`` case is in
``test_replicas.py``."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

import pytest

from fastapi_singletonjob import SingletonJobs
from fastapi_singletonjob._config.workers import (
    Workers,
    memory_store_warning,
    parent_argv,
    several_workers,
)
from fastapi_singletonjob.testing import FakeClock

PY = "/usr/bin/python3"
GUNICORN_ENV = {"SERVER_SOFTWARE": "gunicorn/23.0.0"}

CASES: list[tuple[str, Mapping[str, str], Sequence[str], Sequence[str] | None, Workers | None]] = [
    (
        "uvicorn --workers 2",
        {},
        ["-c"],
        [PY, "-m", "uvicorn", "app:app", "--workers", "2"],
        Workers("uvicorn", 2, "uvicorn --workers 2"),
    ),
    (
        "uvicorn --workers=3, the script",
        {},
        ["-c"],
        ["/venv/bin/uvicorn", "app:app", "--workers=3"],
        Workers("uvicorn", 3, "uvicorn --workers 3"),
    ),
    (
        "the last --workers wins",
        {},
        ["-c"],
        ["uvicorn", "app:app", "--workers", "1", "--workers", "4"],
        Workers("uvicorn", 4, "uvicorn --workers 4"),
    ),
    (
        "WEB_CONCURRENCY, which uvicorn reads",
        {"WEB_CONCURRENCY": "4"},
        ["-c"],
        ["uvicorn", "app:app"],
        Workers("uvicorn", 4, "WEB_CONCURRENCY=4 uvicorn"),
    ),
    ("uvicorn --workers 1", {}, ["-c"], ["uvicorn", "app:app", "--workers", "1"], None),
    (
        "uvicorn --reload runs one worker",
        {},
        ["-c"],
        ["uvicorn", "app:app", "--reload", "--workers", "2"],
        None,
    ),
    ("a lone uvicorn serves in its own process", {}, ["uvicorn", "app:app"], ["bash"], None),
    (
        "a lone uvicorn's own --workers 2 (it is the supervisor)",
        {},
        ["uvicorn", "app:app", "--workers", "2"],
        ["bash"],
        None,
    ),
    (
        "gunicorn -w 4, from the parent",
        GUNICORN_ENV,
        ["/venv/bin/gunicorn", "-w", "4", "app:app"],
        ["/venv/bin/python", "/venv/bin/gunicorn", "-w", "4", "app:app"],
        Workers("gunicorn", 4, "gunicorn -w 4"),
    ),
    (
        "gunicorn -w4 with a process title: its own argv (a fork keeps the master's)",
        GUNICORN_ENV,
        ["/venv/bin/gunicorn", "-k", "uvicorn_worker.UvicornWorker", "-w4", "app:app"],
        ["gunicorn: master [app:app]"],
        Workers("gunicorn", 4, "gunicorn -w 4"),
    ),
    (
        "gunicorn --workers=2",
        GUNICORN_ENV,
        ["gunicorn", "--workers=2", "app:app"],
        None,
        Workers("gunicorn", 2, "gunicorn --workers 2"),
    ),
    (
        "GUNICORN_CMD_ARGS",
        {**GUNICORN_ENV, "GUNICORN_CMD_ARGS": "--bind :8000 --workers 3"},
        ["gunicorn", "app:app"],
        None,
        Workers("gunicorn", 3, "GUNICORN_CMD_ARGS='--workers 3' gunicorn"),
    ),
    (
        "gunicorn with WEB_CONCURRENCY",
        {**GUNICORN_ENV, "WEB_CONCURRENCY": "2"},
        ["gunicorn", "app:app"],
        None,
        Workers("gunicorn", 2, "WEB_CONCURRENCY=2 gunicorn"),
    ),
    (
        "gunicorn, the count in a config file",
        GUNICORN_ENV,
        ["gunicorn", "-c", "conf.py", "app:app"],
        None,
        Workers("gunicorn", None, "gunicorn"),
    ),
    (
        "gunicorn run as python -m, no argv to read",
        GUNICORN_ENV,
        ["-c"],
        None,
        Workers("gunicorn", None, "gunicorn"),
    ),
    ("gunicorn -w 1", GUNICORN_ENV, ["gunicorn", "-w", "1", "app:app"], None, None),
    (
        "a gunicorn command line without gunicorn's variable is not its worker",
        {},
        ["gunicorn", "-w", "4", "app:app"],
        None,
        None,
    ),
    (
        "hypercorn -w 2",
        {},
        ["-c"],
        [PY, "-m", "hypercorn", "-w", "2", "app:app"],
        Workers("hypercorn", 2, "hypercorn -w 2"),
    ),
    (
        "hypercorn --workers 2",
        {},
        ["-c"],
        ["hypercorn", "--workers", "2", "app:app"],
        Workers("hypercorn", 2, "hypercorn --workers 2"),
    ),
    ("a shell", {}, [PY, "main.py"], ["-bash"], None),
    ("pytest", {}, [PY, "-m", "pytest"], None, None),
    ("an app named uvicorn_app is no uvicorn", {}, ["-c"], [PY, "uvicorn_app.py", "-w", "2"], None),
]


@pytest.mark.parametrize(
    ("env", "argv", "parent", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_several_workers(
    env: Mapping[str, str],
    argv: Sequence[str],
    parent: Sequence[str] | None,
    expected: Workers | None,
) -> None:
    assert several_workers(env, argv, parent) == expected


def test_the_parent_command_line_is_read() -> None:
    argv = parent_argv()
    if not os.path.exists("/proc/self/cmdline"):
        assert argv is None
        return
    assert argv, "pytest's parent has a command line"


def test_the_warning_names_the_server_the_count_and_the_fix() -> None:
    loud = memory_store_warning("memory://", Workers("uvicorn", 2, "uvicorn --workers 2"), 42)
    assert loud == (
        "redis_url='memory://' elects within this process only: every worker and replica runs "
        "every job, and this process (pid 42) is one of 2 workers of uvicorn --workers 2: each "
        "of the 2 runs every job on its own, at the same time. Give the workers one Redis "
        "(SINGLETONJOB_REDIS_URL=redis://HOST:6379/0), or run one worker"
    )
    unknown = memory_store_warning("memory://", Workers("gunicorn", None, "gunicorn"), 42)
    assert "is a worker of gunicorn (which may run several): each of them runs" in unknown
    plain = memory_store_warning("memory://x", None, 42)
    assert plain.startswith("redis_url='memory://x' elects within this process only: every")
    assert "workers of" not in plain


async def test_a_memory_store_warns_at_startup_on_the_system_clock_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="fastapi_singletonjob")
    for jobs in (
        SingletonJobs("memory://", project="warned"),
        SingletonJobs("memory://", project="simulated", clock=FakeClock()),
    ):
        await jobs.start()
        await jobs.stop()
    said = [r for r in caplog.records if "elects within this process only" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING], [r.getMessage() for r in said]
