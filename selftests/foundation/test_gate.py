"""Self-tests: the GPU gate's table (tvc/report/gate.py) from run folders.

The rows come from what ``tvc certify`` printed and wrote (``summary.json``,
``timeline.json``); a reference profile passes the gate only when certified, a
real target also when every red is a catalogued finding or the host cannot run
it. The last test certifies for real on this GPU-less box: certify refuses
before any test, and the gate says so and fails (a reference profile).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tvc.report import gate

pytestmark = pytest.mark.hw_any


def _run_folder(tmp_path: Path, counts: dict[str, int], findings: list[dict],
                critical: list[str]) -> Path:
    d = tmp_path / "20261204-120000-certify-x"
    d.mkdir()
    (d / "summary.json").write_text(json.dumps({"counts": counts,
                                                "findings": findings}))
    (d / "timeline.json").write_text(json.dumps({"critical_path": critical}))
    return d


def _output(d: Path, profile: str, verdict: str, rc: int) -> str:
    return (f"certify: profile {profile} ({profile}), strict: gpu, tiers: level1\n"
            f"certify: run folder {d}\n"
            f"certify: {profile} {verdict} in 0h02m21s (141 s); rc={rc}; report "
            f"{d}/summary.html\n")


def test_a_certified_reference_profile_passes(tmp_path) -> None:
    d = _run_folder(tmp_path, {"passed": 151, "skipped": 52, "xfailed": 38},
                    [{"key": "test", "outcome": "xfailed", "tests": ["t"]}],
                    ["the run took 141.0 s", "the busiest lane was gw2: 8 tests"])
    verdict = "CERTIFIED with 1 known defect(s) the profile accepts"
    row = gate.row_from_run("example", 0, 141.2, _output(d, "example", verdict, 0))
    assert row.verdict == verdict and row.passes
    assert row.counts == {"passed": 151, "skipped": 52, "xfailed": 38}
    text = gate.table([row])
    assert ("| example | CERTIFIED with 1 known defect(s) the profile accepts | "
            "151 passed, 52 skipped, 38 xfailed | 141 s | the run took 141.0 s; "
            "the busiest lane was gw2: 8 tests |") in text
    assert text.endswith("gate: PASS")


def test_a_red_reference_profile_fails_the_gate(tmp_path) -> None:
    node = "suites/contract/test_tp.py::test_pp[TP1-PP2-cpu-gloo]"
    d = _run_folder(tmp_path, {"passed": 162, "failed": 1},
                    [{"key": "test", "outcome": "failed", "tests": [node]}], [])
    row = gate.row_from_run("example", 1, 204, _output(d, "example", "NOT certified",
                                                        1))
    assert not row.passes and row.unnamed == [node]
    text = gate.table([row])
    assert f"- example: reds no finding explains: {node}" in text
    assert text.endswith("gate: FAIL (example)")


def test_a_real_target_red_only_with_catalogued_findings_passes(tmp_path) -> None:
    d = _run_folder(tmp_path, {"passed": 40, "failed": 3},
                    [{"key": "tutti-mm-hash", "outcome": "failed", "tests": ["a"]},
                     {"key": "tutti-cache-salt", "outcome": "failed",
                      "tests": ["b", "c"]}], [])
    row = gate.row_from_run("tutti", 1, 90, _output(d, "tutti", "NOT certified", 1))
    assert row.passes and sorted(row.named) == ["tutti-cache-salt", "tutti-mm-hash"]
    d2 = tmp_path / "two"
    d2.mkdir()
    d2 = _run_folder(d2, {"failed": 2},
                     [{"key": "tutti-mm-hash", "outcome": "failed", "tests": ["a"]},
                      {"key": "test", "outcome": "failed", "tests": ["z"]}], [])
    row2 = gate.row_from_run("tutti", 1, 90, _output(d2, "tutti", "NOT certified", 1))
    assert not row2.passes and row2.unnamed == ["z"]


def test_timeouts_and_refusals_are_rows_too(tmp_path) -> None:
    refused = ("certify: lmcache needs --tvc-require nvme: no store. Fix: x.\n"
               "certify: lmcache NOT certified: not run, this box lacks nvme "
               "(CERTIFY_HW_CHECK=0 runs it anyway; each test that needs it then "
               "fails)\n")
    row = gate.row_from_run("lmcache", 1, 2, refused)
    assert row.verdict == "NOT RUN" and "lacks nvme" in row.note and row.passes
    late = gate.row_from_run("cpu-offload", None, 280, "certify: run folder /nope\n")
    assert late.verdict == "TIMED OUT" and not late.passes


def test_the_gate_certifies_for_real_and_says_what_this_box_lacks(tmp_path) -> None:
    row = gate.certify_one("example", 120, tmp_path)
    if row.verdict != "NOT RUN":  # a GPU box: the gate runs the real thing there
        pytest.skip(f"this box can certify example ({row.verdict})")
    assert "example needs --tvc-require gpu" in row.note
    assert not row.passes  # a reference profile must be certified
    assert (tmp_path / "certify-example.log").is_file()
