"""Connectors for the TP harness's self-tests (``module_path = "tp_connectors"``).

ExampleConnector writes one file per layer and prompt, the same path on every TP
rank, so at TP = 2 the ranks overwrite each other's heads: it is not TP-safe.
:class:`PerRankExampleConnector` is the known-good base (one folder per TP rank);
each other class adds ONE rank-local fault.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
)


class PerRankExampleConnector(ExampleConnector):
    """Known good at any TP size: ``<shared_storage_path>/tp-rank-<r>/...``.

    The scheduler side (no TP group in the engine core) looks up rank 0's folder.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None
                 ) -> None:
        super().__init__(vllm_config=vllm_config, role=role,
                         kv_cache_config=kv_cache_config)
        self._tp_rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._tp_rank = get_tensor_model_parallel_rank()
        self._storage_path = os.path.join(self._storage_path,
                                          f"tp-rank-{self._tp_rank}")


class HalfHeadsOnRank1Connector(PerRankExampleConnector):
    """Fault: rank 1 saves only the first half of its KV heads (the rest as zeros)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        if self._tp_rank == 1:
            heads = kv_layer.shape[1]  # FlashAttention (num_blocks, H, B, 2D)
            kv_layer = kv_layer.clone()
            kv_layer[:, heads // 2:] = 0
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)


class Rank1NeverFinishesConnector(PerRankExampleConnector):
    """Fault: frees blocks only after the save (delay_free), but rank 1 never
    reports finished_sending: vLLM never frees the request's blocks."""

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
        return True, None

    def get_finished(self, finished_req_ids: set[str], **kwargs: Any) -> tuple:
        if self._tp_rank == 1:
            return None, None
        return set(finished_req_ids) or None, None


class FinishesOnEveryRankConnector(Rank1NeverFinishesConnector):
    """Known good: delay_free with finished_sending reported by every rank."""

    def get_finished(self, finished_req_ids: set[str], **kwargs: Any) -> tuple:
        return set(finished_req_ids) or None, None
