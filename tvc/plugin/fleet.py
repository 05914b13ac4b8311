"""A fleet summary: run folders from many hosts merged into one (``tvc merge``).

:func:`merge` reads one run folder per host (a CI matrix, a Slurm array) and writes
a new folder: ``summary.json`` (``fleet`` host table and verdict, summed ``counts``,
every ``tests`` and ``findings`` entry with its ``host``), ``junit.xml`` (one
``<testsuite>`` per input, :func:`fleet_junit`) and ``summary.md``/``.html``.
The inputs are only read. See docs/cli.md.
"""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tvc.core.files import read_json, write_file
from tvc.plugin.findings import causes
from tvc.plugin.report import (
    SUMMARY_OUTCOMES,
    RunFolderError,
    junit_classname,
    outcome_reason,
    read_summary,
    stamp_suite,
)

__all__ = ["merge", "check_out_dir", "host_label", "write_fleet_page"]

VERDICT_RANK = {"PASS": 0, "NOTHING PASSED": 1, "INCOMPLETE": 2, "FAIL": 3,
                "NO DATA": 3}


def host_label(summary: Mapping[str, Any], run_dir: Path) -> str:
    """``<host>/<run folder name>``, or the folder name when the host is unknown.

    The host is ``run.host``; older summaries fall back to ``hardware.host``.
    """
    run = summary.get("run") or {}
    host = str(run.get("host") or (summary.get("hardware") or {}).get("host") or "")
    return f"{host}/{run_dir.name}" if host else run_dir.name


def check_out_dir(out: Path, inputs: Sequence[Path]) -> str:
    """Why ``out`` cannot receive the fleet summary (``""`` when it can).

    Never an input folder or one inside it, nor a non-empty folder other than an
    earlier fleet summary.
    """
    out = out.resolve()
    for d in inputs:
        d = d.resolve()
        if out == d:
            return f"{out} is one of the run folders to merge; give a new folder"
        if d in out.parents:
            return f"{out} is inside the run folder {d}; give a folder outside it"
    if out.exists() and not out.is_dir():
        return f"{out} exists and is not a folder"
    if out.is_dir() and any(out.iterdir()):
        try:
            earlier = read_json(out / "summary.json")
        except (OSError, ValueError):
            earlier = None
        if not (isinstance(earlier, dict) and "fleet" in earlier):
            return (f"{out} is a non-empty folder that holds no earlier fleet "
                    "summary; give a new or empty folder")
    return ""


def _hardware(summary: Mapping[str, Any]) -> str:
    hw = summary.get("hardware") or {}
    gpus = hw.get("gpus") or []
    gpu = f"{len(gpus)} x {gpus[0].get('name', 'GPU')}" if gpus else "no GPU"
    levels = [k for k, v in (hw.get("levels") or {}).items() if v and k != "any"]
    return gpu + (f" ({', '.join(levels)})" if levels else "")


def _host_row(label: str, run_dir: Path, s: Mapping[str, Any]) -> dict[str, Any]:
    from tvc.plugin.summary_page import verdict

    word, why = verdict(s)
    run, prof = s.get("run") or {}, s.get("profile") or {}
    counts = {k: int((s.get("counts") or {}).get(k, 0)) for k in SUMMARY_OUTCOMES}
    return {"label": label, "host": str(run.get("host") or ""),
            "run_dir": str(run_dir), "profile": str(prof.get("name", "?")),
            "connector": str(prof.get("connector", "?")),
            "hardware": _hardware(s),
            "vllm": str((s.get("versions") or {}).get("vllm", "?")),
            "started_utc": str(run.get("started_utc", "")),
            "duration_s": run.get("duration_s"),
            "outcome": str(run.get("outcome") or ""), "reason": outcome_reason(
                dict(s)), "verdict": word, "why": why, "counts": counts}


def _suite_from_summary(s: Mapping[str, Any]) -> ET.Element:
    """A ``<testsuite>`` built from ``summary.json``'s tests (no junit.xml)."""
    suite = ET.Element("testsuite")
    for t in s.get("tests") or []:
        path, _, name = str(t["nodeid"]).rpartition("::")
        case = ET.SubElement(suite, "testcase", classname=junit_classname(path),
                             name=name, time=str(t.get("duration_s", 0)))
        msg = str(t.get("message") or "")[:2000]
        o = t["outcome"]
        if o == "failed":
            ET.SubElement(case, "failure", message=msg)
        elif o == "error":
            ET.SubElement(case, "error", message=msg)
        elif o in ("skipped", "xfailed", "not_run"):
            ET.SubElement(case, "skipped", message=msg or "not run")
    return suite


