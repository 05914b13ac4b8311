"""Run reports: JUnit XML plus a JSON summary of the same, under ``reports/``.

Every run writes into one run folder ``reports/<UTC time>-<profile>/`` (or
``--tvc-report-dir``): ``junit.xml`` (with the run's outcome stamped in,
:func:`stamp_junit`), ``summary.json`` (:meth:`RunReport.write`; durations in s) and
``failures.md`` (:mod:`tvc.report.live`); ``reports/latest`` points at the newest.
A run stopped before pytest wrote its JUnit file still gets one
(:func:`write_fallback_junit`). The fields are described in docs/reports.md.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import signal
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from tvc.config.paths import reports_root
from tvc.core.files import read_json, write_file
from tvc.plugin import run_control
from tvc.plugin.findings import findings, pytest_command
from tvc.report.live import LiveReds
from tvc.report.outcome import OUTCOME_BY_EXIT, headline, outcome_reason, verdict
from tvc.report.scope import HW_LEVELS, hardware_level, scope, tier_order

TIER_MARKERS = tier_order()
MISSING_HW_PROPERTY = "tvc_missing_hardware"  # set on a skip for an absent level


def _dist(name: str) -> dict[str, str]:
    """Version and location of an installed distribution, without importing it."""
    try:
        version = md.version(name)
    except md.PackageNotFoundError:
        return {"version": "", "location": ""}
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    loc = str(Path(spec.origin).parent) if spec and spec.origin else ""
    return {"version": version, "location": loc}


def versions() -> dict[str, str]:
    """Versions of Python, vLLM and torch (from package metadata; nothing imported)."""
    vllm, torch = _dist("vllm"), _dist("torch")
    return {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "vllm": vllm["version"],
        "vllm_location": vllm["location"],
        "torch": torch["version"],
        "platform": platform.platform(),
    }


class RunReport:
    """Collects test outcomes and properties; writes ``summary.json`` at the end.

    ``run_dir`` is created here; ``meta`` holds run-level facts (profile, hardware,
    versions, args) for both reports.
    """

    def __init__(self, run_dir: Path, meta: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self.meta = meta
        self.tests: dict[str, dict[str, Any]] = {}
        self.started = time.time()
        # [{"tier", "count", "why"}]: tests collected but not run (see the plugin)
        self.deselected: list[dict[str, Any]] = []
        self.written = False  # summary.json written
        self.terminated_by = ""  # "SIGTERM"/"SIGHUP" when a signal stopped the run
        self.invocation_dir: Path | None = None  # where pytest started (reports/latest)
        # extra top-level sections of summary.json (e.g. "coverage")
        self.extra: dict[str, Any] = {}
        self.summary: dict[str, Any] = {}  # what write() wrote
        # the pytest of rerun commands, fixed where the run starts (a test may
        # change the working folder later)
        self.pytest = pytest_command(sys.executable, os.getcwd())
        # the rootdir, where it is not the folder the run started in (findings)
        self.rerun_root = ""
        self.stop: dict[str, str] = {}  # why the run stopped early (tvc.report.outcome)
        self.live = LiveReds(run_dir, f"profile {meta.get('profile', {}).get('name')}")
        self.running = ""  # node id of the test in progress ('' between tests)

    def flat_properties(self) -> list[tuple[str, str]]:
        """Run-level facts as (name, value) pairs for the JUnit ``<properties>``."""
        out: list[tuple[str, str]] = []

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), v)
            elif isinstance(value, list):
                out.append((prefix, json.dumps(value)))
            else:
                out.append((prefix, str(value)))

        walk("", self.meta)
        return out

    def expect(self, nodeids: Iterable[str],
               hardware: Mapping[str, str] | None = None) -> None:
        """Record the tests the run is to run, as ``not_run`` until they report.

        ``hardware``: node id -> level (``gpu``...) of tests with a ``hw_*`` marker. A
        run cut short then counts every test that never started.
        """
        for nodeid in nodeids:
            parts = nodeid.split("/")
            tier = parts[1] if len(parts) > 2 and parts[0] == "suites" else ""
            self.tests.setdefault(nodeid, {
                "nodeid": nodeid, "outcome": "not_run", "duration_s": 0.0,
                "tiers": [tier] if tier in TIER_MARKERS else [], "properties": {},
                "message": "", "hardware": (hardware or {}).get(nodeid, "any"),
            })

    @pytest.hookimpl
    def pytest_runtest_logstart(self, nodeid: str) -> None:
        """Remember the test in progress (named if the run stops inside it)."""
        self.running = nodeid

    @pytest.hookimpl
    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        """No test in progress."""
        self.running = ""

    @pytest.hookimpl
    def pytest_internalerror(self, excrepr: Any) -> None:
        """An internal error stopped the run inside a test: that test is an error.

        E.g. a time limit that fired in a hook between two phases of a test.
        """
        if not self.running:
            return
        entry = self.tests.setdefault(self.running, {
            "nodeid": self.running, "outcome": "not_run", "duration_s": 0.0,
            "tiers": [], "properties": {}, "message": ""})
        last = [ln for ln in str(excrepr).splitlines() if ln.strip()][-1:]
        entry["outcome"] = "error"
        entry["message"] = ("the run stopped with an internal error while this "
                            f"test ran: {last[0].strip() if last else excrepr}")

    def stopped_inside(self, why: str) -> None:
        """Name the test in progress when the run was interrupted (``why``)."""
        entry = self.tests.get(self.running)
        if entry is not None and entry["outcome"] == "not_run":
            entry["message"] = f"running when the run was {why}: it never finished"

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Record one phase of one test (setup/call/teardown)."""
        entry = self.tests.setdefault(report.nodeid, {
            # "not_run" until the call phase reports: an interrupted run must not
            # count a test whose body never ran as passed
            "nodeid": report.nodeid, "outcome": "not_run", "duration_s": 0.0,
            "tiers": [], "properties": {}, "message": "",
        })
        entry["duration_s"] = round(entry["duration_s"] + report.duration, 3)
        keywords = getattr(report, "keywords", {})
        entry["tiers"] = sorted(m for m in TIER_MARKERS if m in keywords)
        entry["hardware"] = hardware_level(keywords)
        for name, value in report.user_properties:
            if name == MISSING_HW_PROPERTY:
                entry["missing_hardware"] = value
            else:
                entry["properties"][name] = value
        if getattr(report, "tvc_not_run", False):
            entry["outcome"] = "not_run"
            entry["message"] = _short(report)
        elif report.failed:
            if entry["outcome"] not in ("failed", "error"):
                entry["outcome"] = "failed" if report.when == "call" else "error"
                entry["message"] = _short(report)
                self.live.add(report.nodeid, entry["outcome"], entry["message"],
                              self._rerun(entry))
        elif report.skipped and hasattr(report, "wasxfail"):
            # a profile's [[known_failures]] entry (strict xfail): it failed as
            # the upstream defect says; counted apart, never as a skip
            entry["outcome"] = "xfailed"
            entry["message"] = str(report.wasxfail) or _short(report)
        elif report.skipped and entry["outcome"] == "not_run":
            entry["outcome"] = "skipped"
            entry["message"] = _short(report)
        elif report.when == "call" and entry["outcome"] == "not_run":
            entry["outcome"] = "passed"

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report: pytest.TestReport,
                               sched: Any) -> None:
        """A test running on a worker when a signal stopped the run: not run.

        pytest counts it skipped; it is never a red (a worker that crashed on its
        own, with no signal, stays one).
        """
        signum = run_control.stopped_by()
        if signum is None:
            return  # a worker that crashed on its own: a red
        why = ("running when the run was "
               f"{'interrupted' if signum == signal.SIGINT else 'terminated'} "
               f"({signal.Signals(signum).name}): it never finished")
        report.outcome = "skipped"
        report.longrepr = (crashitem.split("::")[0], 0, f"Skipped: {why}")
        report.tvc_not_run = True  # type: ignore[attr-defined]

    def _rerun(self, entry: dict[str, Any]) -> str:
        """The command that reruns one test (as the findings say it)."""
        run = self.meta.get("run", {})
        found = findings([entry], self.meta.get("profile", {}), run.get("seed"),
                         os.environ.get("PYTHONPATH", ""), run.get("require") or (),
                         depth=run.get("depth"),
                         pytest=self.pytest, root=self.rerun_root)
        return str(found[0]["rerun"]) if found else ""

    def would_skip(self) -> None:
        """Tests a stopped run never reached that this box would have skipped.

        Outside strict mode, a test needing absent hardware counts as skipped.
        """
        hw = self.meta.get("hardware") or {}
        levels = hw.get("levels") or {}
        strict = set(self.meta.get("run", {}).get("require") or ())
        for t in self.tests.values():
            level = t.get("hardware")
            if (t["outcome"] != "not_run" or level not in HW_LEVELS
                    or levels.get(level, True) or level in strict):
                continue
            why = (hw.get("missing") or {}).get(level) or f"no {level} on this box"
            t.update(outcome="skipped", missing_hardware=level, message=(
                f"never ran (the run stopped first); this box would skip it: "
                f"{why}"))

    def counts(self) -> dict[str, int]:
        """Number of tests per outcome.

        Returns:
            ``passed``, ``failed``, ``skipped``, ``error``, ``xfailed`` (strict
            xfails of known upstream defects), and ``not_run`` only when an
            interrupted run left tests whose body never ran.

        """
        out = {"passed": 0, "failed": 0, "skipped": 0, "error": 0, "xfailed": 0}
        for t in self.tests.values():
            out[t["outcome"]] = out.get(t["outcome"], 0) + 1
        return out

    def outcome(self, exitstatus: int) -> str:
        """The run's outcome: :data:`OUTCOME_BY_EXIT`, or ``terminated``.

        ``terminated``: exit 2 with :attr:`terminated_by` set (SIGTERM, SIGHUP).
        """
        if int(exitstatus) == 2 and self.terminated_by:
            return "terminated"
        return OUTCOME_BY_EXIT.get(int(exitstatus), f"exit_{int(exitstatus)}")

    def write(self, exitstatus: int) -> Path:
        """Write ``summary.json``; point ``reports/latest`` at a run that ran tests.

        Args:
            exitstatus: pytest's exit code; ``run.outcome`` is its word
                (:data:`OUTCOME_BY_EXIT`).

        Raises:
            OSError: the run folder cannot be written (checked at start-up by
                :func:`check_run_dir`, so only a disk failing mid-run gets here).

        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.would_skip()
        run = {**self.meta.get("run", {}), "exit_status": int(exitstatus),
               "outcome": self.outcome(exitstatus),
               "duration_s": round(time.time() - self.started, 3)}
        run.setdefault("host", platform.node())
        run.setdefault("pythonpath", os.environ.get("PYTHONPATH", ""))
        if self.terminated_by:
            run["signal"] = self.terminated_by
        if self.stop:
            run["stop"] = self.stop
        summary = {
            **self.meta,
            "run": run,
            "counts": self.counts(),
            "deselected": self.deselected,
            "tests": sorted(self.tests.values(), key=lambda t: t["nodeid"]),
            **self.extra,
        }
        prof = summary.get("profile", {})
        pkg = prof.get("package") or {}
        versions = {"vllm": str((summary.get("versions") or {}).get("vllm") or "")}
        if pkg.get("name") and pkg.get("version"):
            versions[str(pkg["name"])] = str(pkg["version"])
        summary["findings"] = findings(summary["tests"], prof, run.get("seed"),
                                       run["pythonpath"], run.get("require") or (),
                                       versions, run.get("depth"),
                                       self.pytest, self.rerun_root)
        run["outcome_reason"] = outcome_reason(summary)
        summary["scope"] = scope(summary, TIER_MARKERS)
        run["verdict"], run["verdict_why"] = headline(summary), verdict(summary)[1]
        self.summary = summary
        path = write_file(self.run_dir / "summary.json",
                          json.dumps(summary, indent=2, default=str) + "\n")
        self.written = True
        self.live.finish(f"{run['verdict']}: {run['verdict_why']}")
        with contextlib.suppress(OSError, RuntimeError):
            root = reports_root(self.invocation_dir)
            latest = root / "latest"
            # the suite's own link only: a file or folder named latest is left
            if self.run_dir.parent == root and self.tests and (
                    latest.is_symlink() or not latest.exists()):
                tmp = root / f".latest.{os.getpid()}"
                tmp.unlink(missing_ok=True)
                os.symlink(self.run_dir.name, tmp)
                os.replace(tmp, latest)
        return path


def write_fallback_junit(rep: RunReport, exitstatus: int, suite_name: str,
                         path: Path | None = None) -> Path:
    """Write a JUnit file from the run's record when pytest wrote none; return its path.

    For a run stopped before pytest's session end (Ctrl-C during start-up, collection
    or shutdown); not-run tests are listed as skipped. ``path`` defaults to
    ``<run>/junit.xml``.
    """
    root = ET.Element("testsuites")
    suite = ET.SubElement(root, "testsuite", name=suite_name)
    props = ET.SubElement(suite, "properties")
    for name, value in rep.flat_properties():
        ET.SubElement(props, "property", name=name, value=value)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for t in sorted(rep.tests.values(), key=lambda t: t["nodeid"]):
        _add_case(suite, t, counts)
    for k, v in counts.items():
        suite.set(k, str(v))
    path = path or rep.run_dir / "junit.xml"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, ET.tostring(root, encoding="utf-8", xml_declaration=True))
    return path


def _add_case(suite: ET.Element, t: dict[str, Any], counts: dict[str, int]) -> None:
    """Append one summary test as a ``<testcase>``; count it in ``counts``.

    ``failed`` / ``error`` get a ``<failure>`` / ``<error>``; ``skipped``, ``xfailed``
    and ``not_run`` a ``<skipped>`` (``type="tvc.not_run"`` for the last).
    """
    nodepath, _, name = str(t.get("nodeid", "")).rpartition("::")
    case = ET.SubElement(suite, "testcase", classname=junit_classname(nodepath),
                         name=name, time=str(t.get("duration_s") or 0))
    counts["tests"] += 1
    o, message = t.get("outcome"), str(t.get("message") or "")[:2000]
    if o == "failed":
        ET.SubElement(case, "failure", message=message)
        counts["failures"] += 1
    elif o == "error":
        ET.SubElement(case, "error", message=message)
        counts["errors"] += 1
    elif o in ("skipped", "not_run", "xfailed"):
        skip = ET.SubElement(case, "skipped", message=message or (
            "not run: the run stopped first"))
        if o == "not_run":
            skip.set("type", "tvc.not_run")
        counts["skipped"] += 1


def junit_classname(path: str) -> str:
    """JUnit ``classname`` of a test file: ``a/b/test_c.py`` -> ``a.b.test_c``."""
    return path.removesuffix(".py").replace("/", ".")


#: the name of the JUnit case that carries a run's non-passing outcome
OUTCOME_CASE = "tvc-run-outcome"


def stamp_suite(suite: ET.Element, summary: dict[str, Any]) -> None:
    """Put a run's outcome into one ``<testsuite>``, in place (:func:`stamp_junit`)."""
    run = summary.get("run") or {}
    outcome = str(run.get("outcome", ""))
    why = outcome_reason(summary)
    props = suite.find("properties")
    if props is None:
        props = ET.Element("properties")
        suite.insert(0, props)
    have = {p.get("name") for p in props}
    for name, value in (("tvc.run.outcome", outcome),
                        ("tvc.run.exit_status", str(run.get("exit_status", "")))):
        if name not in have:
            ET.SubElement(props, "property", name=name, value=value)
    n = summary.get("counts") or {}
    shown = outcome == "failed" and int(n.get("failed", 0)) + int(n.get("error", 0))
    if not why or shown or any(c.get("name") == OUTCOME_CASE
                               for c in suite.iter("testcase")):
        return  # passed, or its failed tests already show it, or stamped
    case = ET.SubElement(suite, "testcase", classname="tvc.run", name=OUTCOME_CASE,
                         time="0")
    fail = ET.SubElement(case, "failure", message=f"run {outcome}: {why}")
    fail.text = (f"The run's outcome is {outcome!r} (pytest exit status "
                 f"{run.get('exit_status', '?')}): {why}. See summary.json.")
    for attr in ("tests", "failures"):
        suite.set(attr, str(int(suite.get(attr, "0") or 0) + 1))


