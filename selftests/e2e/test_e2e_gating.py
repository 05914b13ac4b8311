"""Self-tests: without a GPU the e2e tier skips with its reason; strict mode fails."""

from __future__ import annotations

import pytest

from selftests.conftest import run_suite

pytestmark = pytest.mark.hw_any


@pytest.fixture(autouse=True)
def _no_gpu_here(tvc_hw):
    if tvc_hw["levels"]["gpu"]:
        pytest.skip("this box has a GPU: the e2e tier runs here instead of skipping")


def test_e2e_tier_skips_with_its_reason_without_gpu(tmp_path):
    run = run_suite(["suites/e2e", "-m", "e2e"], tmp_path / "r")
    assert run.rc == 0, run.tail()
    tests = run.summary["tests"]
    assert len(tests) >= 6, [t["nodeid"] for t in tests]
    for t in tests:
        assert t["outcome"] == "skipped", t
        assert "no CUDA GPU" in t["message"], t
        # hw_gpu (one GPU) names the GPU host; hw_gpu2 (TP 2) names two GPUs
        assert ("GPU host" in t["message"]
                or "at least two GPUs" in t["message"]), t


def test_e2e_tier_fails_in_strict_mode_without_gpu(tmp_path):
    run = run_suite(["suites/e2e", "-m", "e2e", "--tvc-require", "gpu,gpu2"],
                    tmp_path / "r")
    assert run.rc == 1, run.tail()
    for t in run.summary["tests"]:
        assert t["outcome"] == "error", t  # failed in setup, before any server
        assert ("strict mode (--tvc-require gpu)" in t["message"]
                or "strict mode (--tvc-require gpu2)" in t["message"]), t
