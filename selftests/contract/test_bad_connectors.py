"""The contract tier catches every known-bad connector, on the right check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

WORKER = "test_loaded_kv_is_bit_identical and cpu and B16-H2-D64-float16 and NHD"

# connector class -> (test selection, text the failure must contain)
CASES = {
    "CountsLastTokenConnector": ("test_second_pass_matches_declared_hit_rule",
                                 "counts the last prompt token"),
    "OverMatchConnector": ("test_second_pass_matches_declared_hit_rule",
                           "beyond the end of the prompt"),
    "UnalignedConnector": ("test_second_pass_matches_declared_hit_rule",
                           "is not a multiple of the block size"),
    # a len - 1 answer passes the alignment check; the rule and the load do not
    "ClaimsUnstoredTailConnector": ("test_second_pass_matches_declared_hit_rule",
                                    "claims more tokens than the declared rule"),
    "PhantomHitConnector": ("test_cold_prompt_matches_nothing",
                            "reports hits it cannot load"),
    "LongPromptRaisesConnector": ("test_second_pass_matches_declared_hit_rule",
                                  "lookup key buffer holds at most 512 tokens"),
    "NoneFinishedConnector": ("test_cold_prompt_matches_nothing",
                              "vLLM could not use what request_finished returned"),
    "CorruptingLoadConnector": (WORKER,
                                "does not hold the KV that was stored"),
    "WrongBlockConnector": (WORKER,
                            "does not hold the KV that was stored"),
    "StrayWriteConnector": (WORKER,
                            "does not own, changed during the load"),
    "WrongLayerConnector": (WORKER,
                            "does not hold the KV that was stored"),
    "NeverHitConnector": ("test_second_pass_matches_declared_hit_rule",
                          "throws stored KV away"),
    "UnserializableMetaConnector": ("test_connector_metadata_survives",
                                    "cannot send to the workers"),
    "NoCapacityCheckConnector": ("test_missing_required_key",
                                 "accepted a missing capacity_bytes"),
    "LeakyConnector": ("test_scheduler_is_empty_and_every_block_free",
                       "still referenced"),
}

PROFILE = """\
[profile]
name = "bad-{cls}"
extends = "example"  # ExampleConnector's hit rule: the bad connectors' base
[connector]
name = "{cls}"
module_path = "bad_connectors"
kv_role = "kv_both"
extra_config = {{ shared_storage_path = "{store}", capacity_bytes = 1073741824 }}
required_extra_config_keys = ["capacity_bytes"]
worker_devices = ["cpu"]
[scratch]
dir = "{scratch}"
"""


@pytest.mark.parametrize("cls", sorted(CASES))
def test_contract_tier_catches_known_bad_connector(cls, tmp_path) -> None:
    select, needle = CASES[cls]
    prof = tmp_path / f"bad-{cls}.toml"
    prof.write_text(PROFILE.format(cls=cls, store="${SCRATCH}/store",
                                   scratch=tmp_path / "scratch"))
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(
               [str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "suites/contract", "-m", "contract",
         "-k", select, "--tvc-profile", str(prof), "-p", "no:cacheprovider",
         "-q", "--tvc-report-dir", str(tmp_path / "report")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, (
        f"{cls}: the contract tier did not fail (exit {proc.returncode}); "
        f"expected a failure containing {needle!r}. Output tail:\n{out[-3000:]}")
    assert needle in out, (
        f"{cls}: the contract tier failed, but not on the expected check "
        f"({needle!r}). Output tail:\n{out[-3000:]}")
