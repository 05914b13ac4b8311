"""e2e: the same prompt twice through ``vllm serve``; pass 2 is served by the connector.

Every test runs on the session's connector server (``vllm_server``) with prompts of
the run's :class:`tvc.e2e.acceptance.PromptBook` (random token ids from the run seed,
recorded as ``prompt_seed``), so a persistent store never knows a prompt before
pass 1. Between the passes ``POST /reset_prefix_cache`` empties vLLM's GPU prefix
cache, so a hit can only come from the connector. Expected hit counts come from the
profile's ``connector.hit_rule``. Both passes are also compared with the baseline
server's output for the same prompt (``[e2e] baseline``, tolerance ``[e2e]
logprob_atol``, default :data:`tvc.e2e.two_pass.LOGPROB_ATOL` nats).
"""

from __future__ import annotations

import pytest

from tvc.e2e import acceptance as acc
from tvc.e2e import two_pass as tp

pytestmark = [pytest.mark.e2e, pytest.mark.hw_gpu]


def test_second_pass_is_served_from_connector_with_identical_output(
        vllm_server, e2e_book, e2e_baseline, tvc_profile, tvc_prompt_seed,
        record_property):
    acc.record_seed(record_property, tvc_prompt_seed)
    prompt = e2e_book.get("acceptance")
    pattern = tvc_profile["connector"]["hit_log_pattern"]
    r = tp.run_two_passes(vllm_server, prompt, hit_log_pattern=pattern)
    for k, v in r.properties().items():
        record_property(k, v)
    acc.check_block_size(e2e_book, r.block_size)
    assert len(prompt) >= tp.PROMPT_BLOCKS_MIN * r.block_size, (
        f"the acceptance prompt must span {tp.PROMPT_BLOCKS_MIN} blocks: "
        f"{len(prompt)} tokens < {tp.PROMPT_BLOCKS_MIN} x {r.block_size} "
        "([e2e] prompt_tokens)")
    record_property("compared_with_baseline", e2e_baseline is not None)
    record_property("expected_hit_tokens", acc.check_two_pass(
        r, vllm_server.log_path, acc.baseline_of(e2e_baseline, "acceptance"),
        profile=tvc_profile))
    record_property("server_log", str(vllm_server.log_path))
    record_property("server_startup_s", round(vllm_server.startup_s, 1))


def test_different_prompt_of_same_length_gets_no_external_hit(
        vllm_server, e2e_book, e2e_baseline, tvc_profile, tvc_prompt_seed,
        record_property):
    acc.record_seed(record_property, tvc_prompt_seed)
    stored = e2e_book.get("false-hit-stored")
    first = tp.run_pass(vllm_server, stored)
    assert int(first.deltas["external_hits"]) == 0, (
        f"a fresh random prompt got {int(first.deltas['external_hits'])} external "
        "hit tokens on its first pass — a false hit")
    vllm_server.client().reset_prefix_cache()
    for name, key in (("an unrelated prompt", "false-hit-unrelated"),
                      ("the stored prompt with its first token changed",
                       "false-hit-first-token-changed")):
        prompt = e2e_book.get(key)
        p = tp.run_pass(vllm_server, prompt)
        seen = int(p.deltas["external_hits"])
        record_property(f"external_hits_{name.replace(' ', '_')}", seen)
        assert seen == 0, (
            f"{name} ({len(prompt)} tokens, same length as a stored one): expected "
            f"0 external hit tokens, saw {seen} — the connector matched KV of "
            "another prompt (a false hit): its lookup key must cover every token "
            "of the prefix, in order")
        base = acc.baseline_of(e2e_baseline, key)
        if base is not None:
            msg = tp.output_diff(base, p.completion, tp.BASELINE_NAME,
                                 f"connector server, {name}",
                                 acc.logprob_atol(tvc_profile))
            assert not msg, f"{msg} — computed without any hit, it must agree"
        vllm_server.client().reset_prefix_cache()


@pytest.mark.parametrize("offset", [-1, 0, 1], ids=["kB-1", "kB", "kB+1"])
def test_hit_count_at_block_boundaries(vllm_server, e2e_book, e2e_baseline, offset,
                                       tvc_profile, tvc_prompt_seed, request,
                                       record_property):
    acc.record_seed(record_property, tvc_prompt_seed)
    key = f"boundary-{request.node.callspec.id}"
    prompt = e2e_book.get(key)
    assert len(prompt) == acc.BOUNDARY_BLOCKS * e2e_book.block_size + offset
    pattern = tvc_profile["connector"]["hit_log_pattern"]
    r = tp.run_two_passes(vllm_server, prompt, hit_log_pattern=pattern)
    for k, v in r.properties().items():
        record_property(k, v)
    acc.check_block_size(e2e_book, r.block_size)
    record_property("expected_hit_tokens", acc.check_two_pass(
        r, vllm_server.log_path, acc.baseline_of(e2e_baseline, key),
        profile=tvc_profile))
