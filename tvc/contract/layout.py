"""Which model runner and KV layout the installed vLLM hands a connector's worker.

The runner: ``VllmConfig.use_v2_model_runner`` (``vllm/config/vllm.py``,
0.26-0.33), taken from vLLM's own property (:func:`decide_model_runner`) or its
per-version transcription (:func:`mirror_model_runner`). The tensors: V2
(``vllm/v1/worker/gpu/kv_connector.py``) registers per-layer
``(num_blocks, H, B, 2*D)``; V1 (``GPUModelRunner.initialize_kv_cache_tensors``,
0.26/0.28) one cross-layer tensor where ``prefer_cross_layer_blocks`` and
``KVConnectorModelRunnerMixin.use_uniform_kv_cache`` hold. NHD/HND comes from
``VLLM_KV_CACHE_LAYOUT``, else ``get_required_kvcache_layout``
(``get_kv_cache_layout``, ``vllm/v1/attention/backends/utils.py``; 0.33:
``resolve_kv_cache_layout``). See docs/tutti.md, "Which KV tensors the engine
hands a connector".
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

#: the variable vLLM reads first (vllm/envs.py, 0.26-0.33)
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
#: the variable that fixes NHD or HND (vllm/envs.py, 0.26-0.33)
LAYOUT_ENV = "VLLM_KV_CACHE_LAYOUT"
KV_LAYOUTS = ("NHD", "HND")

#: architectures that default to the V2 runner even when MoE or hybrid, as
#: written in vllm/config/vllm.py (DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES);
#: used only when the installed vLLM does not expose its own set
_DEFAULT_V2_ARCHITECTURES = frozenset({
    "DeepseekV2ForCausalLM", "DeepseekV4ForCausalLM", "GraniteMoeForCausalLM",
    "InklingForCausalLM", "InklingForConditionalGeneration",
    "KimiK3ForConditionalGeneration", "LongcatFlashNgramForCausalLM",
    "Qwen2MoeForCausalLM"})


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What vLLM's runner decision reads about the model (``ModelConfig``).

    Attributes:
        architectures: ``hf_config.architectures``.
        runner_type: ``"generate"``, ``"pooling"``...
        is_hybrid: attention + Mamba-like layers.
        is_diffusion: 0.26+; False where absent.

    """

    architectures: tuple[str, ...]
    runner_type: str = "generate"
    is_moe: bool = False
    is_hybrid: bool = False
    is_attention_free: bool = False
    is_diffusion: bool = False

    @classmethod
    def of(cls, model_config: Any) -> ModelFacts:
        """Read the facts from a ``vllm.config.ModelConfig``."""
        return cls(
            architectures=tuple(getattr(model_config, "architectures", ()) or ()),
            runner_type=str(getattr(model_config, "runner_type", "generate")),
            is_moe=bool(getattr(model_config, "is_moe", False)),
            is_hybrid=bool(getattr(model_config, "is_hybrid", False)),
            is_attention_free=bool(getattr(model_config, "is_attention_free",
                                           False)),
            is_diffusion=bool(getattr(model_config, "is_diffusion", False)))


def _env_bool(value: str | None) -> bool | None:
    """``vllm.envs.maybe_convert_bool``; ValueError on a non-integer, as vLLM."""
    if value is None:
        return None
    return bool(int(value))


def mirror_model_runner(version: str, facts: ModelFacts, env: Mapping[str, str],
                        *, has_triton: bool = True,
                        unsupported: Sequence[str] = ()) -> str:
    """The runner (``"V1"``/``"V2"``) vLLM ``version`` picks (``use_v2_model_runner``).

    A transcription for ``facts`` and the server's ``env``; ``has_triton`` is True on
    a CUDA host; ``unsupported`` is
    ``VllmConfig._get_v2_model_runner_unsupported_features()``. Speculative-decoding
    and context-parallel branches are not modelled (the suite runs neither).
    ValueError when ``VLLM_USE_V2_MODEL_RUNNER`` is not an integer.
    """
    from packaging.version import Version

    forced = _env_bool(env.get(RUNNER_ENV))
    if forced is not None:
        return "V2" if forced else "V1"
    v = Version(version).release[:2]
    if v >= (0, 33):
        return "V2" if (has_triton and not unsupported) else "V1"
    if facts.is_diffusion:
        return "V2"
    default_arch = any(a in _DEFAULT_V2_ARCHITECTURES for a in facts.architectures)
    if facts.runner_type != "generate":
        return "V1"
    if facts.is_hybrid and (v < (0, 28) or not default_arch):
        return "V1"
    if facts.is_attention_free:
        return "V1"
    if not (default_arch or not facts.is_moe):
        return "V1"
    if not has_triton or unsupported:
        return "V1"
    return "V2"


