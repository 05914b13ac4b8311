"""Run reports: JUnit XML plus a JSON summary of the same, under ``reports/``.

Every run writes, without extra flags, into one run folder
``reports/<UTC time>-<profile>/`` (or ``--tvc-report-dir``):

- ``junit.xml``: pytest's JUnit XML; suite-level properties carry versions, hardware
  and profile; test-level properties carry each test's figures (``record_property``).
- ``summary.json``: the same facts as JSON: ``run`` (with ``outcome``: ``passed``,
  ``failed``, ``interrupted``, ``terminated`` (SIGTERM/SIGHUP, named in
  ``run.signal``), ``internal_error``, ``usage_error``, ``no_tests``; the
  ``seed``), ``versions``, ``hardware``, ``profile``, ``counts``
  (passed/failed/skipped/error), ``deselected`` (per tier: how many and why),
  ``tests`` (one entry each with outcome, duration in s, tier markers, properties and
  a one-paragraph message).

A run stopped before pytest wrote its JUnit file (Ctrl-C during start-up or
shutdown) still gets one (:func:`write_fallback_junit`).

``reports/latest`` points at the newest run folder.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from tvc.config.paths import DATA_DIR, reports_root
from tvc.plugin.findings import findings


def _tiers_from_markers_ini() -> tuple[str, ...]:
    """The tier markers, in ladder order: the ``[tiers]`` section of markers.ini.

    markers.ini is the one list of markers; a missing or malformed file gives an
    empty tuple here (the plugin reports it as a usage error at start-up).
    """
    import configparser

    cp = configparser.ConfigParser(interpolation=None)
    try:
        cp.read(DATA_DIR / "markers.ini")
        return tuple(cp["tiers"]) if cp.has_section("tiers") else ()
    except configparser.Error:
        return ()


TIER_MARKERS = _tiers_from_markers_ini()
# pytest's exit codes (_pytest.config.ExitCode) as the run's outcome word
OUTCOME_BY_EXIT = {0: "passed", 1: "failed", 2: "interrupted", 3: "internal_error",
                   4: "usage_error", 5: "no_tests"}


def default_run_dir(profile_name: str, selftests: bool = False,
                    invocation_dir: Path | None = None) -> Path:
    """A fresh run folder name: ``reports/<YYYYmmdd-HHMMSS>-<profile>[-N]``.

    ``reports/`` is :func:`tvc.config.paths.reports_root`: ``$TVC_REPORTS_ROOT``
    (the self-tests use it so that they never touch a user's reports/), the
    checkout's ``reports/``, or, installed, ``./reports`` of ``invocation_dir``.

    Args:
        profile_name: the profile's name (the folder's suffix).
        selftests: a run of the suite's own tests (``selftests/``): the folder goes
            under ``reports/selftests/``, so it never becomes ``reports/latest``
            (which names the newest conformance run).
        invocation_dir: the directory pytest was started in (default: the
            current directory).

    """
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    base_root = reports_root(invocation_dir)
    root = base_root / "selftests" if selftests else base_root
    base = root / f"{stamp}-{profile_name}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


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

    Args:
        run_dir: the run folder (created here).
        meta: run-level facts (profile, hardware, versions, args) for both reports.

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

    def expect(self, nodeids: Iterable[str]) -> None:
        """Record the tests the run is to run, as ``not_run`` until they report.

        So a run cut short (Ctrl-C, a time limit, ``-x``) counts every test that
        never started, not only those it was in the middle of.

        Args:
            nodeids: the node ids left after collection and deselection.

        """
        for nodeid in nodeids:
            parts = nodeid.split("/")
            tier = parts[1] if len(parts) > 2 and parts[0] == "suites" else ""
            self.tests.setdefault(nodeid, {
                "nodeid": nodeid, "outcome": "not_run", "duration_s": 0.0,
                "tiers": [tier] if tier in TIER_MARKERS else [], "properties": {},
                "message": "",
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

        (E.g. a time limit that fired in a hook between two phases of a test:
        without this the report would list the stuck test as never run.)
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
        entry["tiers"] = sorted(
            m for m in TIER_MARKERS if m in getattr(report, "keywords", {})
        )
        for name, value in report.user_properties:
            entry["properties"][name] = value
        if report.failed:
            if entry["outcome"] not in ("failed", "error"):
                entry["outcome"] = "failed" if report.when == "call" else "error"
                entry["message"] = _short(report)
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

    def counts(self) -> dict[str, int]:
        """Number of tests per outcome.

        Returns:
            ``passed``, ``failed``, ``skipped``, ``error``, ``xfailed`` (known
            upstream defects, strict xfails), and ``not_run`` only
            when an interrupted run left tests whose body never ran.

        """
        out = {"passed": 0, "failed": 0, "skipped": 0, "error": 0, "xfailed": 0}
        for t in self.tests.values():
            out[t["outcome"]] = out.get(t["outcome"], 0) + 1
        return out

    def outcome(self, exitstatus: int) -> str:
        """The run's outcome word: :data:`OUTCOME_BY_EXIT`, or ``terminated``.

        An interrupted run (exit 2) stopped by SIGTERM or SIGHUP
        (:attr:`terminated_by`) is ``terminated``.
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
            OSError: the run folder cannot be written (checked at start-up, see
                :func:`check_run_dir`, so only a disk that fails mid-run gets here).

        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        run = {**self.meta.get("run", {}), "exit_status": int(exitstatus),
               "outcome": self.outcome(exitstatus),
               "duration_s": round(time.time() - self.started, 3)}
        run.setdefault("host", platform.node())
        run.setdefault("pythonpath", os.environ.get("PYTHONPATH", ""))
        if self.terminated_by:
            run["signal"] = self.terminated_by
        summary = {
            **self.meta,
            "run": run,
            "counts": self.counts(),
            "deselected": self.deselected,
            "tests": sorted(self.tests.values(), key=lambda t: t["nodeid"]),
            **self.extra,
        }
        summary["findings"] = findings(summary["tests"], summary.get("profile", {}),
                                       run.get("seed"), run["pythonpath"],
                                       run.get("require") or ())
        run["outcome_reason"] = outcome_reason(summary)
        self.summary = summary
        path = self.run_dir / "summary.json"
        path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
        self.written = True
        root = reports_root(self.invocation_dir)
        if self.run_dir.parent == root and self.tests:
            latest = root / "latest"
            try:
                if latest.is_symlink() or latest.exists():
                    latest.unlink()
                os.symlink(self.run_dir.name, latest)
            except OSError:
                pass
        return path


