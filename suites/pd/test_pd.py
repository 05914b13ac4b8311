"""pd: a prefill/decode pair gives the output of one engine, the KV coming across.

For profiles with ``[pd] enabled = true``. The producer (``kv_producer``, GPU 0)
and the consumer (``kv_consumer``, GPU 1) are started by :class:`tvc.pd.pair.PDPair`;
the in-process :class:`tvc.pd.pair.PDRouter` sends each request's prefill
(``max_tokens = 1``) to the producer, then the whole request to the consumer,
with the routing data the connector expects (``[pd] routing``). The consumer's
``vllm:external_prefix_cache_hits_total`` must rise by the profile's hit rule for
every prompt (the KV came from the producer, not from its own compute). After the
pair stops, one engine without a connector on GPU 0 computes the same prompts:
the greedy tokens must be identical (up to an exact tie) and the top-k logprobs
within ``[e2e] logprob_atol`` nats (default :data:`tvc.e2e.two_pass.LOGPROB_ATOL`).
TTFT through the pair and of the baseline are recorded.
"""

from __future__ import annotations

import pytest

from tvc.e2e import acceptance as acc
from tvc.e2e import two_pass as tp
from tvc.env.model import prompt_token_range
from tvc.pd import pair as PD

pytestmark = [pytest.mark.pd]

NUM_PROMPTS = 2  # two requests: the second must not reuse the first's transfer


def _e2e(profile, key: str, default):
    return profile.data.get("e2e", {}).get(key, default)


@pytest.mark.hw_gpu2
def test_pd_output_equals_single_engine_and_kv_came_from_producer(
        pd_pair_factory, pd_baseline_factory, pd_profile, served_model, request,
        tvc_prompt_seed, record_property) -> None:
    profile, _settings = pd_profile
    rng = tp.rng_for(request.node.nodeid, tvc_prompt_seed[0])
    acc.record_seed(record_property, tvc_prompt_seed)
    length = int(_e2e(profile, "prompt_tokens", tp.ACCEPTANCE_PROMPT_TOKENS))
    atol = float(_e2e(profile, "logprob_atol", tp.LOGPROB_ATOL))
    lo, hi = prompt_token_range(served_model)
    prompts = [tp.make_prompt(rng, length, lo, hi) for _ in range(NUM_PROMPTS)]

    pair = pd_pair_factory()
    run = PD.route_prompts(pair, prompts, max_tokens=tp.MAX_TOKENS,
                           logprobs=tp.TOP_K)
    expected = sum(profile.expected_hit_tokens(len(p), pair.block_size)
                   for p in prompts)
    for i, r in enumerate(run.results):
        record_property(f"pd_ttft_s_{i}", round(r.ttft_s, 4))
        record_property(f"pd_prefill_s_{i}", round(r.prefill_s, 4))
    record_property("consumer_external_hit_tokens", run.consumer_hits)
    record_property("expected_external_hit_tokens", expected)
    record_property("producer_log", str(pair.producer.log_path))
    record_property("consumer_log", str(pair.consumer.log_path))
    PD.check_kv_came_from_producer(run, expected)
    pair.stop()  # one server per GPU: the baseline takes GPU 0

    base = pd_baseline_factory()
    for i, (prompt, r) in enumerate(zip(prompts, run.results, strict=True)):
        ref = base.client().complete_streaming(prompt, max_tokens=tp.MAX_TOKENS,
                                               logprobs=tp.TOP_K)
        record_property(f"baseline_ttft_s_{i}", round(ref.ttft_s or 0.0, 4))
        PD.check_same_as_baseline(
            ref, r.completion, f"P/D output of prompt {i} (request {r.request_id})",
            atol)


@pytest.mark.hw_any
def test_pd_block_size_mismatch_is_refused_at_startup(pd_pair_builder,
                                                      tmp_path) -> None:
    pair = pd_pair_builder(tmp_path / "no-model", producer_args=["--block-size", "16"],
                           consumer_args=["--block-size", "32"])
    with pytest.raises(PD.PDConfigError) as err:
        pair.start()
    msg = str(err.value)
    assert "check_pd_compatible" in msg and "--block-size" in msg, msg
    assert "producer 16" in msg and "consumer 32" in msg, msg
    assert not pair.producer.is_alive() and not pair.consumer.is_alive(), (
        "a server was started although the configuration check failed")
