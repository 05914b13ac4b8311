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
    """Prompts of 4B-1, 4B and 4B+1 tokens, ``[e2e] boundary_repeats`` fresh ones.

    Each is sent twice (two-pass acceptance against its baseline); every repeat
    runs even after one fails, and the failure says how many of them failed, so
    a fault that strikes only some prompts (a race, a colliding key) is seen
    with its rate, and a fault of every prompt is told from an intermittent one.
    """
    acc.record_seed(record_property, tvc_prompt_seed)
    tag = request.node.callspec.id
    pattern = tvc_profile["connector"]["hit_log_pattern"]
    keys = e2e_book.boundary_keys(tag)
    reds: list[str] = []
    hits: list[int] = []
    for i, key in enumerate(keys):
        prompt = e2e_book.get(key)
        assert len(prompt) == acc.BOUNDARY_BLOCKS * e2e_book.block_size + offset
        r = tp.run_two_passes(vllm_server, prompt, hit_log_pattern=pattern)
        hits.append(int(r.pass2.deltas["external_hits"]))
        if i == 0:
            for k, v in r.properties().items():
                record_property(k, v)
            acc.check_block_size(e2e_book, r.block_size)
        try:
            record_property("expected_hit_tokens", acc.check_two_pass(
                r, vllm_server.log_path, acc.baseline_of(e2e_baseline, key),
                profile=tvc_profile))
        except AssertionError as exc:
            reds.append(f"{key}: {exc}")
    record_property("external_hits_pass2_per_prompt", hits)
    record_property("failed_prompts", len(reds))
    how = "every one" if len(reds) == len(keys) else (
        "some only: an intermittent fault, e.g. a race between a save and a later "
        "load, or keys that collide for some prompts")
    assert not reds, (
        f"{len(reds)} of {len(keys)} fresh {len(prompt)}-token prompts failed the "
        f"two-pass check ({how}); pass-2 external hits per prompt {hits}. First: "
        f"{reds[0]}")


def test_local_prefix_cache_hit_then_external_hit(vllm_server, e2e_book, e2e_baseline,
                                                  tvc_profile, tvc_prompt_seed,
                                                  record_property):
    """Part of a stored prompt in vLLM's GPU prefix cache, the rest from the connector.

    1. pass 1 stores the ``local-then-external`` prompt Y; ``POST
       /reset_prefix_cache`` empties the GPU prefix cache;
    2. Y's first ``L`` blocks and half a block are sent alone, so the GPU prefix
       cache then holds Y's first ``L`` blocks (``L`` odd, about half of Y:
       :meth:`tvc.e2e.acceptance.PromptBook.local_blocks`, off any chunk grid of
       two blocks or more);
    3. Y again: vLLM takes ``L * B`` tokens from its GPU cache and asks the
       connector from there on (``get_num_new_matched_tokens(request,
       num_computed_tokens=L * B)``); the output must equal the baseline's, and the
       tokens not computed (GPU cache + connector) must be the hit rule of Y, as
       from an empty cache. A connector that loads from token 0 instead of
       ``num_computed_tokens``, or matches only from its own chunk grid, fails.
    """
    acc.record_seed(record_property, tvc_prompt_seed)
    client = vllm_server.client()
    acc.check_block_size(e2e_book, client.block_size())
    b = e2e_book.block_size
    key = "local-then-external"
    prompt = e2e_book.get(key)
    local = e2e_book.local_blocks() * b
    first = tp.run_pass(vllm_server, prompt)                         # 1
    client.reset_prefix_cache()
    tp.run_pass(vllm_server, prompt[:local + b // 2])                # 2
    third = tp.run_pass(vllm_server, prompt)                         # 3
    gpu = int(third.deltas["prefix_hits"])
    ext = int(third.deltas["external_hits"])
    rule = int(tvc_profile.expected_hit_tokens(len(prompt), b))
    for k, v in (("prompt_tokens", len(prompt)), ("local_tokens", local),
                 ("gpu_prefix_cache_hits", gpu), ("external_hits", ext),
                 ("expected_hit_tokens", rule)):
        record_property(f"local_then_external.{k}", v)
    assert gpu >= local, (
        f"scenario did not happen: after Y's first {local} tokens were computed "
        f"alone, Y ({len(prompt)} tokens) got {gpu} tokens from vLLM's GPU prefix "
        "cache, fewer than those blocks")
    atol = acc.logprob_atol(tvc_profile)
    base = acc.baseline_of(e2e_baseline, key)
    for ref, ref_name in ((base, tp.BASELINE_NAME),
                          (first.completion, "connector pass 1 (computed)")):
        if ref is None:
            continue
        msg = tp.output_diff(ref, third.completion, ref_name,
                             f"connector server, {gpu} tokens from the GPU prefix "
                             f"cache + {ext} from the connector", atol)
        assert not msg, (
            f"{msg} — the KV of tokens [{gpu}, {gpu + ext}) the connector loaded "
            f"after vLLM's local hit of {gpu} tokens is wrong: the load must fill "
            "the tokens from num_computed_tokens on (the value vLLM passed to "
            "get_num_new_matched_tokens), not from token 0 or from the "
            "connector's own chunk grid")
    want = max(rule, gpu)
    assert gpu + ext == want, (
        f"{len(prompt)}-token stored prompt with {gpu} tokens in vLLM's GPU prefix "
        f"cache: the connector served {ext} more (local + external = {gpu + ext}), "
        f"the profile's hit rule expects {want} in total — the connector must match "
        "from num_computed_tokens to the same end as from an empty cache")
