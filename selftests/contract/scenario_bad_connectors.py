"""Known-bad connectors for the contract scenarios: ONE fault each, one scenario's.

Loaded by vLLM through ``kv_connector_module_path = "scenario_bad_connectors"`` (the
self-tests put this folder on PYTHONPATH). Each subclasses vLLM's ExampleConnector,
whose both sides run on CPU, so every fault is exercised on any box. Where plain
ExampleConnector already fails a scenario for another reason (vLLM 0.28: a negative
count after preemption), the fault sits on :class:`ClampedExampleConnector`, which
removes that defect, so the scenario fails on the planted fault alone.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    align_to_block_size,
)
from vllm.v1.request import RequestStatus


class ClampedExampleConnector(ExampleConnector):
    """ExampleConnector that never answers a negative count and, after a
    preemption, answers 0 (a connector may always match less; ExampleConnector's
    own resumed-load path keys its files by the decoded tokens too)."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        if request.num_preemptions > 0:
            return 0, False
        n, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return max(0, n or 0), is_async


class IgnoresLocalHitConnector(ExampleConnector):
    """Fault: counts its match from token 0, ignoring vLLM's local prefix cache hit."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        if not self._found_match_for_request(request):
            return 0, False
        return align_to_block_size(len(request.prompt_token_ids) - 1,
                                   self._block_size), False


class ShiftsByLocalModChunkConnector(ExampleConnector):
    """Fault: writes loaded KV ``num_computed_tokens mod chunk`` slots too far.

    ``chunk`` is ``kv_connector_extra_config["chunk_tokens"]``: a chunked store that
    loads from the start of the chunk holding ``num_computed_tokens`` but places
    it at ``num_computed_tokens``.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._chunk = int(self._kv_transfer_config.get_from_extra_config(
            "chunk_tokens", self._block_size))
        self._local: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        self._local[request.request_id] = num_computed_tokens
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output: Any):
        shifts = [self._local.get(r.req_id, 0) % self._chunk
                  for r in scheduler_output.scheduled_new_reqs
                  if r.req_id in self._requests_need_load]
        meta = super().build_connector_meta(scheduler_output)
        loads = [r for r in meta.requests if not r.is_store]
        for req, shift in zip(loads, shifts, strict=False):
            req.slot_mapping = req.slot_mapping + shift
        return meta


class StaleCountAfterPreemptionConnector(ClampedExampleConnector):
    """Fault: answers a re-admitted request with the count of its first lookup."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self._first: dict[str, tuple[int, bool]] = {}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        rid = request.request_id
        if rid in self._first and request.num_preemptions > 0:
            return self._first[rid]
        ret = super().get_num_new_matched_tokens(request, num_computed_tokens)
        self._first.setdefault(rid, ret)
        return ret


class LeaksOnAbortConnector(ExampleConnector):
    """Fault: for an aborted request, delays freeing its blocks and never frees them."""

    def request_finished(self, request: Any, block_ids: list[int]):
        if request.status == RequestStatus.FINISHED_ABORTED:
            return True, None
        return super().request_finished(request, block_ids)


class BareAssertOnAbortConnector(ExampleConnector):
    """Fault: an internal check without a message fails when a request is aborted
    (as vLLM 0.26.0's OffloadingConnector did on the H200 for a queued request)."""

    def request_finished(self, request: Any, block_ids: list[int]):
        if request.status == RequestStatus.FINISHED_ABORTED:
            stored_keys, planned_blocks = [1, 2], [1]
            assert len(stored_keys) == len(planned_blocks)
        return super().request_finished(request, block_ids)


class DropsAllButFirstLoadConnector(ExampleConnector):
    """Fault: of the loads planned for one step, performs only the first."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        loads = [r for r in meta.requests if not r.is_store]
        keep = loads[:1]
        meta.requests = [r for r in meta.requests if r.is_store or
                         any(r is k for k in keep)]
        super().start_load_kv(forward_context, **kwargs)


class LoadsOneBlockShortConnector(ExampleConnector):
    """Fault: leaves the last block of every load unwritten (one block short).

    The block keeps what its slots held before the load: the KV tensors of every
    release here index blocks in their first dimension.
    """

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        last = {int(r.slot_mapping[-1]) // self._block_size
                for r in meta.requests if not r.is_store and len(r.slot_mapping)}
        kvs = [kv for layer in forward_context.no_compile_layers.values()
               if (kv := getattr(layer, "kv_cache", None)) is not None]
        kept = [(kv, b, kv[b].clone()) for kv in kvs for b in last]
        super().start_load_kv(forward_context, **kwargs)
        for kv, b, before in kept:
            kv[b] = before


class LoadsIntoOtherBlocksConnector(ExampleConnector):
    """Fault: a load lands, scrambled, one load-length further into the pool.

    Its slots move by as many blocks as the load spans (wrapping around the
    pool) and the bytes are negated: the request's own blocks keep the poison
    and other blocks change, as a layout or stride mistake leaves them (LMCache
    on vLLM 0.26's packed K/V layout).
    """

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        kvs = [kv for layer in forward_context.no_compile_layers.values()
               if (kv := getattr(layer, "kv_cache", None)) is not None]
        pool = kvs[0].shape[0] * self._block_size
        moved: set[int] = set()
        for r in meta.requests:
            if not r.is_store and len(r.slot_mapping):
                span = -(-len(r.slot_mapping) // self._block_size) * self._block_size
                r.slot_mapping = (r.slot_mapping + span) % pool
                moved |= {int(s) // self._block_size for s in r.slot_mapping}
        super().start_load_kv(forward_context, **kwargs)
        for kv in kvs:
            for b in moved:
                kv[b] = -kv[b]


class RaisesOnMissingFileConnector(ExampleConnector):
    """Fault (ExampleConnector's own, vLLM 0.28): a stored file gone between the
    lookup and the load raises FileNotFoundError out of ``start_load_kv`` instead
    of being reported through ``get_block_ids_with_load_errors``."""


class FailedSaveVisibleConnector(ExampleConnector):
    """Fault: one save in 200 fails (writes zeros) yet stays visible to lookups."""

    EVERY = 200

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self._stores = 0
        self._first_layer: str | None = None
        self._failing: list[int] = []

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._first_layer is None:
            self._first_layer = layer_name
        if layer_name == self._first_layer:  # count each request's save once
            self._failing = []
            for i, req in enumerate(meta.requests):
                if req.is_store:
                    self._stores += 1
                    if self._stores % self.EVERY == 0:
                        self._failing.append(i)
        if self._failing:
            kv_layer = kv_layer.clone()
            for i in self._failing:
                s = meta.requests[i].slot_mapping
                kv_layer[s // self._block_size, :, s % self._block_size] = 0
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)


class IgnoresTenantConnector(ExampleConnector):
    """Fault (ExampleConnector's own, vLLM 0.28): keys files by token ids only,
    ignoring ``cache_salt`` and the LoRA adapter."""


class StoresNothingUnderChunkConnector(ExampleConnector):
    """Fault: stores only prompts of at least two blocks plus one token.

    (A connector whose real chunk is 2 blocks, declared as ``granularity = "B"``.)
    """

    def build_connector_meta(self, scheduler_output: Any):
        meta = super().build_connector_meta(scheduler_output)
        meta.requests = [r for r in meta.requests if not r.is_store
                         or len(r.token_ids) >= 2 * self._block_size]
        return meta


class StoresFirstChunkOnlyConnector(ExampleConnector):
    """Fault (ExampleConnector's own, vLLM 0.28): under chunked prefill it stores
    only the blocks of the first scheduled chunk under the whole prompt's key."""

