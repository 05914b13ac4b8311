"""Builders of vLLM objects around a connector, with defaults and keyword overrides.

Tiny model config (:func:`write_tiny_model`), ``VllmConfig``
(:func:`make_vllm_config`), ``KVCacheConfig``, vLLM's V1 ``Scheduler`` and
``Request`` objects, as vLLM's own connector unit tests build them.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tvc.config.profile import Profile
from tvc.contract import compat
from tvc.core.run_store import isolate_store_paths
from tvc.core.seed import run_seed

# Tiny Llama used only for its config (no weights are loaded by the contract tier).
TINY_VOCAB_SIZE = 32000  # token ids drawn below this
TINY_NUM_LAYERS = 2
EOS_TOKEN_ID = 2  # Llama convention; never sampled by the driver
SAMPLED_TOKEN_ID = 7  # the fake model always samples this token


DEFAULT_NUM_BLOCKS = 512  # GPU KV blocks in the scheduler's pool (real capacity)
DEFAULT_MAX_MODEL_LEN = 4096  # tokens


class ConnectorConfigRefused(AssertionError):
    """vLLM's own config classes refuse the profile's kv_transfer_config.

    An ``AssertionError`` (the target's failure, not the suite's) of one line: the
    connector, vLLM's version and the first complaint of ``exc`` (usually a
    ``pydantic.ValidationError``) without pydantic's dump.
    """

    def __init__(self, kv_transfer_config: Mapping[str, Any], exc: Exception) -> None:
        errors = getattr(exc, "errors", None)
        try:
            first = errors()[0] if callable(errors) else None
        except Exception:  # noqa: BLE001 - fall back to the text
            first = None
        if first:
            where = ".".join(str(p) for p in first.get("loc", ()) if p != "__root__")
            why = str(first.get("msg", "")).removeprefix("Value error, ")
            why = f"{where}: {why}" if where else why
        else:
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        from tvc.config.profile import installed_vllm_version

        name = kv_transfer_config.get("kv_connector", "?")
        super().__init__(
            f"vLLM {installed_vllm_version() or '(unknown version)'} refuses the "
            f"profile's kv_transfer_config for {name}: {why} — check "
            "connector.name / connector.module_path (is the connector in this vLLM, "
            "or importable?) and connector.kv_transfer")


# --------------------------------------------------------------------------- builders
def write_tiny_model(directory: Path, *, num_kv_heads: int = 2, head_size: int = 64,
                     num_layers: int = TINY_NUM_LAYERS, dtype: str = "float16"
                     ) -> Path:
    """Write a tiny Llama ``config.json`` that vLLM's ``ModelConfig`` accepts.

    Into ``directory`` (suite-owned scratch, created if missing; returned);
    ``head_size`` in elements, ``dtype`` ``float16`` or ``bfloat16``.
    """
    num_heads = max(num_kv_heads, 4)
    num_heads -= num_heads % num_kv_heads
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": num_heads * head_size,
        "intermediate_size": 2 * num_heads * head_size,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": head_size, "num_hidden_layers": num_layers,
        "vocab_size": TINY_VOCAB_SIZE, "max_position_embeddings": DEFAULT_MAX_MODEL_LEN,
        "rms_norm_eps": 1e-5, "torch_dtype": dtype, "bos_token_id": 1,
        "eos_token_id": EOS_TOKEN_ID, "tie_word_embeddings": False,
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    text = json.dumps(cfg, indent=1, sort_keys=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return directory


def make_vllm_config(profile: Profile, *, scratch: Path, block_size: int = 16,
                     num_kv_heads: int = 2, head_size: int = 64,
                     dtype: str = "float16", max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                     max_num_batched_tokens: int = DEFAULT_MAX_MODEL_LEN,
                     max_num_seqs: int = 16,
                     kv_transfer_config: Mapping[str, Any] | None = None,
                     device: str = "cpu", tensor_parallel_size: int = 1,
                     pipeline_parallel_size: int = 1, kv_events: bool = False,
                     model_name: str = "tiny-llama",
                     checkpoint_dtype: str | None = None, cache_dtype: str = "auto",
                     hash_algo: str = "sha256",
                     num_layers: int = TINY_NUM_LAYERS) -> Any:
    """Build a ``VllmConfig`` for the profile's connector (synchronous scheduling).

    Sizes: ``block_size`` B, ``max_model_len`` and ``max_num_batched_tokens`` (per
    step) in tokens, ``head_size`` in elements. ``kv_transfer_config`` overrides the
    profile's; store paths in the profile's scratch (or a test device) move to this
    session's store folder (:func:`tvc.core.run_store.isolate_store_paths`). Each TP
    rank gets ``num_kv_heads // tensor_parallel_size`` KV heads
    (``ModelConfig.get_num_kv_heads``); PP splits the layers (``get_pp_indices``,
    :func:`layer_names`). ``kv_events`` sets ``KVEventsConfig(enable_kv_cache_events=
    True, publisher="null")`` as ``--kv-events-config`` does. ``model_name`` is the
    folder stem (``ModelConfig.model``): another name is another model.
    ``checkpoint_dtype`` is ``config.json``'s ``torch_dtype`` (default ``dtype``);
    ``cache_dtype`` is ``--kv-cache-dtype``; the rig's requests hash with
    ``hash_algo`` (``--prefix-caching-hash-algo``) as ``EngineCore`` does
    (``vllm/v1/engine/core.py``).

    Raises:
        ConnectorConfigRefused: vLLM rejects the kv_transfer_config.

    """
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    ckpt = checkpoint_dtype or dtype
    layers = "" if num_layers == TINY_NUM_LAYERS else f"-L{num_layers}"
    model_dir = write_tiny_model(
        scratch / f"{model_name}-h{num_kv_heads}-d{head_size}{layers}-{ckpt}",
        num_kv_heads=num_kv_heads, head_size=head_size, num_layers=num_layers,
        dtype=ckpt)
    model_config = ModelConfig(model=str(model_dir), dtype=dtype, seed=0,
                               skip_tokenizer_init=True,
                               max_model_len=max_model_len)
    sched_kwargs: dict[str, Any] = dict(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, enable_chunked_prefill=True,
        is_encoder_decoder=False, async_scheduling=False)
    scheduler_config = SchedulerConfig(**sched_kwargs)
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True,
                               cache_dtype=cache_dtype,
                               prefix_caching_hash_algo=hash_algo)
    # Store paths under the profile's scratch move to this session's own folder, so
    # a replayed run (same --tvc-seed) finds no KV of an earlier run.
    ktc = isolate_store_paths(kv_transfer_config or profile.kv_transfer_config(),
                              profile.scratch,
                              devices=profile["store"]["test_devices"])
    try:
        kt = KVTransferConfig(**ktc)
        extra: dict[str, Any] = {}
        if kv_events:
            extra["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True, publisher="null")
        return VllmConfig(**extra, model_config=model_config,
                          scheduler_config=scheduler_config,
                          cache_config=cache_config, kv_transfer_config=kt,
                          device_config=DeviceConfig(device),
                          parallel_config=ParallelConfig(
                              tensor_parallel_size=tensor_parallel_size,
                              pipeline_parallel_size=pipeline_parallel_size))
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise ConnectorConfigRefused(ktc, exc) from None


def layer_names(vllm_config: Any) -> list[str]:
    """Attention layer names as vLLM names them for a Llama model.

    ``model.layers.<i>.self_attn.attn`` (global ``i``); under PP only the stage of
    ``parallel_config.rank`` (``ModelConfig.get_layers_start_end_indices``; ranks are
    DP x PP x TP).
    """
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    start, end = mc.get_layers_start_end_indices(pc)
    return [f"model.layers.{i}.self_attn.attn" for i in range(start, end)]


def make_kv_cache_config(vllm_config: Any, num_blocks: int = DEFAULT_NUM_BLOCKS
                         ) -> Any:
    """A real ``KVCacheConfig``: one full-attention group over every layer.

    Built by vLLM via :func:`tvc.contract.compat.build_kv_cache_config`, with
    ``num_blocks`` KV blocks per layer (the pool's real capacity); HarnessIncompatible
    when this vLLM cannot be driven.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    mc = vllm_config.model_config
    spec = FullAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=mc.get_num_kv_heads(vllm_config.parallel_config),
        head_size=mc.get_head_size(), dtype=kv_cache_dtype(vllm_config))
    return compat.build_kv_cache_config(vllm_config, spec, layer_names(vllm_config),
                                        num_blocks)


