"""e2e: the same prompt twice through ``vllm serve``; pass 2 is served by the connector.

Every test runs on the session's server for the run's profile (``vllm_server``), with
random token-id prompts (seeded per run and test; the seed is a report property) so a
persistent store never knows a prompt before pass 1. Between the passes ``POST
/reset_prefix_cache`` empties vLLM's GPU prefix cache, so a hit can only come from the
connector. Expected hit counts come from the profile's ``connector.hit_rule``.
Tolerance for logprobs: :data:`tvc.two_pass.LOGPROB_ATOL` nats.
"""

from __future__ import annotations

import random

import pytest

from tvc import two_pass as tp
from tvc.model import prompt_token_range
from tvc.session import state

pytestmark = [pytest.mark.e2e, pytest.mark.hw_gpu]

ACCEPTANCE_PROMPT_TOKENS = tp.ACCEPTANCE_PROMPT_TOKENS
BOUNDARY_BLOCKS = 4  # boundaries probed at 4*B - 1, 4*B, 4*B + 1


@pytest.fixture
def rng(request: pytest.FixtureRequest, record_property) -> random.Random:
    """A prompt generator seeded by the run seed and the test id."""
    record_property("prompt_seed", tp.RUN_SEED)
    return tp.rng_for(request.node.nodeid)


@pytest.fixture
def token_range(served_model) -> tuple[int, int]:
    return prompt_token_range(served_model)


def _check_full(r: tp.TwoPassResult, log_path) -> int:
    """All acceptance invariants of one two-pass result; returns the expected hits."""
    profile = state().profile
    expected = profile.expected_hit_tokens(len(r.prompt), r.block_size)
    tp.check_acceptance(r, expected, profile["connector"]["hit_log_pattern"],
                        log_path)
    return expected


def test_second_pass_is_served_from_connector_with_identical_output(
        vllm_server, rng, token_range, record_property):
    prompt = tp.make_prompt(rng, ACCEPTANCE_PROMPT_TOKENS, *token_range)
    pattern = state().profile["connector"]["hit_log_pattern"]
    r = tp.run_two_passes(vllm_server, prompt, hit_log_pattern=pattern)
    for k, v in r.properties().items():
        record_property(k, v)
    assert len(prompt) >= tp.PROMPT_BLOCKS_MIN * r.block_size, (
        f"the acceptance prompt must span {tp.PROMPT_BLOCKS_MIN} blocks: "
        f"{len(prompt)} tokens < {tp.PROMPT_BLOCKS_MIN} x {r.block_size}")
    record_property("expected_hit_tokens", _check_full(r, vllm_server.log_path))
    record_property("server_log", str(vllm_server.log_path))
    record_property("server_startup_s", round(vllm_server.startup_s, 1))


def test_different_prompt_of_same_length_gets_no_external_hit(
        vllm_server, rng, token_range, record_property):
    stored = tp.make_prompt(rng, ACCEPTANCE_PROMPT_TOKENS, *token_range)
    first = tp.run_pass(vllm_server, stored)
    assert int(first.deltas["external_hits"]) == 0, (
        f"a fresh random prompt got {int(first.deltas['external_hits'])} external "
        "hit tokens on its first pass — a false hit")
    vllm_server.client().reset_prefix_cache()
    lo, hi = token_range
    other = tp.make_prompt(rng, ACCEPTANCE_PROMPT_TOKENS, lo, hi)
    first_token_changed = [lo + (stored[0] - lo + 1) % (hi - lo), *stored[1:]]
    for name, prompt in (("an unrelated prompt", other),
                         ("the stored prompt with its first token changed",
                          first_token_changed)):
        p = tp.run_pass(vllm_server, prompt)
        seen = int(p.deltas["external_hits"])
        record_property(f"external_hits_{name.replace(' ', '_')}", seen)
        assert seen == 0, (
            f"{name} ({len(prompt)} tokens, same length as a stored one): expected "
            f"0 external hit tokens, saw {seen} — the connector matched KV of "
            "another prompt (a false hit): its lookup key must cover every token "
            "of the prefix, in order")
        vllm_server.client().reset_prefix_cache()


@pytest.mark.parametrize("offset", [-1, 0, 1], ids=["kB-1", "kB", "kB+1"])
def test_hit_count_at_block_boundaries(vllm_server, rng, token_range, offset,
                                       record_property):
    block = vllm_server.client().block_size()
    length = BOUNDARY_BLOCKS * block + offset
    prompt = tp.make_prompt(rng, length, *token_range)
    pattern = state().profile["connector"]["hit_log_pattern"]
    r = tp.run_two_passes(vllm_server, prompt, hit_log_pattern=pattern)
    for k, v in r.properties().items():
        record_property(k, v)
    record_property("expected_hit_tokens", _check_full(r, vllm_server.log_path))
