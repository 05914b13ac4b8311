"""GPU self-test: the two-pass test FAILS against a connector that corrupts its loads.

Runs ``suites/e2e/test_external_prefix_hit.py::test_second_pass_is_served_from_
connector_with_identical_output`` in a subprocess with a profile (written to tmp)
naming :class:`corrupting_connector.CorruptingConnector`, this folder on PYTHONPATH.
The connector stores and matches like ExampleConnector, so the hit counters agree;
the test must fail on output token ids or logprobs, and for no other reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from selftests.conftest import run_suite
from selftests.e2e.bad_profiles import bad_connector_env, write_bad_connector_profile

pytestmark = [pytest.mark.e2e, pytest.mark.hw_gpu]

TEST = ("suites/e2e/test_external_prefix_hit.py::"
        "test_second_pass_is_served_from_connector_with_identical_output")
EQUALITY_FAILURE = ("output token ids differ between pass 1 and pass 2",
                    "logprob of token", "do not share their top tokens")


def write_profile(tmp_path: Path) -> Path:
    return write_bad_connector_profile(
        tmp_path, name="corrupting-example", connector="CorruptingConnector",
        module="corrupting_connector",
        description="ExampleConnector whose loaded KV is overwritten with noise")


def test_two_pass_check_catches_a_connector_that_corrupts_loaded_kv(tmp_path):
    profile = write_profile(tmp_path)
    run = run_suite([TEST, "--tvc-profile", str(profile), "--tvc-require", "gpu"],
                    tmp_path / "report", env=bad_connector_env(),
                    timeout_s=900)
    t = run.test("test_second_pass_is_served_from_connector_with_identical_output")
    assert t["outcome"] == "failed", (
        f"the e2e two-pass test passed (or did not run: {t['outcome']}) against a "
        f"connector that corrupts the KV it loads — the check is blind\n{run.tail()}")
    props = t["properties"]
    block = int(props.get("block_size", 16))
    expected = (int(props.get("prompt_tokens", 600)) - 2) // block * block
    logs = sorted((tmp_path / "report").rglob("*.log"))
    log_tail = "".join(
        f"\n--- {p.name} (last 60 lines)\n" + "\n".join(
            p.read_text(errors="replace").splitlines()[-60:]) for p in logs)
    assert props.get("external_hits_pass2") == expected, (
        f"the corrupting connector should still hit {expected} tokens in pass 2 "
        f"(properties {props}); the run failed for another reason:\n{t['message']}"
        f"{log_tail}")
    assert any(s in t["message"] for s in EQUALITY_FAILURE), (
        f"expected a failure on output/logprob equality, got: {t['message']}")
