"""level1 install checks against known-bad vLLM installs (editable tree, pins).

Each bad environment is a fake vLLM (a git tree with a ``vllm`` package and a
dist-info dir) put first on PYTHONPATH of a suite run in a subprocess.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from selftests.conftest import SuiteRun, run_suite
from selftests.foundation import fakes

INSTALL_TESTS = "suites/level1/test_vllm_install.py"
EXT_TESTS = "suites/level1/test_compiled_extensions.py"


def _index_fingerprint(tree: Path) -> tuple[int, str, list[str]]:
    """(index mtime in ns, index sha256, every path in the tree outside .git)."""
    index = tree / ".git" / "index"
    files = sorted(str(p.relative_to(tree)) for p in tree.rglob("*")
                   if ".git" not in p.relative_to(tree).parts)
    return (index.stat().st_mtime_ns, hashlib.sha256(index.read_bytes()).hexdigest(),
            files)


def test_real_vllm_outside_configured_tree_fails(tmp_path: Path) -> None:
    tree = fakes.make_git_tree(tmp_path / "checkout", {"README.md": "not vLLM\n"})
    run = run_suite([INSTALL_TESTS, "-k", "configured_source_tree"], tmp_path / "r",
                    env={"TVC_VLLM_SOURCE": str(tree)})
    t = run.test("test_vllm_is_the_configured_source_tree")
    assert t["outcome"] == "failed", run.tail()
    msg = t["message"]
    assert f"not from the source tree {tree.resolve()}" in msg
    assert "editable install is not live" in msg
    assert f"pip install -e {tree.resolve()}" in msg  # the fix
    assert run.rc == 1


@pytest.fixture(scope="module")
def fake_tree(tmp_path_factory) -> tuple[Path, Path]:
    return fakes.make_fake_vllm(tmp_path_factory.mktemp("fake-vllm"))


@pytest.fixture(scope="module")
def clean_run(fake_tree, tmp_path_factory) -> tuple[SuiteRun, tuple, tuple]:
    """One run of the install + extension checks against a clean fake tree.

    A tracked file is touched first (same content, new mtime): a plain ``git status``
    would rewrite the index then, so an unchanged index proves the suite did not.
    """
    tree, site = fake_tree
    os.utime(tree / "setup.py", (1_600_000_000, 1_600_000_000))
    before = _index_fingerprint(tree)
    run = run_suite(
        [INSTALL_TESTS, EXT_TESTS, "-k", "not test_vllm_imports"],
        tmp_path_factory.mktemp("report"),
        env={"TVC_VLLM_SOURCE": str(tree), "PYTHONPATH": fakes.pythonpath(tree, site)})
    return run, before, _index_fingerprint(tree)


def test_clean_fake_tree_passes_install_checks(clean_run) -> None:
    """Positive control: the same fakes pass when nothing is wrong."""
    run, _, _ = clean_run
    for name in ("test_vllm_is_the_configured_source_tree",
                 "test_source_tree_has_no_modified_tracked_files",
                 "test_torch_matches_vllm_pin",
                 "test_python_satisfies_vllm_requires_python"):
        assert run.test(name)["outcome"] == "passed", run.tail()
    assert run.summary["versions"]["vllm"] == fakes.FAKE_VLLM_VERSION


def test_missing_compiled_extensions_fail(clean_run, fake_tree) -> None:
    run, _, _ = clean_run
    t = run.test("test_vllm_ships_compiled_extensions")
    assert t["outcome"] == "failed", run.tail()
    assert "ships no `_C*` extension" in t["message"]
    assert str(fake_tree[0] / "vllm") in t["message"]
    assert "Fix: reinstall vLLM with its compiled part" in t["message"]


def test_suite_does_not_write_the_users_tree(clean_run) -> None:
    _, before, after = clean_run
    assert before == after, "the suite rewrote .git/index of the vLLM source tree"


def test_modified_tracked_file_fails_naming_it(clean_run, fake_tree,
                                               tmp_path: Path) -> None:
    tree, site = fake_tree
    (tree / "vllm" / "config.py").write_text("# a local patch to vLLM\n")
    before = _index_fingerprint(tree)
    run = run_suite([INSTALL_TESTS, "-k", "no_modified_tracked_files"], tmp_path / "r",
                    env={"TVC_VLLM_SOURCE": str(tree),
                         "PYTHONPATH": fakes.pythonpath(tree, site)})
    t = run.test("test_source_tree_has_no_modified_tracked_files")
    assert t["outcome"] == "failed", run.tail()
    assert "1 tracked file(s) modified" in t["message"]
    assert "vllm/config.py" in t["message"]
    assert "zero changes to vLLM" in t["message"] and "Fix:" in t["message"]
    assert _index_fingerprint(tree) == before
    assert (tree / "vllm" / "config.py").read_text() == "# a local patch to vLLM\n"


def test_torch_pin_and_requires_python_mismatch_fail(tmp_path: Path) -> None:
    tree, site = fakes.make_fake_vllm(
        tmp_path / "fake", torch_req="torch==9.9.9",
        requires_python=fakes.excluding_python_spec())
    run = run_suite([INSTALL_TESTS, "-k", "torch_matches or requires_python"],
                    tmp_path / "r", env={"TVC_VLLM_SOURCE": str(tree),
                                         "PYTHONPATH": fakes.pythonpath(tree, site)})
    import importlib.metadata as md
    import platform

    pin = run.test("test_torch_matches_vllm_pin")
    assert pin["outcome"] == "failed", run.tail()
    assert f"torch {md.version('torch')} is installed" in pin["message"]
    assert "pins torch==9.9.9" in pin["message"]
    assert "pip install 'torch==9.9.9'" in pin["message"]
    py = run.test("test_python_satisfies_vllm_requires_python")
    assert py["outcome"] == "failed", run.tail()
    assert f"Python {platform.python_version()}" in py["message"]
    assert f"Requires-Python {fakes.excluding_python_spec()}" in py["message"]
    assert "Fix: use a Python in that range" in py["message"]
