"""SIGTERM and SIGHUP end a run like Ctrl-C: a complete run folder, no store left.

CI runners and Kubernetes stop a job with SIGTERM (then SIGKILL after a grace
period); a closed terminal sends SIGHUP. Each case runs the suite in a subprocess on
a slow synthetic test that opened a session store, signals it once the slow test
runs, and checks what a CI gate reads afterwards: ``summary.json`` (outcome
``terminated``, the signal, the counts), ``junit.xml`` (the finished test and the
interrupted ones), the store folders (all gone) and the output (no traceback).
The only clock in the assertions is a generous upper bound on how long the run
takes to stop (:data:`STOP_BOUND_S`), never a tight one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import psutil
import pytest

from selftests.conftest import REPO_ROOT, SUITE_ENV_VARS
from selftests.foundation.synthetic import write_tests

SLOW_S = 300  # the slow tests' sleep: far longer than any trial takes to stop
STOP_BOUND_S = 120  # upper bound for a signalled run to write its reports and exit
TRIALS = 5  # the SIGTERM-to-the-controller case, repeated

STORE_TESTS = {"test_store_and_wait.py": f"""
    import os
    import time
    from pathlib import Path

    import pytest

    from tvc.core.run_store import isolate_store_paths

    pytestmark = [pytest.mark.level1, pytest.mark.hw_any]

    def test_fast():
        pass

    @pytest.mark.parametrize("i", range(4))
    def test_slow(i, tvc_profile):
        prof = tvc_profile
        cfg = isolate_store_paths(prof.kv_transfer_config(), prof.scratch)
        store = Path(cfg["kv_connector_extra_config"]["shared_storage_path"])
        store.mkdir(parents=True, exist_ok=True)
        (store / f"entry-{{i}}").write_bytes(b"kv" * 1024)
        marks = Path(os.environ["TVC_SELFTEST_MARKS"])
        (marks / f"{{os.getpid()}}-{{i}}").write_text(str(store))
        time.sleep({SLOW_S})
    """}


def _profile(tmp_path: Path) -> Path:
    """The example profile with its scratch in ``tmp_path`` (a new folder)."""
    path = tmp_path / "signals.toml"
    path.write_text('[profile]\nname = "signals"\nextends = "example"\n'
                    f'[scratch]\ndir = "{tmp_path / "scratch"}"\n')
    return path


def _start(tmp_path: Path, extra: list[str], ignore_ctrl_c: bool = False
           ) -> tuple[subprocess.Popen[str], Path]:
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in SUITE_ENV_VARS}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["TVC_SELFTEST_MARKS"] = str(marks)
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
            *write_tests(tmp_path / "t", STORE_TESTS),
            f"--tvc-profile={_profile(tmp_path)}",
            f"--tvc-report-dir={tmp_path / 'r'}", *extra]
    # a shell's background job (`cmd &`) starts with SIGINT ignored
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if (
        ignore_ctrl_c) else None
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env=env, preexec_fn=ignore)
    return proc, marks


def _wait_for_slow_tests(marks: Path, n: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + STOP_BOUND_S
    while len({p.name.split("-")[0] for p in marks.iterdir()}) < n:
        if proc.poll() is not None or time.monotonic() > deadline:
            out = proc.communicate()[0] if proc.poll() is not None else ""
            _kill(proc)
            pytest.fail(f"the slow tests did not start on {n} process(es): "
                        f"{out[-3000:]}")
        time.sleep(0.1)


def _kill(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _check_complete_run_folder(tmp_path: Path, proc: subprocess.Popen[str],
                               signum: signal.Signals) -> None:
    """The run folder a CI gate reads after the signal, and nothing left behind."""
    try:
        out = proc.communicate(timeout=STOP_BOUND_S)[0]
    except subprocess.TimeoutExpired:
        _kill(proc)
        out = proc.communicate()[0]
        pytest.fail(f"the run did not stop within {STOP_BOUND_S} s of "
                    f"{signum.name}: {out[-3000:]}")
    assert proc.returncode == 2, out[-3000:]
    report = tmp_path / "r"
    summary = json.loads((report / "summary.json").read_text())
    assert summary["run"]["outcome"] == "terminated", summary["run"]
    assert summary["run"]["signal"] == signum.name, summary["run"]
    assert summary["counts"]["passed"] == 1, summary["counts"]
    assert summary["counts"]["not_run"] == 4, summary["counts"]
    by_id = {t["nodeid"].rpartition("::")[2]: t["outcome"] for t in summary["tests"]}
    assert by_id["test_fast"] == "passed", by_id
    assert {by_id[f"test_slow[{i}]"] for i in range(4)} == {"not_run"}, by_id
    cases = ET.parse(report / "junit.xml").getroot().iter("testcase")
    names = {c.get("name"): c for c in cases}
    assert "test_fast" in names and names["test_fast"].find("failure") is None, (
        sorted(names))
    # junit and summary.json list the same tests (the cut-off one by name)
    assert set(names) - {"tvc-run-outcome"} == set(by_id), sorted(names)
    assert {names[f"test_slow[{i}]"].find("skipped").get("type")
            for i in range(4)} == {"tvc.not_run"}, sorted(names)
    # a gate that reads only junit.xml sees the run was stopped, not green
    stopped = names.get("tvc-run-outcome")
    assert stopped is not None and stopped.find("failure") is not None, sorted(names)
    assert f"terminated by {signum.name}" in stopped.find("failure").get("message")
    assert (report / "summary.md").is_file()
    stores = tmp_path / "scratch" / "run-stores"
    left = sorted(p.name for p in stores.iterdir()) if stores.is_dir() else []
    assert left == [], f"session stores left after {signum.name}: {left}"
    started = [Path(p.read_text()) for p in (tmp_path / "marks").iterdir()]
    assert started and not any(p.exists() for p in started), started
    assert "Traceback" not in out, out[-3000:]
    assert len(out.splitlines()) < 60, out[-3000:]


def _no_process_left(proc: subprocess.Popen[str]) -> None:
    alive = [p for p in psutil.process_iter(["environ"]) if _ours(p, proc)]
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    assert alive == [], f"processes of the signalled run left: {alive}"


def _ours(p: psutil.Process, proc: subprocess.Popen[str]) -> bool:
    """A live process of the signalled run's group (a zombie has ended already:
    a container's init may be slow to reap one whose parent exited first)."""
    with contextlib.suppress(psutil.Error):
        return os.getpgid(p.pid) == proc.pid and p.status() != psutil.STATUS_ZOMBIE
    return False


