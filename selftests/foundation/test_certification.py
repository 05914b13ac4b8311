"""A certification and ``tvc verify`` (tvc.report.certification, tvc.cli).

A small suite of two tiers (written to a temp folder, run through the real plugin
by ``tvc certify --root``): three tests that pass, one that skips as not
applicable, one two-GPU test outside the certification of a profile that claims
no TP 2. A full run is certified and accepted; a doctored file, a run with a test
deselected, and results with a required test skipped for missing hardware,
missing or xfailed without a listed defect are refused, each for its reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from selftests.conftest import REPO_ROOT, SUITE_ENV_VARS
from tvc import cli
from tvc.config.profile import load
from tvc.report import certification as cert

pytestmark = pytest.mark.hw_any

TESTS = {
    "level1/test_a.py": """
        import pytest

        pytestmark = [pytest.mark.level1, pytest.mark.hw_any]

        def test_one():
            pass

        def test_two():
            pass
        """,
    "contract/test_b.py": """
        import pytest

        pytestmark = pytest.mark.contract

        @pytest.mark.hw_any
        def test_three():
            pass

        @pytest.mark.hw_gpu2
        def test_tensor_parallel():
            pass

        @pytest.mark.hw_any
        def test_stats():
            pytest.skip("the connector reports no stats: nothing to check")
        """}
IN_SET = ["suites/contract/test_b.py::test_stats",
          "suites/contract/test_b.py::test_three",
          "suites/level1/test_a.py::test_one", "suites/level1/test_a.py::test_two"]


def tvc(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in SUITE_ENV_VARS}
    env.update(CERTIFY_HW_CHECK="0", CERTIFY_WORKERS="0", PYTHONPATH=os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run([sys.executable, "-m", "tvc.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The small suite, its profile, a full certify run and a ``-k`` one."""
    import textwrap

    top = tmp_path_factory.mktemp("cert")
    root = top / "root"
    for name, src in TESTS.items():
        (root / "suites" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "suites" / name).write_text(textwrap.dedent(src))
    prof = top / "p.toml"
    prof.write_text('[profile]\nname = "small"\nextends = "example"\n'
                    f'[scratch]\ndir = "{top / "scratch"}"\n')
    runs: dict[str, object] = {}
    for name, extra in (("full", []), ("selection", ["-k", "not test_two"])):
        here = top / name  # installed-style root: the run folder goes to ./reports
        here.mkdir()
        runs[f"{name}-out"] = tvc("certify", "--root", str(root), str(prof),
                                  *extra, cwd=here)
        runs[name] = next(iter((here / "reports").glob("*-certify-small")), None)
    return {"top": top, "root": root, "profile": prof, **runs,
            "collected": cli.certification_set(root, str(prof))}


def test_a_full_run_is_certified_and_accepted(world) -> None:
    proc, run = world["full-out"], world["full"]
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0 and "small CERTIFIED" in last, proc.stdout[-3000:]
    doc = json.loads((run / cert.FILE).read_text())
    assert doc["certified"] and doc["problems"] == []
    assert [r["nodeid"] for r in doc["results"]] == IN_SET  # two-GPU test outside
    assert doc["counts"] == {"ok": 3, "n/a": 1, "refused": 0}
    stats = next(r for r in doc["results"] if r["nodeid"].endswith("test_stats"))
    assert stats["note"] == ("not applicable: the connector reports no stats: "
                             "nothing to check")
    assert doc["hardware"]["levels"] == ["gpu"] and doc["suite"]["tests_digest"]
    ok = tvc("verify", "--root", str(world["root"]), str(run), cwd=world["top"])
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.startswith("ACCEPTED: small (ExampleConnector), hardware gpu, "
                                "4 test(s) in the set: 3 passed or known defects, "
                                "1 not applicable"), ok.stdout


def test_a_doctored_file_is_refused(world, tmp_path) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(world["full"], run)
    path = run / cert.FILE
    good = json.loads(path.read_text())
    # 1. an edited result: the digest no longer matches
    bad = json.loads(path.read_text())
    bad["results"][0]["outcome"] = bad["results"][0]["status"] = "failed"
    path.write_text(json.dumps(bad))
    out = tvc("verify", "--root", str(world["root"]), str(run), cwd=world["top"])
    assert out.returncode == 1 and cert.DOCTORED in out.stdout, out.stdout
    # 2. a test taken out of the set and the digest made again: the set is
    #    collected again, and summary.json still judges every test
    bad = json.loads(json.dumps(good))
    bad["results"] = bad["results"][1:]
    bad["set"]["size"] = 3
    bad["set"]["sha256"] = cert.sha256("\n".join(IN_SET[1:]).encode())
    bad.pop("digest")
    bad["digest"] = cert.sha256(cert.canonical(bad))
    path.write_text(json.dumps(bad))
    out = tvc("verify", "--root", str(world["root"]), str(run), cwd=world["top"])
    assert out.returncode == 1, out.stdout
    assert ("the certification set collected again has 4 test(s), the file 3; not "
            f"in it: {IN_SET[0]}") in out.stdout, out.stdout
    # 3. a summary.json edited beside a valid file
    path.write_text(json.dumps(good))
    summary = json.loads((run / "summary.json").read_text())
    summary["run"]["host"] = "elsewhere"
    (run / "summary.json").write_text(json.dumps(summary))
    problems = _check(world, good, summary, run)
    assert problems == ["summary.json is not the one it was made from (digest "
                        "differs)"], problems


