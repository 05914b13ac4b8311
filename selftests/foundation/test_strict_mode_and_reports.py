"""Strict mode (``--tvc-require``) and the run reports (junit.xml + summary.json).

Two suite runs against the real installed vLLM are shared by all tests here: a serial
one in strict mode (``--tvc-require gpu``; this box has no GPU) and one with ``-n 2``
without it. Both select passing, skipping and GPU tests so every outcome appears.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from selftests.conftest import REPO_ROOT, SuiteRun, run_suite

ARGS = ["suites/level1/test_vllm_install.py",
        "suites/level1/test_compiled_extensions.py",
        "-k", "vllm_imports or torch_matches or source_tree or extensions_load"]
GPU_TEST = "test_compiled_extensions_load"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, SuiteRun]:
    base = tmp_path_factory.mktemp("reports")
    try:
        import xdist  # noqa: F401
        xdist_args = ["-n", "2"]
    except ImportError:
        xdist_args = []
    cases = {"strict": [*ARGS, "--tvc-require", "gpu"], "xdist": [*ARGS, *xdist_args]}
    env = {"TVC_VLLM_SOURCE": None}  # the source-tree checks skip: a third outcome

    def one(case: str) -> SuiteRun:
        return run_suite(cases[case], base / f"report-{case}", env=env)

    with ThreadPoolExecutor(max_workers=2) as pool:
        out = dict(zip(cases, pool.map(one, cases), strict=True))
    if not xdist_args:
        pytest.skip("pytest-xdist is not installed: pip install pytest-xdist")
    return out


def _no_gpu(run: SuiteRun) -> None:
    if run.summary["hardware"]["levels"]["gpu"]:
        pytest.skip("this box has a GPU: strict mode has nothing to turn into failures")


def test_strict_mode_turns_gpu_skip_into_failure(runs) -> None:
    run = runs["strict"]
    _no_gpu(run)
    t = run.test(GPU_TEST)
    assert t["outcome"] in ("failed", "error"), run.tail()
    assert "strict mode (--tvc-require gpu): no CUDA GPU" in t["message"]
    assert "Fix: run this tier on a GPU host" in t["message"]
    assert run.summary["run"]["require"] == ["gpu"]
    assert run.rc == 1


def test_without_strict_mode_the_gpu_test_skips(runs) -> None:
    run = runs["xdist"]
    _no_gpu(run)
    t = run.test(GPU_TEST)
    assert t["outcome"] == "skipped"
    assert t["message"].startswith("no CUDA GPU") and "strict" not in t["message"]
    assert run.rc == 0


def test_strict_mode_from_environment(tmp_path) -> None:
    run = run_suite(["suites/level2/test_torch_compile.py", "-k", "cuda"],
                    tmp_path / "r", env={"TVC_REQUIRE": "gpu"})
    _no_gpu(run)
    t = run.test("test_torch_compile_cuda_matches_eager")
    assert t["outcome"] in ("failed", "error")
    assert "strict mode (--tvc-require gpu)" in t["message"]


def test_unknown_required_level_is_an_argparse_error_naming_the_option(tmp_path
                                                                       ) -> None:
    run = run_suite(["suites/level1/test_vllm_install.py", "--tvc-require",
                     "gpu,bogus"], tmp_path / "r")
    assert run.rc == 4 and run.summary is None
    assert ("error: argument --tvc-require: unknown hardware level 'bogus' "
            "(known: gpu, gpu2, nvme, all, coverage)") in run.stdout, run.tail()
    assert "Traceback" not in run.stdout


def test_unknown_required_level_from_environment_is_one_line(tmp_path) -> None:
    run = run_suite(["suites/level1/test_vllm_install.py"], tmp_path / "r",
                    env={"TVC_REQUIRE": "gpu,bogus"})
    assert run.rc == 4 and run.summary is None
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    assert lines == ["ERROR: TVC_REQUIRE: unknown hardware level 'bogus' "
                     "(known: gpu, gpu2, nvme, all, coverage)"]


def _junit_counts(run: SuiteRun) -> dict[str, int]:
    """The suite's counts, less a run-outcome case (summary.json's ``run``)."""
    suite = run.junit().find("testsuite")
    tests, failures, errors, skipped = (int(suite.get(k)) for k in
                                        ("tests", "failures", "errors", "skipped"))
    outcome_cases = [c for c in suite.iter("testcase")
                     if c.get("name") == "tvc-run-outcome"]
    tests -= len(outcome_cases)
    failures -= len(outcome_cases)
    return {"passed": tests - failures - errors - skipped, "failed": failures,
            "error": errors, "skipped": skipped}


@pytest.mark.parametrize("case", ["strict", "xdist"])
def test_summary_counts_equal_junit_counts(runs, case: str) -> None:
    run = runs[case]
    counts = dict(run.summary["counts"])
    counts["skipped"] += counts.pop("xfailed")  # JUnit files an xfail as a skip
    assert counts == _junit_counts(run), run.tail()
    assert sum(run.summary["counts"].values()) == len(run.summary["tests"]) == 5
    assert run.summary["run"]["exit_status"] == run.rc


@pytest.mark.parametrize("case", ["strict", "xdist"])
def test_junit_suite_properties_carry_profile_versions_hardware(runs, case) -> None:
    run = runs[case]
    props = {p.get("name"): p.get("value") for p in
             run.junit().find("testsuite").find("properties")}
    assert props["profile.name"] == "example"
    assert props["versions.vllm"] == md.version("vllm") == run.summary["versions"][
        "vllm"]
    assert props["versions.torch"] == md.version("torch")
    assert props["hardware.gpu_count"] == str(run.summary["hardware"]["gpu_count"])
    assert json.loads(props["run.require"]) == run.summary["run"]["require"]


@pytest.mark.parametrize("case", ["strict", "xdist"])
def test_per_test_properties_in_both_reports(runs, case) -> None:
    run = runs[case]
    case_el = next(tc for tc in run.junit().iter("testcase")
                   if tc.get("name") == "test_vllm_imports")
    junit_props = {p.get("name"): p.get("value") for p in case_el.iter("property")}
    summary_props = run.test("test_vllm_imports")["properties"]
    assert junit_props["torch_version"] == summary_props["torch_version"] == (
        md.version("torch"))
    assert junit_props["vllm_version"] == summary_props["vllm_version"] == (
        md.version("vllm"))
    assert run.test("test_vllm_imports")["tiers"] == ["level1"]


def test_default_report_dir_is_a_run_folder_under_reports(tmp_path) -> None:
    """Without --tvc-report-dir the run writes <reports root>/<time>-<profile>/.

    ``reports/latest`` then points at it. The reports root is moved under tmp_path
    with ``TVC_REPORTS_ROOT`` (tvc/plugin/report.py), so this self-test leaves no run
    folder in the repo's own ``reports/`` and never moves its ``latest``.
    """
    root = tmp_path / "reports"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TVC_")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "suites/level1/test_vllm_install.py", "-k",
         "source_tree", "-p", "no:cacheprovider"], cwd=REPO_ROOT, capture_output=True,
        text=True, check=False,
        env={**env, "TVC_VLLM_SOURCE": "", "TVC_REPORTS_ROOT": str(root)})
    # the header and the last line name the run folder
    lines = [x for x in proc.stdout.splitlines() if x.startswith("reports: ")]
    assert lines, f"no 'reports:' line in the output:\n{proc.stdout[-3000:]}"
    run_dir = Path(lines[-1].split()[1].removesuffix("junit.xml").rstrip("/"))
    assert run_dir.parent == root, (
        f"the run folder {run_dir} is not under TVC_REPORTS_ROOT={root}: the run "
        "wrote into the repo's reports/ (tvc/plugin/report.py REPORTS_ROOT)")
    assert run_dir.name.endswith("-example"), run_dir
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["counts"]["skipped"] == 2
    assert (root / "latest").resolve() == run_dir.resolve()


def test_selftest_run_is_filed_apart_and_never_becomes_latest(tmp_path) -> None:
    """A run of the suite's own tests is not a conformance run (fresh-user finding).

    ``pytest selftests`` used to write ``reports/<time>-example/`` titled
    "Conformance run: PASS" with ``reports/latest`` pointing at it. Now it goes
    under ``reports/selftests/``, says ``run.kind = "selftests"`` and its page title
    says so; ``latest`` keeps naming the newest conformance run.
    """
    root = tmp_path / "reports"
    root.mkdir()
    (root / "latest").symlink_to("20260101-000000-example")  # an earlier real run
    env = {k: v for k, v in os.environ.items() if not k.startswith("TVC_")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "selftests/foundation/test_markers.py",
         "-k", "parse_require", "-p", "no:cacheprovider"], cwd=REPO_ROOT,
        capture_output=True, text=True, check=False,
        env={**env, "TVC_REPORTS_ROOT": str(root)})
    assert proc.returncode == 0, proc.stdout[-3000:]
    runs = list((root / "selftests").iterdir())
    assert len(runs) == 1, f"expected one folder under {root}/selftests: {runs}"
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert summary["run"]["kind"] == "selftests"
    assert summary["counts"]["passed"] == 1
    page = (runs[0] / "summary.md").read_text()
    assert page.startswith("# Suite self-test run"), page[:200]
    assert os.readlink(root / "latest") == "20260101-000000-example"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "selftests"]


def test_the_plugin_knows_the_property_the_contract_tier_records_coverage_in(
) -> None:
    """The controller starts vLLM's API inventory at the first report carrying it."""
    from tvc.contract.coverage import PROPERTY
    from tvc.plugin.hooks import COVERAGE_PROPERTY

    assert COVERAGE_PROPERTY == PROPERTY


def test_the_inventory_thread_runs_only_beside_xdist_workers() -> None:
    """``ast.parse`` on two threads at once fails in CPython 3.11 ("AST constructor
    recursion depth mismatch"): a test's traceback or hypothesis parsing on the main
    thread while the inventory thread imported vLLM (torch's ``_overload`` parses
    source) broke an exploration self-test, 2 of 3 runs on a loaded box. The thread
    runs only on an xdist controller, where no test runs."""
    from types import SimpleNamespace

    from tvc.plugin.hooks import inventory_beside_run

    def cfg(**option):
        return SimpleNamespace(option=SimpleNamespace(**option))

    assert inventory_beside_run(cfg(numprocesses=2, dist="load"))
    assert not inventory_beside_run(cfg(numprocesses=0, dist="no"))
    assert not inventory_beside_run(cfg())  # -p no:xdist: no such options
    assert not inventory_beside_run(cfg(numprocesses=None, dist="no"))
