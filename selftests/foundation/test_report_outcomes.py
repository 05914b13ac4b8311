"""RunReport outcomes: a test counts as passed only once its body ran and passed."""

from __future__ import annotations

import json
import signal

import pytest

from tvc.plugin import run_control
from tvc.plugin.report import RunReport
from tvc.report.run_folder import check_run_dir


def phase(nodeid: str, when: str, outcome: str) -> pytest.TestReport:
    longrepr = ("f.py", 1, "Skipped: no GPU") if outcome == "skipped" else None
    return pytest.TestReport(nodeid, ("f.py", 1, nodeid), {"level1": 1}, outcome,
                             longrepr, when, user_properties=[("x", 1)])


def test_an_interrupted_test_is_not_run_not_passed(tmp_path) -> None:
    rep = RunReport(tmp_path / "run", {"run": {}})
    rep.pytest_runtest_logreport(phase("t::a", "setup", "passed"))  # then Ctrl-C
    rep.pytest_runtest_logreport(phase("t::b", "setup", "passed"))
    rep.pytest_runtest_logreport(phase("t::b", "call", "passed"))
    rep.pytest_runtest_logreport(phase("t::b", "teardown", "passed"))
    assert rep.counts() == {"passed": 1, "failed": 0, "skipped": 0, "error": 0,
                            "xfailed": 0, "not_run": 1}
    summary = json.loads(rep.write(2).read_text())
    assert summary["run"]["exit_status"] == 2
    assert {t["nodeid"]: t["outcome"] for t in summary["tests"]} == {
        "t::a": "not_run", "t::b": "passed"}


@pytest.mark.parametrize(("stop", "outcome"),
                         [(signal.SIGINT, "not_run"), (None, "error")])
def test_a_worker_stopped_by_ctrl_c_leaves_its_test_not_run(tmp_path, monkeypatch,
                                                            stop, outcome) -> None:
    """xdist reports the test a stopped worker ran as "crashed": when a signal
    stopped the run it is cut short, not a red; a worker that crashed on its own
    stays an error."""
    monkeypatch.setattr(run_control, "_STOPPED_BY", [] if stop is None else [stop])
    rep = RunReport(tmp_path / "run", {"run": {}})
    crash = pytest.TestReport("t::a", ("t", None, "t"), {}, "failed",
                              "worker 'gw1' crashed while running 't::a'", "???")
    rep.pytest_handlecrashitem("t::a", crash, None)
    rep.pytest_runtest_logreport(crash)
    summary = json.loads(rep.write(2 if stop else 1).read_text())
    (t,) = summary["tests"]
    assert t["outcome"] == outcome, t
    assert summary["counts"][outcome] == 1, summary["counts"]
    if outcome == "not_run":
        assert "running when the run was interrupted (SIGINT)" in t["message"], t


def test_a_teardown_error_after_a_pass_is_an_error(tmp_path) -> None:
    rep = RunReport(tmp_path / "run", {"run": {}})
    for when, outcome in (("setup", "passed"), ("call", "passed"),
                          ("teardown", "failed")):
        rep.pytest_runtest_logreport(phase("t::a", when, outcome))
    assert rep.counts()["error"] == 1 and rep.counts()["passed"] == 0


def test_a_skip_in_setup_is_a_skip(tmp_path) -> None:
    rep = RunReport(tmp_path / "run", {"run": {}})
    rep.pytest_runtest_logreport(phase("t::a", "setup", "skipped"))
    rep.pytest_runtest_logreport(phase("t::a", "teardown", "passed"))
    assert rep.counts() == {"passed": 0, "failed": 0, "skipped": 1, "error": 0,
                            "xfailed": 0}


def test_run_dir_checks_name_the_problem(tmp_path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("user data")
    assert "is not a directory" in check_run_dir(afile)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("user data")
    assert "holds no earlier run" in check_run_dir(tmp_path / "mine")
    assert check_run_dir(tmp_path / "new" / "run") == ""
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "summary.json").write_text('{"run": {}, "counts": {}, "tests": []}')
    assert check_run_dir(earlier) == ""
    # A user's own summary.json / junit.xml is not an earlier run of the suite
    # (fresh-user finding: both were overwritten).
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "summary.json").write_text('{"mine": 1}')
    (theirs / "junit.xml").write_text("<testsuites/>")
    assert "holds no earlier run of this suite" in check_run_dir(theirs)
    (theirs / "summary.json").write_text("not json")
    assert "holds no earlier run of this suite" in check_run_dir(theirs)
    assert (theirs / "junit.xml").read_text() == "<testsuites/>"
    assert afile.read_text() == "user data"  # nothing of the user's was touched
