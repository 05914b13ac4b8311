"""GPU self-test: the concurrency check FAILS against a connector that cross-serves KV.

Runs the e2e acceptance test and the concurrency test in one subprocess with a
profile (written to tmp) naming :class:`cross_serving_connector.CrossServingConnector`
(this folder on PYTHONPATH). The connector loads correctly one request at a time, so
the two-pass acceptance test must pass; under concurrency it fills requests' blocks
from each other's stored KV, so the concurrency test must fail on output equality
(against the baseline) — and for no other reason.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from selftests.conftest import run_suite
from tvc.session import state

pytestmark = [pytest.mark.e2e, pytest.mark.hw_gpu]

HERE = Path(__file__).resolve().parent
ACCEPTANCE = ("suites/e2e/test_external_prefix_hit.py::"
              "test_second_pass_is_served_from_connector_with_identical_output")
CONCURRENCY = ("suites/e2e/test_concurrency.py::"
               "test_concurrent_requests_match_the_baseline_and_the_hit_rule")


def write_profile(tmp_path: Path) -> Path:
    serve_args = state().profile["vllm"]["serve_args"]
    text = f"""\
[profile]
name = "cross-serving-example"
description = "ExampleConnector that serves one request's KV to another"

[connector]
name = "CrossServingConnector"
module_path = "cross_serving_connector"
kv_role = "kv_both"
extra_config = {{ shared_storage_path = "${{SCRATCH}}/cross-store" }}
hit_rule = "(len - 2) // B * B * ((len - 1 - (len - 1) // B * B + B - 1) // B)"
hit_rule_source = "same as the example profile (ExampleConnector's matching)"
hit_log_pattern = "External Cache Hit!"
persistent_store = true

[model]
path = "${{TVC_MODEL:-}}"

[vllm]
serve_args = {json.dumps(serve_args)}

[scratch]
dir = "{tmp_path / 'scratch'}"
"""
    path = tmp_path / "cross.toml"
    path.write_text(text)
    return path


def test_concurrency_check_catches_a_connector_that_cross_serves_kv(tmp_path):
    profile = write_profile(tmp_path)
    pythonpath = os.pathsep.join(
        p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    run = run_suite([ACCEPTANCE, CONCURRENCY, "--tvc-profile", str(profile),
                     "--tvc-require", "gpu"], tmp_path / "report",
                    env={"PYTHONPATH": pythonpath}, timeout_s=900)
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
