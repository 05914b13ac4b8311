"""The one place where the contract harness meets differences between vLLM versions.

vLLM's ``KVCacheConfig``, ``Scheduler``, KV layout, ``ModelRunnerOutput`` and
forward context move between releases; each shim here detects features
(``hasattr``, ``dataclasses.fields``, ``inspect.signature``), never version strings,
and names the vLLM versions and files it serves. Checked on 0.26.0, 0.28.0, 0.33.0
(``SUPPORTED_VLLM``). A missing API raises :class:`HarnessIncompatible`;
:func:`check_harness` probes them all at fixture set-up. The differences handled
are listed in docs/vllm-versions.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata as md
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

#: vLLM releases the harness supports (PEP 440 specifier); checked on 0.26.0,
#: 0.28.0 and 0.33.0. Outside it the shims still feature-detect; an API they do
#: not know raises :class:`HarnessIncompatible`.
SUPPORTED_VLLM = ">=0.26,<0.34"
CHECKED_VLLM = ("0.26.0", "0.28.0", "0.33.0")

#: ``KVCacheTensor`` field listing the layers a tensor backs: ``shared_by``
#: (vLLM 0.26, 0.28), ``layers`` (0.33); ``vllm/v1/kv_cache_interface.py``.
KV_TENSOR_LAYER_FIELDS = ("shared_by", "layers")

_PLANNING_MODULES = ("vllm.v1.core.kv_cache_planning",  # 0.33
                     "vllm.v1.core.kv_cache_utils")  # 0.26, 0.28


# ------------------------------------------------------------------ the exception
def vllm_version() -> str:
    """The installed vLLM's version (metadata, ``vllm.__version__``, else "unknown")."""
    try:
        return md.version("vllm")
    except md.PackageNotFoundError:
        pass
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # noqa: BLE001 - only for a message
        return "unknown"


class HarnessIncompatible(Exception):
    """The installed vLLM lacks an API the contract harness needs.

    Not a connector failure: pytest reports it as an ERROR
    (:mod:`tvc.plugin.compat_report`). ``api`` is e.g. ``"KVCacheTensor"``;
    ``change`` says what changed; ``version`` defaults to :func:`vllm_version`.
    """

    def __init__(self, api: str, change: str, version: str | None = None) -> None:
        self.api = api
        self.change = change
        self.version = version or vllm_version()
        super().__init__(f"suite harness does not support vLLM {self.version}: "
                         f"{api} ({change})")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.api, self.change, self.version)


