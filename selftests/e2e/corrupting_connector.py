"""Negative control: vLLM's ExampleConnector, but the KV it loads is corrupted.

Loaded by vLLM through ``kv_connector_module_path = "corrupting_connector"`` (this
folder on ``PYTHONPATH``). It stores and matches exactly like ExampleConnector, so the
hit counters look right; after each load it overwrites the loaded slots of every
layer with seeded random values (same shape, dtype and scale), so pass 2 attends to
KV that pass 1 never computed. The two-pass test must FAIL on output/logprob equality.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
)


class CorruptingConnector(ExampleConnector):
    """ExampleConnector whose loaded KV is replaced by noise after each load."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Load as ExampleConnector does, then corrupt the slots just written."""
        super().start_load_kv(forward_context, **kwargs)
        metadata = self._get_connector_metadata()
        gen = torch.Generator(device="cpu").manual_seed(0)
        for request in getattr(metadata, "requests", []):
            if request.is_store:
                continue
            for layer in forward_context.no_compile_layers.values():
                kv = getattr(layer, "kv_cache", None)
                if kv is None or not isinstance(kv, torch.Tensor):
                    continue
                slots = request.slot_mapping.to(kv.device)
                # same indexing as ExampleConnector's inject_kv_into_layer (non-MLA):
                # kv is [num_blocks, 2, block_size, ...]
                blocks, offsets = slots // self._block_size, slots % self._block_size
                loaded = kv[blocks, :, offsets]
                scale = float(loaded.float().std().clamp(min=1e-3))  # host scalar
                noise = torch.randn(loaded.shape, generator=gen) * scale
                kv[blocks, :, offsets] = noise.to(device=kv.device, dtype=kv.dtype)
