"""Probe: vLLM's own model-runner decision next to the harness's, as JSON.

Run as ``python runner_decision_probe.py SCRATCH`` under the vLLM to probe
(another venv, or 0.26.0's sources first on ``PYTHONPATH``); prints one JSON
object: ``{"version": ..., "cases": [{model, env, vllm, harness, mirror,
cross_layer_api}]}``. ``vllm`` is ``VllmConfig.use_v2_model_runner`` itself
(Triton taken as present, as on a CUDA host); ``harness`` is
:func:`tvc.contract.layout.decide_model_runner`; ``mirror`` is
:func:`tvc.contract.layout.mirror_model_runner` on the model's facts.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

BASE = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2}
MODELS = {
    "dense": {**BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "moe": {**BASE, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_local_experts": 4, "num_experts_per_tok": 2},
    # an MoE architecture vLLM 0.26/0.28 list as V2 by default
    "moe-default-v2": {**BASE, "architectures": ["Qwen2MoeForCausalLM"],
                       "model_type": "qwen2_moe", "num_experts": 4,
                       "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                       "shared_expert_intermediate_size": 256},
    # Gemma-2/3 style: sliding window on every other layer (two KV cache groups)
    "sliding-window": {**BASE, "architectures": ["LlamaForCausalLM"],
                       "model_type": "llama", "sliding_window": 128,
                       "layer_types": ["sliding_attention", "full_attention"] * 2},
    # every layer slides
    "sliding-window-all": {**BASE, "architectures": ["MistralForCausalLM"],
                           "model_type": "mistral", "sliding_window": 128},
}
ENVS = [{}, {"VLLM_USE_V2_MODEL_RUNNER": "0"}, {"VLLM_USE_V2_MODEL_RUNNER": "1"}]


def main(scratch: Path) -> None:
    import importlib

    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig

    from tvc.contract.compat import vllm_version
    from tvc.contract.layout import (
        ModelFacts,
        cross_layer_api,
        decide_model_runner,
        mirror_model_runner,
        vllm_env,
    )

    version = vllm_version()
    cases = []
    for name, cfg in MODELS.items():
        d = scratch / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg))
        mc = ModelConfig(model=str(d), dtype="float16", seed=0,
                         skip_tokenizer_init=True, max_model_len=2048)
        vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=16),
                        device_config=DeviceConfig("cpu"))
        mod = importlib.import_module(type(vc).__module__)
        for env in ENVS:
            with vllm_env(env), contextlib.ExitStack() as st:
                old = getattr(mod, "HAS_TRITON", None)
                if old is not None:
                    mod.HAS_TRITON = True
                    st.callback(setattr, mod, "HAS_TRITON", old)
                own = "V2" if type(vc).use_v2_model_runner.fget(vc) else "V1"
                unsupported = list(vc._get_v2_model_runner_unsupported_features())
            harness = decide_model_runner(vc, env)
            mirror = mirror_model_runner(version, ModelFacts.of(mc),
                                         {**os.environ, **env},
                                         unsupported=unsupported)
            cases.append({"model": name, "env": env, "vllm": own,
                          "harness": list(harness), "mirror": mirror,
                          "facts": ModelFacts.of(mc).__dict__ | {
                              "architectures": list(ModelFacts.of(mc).architectures)},
                          "cross_layer_api": cross_layer_api()})
    print("PROBE-JSON " + json.dumps({"version": version, "cases": cases}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