def write_fallback_junit(rep: RunReport, exitstatus: int, suite_name: str,
                         path: Path | None = None) -> Path:
    """Write a JUnit file from the run's record when pytest wrote none.

    pytest writes its JUnit file at the end of the session; a run stopped before that
    (Ctrl-C during start-up, collection or shutdown) would leave a CI gate without
    one. This one lists the tests recorded so far, each not-run test as skipped;
    :func:`stamp_junit` then adds the run's outcome.

    Args:
        rep: the run's :class:`RunReport`.
        exitstatus: pytest's exit code.
        suite_name: the ``<testsuite name>``.
        path: where to write it (default ``<run>/junit.xml``).

    Returns:
        the path written.

    """
    root = ET.Element("testsuites")
    suite = ET.SubElement(root, "testsuite", name=suite_name)
    props = ET.SubElement(suite, "properties")
    for name, value in rep.flat_properties():
        ET.SubElement(props, "property", name=name, value=value)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for t in sorted(rep.tests.values(), key=lambda t: t["nodeid"]):
        nodepath, _, name = t["nodeid"].rpartition("::")
        case = ET.SubElement(suite, "testcase", classname=junit_classname(nodepath),
                             name=name, time=str(t["duration_s"]))
        counts["tests"] += 1
        o = t["outcome"]
        if o == "failed":
            ET.SubElement(case, "failure", message=t["message"][:2000])
            counts["failures"] += 1
        elif o == "error":
            ET.SubElement(case, "error", message=t["message"][:2000])
            counts["errors"] += 1
        elif o in ("skipped", "not_run", "xfailed"):
            ET.SubElement(case, "skipped", message=t["message"][:2000] or
                          "not run: the run stopped first")
            counts["skipped"] += 1
    for k, v in counts.items():
        suite.set(k, str(v))
    path = path or rep.run_dir / "junit.xml"
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
    return path


def junit_classname(path: str) -> str:
    """JUnit ``classname`` of a test file: ``a/b/test_c.py`` -> ``a.b.test_c``."""
    return path.removesuffix(".py").replace("/", ".")


#: the name of the JUnit case that carries a run's non-passing outcome
OUTCOME_CASE = "tvc-run-outcome"


def outcome_reason(summary: dict[str, Any]) -> str:
    """Why a run did not pass, in one line (``""`` for a run that passed).

    Reads ``run`` (``outcome``, ``exit_status``, ``signal``), ``counts`` and
    ``coverage`` of a ``summary.json`` (older files without ``outcome`` are read
    by their ``exit_status``).

    Args:
        summary: the parsed ``summary.json``.

    Returns:
        e.g. ``terminated by SIGTERM: 12 test(s) never ran``, or ``coverage gate
        (--tvc-require coverage) failed: the connector overrides take_events but
        no test exercised it with a meaningful input``.

    """
    run = summary.get("run") or {}
    c = summary.get("counts") or {}
    status = int(run.get("exit_status", 0) or 0)
    outcome = run.get("outcome") or OUTCOME_BY_EXIT.get(status, f"exit_{status}")
    if outcome == "passed":
        return ""
    bad = int(c.get("failed", 0)) + int(c.get("error", 0))
    never = int(c.get("not_run", 0))
    never_s = f"; {never} test(s) never ran" if never else ""
    cov = summary.get("coverage") or {}
    if outcome == "terminated":
        return f"terminated by {run.get('signal') or 'a signal'}{never_s}"
    if outcome == "interrupted":
        return f"interrupted (Ctrl-C){never_s}"
    if outcome == "failed" and not bad and cov.get("strict") and cov.get(
            "missing_overridden"):
        return ("coverage gate (--tvc-require coverage) failed: the connector "
                f"overrides {', '.join(cov['missing_overridden'])} but no test "
                "exercised it with a meaningful input")
    if outcome == "failed":
        return f"{bad} test(s) failed or errored" if bad else "pytest exit status 1"
    return {"internal_error": "pytest hit an internal error",
            "usage_error": "pytest was given bad arguments",
            "no_tests": "no test ran (nothing collected or all deselected)",
            }.get(outcome, f"pytest exit status {status}")


