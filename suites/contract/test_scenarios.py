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


def test_freed_blocks_handed_to_the_next_request_at_once(
        make_rig, contract_profile, record_property) -> None:
    """A finished request's blocks go to the request queued behind it.

    vLLM may hand a block to another request the step after it freed it
    (``request_finished`` returned False); that request's forward overwrites
    it. A save still reading the blocks then stores another request's KV, unless
    the connector delays the free or finishes the save in ``handle_preemptions``
    (base.py: "evicted blocks BEFORE they are overwritten"; vLLM's
    OffloadingConnector: ``jobs_to_flush``).
    """
    from tvc.contract.driver import external_hit

    b = S.BLOCK_SIZE
    n = S.round_trip_len(contract_profile, b)
    # 1. a pool for one request at a time (+1: vLLM's null block): B, queued
    #    behind A, is admitted once A's blocks are free (vLLM admits a request
    #    only when its whole sequence fits) and gets A's blocks
    rig = make_rig(block_size=b, num_blocks=-(-(n + 2) // b) + 1)
    w = S.real_worker(rig)
    if w is None:
        pytest.skip("no real worker side on this device: the KV in a reused "
                    "block cannot be read")
    first, second = rig.request(n), rig.request(n)
    rig.driver.run(first, second)
    reused = set(w.block_table[first.request_id]) & set(
        w.block_table[second.request_id])
    assert reused, ("scenario did not happen: the second request got none of "
                    f"the first one's blocks ({w.block_table})")
    # 2. replay the first prompt: its local cache went with its blocks, so the
    #    connector loads it; every loaded token must be the first request's KV
    replay = rig.request(n, shared_prefix=first.prompt_token_ids)
    rig.driver.run(replay)
    local, matched = S.check_hit(rig, replay, S.rule_hit(contract_profile, n, b),
                                 "replay after its blocks were reused")
    assert local == 0 and matched > 0, (
        f"scenario did not happen: the replay found {local} tokens in vLLM's "
        f"local prefix cache and matched {matched} external tokens of a stored "
        f"{n}-token prompt")
    S.check_every_load(rig, [replay], "replay after its blocks were reused")
    S.finish(rig)
    record_property("scenario", {"prompt_len": n, "reused_blocks": len(reused),
                                 "matched": matched,
                                 "is_async": external_hit(rig.driver, replay)[2]})


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