def _import(module: str, api: str) -> Any:
    """Import a vLLM module; a missing ``vllm.*`` module is HarnessIncompatible."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")) \
                and exc.name.startswith("vllm."):
            raise HarnessIncompatible(api, f"module {module} does not exist"
                                      ) from None
        raise


def _param_names(obj: Any) -> set[str]:
    """Field names of a dataclass, else the constructor's parameter names."""
    if dataclasses.is_dataclass(obj):
        return {f.name for f in dataclasses.fields(obj)}
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return set()
    return {n for n, p in params.items() if p.kind not in (
        p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _require_fields(obj: Any, api: str, needed: Sequence[str]) -> set[str]:
    have = _param_names(obj)
    missing = [n for n in needed if n not in have]
    if missing:
        raise HarnessIncompatible(api, f"no field(s) {', '.join(missing)}; it has "
                                  f"{', '.join(sorted(have)) or 'none'}")
    return have


# ------------------------------------------------------------- KV cache config
def kv_cache_config_builder() -> Callable[[Any, list[Any], int], Any]:
    """VLLM's ``get_kv_cache_config_from_groups(vllm_config, groups, memory)``.

    From ``vllm/v1/core/kv_cache_utils.py`` (0.26, 0.28) or
    ``vllm/v1/core/kv_cache_planning.py`` (0.33); HarnessIncompatible in neither.
    """
    for name in _PLANNING_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        fn = getattr(mod, "get_kv_cache_config_from_groups", None)
        if callable(fn):
            return fn
    raise HarnessIncompatible("get_kv_cache_config_from_groups",
                              "not in " + " or ".join(_PLANNING_MODULES))


def kv_cache_tensor_layer_field() -> str:
    """The ``KVCacheTensor`` field naming the layers it backs.

    ``"shared_by"`` (vLLM 0.26, 0.28) or ``"layers"`` (0.33); HarnessIncompatible
    with neither.
    """
    from vllm.v1.kv_cache_interface import KVCacheTensor

    have = _param_names(KVCacheTensor)
    for name in KV_TENSOR_LAYER_FIELDS:
        if name in have:
            return name
    raise HarnessIncompatible(
        "vllm.v1.kv_cache_interface.KVCacheTensor",
        f"no layer-name field: it has {', '.join(sorted(have)) or 'none'}, the "
        "harness knows shared_by (vLLM 0.26-0.28) and layers (0.33)")


def kv_cache_tensor_layers(tensor: Any) -> list[str]:
    """Layer names a ``KVCacheTensor`` backs (:func:`kv_cache_tensor_layer_field`)."""
    return list(getattr(tensor, kv_cache_tensor_layer_field()))


def resolve_kv_cache_layout(vllm_config: Any, specs: Sequence[Any],
                            backend: type | None = None) -> Any:
    """Resolve the physical KV cache layout as the engine core does, where it does.

    vLLM 0.33: ``EngineCore._initialize_kv_caches`` calls
    ``vllm/v1/attention/backends/utils.py: resolve_kv_cache_layout`` and records the
    ``KVCacheLayout`` on ``cache_config.kv_cache_layout`` (in place; one already
    there is kept). Returns None on 0.26/0.28, where ``get_kv_cache_layout()``
    decides when the backend is asked.
    """
    from vllm.v1.attention.backends import utils as attn_utils

    resolve = getattr(attn_utils, "resolve_kv_cache_layout", None)
    if resolve is None:
        return None
    supported = attn_utils.get_supported_kv_cache_layouts(
        [backend or attention_backend()])
    return resolve(vllm_config, [[layout.name for layout in supported]],
                   list(specs))


def resolve_engine_kv_cache_fields(vllm_config: Any, kv_cache_config: Any) -> None:
    """Fill the ``KVCacheConfig`` fields the engine core resolves, where they exist.

    vLLM 0.33 (``EngineCore._initialize_kv_caches``): ``kv_cache_layout``,
    ``hash_block_size`` (``resolve_kv_cache_block_sizes``) and
    ``cache_hit_alignment_tokens`` (``resolve_cache_hit_alignment_tokens``,
    ``vllm/v1/core/kv_cache_utils.py``; read by ``OffloadingConnector``); the last two
    are copied into ``CacheConfig`` as ``Worker.initialize_from_config`` does. No-op
    on 0.26/0.28.
    """
    from vllm.v1.core import kv_cache_utils as kcu

    have = _param_names(type(kv_cache_config))
    cache = vllm_config.cache_config
    if "kv_cache_layout" in have:
        kv_cache_config.kv_cache_layout = getattr(cache, "kv_cache_layout", None)
    if "hash_block_size" not in have or not hasattr(
            kcu, "resolve_kv_cache_block_sizes"):
        return
    block, hashed = kcu.resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    kv_cache_config.hash_block_size = hashed
    if "cache_hit_alignment_tokens" in have and hasattr(
            kcu, "resolve_cache_hit_alignment_tokens"):
        kv_cache_config.cache_hit_alignment_tokens = \
            kcu.resolve_cache_hit_alignment_tokens(kv_cache_config, vllm_config,
                                                   block, hashed)
    cache_fields = _param_names(type(cache)) | set(vars(cache))
    for name in ("hash_block_size", "cache_hit_alignment_tokens"):
        if name in cache_fields and hasattr(kv_cache_config, name):
            setattr(cache, name, getattr(kv_cache_config, name))


def build_kv_cache_config(vllm_config: Any, spec: Any, layer_names: Sequence[str],
                          num_blocks: int) -> Any:
    """A ``KVCacheConfig`` of one group, built by vLLM as the engine core builds it.

    Gives vLLM's builder exactly ``num_blocks`` pages per layer, then fills the
    engine-resolved fields and ``cache_config.num_gpu_blocks``; every layer is
    backed by exactly one tensor.

    Raises:
        HarnessIncompatible: vLLM lacks the builder, ``KVCacheTensor`` has no known
            layer field, or vLLM's plan does not give ``num_blocks`` blocks to
            each layer.

    """
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    names = list(layer_names)
    build = kv_cache_config_builder()
    kv_cache_tensor_layer_field()  # fail before vLLM's builder trips over it
    with set_current_vllm_config(vllm_config):
        resolve_kv_cache_layout(vllm_config, [spec])
        kcc = build(vllm_config, [KVCacheGroupSpec(names, spec)],
                    spec.page_size_bytes * num_blocks * len(names))
    if kcc.num_blocks != num_blocks:
        raise HarnessIncompatible(
            "get_kv_cache_config_from_groups",
            f"it planned {kcc.num_blocks} blocks for the memory of {num_blocks} "
            f"blocks x {len(names)} layers")
    backed = sorted(n for t in kcc.kv_cache_tensors
                    for n in kv_cache_tensor_layers(t))
    if backed != sorted(names):
        raise HarnessIncompatible(
            "get_kv_cache_config_from_groups",
            f"its tensors back layers {backed}, expected each of {sorted(names)} "
            "once")
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    resolve_engine_kv_cache_fields(vllm_config, kcc)
    return kcc


# ------------------------------------------------------------------- scheduler
def scheduler_kwargs(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.v1.core.sched.scheduler.Scheduler``.

    As ``EngineCore.__init__`` (``vllm/v1/engine/core.py``, 0.26-0.33) passes them:
    ``block_size``/``hash_block_size`` from ``resolve_kv_cache_block_sizes`` where it
    exists, ``log_stats=True``. HarnessIncompatible if a parameter is missing.
    """
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    have = _require_fields(
        Scheduler, "vllm.v1.core.sched.scheduler.Scheduler",
        ("vllm_config", "kv_cache_config", "structured_output_manager",
         "block_size", "log_stats"))
    block = hashed = vllm_config.cache_config.block_size
    resolve = getattr(kcu, "resolve_kv_cache_block_sizes", None)
    if resolve is not None:
        block, hashed = resolve(kv_cache_config, vllm_config)
    kw: dict[str, Any] = dict(
        vllm_config=vllm_config, kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block, log_stats=True)
    if "hash_block_size" in have:
        kw["hash_block_size"] = hashed
    return kw


# ------------------------------------------------------------------ KV caches
def attention_backend() -> type[Any]:
    """The attention backend whose KV layout the worker harness uses.

    FlashAttention, vLLM's pick for Llama on an NVIDIA GPU
    (``vllm/v1/attention/backends/flash_attn.py``, 0.26-0.33); its layout functions
    are pure, so the same layout is used on CPU. HarnessIncompatible if it is gone.
    """
    mod = _import("vllm.v1.attention.backends.flash_attn",
                  "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend")
    backend = getattr(mod, "FlashAttentionBackend", None)
    if backend is None:
        raise HarnessIncompatible(
            "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend",
            "the class does not exist")
    return backend


def kv_allocation_api() -> str:
    """Which KV allocation path this vLLM offers (HarnessIncompatible: neither).

    ``"backend_shape"``: ``FlashAttentionBackend.get_kv_cache_shape`` and
    ``get_kv_cache_stride_order`` (0.26, 0.28); ``"worker_utils"``:
    ``vllm/v1/worker/utils.py: allocate_kv_cache`` with the resolved layout (0.33).
    """
    backend = attention_backend()
    if hasattr(backend, "get_kv_cache_shape"):
        return "backend_shape"
    from vllm.v1.attention.backends import utils as attn_utils

    worker_utils = _import("vllm.v1.worker.utils",
                           "vllm.v1.worker.utils.allocate_kv_cache")
    if hasattr(worker_utils, "allocate_kv_cache") and hasattr(
            attn_utils, "resolve_kv_cache_layout"):
        return "worker_utils"
    raise HarnessIncompatible(
        "KV cache allocation",
        "FlashAttentionBackend.get_kv_cache_shape is gone and "
        "vllm.v1.worker.utils.allocate_kv_cache / "
        "vllm.v1.attention.backends.utils.resolve_kv_cache_layout are absent")


def allocate_kv_caches(vllm_config: Any, kv_cache_config: Any, device: str
                       ) -> dict[str, Any]:
    """Allocate zeroed KV caches per layer exactly as this vLLM's model runner does.

    0.26/0.28: a stride-ordered buffer per layer, permuted back to
    ``get_kv_cache_shape`` (``GPUModelRunner._reshape_kv_cache_tensors``). 0.33: one
    buffer viewed per layer in the resolved layout
    (``GPUModelRunner.initialize_kv_cache_tensors`` ->
    ``vllm/v1/worker/utils.py: allocate_kv_cache``).

    Returns:
        layer name -> tensor of logical shape ``(num_blocks, H, B, 2*D)`` (K and V
        packed, FlashAttention 0.26-0.33), dtype = the spec's dtype.

    Raises:
        HarnessIncompatible: no known allocation path, or a layout the harness
            cannot address (:func:`tvc.contract.worker.token_view`).

    """
    import torch
    from vllm.config import set_current_vllm_config

    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    if kv_allocation_api() == "worker_utils":
        from vllm.v1.worker import utils as worker_utils

        with set_current_vllm_config(vllm_config):
            out = dict(worker_utils.allocate_kv_cache(
                kv_cache_config, torch.device(device),
                vllm_config.cache_config.get_resolved_kv_cache_layout()))
        api = "vllm.v1.worker.utils.allocate_kv_cache"
    else:
        out = _allocate_by_backend_shape(vllm_config, kv_cache_config, device)
        api = "FlashAttentionBackend.get_kv_cache_shape"
    want = {(kv_cache_config.num_blocks, spec.num_kv_heads, spec.block_size,
             2 * spec.head_size),
            (2, kv_cache_config.num_blocks, spec.block_size, spec.num_kv_heads,
             spec.head_size)}
    for name in group.layer_names:
        t = out.get(name)
        shape = None if t is None else tuple(t.shape)
        if shape not in want:
            raise HarnessIncompatible(
                api, f"layer {name} got shape {shape}; the harness addresses "
                "(num_blocks, H, B, 2*D) and (2, num_blocks, B, H, D)")
    return {name: out[name] for name in group.layer_names}


def _allocate_by_backend_shape(vllm_config: Any, kv_cache_config: Any, device: str
                               ) -> dict[str, Any]:
    """0.26/0.28 path of :func:`allocate_kv_caches`."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends import utils as attn_utils

    backend = attention_backend()
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    shape = backend.get_kv_cache_shape(kv_cache_config.num_blocks, spec.block_size,
                                       spec.num_kv_heads, spec.head_size)
    layout_cache = getattr(attn_utils.get_kv_cache_layout, "cache_clear", None)
    with set_current_vllm_config(vllm_config):
        if layout_cache:
            layout_cache()
        try:
            order = backend.get_kv_cache_stride_order()
        except (AttributeError, NotImplementedError):
            order = tuple(range(len(shape)))
        finally:
            if layout_cache:
                layout_cache()
    inv = [order.index(i) for i in range(len(order))]
    out = {}
    for name in group.layer_names:
        raw = torch.zeros([shape[i] for i in order], dtype=spec.dtype, device=device)
        out[name] = raw.permute(*inv)
    return out


# ------------------------------------------------------------- worker plumbing
class HarnessAttentionLayer:
    """What the harness puts in ``static_forward_context`` for one attention layer.

    The model runner binds each layer's KV tensor there (``vllm/v1/worker/utils.py
    bind_kv_cache``: ``forward_context[layer_name].kv_cache = kv_cache`` in 0.26.0
    L536-L538; ``layer.bind_kv_cache(kv_cache)`` in 0.28.0 L549-L550 and
    ``attention_layer_base.py``). Connectors that use the forward context (LMCache's
    ``_init_kv_caches_from_forward_context``, ExampleConnector's ``start_load_kv``)
    read ``layer_name`` and ``kv_cache``.
    """

    def __init__(self, layer_name: str, kv_cache: Any) -> None:
        self.layer_name = layer_name
        self.kv_cache = kv_cache

    def bind_kv_cache(self, kv_cache: Any) -> None:
        """Bind the layer's KV tensor (``AttentionLayerBase.bind_kv_cache``)."""
        self.kv_cache = kv_cache


@contextlib.contextmanager
def engine_forward_context(vllm_config: Any, kv_caches: Mapping[str, Any],
                           slot_mapping: Mapping[str, Any] | None = None,
                           num_tokens: int | None = None,
                           with_metadata: bool = True) -> Iterator[Any]:
    """The forward context of vLLM around a harness step, as the model runner sets it.

    Sources (0.28.0; same in 0.26.0): V1 ``gpu_model_runner.py`` L4548-L4563 with
    ``kv_connector_model_runner_mixin.py`` L78-L112; V2 ``gpu/model_runner.py``
    L1644-L1655, ``gpu/kv_connector.py`` L61-L75 (``post_forward`` after the block,
    L1739); ``no_compile_layers`` is ``static_forward_context``
    (``forward_context.py`` ``create_forward_context``, L230). Layers without an
    entry there get a :class:`HarnessAttentionLayer`.

    Args:
        vllm_config: the rig's config.
        kv_caches: layer name -> the KV tensor registered with the connector.
        slot_mapping: layer name -> long tensor ``(num_tokens,)`` of this step's
            slots (``block_id * B + offset``).
        num_tokens: tokens scheduled in this step.
        with_metadata: False for a step without a forward (the runner's
            ``kv_connector_no_forward`` passes ``attn_metadata=None``).

    Yields:
        vLLM's ``ForwardContext``.

    Raises:
        HarnessIncompatible: this vLLM has no ``set_forward_context``.

    """
    try:
        from vllm.forward_context import get_forward_context, set_forward_context
    except ImportError as exc:
        raise HarnessIncompatible("vllm.forward_context.set_forward_context",
                                  str(exc)) from None
    static = vllm_config.compilation_config.static_forward_context
    for name, kv in kv_caches.items():
        layer = static.get(name)
        if layer is None:
            static[name] = HarnessAttentionLayer(name, kv)
        elif getattr(layer, "kv_cache", None) is not kv:
            layer.kv_cache = kv
    meta = ({n: SimpleNamespace(layer_name=n, slot_mapping=(slot_mapping or {}).get(n))
             for n in kv_caches} if with_metadata else None)
    params = inspect.signature(set_forward_context).parameters
    kw: dict[str, Any] = {}
    if with_metadata and num_tokens is not None and "num_tokens" in params:
        kw["num_tokens"] = num_tokens
    if with_metadata and slot_mapping is not None and "slot_mapping" in params:
        kw["slot_mapping"] = dict(slot_mapping)
    with set_forward_context(meta, vllm_config, **kw):
        yield get_forward_context()


def model_runner_output(req_ids: Sequence[str], sampled_token_ids: list[list[int]],
                        kv_connector_output: Any) -> Any:
    """A ``ModelRunnerOutput`` as the model runner returns it (no logprobs/pooling).

    ``vllm/v1/outputs.py`` (0.26-0.33); optional fields are passed empty where they
    exist (``pooler_output`` as one ``None`` per request where it is a list).
    HarnessIncompatible if a required field is missing.
    """
    from vllm.v1.outputs import ModelRunnerOutput

    have = _require_fields(
        ModelRunnerOutput, "vllm.v1.outputs.ModelRunnerOutput",
        ("req_ids", "req_id_to_index", "sampled_token_ids", "kv_connector_output"))
    req_ids = list(req_ids)
    kw: dict[str, Any] = dict(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled_token_ids, kv_connector_output=kv_connector_output)
    if "logprobs" in have:
        kw["logprobs"] = None
    if "prompt_logprobs_dict" in have:
        kw["prompt_logprobs_dict"] = {}
    if "pooler_output" in have:
        kw["pooler_output"] = [None] * len(req_ids) if _pooler_is_list() else None
    return ModelRunnerOutput(**kw)


def _pooler_is_list() -> bool:
    from vllm.v1.outputs import ModelRunnerOutput

    try:
        ann = inspect.signature(ModelRunnerOutput).parameters["pooler_output"]
    except (KeyError, ValueError):
        return False
    return "None" not in str(ann.annotation) and "list" in str(ann.annotation)


# ----------------------------------------------------------------------- probe
def check_harness() -> None:
    """Check, without building anything, that this vLLM has every API the harness uses.

    Called by the contract fixtures at set-up (cached per process); raises
    HarnessIncompatible for the first missing API.
    """
    err = _probe()
    if err is not None:
        raise HarnessIncompatible(err.api, err.change, err.version)


@functools.cache
def _probe() -> HarnessIncompatible | None:
    try:
        _probe_apis()
    except HarnessIncompatible as exc:
        return exc
    return None


def _probe_apis() -> None:
    kv_cache_config_builder()
    kv_cache_tensor_layer_field()
    kv_allocation_api()
    kci = _import("vllm.v1.kv_cache_interface", "vllm.v1.kv_cache_interface")
    for name in ("FullAttentionSpec", "KVCacheGroupSpec", "KVCacheConfig"):
        if not hasattr(kci, name):
            raise HarnessIncompatible(f"vllm.v1.kv_cache_interface.{name}",
                                      "the class does not exist")
    _require_fields(kci.KVCacheConfig, "vllm.v1.kv_cache_interface.KVCacheConfig",
                    ("num_blocks", "kv_cache_tensors", "kv_cache_groups"))
    sched = _import("vllm.v1.core.sched.scheduler",
                    "vllm.v1.core.sched.scheduler.Scheduler")
    _require_fields(sched.Scheduler, "vllm.v1.core.sched.scheduler.Scheduler",
                    ("vllm_config", "kv_cache_config", "structured_output_manager",
                     "block_size", "log_stats"))
    out = _import("vllm.v1.core.sched.output", "vllm.v1.core.sched.output")
    _require_fields(out.SchedulerOutput, "vllm.v1.core.sched.output.SchedulerOutput",
                    ("scheduled_new_reqs", "scheduled_cached_reqs",
                     "num_scheduled_tokens", "finished_req_ids",
                     "kv_connector_metadata"))
    _require_fields(out.NewRequestData, "vllm.v1.core.sched.output.NewRequestData",
                    ("req_id", "prompt_token_ids", "block_ids",
                     "num_computed_tokens"))
    _require_fields(out.CachedRequestData,
                    "vllm.v1.core.sched.output.CachedRequestData",
                    ("req_ids", "new_block_ids", "num_computed_tokens"))
    outputs = _import("vllm.v1.outputs", "vllm.v1.outputs")
    _require_fields(outputs.ModelRunnerOutput, "vllm.v1.outputs.ModelRunnerOutput",
                    ("req_ids", "req_id_to_index", "sampled_token_ids",
                     "kv_connector_output"))
    _require_fields(outputs.KVConnectorOutput, "vllm.v1.outputs.KVConnectorOutput",
                    ("finished_sending", "finished_recving"))
    req = _import("vllm.v1.request", "vllm.v1.request.Request")
    _require_fields(req.Request, "vllm.v1.request.Request",
                    ("request_id", "prompt_token_ids", "sampling_params",
                     "pooling_params", "block_hasher"))
    kcu = _import("vllm.v1.core.kv_cache_utils", "vllm.v1.core.kv_cache_utils")
    for name in ("get_request_block_hasher", "init_none_hash"):
        if not hasattr(kcu, name):
            raise HarnessIncompatible(f"vllm.v1.core.kv_cache_utils.{name}",
                                      "the function does not exist")
    hashing = _import("vllm.utils.hashing", "vllm.utils.hashing.sha256")
    if not hasattr(hashing, "sha256"):
        raise HarnessIncompatible("vllm.utils.hashing.sha256",
                                  "the function does not exist")
