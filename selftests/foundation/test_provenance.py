"""Provenance: a run records exactly what it tested (suite, vLLM, connector package)."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import subprocess
from pathlib import Path

import pytest

from selftests.conftest import REPO_ROOT, run_suite
from selftests.foundation.fakes import make_fake_distribution, make_git_tree
from selftests.foundation.synthetic import write_tests
from tvc.config.profile import load
from tvc.report import provenance as P

pytestmark = pytest.mark.hw_any

COMMIT = "0123456789abcdef0123456789abcdef01234567"
URL = "https://github.com/example/tvcfakeprov.git"


def _head(folder: Path) -> str:
    return subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_example_profile_names_suite_vllm_and_the_built_in_connector() -> None:
    prov = P.provenance(load("example"))
    suite, vllm, conn = prov["suite"], prov["vllm"], prov["connector"]
    assert suite["version"] == md.version(P.SUITE_DISTRIBUTION)
    import tvc

    assert suite["location"] == str(Path(tvc.__file__).resolve().parent)
    assert suite["commit"] == _head(REPO_ROOT), suite  # the checkout imported
    assert vllm["version"] == md.version("vllm")
    spec = importlib.util.find_spec("vllm")
    text = (Path(spec.origin).parent / "_version.py").read_text()
    assert f"__commit_id__ = commit_id = '{vllm['commit']}'" in text, vllm
    assert vllm["source"] == "vllm/_version.py __commit_id__"
    # ExampleConnector is vLLM's own: its package is vLLM
    assert conn == [{"module": "vllm (built in)", "built_in": True, **vllm}]
    assert P.one_line(conn[0]).startswith("built into vllm ")
    assert P.one_line(vllm).startswith(f"vllm {md.version('vllm')}, commit ")


def test_a_vcs_install_gives_its_commit_and_a_checkout_its_head(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    make_fake_distribution(site, "tvcfakeprov", "2.0.1", {
        "tvcfakeprov/__init__.py": "", "tvcfakeprov/connector.py": ""},
        direct_url={"url": URL, "vcs_info": {"vcs": "git", "commit_id": COMMIT}})
    tree = make_git_tree(tmp_path / "src", {"tvcfakeedit/__init__.py": ""})
    make_fake_distribution(site, "tvcfakeedit", "0.0.1", {},
                           direct_url={"url": tree.as_uri(),
                                       "dir_info": {"editable": True}})
    (tree / "tvcfakeedit" / "__init__.py").write_text("x = 1\n")  # a local edit
    checkout = make_git_tree(tmp_path / "co", {"tvcfakeco/__init__.py": ""})
    monkeypatch.syspath_prepend(str(checkout))
    monkeypatch.syspath_prepend(str(site))
    (tmp_path / "p.toml").write_text(
        '[profile]\nname = "x"\n[connector]\nname = "C"\n'
        'module_path = "tvcfakeprov.connector"\n'
        '[imports]\nmodules = ["tvcfakeprov", "tvcfakeedit", "tvcfakeco"]\n')
    conn = P.provenance(load(str(tmp_path / "p.toml"), env={}))["connector"]
    assert conn[0] == {"module": "tvcfakeprov.connector",
                       "distribution": "tvcfakeprov", "version": "2.0.1",
                       "commit": COMMIT, "url": URL,
                       "source": "direct_url.json vcs_info"}  # deduplicated
    assert [e["module"] for e in conn] == ["tvcfakeprov.connector", "tvcfakeedit",
                                           "tvcfakeco"]
    edit = conn[1]
    assert edit["commit"] == _head(tree) and edit["dirty"] is True, edit
    assert edit["source"] == f"git checkout {tree}"
    assert "(uncommitted changes)" in P.one_line(edit)
    co = conn[2]
    assert co["commit"] == _head(checkout) and co["dirty"] is False, co
    assert "distribution" not in co and co["location"] == str(checkout / "tvcfakeco")
    assert P.one_line(conn[0]) == (f"tvcfakeprov 2.0.1, commit {COMMIT[:12]} "
                                   "(direct_url.json vcs_info)")


def test_a_package_of_unknown_source_says_so(tmp_path: Path) -> None:
    assert P.git_head(tmp_path) == {}
    # `pip install <checkout>` (not editable) copied the code at install time:
    # the checkout's HEAD now may be later, so no commit is claimed
    tree = make_git_tree(tmp_path / "src", {"tvcfakecopy/__init__.py": ""})
    site = tmp_path / "site"
    make_fake_distribution(site, "tvcfakecopy", "1.0", {
        "tvcfakecopy/__init__.py": ""}, direct_url={"url": tree.as_uri(),
                                                    "dir_info": {}})
    dist = md.PathDistribution(next(site.glob("tvcfakecopy-*.dist-info")))
    copy = P.distribution_source(dist)
    assert "commit" not in copy, copy
    assert P.one_line(copy) == (
        f"tvcfakecopy 1.0, source commit unknown (installed (not editable) from "
        f"{tree}: the commit it was installed at is not recorded)")
    assert P.one_line({"distribution": "x", "version": "1"}) == (
        "x 1, source commit unknown")


def test_summary_json_and_page_record_the_provenance(tmp_path: Path) -> None:
    args = write_tests(tmp_path / "t", {"test_one.py": """
        import pytest

        pytestmark = [pytest.mark.level1, pytest.mark.hw_any]

        def test_one():
            pass
        """})
    run = run_suite([*args, "--tvc-profile=example", "-p", "no:xdist"],
                    tmp_path / "r")
    assert run.rc == 0, run.tail()
    prov = run.summary["provenance"]
    assert prov["suite"]["commit"] == _head(REPO_ROOT), prov
    assert prov["vllm"]["version"] == md.version("vllm") and prov["vllm"]["commit"]
    page = (tmp_path / "r" / "summary.md").read_text()
    assert f"vllm {md.version('vllm')}, commit {prov['vllm']['commit']}" in page
    assert "**connector package**: built into vllm" in page, page[:3000]
    assert "**suite**: tutti-vllm-conformance" in page, page[:3000]