@pytest.mark.parametrize("trial", range(TRIALS))
def test_sigterm_to_the_controller_leaves_a_complete_run_folder(
        tmp_path: Path, trial: int) -> None:
    proc, marks = _start(tmp_path, ["-p", "no:xdist"])
    _wait_for_slow_tests(marks, 1, proc)
    proc.send_signal(signal.SIGTERM)  # `kill PID`: the controller alone
    _check_complete_run_folder(tmp_path, proc, signal.SIGTERM)
    _no_process_left(proc)


@pytest.mark.parametrize(("signum", "target", "workers"), [
    (signal.SIGHUP, "group", 0),
    (signal.SIGTERM, "group", 0),
    (signal.SIGTERM, "controller", 2),
    (signal.SIGTERM, "group", 2),
    (signal.SIGHUP, "controller", 2),
], ids=lambda v: getattr(v, "name", str(v)))
def test_terminating_signal_leaves_a_complete_run_folder(
        tmp_path: Path, signum: signal.Signals, target: str, workers: int) -> None:
    """Serial and xdist runs; the signal to the controller or its process group."""
    if workers and importlib.util.find_spec("xdist") is None:
        pytest.skip("pytest-xdist is not installed: pip install pytest-xdist")
    proc, marks = _start(tmp_path, ["-n", str(workers)] if workers
                         else ["-p", "no:xdist"])
    _wait_for_slow_tests(marks, max(workers, 1), proc)
    if target == "group":
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    _check_complete_run_folder(tmp_path, proc, signum)
    _no_process_left(proc)


START_HOOK = {"conftest.py": """
    import os
    import signal
    import subprocess
    import threading
    import time
    from pathlib import Path

    # a thread the main thread's signal mask does not cover, as a native
    # library's: the kernel hands it the SIGINT the main thread holds
    threading.Thread(target=threading.Event().wait, daemon=True).start()

    def pytest_xdist_setupnodes(config, specs):
        # Ctrl-C to the whole group right after the first worker's process
        # exists and before execnet hands it its bootstrap
        popen = subprocess.Popen

        class CtrlCAtSpawn(popen):
            def __init__(self, args, *a, **kw):
                super().__init__(args, *a, **kw)
                if "-c" in list(args) and subprocess.Popen is CtrlCAtSpawn:
                    subprocess.Popen = popen
                    (Path(os.environ["TVC_SELFTEST_MARKS"]) / "spawning").write_text("")
                    os.killpg(0, signal.SIGINT)
                    time.sleep(0.2)  # the other thread takes it meanwhile

        subprocess.Popen = CtrlCAtSpawn
    """}


