"""The wheel's contents follow the tree (pyproject.toml [tool.setuptools]).

``packages`` is a list (the tests ship as ``tvc.suites`` from ``suites/``, which
``find`` cannot map), so a new folder of modules or tests, or a new kind of data file,
must be added there; these checks say which. ``scripts/wheel_check.sh`` (a CI step)
builds and runs the wheel itself.
"""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

import pytest

from selftests.conftest import REPO_ROOT
from tvc.config import paths

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SETUPTOOLS = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"][
    "setuptools"]


def _source_dir(package: str) -> Path:
    """The folder setuptools builds ``package`` from (package-dir mapping applied)."""
    mapping = SETUPTOOLS.get("package-dir", {})
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in mapping:
            return REPO_ROOT / mapping[prefix] / Path(*parts[n:])
    return REPO_ROOT / Path(*parts)


def _tree_packages() -> set[str]:
    """Every folder under tvc/ and suites/ that holds a module or a data file."""
    out = set()
    for top, name in ((REPO_ROOT / "tvc", "tvc"), (REPO_ROOT / "suites", "tvc.suites")):
        for folder in [top, *(p for p in top.rglob("*") if p.is_dir())]:
            if folder.name == "__pycache__" or "__pycache__" in folder.parts:
                continue
            if any(f.suffix == ".py" for f in folder.iterdir()) or folder == top:
                rel = folder.relative_to(top).parts
                out.add(".".join([name, *rel]))
    # tvc/data holds no module: its files are package data of "tvc.data"
    out.add("tvc.data")
    return {p for p in out if not p.startswith("tvc.data.")}


def test_listed_packages_are_the_folders_of_the_tree() -> None:
    listed = set(SETUPTOOLS["packages"])
    tree = _tree_packages()
    assert listed == tree, (
        f"pyproject.toml [tool.setuptools] packages: missing {sorted(tree - listed)}, "
        f"not in the tree {sorted(listed - tree)}")
    for package in listed:
        folder = _source_dir(package)
        assert folder.is_dir(), f"{package}: no folder {folder}"


def test_every_non_module_file_is_package_data() -> None:
    data = SETUPTOOLS["package-data"]
    missing = []
    for package in SETUPTOOLS["packages"]:
        base = _source_dir(package)
        for f in base.iterdir() if package != "tvc.data" else base.rglob("*"):
            if not f.is_file() or f.suffix in (".py", ".pyc"):
                continue
            rel = str(f.relative_to(base))
            if not any(fnmatch.fnmatch(rel, g) for g in data.get(package, [])):
                missing.append(f"{package}: {rel}")
    assert not missing, (
        f"files the wheel would leave out (add a glob to [tool.setuptools.package-data]"
        f"): {missing}")


def test_trace_option_sizes_are_the_sizes() -> None:
    from tvc.trace.bench import SIZES
    from tvc.trace.options import SIZE_NAMES

    assert sorted(SIZE_NAMES) == sorted(SIZES)


def test_defaults_in_a_checkout_and_installed(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    """Reports and scratch never default into the package's folder."""
    monkeypatch.delenv("TVC_REPORTS_ROOT", raising=False)
    assert paths.CHECKOUT == REPO_ROOT
    assert paths.reports_root(REPO_ROOT / "suites") == REPO_ROOT / "reports"
    # started from another folder (an editable install): reports go there
    assert paths.reports_root(tmp_path) == tmp_path.resolve() / "reports"
    assert paths.default_scratch("x") == REPO_ROOT / ".scratch" / "x"
    assert paths.suites_dir() == REPO_ROOT / "suites"
    monkeypatch.setattr(paths, "CHECKOUT", None)  # as installed from the wheel
    assert paths.reports_root(tmp_path) == tmp_path.resolve() / "reports"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cache = tmp_path / "cache"
    assert paths.default_scratch("x") == cache / paths.SCRATCH_APP_DIR / "x"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # invalid per the XDG spec
    assert paths.default_scratch("x") == (
        Path.home() / ".cache" / paths.SCRATCH_APP_DIR / "x")
    assert not paths.is_legacy_scratch(paths.default_scratch("x"), "x")
    assert paths.suites_dir() == paths.PACKAGE_DIR / "suites"
    monkeypatch.setenv("TVC_REPORTS_ROOT", str(tmp_path / "r"))
    assert paths.reports_root(tmp_path) == (tmp_path / "r").resolve()