def stamp_suite(suite: ET.Element, summary: dict[str, Any]) -> None:
    """Put a run's outcome into one ``<testsuite>`` (see :func:`stamp_junit`).

    Args:
        suite: the element (changed in place).
        summary: the run's ``summary.json`` content.

    """
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


def stamp_junit(path: Path, summary: dict[str, Any]) -> None:
    """Put the run's outcome into a JUnit file, so a gate reading it sees it.

    Every ``<testsuite>`` gets the properties ``tvc.run.outcome`` and
    ``tvc.run.exit_status``; a run that did not pass (a signal, a coverage
    gate, no tests) also gets one ``<testcase classname="tvc.run"
    name="tvc-run-outcome">`` with a ``<failure>`` saying why
    (:func:`outcome_reason`), counted in the suite's ``tests``/``failures`` --
    except a run that failed because tests failed (its cases show it; the
    counts stay those of the tests). Stamping twice changes nothing.

    Args:
        path: the JUnit XML file (rewritten in place).
        summary: the run's ``summary.json`` content.

    Raises:
        OSError, xml.etree.ElementTree.ParseError: the file cannot be read.

    """
    tree = ET.parse(path)
    root = tree.getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    for suite in suites:
        stamp_suite(suite, summary)
    if root.tag == "testsuites":
        for attr in ("tests", "failures"):
            if root.get(attr) is not None:
                root.set(attr, str(sum(int(s.get(attr, "0") or 0) for s in suites)))
    tree.write(path, encoding="utf-8", xml_declaration=True)


def finish_junit(rep: RunReport, exitstatus: int, xml: Path | None,
                 suite_name: str) -> list[Path]:
    """The run's JUnit files, complete: the user's ``--junitxml`` and the run folder's.

    After :meth:`RunReport.write`: writes a fallback file where pytest wrote none
    (:func:`write_fallback_junit`), stamps the outcome into it
    (:func:`stamp_junit`) and, when the user chose another path with
    ``--junitxml``, copies it to ``<run>/junit.xml`` too.

    Args:
        rep: the run's report (written).
        exitstatus: the run's exit status.
        xml: the JUnit path pytest was given (``config.option.xmlpath``), or None.
        suite_name: the ini's ``junit_suite_name``.

    Returns:
        the files written.

    """
    own = rep.run_dir / "junit.xml"
    first = Path(xml).resolve() if xml else own
    if not first.is_file():
        write_fallback_junit(rep, exitstatus, suite_name, first)
    stamp_junit(first, rep.summary)
    out = [first]
    if first != own.resolve():
        own.write_bytes(first.read_bytes())
        out.append(own)
    return out


def holds_suite_run(path: Path) -> bool:
    """True when ``path/summary.json`` is one this suite wrote.

    That is a JSON object with ``run``, ``counts`` and ``tests``: reusing such a
    folder overwrites only the suite's own files; a user's file of that name does
    not qualify.
    """
    try:
        data = json.loads((path / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"run", "counts", "tests"} <= data.keys()


def check_run_dir(path: Path) -> str:
    """Why ``path`` cannot be a run folder ('' when it can).

    A run folder must be a directory this user can create and write, and must not
    be a non-empty directory that holds anything but an earlier run (so a stray
    ``--tvc-report-dir=.`` never mixes reports into someone's files).
    """
    if path.exists() and not path.is_dir():
        return f"{path} exists and is not a directory"
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable by this user"
    if path.is_dir() and any(path.iterdir()) and not holds_suite_run(path):
        return (f"{path} is a non-empty folder that holds no earlier run of this "
                "suite (a summary.json it wrote); choose an empty or new folder")
    try:  # the only sure test: create it and write into it
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".tvc-write-test-"):
            pass
    except OSError as exc:
        return f"{path} cannot be created or written ({exc.strerror})"
    return ""


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

    Args:
        run_dir: the run folder.

    Returns:
        the parsed summary.

    Raises:
        RunFolderError: no such folder, no ``summary.json``, not JSON, not an
            object, a key missing (``run``, ``counts``, ``tests``) or of the
            wrong type (``tests[3].outcome``); the message names the file and
            the key.

    """
    path = Path(run_dir) / "summary.json"
    if not Path(run_dir).is_dir():
        raise RunFolderError(f"{run_dir}: no such folder")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RunFolderError(f"{path}: missing: {run_dir} is not a run folder (a run "
                             "writes summary.json at its end)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RunFolderError(f"{path}: cannot be read ({exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RunFolderError(f"{path}: not valid JSON ({exc.msg} at line "
                             f"{exc.lineno} column {exc.colno}): the run that wrote "
                             "it was cut off") from None
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
