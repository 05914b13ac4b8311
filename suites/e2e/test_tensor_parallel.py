"""e2e at tensor parallelism 2: two passes through ``vllm serve`` at TP 2 vs TP 1.

For profiles declaring ``[vllm] tensor_parallel_sizes`` with 2. First a TP = 1
server WITHOUT the connector computes the reference output of the prompt (greedy,
top-k logprobs) and stops; then a TP = 2 server with the connector runs the
two-pass acceptance check (pass 1 computed, pass 2 an external hit of the
profile's hit rule, identical output; :func:`tvc.e2e.two_pass.check_acceptance`), and
both of its passes must equal the TP = 1 output: the same greedy tokens (up to an
exact tie) and top-k logprobs within ``[e2e] logprob_atol`` nats (default
:data:`tvc.e2e.two_pass.LOGPROB_ATOL`; TP changes the all-reduce order, so the logits
are close, not equal).

One server at a time: the TP = 2 server uses GPUs 0 and 1 (``CUDA_VISIBLE_DEVICES``
as the run has it).
"""

from __future__ import annotations

import json
import random

import pytest

from tvc.contract.tp import declared_tp_sizes
from tvc.e2e import acceptance as acc
from tvc.e2e import two_pass as tp
from tvc.env.model import prompt_token_range

pytestmark = [pytest.mark.e2e, pytest.mark.hw_gpu2]

TP_SIZE = 2


def _e2e(profile, key: str, default):
    """``[e2e] key`` of the profile, with a default until the schema has it."""
    return profile.data.get("e2e", {}).get(key, default)


def _compare(ref: tp.PassResult, got: tp.PassResult, prompt: list[int], block: int,
             what: str, atol: float) -> None:
    """``got`` equals the TP = 1 reference (tokens up to a tie; logprobs)."""
    r = tp.TwoPassResult(list(prompt), block, ref, got)
    try:
        tp.check_same_output_tokens(r)
        tp.check_logprobs_agree(r, atol)
    except AssertionError as exc:
        raise AssertionError(
            f"TP {TP_SIZE} {what} differs from TP 1 without the connector "
            f"(pass 1 below = TP 1, pass 2 = TP {TP_SIZE}): {exc}") from None


def test_tp2_two_passes_equal_tp1_output(vllm_server_factory, served_model,
                                         tvc_profile, tvc_prompt_seed,
                                         request, record_property) -> None:
    profile = tvc_profile
    sizes = declared_tp_sizes(profile)
    if TP_SIZE not in sizes:
        pytest.skip(f"profile {profile.name} declares [vllm] tensor_parallel_sizes "
                    f"= {sizes}: TP {TP_SIZE} is not claimed")
    cfg = json.loads((served_model / "config.json").read_text())
    heads = cfg.get("num_attention_heads", 0)
    kv_heads = cfg.get("num_key_value_heads", heads)
    assert heads % TP_SIZE == 0 and kv_heads % TP_SIZE == 0, (
        f"model {served_model}: {heads} attention heads / {kv_heads} KV heads do not "
        f"split over TP {TP_SIZE}; use a model whose head counts are multiples of "
        f"{TP_SIZE} or drop {TP_SIZE} from [vllm] tensor_parallel_sizes")
    acc.record_seed(record_property, tvc_prompt_seed)
    rng: random.Random = tp.rng_for(request.node.nodeid, tvc_prompt_seed[0])
    length = int(_e2e(profile, "prompt_tokens", tp.ACCEPTANCE_PROMPT_TOKENS))
    atol = float(_e2e(profile, "logprob_atol", tp.LOGPROB_ATOL))
    prompt = tp.make_prompt(rng, length, *prompt_token_range(served_model))
    serve = list(profile["vllm"]["serve_args"])

    base = vllm_server_factory("vllm-tp1-baseline", kv_transfer_config=None,
                               serve_args=[*serve, "--tensor-parallel-size", "1"])
    block = base.client().block_size()
    ref = tp.run_pass(base, prompt)
    base.stop()  # one server per GPU at a time; the factory's teardown is idempotent

    srv = vllm_server_factory(f"vllm-tp{TP_SIZE}",
                              serve_args=[*serve, "--tensor-parallel-size",
                                          str(TP_SIZE)])
    pattern = profile["connector"]["hit_log_pattern"]
    r = tp.run_two_passes(srv, prompt, hit_log_pattern=pattern)
    for k, v in r.properties(f"tp{TP_SIZE}_").items():
        record_property(k, v)
    record_property("ttft_tp1_s", round(ref.completion.ttft_s or 0.0, 4))
    record_property("server_log", str(srv.log_path))
    assert r.block_size == block, (
        f"TP 1 served block size {block}, TP {TP_SIZE} {r.block_size}: the "
        "comparison needs one block size (set --block-size in [vllm] serve_args)")
    expected = profile.expected_hit_tokens(len(prompt), r.block_size)
    record_property("expected_hit_tokens", expected)
    tp.check_acceptance(r, expected, pattern, srv.log_path,
                        f"external hits after pass 2 at TP {TP_SIZE}")
    _compare(ref, r.pass1, prompt, block, "pass 1 (computed)", atol)
    _compare(ref, r.pass2, prompt, block, "pass 2 (loaded by the connector)", atol)
