"""contract (connector API): the paths vLLM drives that the scenarios never judged.

Derived from vLLM's connector base class (see ``docs/coverage.md``): the stats vLLM
aggregates, reduces and logs every step; the KV cache events it publishes; the
connector reset behind ``reset_prefix_cache(reset_connector=True)``; the block hash
function (``--prefix-caching-hash-algo``); requests that
must not read cached KV (``prompt_logprobs``, ``skip_reading_prefix_cache``); a
store that another model's engine shares (vLLM's block hashes do not cover the
model, its dtype or the KV cache dtype); and the answers vLLM reads outside a step
(role, layout, handshake, push work). Each test drives vLLM's own scheduler (and
the real worker side where the profile allows) and compares the connector's
answers with what the run stored and loaded.
"""

from __future__ import annotations

import pytest

from tvc.contract import scenarios as S

pytestmark = [pytest.mark.contract]

def test_stats_are_per_interval_and_usable_by_vllms_logger(
        make_rig, contract_profile, record_property) -> None:
    out = S.run_scenario(S.stats_per_interval, make_rig, contract_profile,
                         record_property=record_property)
    # a hit was served and vLLM asked for stats in its steps (every answer judged)
    assert out["hit_tokens"] > 0 and out["answers"] > 0, out


def test_kv_cache_events_name_only_stored_blocks(make_rig, contract_profile,
                                                 record_property) -> None:
    out = S.run_scenario(S.kv_cache_events, make_rig, contract_profile,
                         record_property=record_property)
    assert out["hit_tokens"] > 0 and out["stored"] > 0, out


def test_reset_cache_empties_the_connector(make_rig, contract_profile,
                                           record_property) -> None:
    out = S.run_scenario(S.reset_cache_misses, make_rig, contract_profile,
                         record_property=record_property)
    assert out["hit_before"] > 0 and out["hit_after"] == 0, out  # reset emptied it


@pytest.mark.parametrize("field", sorted(S.SKIP_READING))
def test_request_that_must_not_read_cached_kv_gets_a_miss(
        make_rig, contract_profile, field, record_property) -> None:
    out = S.run_scenario(S.skip_reading_prefix_cache, make_rig, contract_profile,
                         field, record_property=record_property)
    # the plain replay hit; with the field set nothing was read from a cache
    assert out["hit_plain"] > 0 and out["tokens_read_from_cache"] == 0, out


def test_answers_vllm_reads_outside_a_step(make_rig, contract_profile,
                                           record_property) -> None:
    out = S.run_scenario(S.answers_vllm_reads, make_rig, contract_profile,
                         record_property=record_property)
    assert out["hit_tokens"] > 0 and isinstance(out["piecewise"], bool), out


def test_multimodal_item_hits_never_serve_another_image(
        make_rig, contract_profile, record_property) -> None:
    out = S.run_scenario(S.multimodal_items, make_rig, contract_profile,
                         record_property=record_property)
    # image A was served past its placeholder; image B not into it
    assert out["hit_a"] > out["placeholder"][1] - out["placeholder"][0], out
    assert out["hit_b"] <= out["placeholder"][0], out


@pytest.mark.parametrize("algo", S.HASH_ALGOS)
def test_block_hash_algorithm_keeps_hits_and_loads_exact(
        make_rig, contract_profile, algo, record_property) -> None:
    out = S.run_scenario(S.block_hash_algorithm, make_rig, contract_profile, algo,
                         record_property=record_property)
    # at least two of the three prefix-sharing replays loaded under this hash
    assert out["algo"] == algo and out["loads"] >= 2, out


@pytest.mark.parametrize("variant", sorted(S.OTHER_MODEL))
def test_another_model_on_one_store_gets_a_miss(make_rig, contract_profile, variant,
                                                record_property) -> None:
    out = S.run_scenario(S.another_model_on_one_store, make_rig, contract_profile,
                         variant, record_property=record_property)
    # model A hit twice (the store outlives a connector); model B was not served
    assert out["hit_a"] > 0 and out["hit_a_again"] > 0, out
    # a miss, a refusal, or (the same KV values in another layout) exact loads
    assert out["hit_b"] == 0 or out["refused"] or out.get("same_kv_loads_exact"), out
