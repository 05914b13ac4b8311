"""GPU self-test: the e2e load-failure test FAILS against a connector that reports
its failed loads wrongly.

Runs ``suites/e2e/test_load_failure.py`` in a subprocess with a built-in profile
and ``[e2e] load_failure_fault`` set to a faulty mode of the fault injector
(:mod:`tvc.contract.faults`), on a profile and policy where the correct mode
(``fail_load``) passes on vLLM 0.26.0 (the H200), so a failure means the check saw
the fault:

- ``misreport_load`` under ``recompute``, cpu-offload: one loaded block is
  overwritten and the block after it is reported, so vLLM recomputes from there and
  keeps the overwritten one; the test must fail on the output against the baseline
  (not on a missing log line, not on the server). (example is not used here: vLLM
  0.26.0 does not recover its synchronous loads even when they are reported
  right, a known failure of that profile.)
- ``corrupt_load`` under ``fail``, example: the block is overwritten and nothing is
  reported, so vLLM serves the garbage; the test must fail because the request
  completed instead of ending with an error. (With the correct mode vLLM 0.26.0
  ends the failed request with an empty stream on both profiles, a known failure
  whose ``match`` is that symptom only: the garbage answer stays a failure.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from selftests.conftest import run_suite
from selftests.e2e.bad_profiles import write_extending_profile

pytestmark = [pytest.mark.e2e, pytest.mark.hw_gpu]

LOAD_FAILURE = "suites/e2e/test_load_failure.py"
TEST = "test_failed_kv_load_follows_the_policy_and_the_server_lives_on"
CASES = [
    ("cpu-offload", "misreport_load", "recompute-async",
     "a recomputed request must give the output of a plain computation"),
    ("example", "corrupt_load", "fail-sync", "instead of an error"),
]


def write_profile(tmp_path: Path, base: str, mode: str) -> Path:
    return write_extending_profile(
        tmp_path, name=f"{base}-{mode.replace('_', '-')}", base=base,
        description=f"{base} whose failed loads are reported wrongly ({mode})",
        body=f'[e2e]\nload_failure_fault = "{mode}"\n')


@pytest.mark.parametrize(("base", "mode", "case", "expected"), CASES,
                         ids=[f"{b}-{m}-{c}" for b, m, c, _ in CASES])
def test_load_failure_check_catches_a_connector_that_reports_loads_wrongly(
        tmp_path, base, mode, case, expected):
    profile = write_profile(tmp_path, base, mode)
    run = run_suite([LOAD_FAILURE, "-k", case, "--tvc-profile", str(profile),
                     "--tvc-require", "gpu"], tmp_path / "report", timeout_s=600)
    t = run.test(f"{TEST}[{case}]")
    assert t["outcome"] == "failed", (
        f"the load-failure test {t['outcome']} against a connector that reports its "
        f"failed loads wrongly ({mode}) — the check is blind\n{run.tail()}")
    assert expected in t["message"], (
        f"expected the {case} case to fail because {expected!r}, got: "
        f"{t['message']}")
