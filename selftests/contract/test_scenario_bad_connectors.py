"""The contract scenarios catch each known-bad connector, on the right check.

Every connector in ``scenario_bad_connectors.py`` carries one fault; its scenario
(one test of ``suites/contract/test_scenarios.py``, CPU variant) must fail with a
message naming that fault. A control (the defect-free base) passes the scenario
whose bad variant it carries, and a plan whose chunk does not fit any prompt is a
set-up error ("vacuous"), never a pass.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.hw_any

EXAMPLE_RULE = "(len - 2) // B * B * ((len - 1 - (len - 1) // B * B + B - 1) // B)"
S1 = "test_local_prefix_cache_hit_then_external_hit and cpu"

# connector class -> (test selection, text the failure must contain, profile extras)
CASES = {
    "IgnoresLocalHitConnector": (S1, "ignores the local hit", ""),
    "ShiftsByLocalModChunkConnector": (
        S1, "sits 16 tokens from its slots (num_computed_tokens mod chunk = 16)",
        'granularity = "2 * B"'),
    # not shifted: the red must not say "not at the right slots"
    "LoadsOneBlockShortConnector": (S1, "is wrong: ", 'granularity = "2 * B"'),
    "DropsAllButFirstLoadConnector": (
        "test_shared_prefixes and one_step and cpu",
        "nothing was loaded into them", ""),
    "StaleCountAfterPreemptionConnector": (
        "test_preemption_and_resume and cpu",
        "answers a stale count from before the preemption", ""),
    "LeaksOnAbortConnector": ("test_abort and running and cpu", "(leaked blocks)",
                              ""),
    "BareAssertOnAbortConnector": (
        "test_abort and queued and cpu",
        "(request_finished): assert len(stored_keys) == len(planned_blocks)", ""),
    "RaisesOnMissingFileConnector": (
        "test_store_fault and lose-recompute and cpu",
        "raised FileNotFoundError", ""),
    "FailedSaveVisibleConnector": (
        "test_volume and cpu", "does not hold the KV that was stored", ""),
    "IgnoresTenantConnector": ("test_tenant_isolation and cpu",
                               "the connector ignores cache_salt", ""),
    "StoresNothingUnderChunkConnector": (
        "test_granularity and cpu", "the connector stores nothing for it", ""),
    "StoresFirstChunkOnlyConnector": (
        "test_chunked_prefill_stores and cpu", "engine step", ""),
}

PROFILE = """\
[profile]
name = "bad-{cls}"
[connector]
name = "{cls}"
module_path = "scenario_bad_connectors"
kv_role = "kv_both"
extra_config = {{ shared_storage_path = "{store}", chunk_tokens = 32 }}
hit_rule = "{rule}"
hit_rule_source = "ExampleConnector (the bad connectors' base)"
worker_devices = ["cpu"]
{extra}
[scratch]
dir = "{scratch}"
"""


def _run(cls: str, select: str, extra: str, tmp_path: Path
         ) -> subprocess.CompletedProcess:
    prof = tmp_path / f"bad-{cls}.toml"
    prof.write_text(PROFILE.format(cls=cls, store="${SCRATCH}/store",
                                   scratch=tmp_path / "scratch", rule=EXAMPLE_RULE,
                                   extra=extra))
    env = {**os.environ,
           "TVC_SCENARIO_VOLUME": "1000",
           "PYTHONPATH": os.pathsep.join(
               [str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "suites/contract/test_scenarios.py",
         "-m", "contract", "-k", select, f"--tvc-profile={prof}",
         "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
         f"--tvc-report-dir={tmp_path / 'report'}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("cls", sorted(CASES))
def test_scenario_catches_known_bad_connector(cls, tmp_path) -> None:
    select, needle, extra = CASES[cls]
    proc = _run(cls, select, extra, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, (
        f"{cls}: the scenario did not fail (exit {proc.returncode}); expected a "
        f"failure containing {needle!r}. Output tail:\n{out[-3000:]}")
    assert needle in out, (
        f"{cls}: the scenario failed, but not on the expected check ({needle!r}). "
        f"Output tail:\n{out[-3000:]}")


@pytest.mark.parametrize(("cls", "elsewhere"), [
    ("LoadsIntoOtherBlocksConnector", True), ("LoadsOneBlockShortConnector", False)])
def test_a_load_that_landed_elsewhere_is_told_from_one_that_never_ran(
        cls: str, elsewhere: bool, tmp_path: Path) -> None:
    """Both leave the request's slots poisoned; only the one whose bytes went to
    blocks no request holds is told so (LMCache on vLLM 0.26's packed layout:
    the contract tier said only "nothing was loaded", the e2e tier wrong KV)."""
    proc = _run(cls, S1, "", tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "nothing was loaded into them" in out, out[-3000:]
    said = "that no request holds were written" in out
    assert said == elsewhere, out[-3000:]


def test_control_connector_passes_the_preemption_scenario(tmp_path) -> None:
    proc = _run("ClampedExampleConnector", "test_preemption_and_resume and cpu",
                "", tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "1 passed" in out, (
        "the defect-free base of StaleCountAfterPreemptionConnector must pass the "
        f"preemption scenario. Output tail:\n{out[-3000:]}")


def test_worker_sees_a_resumed_request_sent_as_new(tmp_path) -> None:
    """Model Runner V2's scheduler sends resumed requests as new ones (vLLM's
    default on CUDA in 0.26.0); the preemption scenario must still see the
    resumption instead of calling itself vacuous (on the H200: "the worker never
    saw the preempted request resumed" for cpu-offload's CUDA variant)."""
    from suites.contract.test_scenarios import test_preemption_and_resume
    from tvc import contract as C
    from tvc.config.profile import load

    prof = tmp_path / "control.toml"
    prof.write_text(PROFILE.format(
        cls="ClampedExampleConnector", store="${SCRATCH}/store",
        scratch=tmp_path / "scratch", rule=EXAMPLE_RULE, extra="").replace(
            'module_path = "scenario_bad_connectors"',
            'module_path = "selftests.contract.scenario_bad_connectors"'))
    profile = load(str(prof))
    rigs: list = []

    def factory(**kw):
        rig = C.make_rig(profile, profile.scratch / "contract", **kw)
        if not hasattr(rig.scheduler, "use_v2_model_runner"):
            pytest.skip("this vLLM's scheduler has no use_v2_model_runner switch")
        rig.scheduler.use_v2_model_runner = True  # resumed requests go out as new
        rigs.append(rig)
        return rig

    recorded: dict = {}
    test_preemption_and_resume(factory, profile, recorded.__setitem__)
    assert recorded["scenario"]["preempted"] >= 1 and rigs[-1].worker is not None
    assert rigs[-1].worker.resumed, "the worker never recorded the resumed request"


def test_vacuous_plan_is_an_error_naming_the_chunk(tmp_path) -> None:
    proc = _run("ClampedExampleConnector", "test_granularity and cpu",
                'granularity = "250 * B"', tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "1 error" in out, (
        f"a plan whose chunk exceeds every prompt must error. Tail:\n{out[-3000:]}")
    assert "vacuous: this connector stores whole chunks of 4000 tokens" in out, (
        out[-3000:])
