"""e2e: the two-pass acceptance under other engine settings and another model.

Each variant of :data:`tvc.e2e.acceptance.VARIANTS` runs its own pair of servers, one
after the other: a baseline (the variant's model and serve args, no connector) and
the connector server; pass 2 must hit by the profile's rule and both passes must
match the baseline.

- ``sliding_window``: the built-in tiny Llama with sliding-window attention on every
  other layer (window 128 < the prompt); skipped when the profile names its own
  model (``[model] path``).
- ``ngram_spec_decode``: ``--speculative-config`` with vLLM's n-gram proposer and a
  prompt that repeats a pattern; the draft-token counter must rise.
- ``chunked_prefill``: ``--max-num-batched-tokens 256`` and a prompt of 600+ tokens,
  so pass 1 prefills in chunks and pass 2 must still hit.

A profile may list the variants to run in ``[e2e] variants`` (default: all); ``-k``
selects as usual.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tvc.e2e import acceptance as acc
from tvc.e2e import two_pass as tp
from tvc.env.model import build_tiny_model, prompt_token_range

pytestmark = [pytest.mark.e2e, pytest.mark.hw_gpu]


def variant_model(variant: str, served_model: Path, profile) -> Path | None:
    """The variant's model folder, or None when the profile's model rules it out."""
    v = acc.VARIANTS[variant]
    if v.model == "profile":
        return Path(served_model)
    if profile["model"]["path"]:
        return None
    return build_tiny_model(profile.scratch / "models", v.model)


def variant_serve_args(variant: str, profile) -> list[str]:
    """The profile's serve args, then the variant's."""
    return [*profile["vllm"]["serve_args"], *acc.VARIANTS[variant].serve_args]


def tvc_servers(config, model, params):
    """The server pool's plan (tvc.fixtures.vllm): the variant's baseline and server."""
    from tvc.fixtures.vllm import server_from_profile
    from tvc.plugin import session

    profile = session.run_state(config).profile  # a hook: no fixtures yet
    variant = params["variant"]
    selected = acc.e2e_setting(profile, "variants", None)
    vmodel = variant_model(variant, model, profile)
    if vmodel is None or (selected is not None and variant not in selected):
        return []
    args = variant_serve_args(variant, profile)
    return [server_from_profile(config, vmodel, f"vllm-baseline-{variant}",
                                kv_transfer_config=None, serve_args=args),
            server_from_profile(config, vmodel, f"vllm-{variant}", serve_args=args)]


@pytest.mark.parametrize("variant", list(acc.VARIANTS))
def test_engine_variant_hits_and_matches_its_baseline(
        variant, vllm_server_factory, served_model, tvc_profile, tvc_prompt_seed,
        record_property):
    v = acc.VARIANTS[variant]
    profile = tvc_profile
    selected = acc.e2e_setting(profile, "variants", None)
    if selected is not None and variant not in selected:
        pytest.skip(f"variant {variant} is not in the profile's [e2e] variants "
                    f"{list(selected)}")
    model = variant_model(variant, served_model, profile)
    if model is None:
        pytest.skip(f"variant {variant} runs the built-in tiny {v.model} model; "
                    f"the profile names its own model ({profile['model']['path']})"
                    " — run it with a profile whose [model] path is empty")
    record_property("variant", v.doc)
    acc.record_seed(record_property, tvc_prompt_seed)
    args = variant_serve_args(variant, profile)

    base = vllm_server_factory(f"vllm-baseline-{variant}", model=model,
                               kv_transfer_config=None, serve_args=args)
    book = acc.prompt_book(profile, base.client().block_size(),
                           prompt_token_range(model), seed=tvc_prompt_seed[0])
    n = max(book.prompt_tokens, v.min_prompt_tokens)
    key = f"variant-{variant}"
    prompt = (book.repetitive_tokens(key, n) if v.prompt == "repetitive"
              else book.random_tokens(key, n))
    reference = base.client().stream(prompt, tp.MAX_TOKENS, tp.TOP_K)
    assert reference.ok, f"{variant} baseline server: {reference.error}"
    base.stop()

    srv = vllm_server_factory(f"vllm-{variant}", model=model, serve_args=args)
    pattern = profile["connector"]["hit_log_pattern"]
    r = tp.run_two_passes(srv, prompt, hit_log_pattern=pattern)
    for k, val in r.properties().items():
        record_property(k, val)
    acc.check_block_size(book, r.block_size)
    if v.model == "sliding-window":
        window = json.loads((model / "config.json").read_text())["sliding_window"]
        record_property("sliding_window_tokens", window)
        assert window < len(prompt), (
            f"sliding_window variant: the window ({window} tokens) must be shorter "
            f"than the prompt ({len(prompt)}) for it to matter")
    if variant == "chunked_prefill":
        assert len(prompt) > acc.CHUNKED_BATCH_TOKENS, (
            f"chunked_prefill variant: the prompt ({len(prompt)} tokens) must be "
            f"longer than --max-num-batched-tokens {acc.CHUNKED_BATCH_TOKENS}")
    if v.scenario_metric:
        assert r.pass2.metrics_after.has(v.scenario_metric), (
            f"{variant}: this vLLM does not export {v.scenario_metric} on /metrics; "
            "the variant cannot prove its feature ran (see the server log "
            f"{srv.log_path})")
        seen = r.pass2.metrics_after.value(v.scenario_metric)
        record_property(v.scenario_metric, seen)
        assert seen > 0, (
            f"{variant}: {v.scenario_metric} is {seen:g} after both passes; "
            "expected it to rise — the variant's feature never ran (check the "
            f"server log {srv.log_path})")
    record_property("expected_hit_tokens",
                    acc.check_two_pass(r, srv.log_path, reference,
                                       profile=profile))
