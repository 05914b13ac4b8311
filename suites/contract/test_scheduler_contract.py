"""contract (scheduler side): the connector keeps the V1 scheduler's contract.

Driven through vLLM's own ``Scheduler`` on CPU.

Each test builds a rig (config, real scheduler, the connector's worker side on CPU
where the profile allows it, else a transfer-acknowledging stand-in), acts, and
checks with the named invariant helpers of :mod:`tvc.contract`.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tvc import contract as C
from tvc.contract.steps import rule_edge_lengths
from tvc.core.seed import run_seed

pytestmark = [pytest.mark.contract, pytest.mark.hw_any]

BLOCK_SIZES = (16, 32)  # vLLM's default block size and the next power of two
PROMPT_BLOCKS = (1, 4, 64)  # k in {k*B - 1, k*B, k*B + 1}; 64: prompts of 1-2k tokens
OUTPUT_TOKENS = 2  # tvc.contract.builders.make_request's default max_tokens


def _lengths(block_size: int, unit: int | None = None,
             max_model_len: int = 4096) -> list[int]:
    """Prompt lengths k*U-1, k*U, k*U+1 for U = B and U = the storage unit G.

    G is ``connector.granularity`` (tokens per stored unit: B for per-block
    stores, e.g. ``chunk_tokens`` for chunked ones), default B. The largest k
    is 64, or the largest that keeps ``k*U + 1`` prompt tokens plus the
    output tokens within ``max_model_len`` (the rig's: a longer request never
    finishes), so a chunk of 64 or 256 tokens still gets its longest prompts.
    """
    units = {block_size, unit or block_size}
    out = set()
    for u in units:
        k_max = min(max(PROMPT_BLOCKS), (max_model_len - OUTPUT_TOKENS - 1) // u)
        for k in {min(k, k_max) for k in PROMPT_BLOCKS}:
            out.update(k * u + d for d in (-1, 0, 1) if k * u + d >= 1)
    return sorted(out)


def _store_then_replay(rig: C.Rig, num_tokens: int, **kw) -> tuple:
    """Run a prompt (stored), forget the local cache, run it again."""
    first = rig.request(num_tokens, **kw)
    rig.driver.run(first)
    rig.forget_local_cache()
    second = rig.request(num_tokens, shared_prefix=first.prompt_token_ids)
    rig.driver.run(second)
    return first, second


def test_cold_prompt_matches_nothing(rig_factory) -> None:
    rig = rig_factory(block_size=16)
    req = rig.request(4 * 16 + 1)
    try:
        rig.driver.run(req)
    finally:
        _, matched, _ = C.external_hit(rig.driver, req)
        assert matched == 0, (
            f"cold prompt ({req.num_prompt_tokens} tokens, never stored): the "
            f"connector matched {matched} tokens, expected 0 — it reports hits it "
            "cannot load (false hit)")
    C.assert_scheduler_empty_and_no_leaked_blocks(rig.scheduler)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_second_pass_matches_declared_hit_rule(rig_factory, contract_profile,
                                               block_size, record_property) -> None:
    rule, source = contract_profile.select_hit_rule()  # hit_rules by vLLM version
    if not rule:
        pytest.skip(f"profile {contract_profile.name} declares no connector.hit_rule; "
                    "add the connector's rule (an expression of len and B) with its "
                    "hit_rule_source to check hits exactly")
    rig = rig_factory(block_size=block_size)
    seen = {}
    max_len = rig.vllm_config.model_config.max_model_len
    lengths = sorted(set(_lengths(block_size, contract_profile.granularity_tokens(
        block_size), max_len)) | set(rule_edge_lengths(
            contract_profile, block_size, max_len - OUTPUT_TOKENS - 1)))
    expected = {n: contract_profile.expected_hit_tokens(n, block_size)
                for n in lengths}
    assert any(expected.values()), (
        f"the profile's hit_rule {rule!r} expects 0 tokens for every prompt length "
        f"tried ({lengths}, from connector.granularity at B={block_size}): this "
        "test would pass without a single hit. Fix connector.hit_rule or "
        "connector.granularity")
    for n in lengths:
        _, second = _store_then_replay(rig, n)
        local, matched, is_async = C.external_hit(rig.driver, second)
        seen[n] = matched
        C.assert_block_aligned(matched, block_size, n, local, is_async)
        C.assert_hit_matches_rule(
            matched, contract_profile.expected_hit_tokens(n, block_size), n,
            block_size, rule, source)
        C.assert_last_token_recomputed(rig.driver, second)
        C.assert_only_unmatched_tokens_run(rig.driver, second, local + matched)
        if rig.worker is not None:
            C.assert_loaded_kv_bit_identical(rig.worker)
        C.assert_scheduler_empty_and_no_leaked_blocks(rig.scheduler)
    record_property("hits_by_prompt_len", seen)


def _units(rig: C.Rig, profile, count: int) -> int:
    """Tokens per stored unit G (``connector.granularity``), checked to fit.

    Skips when ``count`` units and a few more tokens exceed the rig's
    ``max_model_len``: a prompt that long never finishes.
    """
    g = profile.granularity_tokens(rig.block_size)
    if count * g + 8 + OUTPUT_TOKENS > rig.vllm_config.model_config.max_model_len:
        pytest.skip(f"{count} stored units of {g} tokens (connector.granularity) do "
                    "not fit the rig's max_model_len")
    return g


def test_prefix_sharing_matches_at_most_the_shared_blocks(rig_factory,
                                                          contract_profile) -> None:
    rig = rig_factory(block_size=16)
    # whole stored units (G tokens: a block, or a chunk), so that a chunked store
    # holds the shared prefix too
    g = _units(rig, contract_profile, 6)
    base = rig.request(6 * g + 3)
    rig.driver.run(base)
    for k in (1, 3):
        rig.forget_local_cache()
        shared = list(base.prompt_token_ids[: k * g])
        req = rig.request(6 * g + 3, shared_prefix=shared)
        rig.driver.run(req)
        local, matched, is_async = C.external_hit(rig.driver, req)
        assert matched <= k * g, (
            f"prompt sharing {k} whole stored unit(s) ({k * g} tokens) with a stored "
            f"prompt matched {matched} tokens: at most {k * g} may match — the "
            "connector reports tokens beyond the shared prefix (false hit)")
        C.assert_block_aligned(matched, rig.block_size, req.num_prompt_tokens, local,
                               is_async)
    rig.forget_local_cache()
    other = rig.request(6 * g + 3)
    rig.driver.run(other)
    _, matched, _ = C.external_hit(rig.driver, other)
    assert matched == 0, (f"unrelated prompt matched {matched} tokens, expected 0 "
                          "(false hit)")
    if rig.worker is not None:
        C.assert_loaded_kv_bit_identical(rig.worker)
    C.assert_scheduler_empty_and_no_leaked_blocks(rig.scheduler)


def test_async_load_completes_through_finished_receiving(rig_factory,
                                                         contract_profile) -> None:
    rig = rig_factory(block_size=16)
    n = 4 * _units(rig, contract_profile, 4) + 5  # whole stored units, and a tail
    _, second = _store_then_replay(rig, n)
    local, matched, is_async = C.external_hit(rig.driver, second)
    if not matched:
        rule, _source = contract_profile.select_hit_rule()
        want = contract_profile.expected_hit_tokens(n, rig.block_size) if rule else 0
        assert not want, (
            f"scenario did not happen: the replay of a stored {n}-token prompt "
            f"matched no token (the profile's hit_rule expects {want}), so no load "
            "ran to follow")
        pytest.skip(f"the replay of a stored {n}-token prompt matched no token"
                    + (" (as the profile's hit_rule expects)" if rule else
                       " and the profile declares no hit_rule")
                    + ": no load to follow")
    if not is_async:
        pytest.skip("the connector loads synchronously (get_num_new_matched_tokens "
                    "returned load_kv_async=False), so there is no "
                    "finished-receiving path to check")
    assert second.request_id in rig.driver.finished_recving, (
        f"request {second.request_id} was admitted with an async load of {matched} "
        "tokens but its id never appeared in KVConnectorOutput.finished_recving")
    C.assert_only_unmatched_tokens_run(rig.driver, second, local + matched)
    C.assert_scheduler_empty_and_no_leaked_blocks(rig.scheduler)


def test_connector_metadata_survives_scheduler_to_worker_serialization(
        rig_factory, contract_profile) -> None:
    # the scheduler side alone, unless it asks its worker for every lookup
    alone = not contract_profile["connector"]["lookups_need_worker"]
    rig = rig_factory(block_size=16, scheduler_only=alone)
    # the driver checks each metadata as built and hands the worker a copy, as
    # vLLM does: a worker that annotates its copy (Mooncake's store event) never
    # changes the scheduler's
    _store_then_replay(rig, 3 * 16 + 7)
    assert rig.driver.metas, "the scheduler produced no connector metadata"
    for meta in rig.driver.metas:
        C.assert_metadata_survives_serialization(meta)


def test_request_finished_returns_documented_types(rig_factory) -> None:
    rig = rig_factory(block_size=16)
    _store_then_replay(rig, 2 * 16 + 3)
    returns = list(C.iter_finished_returns(rig.driver))
    assert len(returns) == 2, (
        f"vLLM called request_finished(_all_groups) for {len(returns)} of 2 "
        "finished requests")
    for _rid, method, ret in returns:
        C.assert_request_finished_types(ret, method)


def test_scheduler_is_empty_and_every_block_free_after_requests_finish(
        rig_factory) -> None:
    rig = rig_factory(block_size=16)
    reqs = [rig.request(n) for n in (17, 40, 3 * 16)]
    rig.driver.run(*reqs)
    rig.forget_local_cache()
    rig.driver.run(*[rig.request(r.num_prompt_tokens,
                                 shared_prefix=r.prompt_token_ids) for r in reqs])
    C.assert_scheduler_empty_and_no_leaked_blocks(rig.scheduler)


@settings(settings.get_profile("tvc-ci"))
@given(block_size=st.sampled_from(BLOCK_SIZES),
       plan=st.lists(st.tuples(st.integers(0, 4), st.integers(2, 40)),
                     min_size=2, max_size=4))
def test_prefix_sharing_sequences_never_overmatch(rig_factory, block_size,
                                                  plan) -> None:
    """Requests sharing k blocks of earlier prompts match at most what is shared.

    Prompts are at least 2 tokens: vLLM 0.26/0.28's ExampleConnector answers -B
    for a 1-token prompt once any prompt of at most B tokens was stored (its
    ``align_to_block_size(0)`` is ``-B``); that defect is reported, not tested.
    """
    rig_factory.release()  # the rigs of earlier examples: their sockets, threads
    rig = rig_factory(block_size=block_size)
    b = block_size
    stored: list[list[int]] = []
    base = rig.request(4 * b + 2).prompt_token_ids
    for k, tail in plan:
        rig.forget_local_cache()
        req = rig.request(k * b + tail, shared_prefix=base[: k * b])
        rig.driver.run(req)
        local, matched, is_async = C.external_hit(rig.driver, req)
        toks = req.prompt_token_ids
        common = max((_common(toks, s) for s in stored), default=0)
        bound = common // b * b
        if local + matched in C.full_prompt_ends(len(toks), is_async):
            bound = max(bound, common - local)  # ends at the last token
        assert matched <= bound, (
            f"request of {len(toks)} tokens whose longest common prefix with any "
            f"stored prompt is {common} tokens matched {matched} (> {bound}, "
            f"block {b}): false hit. Reproduce with the printed example and "
            f"--tvc-seed={run_seed()}")
        C.assert_block_aligned(matched, b, len(toks), local, is_async)
        stored.append(list(toks))
    if rig.worker is not None:
        C.assert_loaded_kv_bit_identical(rig.worker)
    C.assert_scheduler_empty_and_no_leaked_blocks(rig.scheduler)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