def _check(world, doc, summary, run: Path) -> list[str]:
    return cert.check(doc, summary, (run / "summary.json").read_bytes(),
                      world["collected"],
                      cli.suite_info(world["root"]), load(str(world["profile"])),
                      (run / "junit.xml").read_bytes())


def test_a_deselected_required_test_is_refused(world) -> None:
    proc, run = world["selection-out"], world["selection"]
    last = proc.stdout.strip().splitlines()[-1]
    assert "PASSED a selection" in last and "not certified" in last, last
    doc = json.loads((run / cert.FILE).read_text())
    assert doc["problems"] == ["suites/level1/test_a.py::test_two: deselected (-k "
                               "'not test_two')"], doc["problems"]
    out = tvc("verify", "--root", str(world["root"]), str(run), cwd=world["top"])
    assert out.returncode == 1 and "test_two: deselected (-k 'not test_two')" in \
        out.stdout, out.stdout


@pytest.mark.parametrize(("change", "reason"), [
    ({"outcome": "skipped", "missing_hardware": "gpu",
      "message": "no CUDA GPU: nvidia-smi not found"},
     "skipped: missing hardware (gpu): no CUDA GPU: nvidia-smi not found"),
    (None, "missing from the run's results"),
    ({"outcome": "xfailed", "message": "known upstream defect: ..."},
     "xfailed, but the profile lists no known defect for it"),
    ({"outcome": "failed", "message": "AssertionError: matched 16"},
     "failed: AssertionError: matched 16"),
], ids=["skipped-for-hardware", "missing", "unlisted-xfail", "failed"])
def test_a_required_test_that_did_not_pass_is_refused(world, tmp_path, change,
                                                       reason) -> None:
    """Results of a run where test_one did not pass, written consistently (the
    summary and the file agree, digests made again): still refused, for that."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(world["full"], run)
    summary = json.loads((run / "summary.json").read_text())
    nodeid = "suites/level1/test_a.py::test_one"
    tests = [t for t in summary["tests"] if t["nodeid"] != nodeid]
    if change is not None:
        tests.append({**next(t for t in summary["tests"] if t["nodeid"] == nodeid),
                      **change})
    summary["tests"] = tests
    data = json.dumps(summary).encode()
    (run / "summary.json").write_bytes(data)
    collected, prof = world["collected"], load(str(world["profile"]))
    doc = cert.build(summary, data, collected, ["gpu"], cli.suite_info(world["root"]),
                     prof)
    assert not doc["certified"] and doc["problems"] == [f"{nodeid}: {reason}"]
    assert cert.check(doc, summary, data, collected, cli.suite_info(world["root"]),
                      prof) == [f"{nodeid}: {reason}"]


def test_junit_keys_match_pytests_writer() -> None:
    assert cert.junit_key("suites/e2e/test_x.py::test_y[a-b::c]") == (
        "suites.e2e.test_x::test_y[a-b::c]")
    assert cert.junit_key("s/t.py::C::test") == "s.t.C::test"


@pytest.mark.parametrize(("need", "levels", "status"), [
    ("gpu2", ["gpu"], "n/a"),  # a gloo variant on a one-GPU CUDA host
    ("gpu2", ["gpu", "gpu2"], "refused"),  # the profile claims two GPUs
    ("gpu", ["gpu"], "refused"),
    ("nvme", ["gpu"], "n/a"),
    ("nvme", ["gpu", "nvme"], "refused"),
])
def test_a_skip_for_hardware_outside_the_levels_is_not_required(
        need: str, levels: list[str], status: str) -> None:
    """A ``hw_any`` test that skips for a level the certification does not claim
    is outside it, as the tests marked with that level are; one the
    certification claims is refused."""
    entry = {"outcome": "skipped", "missing_hardware": need,
             "message": f"missing hardware ({need}): this host has 1 CUDA device(s)"}
    got, note = cert.judge(entry, "", "", levels)
    assert got == status, note
    if status == "n/a":
        assert note.startswith(f"needs {need}, a level this certification does "
                               "not claim"), note
