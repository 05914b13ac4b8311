"""GPU self-test: the concurrency check FAILS against a connector that cross-serves KV.

Runs the e2e acceptance test and the concurrency test in one subprocess with a
profile (written to tmp) naming :class:`cross_serving_connector.CrossServingConnector`
(this folder on PYTHONPATH). The connector loads correctly one request at a time, so
the two-pass acceptance test must pass; under concurrency it fills requests' blocks
from each other's stored KV, so the concurrency test must fail on output equality
(against the baseline) — and for no other reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from selftests.conftest import run_suite
from selftests.e2e.bad_profiles import bad_connector_env, write_bad_connector_profile

pytestmark = [pytest.mark.e2e, pytest.mark.hw_gpu]

ACCEPTANCE = ("suites/e2e/test_external_prefix_hit.py::"
              "test_second_pass_is_served_from_connector_with_identical_output")
CONCURRENCY = ("suites/e2e/test_concurrency.py::"
               "test_concurrent_requests_match_the_baseline_and_the_hit_rule")


def write_profile(tmp_path: Path) -> Path:
    return write_bad_connector_profile(
        tmp_path, name="cross-serving-example", connector="CrossServingConnector",
        module="cross_serving_connector",
        description="ExampleConnector that serves one request's KV to another")


def test_concurrency_check_catches_a_connector_that_cross_serves_kv(tmp_path):
    profile = write_profile(tmp_path)
    run = run_suite([ACCEPTANCE, CONCURRENCY, "--tvc-profile", str(profile),
                     "--tvc-require", "gpu"], tmp_path / "report",
                    env=bad_connector_env(), timeout_s=900)
    single = run.test("test_second_pass_is_served_from_connector")
    assert single["outcome"] == "passed", (
        "the cross-serving connector loads one request at a time correctly, so the "
        f"two-pass test should pass; it {single['outcome']}: {single['message']}\n"
        f"{run.tail()}")
    t = run.test("test_concurrent_requests_match_the_baseline_and_the_hit_rule")
    assert t["outcome"] == "failed", (
        f"the concurrency test passed (or did not run: {t['outcome']}) against a "
        "connector that serves one request's KV to another — the check is blind "
        f"(or no forward step loaded two requests at once)\n{run.tail()}")
    assert ("concurrency: connector, concurrent request #" in t["message"]
            and "differs from the baseline" in t["message"]), (
        f"expected a failure on a concurrent output against the baseline, got: "
        f"{t['message']}")
