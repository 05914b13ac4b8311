"""What a run says while and when it ends: reds as they happen, its scope, why it
stopped (``tvc.report.live``, ``tvc.report.scope``, ``tvc.report.outcome``).

Each case runs a few synthetic tests through the plugin with ``pytester`` in a
subprocess, on a box made GPU-less by a failing ``nvidia-smi`` first on ``PATH``
(so the same answer on a GPU host), and reads what a user reads: the console,
``failures.md``, ``summary.json`` and ``summary.md``.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from selftests.conftest import REPO_ROOT, SUITE_ENV_VARS

pytestmark = pytest.mark.hw_any

needs_xdist = pytest.mark.skipif(importlib.util.find_spec("xdist") is None,
                                 reason="pytest-xdist is not installed: pip install "
                                        "pytest-xdist")

# a contract-tier file: two worker variants each, [cpu] on any box, [cuda] on a GPU
VARIANTS = """
import pytest

pytestmark = pytest.mark.contract
DEVICES = [pytest.param("cpu", marks=pytest.mark.hw_any, id="cpu"),
           pytest.param("cuda", marks=pytest.mark.hw_gpu, id="cuda")]

@pytest.mark.parametrize("device", DEVICES)
def test_round_trip(device):
    pass

@pytest.mark.parametrize("device", DEVICES)
def test_zz_after(device):
    pass
