"""Shared machinery for the suite's own tests: run the suite in a subprocess.

The suite's checks are proved by running them against known-bad environments built in
temp dirs. :func:`run_suite` runs ``python -m pytest`` from the repo root in a fresh
interpreter with a chosen environment and returns the exit code, the output and the
parsed ``summary.json`` (see :mod:`tvc.plugin.report`), so a self-test can assert that a
check FAILED and that its message names the cause and the fix.

Usage from a self-test::

    from selftests.conftest import run_suite

    def test_x(tmp_path):
        run = run_suite(["suites/level1/test_vllm_install.py", "-k", "torch_matches"],
                        tmp_path / "report", env={"TVC_VLLM_SOURCE": str(tree)})
        t = run.test("test_torch_matches_vllm_pin")
        assert t["outcome"] == "failed" and "9.9.9" in t["message"]

or through the ``suite_runner`` fixture, which picks a fresh report folder under
``tmp_path`` for every call.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# One CPU thread per process for torch (OpenMP) here and in every suite run a
# self-test starts: under `-n 2` on 2 cores, each process's own pool of one
# thread per core spins against the other's (a panel member's tier: 183 s of CPU
# with an inner `-n 2`, 55 s serial with one thread, same tests and results)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The signal self-tests send SIGINT/SIGHUP to suite runs they start: a run
# launched in the background of a non-interactive shell (or under nohup) inherits
# both as ignored, and so would every run it starts. Give them their default
# actions back here (before xdist starts its workers), so those tests see what a
# terminal or CI runner does, whatever started this run.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)

REPO_ROOT = Path(__file__).resolve().parent.parent

pytest_plugins = ["pytester"]  # the plugin's own self-tests run pytest in pytester

# Variables a caller's shell may set that would change which profile/strictness/report
# folder the child run uses; they are dropped unless the caller passes them in ``env``.
SUITE_ENV_VARS = ("TVC_PROFILE", "TVC_REQUIRE", "TVC_REPORT_DIR", "TVC_SEED",
                  "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER", "PYTEST_CURRENT_TEST")


@dataclass
class SuiteRun:
    """The outcome of one suite run in a subprocess.

    Attributes:
        rc: pytest's exit code (0 ok, 1 tests failed, 4 usage error, 5 nothing ran).
        stdout: stdout and stderr of the run, interleaved.
        summary: the parsed ``summary.json``, or None when the run wrote none
            (e.g. a usage error at start-up).
        report_dir: the ``--tvc-report-dir`` the run used.
    """

    rc: int
    stdout: str
    summary: dict[str, Any] | None
    report_dir: Path

    def test(self, name: str) -> dict[str, Any]:
        """The summary entry of the one test whose node id contains ``name``.

        Args:
            name: a substring of the node id, e.g. ``"test_torch_matches_vllm_pin"``
                or ``"[TMPDIR]"``.

        Returns:
            dict with ``nodeid``, ``outcome``, ``message``, ``properties``...

        Raises:
            AssertionError: no summary, or not exactly one matching test (the
                message shows the run's output to debug with).
        """
        assert self.summary is not None, (
            f"no summary.json (rc {self.rc}):\n{self.tail()}")
        hits = [t for t in self.summary["tests"] if name in t["nodeid"]]
        assert len(hits) == 1, (
            f"expected one test matching {name!r}, got "
            f"{[t['nodeid'] for t in hits]} of "
            f"{[t['nodeid'] for t in self.summary['tests']]}\n{self.tail()}")
        return hits[0]

    def junit(self) -> ET.Element:
        """The parsed ``junit.xml`` root element."""
        return ET.parse(self.report_dir / "junit.xml").getroot()

    def tail(self, chars: int = 4000) -> str:
        """The last ``chars`` characters of the output, for assertion messages."""
        return self.stdout[-chars:]


def run_suite(args: Sequence[str], report_dir: Path,
              env: Mapping[str, str | None] | None = None,
              timeout_s: float = 300) -> SuiteRun:
    """Run the suite in a fresh interpreter from the repo root.

    Runs ``[sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider",
    "--tvc-report-dir", report_dir]`` with cwd = repo root.

    Args:
        args: pytest arguments (test paths, ``-k``, ``--tvc-profile``...).
        report_dir: the run folder for ``junit.xml`` / ``summary.json``.
        env: overrides on top of ``os.environ`` (minus :data:`SUITE_ENV_VARS`);
            a value of None removes the variable (e.g. ``{"CUDA_HOME": None}``).
        timeout_s: wall-clock limit in seconds.

    Returns:
        the :class:`SuiteRun`.
    """
    full_env = {k: v for k, v in os.environ.items() if k not in SUITE_ENV_VARS}
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    argv = [sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider",
            "--tvc-report-dir", str(report_dir)]
    proc = subprocess.run(argv, cwd=REPO_ROOT, env=full_env, capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    summary_path = Path(report_dir) / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    return SuiteRun(rc=proc.returncode, stdout=proc.stdout + proc.stderr,
                    summary=summary, report_dir=Path(report_dir))


#: self-test files of long, independent tests (each runs the suite in a fresh
#: process, no module-scoped fixture): under ``-n N`` their tests spread over the
#: workers instead of holding one worker for the whole file
SPREAD = frozenset(f"selftests/contract/{name}.py" for name in (
    "test_panel_connectors", "test_worker_report", "test_invariant_bad_connectors",
    "test_exploration_seeds", "test_exploration", "test_scenario_bad_connectors",
    "test_bad_connectors"))

if importlib.util.find_spec("xdist") is not None:

    @pytest.hookimpl(optionalhook=True)  # -p no:xdist leaves the hook unknown
    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        """Under ``-n N``, send each self-test file whole to one worker.

        Self-test modules share expensive module-scoped suite runs (each imports
        vLLM or compiles with Inductor); xdist's default ``load`` scheduling spreads a
        module over workers and repeats those runs on each (``selftests/foundation``
        with ``-n 2``: 138 s with ``load``, 64 s file by file). The suite's GPU
        owners still run as one unit (:func:`tvc.plugin.run_control.make_scheduler`). An
        explicit ``--dist`` other than ``load`` is respected.

        Returns:
            the scheduler, or None to keep xdist's choice.
        """
        if config.getoption("dist") != "load":
            return None
        from tvc.plugin.run_control import make_scheduler

        sched = make_scheduler(config, log, by_file=True, spread=SPREAD)
        if sched is not None:
            return sched
        from xdist.scheduler import LoadFileScheduling

        return LoadFileScheduling(config, log)


@pytest.fixture
def suite_runner(tmp_path: Path):
    """A :func:`run_suite` that uses a fresh report folder under ``tmp_path``.

    Returns:
        callable ``(args, env=None, timeout_s=300) -> SuiteRun``.
    """
    counter = iter(range(1_000_000))

    def runner(args: Sequence[str], env: Mapping[str, str | None] | None = None,
               timeout_s: float = 300) -> SuiteRun:
        return run_suite(args, tmp_path / f"report-{next(counter)}", env, timeout_s)

    return runner
