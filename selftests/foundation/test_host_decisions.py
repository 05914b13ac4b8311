"""Self-tests: host-dependent tests decide before they run (a faked hardware probe).

A test whose outcome depends on the host (GPU count, vLLM's CUDA platform checks)
must skip with the reason and the fix where the host cannot run it, and fail only
in strict mode for the level it needs, never as a red that blames the profile.
Seen on the H200 (one GPU): the gloo variant of the pipeline-parallel round trip
ran into vLLM's ``ParallelConfig`` refusal ("World size (2) is larger than the
number of available GPUs (1)") and blamed the profile's kv_transfer_config.
Here the suite's hardware probe (``tvc_hw``) is faked through a conftest.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.hw_any

SUITES = Path(__file__).resolve().parents[2] / "suites"

FAKE_HW = """
import pytest


@pytest.fixture(scope="session")
def tvc_hw():
    missing = {{"gpu2": "fewer than two CUDA GPUs: {n} visible",
               "nvme": "no GPU-direct NVMe store: faked"}}
    return {{"levels": {{"any": True, "gpu": True, "gpu2": False, "nvme": False}},
            "gpu_count": {n}, "visible_gpus": {n},
            "gpus": [{{"name": "Fake H200"}}] * {n}, "missing": missing}}
"""


def _run(pytester: pytest.Pytester, n_gpus: int, *extra: str) -> pytest.RunResult:
    shutil.copy(SUITES / "contract" / "test_tp.py", pytester.path / "test_tp.py")
    pytester.makeconftest(FAKE_HW.format(n=n_gpus))
    return pytester.runpytest_subprocess(
        "--tvc-profile=example", f"--tvc-report-dir={pytester.path / 'run'}",
        "-p", "no:xdist", "-p", "no:cacheprovider", "-rs",
        "-k", "pp_round_trip and cpu-gloo", *extra, str(pytester.path))


def test_gloo_parallel_variants_skip_on_a_one_gpu_host(pytester) -> None:
    result = _run(pytester, 1)
    # example claims PP 2, not TP 2: TP1-PP2 meets the host, TP2-PP2 the profile
    result.assert_outcomes(skipped=2)
    text = result.stdout.str()
    assert "World size (2) is larger than the number of available GPUs (1)" in text
    assert "the gloo variant runs on a CPU-only box" in text
    assert "Fix: run the two-GPU tiers" in text
    assert "refuses the profile's kv_transfer_config" not in text
    assert "TP 2 is not claimed" in text


def test_gloo_parallel_variant_fails_only_when_gpu2_is_required(pytester) -> None:
    result = _run(pytester, 1, "--tvc-require=gpu2")
    result.assert_outcomes(failed=1, skipped=1)
    result.stdout.fnmatch_lines(["*strict mode (--tvc-require gpu2)*World size (2)*"])
