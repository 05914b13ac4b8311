"""contract (scenarios): the engine scenarios where real connector faults live.

Each test runs one scenario of :mod:`tvc.contract.scenarios` — a plain function a
connector author can read step by step (schedule, forward, update_from_output) —
through vLLM's own V1 scheduler and the connector's worker side (real on CPU where
``connector.worker_devices`` lists ``cpu``, else the transfer-acknowledging
stand-in; the ``[cuda]`` variants run the real worker on a GPU), then the contract
invariants (len - 1 bound, block alignment, bit-identical KV for every loaded
request, nothing else changed, scheduler empty, every block free).
"""

from __future__ import annotations

import pytest

from tvc.contract import scenarios as S

pytestmark = [pytest.mark.contract]



def _seed(tvc_seed: int | None) -> int:
    from tvc.contract.builders import RUN_NONCE

    return int(tvc_seed) if tvc_seed else RUN_NONCE


def test_local_prefix_cache_hit_then_external_hit(make_rig, contract_profile,
                                                  record_property) -> None:
    out = S.run_scenario(S.local_then_external, make_rig, contract_profile,
                         record_property=record_property)
    # k blocks came from vLLM's local prefix cache, the rest from the connector
    assert out["local"] == out["k_blocks"] * S.BLOCK_SIZE and out["matched"] > 0, out


@pytest.mark.parametrize("together", [True, False], ids=["one_step", "staggered"])
def test_shared_prefixes_every_load_bit_identical(make_rig, contract_profile,
                                                  together, record_property) -> None:
    out = S.run_scenario(S.shared_prefixes, make_rig, contract_profile, together,
                         record_property=record_property)
    assert out["loads"] >= 2, out  # several loads of one prefix were in flight


def test_preemption_and_resume(make_rig, contract_profile, record_property) -> None:
    out = S.run_scenario(S.preemption_and_resume, make_rig, contract_profile,
                         record_property=record_property)
    # vLLM preempted a request and asked the connector again on re-admission
    assert out["preempted"] >= 1 and out["readmission_answers"], out


# the request's vLLM RequestStatus when it is aborted, per parameter
ABORTED_WHILE = {"waiting_for_remote_kv": "WAITING_FOR_REMOTE_KVS",
                 "running": "RUNNING", "queued": "WAITING"}


@pytest.mark.parametrize("when", list(ABORTED_WHILE))
def test_abort_leaves_nothing_behind(make_rig, contract_profile, when,
                                     record_property) -> None:
    out = S.run_scenario(S.abort, make_rig, contract_profile, when,
                         record_property=record_property)
    assert out["aborted_while"] == ABORTED_WHILE[when], out


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_reported_load_failure_affects_that_request_only(
        make_rig, contract_profile, policy, record_property) -> None:
    out = S.run_scenario(S.fault_wrapper, make_rig, contract_profile, policy,
                         record_property=record_property)
    assert out["reported_blocks"], out  # the failure reached vLLM as block ids


STORE_FAULTS = [("lose", "recompute"), ("lose", "fail"), ("corrupt", "recompute"),
                ("tear", "recompute"), ("tear", "fail"), ("fail_save", "recompute")]


@pytest.mark.parametrize(("kind", "policy"), STORE_FAULTS,
                         ids=[f"{k}-{p}" for k, p in STORE_FAULTS])
def test_store_fault_is_reported_never_silent(make_rig, contract_profile, kind,
                                              policy, record_property) -> None:
    out = S.run_scenario(S.store_fault, make_rig, contract_profile, kind, policy,
                         lambda rig: _fault_injector(contract_profile, rig),
                         record_property=record_property)
    if kind != "fail_save":  # the damage was seen: reported, matched less, failed
        assert out["reported"] or out["failed"] or (
            out["full"] is not None and out["matched"] < out["full"]), out


def test_volume_of_stores_and_loads(make_rig, contract_profile, tvc_seed,
                                    tvc_depth, record_property) -> None:
    # the depth's prompts (standard: 1,000 stores and 1,000 loads, so a
    # 1-in-a-few-hundred fault shows; --tvc-depth deep: 10,000)
    n = tvc_depth.scenario_volume
    seed = _seed(tvc_seed)
    out = S.run_scenario(S.volume, make_rig, contract_profile, n, seed,
                         record_property=record_property)
    assert out["stores"] >= n and out["loads"] >= n, out
    assert out["hit_tokens"] >= out["loads"], out  # every load matched >= 1 token
    print(f"volume: {out['stores']} stores at {out['stores_per_s']}/s, "
          f"{out['loads']} loads at {out['loads_per_s']}/s (seed {seed})")


def test_tenant_isolation_cache_salt_and_lora(make_rig, contract_profile,
                                              record_property) -> None:
    out = S.run_scenario(S.tenant_isolation, make_rig, contract_profile,
                         record_property=record_property)
    # no hit under another tenant; the plain replay proves the store held it
    assert out["hits"] == {"cache_salt": 0, "LoRA adapter": 0} and out["plain"] > 0


def test_granularity_prompts_at_chunk_boundaries(make_rig, contract_profile,
                                                 record_property) -> None:
    out = S.run_scenario(S.granularity, make_rig, contract_profile,
                         record_property=record_property)
    assert any(out["hits"].values()), out  # at least one boundary prompt hit


def test_chunked_prefill_stores_the_whole_prompt(make_rig, contract_profile,
                                                 record_property) -> None:
    out = S.run_scenario(S.chunked_prefill, make_rig, contract_profile,
                         record_property=record_property)
    assert out["prefill_steps"] >= 2, out  # the prompt was prefilled over steps


def test_chunked_prefill_preempted_and_resumed(make_rig, contract_profile,
                                               record_property) -> None:
    out = S.run_scenario(S.resumed_prefill, make_rig, contract_profile,
                         record_property=record_property)
    # preempted mid-prefill, then again; resumed on other blocks; replay hit
    assert len(out["preempted_after"]) >= 2 and out["matched"] > 0, out


def test_writes_no_more_than_vllm_asked_to_store(make_rig, contract_profile,
                                                 record_property) -> None:
    out = S.run_scenario(S.write_volume, make_rig, contract_profile,
                         lambda rig: _fault_injector(contract_profile, rig),
                         record_property=record_property)
    assert out["requests"][-1]["bytes"] > 0, out  # it stored something


def _fault_injector(profile, rig):
    """Return ``tvc.contract.faults.fault_injector_for(profile, rig)``.

    Imported here: tvc.contract.faults needs vLLM, and this module must collect on a box
    without vLLM (level1 says what is missing there).
    """
    from tvc.contract.faults import fault_injector_for

    return fault_injector_for(profile, rig)
