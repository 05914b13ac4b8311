"""Connectors that read what a real model runner hands them, for the harness test.

:class:`ForwardContextProbeConnector` is vLLM's ExampleConnector that records,
at each worker call, what LMCache-style connectors rely on: the forward context
it was handed is vLLM's current one, its ``no_compile_layers`` hold every
registered layer bound to the very tensor registered, ``attn_metadata`` is set
for a step with a forward, and whether the call ran inside a forward context.

:class:`ForwardContextLayersConnector` finds its KV tensors only through the
forward context, as LMCache's ``_init_kv_caches_from_forward_context`` does
(``attn_layer.kv_cache`` of each ``no_compile_layers`` entry); it loads and saves
by ExampleConnector's code otherwise, so with a faithful harness it is correct.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
)
from vllm.forward_context import get_forward_context, is_forward_context_available

#: call name -> list of observations (one process: the harness's)
SEEN: dict[str, list[dict[str, Any]]] = {}


class ForwardContextProbeConnector(ExampleConnector):
    """ExampleConnector recording the forward context of each worker call."""

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:  # noqa: D102
        self._registered = dict(kv_caches)
        super().register_kv_caches(kv_caches)

    def _note(self, call: str, handed: Any = None) -> None:
        inside = is_forward_context_available()
        ctx = get_forward_context() if inside else None
        reg = getattr(self, "_registered", {})
        layers = ctx.no_compile_layers if ctx is not None else {}
        SEEN.setdefault(call, []).append({
            "inside": inside,
            "handed_is_current": handed is None or handed is ctx,
            "layers_bound": bool(reg) and all(
                getattr(layers.get(n), "kv_cache", None) is t for n, t in reg.items()),
            "metadata": ctx is not None and ctx.attn_metadata is not None,
        })

    def start_load_kv(self, forward_context: Any, **kw: Any) -> None:  # noqa: D102
        self._note("start_load_kv", forward_context)
        super().start_load_kv(forward_context, **kw)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kw: Any) -> None:  # noqa: D102
        self._note("save_kv_layer")
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kw)

    def wait_for_save(self) -> None:  # noqa: D102
        self._note("wait_for_save")
        super().wait_for_save()


class ForwardContextLayersConnector(ExampleConnector):
    """Finds its KV tensors through the forward context only (LMCache's way)."""

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:  # noqa: D102
        self._kv: dict[str, Any] = {}  # deliberately ignored: read the context

    def start_load_kv(self, forward_context: Any, **kw: Any) -> None:  # noqa: D102
        for name, layer in forward_context.no_compile_layers.items():
            if hasattr(layer, "kv_cache"):
                self._kv.setdefault(name, layer.kv_cache)
        if not self._kv:
            raise RuntimeError("no attention layer in the forward context: nothing "
                               "to load into")
        super().start_load_kv(forward_context, **kw)
