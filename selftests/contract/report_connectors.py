"""Connectors for the worker-report and worker-harness self-tests (CPU).

Loaded by vLLM through ``kv_connector_module_path = "report_connectors"`` (the
self-tests put this folder on PYTHONPATH). All are small ExampleConnector
subclasses, so both sides run on CPU:

* :class:`WorkerMetaResidencyConnector`: its scheduler matches only prompts its
  workers reported as stored through worker metadata (a memory-authoritative
  index, as the public Tutti connector keeps), with a stand-in
  (:func:`stored_prefixes_report`) for rigs that run no worker.
* :class:`CrossLayerConnector`: prefers cross-layer blocks, accepts only the
  cross-layer tensor, needs vLLM's TP group in every load (as Tutti's worker);
  :class:`Rank4RefusingConnector` refuses other tensors as Tutti's worker does.
* Known-bad ones, each with ONE fault: :class:`WorkerMetaIgnoredConnector`,
  :class:`CrossLayerWrongLayerConnector`,
  :class:`FalseLoadErrorConnector`, :class:`LateLoadErrorConnector`,
  :class:`RequestIdsFalseReportConnector`, :class:`StagingRefusedConnector`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
)


# ------------------------------------------------------------ residency via worker
@dataclass
class StoredPrefixes(KVConnectorWorkerMetadata):
    """Worker -> scheduler: token prefixes stored in this step."""

    prefixes: list[tuple[int, ...]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, StoredPrefixes)
        return StoredPrefixes(self.prefixes + other.prefixes)


def _stored(meta: Any) -> list[tuple[int, ...]]:
    return [tuple(int(t) for t in r.token_ids) for r in getattr(meta, "requests", ())
            if r.is_store]


class WorkerMetaResidencyConnector(ExampleConnector):
    """Matches ``(len - 1) // B * B`` tokens of a prompt its workers reported stored.

    The scheduler never looks at the files: it learns residency only through
    ``update_connector_output(kv_connector_worker_meta=StoredPrefixes)``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reported: set[tuple[int, ...]] = set()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        tokens = list(request.prompt_token_ids or [])
        n = (len(tokens) - 1) // self._block_size * self._block_size
        if n <= num_computed_tokens or tuple(tokens[:n]) not in self._reported:
            return 0, False
        return n - num_computed_tokens, False

    def _found_match_for_prompt(self, prompt_token_ids: list[int],
                                mm_hashes: list[str]) -> bool:
        # store decision (build_connector_meta) from the reported residency too
        n = (len(prompt_token_ids) - 1) // self._block_size * self._block_size
        return n > 0 and tuple(prompt_token_ids[:n]) in self._reported

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, StoredPrefixes):
            self._reported.update(meta.prefixes)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        prefixes = _stored(self._get_connector_metadata())
        return StoredPrefixes(prefixes) if prefixes else None


class WorkerMetaIgnoredConnector(WorkerMetaResidencyConnector):
    """Known-bad: its workers report stores, its scheduler drops the reports.

    ``update_connector_output`` ignores the worker metadata (as a scheduler-side
    index without a publishing method does), so no prompt ever becomes resident
    and every replay matches 0 tokens.
    """

    def update_connector_output(self, connector_output: Any) -> None:
        return None


def stored_prefixes_report(vllm_config: Any, kv_cache_config: Any,
                           connector: Any) -> Any:
    """Stand-in worker report: every prefix the scheduler planned to store."""

    def report(scheduler_output: Any, metadata: Any) -> Any:
        prefixes = _stored(metadata)
        return StoredPrefixes(prefixes) if prefixes else None

    return report


