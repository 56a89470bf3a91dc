"""The built distributions hold what a release needs, and the wheel nothing more.

The wheel holds exactly the package's modules, ``py.typed`` and the dist-info with the license;
no tests, docs or example app. The sdist holds the sources with LICENSE, README.md and
CHANGELOG.md. The test builds both with ``python -m build`` (isolated environments that fetch
the build backend: several seconds, hence ``slow``) into a temporary directory; ``nox -s build``
builds them once, checks them with ``twine check --strict`` and passes their directory in
``SJTEST_DIST_DIR`` instead.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
import zipfile
from email.parser import HeaderParser
from pathlib import Path

import pytest

import fastapi_singletonjob

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "fastapi_singletonjob"
DIST_DIR_ENV = "SJTEST_DIST_DIR"
"""A directory holding one built sdist and one wheel; unset, the test builds them."""
BUILD_TIMEOUT_S = 240

SDIST_REQUIRED = frozenset({"LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "PKG-INFO"})
SDIST_ALLOWED = SDIST_REQUIRED | {PACKAGE, "tests", "docs", ".gitignore"}
"""Top-level entries the sdist may hold: pyproject's sdist include list, plus what hatchling
always adds."""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT_S + 60)]


def build_installed() -> bool:
    """Whether the ``build`` frontend is importable (the ``dev`` extra installs it)."""
    # The checkout's build/ directory (the docs site) would import as a namespace package.
    spec = importlib.util.find_spec("build")
    return spec is not None and spec.origin is not None


@pytest.fixture(scope="module")
def dist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory with the sdist and the wheel: given by ``nox -s build``, else built here."""
    given = os.environ.get(DIST_DIR_ENV)
    if given:
        return Path(given)
    if not build_installed():
        pytest.skip("the 'build' package is not installed: pip install -e '.[dev]'")
    out = tmp_path_factory.mktemp("dist")
    # The sdist first, then the wheel built from the unpacked sdist, so both are checked.
    # Run from out: `-m` puts the working directory on sys.path, and the checkout has a build/.
    done = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
        cwd=out,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"python -m build failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return out


def only(dist_dir: Path, pattern: str) -> Path:
    """The one file of ``dist_dir`` that matches ``pattern``."""
    found = sorted(dist_dir.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {dist_dir}, found {found}"
    return found[0]


def package_files() -> set[str]:
    """Every file the wheel must hold outside its dist-info, as archive paths."""
    package = ROOT / PACKAGE
    files = {path.relative_to(ROOT).as_posix() for path in package.rglob("*.py")}
    return files | {f"{PACKAGE}/py.typed"}


def test_wheel_holds_exactly_the_package_and_its_metadata(dist_dir: Path) -> None:
    wheel = only(dist_dir, f"{PACKAGE}-*.whl")
    version = fastapi_singletonjob.__version__
    assert wheel.name == f"{PACKAGE}-{version}-py3-none-any.whl"
    dist_info = f"{PACKAGE}-{version}.dist-info"
    meta_files = {
        f"{dist_info}/{name}" for name in ("METADATA", "WHEEL", "RECORD", "entry_points.txt")
    }
    expected = package_files() | meta_files | {f"{dist_info}/licenses/LICENSE"}
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        assert sorted(names - expected) == [], "files in the wheel that do not belong there"
        assert sorted(expected - names) == [], "files missing from the wheel"
        metadata = HeaderParser().parsestr(archive.read(f"{dist_info}/METADATA").decode())
        license_text = archive.read(f"{dist_info}/licenses/LICENSE").decode()
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()

    assert metadata["Name"] == "fastapi-singletonjob"
    assert metadata["Version"] == version
    assert metadata["License-Expression"] == "MIT"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert license_text == (ROOT / "LICENSE").read_text(encoding="utf-8")
    # The one console script: the operators' command (docs/operations.md).
    assert "[console_scripts]" in entry_points
    assert "singletonjob = fastapi_singletonjob._cli:main" in entry_points


def test_sdist_holds_the_license_readme_and_changelog(dist_dir: Path) -> None:
    sdist = only(dist_dir, f"{PACKAGE}-*.tar.gz")
    top = f"{PACKAGE}-{fastapi_singletonjob.__version__}"
    assert sdist.name == f"{top}.tar.gz"
    with tarfile.open(sdist) as archive:
        names = {member.name for member in archive.getmembers() if member.isfile()}
    assert all(name.startswith(f"{top}/") for name in names), "entries outside the top folder"
    entries = {name.split("/")[1] for name in names}
    assert sorted(SDIST_REQUIRED - entries) == [], "files missing from the sdist"
    assert sorted(entries - SDIST_ALLOWED) == [], "entries in the sdist that do not belong there"
    assert {f"{top}/{name}" for name in package_files()} <= names
