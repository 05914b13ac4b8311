"""``tvc summary`` and ``tvc merge`` (tvc.cli): bad folders are one line, a fleet
of run folders becomes one summary and one JUnit file, inputs are never written.

Run folders are synthetic (``summary.json`` + ``junit.xml`` as the plugin writes
them) except in :mod:`selftests.foundation.test_plugin_junit`, which merges run
folders of real plugin runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from selftests.conftest import REPO_ROOT
from tvc import cli
from tvc.plugin.findings import findings
from tvc.plugin.report import OUTCOME_CASE, junit_classname

pytestmark = pytest.mark.hw_any

IDS = ["suites/level1/test_vllm_install.py::test_vllm_imports",
       "suites/contract/test_scenarios.py::test_cold_prompt_matches_nothing",
       "suites/contract/test_scenarios.py::test_stored_prompt_hits"]


def make_run(root: Path, name: str, host: str, outcomes: list[str],
             run: dict | None = None, messages: dict[int, str] | None = None,
             junit: bool = True, gpus: int = 1) -> Path:
    """A run folder as the plugin writes it: summary.json and junit.xml."""
    d = root / name
    d.mkdir(parents=True)
    messages = messages or {}
    tests = [{"nodeid": nid, "outcome": o, "duration_s": 0.5,
              "tiers": [nid.split("/")[1]], "properties": {},
              "message": messages.get(i, "" if o == "passed" else f"{o} here")}
             for i, (nid, o) in enumerate(zip(IDS, outcomes, strict=True))]
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    bad = counts.get("failed", 0) + counts.get("error", 0)
    prof = {"name": "example", "connector": "ExampleConnector",
            "source": "/p/example.toml"}
    s = {"run": {"host": host, "started_utc": "2026-12-01T10:00:00Z",
                 "outcome": "failed" if bad else "passed",
                 "exit_status": 1 if bad else 0, "seed": 3, **(run or {})},
         "profile": prof, "versions": {"vllm": "0.28.0"},
         "hardware": {"gpus": [{"name": "NVIDIA H200"}] * gpus,
                      "levels": {"any": True, "gpu": bool(gpus), "nvme": False}},
         "counts": counts, "deselected": [], "tests": tests}
    s["findings"] = findings(tests, prof, 3)
    (d / "summary.json").write_text(json.dumps(s, indent=1))
    if junit:
        suite = ET.Element("testsuite", name="tutti-vllm-conformance")
        for t in tests:
            path, _, nm = t["nodeid"].rpartition("::")
            case = ET.SubElement(suite, "testcase", classname=junit_classname(path),
                                 name=nm)
            if t["outcome"] == "failed":
                ET.SubElement(case, "failure", message=t["message"])
            elif t["outcome"] in ("skipped", "not_run"):
                ET.SubElement(case, "skipped", message=t["message"])
        root_el = ET.Element("testsuites")
        root_el.append(suite)
        ET.ElementTree(root_el).write(d / "junit.xml", encoding="utf-8",
                                      xml_declaration=True)
    return d


def snapshot(folders: list[Path]) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for d in folders for p in sorted(d.rglob("*")) if p.is_file()}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tvc.cli", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120, check=False)


def _one_line(proc: subprocess.CompletedProcess, *parts: str) -> None:
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, proc.stdout, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for part in parts:
        assert part in err, (part, err)


# ------------------------------------------------------------------ summary

@pytest.mark.parametrize(("corrupt", "parts"), [
    (lambda p: p.write_text('{"run": {}, "counts": {"passed": 1}, "tests": [{"no'),
     ["summary.json: not valid JSON", "line 1"]),
    (lambda p: p.write_text('{"run": {}, "tests": []}'), ["key 'counts' missing"]),
    (lambda p: p.write_text('[1, 2]'), ["expected a JSON object, got list"]),
    (lambda p: p.write_text(json.dumps({"run": {}, "counts": {"passed": 2},
                                        "tests": [{"nodeid": "a::t",
                                                   "outcome": "passed"},
                                                  {"nodeid": "a::u",
                                                   "outcome": "green"}]})),
     ["key 'tests[1].outcome' (a::u)", "got 'green'"]),
    (lambda p: p.write_text(json.dumps({"run": {}, "counts": {"passed": 5},
                                        "tests": [{"nodeid": "a::t",
                                                   "outcome": "passed"}]})),
     ["key 'counts': 5 test(s) counted, 1 listed"]),
    (lambda p: p.write_text(json.dumps({"run": [], "counts": {}, "tests": []})),
     ["key 'run': expected an object, got list"]),
    (lambda p: p.unlink(), ["summary.json: missing"]),
], ids=["cut-off", "no-counts", "not-object", "bad-outcome", "counts-mismatch",
        "run-list", "missing"])
def test_summary_of_a_bad_run_folder_is_one_line(tmp_path, corrupt, parts) -> None:
    d = make_run(tmp_path, "r", "h1", ["passed", "passed", "passed"])
    corrupt(d / "summary.json")
    _one_line(run_cli("summary", str(d)), "tvc summary: ", str(d), *parts)
    assert not (d / "summary.html").exists()  # nothing rendered from it


def test_summary_of_a_missing_folder_is_one_line(tmp_path) -> None:
    proc = run_cli("summary", str(tmp_path / "nope"))
    _one_line(proc, "no such folder")
    assert str(tmp_path / "nope") in proc.stderr, proc.stderr  # names the folder
    assert not (tmp_path / "nope").exists()  # a summary creates nothing


def test_summary_rerenders_the_page_and_prints_the_verdict(tmp_path, capsys
                                                           ) -> None:
    d = make_run(tmp_path, "r", "h1", ["passed", "failed", "skipped"])
    assert cli.main(["summary", str(d)]) == 1  # FAIL
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "FAIL: 1 test(s) failed or errored", out
    assert "counts: passed 1, failed 1, error 0, xfailed 0, skipped 1" in out
    md = (d / "summary.md").read_text()
    assert md.startswith("# Conformance run: FAIL")
    assert "`test_cold_prompt_matches_nothing`: failed here" in md
    green = make_run(tmp_path, "g", "h1", ["passed", "passed", "passed"])
    assert cli.main(["summary", str(green)]) == 0
    # a run of two tiers says so (tvc.report.scope)
    assert capsys.readouterr().out.startswith(
        "PASS (partial run, level1 and contract only): 3 passed, 0 skipped")


# -------------------------------------------------------------------- merge

def fleet(tmp_path: Path) -> list[Path]:
    """Four hosts of one CI matrix, same test ids: green, failed, terminated
    (its junit.xml all green, as pytest wrote it before the signal), and one
    whose junit.xml is missing."""
    return [
        make_run(tmp_path, "20261201-100000-example", "gpu-a",
                 ["passed", "passed", "passed"]),
        make_run(tmp_path, "20261201-100001-example", "gpu-b",
                 ["passed", "failed", "failed"],
                 messages={1: "AssertionError: matched 16 tokens, expected 0",
                           2: "AssertionError: matched 48 tokens, expected 0"}),
        make_run(tmp_path, "20261201-100002-example", "gpu-c",
                 ["passed", "passed", "not_run"],
                 run={"outcome": "terminated", "exit_status": 2,
                      "signal": "SIGTERM"}),
        make_run(tmp_path, "20261201-100000-example-2", "gpu-d",
                 ["passed", "passed", "passed"], junit=False, gpus=2),
    ]


def test_merge_writes_one_fleet_summary_and_one_junit(tmp_path, capsys) -> None:
    runs = fleet(tmp_path / "in")
    before = snapshot(runs)
    out = tmp_path / "fleet"
    rc = cli.main(["merge", *map(str, runs), "--out", str(out)])
    printed = capsys.readouterr()
    assert rc == 1, printed  # a host failed: the fleet did not pass
    assert snapshot(runs) == before  # inputs only read
    assert "20261201-100000-example-2/junit.xml: missing" in printed.err
    s = json.loads((out / "summary.json").read_text())
    hosts = {h["label"]: h for h in s["fleet"]["hosts"]}
    assert list(hosts) == ["gpu-a/20261201-100000-example",
                           "gpu-b/20261201-100001-example",
                           "gpu-c/20261201-100002-example",
                           "gpu-d/20261201-100000-example-2"]
    assert [h["verdict"] for h in hosts.values()] == ["PASS", "FAIL", "INCOMPLETE",
                                                      "PASS"]
    assert s["fleet"]["verdict"] == "FAIL" and s["run"]["outcome"] == "failed"
    assert "2 of 4 run(s) did not pass" in s["fleet"]["why"]
    assert hosts["gpu-c/20261201-100002-example"]["reason"].startswith(
        "terminated by SIGTERM")
    assert hosts["gpu-d/20261201-100000-example-2"]["hardware"] == \
        "2 x NVIDIA H200 (gpu)"
    assert s["counts"] == {"passed": 9, "failed": 2, "error": 0, "skipped": 0,
                           "xfailed": 0, "not_run": 1}
    assert len(s["tests"]) == 12 and {t["host"] for t in s["tests"]} == set(hosts)
    # JUnit: a suite per host/run; equal test ids stay apart; outcomes carried
    root = ET.parse(out / "junit.xml").getroot()
    suites = {su.get("name"): su for su in root.findall("testsuite")}
    assert list(suites) == list(hosts)
    for label, su in suites.items():
        cls = {c.get("classname") for c in su.iter("testcase")
               if c.get("name") == "test_vllm_imports"}
        assert cls == {f"{label.replace('.', '_')}.suites.level1."
                       "test_vllm_install"}, cls
        props = {p.get("name"): p.get("value") for p in su.iter("property")}
        assert props["tvc.run.outcome"] == hosts[label]["outcome"], props
    outcome = {label: [c for c in su.iter("testcase") if c.get("name") ==
                       OUTCOME_CASE] for label, su in suites.items()}
    # gpu-b's failed tests show its outcome; gpu-c's cases are all green
    assert [len(v) for v in outcome.values()] == [0, 0, 1, 0], outcome
    term = outcome["gpu-c/20261201-100002-example"][0].find("failure")
    assert "terminated by SIGTERM" in term.get("message")
    b = suites["gpu-b/20261201-100001-example"]
    assert (b.get("tests"), b.get("failures")) == ("3", "2")
    assert root.get("tests") == "13" and root.get("failures") == "3"
    # the page: host table, then one cause across hosts
    md = (out / "summary.md").read_text()
    assert md.startswith("# Fleet run (4 run folder(s)): FAIL")
    row = next(ln for ln in md.splitlines() if ln.startswith("| gpu-c/"))
    assert "| example | ExampleConnector | 1 x NVIDIA H200 (gpu) | 0.28.0 |" in row
    assert "INCOMPLETE: terminated by SIGTERM" in row
    assert "## What failed: 2 test(s), 1 cause(s)" in md
    assert md.count("AssertionError: matched") == 1, md
    assert ("`gpu-b/20261201-100001-example: test_cold_prompt_matches_nothing` and "
            "`gpu-b/20261201-100001-example: test_stored_prompt_hits` (2 tests)"
            ) in md
    assert "## Never ran" in md and "gpu-c/20261201-100002-example: " \
        "test_stored_prompt_hits" in md
    # tvc summary re-renders a fleet folder too
    (out / "summary.md").unlink()
    assert cli.main(["summary", str(out)]) == 1
    assert (out / "summary.md").read_text() == md  # the same page again


def test_merge_of_green_hosts_passes(tmp_path, capsys) -> None:
    runs = [make_run(tmp_path, f"r{i}", f"node{i}", ["passed", "passed", "skipped"])
            for i in range(3)]
    assert cli.main(["merge", *map(str, runs), "--out", str(tmp_path / "f")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PASS: every run passed (3)"), out
    root = ET.parse(tmp_path / "f" / "junit.xml").getroot()
    assert root.get("failures") == "0" and root.get("tests") == "9"
    assert not [c for c in root.iter("testcase") if c.get("name") == OUTCOME_CASE]
    # merging again into the same fleet folder is allowed (a re-run of the step)
    assert cli.main(["merge", *map(str, runs), "--out", str(tmp_path / "f")]) == 0


def test_same_host_and_folder_name_get_distinct_labels(tmp_path) -> None:
    # two runs of one host, in folders of one name, started at different times
    # (an identical summary.json is a copy of one run: refused, see below)
    a = make_run(tmp_path / "x", "run", "node", ["passed"] * 3)
    b = make_run(tmp_path / "y", "run", "node", ["passed"] * 3,
                 run={"started_utc": "2026-12-01T10:05:00Z"})
    assert cli.main(["merge", str(a), str(b), "--out", str(tmp_path / "f")]) == 0
    s = json.loads((tmp_path / "f" / "summary.json").read_text())
    assert [h["label"] for h in s["fleet"]["hosts"]] == ["node/run", "node/run-2"]


@pytest.mark.parametrize("case", ["out-is-input", "out-inside-input", "non-empty",
                                  "twice", "a-copy", "corrupt-input",
                                  "fleet-as-input", "not-a-folder"])
def test_merge_refuses_in_one_line_and_writes_nothing(tmp_path, case) -> None:
    runs = fleet(tmp_path / "in")[:2]
    out = tmp_path / "fleet"
    args = [*map(str, runs)]
    part = ""
    if case == "out-is-input":
        out, part = runs[0], "is one of the run folders to merge"
    elif case == "out-inside-input":
        out, part = runs[1] / "fleet", "is inside the run folder"
    elif case == "non-empty":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        part = "holds no earlier fleet summary"
    elif case == "twice":
        args.append(str(runs[0]))
        part = "given twice"
    elif case == "a-copy":
        shutil.copytree(runs[0], tmp_path / "in" / "copy")
        args.append(str(tmp_path / "in" / "copy"))
        part = f"the same run as {runs[0]} (identical summary.json)"
    elif case == "corrupt-input":
        (runs[1] / "summary.json").write_text('{"run": {}, "counts": {}, "tes')
        part = f"{runs[1]}/summary.json: not valid JSON"
    elif case == "fleet-as-input":
        assert cli.main(["merge", *args, "--out", str(tmp_path / "f0")]) == 1
        args.append(str(tmp_path / "f0"))
        part = "key 'fleet': this is a fleet summary"
    elif case == "not-a-folder":
        args.append(str(tmp_path / "in" / "nope"))
        part = "nope: no such folder"
    before = snapshot([tmp_path / "in"])
    proc = run_cli("merge", *args, "--out", str(out))
    _one_line(proc, "tvc merge: ", part)
    assert snapshot([tmp_path / "in"]) == before
    if case not in ("out-is-input", "non-empty"):
        assert not (out / "junit.xml").exists()


def test_cli_module_is_cheap_to_import() -> None:
    """``tvc --help`` must not pay for pytest, vLLM or the plugin."""
    code = ("import sys, tvc.cli; heavy = [m for m in ('pytest', 'vllm', 'torch', "
            "'jinja2', 'tvc.plugin.hooks', 'tvc.config.profile') if m in "
            "sys.modules]; print(heavy)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.strip() == "[]", proc.stdout
    helped = run_cli("--help")
    assert helped.returncode == 0 and "certify" in helped.stdout and (
        "merge" in helped.stdout)


# ------------------------------------------------------------------ certify

def test_certify_is_the_one_implementation_behind_the_script(tmp_path) -> None:
    """``tvc certify`` directly: the same command line and usage errors as
    ``scripts/certify.sh`` (selftests/foundation/test_certify.py), which calls it."""
    import shlex

    env_dry = {"CERTIFY_DRY_RUN": "1", "CERTIFY_WORKERS": "0",
               "TVC_REPORTS_ROOT": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "tvc.cli", "certify", "lab-disk",
                           "-k", "x"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ,
                                                   **env_dry})
    assert proc.returncode == 0, proc.stderr
    cmd = shlex.split(proc.stdout.strip().splitlines()[-1])
    assert cmd[:3] == [sys.executable, "-m", "pytest"] and "-n" not in cmd, cmd
    assert "--tvc-require=gpu,nvme" in cmd and cmd[-2:] == ["-k", "x"], cmd
    tiers = [a for a in cmd if a.startswith("suites/")]
    assert tiers[:7] == [f"suites/{t}" for t in cli.TIER_ORDER], tiers
    assert any(a.startswith(f"--tvc-report-dir={tmp_path}/") and
               a.endswith("-certify-lab-disk") for a in cmd), cmd
    _one_line(run_cli("certify", "example", "--fixtures"), "certify: --fixtures "
              "runs no test")
    bad = run_cli("certify", "nosuch")
    assert bad.returncode == 4 and len(bad.stderr.strip().splitlines()) == 1, bad
    assert "profile 'nosuch'" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize(("rc", "partial", "known", "word"), [
    (0, [], 0, "CERTIFIED"),
    (0, [], 2, "CERTIFIED with 2 known defect(s) the profile accepts"),
    (0, ["-k 'x'"], 0, "PASSED a selection (-k 'x'), not certified"),
    (1, [], 0, "NOT certified"),
    (2, ["-k 'x'"], 1, "NOT certified"),
])
def test_certify_verdict(rc, partial, known, word) -> None:
    assert cli.certify_verdict(rc, partial, known).startswith(word)


def test_narrowed_by_ignores_the_suites_own_device_deselection() -> None:
    s = {"run": {"keyword": "", "markexpr": "level1"},
         "deselected": [{"tier": "contract", "count": 24,
                         "why": "[cpu] worker variants: worker_devices = ['cuda']"},
                        {"tier": "e2e", "count": 5, "why": "-m 'level1'"}]}
    assert cli.narrowed_by(s) == "-m 'level1', 5 test(s) deselected"
    s["run"]["markexpr"] = ""
    s["deselected"] = s["deselected"][:1]
    assert cli.narrowed_by(s) == ""


def test_certify_from_an_installed_package_plans_where_the_user_stands(
        tmp_path, monkeypatch, capsys) -> None:
    """Installed, the tests are the package's ``tvc/suites``: pytest starts where
    the user stands (never in site-packages) with ``--rootdir`` at the package, so
    node ids read ``suites/<tier>/...``; the run folder goes to ``./reports``."""
    import shlex

    pkg = tmp_path / "site-packages" / "tvc"
    for tier in ("level1", "contract"):
        (pkg / "suites" / tier).mkdir(parents=True)
    here = tmp_path / "work"
    here.mkdir()
    monkeypatch.chdir(here)
    rc = cli.certify("example", ["suites/level1/test_x.py", "-x"], str(pkg),
                     env={"CERTIFY_WORKERS": "0"}, dry_run=True)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"certify: run folder {here}/reports/" in out, out
    assert f"certify: dry run: pytest would start in {here}" in out, out
    cmd = shlex.split(out.strip().splitlines()[-1])
    assert f"--rootdir={pkg}" in cmd and str(pkg / "suites" / "level1") in cmd, cmd
    assert str(pkg / "suites" / "level1" / "test_x.py") in cmd, cmd  # user's path
    assert not list(pkg.rglob("reports"))  # nothing planned inside the package
    # a checkout is found from anywhere: the suite tvc was imported from
    assert cli.find_root(None) == REPO_ROOT
    assert cli.find_root(str(here)) is None  # --root without suites/
    assert cli.main(["certify", "--root", str(here), "example"]) == 2


def test_merge_renders_the_connector_package_vllm_hardware_matrix(tmp_path, capsys
                                                                   ) -> None:
    """Runs of two vLLM versions fold into one verdict per cell, worst run first."""
    runs = fleet(tmp_path / "in")  # vLLM 0.28.0: gpu-a PASS, gpu-b FAIL (1 GPU)
    older = make_run(tmp_path / "in", "20261201-090000-example", "gpu-e",
                     ["passed", "passed", "passed"])
    s = json.loads((older / "summary.json").read_text())
    s["versions"]["vllm"] = "0.26.0"
    s["profile"]["package"] = {"name": "lmcache", "version": "0.5.3"}
    (older / "summary.json").write_text(json.dumps(s))
    out = tmp_path / "fleet"
    assert cli.main(["merge", *map(str, runs), str(older), "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    table = json.loads((out / "summary.json").read_text())["fleet"]["matrix"]
    cells = {(r["package"], r["vllm"], r["hardware"]): r for r in table}
    one = ("(vLLM's own)", "0.28.0", "1 x NVIDIA H200 (gpu)")
    assert cells[one]["verdict"] == "FAIL"  # gpu-b's FAIL outranks gpu-a's PASS
    assert len(cells[one]["runs"]) == 3  # gpu-a, gpu-b, gpu-c
    assert cells[one]["uncatalogued"] == 2
    assert cells[("lmcache 0.5.3", "0.26.0", "1 x NVIDIA H200 (gpu)")]["verdict"] == \
        "PASS"
    assert table[0]["verdict"] == "FAIL"  # worst first
    assert "| ExampleConnector | lmcache 0.5.3 | 0.26.0 | 1 x NVIDIA H200 (gpu) " \
        "| PASS | 3 | 0 | — | 1 |" in printed
    assert (out / "matrix.md").read_text().startswith("| connector | package |")