@contextlib.contextmanager
def vllm_env(env: Mapping[str, str]) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` for vLLM's readers, then restore it.

    Clears ``vllm.envs``' cache (``enable_envs_cache``) and the cached
    ``get_kv_cache_layout`` on entry and exit.
    """
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    _clear_vllm_caches()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _clear_vllm_caches()


def _clear_vllm_caches() -> None:
    import sys

    envs = sys.modules.get("vllm.envs")
    clear = getattr(getattr(envs, "__getattr__", None), "cache_clear", None)
    if clear:
        clear()
    utils = sys.modules.get("vllm.v1.attention.backends.utils")
    clear = getattr(getattr(utils, "get_kv_cache_layout", None), "cache_clear", None)
    if clear:
        clear()


def decide_model_runner(vllm_config: Any, env: Mapping[str, str] | None = None
                        ) -> tuple[str, str]:
    """The model runner the installed vLLM uses for this config on a CUDA host.

    Calls ``VllmConfig.use_v2_model_runner`` under ``env`` (over ``os.environ``) with
    ``HAS_TRITON`` True: the decision is for the GPU server, even on a CPU box.

    Returns:
        ``(runner, source)``: runner ``"V1"`` or ``"V2"``; source ``"vllm"``
        (its property), ``"mirror"`` (:func:`mirror_model_runner`: the property
        failed outside a CUDA host) or ``"no V2 runner"`` (this vLLM has none).

    Raises:
        ValueError: ``VLLM_USE_V2_MODEL_RUNNER`` is not an integer.

    """
    import importlib

    env = dict(env or {})
    merged = {**os.environ, **env}
    _env_bool(merged.get(RUNNER_ENV))  # a bad value is the caller's error
    prop = getattr(type(vllm_config), "use_v2_model_runner", None)
    if not isinstance(prop, property) or prop.fget is None:
        return "V1", "no V2 runner"
    mod = importlib.import_module(type(vllm_config).__module__)
    with vllm_env(env), _patched(mod, "HAS_TRITON", True):
        try:
            return ("V2" if prop.fget(vllm_config) else "V1"), "vllm"
        except Exception:  # noqa: BLE001 - platform probes off a GPU host
            pass
    from tvc.contract.compat import vllm_version

    unsupported: list[str] = []
    probe = getattr(vllm_config, "_get_v2_model_runner_unsupported_features", None)
    with contextlib.suppress(Exception):
        unsupported = list(probe()) if probe else []
    return mirror_model_runner(vllm_version(), ModelFacts.of(
        vllm_config.model_config), merged, unsupported=unsupported), "mirror"


@contextlib.contextmanager
def _patched(mod: Any, name: str, value: Any) -> Iterator[None]:
    missing = object()
    old = getattr(mod, name, missing)
    if old is not missing:
        setattr(mod, name, value)
    try:
        yield
    finally:
        if old is not missing:
            setattr(mod, name, old)


def cross_layer_api() -> bool:
    """Whether this vLLM's V1 runner can hand a cross-layer tensor at all.

    ``KVConnectorModelRunnerMixin.allocate_uniform_kv_caches`` (0.26, 0.28); absent
    in 0.33.
    """
    try:
        from vllm.v1.worker.kv_connector_model_runner_mixin import (
            KVConnectorModelRunnerMixin,
        )
    except ImportError:
        return False
    return hasattr(KVConnectorModelRunnerMixin, "allocate_uniform_kv_caches")


def allowed_kv_layouts(connector_cls: Any, vllm_config: Any,
                       env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The physical KV layouts (NHD/HND) this engine may hand the connector.

    ``VLLM_KV_CACHE_LAYOUT`` (profile env, else process) fixes one; else the
    connector's ``get_required_kvcache_layout(vllm_config)`` when it returns a name;
    else both.
    """
    merged = {**os.environ, **dict(env or {})}
    fixed = merged.get(LAYOUT_ENV)
    if fixed in KV_LAYOUTS:
        return (fixed,)
    required = None
    fn = getattr(connector_cls, "get_required_kvcache_layout", None)
    if fn is not None:
        with contextlib.suppress(Exception):
            required = fn(vllm_config)
    if required in KV_LAYOUTS:
        return (required,)
    return KV_LAYOUTS


@dataclasses.dataclass(frozen=True)
class KVLayoutChoice:
    """The runner and KV layout one worker harness used.

    Attributes:
        runner_source: see :func:`decide_model_runner`.
        kv_layout: ``"NHD"`` or ``"HND"`` (physical order of H and B).
        shape: the cross-layer tensor's shape, or the first layer's.
        stride: its strides in elements.

    """

    runner: str
    runner_source: str
    cross_layer: bool
    kv_layout: str
    shape: tuple[int, ...]
    stride: tuple[int, ...] = ()

    def physical_layout(self) -> str:
        """NHD or HND as the strides show it (per layer ``(N, H, B, 2D)``)."""
        if self.cross_layer or len(self.stride) != 4:
            return self.kv_layout
        return "HND" if self.stride[1] > self.stride[2] else "NHD"

    def label(self) -> str:
        """One line for reports, e.g. ``V2 model runner (vllm): per-layer ...``."""
        kind = ("cross-layer tensor (num_blocks, num_layers, B, H, 2*D) through "
                "register_cross_layers_kv_cache" if self.cross_layer else
                "per-layer tensors (num_blocks, H, B, 2*D) through "
                "register_kv_caches")
        return (f"{self.runner} model runner ({self.runner_source}): {kind}, "
                f"{self.kv_layout}, shape {self.shape}, stride {self.stride}")


def current_kv_layout(vllm_config: Any) -> str:
    """The physical layout vLLM uses now (call inside :func:`vllm_env`).

    0.33: ``cache_config.get_resolved_kv_cache_layout()`` where resolved; else
    ``get_kv_cache_layout()`` under the current config.
    """
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends import utils as attn_utils

    cache = vllm_config.cache_config
    resolved = getattr(cache, "kv_cache_layout", None)
    if resolved is not None:
        # 0.33 KVCacheLayout (vllm/v1/kv_cache_layout.py): logical axes L, B
        # (blocks), H (heads), N (tokens of a block), C; the legacy names are
        # aliases: NHD = LBNHC, HND = LBHNC (resolve_kv_cache_layout)
        name = str(getattr(resolved, "name", resolved)).upper()
        if name in KV_LAYOUTS:
            return name
        return "HND" if name.find("H") < name.find("N") else "NHD"
    _clear_vllm_caches()
    with set_current_vllm_config(vllm_config):
        return str(attn_utils.get_kv_cache_layout())
