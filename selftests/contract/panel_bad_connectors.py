"""Known-bad variants of the panel's correct connectors: ONE fault each.

Each is the panel connector of the same shape (``panel_connectors.py``) with one
defect, so the contract check that must catch it fails on that defect alone
(``test_panel_connectors.py`` asserts the check and its words). Loaded by vLLM
through ``kv_connector_module_path = "panel_bad_connectors"``.
"""

from __future__ import annotations

import hashlib
from typing import Any

from panel_connectors import (
    AsyncPanelConnector,
    DelayedFreePanelConnector,
    FullPromptPanelConnector,
    RankAwarePanelConnector,
    SyncPanelConnector,
    ThresholdPanelConnector,
)


class CountsFailedReceiveAsDoneConnector(AsyncPanelConnector):
    """Fault: a failed asynchronous load is reported finished (``finished_recving``)
    but its blocks are never reported through ``get_block_ids_with_load_errors``:
    vLLM takes the unloaded blocks as loaded."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        super().get_block_ids_with_load_errors()
        return set()


class NeverEndsFailedReceiveConnector(AsyncPanelConnector):
    """Fault: a failed asynchronous load is never reported finished: the request
    waits for remote KV forever."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        self._recv_done -= self._failed_reqs

    def get_block_ids_with_load_errors(self) -> set[int]:
        super().get_block_ids_with_load_errors()
        return set()


class NeverSendsConnector(DelayedFreePanelConnector):
    """Fault: ``request_finished`` delays freeing the blocks, but the worker never
    names the request in ``finished_sending``: its blocks leak."""

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        _sending, recving = super().get_finished(finished_req_ids)
        return None, recving


class SharedFileAcrossRanksConnector(SyncPanelConnector):
    """Fault (under TP > 1): every rank writes and reads the same file per chunk,
    so the heads of whichever rank wrote last are what every rank loads. (The
    correct shape is ``RankAwarePanelConnector``.)"""


class ReportsReceiveTwiceConnector(AsyncPanelConnector):
    """Fault: names every finished asynchronous receive in finished_recving in
    the step its load completed and again in the next step."""

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        sending, recv = super().get_finished(finished_req_ids)
        again, self._again = getattr(self, "_again", set()), set(recv or ())
        both = set(recv or ()) | again
        return sending, both or None


class RawBlockBytesConnector(SyncPanelConnector):
    """Fault: moves each block's raw bytes in the physical order of its KV
    buffer (as a GPU-direct store copies pages) and keys entries by model and
    shape but not by the layout: an engine on another layout (HND vs NHD) on
    the same store gets the right bytes in the wrong order."""

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        flat = {}
        for name, t in kv_caches.items():
            order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
            phys = t.permute(order)  # the buffer as it lies in memory
            assert phys.is_contiguous(), (name, t.shape, t.stride())
            flat[name] = phys.reshape(phys.shape[0], -1)  # (blocks, elements)
        super().register_kv_caches(flat)


class LandsAfterForwardConnector(SyncPanelConnector):
    """Fault: start_load_kv only queues the step's loads and wait_for_save (after
    the forward) copies them: the forward reads the blocks before the KV is in
    them, and by the end of the step they hold it."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        self._late = list(meta.loads)

    def wait_for_save(self) -> None:
        for job in getattr(self, "_late", ()):
            self._load(job)
        self._late = []
        super().wait_for_save()


class StageBlindRankConnector(RankAwarePanelConnector):
    """Fault (under PP > 1): names its per-rank files by the TP rank alone, so
    the workers of two pipeline stages share one file per chunk: the first
    stage's write wins and the other stage finds someone else's layers."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None
                 ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.rank = self.rank % self.tp_size
        self.world_size = self.tp_size


class IgnoresTheModelConnector(SyncPanelConnector):
    """Fault: one folder for every model (keys are vLLM's block hashes alone), so
    an engine of another model on the same store loads this model's KV."""

    @staticmethod
    def model_namespace(vllm_config: Any) -> str:
        return "all-models"


class IgnoresTheKVDtypeConnector(SyncPanelConnector):
    """Fault: keys by the model and the KV shape but not by the element types
    (model dtype, KV cache dtype), so the same checkpoint served with
    ``--dtype bfloat16`` or ``--kv-cache-dtype fp8`` on the same store loads KV
    of other bytes: a raw-byte store would reinterpret them as they are."""

    @staticmethod
    def model_namespace(vllm_config: Any) -> str:
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        ident = (mc.model, mc.get_total_num_kv_heads(), mc.get_head_size(),
                 mc.get_num_layers(pc), pc.tensor_parallel_size)
        return hashlib.sha256(repr(ident).encode()).hexdigest()[:16]


