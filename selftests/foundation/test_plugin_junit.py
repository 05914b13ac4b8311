"""The plugin's JUnit files carry the run's outcome; ``--junitxml`` and the run
folder's ``junit.xml`` are both written; real run folders merge (pytester).

Each case runs the plugin in a pytester subprocess on small synthetic test files
with the repo as rootdir (so the plugin treats the run as the suite's).
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from selftests.conftest import REPO_ROOT, SUITE_ENV_VARS
from tvc.plugin.report import OUTCOME_CASE

pytestmark = pytest.mark.hw_any

TESTS = """
import pytest

pytestmark = [pytest.mark.level1, pytest.mark.hw_any]

def test_ok():
    assert 1 + 1 == 2

@pytest.mark.parametrize("n", [16, 48, 80])
def test_matched(n):
    assert n == 0, f"matched {n} tokens of /tmp/store-{n}/k.bin, expected 0"

def test_skipped():
    pytest.skip("no NVMe device under /dev/nvme*")
"""

GREEN = """
import pytest

pytestmark = [pytest.mark.level1, pytest.mark.hw_any]

def test_ok():
    assert 2 * 2 == 4
"""


@pytest.fixture(autouse=True)
def _this_checkout(monkeypatch) -> None:
    """The child imports this checkout's tvc (an absolute path first on
    PYTHONPATH; pytester runs it from its own folder), with no suite variables."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    for var in SUITE_ENV_VARS:
        monkeypatch.delenv(var, raising=False)


def run(pytester: pytest.Pytester, source: str, report: Path, *args: str
        ) -> pytest.RunResult:
    test = pytester.makepyfile(test_synthetic=source)
    return pytester.runpytest_subprocess(
        f"--rootdir={REPO_ROOT}", "-c", str(REPO_ROOT / "pyproject.toml"),
        "-p", "no:cacheprovider", "-p", "no:xdist", "--tvc-profile=example",
        f"--tvc-report-dir={report}", str(test), *args, timeout=300)


def suite_of(path: Path) -> ET.Element:
    root = ET.parse(path).getroot()
    return root if root.tag == "testsuite" else root.find("testsuite")


def outcome_cases(suite: ET.Element) -> list[ET.Element]:
    return [c for c in suite.iter("testcase") if c.get("name") == OUTCOME_CASE]


def test_user_junitxml_and_the_run_folders_are_both_written(pytester) -> None:
    report = pytester.path / "run"
    user = pytester.path / "ci" / "user-junit.xml"
    result = run(pytester, TESTS, report, f"--junitxml={user}")
    assert result.ret == 1, result.stdout.str()[-3000:]
    own = report / "junit.xml"
    assert user.is_file(), "the user's --junitxml was not written"
    assert own.is_file(), "the run folder's junit.xml was not written"
    assert user.read_bytes() == own.read_bytes()
    suite = suite_of(own)
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["tvc.run.outcome"] == "failed" and props["profile.name"] == "example"
    # failed because tests failed: the cases show it; no extra case, same counts
    assert outcome_cases(suite) == [] and suite.get("failures") == "3"
    names = {c.get("name") for c in suite.iter("testcase")}
    assert {"test_ok", "test_matched[16]", "test_skipped"} <= names
    # the page: what failed first, the three failures one cause, the skip grouped
    md = (report / "summary.md").read_text()
    assert md.index("## What failed: 3 test(s), 1 cause(s)") < md.index("## Tiers")
    assert md.count("matched 16 tokens") == 1 and "matched 48 tokens" not in md
    assert ("`test_matched[16]`, `test_matched[48]` and `test_matched[80]` "
            "(3 tests)") in md
    assert "`test_skipped`: no NVMe device" in md and "## Passed (1)" in md


