"""The plugin's run control: inert elsewhere, xdist grouping, variants, interrupts.

Every case runs pytest in a subprocess on synthetic test files (see
:mod:`selftests.foundation.synthetic`) and checks what a user would see: which
worker ran which test, the lines printed, the run folder left behind, the processes
left alive.
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

from selftests.conftest import REPO_ROOT, SUITE_ENV_VARS, run_suite
from selftests.foundation.synthetic import write_tests
from tvc.plugin import run_control

needs_xdist = pytest.mark.skipif(importlib.util.find_spec("xdist") is None,
                                 reason="pytest-xdist is not installed: pip install "
                                        "pytest-xdist")

OWNER_TESTS = {"test_owners.py": """
    import os

    import pytest

    pytestmark = [pytest.mark.hw_any]

    @pytest.fixture
    def vllm_server():  # same name as the suite's server owner (tvc/fixtures/vllm.py)
        return "server"

    def _worker(record_property):
        record_property("worker", os.environ.get("PYTEST_XDIST_WORKER", ""))

    @pytest.mark.level1
    @pytest.mark.parametrize("i", range(6))
    def test_owner(vllm_server, i, record_property):
        _worker(record_property)

    @pytest.mark.e2e
    @pytest.mark.parametrize("i", range(4))
    def test_tier(i, record_property):
        _worker(record_property)

    @pytest.mark.level1
    @pytest.mark.parametrize("i", range(8))
    def test_free(i, record_property):
        _worker(record_property)

    @pytest.mark.bandwidth
    def test_worker_writes_into_the_run_folder(record_property, tvc_run_dir):
        import json

        _worker(record_property)
        run_dir = tvc_run_dir
        assert run_dir is not None
        (run_dir / "bandwidth.json").write_text(json.dumps({
            "write": {"1048576": {"median_gbps": 5.5}},
            "read": {"1048576": {"median_gbps": 6.5}},
            "threshold_gbps": 7.0, "tier": "one disk"}))
    """}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SUITE_ENV_VARS}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


# ---------------------------------------------------------------- inert elsewhere

def test_plugin_is_inert_outside_the_suite(tmp_path: Path) -> None:
    """A user's own test folder: options only; no profile, no run folder.

    The folder's conftest owns ``--profile`` (as pytest-profiling would); the
    suite, whose options are all ``--tvc-*``, leaves it alone.
    """
    proj = tmp_path / "user-project"
    write_tests(proj, {
        "conftest.py": """
            def pytest_addoption(parser):
                parser.addoption("--profile", default="none")
            """,
        "test_mine.py": """
            def test_mine(request):
                assert request.config.getoption("profile") == "fast"
            """})
    reports = tmp_path / "reports-root"
    env = {**_env(), "TVC_REPORTS_ROOT": str(reports)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "--profile=fast"], cwd=proj, env=env, text=True,
                          capture_output=True, timeout=300, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "tutti-vllm-conformance" in out  # the plugin did load (entry point)
    assert "profile:" not in out and "reports:" not in out and "seed:" not in out
    assert not reports.exists()
    assert sorted(p.name for p in proj.iterdir()) == ["conftest.py", "test_mine.py"]
    helped = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                             "--help"], cwd=proj, env=env, text=True,
                            capture_output=True, timeout=300, check=False)
    assert helped.returncode == 0 and "--tvc-profile" in helped.stdout
    # -m naming a tier of the suite, nothing collected: one line says why and how
    tier = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "-m", "level1 and not slow", "--profile=fast"], cwd=proj,
                          env=env, text=True, capture_output=True, timeout=300,
                          check=False)
    hint = [line for line in tier.stdout.splitlines() if line.startswith("tvc:")]
    assert tier.returncode == 5 and len(hint) == 1, tier.stdout[-3000:]
    assert "tier(s) level1 of tutti-vllm-conformance" in hint[0], hint
    assert "--tvc-profile example" in hint[0], hint
    assert not reports.exists()
    other = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                            "-m", "slow", "--profile=fast"], cwd=proj, env=env,
                           text=True, capture_output=True, timeout=300, check=False)
    assert other.returncode == 5 and "tvc:" not in other.stdout, other.stdout


def test_import_mode_importlib_loads_plugin_and_fixtures(tmp_path: Path) -> None:
    run = run_suite(["suites/level1/test_vllm_install.py", "-k", "vllm_imports",
                     "--import-mode=importlib", "-p", "no:xdist"], tmp_path / "r")
    assert run.rc == 0, run.tail()
    assert run.test("test_vllm_imports")["outcome"] == "passed"


# ------------------------------------------------------------------ xdist grouping

def _workers_by_test(run) -> dict[str, set[str]]:
    """Test function name -> the xdist workers its cases ran on."""
    workers: dict[str, set[str]] = {}
    for t in run.summary["tests"]:
        kind = t["nodeid"].split("::")[-1].split("[")[0]
        workers.setdefault(kind, set()).add(t["properties"]["worker"])
    return workers


@needs_xdist
def test_gpu_owners_run_on_one_worker_and_worker_files_reach_the_summary(
        tmp_path: Path) -> None:
    run = run_suite([*write_tests(tmp_path / "t", OWNER_TESTS), "-n", "2"],
                    tmp_path / "r")
    assert run.rc == 0, run.tail()
    assert "xdist: --dist load: tests that own a GPU server" in run.stdout
    workers = _workers_by_test(run)
    owners = (workers["test_owner"] | workers["test_tier"]
              | workers["test_worker_writes_into_the_run_folder"])
    assert len(owners) == 1 and "" not in owners, workers  # one xdist worker
    assert len(run.summary["tests"]) == 19
    # a worker wrote bandwidth.json into the controller's run folder: the page has it
    assert (run.report_dir / "bandwidth.json").is_file()
    assert "| 1 MiB | 5.50 | 6.50 |" in (run.report_dir / "summary.md").read_text()


LANE_B_TESTS = {**OWNER_TESTS, "test_lane_b.py": """
    import os

    import pytest

    pytestmark = [pytest.mark.hw_any, pytest.mark.e2e]

    def tvc_servers(config, model, params):  # plans its own servers: lane B
        return []

    @pytest.mark.parametrize("i", range(4))
    def test_own_servers(i, record_property):
        record_property("worker", os.environ.get("PYTEST_XDIST_WORKER", ""))
    """}


@needs_xdist
@pytest.mark.parametrize("lanes", [None, "1"])
def test_tests_planning_their_own_servers_get_a_second_gpu_lane(
        tmp_path: Path, lanes: str | None) -> None:
    extra = [] if lanes is None else [f"--tvc-gpu-lanes={lanes}"]
    run = run_suite([*write_tests(tmp_path / "t", LANE_B_TESTS), "-n", "3", *extra],
                    tmp_path / "r")
    assert run.rc == 0, run.tail()
    workers = _workers_by_test(run)
    lane_a = workers["test_owner"] | workers["test_tier"]
    lane_b = workers["test_own_servers"]
    assert len(lane_a) == 1 and len(lane_b) == 1, workers
    if lanes is None:  # default with -n 3: two lanes, on two workers
        assert lane_a != lane_b, workers
        assert "in 2 GPU lane(s)" in run.stdout
    else:
        assert lane_a == lane_b, workers


LANE_C_TESTS = {**LANE_B_TESTS, "test_lane_c.py": """
    import os

    import pytest

    pytestmark = [pytest.mark.hw_any, pytest.mark.e2e]
    tvc_restarts_server = True  # its server starts come one after another: lane C

    def tvc_servers(config, model, params):
        return []

    def test_restart(record_property):
        record_property("worker", os.environ.get("PYTEST_XDIST_WORKER", ""))
    """}


@needs_xdist
def test_a_test_restarting_its_server_gets_a_third_lane_with_six_workers(
        tmp_path: Path) -> None:
    run = run_suite([*write_tests(tmp_path / "t", LANE_C_TESTS), "-n", "6"],
                    tmp_path / "r")
    assert run.rc == 0, run.tail()
    workers = _workers_by_test(run)
    lane_a = workers["test_owner"] | workers["test_tier"]
    lane_b, lane_c = workers["test_own_servers"], workers["test_restart"]
    assert len(lane_a) == len(lane_b) == len(lane_c) == 1, workers
    assert len(lane_a | lane_b | lane_c) == 3, workers  # three workers
    assert "in 3 GPU lane(s)" in run.stdout


PLAIN_FIRST = {"test_a_plain.py": """
    import os
    import time

    import pytest

    pytestmark = [pytest.mark.hw_any, pytest.mark.contract]

    @pytest.mark.parametrize("i", range(24))
    def test_plain(i, record_property):
        record_property("worker", os.environ.get("PYTEST_XDIST_WORKER", ""))
        time.sleep(0.05)
    """, **LANE_C_TESTS}


@needs_xdist
def test_the_restart_chain_starts_before_the_tests_collected_ahead_of_it(
        tmp_path: Path) -> None:
    """Lane C's test is its worker's first, though 24 plain tests (each a scope
    of its own, as large as lane C's) are collected before it."""
    files = {k: v.replace('record_property("worker", os.environ.get('
                          '"PYTEST_XDIST_WORKER", ""))',
                          'record_property("worker", os.environ.get('
                          '"PYTEST_XDIST_WORKER", "")); '
                          'record_property("t", __import__("time").time())')
             for k, v in PLAIN_FIRST.items()}
    run = run_suite([*write_tests(tmp_path / "t", files), "-n", "6"],
                    tmp_path / "r")
    assert run.rc == 0, run.tail()
    by_name = {t["nodeid"].split("::")[-1]: t["properties"]
               for t in run.summary["tests"]}
    restart = by_name["test_restart"]
    before = [p["t"] for n, p in by_name.items() if n.startswith("test_plain")
              and p["worker"] == restart["worker"] and p["t"] < restart["t"]]
    assert not before, (
        f"{len(before)} plain test(s) ran on {restart['worker']} before the "
        "restart chain")


def test_owner_detection_by_fixture_and_tier() -> None:
    class Item:
        def __init__(self, fixtures: tuple[str, ...], marks: tuple[str, ...]) -> None:
            self.fixturenames, self.marks = fixtures, marks

        def get_closest_marker(self, name: str) -> object:
            return object() if name in self.marks else None

    assert run_control.owns_gpu(Item(("gpu_store", "tmp_path"), ("contract",)))
    assert run_control.owns_gpu(Item(("tmp_path",), ("trace",)))
    assert not run_control.owns_gpu(Item(("tmp_path", "rig_factory"), ("contract",)))


# -------------------------------------------------------------- device variants

VARIANT_TESTS = {"test_variants.py": """
    import pytest

    pytestmark = [pytest.mark.contract]
    DEVICES = [pytest.param("cpu", marks=pytest.mark.hw_any, id="cpu"),
               pytest.param("cuda", marks=pytest.mark.hw_gpu, id="cuda")]

    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("n", range(3))
    def test_roundtrip(device, n):
        pass
    """}


def _cuda_only_profile(tmp_path: Path) -> Path:
    text = (REPO_ROOT / "tvc" / "data" / "profiles" / "example.toml").read_text()
    lines = [('worker_devices = ["cuda"]' if ln.startswith("worker_devices") else ln)
             for ln in text.splitlines()]
    assert 'worker_devices = ["cuda"]' in lines  # the example profile has the key
    path = tmp_path / "cuda-only.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("xdist", [False, True], ids=["serial", "xdist"])
def test_device_variants_the_connector_lacks_are_deselected_with_one_line(
        tmp_path: Path, xdist: bool) -> None:
    if xdist and importlib.util.find_spec("xdist") is None:
        pytest.skip("pytest-xdist is not installed: pip install pytest-xdist")
    args = [*write_tests(tmp_path / "t", VARIANT_TESTS),
            f"--tvc-profile={_cuda_only_profile(tmp_path)}"]
    args += ["-n", "2"] if xdist else ["-p", "no:xdist"]
    run = run_suite(args, tmp_path / "r")
    assert run.rc == 0, run.tail()
    line = ("tvc: deselected 3 [cpu] worker variants: connector.worker_devices = "
            "['cuda']")
    assert run.stdout.count(line) == 1, run.tail()
    assert "[cpu]" not in " ".join(t["nodeid"] for t in run.summary["tests"])
    cuda = [t for t in run.summary["tests"] if "cuda" in t["nodeid"]]
    assert len(cuda) == 3
    if not run.summary["hardware"]["levels"]["gpu"]:  # a real missing level: skips
        assert {t["outcome"] for t in cuda} == {"skipped"}
        assert all(t["message"].startswith("no CUDA GPU") for t in cuda)
    assert run.summary["deselected"] == [
        {"tier": "contract", "count": 3, "why": "[cpu] worker variants: "
         "connector.worker_devices = ['cuda']"}]


def test_roundtrip_suite_deselects_48_cpu_variants_for_a_cuda_only_connector(
        tmp_path: Path) -> None:
    run = run_suite(["suites/contract/test_worker_roundtrip.py", "--co", "-p",
                     "no:xdist", f"--tvc-profile={_cuda_only_profile(tmp_path)}"],
                    tmp_path / "r")
    assert run.rc == 0, run.tail()
    assert "tvc: deselected 48 [cpu] worker variants: connector.worker_devices = " \
           "['cuda']" in run.stdout
    assert "48/96 tests collected (48 deselected)" in run.stdout


def test_scenario_rig_cpu_variants_are_deselected_only_for_cuda_only_on_a_gpu(
        ) -> None:
    """``make_rig[cpu]`` may run a stand-in where no worker runs: it is dropped
    only where its ``[cuda]`` twin runs the connector's own worker."""
    class Spec:
        def __init__(self, params: dict[str, str]) -> None:
            self.params = params

    class Item:
        def __init__(self, **params: str) -> None:
            self.callspec = Spec(params)

        def get_closest_marker(self, name: str) -> object:
            return object() if name == "contract" else None

    items = [Item(make_rig="cpu"), Item(make_rig="cuda"), Item(device="cpu")]
    split = run_control.split_device_variants
    keep, dropped = split(items, ["cuda"], gpu_here=True)
    assert keep == [items[1]] and dropped == {"cpu": [items[0], items[2]]}
    keep, dropped = split(items, ["cuda"], gpu_here=False)  # stand-in or one skip
    assert keep == items[:2] and dropped == {"cpu": [items[2]]}
    keep, dropped = split(items, ["cpu", "cuda"], gpu_here=True)
    assert keep == items and not dropped
    # a CPU-only worker: its [cuda] rig variants would skip everywhere, so a CPU
    # box's scope never counts them as "not run for lack of a GPU"
    for gpu in (True, False):
        keep, dropped = split(items, ["cpu"], gpu_here=gpu)
        assert keep == [items[0], items[2]] and dropped == {"cuda": [items[1]]}


# ------------------------------------------------------------------- interrupts

SLOW_TESTS = {"test_slow.py": """
    import os
    import time
    from pathlib import Path

    import pytest

    pytestmark = [pytest.mark.level1, pytest.mark.hw_any]

    def test_fast():
        pass

    @pytest.mark.parametrize("i", range(4))
    def test_slow(i):
        marks = Path(os.environ["TVC_SELFTEST_MARKS"])
        (marks / f"{os.getpid()}-{i}").write_text("started")
        time.sleep(60)
    """}


def _start(tmp_path: Path, extra: list[str]) -> tuple[subprocess.Popen[str], Path,
                                                       Path]:
    marks = tmp_path / "marks"
    marks.mkdir()
    report = tmp_path / "r"
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
            *write_tests(tmp_path / "t", SLOW_TESTS), f"--tvc-report-dir={report}",
            *extra]
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**_env(), "TVC_SELFTEST_MARKS": str(marks)})
    return proc, marks, report


