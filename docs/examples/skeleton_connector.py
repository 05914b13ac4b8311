"""A skeleton KV connector to copy: correct, small, and green on the contract tier.

``SkeletonConnector`` stores each full KV block of a prompt as one file and loads
the longest run of stored blocks of a later prompt with the same prefix. Copy it,
rename it, and replace the store (``_write``/``_read``/``_resident``) with yours;
keep the rest until a test says otherwise. ``docs/your-connector.md`` walks
through it; ``skeleton.toml`` beside it is its profile.

vLLM drives a ``KVConnectorBase_V1`` from two processes
(``vllm/distributed/kv_transfer/kv_connector/v1/base.py``):

- the **scheduler side** (``role == SCHEDULER``) answers lookups
  (``get_num_new_matched_tokens``), learns the blocks vLLM allocated
  (``update_state_after_alloc``) and plans each step's loads and saves in a
  metadata object (``build_connector_meta``) that vLLM pickles to the workers;
- the **worker side** (``role == WORKER``, one per GPU rank) registers the KV
  tensors (``register_kv_caches``), loads before the forward pass
  (``start_load_kv``), saves after it (``wait_for_save``) and reports loads that
  failed (``get_block_ids_with_load_errors``).

Lines marked ``TRAP`` are where connectors go wrong; each names the contract test
that catches that mistake (``suites/contract/``).

Store: ``<store_path>/<model>/<key[:2]>/<key>.r<rank>.safetensors``, one file per
block per worker rank, holding every layer's slice of that block and, in its
header, a SHA-256 of the bytes; ``key`` is vLLM's hash of the block, which covers
every token before it, the ``cache_salt``, the LoRA adapter and multimodal
inputs. Extra config: ``store_path`` (required).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

log = logging.getLogger(__name__)


@dataclass
class BlockJob:
    """Load or save one block of one request.

    Attributes:
        req_id: the request.
        key: the store key (hex of vLLM's block hash).
        block_id: the block in vLLM's KV cache (an index into every layer).

    """

    req_id: str
    key: str
    block_id: int


@dataclass
class SkeletonMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler side to every worker.

    TRAP: vLLM pickles this to the workers (a separate process on a GPU host):
    plain lists and dataclasses only, never a Request, a tensor or a lock
    (``test_connector_metadata_survives_scheduler_to_worker_serialization``).
    """

    loads: list[BlockJob] = field(default_factory=list)
    saves: list[BlockJob] = field(default_factory=list)


def block_dim(kv: torch.Tensor) -> int:
    """The block axis of one layer's KV tensor.

    ``(num_blocks, ...)`` -> 0; ``(2, num_blocks, block_size, heads, head_size)``
    (K and V first, FlashAttention on some versions) -> 1.
    TRAP: copy along the wrong axis and another request's KV is loaded
    (``test_loaded_kv_is_bit_identical_and_nothing_else_changes``).
    """
    return 1 if kv.dim() == 5 and kv.shape[0] == 2 else 0


def digest(tensors: list[torch.Tensor]) -> str:
    """SHA-256 over the raw bytes of a block's slices, in layer order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class SkeletonConnector(KVConnectorBase_V1):
    """Stores full KV blocks as files; loads the longest stored prefix."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        path = str(self._kv_transfer_config.get_from_extra_config("store_path", ""))
        if not path:  # a missing key fails at creation, naming it
            raise ValueError("kv_connector_extra_config: key store_path is required")
        # TRAP: vLLM's block hashes cover tokens, salt, LoRA and images, not the
        # model: a store shared by engines of two models, dtypes, KV cache dtypes
        # or TP sizes must key by them too
        # (test_another_model_on_one_store_gets_a_miss)
        self.root = Path(path) / self.model_key(vllm_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        pc = vllm_config.parallel_config
        # TRAP: with tensor or pipeline parallelism each worker holds its own
        # heads or layers: its own files, and a block is stored only when every
        # worker's file is there (test_tp_round_trip_is_bit_identical_on_every_rank)
        self.world_size = int(pc.tensor_parallel_size) * int(
            pc.pipeline_parallel_size)
        self.rank = int(pc.rank)
        # scheduler side
        self._requests: dict[str, Any] = {}  # req_id -> vLLM Request
        self._block_ids: dict[str, list[int]] = {}  # req_id -> its block table
        self._planned: dict[str, tuple[int, int]] = {}  # req_id -> (local, hit)
        self._loads: list[BlockJob] = []
        self._saved: dict[str, int] = {}  # req_id -> blocks saved or found stored
        # worker side
        self._kv: dict[str, torch.Tensor] = {}  # layer name -> KV tensor
        self._failed: set[int] = set()  # block ids whose load failed

    # --------------------------------------------------------------- the store
    @staticmethod
    def model_key(vllm_config: Any) -> str:
        """A folder per model, dtype, KV cache dtype, layer count and TP size."""
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        ident = (mc.model, mc.get_total_num_kv_heads(), mc.get_head_size(),
                 str(mc.dtype), vllm_config.cache_config.cache_dtype,
                 mc.get_total_num_hidden_layers(), pc.tensor_parallel_size)
        return hashlib.sha256(repr(ident).encode()).hexdigest()[:16]

    def _path(self, key: str, rank: int) -> Path:
        return self.root / key[:2] / f"{key}.r{rank}.safetensors"

    def _resident(self, key: str) -> bool:
        return all(self._path(key, r).is_file() for r in range(self.world_size))

    def _keys(self, request: Any, num_tokens: int) -> list[str]:
        """Store keys of the request's full blocks within its first tokens."""
        out = []
        for h in request.block_hashes[:num_tokens // self.block_size]:
            # TRAP: key by vLLM's block hash, never by the block's own tokens:
            # the hash chains every block before it, the cache_salt and the LoRA
            # adapter (test_tenant_isolation_cache_salt_and_lora,
            # test_multimodal_item_hits_never_serve_another_image) and follows
            # --prefix-caching-hash-algo (test_block_hash_algorithm_...)
            out.append(bytes(h).hex() if isinstance(h, bytes | bytearray)
                       else hashlib.sha256(repr(h).encode()).hexdigest())
        return out

    # ---------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        """Tokens the store holds beyond vLLM's own prefix cache; no async load.

        TRAP: vLLM may ask again for the same request (it did not fit this step,
        or it was preempted): answer from the store, plan nothing irreversible
        here (test_preemption_and_resume).
        """
        self._requests[request.request_id] = request
        # TRAP: at most len - 1 tokens: vLLM must compute the last prompt token
        # itself to sample from it (test_second_pass_matches_declared_hit_rule)
        limit = request.num_prompt_tokens - 1
        if getattr(request, "skip_reading_prefix_cache", False):
            limit = 0  # TRAP: prompt_logprobs must not read cached KV
            # (test_request_that_must_not_read_cached_kv_gets_a_miss)
        stored = 0
        for key in self._keys(request, limit):
            if not self._resident(key):
                break
            stored += 1
        hit = stored * self.block_size  # TRAP: whole blocks only (block alignment)
        # TRAP: subtract what vLLM's local prefix cache already holds
        # (test_local_prefix_cache_hit_then_external_hit)
        n = max(0, hit - num_computed_tokens)
        if n:
            self._planned[request.request_id] = (num_computed_tokens, hit)
        else:
            self._planned.pop(request.request_id, None)
        return n, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        """Plan the loads into the blocks vLLM allocated for this request.

        Called for every scheduled request, with ``num_external_tokens == 0``
        when there is nothing to load.
        """
        rid = request.request_id
        block_ids = list(blocks.get_block_ids()[0])
        if block_ids:
            self._block_ids[rid] = block_ids
        plan = self._planned.pop(rid, None)
        if not num_external_tokens or plan is None:
            return
        local, hit = plan
        keys = self._keys(request, hit)
        for i in range(local // self.block_size, hit // self.block_size):
            self._loads.append(BlockJob(rid, keys[i], block_ids[i]))

    def build_connector_meta(self, scheduler_output: Any) -> SkeletonMetadata:
        """Plan the step: its loads, and a save of every full prompt block computed."""
        meta = SkeletonMetadata(loads=self._loads)
        self._loads = []
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            self._block_ids[new.req_id] = list(new.block_ids[0])
            computed[new.req_id] = (new.num_computed_tokens + scheduler_output
                                    .num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                # TRAP: a preempted request comes back with a new block table:
                # replace it, do not append (test_preemption_and_resume)
                if rid in resumed:
                    self._block_ids[rid] = list(new_ids[0])
                else:
                    self._block_ids.setdefault(rid, []).extend(new_ids[0])
            computed[rid] = (cached.num_computed_tokens[i]
                             + scheduler_output.num_scheduled_tokens[rid])
        for rid, done in computed.items():
            request = self._requests.get(rid)
            if request is None:
                continue
            # TRAP: under chunked prefill a prompt is computed over several steps:
            # save each block once it is computed, up to the prompt's end
            # (test_chunked_prefill_stores_the_whole_prompt)
            keys = self._keys(request, min(done, request.num_prompt_tokens))
            table = self._block_ids.get(rid, [])
            for i in range(self._saved.get(rid, 0), len(keys)):
                if not self._resident(keys[i]):
                    meta.saves.append(BlockJob(rid, keys[i], table[i]))
            self._saved[rid] = max(self._saved.get(rid, 0), len(keys))
        return meta

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; vLLM may free its blocks at once (False).

        TRAP: an aborted request ends here too, whether it was waiting, running
        or had a load planned: drop every trace of it, or blocks leak
        (test_abort_leaves_nothing_behind,
        test_scheduler_is_empty_and_every_block_free_after_requests_finish).
        """
        rid = request.request_id
        for state in (self._requests, self._block_ids, self._planned, self._saved):
            state.pop(rid, None)
        self._loads = [j for j in self._loads if j.req_id != rid]
        return False, None

    # ------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep every layer's KV tensor (in the order vLLM registers them)."""
        self._kv = dict(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Load this step's planned blocks before the forward pass.

        TRAP: a store can lose, tear or corrupt an entry between the lookup and
        the load: never raise and never load wrong bytes; report the failed
        blocks (and the rest of that request's) through
        ``get_block_ids_with_load_errors`` so vLLM recomputes them or fails the
        request (test_store_fault_is_reported_never_silent,
        test_reported_load_failure_affects_that_request_only).
        """
        meta = self._get_connector_metadata()
        assert isinstance(meta, SkeletonMetadata)
        failed_reqs: set[str] = set()
        for job in meta.loads:
            if job.req_id in failed_reqs or not self._read(job):
                failed_reqs.add(job.req_id)
                self._failed.add(job.block_id)

    def _read(self, job: BlockJob) -> bool:
        """Copy one stored block into its KV block; False when it cannot."""
        path = self._path(job.key, self.rank)
        names = list(self._kv)
        try:
            with safe_open(str(path), framework="pt") as f:
                want = (f.metadata() or {}).get("sha256")
                data = [f.get_tensor(n) for n in names]
        except Exception as exc:  # noqa: BLE001 - any unreadable entry is a miss
            log.warning("skeleton: cannot read %s: %s", path, exc)
            self._drop(path)
            return False
        if digest(data) != want:  # check every byte before copying one
            log.warning("skeleton: %s is damaged (digest differs)", path)
            self._drop(path)
            return False
        for name, src in zip(names, data, strict=True):
            kv = self._kv[name]
            kv.select(block_dim(kv), job.block_id).copy_(src.to(kv.device, kv.dtype))
        return True

    @staticmethod
    def _drop(path: Path) -> None:
        """Remove a damaged entry, so the next lookup misses it."""
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finished in ``start_load_kv``."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Saves run in ``wait_for_save``, once every layer is computed."""

    def wait_for_save(self) -> None:
        """Write this step's blocks to the store."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, SkeletonMetadata)
        for job in meta.saves:
            data = [kv.select(block_dim(kv), job.block_id).to("cpu").contiguous()
                    for kv in self._kv.values()]
            self._write(job, data)

    def _write(self, job: BlockJob, data: list[torch.Tensor]) -> None:
        """Write one block whole or not at all; a failed save is a future miss.

        TRAP: write to a temporary name and rename it, so a lookup never sees a
        half-written entry, and absorb a failure (full disk, quota): a failed
        save must never be visible to a later lookup, nor stop the engine
        (test_store_fault_is_reported_never_silent[...-fail_save-...]).
        """
        path = self._path(job.key, self.rank)
        if path.is_file():
            return
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file(dict(zip(self._kv, data, strict=True)), str(tmp),
                      metadata={"sha256": digest(data)})
            os.replace(tmp, path)
        except Exception as exc:  # noqa: BLE001 - the request goes on without it
            log.warning("skeleton: save of %s failed: %s", path, exc)
            self._drop(tmp)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Nothing in flight: loads and saves end within their step."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (then forgotten)."""
        out, self._failed = self._failed, set()
        return out
