"""The model the server runs: the profile's local model, or a tiny Llama built here.

The tiny model is built on CPU without the hub and cached by content hash (builder
version, config, vocabulary, seed, init scale) under ``<scratch>/models/``. Init std is
0.1: with the default 0.02 a tiny random Llama repeats one token whatever the context,
hiding a corrupted KV load (seen on the GPU host). Tokenizer: a ``tokenizers`` WordLevel
model (``<unk>``, ``<s>``, ``</s>``, ``w3`` ...), loadable offline. Fixture:
``served_model`` (session).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

BUILDER_VERSION = 1  # bump when the build below changes its output
TINY_INIT_STD = 0.1  # see the module docstring (0.02 repeats one token)
TINY_SEED = 1234
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    # float16 over bfloat16: 3 more mantissa bits keep pass 1 / pass 2 logprobs close.
    "dtype": "float16",  # transformers 5 key (4.x wrote torch_dtype)
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": TINY_INIT_STD,
}
# The same tiny Llama with sliding-window attention on every other layer, in the
# Gemma-2/3 style that vLLM 0.26 and 0.28 read for Llama (model_executor/models/
# llama.py: a layer whose ``layer_types`` entry is "sliding_attention" gets
# ``config.sliding_window``; engine/arg_utils.py sets a model-wide window only when
# every layer slides). A window of 128 tokens (8 blocks of 16) is far below the
# e2e prompt (600 tokens), so the window matters. It is a hybrid model: vLLM's
# hybrid KV cache manager gives sliding and full layers separate KV groups, and vLLM
# turns that manager off for a connector that does not support it (vllm/config/
# vllm.py), so the baseline and the connector server manage KV differently and must
# still agree on the output.
TINY_SLIDING_WINDOW = 128
TINY_SLIDING_CONFIG: dict[str, Any] = {
    **TINY_CONFIG,
    "sliding_window": TINY_SLIDING_WINDOW,
    "layer_types": ["sliding_attention", "full_attention"] * (
        TINY_CONFIG["num_hidden_layers"] // 2),
}
# The same tiny Llama with 8 KV heads (and 8 query heads): connectors that handle
# only some KV-head counts per rank (Tutti's worker takes vLLM's cross-layer tensor
# with exactly 2) meet a common shape (Llama-3-8B and Qwen2.5-7B have 8 KV heads).
TINY_KV8_CONFIG: dict[str, Any] = {
    **TINY_CONFIG, "num_attention_heads": 8, "num_key_value_heads": 8}
# recipe name -> config (``build_tiny_model``)
TINY_RECIPES: dict[str, dict[str, Any]] = {
    "llama": TINY_CONFIG,
    "sliding-window": TINY_SLIDING_CONFIG,
    "kv8": TINY_KV8_CONFIG,
}


def recipe_hash(config: Mapping[str, Any] = TINY_CONFIG, seed: int = TINY_SEED,
                init_std: float = TINY_INIT_STD) -> str:
    """Content hash of a tiny-model recipe (hex sha256, first 16 digits)."""
    blob = json.dumps({"builder": BUILDER_VERSION, "config": dict(config),
                       "special": SPECIAL_TOKENS, "seed": seed,
                       "init_std": init_std}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _weights(config: Mapping[str, Any], seed: int, init_std: float) -> dict[str, Any]:
    """LlamaForCausalLM state dict: N(0, init_std) matrices, unit norm weights."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, config["dtype"])
    h, inter = config["hidden_size"], config["intermediate_size"]
    hd = config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def mat(*shape: int) -> Any:
        return (torch.randn(*shape, generator=gen) * init_std).to(dtype)

    sd = {"model.embed_tokens.weight": mat(config["vocab_size"], h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd |= {
            p + "self_attn.q_proj.weight": mat(q, h),
            p + "self_attn.k_proj.weight": mat(kv, h),
            p + "self_attn.v_proj.weight": mat(kv, h),
            p + "self_attn.o_proj.weight": mat(h, q),
            p + "mlp.gate_proj.weight": mat(inter, h),
            p + "mlp.up_proj.weight": mat(inter, h),
            p + "mlp.down_proj.weight": mat(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        }
    sd["model.norm.weight"] = torch.ones(h, dtype=dtype)
    sd["lm_head.weight"] = mat(config["vocab_size"], h)
    return sd


def _save_tokenizer(out: Path, vocab_size: int, max_len: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab |= {f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": max_len, "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({
        "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}, indent=2)
        + "\n")


def build_tiny_llama(root: Path, config: Mapping[str, Any] = TINY_CONFIG,
                     seed: int = TINY_SEED, init_std: float = TINY_INIT_STD) -> Path:
    """Build (or reuse) a tiny random Llama under ``root``.

    ``seed`` seeds the torch CPU generator; ``init_std`` is every matrix's std. Returns
    ``root/tiny-llama-<recipe hash>``; an existing folder is reused as is (it appears
    atomically, by rename, only once complete).
    """
    from safetensors.torch import save_file

    cfg = {**config, "initializer_range": init_std}
    dest = root / f"tiny-llama-{recipe_hash(config, seed, init_std)}"
    if dest.is_dir():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps({
            "bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
            "do_sample": False}, indent=2) + "\n")
        save_file(_weights(cfg, seed, init_std), str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        _save_tokenizer(tmp, cfg["vocab_size"], cfg["max_position_embeddings"])
        try:
            os.rename(tmp, dest)
        except OSError:  # another process finished first: use theirs
            if not dest.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def build_tiny_model(root: Path, recipe: str = "llama") -> Path:
    """Build (or reuse) the tiny model of a recipe of :data:`TINY_RECIPES`.

    ``recipe`` is ``llama``, ``sliding-window`` or ``kv8`` (8 KV heads); each has its
    own folder (see :func:`build_tiny_llama`).

    Raises:
        KeyError: an unknown recipe (the message lists the known ones).

    """
    if recipe not in TINY_RECIPES:
        raise KeyError(f"unknown tiny-model recipe {recipe!r} (known: "
                       f"{', '.join(TINY_RECIPES)})")
    return build_tiny_llama(root, TINY_RECIPES[recipe])


def prompt_token_range(model_dir: Path) -> tuple[int, int]:
    """Token ids safe for random prompts: ``[lo, hi)`` without special tokens.

    From config.json's ``vocab_size`` and tokenizer.json's special ids; below 30000, and
    skips the first 1000 ids of large vocabularies (byte and control tokens).
    """
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab = int(cfg.get("vocab_size") or cfg.get("text_config", {})["vocab_size"])
    specials: list[int] = []
    with_tok = model_dir / "tokenizer.json"
    if with_tok.is_file():
        tj = json.loads(with_tok.read_text())
        specials = [t["id"] for t in tj.get("added_tokens", []) if t.get("special")]
    lo = 1000 if vocab > 8000 else 0
    hi = min(vocab, 30000)
    below = [s for s in specials if lo <= s < hi]
    while below and max(below) >= (lo + hi) // 2:  # specials at the top: cut there
        hi = min(below)
        below = [s for s in specials if lo <= s < hi]
    if below:
        lo = max(below) + 1
    return lo, hi


def random_prompt(model_dir: Path, length: int, rng: random.Random) -> list[int]:
    """``length`` token ids drawn uniformly from :func:`prompt_token_range`."""
    lo, hi = prompt_token_range(model_dir)
    return [rng.randrange(lo, hi) for _ in range(length)]