def _wait_for(marks: Path, n: int, proc: subprocess.Popen[str],
              timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while len({p.name.split("-")[0] for p in marks.iterdir()}) < n:
        if proc.poll() is not None or time.monotonic() > deadline:
            out = proc.communicate()[0] if proc.poll() is not None else ""
            proc.kill()
            pytest.fail(f"the slow tests did not start on {n} process(es): {out}")
        time.sleep(0.1)


@pytest.mark.parametrize("mode", ["serial", "xdist", "xdist-twice"])
def test_ctrl_c_leaves_an_interrupted_run_folder(tmp_path: Path, mode: str) -> None:
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) mid-run.

    ``xdist-twice`` presses it again 0.1 s later, while pytest formats the
    interrupt and xdist stops its workers.
    """
    if mode != "serial" and importlib.util.find_spec("xdist") is None:
        pytest.skip("pytest-xdist is not installed: pip install pytest-xdist")
    proc, marks, report = _start(tmp_path, ["-p", "no:xdist"] if mode == "serial"
                                 else ["-n", "2"])
    _wait_for(marks, 1 if mode == "serial" else 2, proc)
    os.killpg(proc.pid, signal.SIGINT)
    if mode == "xdist-twice":
        time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 2, out[-3000:]
    summary = json.loads((report / "summary.json").read_text())
    assert summary["run"]["outcome"] == "interrupted"
    # every slow test counts: those interrupted and those never started
    assert summary["counts"]["passed"] == 1 and summary["counts"]["not_run"] == 4, (
        summary["counts"])
    assert ET.parse(report / "junit.xml").getroot() is not None
    assert "Traceback" not in out, out[-3000:]
    assert len(out.splitlines()) < 40, out  # no 70-line KeyboardInterrupt dump
    # a test a worker was running is interrupted, not "worker 'gw0' crashed"
    page = (report / "summary.md").read_text()
    assert "crashed" not in page and "What failed" not in page, page
    started = [t for t in summary["tests"] if t["message"].startswith("running")]
    assert started and all(t["outcome"] == "not_run" and "interrupted" in t["message"]
                           for t in started), summary["tests"]


ORPHAN_BOUND_S = 15.0  # the watcher's poll (0.5 s) and kill grace (1.5 s), with
#   room for a loaded 2-core box: an upper bound, not a measurement


@needs_xdist
def test_sigkilled_controller_takes_its_workers(tmp_path: Path) -> None:
    proc, marks, _ = _start(tmp_path, ["-n", "2"])
    workers: list[psutil.Process] = []
    try:
        _wait_for(marks, 2, proc)
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert len(workers) >= 2
        proc.kill()  # SIGKILL: the controller cannot tell its workers anything
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(workers, timeout=ORPHAN_BOUND_S)
        assert alive == [], (f"xdist workers still alive {ORPHAN_BOUND_S} s after "
                             f"the controller: {[p.pid for p in alive]}")
    finally:
        for p in [psutil.Process(proc.pid), *workers] if proc.poll() is None \
                else workers:
            with contextlib.suppress(psutil.Error):
                p.kill()


def test_run_stopped_by_a_usage_error_leaves_no_empty_run_folder(tmp_path: Path
                                                                 ) -> None:
    plug = tmp_path / "plug"
    plug.mkdir()
    (plug / "late_usage_error.py").write_text(
        "import pytest\n\n"
        "@pytest.hookimpl(trylast=True)\n"
        "def pytest_configure(config):\n"
        "    raise pytest.UsageError('late plugin refuses')\n")
    run = run_suite([*write_tests(tmp_path / "t", SLOW_TESTS), "-p",
                     "late_usage_error", "-p", "no:xdist"], tmp_path / "r",
                    env={"PYTHONPATH": f"{plug}{os.pathsep}{REPO_ROOT}"})
    assert run.rc == 4 and "late plugin refuses" in run.stdout, run.tail()
    assert not (tmp_path / "r").exists()


SLOW_CLEANUP = {"conftest.py": """
    import os
    import signal
    import time

    if os.environ.get("PYTEST_XDIST_WORKER"):
        from tvc.core import run_store

        _remove = run_store.remove_session_stores

        def _slow(*args, **kwargs):
            # a worker's clean-up that outlives execnet's 5 s grace (a loaded box):
            # execnet then sends the worker a SIGINT of its own
            time.sleep(float(os.environ.get("TVC_SELFTEST_CLEANUP_S", "0")))
            handler = signal.getsignal(signal.SIGINT)
            held = getattr(getattr(handler, "__self__", None), "count", None)
            with open(os.environ["TVC_SELFTEST_HELD"], "a") as f:
                f.write(f"{os.environ['PYTEST_XDIST_WORKER']} {held}\\n")
            return _remove(*args, **kwargs)

        run_store.remove_session_stores = _slow

        def _slow_exit():
            # the worker's last steps in pytest (config clean-ups, pytest's own
            # garbage collection for unraisable exceptions) outliving execnet's grace
            try:
                time.sleep(float(os.environ.get("TVC_SELFTEST_EXIT_S", "0")))
                from tvc.plugin.hooks import _WORKER_HOLD

                seen = _WORKER_HOLD[0].count if _WORKER_HOLD else "no-hold"
            except KeyboardInterrupt:
                seen = "KeyboardInterrupt"
            with open(os.environ["TVC_SELFTEST_HELD"] + ".exit", "a") as f:
                f.write(f"{os.environ['PYTEST_XDIST_WORKER']} {seen}\\n")

        def pytest_configure(config):
            config.add_cleanup(_slow_exit)  # runs after every pytest_unconfigure
    """, "test_tiny.py": """
    import pytest

    pytestmark = [pytest.mark.level1, pytest.mark.hw_any]

    @pytest.mark.parametrize("i", range(4))
    def test_ok(i):
        pass
    """}
EXECNET_GRACE_S = 5.0  # execnet's WorkerGateway._terminate_execution waits 5 s


@needs_xdist
@pytest.mark.parametrize(("cleanup_s", "exit_s"), [
    (0.0, 0.0), (EXECNET_GRACE_S + 2, 0.0), (0.0, EXECNET_GRACE_S + 2)],
    ids=["quick-cleanup", "slow-cleanup", "slow-exit"])
def test_an_xdist_run_without_a_signal_prints_no_sigint_line(
        tmp_path: Path, cleanup_s: float, exit_s: float) -> None:
    """"tvc: SIGINT while finishing" came at the end of -n 2 runs nobody signalled:
    execnet sends a worker still busy 5 s after the controller closed its gateway
    a SIGINT of its own; the worker holds it silently, only the controller (where
    a user's Ctrl-C arrives) speaks."""
    held = tmp_path / "held.txt"
    run = run_suite([*write_tests(tmp_path / "t", SLOW_CLEANUP), "-n", "2"],
                    tmp_path / "r", env={"TVC_SELFTEST_CLEANUP_S": str(cleanup_s),
                                         "TVC_SELFTEST_EXIT_S": str(exit_s),
                                         "TVC_SELFTEST_HELD": str(held)})
    assert run.rc == 0 and run.summary is not None, run.tail()
    assert run.summary["run"]["outcome"] == "passed"
    assert "SIGINT" not in run.stdout and "Traceback" not in run.stdout, run.tail()
    assert "KeyboardInterrupt" not in run.stdout, run.tail()
    assert {t["outcome"] for t in run.summary["tests"]} == {"passed"}, run.tail()
    workers = dict(line.split() for line in held.read_text().splitlines())
    assert sorted(workers) == ["gw0", "gw1"], workers  # both cleaned up
    if cleanup_s > EXECNET_GRACE_S:  # the premise: execnet's SIGINT did arrive
        assert set(workers.values()) == {"1"}, workers
    if exit_s > EXECNET_GRACE_S:  # ... after pytest_unconfigure: held until exit
        deadline = time.monotonic() + 30  # the workers' atexit may outlive the run
        done = Path(f"{held}.exit")  # written by each worker as it ends
        while len(exits := dict(line.split() for line in (
                done.read_text() if done.exists() else "").splitlines())) < 2:
            assert time.monotonic() < deadline, exits
            time.sleep(0.2)
        assert set(exits.values()) == {"1"}, exits


THREAD_TESTS = {"test_threads.py": """
    import os

    import pytest

    pytestmark = [pytest.mark.level1, pytest.mark.hw_any]

    @pytest.mark.parametrize("i", range(2))
    def test_threads(i, record_property):
        import torch

        record_property("threads", torch.get_num_threads())
        record_property("omp", os.environ.get("OMP_NUM_THREADS"))
    """}


@needs_xdist
@pytest.mark.parametrize("omp", [None, "1"])
def test_xdist_workers_share_the_cpus_for_torch(tmp_path: Path,
                                                omp: str | None) -> None:
    """Under ``-n 2`` each worker's torch pool gets half the CPUs (two full pools
    spun against each other on 2 cores: 245 s against 86 s for the example
    profile's CPU tiers); the environment is left as it is for the processes
    a worker starts, and a user's OMP_NUM_THREADS wins."""
    run = run_suite([*write_tests(tmp_path / "t", THREAD_TESTS), "-n", "2"],
                    tmp_path / "r", env={"OMP_NUM_THREADS": omp})
    assert run.rc == 0 and run.summary is not None, run.tail()
    got = {(t["properties"]["threads"], t["properties"]["omp"])
           for t in run.summary["tests"]}
    want = int(omp) if omp else max(1, (os.cpu_count() or 1) // 2)
    assert got == {(want, omp)}, got