def kv_cache_dtype(vllm_config: Any) -> Any:
    """The KV cache's ``torch.dtype``, as the model runner resolves it.

    vLLM's ``kv_cache_dtype_str_to_dtype`` (``vllm/utils/torch_utils.py``, 0.26-0.33,
    ``GPUModelRunner.__init__``): ``auto`` is the model's dtype; ``fp8`` is
    ``torch.uint8``.
    """
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

    return kv_cache_dtype_str_to_dtype(vllm_config.cache_config.cache_dtype,
                                       vllm_config.model_config)


def make_scheduler(vllm_config: Any, kv_cache_config: Any | None = None) -> Any:
    """VLLM's real V1 ``Scheduler``; it creates the scheduler-side connector.

    ``kv_cache_config`` is built by :func:`make_kv_cache_config` if None.
    """
    from vllm.config import set_current_vllm_config
    from vllm.v1.core.sched.scheduler import Scheduler

    kv_cache_config = kv_cache_config or make_kv_cache_config(vllm_config)
    with set_current_vllm_config(vllm_config):
        sched = Scheduler(**compat.scheduler_kwargs(vllm_config, kv_cache_config))
    give_encoder_budget(sched, vllm_config.model_config.max_model_len)
    return sched


def give_encoder_budget(scheduler: Any, tokens: int) -> None:
    """Let the scheduler admit multimodal requests as for a multimodal model.

    vLLM gives a text-only model a 0 encoder budget (``Scheduler.__init__``), and
    ``_try_schedule_encoder_inputs`` then stops a prefill at a placeholder; the
    harness has no encoder (:func:`tvc.contract.worker.content_tokens`), so it sets
    a budget of ``tokens`` (encoder tokens per step and cache slots).
    """
    mgr: Any = getattr(scheduler, "encoder_cache_manager", None)
    if mgr is None:
        return
    try:
        fresh = type(mgr)(cache_size=tokens)
    except TypeError:  # another constructor: keep vLLM's (text-only budget)
        return
    scheduler.encoder_cache_manager = fresh
    scheduler.max_num_encoder_input_tokens = tokens