def test_a_green_run_stays_green_in_junit(pytester) -> None:
    report = pytester.path / "run"
    result = run(pytester, GREEN, report)
    assert result.ret == 0, result.stdout.str()[-3000:]
    suite = suite_of(report / "junit.xml")
    assert outcome_cases(suite) == [] and suite.get("failures") == "0"
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["tvc.run.outcome"] == "passed"
    summary = json.loads((report / "summary.json").read_text())
    assert summary["run"]["host"] and summary["run"]["outcome_reason"] == ""


def test_a_run_that_ran_no_test_is_red_in_junit(pytester) -> None:
    """``-k`` that matches nothing: pytest's junit.xml has no failing case."""
    report = pytester.path / "run"
    result = run(pytester, GREEN, report, "-k", "no_such_test")
    assert result.ret == 5, result.stdout.str()[-3000:]
    (case,) = outcome_cases(suite_of(report / "junit.xml"))
    assert "no test ran" in case.find("failure").get("message")


def test_real_run_folders_merge_into_one_junit(pytester, capsys) -> None:
    from tvc import cli

    red, green = pytester.path / "red", pytester.path / "green"
    assert run(pytester, TESTS, red).ret == 1
    assert run(pytester, GREEN, green).ret == 0
    out = pytester.path / "fleet"
    assert cli.main(["merge", str(red), str(green), "--out", str(out)]) == 1
    assert "FAIL: 1 of 2 run(s) did not pass" in capsys.readouterr().out
    root = ET.parse(out / "junit.xml").getroot()
    suites = root.findall("testsuite")
    assert [s.get("name").rsplit("/", 1)[-1] for s in suites] == ["red", "green"]
    red_suite, green_suite = suites
    assert outcome_cases(red_suite) == []  # its 3 failed tests show the outcome
    assert green_suite.get("failures") == "0"
    assert int(red_suite.get("failures")) == 3
    assert int(root.get("tests")) == 5 + 1 and int(root.get("failures")) == 3


def test_junit_of_a_stopped_run_lists_every_test_of_the_summary(tmp_path: Path
                                                                 ) -> None:
    """Fresh-user finding: after Ctrl-C, tests that never ran and that this box
    would skip ([cuda] variants on a CPU box, labelled skipped in summary.json) were
    missing from junit.xml. Every summary test is a case; pytest's nameless case of
    the cut-off test goes; the counts follow; a second stamp changes nothing."""
    from tvc.plugin.report import stamp_junit

    path = tmp_path / "junit.xml"
    path.write_text(
        '<testsuites><testsuite name="pytest" tests="1" failures="0" errors="0" '
        'skipped="0"><testcase classname="suites.contract.test_a" name="test_x[cpu]"'
        ' time="1.0" /><testcase time="0.3" /></testsuite></testsuites>')
    summary = {"run": {"outcome": "interrupted", "exit_status": 2},
               "counts": {"passed": 1, "skipped": 1, "not_run": 1}, "tests": [
                   {"nodeid": "suites/contract/test_a.py::test_x[cpu]",
                    "outcome": "passed", "message": ""},
                   {"nodeid": "suites/contract/test_a.py::test_x[cuda]",
                    "outcome": "skipped", "message": "never ran (the run stopped "
                    "first); this box would skip it: no CUDA GPU"},
                   {"nodeid": "suites/contract/test_a.py::test_y[cpu]",
                    "outcome": "not_run", "message": ""}]}
    for _ in range(2):
        stamp_junit(path, summary)
        suite = ET.parse(path).getroot().find("testsuite")
        cases = {c.get("name"): c for c in suite.iter("testcase")}
        assert sorted(cases) == sorted([OUTCOME_CASE, "test_x[cpu]", "test_x[cuda]",
                                        "test_y[cpu]"]), sorted(cases)
        assert "would skip" in cases["test_x[cuda]"].find("skipped").get("message")
        assert cases["test_y[cpu]"].find("skipped").get("type") == "tvc.not_run"
        assert (suite.get("tests"), suite.get("skipped"), suite.get("failures")
                ) == ("4", "2", "1"), suite.attrib