def test_ctrl_c_while_xdist_workers_start_prints_no_traceback(tmp_path: Path
                                                              ) -> None:
    """Ctrl-C (SIGINT to the process group) while the first worker boots.

    A worker imports execnet before pytest; a Ctrl-C then printed its interpreter
    traceback over the output (4 of 5 trials). The controller holds SIGINT away
    from the workers while they start and stops the run itself, also when the
    kernel hands the SIGINT to a thread of the controller other than the main
    one (CI: a worker that never got its bootstrap printed a SyntaxError).
    """
    if importlib.util.find_spec("xdist") is None:
        pytest.skip("pytest-xdist is not installed: pip install pytest-xdist")
    write_tests(tmp_path / "t", START_HOOK)
    proc, marks = _start(tmp_path, ["-n", "2"])
    try:
        out = proc.communicate(timeout=STOP_BOUND_S)[0]
    except subprocess.TimeoutExpired:
        _kill(proc)
        pytest.fail("the run did not stop after Ctrl-C during worker start")
    assert (marks / "spawning").exists(), f"no worker was spawned: {out[-3000:]}"
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "Fatal Python error" not in out, out[-3000:]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["run"]["outcome"] == "interrupted", summary["run"]
    assert (tmp_path / "r" / "junit.xml").is_file()
    stores = tmp_path / "scratch" / "run-stores"
    assert not stores.is_dir() or [p.name for p in stores.iterdir()] == []
    _no_process_left(proc)


def test_ctrl_c_to_the_group_under_xdist_names_no_red(tmp_path: Path) -> None:
    """Ctrl-C to the process group while two workers run slow tests: the tests they
    were running never finished (not run), so no ``tvc: RED`` line, no red in
    ``failures.md`` and no failure in pytest's counts (never-harm probe: each
    "worker 'gw0' crashed while running" was a red there, 3 of 3 runs). The run
    starts as a shell's background job does, with SIGINT ignored: the controller
    keeps ignoring it and only the workers stop."""
    if importlib.util.find_spec("xdist") is None:
        pytest.skip("pytest-xdist is not installed: pip install pytest-xdist")
    proc, marks = _start(tmp_path, ["-n", "2"], ignore_ctrl_c=True)
    _wait_for_slow_tests(marks, 2, proc)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out = proc.communicate(timeout=STOP_BOUND_S)[0]
    except subprocess.TimeoutExpired:
        _kill(proc)
        pytest.fail("the run did not stop after Ctrl-C")
    assert proc.returncode == 2, out[-3000:]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["run"]["outcome"] == "interrupted", summary["run"]
    assert summary["counts"]["failed"] == summary["counts"]["error"] == 0, (
        summary["counts"])
    assert summary["counts"]["not_run"] == 4, summary["counts"]
    assert "tvc: RED" not in out and " failed" not in out.splitlines()[-1], (
        out[-3000:])
    page = (tmp_path / "r" / "failures.md").read_text()
    assert "No red." in page and "crashed" not in page, page
    _no_process_left(proc)


def test_a_worker_that_crashes_on_its_own_is_still_a_red(tmp_path: Path) -> None:
    """The other side of the rule above: with no signal, a worker that dies in a
    test (a connector's native crash) is a red naming the test."""
    if importlib.util.find_spec("xdist") is None:
        pytest.skip("pytest-xdist is not installed: pip install pytest-xdist")
    crash = {"test_crash.py": """
        import os

        import pytest

        pytestmark = [pytest.mark.level1, pytest.mark.hw_any]

        def test_fine():
            pass

        def test_dies():
            os._exit(1)
        """}
    env = {k: v for k, v in os.environ.items() if k not in SUITE_ENV_VARS}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
         *write_tests(tmp_path / "t", crash), f"--tvc-profile={_profile(tmp_path)}",
         f"--tvc-report-dir={tmp_path / 'r'}", "-n", "2"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=STOP_BOUND_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "tvc: RED 1:" in out and "test_dies" in out, out[-3000:]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    by_id = {t["nodeid"].rpartition("::")[2]: t for t in summary["tests"]}
    assert by_id["test_dies"]["outcome"] in ("failed", "error"), by_id
    assert "crashed" in by_id["test_dies"]["message"], by_id["test_dies"]
