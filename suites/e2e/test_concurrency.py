"""e2e: N requests at once after a store pass; outputs and hit sums stay right.

On the session's connector server: the distinct prompts of the run's concurrency
plan (:meth:`tvc.e2e.acceptance.PromptBook.concurrency_plan`: groups sharing a prefix,
identical twins) are stored one at a time, ``POST /reset_prefix_cache`` empties the
GPU prefix cache, then all ``[e2e] concurrency`` requests (default 16) are sent at
once. Every output must equal the baseline's for its prompt; the prompt tokens not
computed (GPU prefix cache + connector, ``prompt_tokens_by_source``) must sum to
N x hit rule, and the external hits must lie between the tokens only the connector
could serve and that sum (see tvc/e2e/acceptance.py for why the split is not fixed).
"""

from __future__ import annotations

import pytest

from tvc.e2e import acceptance as acc

pytestmark = [pytest.mark.e2e, pytest.mark.hw_gpu]


def test_concurrent_requests_match_the_baseline_and_the_hit_rule(
        vllm_server, e2e_book, e2e_baseline, tvc_profile, tvc_prompt_seed,
        record_property):
    acc.record_seed(record_property, tvc_prompt_seed)
    acc.check_block_size(e2e_book, vllm_server.client().block_size())
    w = acc.run_wave(vllm_server, e2e_book)
    p = w.plan
    for key, value in (("requests", len(p.requests)), ("distinct", len(p.distinct)),
                       ("twins", p.twins), ("prompt_tokens", p.length),
                       ("shared_prefix_tokens", p.shared_prefix),
                       ("hit_rule_tokens", p.rule_tokens),
                       ("expected_cached_tokens", p.expected_cached),
                       ("min_external_tokens", p.min_external),
                       ("external_hit_tokens", int(w.deltas["external_hits"])),
                       ("local_source_tokens", int(w.deltas["local_source"])),
                       ("external_source_tokens", int(w.deltas["external_source"]))):
        record_property(f"concurrency.{key}", value)
    for note in p.notes:
        record_property("concurrency.note", note)
    ttfts = sorted(c.ttft_s for _, c in w.outputs if c.ttft_s is not None)
    if ttfts:
        record_property("concurrency.ttft_max_s", round(ttfts[-1], 4))
    acc.check_wave_outputs(w, e2e_baseline, acc.logprob_atol(tvc_profile))
    acc.check_wave_hits(w)
