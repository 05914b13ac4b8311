"""Known-bad connectors for the invariants vLLM implies: ONE fault each.

Each subclasses a correct member of the panel (``panel_connectors.py``), so the
only thing wrong with it is its planted fault; loaded by vLLM through
``kv_connector_module_path = "invariant_bad_connectors"`` (the self-tests put
this folder on PYTHONPATH). Every fault is a public defect's shape:

* :class:`WaitsForSpaceConnector`: an allocation that waits (busy-loops) for
  room in a full store, which only a later engine step could make;
* :class:`SavesAfterFreeConnector`: a write-behind save that reads the
  request's blocks once vLLM says it finished, while ``request_finished``
  returned False (vLLM freed the blocks at once);
* :class:`AppendsTableOnResumeConnector`: appends a resumed request's block
  table to the one it had before its preemption instead of replacing it;
* :class:`CountsScheduledTokensConnector`: counts a request's computed tokens
  itself (the sum of its scheduled tokens) and never resets the count when
  vLLM preempts the request and recomputes it;
* :class:`StoresEverythingConnector`: stores every whole chunk of a request,
  prompt and output, again at every step, as new entries;
* :class:`AssertsWholeChunksConnector`: its own ``assert`` (with a message) that
  a load starts at a chunk's first block, which vLLM's local prefix cache
  breaks;
* :class:`LoadsNextLayerConnector`: loads each layer's KV into the next layer.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from panel_connectors import ChunkJob, PanelMetadata, SyncPanelConnector


class WaitsForSpaceConnector(SyncPanelConnector):
    """Fault: a store of ``capacity_chunks`` entries (extra config); when it is
    full, ``update_state_after_alloc`` waits for an entry to go, which nothing
    in this engine step can do: the call never returns."""

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        cap = int(self._kv_transfer_config.get_from_extra_config(
            "capacity_chunks", 1 << 30))
        while sum(1 for _ in self.root.rglob("*.safetensors")) >= cap:
            time.sleep(0.001)  # waits for room that never comes
        super().update_state_after_alloc(request, blocks, num_external_tokens)


class SavesAfterFreeConnector(SyncPanelConnector):
    """Fault: queues each save (block ids only) and writes it when vLLM names
    the request in ``finished_req_ids``, reading the blocks then; but
    ``request_finished`` returns False, so vLLM freed them a step before. (The
    correct shape returns True and names the request in ``finished_sending``
    once written: ``DelayedFreePanelConnector``.)"""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self._queued: list[ChunkJob] = []

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PanelMetadata)
        self._queued += meta.saves

    def get_finished(self, finished_req_ids: set[str]):
        names = list(self._kv)
        bdim = 1 if next(iter(self._kv.values())).dim() == 5 else 0
        keep = []
        for job in self._queued:
            if job.req_id not in finished_req_ids:
                keep.append(job)
                continue
            idx = torch.tensor(job.block_ids)
            data = [self._kv[n].index_select(bdim, idx).contiguous() for n in names]
            self._write(job, names, data)
        self._queued = keep
        return super().get_finished(finished_req_ids)


class AppendsTableOnResumeConnector(SyncPanelConnector):
    """Fault: a resumed request's block ids are appended to those it had before
    its preemption (as for a running request), so its later saves read the old
    blocks."""

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        old = self._block_ids.get(request.request_id)
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if old is not None:  # a known request: its table is kept (and grown)
            self._block_ids[request.request_id] = old

    def _note_blocks(self, rid: str, block_ids: list[int], resumed: bool) -> None:
        if resumed and self._block_ids.get(rid) == block_ids:
            return  # a new request: the table update_state_after_alloc was given
        super()._note_blocks(rid, block_ids, resumed=False)


class CountsScheduledTokensConnector(SyncPanelConnector):
    """Fault: the computed-token count of a request is the sum of the tokens
    scheduled for it, never reset: after a preemption vLLM recomputes from
    ``num_computed_tokens``, and the count runs ahead of what is computed."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self._count: dict[str, int] = {}

    def _computed_after(self, rid: str, num_computed: int, scheduled: int) -> int:
        self._count[rid] = self._count.get(rid, num_computed) + scheduled
        return self._count[rid]

    def request_finished(self, request: Any, block_ids: list[int]):
        self._count.pop(request.request_id, None)
        return super().request_finished(request, block_ids)


class StoresEverythingConnector(SyncPanelConnector):
    """Fault: at every step it stores every whole chunk a running request has
    computed so far, the output's included, as new entries (the step number in
    the key): several entries per chunk and request."""

    def build_connector_meta(self, scheduler_output: Any) -> PanelMetadata:
        meta = super().build_connector_meta(scheduler_output)
        self._step_no = getattr(self, "_step_no", 0) + 1
        per = self.blocks_per_chunk
        for rid, req in self._requests.items():
            table = self._block_ids.get(rid, [])
            done = min(req.num_computed_tokens, len(table) * self.block_size)
            for k, key in enumerate(self._keys(req, done)):
                meta.saves.append(ChunkJob(rid, f"{key}-{self._step_no:05d}",
                                           table[k * per:(k + 1) * per]))
        return meta


class AssertsWholeChunksConnector(SyncPanelConnector):
    """Fault: asserts that every load starts at a chunk's first block; vLLM's
    local prefix-cache hit ends inside a chunk whenever it is not a multiple of
    the chunk."""

    def _load(self, job: ChunkJob) -> int | None:
        assert job.first == 0, (
            f"load of chunk {job.key[:8]} starts at its block {job.first}")
        return super()._load(job)


class LoadsNextLayerConnector(SyncPanelConnector):
    """Fault: loads each layer's KV into the next layer (the last into the
    first), as a store that keys layers by their position in a reordered list."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self._saving = dict(self._kv)

    def _load(self, job: ChunkJob) -> int | None:
        names = list(self._saving)
        self._kv = dict(zip(names, [self._saving[n] for n in names[1:] + names[:1]],
                            strict=True))
        try:
            return super()._load(job)
        finally:
            self._kv = dict(self._saving)