# ----------------------------------------------------------------- cross-layer KV
class CrossLayerConnector(ExampleConnector):
    """Takes vLLM's cross-layer KV tensor; each load needs vLLM's TP group.

    ``register_kv_caches`` refuses (the harness must take the cross-layer path);
    ``register_cross_layers_kv_cache`` checks the FlashAttention NHD cross-layer
    shape ``(num_blocks, num_layers, B, H, 2*D)``, contiguous, and that every
    per-layer KV view the model uses lies in it.
    """

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return True

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str:
        return "NHD"

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        raise RuntimeError("CrossLayerConnector: expected "
                           "register_cross_layers_kv_cache, got register_kv_caches")

    def register_cross_layers_kv_cache(self, kv_cache: Any, attn_backend: Any) -> None:
        n, layers, b, h, d2 = kv_cache.shape
        assert kv_cache.is_contiguous(), "cross-layer KV tensor not contiguous"
        assert b == self._block_size, f"block axis {b} != {self._block_size}"
        assert layers == 2 and d2 % 2 == 0 and n > 0 and h > 0, kv_cache.shape
        self._cross = kv_cache

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        from vllm.distributed.parallel_state import get_tp_group

        assert get_tp_group().world_size == 1  # AssertionError when not set up
        base = self._cross.untyped_storage().data_ptr()
        for layer in forward_context.no_compile_layers.values():
            assert layer.kv_cache.untyped_storage().data_ptr() == base, (
                "a per-layer KV view is not inside the registered cross-layer "
                "tensor")
        super().start_load_kv(forward_context, **kwargs)


class Rank4RefusingConnector(CrossLayerConnector):
    """Refuses as Tutti's worker does (``tutti_kv_transfer`` layout detection):
    a per-layer tensor, or a cross-layer tensor with other than 2 KV heads, is
    "unsupported paged KV tensor rank 4" (it slices the cross-layer tensor per
    layer to (N, B, H, 2D) and wants the 2 at position 1 as a K/V axis)."""

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        t = next(iter(kv_caches.values()))
        raise AssertionError(f"unsupported paged KV tensor rank {t.dim()} "
                             f"(shape={tuple(t.shape)})")

    def register_cross_layers_kv_cache(self, kv_cache: Any, attn_backend: Any) -> None:
        if kv_cache.shape[3] != 2:
            piece = kv_cache[:, 0]
            raise AssertionError(f"unsupported paged KV tensor rank {piece.dim()} "
                                 f"(shape={tuple(piece.shape)})")
        super().register_cross_layers_kv_cache(kv_cache, attn_backend)


class CrossLayerWrongLayerConnector(CrossLayerConnector):
    """Fault: after loading, swaps layers 0 and 1 of the loaded blocks in the
    cross-layer tensor (reads the layer axis wrongly)."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        for req in self._get_connector_metadata().requests:
            if req.is_store or not len(req.slot_mapping):
                continue
            blocks = sorted({int(s) // self._block_size for s in req.slot_mapping})
            for blk in blocks:
                self._cross[blk] = self._cross[blk].flip(0).clone()


# ----------------------------------------------------------- load-error reports
class FalseLoadErrorConnector(ExampleConnector):
    """Fault: loads correctly, then reports the first loaded block as failed."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        meta = self._get_connector_metadata()
        out = set()
        for req in meta.requests:
            if not req.is_store and len(req.slot_mapping):
                out.add(int(req.slot_mapping[0]) // self._block_size)
        return out


class LateLoadErrorConnector(ExampleConnector):
    """Fault: corrupts its first loaded block but reports the second as failed."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        for req in self._get_connector_metadata().requests:
            if req.is_store or not len(req.slot_mapping):
                continue
            blk = int(req.slot_mapping[0]) // self._block_size
            for layer in forward_context.no_compile_layers.values():
                layer.kv_cache[blk] = 3.0  # an all-3.0 token never holds the pattern

    def get_block_ids_with_load_errors(self) -> set[int]:
        out = set()
        for req in self._get_connector_metadata().requests:
            if not req.is_store and len(req.slot_mapping) > self._block_size:
                out.add(int(req.slot_mapping[self._block_size]) // self._block_size)
        return out


class RequestIdsFalseReportConnector(ExampleConnector):
    """Fault: a bit-identical load, yet ``get_request_ids_with_load_errors`` (the
    fork hook some connectors add) names the loading request."""

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        ids = [r.req_id for r in scheduler_output.scheduled_new_reqs
               if r.req_id in self._requests_need_load]
        meta = super().build_connector_meta(scheduler_output)
        meta.load_req_ids = ids
        return meta

    def get_request_ids_with_load_errors(self) -> set[str]:
        return set(getattr(self._get_connector_metadata(), "load_req_ids", ()))


class StagingRefusedConnector(CrossLayerConnector):
    """Fault: registration fails as the public Tutti memory store does on CUDA."""

    def register_cross_layers_kv_cache(self, kv_cache: Any, attn_backend: Any) -> None:
        raise RuntimeError("staging 环窗被 store 拒收（granularity=16384）")