_REQ_COUNTER = itertools.count(1)
_NONE_HASH_READY = False
#: The first block's parent hash seed when PYTHONHASHSEED is unset: vLLM 0.33's
#: ``kv_cache_utils.DEFAULT_NONE_HASH_SEED`` (0.26/0.28 draw random bytes, so
#: block-hash keys would differ per process and a seeded run would not repeat).
NONE_HASH_SEED = "vllm-none-hash"


def _init_none_hash(sha256: Any) -> None:
    """``init_none_hash(sha256)`` with vLLM 0.33's seed unless PYTHONHASHSEED is set."""
    from vllm.v1.core import kv_cache_utils as kcu

    kcu.init_none_hash(sha256)
    if os.getenv("PYTHONHASHSEED") is None:
        kcu.NONE_HASH = sha256(NONE_HASH_SEED)  # BlockHash is NewType(bytes)


def prompt_tokens(num_tokens: int, seed: int) -> list[int]:
    """Deterministic pseudo-random token ids in ``[10, TINY_VOCAB_SIZE)``.

    Equal seeds (in one run seed) give equal prompts; no two seeds share a first token.
    """
    import random

    nonce = run_seed()  # the run's: --tvc-seed replays the same token ids
    rng = random.Random(f"{nonce}-{seed}")
    return [10 + (seed * 131 + nonce) % 9973] + [
        rng.randrange(10, TINY_VOCAB_SIZE) for _ in range(num_tokens - 1)]


def make_request(*, num_tokens: int, block_size: int, seed: int | None = None,
                 shared_prefix: Sequence[int] = (), max_tokens: int = 2,
                 request_id: str | None = None, cache_salt: str | None = None,
                 lora_request: Any = None,
                 sampling: Mapping[str, Any] | None = None,
                 prompt_embeds: Any = None, hash_algo: str = "sha256",
                 media: Sequence[tuple[int, int, str]] = ()) -> Any:
    """A vLLM ``Request`` with vLLM's own block hasher.

    ``num_tokens`` includes ``shared_prefix``; ``block_size`` must equal the cache's;
    ``seed`` None is a new prompt; ``request_id`` defaults to ``req-<n>``.
    ``cache_salt`` goes into the first block's hash, the ``lora_request`` name into
    every one. ``sampling`` adds ``SamplingParams`` fields. ``prompt_embeds``:
    ``(tokens) -> tensor [num_tokens, hidden]`` makes an embeddings-only request
    (hashes cover the embeddings,
    ``kv_cache_utils._gen_prompt_embeds_extra_hash_keys``).
    ``hash_algo``: ``sha256``, ``sha256_cbor``, ``xxhash`` or ``xxhash_cbor``.
    ``media``: ``(offset, length, identifier)`` placeholder items, made
    ``mm_features`` (modality ``image``, ``mm_hash`` = identifier) and mixed into
    the hash of every block they overlap
    (``kv_cache_utils.generate_block_hash_extra_keys``).

    Raises:
        ValueError: vLLM knows no such hash function.
        ModuleNotFoundError: ``xxhash`` is named and not installed.

    """
    global _NONE_HASH_READY
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name, sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    if not _NONE_HASH_READY:
        _init_none_hash(sha256)
        _NONE_HASH_READY = True
    n = next(_REQ_COUNTER)
    seed = n + 100_000 if seed is None else seed
    prefix = list(shared_prefix)
    assert len(prefix) <= num_tokens, "shared_prefix longer than the prompt"
    tail = prompt_tokens(num_tokens - len(prefix) + 1, seed)[1:] if prefix else \
        prompt_tokens(num_tokens, seed)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                            **dict(sampling or {}))
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    toks = prefix + tail
    embeds = None if prompt_embeds is None else prompt_embeds(toks)
    extra: dict[str, Any] = {}
    if media:
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

        extra["mm_features"] = [
            MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                  mm_position=PlaceholderRange(offset=o, length=ln),
                                  mm_hash=ident)
            for o, ln, ident in sorted(media)]
    return Request(**extra, request_id=request_id or f"req-{n}",
                   prompt_token_ids=None if embeds is not None else toks,
                   prompt_embeds=embeds, sampling_params=params,
                   pooling_params=None, cache_salt=cache_salt,
                   lora_request=lora_request,
                   block_hasher=get_request_block_hasher(
                       block_size, get_hash_fn_by_name(hash_algo)))