def _host_cases(run_dir: Path, s: Mapping[str, Any], warn: list[str]
                ) -> tuple[list[ET.Element], list[ET.Element]]:
    """(properties, testcases) of one run: its junit.xml, else its summary.json."""
    path = run_dir / "junit.xml"
    if path.is_file():
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as exc:
            warn.append(f"{path}: not readable JUnit XML ({exc}); its cases are "
                        "taken from summary.json")
        else:
            suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
            props = [p for su in suites for p in su.findall("properties/property")]
            cases = [c for su in suites for c in su.iter("testcase")]
            return props, cases
    else:
        warn.append(f"{path}: missing; its cases are taken from summary.json")
    return [], list(_suite_from_summary(s).iter("testcase"))


def fleet_junit(runs: Sequence[tuple[str, Path, Mapping[str, Any]]],
                warn: list[str]) -> ET.ElementTree:
    """One JUnit tree (``<testsuites name="tvc fleet">``), a suite per run folder.

    Each case's ``classname`` is prefixed with the run's label (dots made ``_``), so
    equal ids from two hosts stay two cases; a run that did not pass carries its
    ``tvc-run-outcome`` failure (:func:`stamp_suite`). ``runs`` are ``(label, run
    folder, summary)``; ``warn`` gets a line per missing or corrupt junit.xml.
    """
    root = ET.Element("testsuites", name="tvc fleet")
    for label, run_dir, s in runs:
        props, cases = _host_cases(run_dir, s, warn)
        suite = ET.SubElement(root, "testsuite", name=label)
        p = ET.SubElement(suite, "properties")
        for name, value in (("tvc.host", str((s.get("run") or {}).get("host") or "")),
                            ("tvc.run_dir", str(run_dir)),
                            ("tvc.profile", str((s.get("profile") or {}).get(
                                "name", "")))):
            ET.SubElement(p, "property", name=name, value=value)
        for prop in props:
            p.append(prop)
        prefix = label.replace(".", "_")
        for case in cases:
            cls = case.get("classname", "")
            if cls != "tvc.run":
                case.set("classname", f"{prefix}.{cls}" if cls else prefix)
            suite.append(case)
        stamp_suite(suite, dict(s))
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        for case in suite.iter("testcase"):
            counts["tests"] += 1
            for tag, key in (("failure", "failures"), ("error", "errors"),
                             ("skipped", "skipped")):
                if case.find(tag) is not None:
                    counts[key] += 1
        for k, v in counts.items():
            suite.set(k, str(v))
    for k in ("tests", "failures", "errors", "skipped"):
        root.set(k, str(sum(int(su.get(k, "0")) for su in root.findall("testsuite"))))
    return ET.ElementTree(root)