class IgnoresMediaConnector(SyncPanelConnector):
    """Fault: keys each chunk by a hash of the prompt's token ids up to it, so
    two prompts with the same placeholder tokens for different images (other
    ``mm_features`` identifiers) share every key: image B's prompt loads image
    A's KV. (Keys still chain the whole prefix, so text-only prompts are right.)"""

    def _keys(self, request: Any, upto_tokens: int) -> list[str]:
        toks = list(request.prompt_token_ids or [])
        salt = repr((request.cache_salt, getattr(request.lora_request, "name", None)))
        return [hashlib.sha256(repr((salt, toks[:(k + 1) * self.chunk])).encode()
                               ).hexdigest()
                for k in range(min(upto_tokens, len(toks)) // self.chunk)]


class AssumesSha256KeysConnector(SyncPanelConnector):
    """Fault: looks chunks up by vLLM's ``request.block_hashes`` but names the
    chunks it saves by its own re-computation of them with sha256 (vLLM's
    ``hash_block_tokens``): equal under the default ``sha256``, never equal under
    another ``--prefix-caching-hash-algo``, where nothing it stores is ever hit."""

    _saving = False

    def _keys(self, request: Any, upto_tokens: int) -> list[str]:
        if not self._saving:
            return super()._keys(request, upto_tokens)
        from vllm.utils.hashing import sha256
        from vllm.v1.core import kv_cache_utils as kcu

        toks, b = request.prompt_token_ids, self.block_size
        parent, out = None, []
        for i in range(upto_tokens // b):
            parent = kcu.hash_block_tokens(
                sha256, parent if parent is not None else kcu.NONE_HASH,
                toks[i * b:(i + 1) * b], None)
            if (i + 1) % self.blocks_per_chunk == 0:
                out.append(bytes(parent).hex())
        return out

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        self._saving = True
        try:
            return super().build_connector_meta(scheduler_output)
        finally:
            self._saving = False


class CapsHitAt2kConnector(SyncPanelConnector):
    """Fault: never matches beyond 2,048 tokens although longer prompts are
    stored whole (visible only to prompts longer than 2k tokens)."""

    CAP_TOKENS = 2048

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        n, is_async = super().get_num_new_matched_tokens(request,
                                                         num_computed_tokens)
        cap = max(0, self.CAP_TOKENS // self.chunk * self.chunk - num_computed_tokens)
        if n > cap:
            self._planned.pop(request.request_id, None)
            if cap:
                self._planned[request.request_id] = (num_computed_tokens,
                                                     num_computed_tokens + cap)
            return cap, is_async and bool(cap)
        return n, is_async


class MatchesOneChunkLessConnector(SyncPanelConnector):
    """Fault: answers one chunk less than it holds once it holds two or more."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        n, is_async = super().get_num_new_matched_tokens(request,
                                                         num_computed_tokens)
        plan = self._planned.get(request.request_id)
        if plan is None or plan[1] < 2 * self.chunk:
            return n, is_async
        local, hit = plan
        less = max(0, hit - self.chunk - local)
        if less:
            self._planned[request.request_id] = (local, local + less)
        else:
            self._planned.pop(request.request_id, None)
        return less, is_async and bool(less)


class LoadsTheLastTokenAfterForwardConnector(FullPromptPanelConnector):
    """Fault: answers ``len - 1`` for a stored whole prompt, then writes the last
    token's slot after the forward. It stores only the ``len - 1`` tokens it
    serves (a stored prompt's last slot is written as zeros) and copies its
    loads a second time in ``wait_for_save`` "to be sure they landed": the slot
    of the last token, which vLLM computed in that step, ends up zero."""

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        for job in meta.saves:
            req = self._requests.get(job.req_id)
            n = req.num_prompt_tokens if req is not None else 0
            keys = self._keys(req, n) if n and n % self.chunk == 0 else []
            job.ends_prompt = bool(keys) and job.key == keys[-1]  # type: ignore
        return meta

    def _write(self, job: Any, names: list[str], data: list[Any]) -> None:
        if getattr(job, "ends_prompt", False):
            bdim = 1 if data[0].dim() == 5 and data[0].shape[0] == 2 else 0
            for t in data:  # after the block, the token dim is 1 in both layouts
                t.select(bdim, t.shape[bdim] - 1).select(1, self.block_size - 1
                                                         ).zero_()
        super()._write(job, names, data)

    def wait_for_save(self) -> None:
        for job in self._get_connector_metadata().loads:
            self._load(job)
        super().wait_for_save()


class ThresholdOffByOneConnector(ThresholdPanelConnector):
    """Fault: stores prompts longer than ``min_store_tokens``, not of at least it
    (``len > N`` for its declared ``len >= N``): a prompt of exactly N tokens
    misses."""

    INCLUSIVE = False