def add_missing_cases(suites: list[ET.Element], summary: dict[str, Any]) -> None:
    """Give every test of ``summary`` its ``<testcase>``, so junit and summary agree.

    pytest's JUnit file of an interrupted run lists only the tests that reported,
    plus a ``<testcase>`` with no name for the test cut off in its call (its setup's
    duration). That one goes; each test of ``summary`` missing from ``suites`` (never
    run, or never run and labelled skipped where this box would skip it) is added to
    the first as :func:`write_fallback_junit` writes it, and the counts follow.
    Idempotent.
    """
    have = set()
    for suite in suites:
        for case in list(suite.findall("testcase")):
            if case.get("name") is None and not len(case):
                suite.remove(case)
            have.add((case.get("classname"), case.get("name")))
    added = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for t in sorted(summary.get("tests") or [], key=lambda t: str(t.get("nodeid"))):
        if not isinstance(t, dict):
            continue
        nodepath, _, name = str(t.get("nodeid", "")).rpartition("::")
        if (junit_classname(nodepath), name) not in have:
            _add_case(suites[0], t, added)
    for attr, n in added.items():
        suites[0].set(attr, str(int(suites[0].get(attr, "0") or 0) + n))


def stamp_junit(path: Path, summary: dict[str, Any]) -> None:
    """Put the run's outcome into a JUnit file (in place), so a gate reading it sees it.

    Every ``<testsuite>`` gets ``tvc.run.outcome`` and ``tvc.run.exit_status``
    properties; a run that did not pass for another reason than failed tests also gets
    a failing ``<testcase classname="tvc.run" name="tvc-run-outcome">``
    (:func:`outcome_reason`). Idempotent.

    Raises:
        OSError, xml.etree.ElementTree.ParseError: the file cannot be read.

    """
    tree = ET.parse(path)
    root = tree.getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    for suite in suites:
        stamp_suite(suite, summary)
    if suites:
        add_missing_cases(suites, summary)
    if root.tag == "testsuites":
        for attr in ("tests", "failures", "errors", "skipped"):
            if root.get(attr) is not None:
                root.set(attr, str(sum(int(s.get(attr, "0") or 0) for s in suites)))
    write_file(path, ET.tostring(root, encoding="utf-8", xml_declaration=True))