"""


@pytest.fixture
def run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    """``run(*args) -> (result, summary, run folder)`` on a box with no GPU.

    Give the test files: without a path, a suite run outside the checkout
    collects the suite's own tests.
    """
    bin_dir = pytester.path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'no devices were found' >&2\nexit 6\n")
    smi.chmod(0o755)
    for var in SUITE_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    prof = pytester.path / "p.toml"
    prof.write_text('[profile]\nname = "live"\nextends = "example"\n'
                    f'[scratch]\ndir = "{pytester.path / "scratch"}"\n')
    count = iter(range(100))

    def go(*args: str):
        out = pytester.path / f"r{next(count)}"
        res = pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", f"--tvc-profile={prof}",
            f"--tvc-report-dir={out}", *args, timeout=300)
        summary = json.loads((out / "summary.json").read_text())
        return res, summary, out

    return go


def _outcomes(summary: dict) -> dict[str, str]:
    return {t["nodeid"].split("::")[-1]: t["outcome"] for t in summary["tests"]}


@needs_xdist
def test_a_red_is_said_and_written_while_the_run_goes_on(pytester, run) -> None:
    """Under xdist: the controller prints the red (node id, one-line cause) and
    failures.md holds it while another test is still running (it waits for it)."""
    pytester.makepyfile(test_live="""
        import time
        from pathlib import Path

        import pytest

        pytestmark = [pytest.mark.contract, pytest.mark.hw_any]

        def test_red():
            assert 16 == 0, "matched 16 tokens of a 17-token prompt, expected 0"

        def test_sees_the_red(tvc_run_dir):
            page = Path(tvc_run_dir) / "failures.md"
            deadline = time.monotonic() + 120
            while "test_red" not in (page.read_text() if page.exists() else ""):
                assert time.monotonic() < deadline, "failures.md never named it"
                time.sleep(0.2)
            assert "live: the run is going on" in page.read_text()
        """)
    res, summary, out = run("-n", "2", "-v", "test_live.py")
    assert _outcomes(summary) == {"test_red": "failed", "test_sees_the_red": "passed"}
    lines = res.outlines
    red = ("tvc: RED 1: test_live.py::test_red (failed): AssertionError: matched 16 "
           "tokens of a 17-token prompt, expected 0")
    at = next(i for i, ln in enumerate(lines) if ln.startswith(red))
    seen = next(i for i, ln in enumerate(lines)
                if "PASSED" in ln and "test_sees_the_red" in ln)
    assert at < seen, lines  # said before the test that waited for it finished
    page = (out / "failures.md").read_text()
    assert page.startswith("# Reds of profile live — the run ended: FAIL"), page
    assert "1. `test_live.py::test_red` (failed" in page, page
    assert "pytest test_live.py::test_red --tvc-profile=" in page, page  # rerun


def test_a_cpu_pass_states_its_scope(pytester, run) -> None:
    """A green run whose [cuda] variants were skipped for want of a GPU is a PASS
    of the CPU scope, in the console, summary.json, summary.md and summary.html."""
    pytester.makepyfile(test_variants=VARIANTS)
    res, summary, out = run("test_variants.py")
    line = ("CPU scope, contract only: 2 [cuda] variants not run; certify on a GPU "
            "host")
    assert summary["scope"]["line"] == line, summary["scope"]
    assert summary["scope"]["not_run"] == [{"level": "gpu", "count": 2, "by_tier": {
        "contract": 2}, "where": "a GPU host", "claimed": True}]
    assert summary["run"]["verdict"] == f"PASS ({line})"
    res.stdout.fnmatch_lines([f"tvc: PASS ({line}): 2 passed, 2 skipped"])
    md = (out / "summary.md").read_text()
    assert md.startswith(f"# Conformance run: PASS ({line})"), md[:200]
    assert f"<b>PASS ({line})</b>" in (out / "summary.html").read_text()
    skipped = [t for t in summary["tests"] if t["outcome"] == "skipped"]
    assert {t["missing_hardware"] for t in skipped} == {"gpu"}, skipped


@pytest.mark.parametrize(("body", "args", "kind", "reason"), [
    ("assert 0, 'red'", ["-x"], "maxfail", "stopped after 1 failure (--maxfail=1 "
     "or -x)"),
    ("raise KeyboardInterrupt", [], "ctrl_c", "interrupted by Ctrl-C"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGTERM); import time; "
     "time.sleep(30)", [], "signal", "terminated by SIGTERM"),
    ("import time; time.sleep(2)", ["--session-timeout=1"], "timeout",
     "stopped by the session timeout (--session-timeout=1.0 s, pytest-timeout)"),
    ("import pytest; pytest.exit('the lab watchdog fired')", [], "exit",
     "stopped by pytest.exit(): the lab watchdog fired"),
], ids=["maxfail", "ctrl-c", "sigterm", "session-timeout", "pytest-exit"])
def test_each_stop_reason_is_named(pytester, run, body, args, kind, reason) -> None:
    """Why a run stopped, in plain words (never "Ctrl-C" for a --maxfail stop);
    its [cuda] variants that never ran are skips this box would make, not reds."""
    pytester.makepyfile(test_a_first=f"""
        import pytest

        pytestmark = [pytest.mark.contract, pytest.mark.hw_any]

        def test_stops():
            {body}
        """, test_variants=VARIANTS)
    res, summary, out = run(*args, "test_a_first.py", "test_variants.py")
    assert summary["run"]["stop"] == {"kind": kind, "reason": reason}, summary["run"]
    assert summary["run"]["outcome_reason"].startswith(reason), summary["run"]
    assert "Ctrl-C" not in summary["run"]["outcome_reason"] or kind == "ctrl_c"
    o = _outcomes(summary)
    assert o["test_round_trip[cpu]"] == "not_run", o  # would have run: never ran
    cuda = next(t for t in summary["tests"] if t["nodeid"].endswith(
        "test_round_trip[cuda]"))
    assert cuda["outcome"] == "skipped" and cuda["missing_hardware"] == "gpu", cuda
    assert cuda["message"].startswith("never ran (the run stopped first); this box "
                                      "would skip it: no CUDA GPU"), cuda
    res.stdout.fnmatch_lines([f"tvc: * {reason}*"])
    md = (out / "summary.md").read_text()
    never = md[md.index("## Never ran"):md.index("## Tiers")]
    assert "test_round_trip[cpu]" in never and "[cuda]" not in never, never
    if kind == "maxfail":
        assert md.startswith("# Conformance run: FAIL"), md[:100]


def test_a_collection_error_is_named_never_ctrl_c(pytester, run) -> None:
    """pytest stops on a collection error with its ``Interrupted`` (a
    KeyboardInterrupt): the run says so, not "interrupted by Ctrl-C"."""
    pytester.makepyfile(test_ok="""
        import pytest

        pytestmark = [pytest.mark.contract, pytest.mark.hw_any]

        def test_fine():
            pass
        """, test_broken="def test_x(:\n    pass\n")
    res, summary, _ = run("test_ok.py", "test_broken.py")
    stop = summary["run"]["stop"]
    assert stop["kind"] == "collection", stop
    assert stop["reason"].startswith("stopped: 1 error during collection"), stop
    assert "Ctrl-C" not in summary["run"]["outcome_reason"], summary["run"]
    res.stdout.fnmatch_lines(["tvc: * stopped: 1 error during collection*"])


@needs_xdist
@pytest.mark.parametrize(("body", "args", "kind", "reason"), [
    ("assert 0, 'red'", ["--maxfail=1"], "maxfail",
     "stopped after 1 failure (--maxfail=1 or -x)"),
    ("import os; os._exit(9)", ["--max-worker-restart=0"], "watchdog",
     "stopped after 1 xdist worker(s) died"),
], ids=["maxfail", "dead-worker"])
def test_stop_reasons_under_xdist(pytester, run, body, args, kind, reason) -> None:
    """Under xdist a --maxfail stop reaches pytest as an interrupt: named as the
    stop it is; a worker killed under a test leaves the rest unrun: named so."""
    pytester.makepyfile(test_a_first=f"""
        import pytest

        pytestmark = [pytest.mark.contract, pytest.mark.hw_any]

        def test_stops():
            {body}
        """, test_variants=VARIANTS.replace("pass", "import time; time.sleep(3)"))
    res, summary, _ = run("-n", "1", *args, "test_a_first.py", "test_variants.py")
    assert summary["run"]["stop"]["kind"] == kind, summary["run"]
    assert summary["run"]["stop"]["reason"].startswith(reason), summary["run"]
    assert "Ctrl-C" not in summary["run"]["outcome_reason"], summary["run"]
    cuda = [t for t in summary["tests"] if "[cuda]" in t["nodeid"]]
    assert cuda and all(t["outcome"] == "skipped" for t in cuda), cuda
    res.stdout.fnmatch_lines([f"tvc: * {reason}*"])


def test_a_long_never_ran_list_is_printed_once(tmp_path: Path) -> None:
    """173 tests that never ran: six named in the entry, the rest once, folded by
    test (not all 173 again on one line)."""
    from tvc.plugin.summary_page import write_page

    ids = [f"suites/contract/test_s.py::test_{k}[cpu-{i}]" for k in "ab"
           for i in range(86)] + ["suites/contract/test_s.py::test_c"]
    tests = [{"nodeid": n, "outcome": "not_run", "tiers": ["contract"],
              "message": "", "properties": {}, "duration_s": 0} for n in ids]
    s = {"run": {"outcome": "interrupted", "exit_status": 2,
                 "stop": {"kind": "ctrl_c", "reason": "interrupted by Ctrl-C"}},
         "counts": {"not_run": len(ids)}, "tests": tests, "findings": []}
    (tmp_path / "summary.json").write_text(json.dumps(s))
    md = write_page(tmp_path)["markdown"].read_text()
    section = md[md.index("## Never ran (173)"):md.index("## Tiers")]
    assert section.count("test_a[cpu-0]") == 1 and section.count("test_c") == 1
    assert "`test_a[cpu-6, cpu-7," in section and "`test_b[cpu-0, " in section
    assert "every test" not in section


def test_failures_page_is_readable_like_the_other_pages(tmp_path: Path) -> None:
    """``failures.md`` is written through a temporary file (mkstemp: mode 0600);
    it gets the mode the umask gives ``summary.md``, not a private one."""
    from tvc.report.live import LiveReds

    old = os.umask(0o022)
    try:
        live = LiveReds(tmp_path, "profile example")
        live.add("suites/contract/test_s.py::test_a", "failed", "boom")
        (tmp_path / "summary.md").write_text("x")
    finally:
        os.umask(old)
    page = tmp_path / "failures.md"
    assert "boom" in page.read_text()
    assert page.stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "summary.md").stat().st_mode & 0o777 == 0o644


def test_failures_page_keeps_the_whole_cause_with_its_fix(tmp_path: Path) -> None:
    """A fresh user found a fix cut off at about 400 characters on the page:
    ``failures.md`` now keeps the message's whole first line (the console line
    stays short)."""
    from tvc.report.live import LiveReds

    msg = ("store fault 'corrupt': " + "the connector loaded a damaged entry " * 12
           + "Fix: verify each file of an entry before loading it (end of fix)")
    assert len(msg) > 500
    line = LiveReds(tmp_path, "profile example").add("a::t", "failed", msg)
    assert len(line) < 300 and line.endswith("…"), line
    assert "(end of fix)" in (tmp_path / "failures.md").read_text()


def test_cpu_rigs_without_a_worker_here_are_not_called_cuda_variants() -> None:
    """A CUDA-only worker's ``[cpu]`` rigs skip for want of a GPU too; the scope line
    counts them as GPU tests, only ids with a ``cuda`` parameter as [cuda] variants."""
    from tvc.report.scope import scope

    def skipped(nodeid: str) -> dict[str, object]:
        return {"nodeid": nodeid, "outcome": "skipped", "tiers": ["contract"],
                "hardware": "any", "missing_hardware": "gpu"}

    tests = [skipped("suites/contract/test_a.py::test_x[cuda]"),
             skipped("suites/contract/test_a.py::test_y[cuda-prompt_logprobs]"),
             skipped("suites/contract/test_a.py::test_x[cpu]"),
             skipped("suites/contract/test_a.py::test_y[cpu-prompt_logprobs]"),
             skipped("suites/contract/test_a.py::test_z[cpu-cudagraph]"),
             {"nodeid": "suites/contract/test_b.py::test_config", "outcome": "passed",
              "tiers": ["contract"], "hardware": "any"}]
    got = scope({"tests": tests, "hardware": {"levels": {"gpu": False}}},
                order=("contract",))
    assert got["line"] == ("CPU scope: 2 [cuda] variants and 3 other GPU tests "
                           "(contract 3) not run; certify on a GPU host"), got