def merge(inputs: Sequence[Path], out: Path) -> dict[str, Any]:
    """Merge run folders into a fleet summary under ``out``.

    Returns:
        the fleet ``summary.json`` content, plus ``warnings`` (inputs whose
        junit.xml was missing or corrupt) and ``files``.

    Raises:
        RunFolderError: an input is not a run folder (the message names the file and
            the key), is given twice (or a copy of another), is itself a fleet
            summary, or ``out`` cannot receive the summary.

    """
    if not inputs:
        raise RunFolderError("no run folder given")
    seen: dict[Path, Path] = {}
    same: dict[str, Path] = {}  # a run's summary (canonical JSON) -> its folder
    runs: list[tuple[str, Path, dict[str, Any]]] = []
    labels: set[str] = set()
    for given in inputs:
        d = Path(given).resolve()
        if d in seen:
            raise RunFolderError(f"{given}: given twice")
        seen[d] = Path(given)
        s = read_summary(d)
        key = json.dumps(s, sort_keys=True, default=str)
        if key in same:  # a copy of a run would count it twice
            raise RunFolderError(f"{given}: the same run as {same[key]} "
                                 "(identical summary.json); give each run once")
        same[key] = Path(given)
        if "fleet" in s:
            raise RunFolderError(f"{d / 'summary.json'}: key 'fleet': this is a fleet "
                                 "summary (tvc merge wrote it); give the run folders")
        label, n = host_label(s, d), 1
        base = label
        while label in labels:
            n += 1
            label = f"{base}-{n}"
        labels.add(label)
        runs.append((label, d, s))
    why = check_out_dir(Path(out), [d for _, d, _ in runs])
    if why:
        raise RunFolderError(f"--out: {why}")
    hosts = [_host_row(label, d, s) for label, d, s in runs]
    worst = max(hosts, key=lambda h: VERDICT_RANK.get(h["verdict"], 3))
    word = worst["verdict"]
    not_passed = [h for h in hosts if h["verdict"] != "PASS"]
    why_fleet = (f"every run passed ({len(hosts)})" if not not_passed else
                 f"{len(not_passed)} of {len(hosts)} run(s) did not pass: "
                 + "; ".join(f"{h['label']}: {h['verdict']} ({h['why']})"
                             for h in not_passed[:4])
                 + (" ..." if len(not_passed) > 4 else ""))
    from tvc.report import matrix

    table = matrix.cells([(h, s) for h, (_, _, s) in zip(hosts, runs, strict=True)])
    counts = {k: sum(h["counts"][k] for h in hosts) for k in SUMMARY_OUTCOMES}
    tests = [{**t, "host": label} for label, _, s in runs for t in s["tests"]]
    found = [{**f, "host": label} for label, _, s in runs
             for f in s.get("findings") or []]
    summary = {
        "fleet": {"created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "verdict": word, "why": why_fleet, "hosts": hosts,
                  "matrix": table},
        "run": {"kind": "fleet", "outcome": "passed" if word == "PASS" else "failed",
                "exit_status": 0 if word == "PASS" else 1},
        "counts": counts, "tests": tests, "findings": found,
    }
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    warn: list[str] = []
    tree = fleet_junit(runs, warn)
    root = tree.getroot()
    assert root is not None  # fleet_junit builds the tree around a root
    write_file(out / "junit.xml", ET.tostring(root, encoding="utf-8",
                                              xml_declaration=True))
    write_file(out / "summary.json", json.dumps(summary, indent=2, default=str)
               + "\n")
    files = write_fleet_page(out, summary)
    (out / "matrix.md").write_text(matrix.markdown(table))
    files["matrix"] = out / "matrix.md"
    return {**summary, "warnings": warn,
            "files": {"summary.json": out / "summary.json",
                      "junit.xml": out / "junit.xml", **files}}


def fleet_model(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The template context of a fleet page; causes grouped across hosts."""
    from tvc.plugin.summary_page import NAMES_SHOWN, OUTCOMES

    fleet = summary.get("fleet") or {}
    tests = summary.get("tests") or []
    # catalogue keys per host: a test id is only one host's test
    found = [{**f, "tests": [f"{f.get('host', '')}\0{n}" for n in f.get("tests", [])]}
             for f in summary.get("findings") or []]
    keyed = [{**t, "nodeid": f"{t.get('host', '')}\0{t['nodeid']}"} for t in tests]

    def label(t: Mapping[str, Any]) -> str:
        host, _, nodeid = str(t["nodeid"]).partition("\0")
        return f"{host}: {nodeid.split('::')[-1]}"

    groups = {g: causes(keyed, found, g, label=label)
              for g in ("failed", "xfailed", "not_run", "skipped")}
    for group in groups.values():
        for e in group:
            e["tests"] = [n.partition("\0")[2] for n in e["tests"]]
            e["hosts"] = sorted({n.partition(": ")[0] for n in e["names"]})
            e["outcome"] = ", ".join(
                o if n == len(e["names"]) else f"{o} {n}"
                for o, n in sorted(e["outcomes"].items()))
            e["rerun"] = e["reproduction"] = e["source"] = ""
    counts = summary.get("counts") or {}
    return {
        "word": fleet.get("verdict", "NO DATA"), "why": fleet.get("why", ""),
        "badge": fleet.get("verdict") if fleet.get("verdict") in ("PASS", "FAIL")
        else "other",
        "created": fleet.get("created_utc", ""), "hosts": fleet.get("hosts") or [],
        "outcomes": OUTCOMES, "counts": [(k, counts.get(k, 0)) for k in OUTCOMES],
        "failures": groups["failed"], "known": groups["xfailed"],
        "not_run": groups["not_run"], "skips": groups["skipped"],
        "failed_tests": sum(len(e["tests"]) for e in groups["failed"]),
        "skipped_tests": sum(len(e["tests"]) for e in groups["skipped"]),
        "names_shown": NAMES_SHOWN,
    }


def write_fleet_page(out: Path, summary: Mapping[str, Any]) -> dict[str, Path]:
    """Write ``summary.md`` and ``summary.html`` of a fleet folder; name -> path."""
    from tvc.plugin.summary_page import render

    model = fleet_model(summary)
    md, page = Path(out) / "summary.md", Path(out) / "summary.html"
    write_file(md, render("fleet.md.j2", model))
    write_file(page, render("fleet.html.j2", model))
    return {"markdown": md, "html": page}