def finish_junit(rep: RunReport, exitstatus: int, xml: Path | None,
                 suite_name: str) -> list[Path]:
    """The run's JUnit files, complete: the user's ``--junitxml`` and the run folder's.

    After :meth:`RunReport.write`: writes a fallback where pytest wrote none, stamps
    the outcome, and copies ``xml`` (``config.option.xmlpath``) when elsewhere to
    ``<run>/junit.xml``. Returns the files written.
    """
    own = rep.run_dir / "junit.xml"
    first = Path(xml).resolve() if xml else own
    if not first.is_file():
        write_fallback_junit(rep, exitstatus, suite_name, first)
    stamp_junit(first, rep.summary)
    out = [first]
    if first != own.resolve():
        write_file(own, first.read_bytes())
        out.append(own)
    return out


def _short(report: pytest.TestReport) -> str:
    """The failure or skip message, without the traceback."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message)
    return str(report.longrepr)[-2000:]


class RunFolderError(ValueError):
    """A run folder that cannot be read: one line naming the file and the key."""


SUMMARY_OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "not_run")


def read_summary(run_dir: Path) -> dict[str, Any]:
    """A run folder's ``summary.json``, checked to be one this suite wrote.

    Raises:
        RunFolderError: no such folder, no ``summary.json``, not a regular file
            (a FIFO), over 64 MiB, nested over 64 deep, not JSON, not an object, a
            key missing (``run``, ``counts``, ``tests``) or of the wrong type
            (``tests[3].outcome``); the message names the file and the key.

    """
    path = Path(run_dir) / "summary.json"
    try:
        if not Path(run_dir).is_dir():
            raise RunFolderError(f"{run_dir}: no such folder")
        data = read_json(path)
    except FileNotFoundError:
        raise RunFolderError(f"{path}: missing: {run_dir} is not a run folder (a run "
                             "writes summary.json at its end)") from None
    except json.JSONDecodeError as exc:
        raise RunFolderError(f"{path}: not valid JSON ({exc.msg} at line "
                             f"{exc.lineno} column {exc.colno}): the run that wrote "
                             "it was cut off") from None
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise RunFolderError(f"{path}: cannot be read ({why})") from None
    if not isinstance(data, dict):
        raise RunFolderError(f"{path}: expected a JSON object, got "
                             f"{type(data).__name__}")
    for key, kind in (("run", dict), ("counts", dict), ("tests", list)):
        if key not in data:
            raise RunFolderError(f"{path}: key {key!r} missing: not a summary this "
                                 "suite wrote")
        if not isinstance(data[key], kind):
            raise RunFolderError(f"{path}: key {key!r}: expected "
                                 f"{'an object' if kind is dict else 'a list'}, got "
                                 f"{type(data[key]).__name__}")
    for k, v in data["counts"].items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise RunFolderError(f"{path}: key 'counts.{k}': expected a whole number "
                                 f">= 0, got {v!r}")
    for i, t in enumerate(data["tests"]):
        if not isinstance(t, dict):
            raise RunFolderError(f"{path}: key 'tests[{i}]': expected an object, got "
                                 f"{type(t).__name__}")
        if not isinstance(t.get("nodeid"), str) or not t["nodeid"]:
            raise RunFolderError(f"{path}: key 'tests[{i}].nodeid': expected the "
                                 f"test's node id, got {t.get('nodeid')!r}")
        if t.get("outcome") not in SUMMARY_OUTCOMES:
            raise RunFolderError(
                f"{path}: key 'tests[{i}].outcome' ({t['nodeid']}): expected one of "
                f"{', '.join(SUMMARY_OUTCOMES)}, got {t.get('outcome')!r}")
    counted = sum(data["counts"].values())
    if counted != len(data["tests"]):
        raise RunFolderError(f"{path}: key 'counts': {counted} test(s) counted, "
                             f"{len(data['tests'])} listed under 'tests'")
    outcome = data["run"].get("outcome")
    if outcome is not None and not isinstance(outcome, str):
        raise RunFolderError(f"{path}: key 'run.outcome': expected a word, got "
                             f"{outcome!r}")
    return data
