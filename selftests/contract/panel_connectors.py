"""A panel of CORRECT connectors of different shapes, for the contract tier.

Every contract test must give each of them zero reds (``test_panel_connectors.py``):
a red there is a false red of the suite, not a connector fault. They are small
connectors written from scratch against vLLM's ``KVConnectorBase_V1``
(``vllm/distributed/kv_transfer/kv_connector/v1/base.py``) and the V1 scheduler's
use of it (``vllm/v1/core/sched/scheduler.py``), loaded by vLLM through
``kv_connector_module_path = "panel_connectors"`` (the self-tests put this folder
on PYTHONPATH).

The store: one safetensors file per chunk (and per TP rank for the rank-aware
shape) under ``kv_connector_extra_config["store_path"]``; a chunk is
``lcm(chunk_tokens, B)`` tokens (``chunk_tokens`` from the extra config, default
B) and is keyed by vLLM's block hash of its last block, so the key covers the
whole prefix, ``cache_salt`` and the LoRA adapter
(``vllm/v1/core/kv_cache_utils.py`` ``generate_block_hash_extra_keys``), under a
folder per model (the block hash does not cover the model). A file
is written to a temporary name and renamed, so a lookup never sees a partial
entry; every block carries a SHA-256 digest, checked before a byte is copied.

Matched tokens: the longest run of stored whole chunks of the prompt, capped at
``len - 1`` and rounded down to the chunk, minus ``num_computed_tokens``
(never negative): hit rule ``(len - 1) // G * G``.

Shapes (class attributes of :class:`FileChunkConnector`):

* :class:`SyncPanelConnector`: loads in ``start_load_kv`` of the step that
  schedules the request (``load_kv_async=False``);
* :class:`AsyncPanelConnector`: ``load_kv_async=True``; the load runs in the
  admission step (the request waits in WAITING_FOR_REMOTE_KVS) and ends in that
  very step's ``get_finished`` (``finished_recving``), a failure's blocks in the
  same pass's ``get_block_ids_with_load_errors`` (base.py's rule for async loads);
* :class:`DelayedFreePanelConnector`: copies the blocks to save in
  ``wait_for_save`` and writes them one step later; ``request_finished`` returns
  ``True`` for every request and the worker names it in ``finished_sending``
  once its writes are done (vLLM frees its blocks then);
* :class:`RankAwarePanelConnector`: each worker (TP rank, pipeline stage)
  writes and reads its own files, named by ``parallel_config.rank`` (set per
  worker by vLLM's ``WorkerBase``); a chunk is resident only when every
  worker's file exists;
* :class:`FailureReportingPanelConnector`: on a damaged chunk it loads the good
  blocks before the first bad one and reports exactly the blocks from there
  (the others report the damaged chunk's blocks from its first one), and it
  names the failed requests in ``get_request_ids_with_load_errors``.
* :class:`DeferredLookupPanelConnector`: answers ``None`` to the first lookup
  of each request (vLLM asks again a step later), the store's answer after;
* :class:`FullPromptPanelConnector`, :class:`AsyncFullPromptPanelConnector`:
  a prompt whose every chunk is stored (its length a multiple of the chunk)
  is a full-prompt hit answered ``len - 1``, as LMCache answers it ("in the
  full-prompt-hit case we need to recompute the last token"); the load copies
  whole blocks, the last token's slot included, before the forward, which then
  overwrites that slot (LMCache retrieves the whole stored prompt the same way).
  Hit rule ``len - 1 if len % G == 0 else (len - 1) // G * G``.

A failed save is absorbed (logged), never raised, and leaves no entry; an entry
whose load failed is removed, so vLLM's next lookup (it asks again after a failed
asynchronous load) misses it instead of loading it again.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import time
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
class ChunkJob:
    """One chunk to load or save for one request.

    Attributes:
        req_id: the request.
        key: the store key (hex of vLLM's block hash of the chunk's last block).
        block_ids: the request's KV block ids of the whole chunk, in order.
        first: index in ``block_ids`` of the first block to copy (a load from
            ``num_computed_tokens`` inside the chunk starts there).
    """

    req_id: str
    key: str
    block_ids: list[int]
    first: int = 0


@dataclass
class PanelMetadata(KVConnectorMetadata):
    """This step's loads and saves (picklable: plain lists)."""

    loads: list[ChunkJob] = field(default_factory=list)
    saves: list[ChunkJob] = field(default_factory=list)


def _block_dim(t: torch.Tensor) -> int:
    """The block dimension of a layer's KV tensor.

    ``(num_blocks, ...)`` (e.g. FlashAttention's ``(N, H, B, 2*D)``) -> 0;
    ``(2, num_blocks, B, H, D)`` -> 1.
    """
    return 1 if t.dim() == 5 and t.shape[0] == 2 else 0


def _digest(tensors: list[torch.Tensor], block_dim: int, i: int) -> str:
    """SHA-256 over block ``i`` of every layer (raw bytes, layer order)."""
    h = hashlib.sha256()
    for t in tensors:
        blk = t.select(block_dim, i).contiguous().reshape(-1)
        h.update(blk.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class FileChunkConnector(KVConnectorBase_V1):
    """A correct chunked, file-backed connector (see the module docstring).

    Extra config: ``store_path`` (required, a directory), ``chunk_tokens``
    (tokens per stored chunk, default B; the chunk is ``lcm(chunk_tokens, B)``).
    """

    LOAD_ASYNC = False
    DELAY_FREE = False
    RANK_FILES = False
    BLOCK_EXACT_REPORTS = False
    FULL_PROMPT = False

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        self.root = Path(str(ktc.get_from_extra_config("store_path", "")))
        if not str(self.root) or str(self.root) == ".":
            raise ValueError("kv_connector_extra_config: key store_path is required")
        self.root = self.root / self.model_namespace(vllm_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.chunk = math.lcm(int(ktc.get_from_extra_config(
            "chunk_tokens", self.block_size)), self.block_size)
        self.blocks_per_chunk = self.chunk // self.block_size
        pc = vllm_config.parallel_config
        self.tp_size = int(pc.tensor_parallel_size)
        # every worker of the engine: TP ranks x pipeline stages
        self.world_size = self.tp_size * int(pc.pipeline_parallel_size)
        self.rank = int(pc.rank)
        # scheduler side
        self._requests: dict[str, Any] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._planned: dict[str, tuple[int, int]] = {}  # req -> (local, hit)
        self._loads: list[ChunkJob] = []
        self._saved_upto: dict[str, int] = {}  # req -> chunks saved or present
        # worker side
        self._kv: dict[str, torch.Tensor] = {}
        self._invalid: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._recv_done: set[str] = set()
        self._staged: list[tuple[ChunkJob, list[torch.Tensor]]] = []
        self._staged_now: list[tuple[ChunkJob, list[torch.Tensor]]] = []
        self._finished: set[str] = set()

    # ------------------------------------------------------------------ store
    @staticmethod
    def model_namespace(vllm_config: Any) -> str:
        """Folder of this model's entries: vLLM's block hashes do not cover the
        model, so one store shared by engines of different models keys by it
        (model path, KV heads, head size, dtype, KV cache dtype, layers, TP
        size)."""
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        ident = (mc.model, mc.get_total_num_kv_heads(), mc.get_head_size(),
                 str(mc.dtype), vllm_config.cache_config.cache_dtype,
                 mc.get_total_num_hidden_layers(), pc.tensor_parallel_size)
        return hashlib.sha256(repr(ident).encode()).hexdigest()[:16]

    def _path(self, key: str, rank: int) -> Path:
        name = f"{key}.r{rank}.safetensors" if self.RANK_FILES else \
            f"{key}.safetensors"
        return self.root / key[:2] / name

    def _resident(self, key: str) -> bool:
        ranks = range(self.world_size) if self.RANK_FILES else (0,)
        return all(self._path(key, r).is_file() for r in ranks)

    def _keys(self, request: Any, upto_tokens: int) -> list[str]:
        """Keys of the request's whole chunks within its first ``upto`` tokens."""
        hashes = request.block_hashes
        out = []
        for k in range(upto_tokens // self.chunk):
            last = (k + 1) * self.blocks_per_chunk - 1
            if last >= len(hashes):
                break
            h = hashes[last]
            out.append(bytes(h).hex() if isinstance(h, bytes | bytearray)
                       else hashlib.sha256(repr(h).encode()).hexdigest())
        return out

    # -------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        """Stored whole chunks of the prompt, capped at len - 1, beyond local.

        A request that must not read cached KV (``skip_reading_prefix_cache``,
        which vLLM sets for ``prompt_logprobs``) gets 0: vLLM 0.26/0.28 use the
        connector's answer as is.
        """
        self._requests[request.request_id] = request
        prompt = request.num_prompt_tokens  # prompt_token_ids is None for embeds
        stored = 0
        if getattr(request, "skip_reading_prefix_cache", False):
            prompt = 1  # no whole chunk below len - 1 = 0: a miss
        whole = self.FULL_PROMPT and prompt % self.chunk == 0
        for key in self._keys(request, prompt if whole else prompt - 1):
            if not self._resident(key):
                break
            stored += 1
        hit = stored * self.chunk
        if whole and hit == prompt:
            hit = prompt - 1  # the whole prompt is stored: vLLM computes the last
        n = max(0, hit - num_computed_tokens)
        if n:
            self._planned[request.request_id] = (num_computed_tokens, hit)
        else:
            self._planned.pop(request.request_id, None)
        return n, bool(n) and self.LOAD_ASYNC

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        """Plan the load of ``num_external_tokens`` into the allocated blocks."""
        rid = request.request_id
        block_ids = list(blocks.get_block_ids()[0])
        if block_ids:
            self._block_ids[rid] = block_ids
        plan = self._planned.pop(rid, None)
        if not num_external_tokens or plan is None:
            return
        local, hit = plan
        end = -(-hit // self.chunk)  # a len - 1 hit ends in its last chunk
        keys = self._keys(request, end * self.chunk)
        b, per = self.block_size, self.blocks_per_chunk
        for k in range(local // self.chunk, end):
            chunk_blocks = block_ids[k * per:(k + 1) * per]
            first = max(0, local // b - k * per)
            self._loads.append(ChunkJob(rid, keys[k], chunk_blocks, first))

    def build_connector_meta(self, scheduler_output: Any) -> PanelMetadata:
        """This step's planned loads, and saves of every chunk now computed."""
        meta = PanelMetadata(loads=self._loads)
        self._loads = []
        computed: dict[str, int] = {}
        for nr in scheduler_output.scheduled_new_reqs:
            # new, or resumed and sent as new (Model Runner V2): its whole table
            self._note_blocks(nr.req_id, list(nr.block_ids[0]), True)
            computed[nr.req_id] = self._computed_after(
                nr.req_id, nr.num_computed_tokens,
                scheduler_output.num_scheduled_tokens[nr.req_id])
        cr = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cr, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cr.req_ids):
            new = cr.new_block_ids[i]
            if new is not None:
                self._note_blocks(rid, list(new[0]), rid in resumed)
            computed[rid] = self._computed_after(
                rid, cr.num_computed_tokens[i],
                scheduler_output.num_scheduled_tokens[rid])
        for rid, done in computed.items():
            req = self._requests.get(rid)
            if req is None:
                continue
            keys = self._keys(req, min(done, req.num_prompt_tokens))
            table = self._block_ids.get(rid, [])
            per = self.blocks_per_chunk
            for k in range(self._saved_upto.get(rid, 0), len(keys)):
                if not self._resident(keys[k]):
                    meta.saves.append(ChunkJob(rid, keys[k],
                                               table[k * per:(k + 1) * per]))
            self._saved_upto[rid] = max(self._saved_upto.get(rid, 0), len(keys))
        return meta

    def _note_blocks(self, rid: str, block_ids: list[int], resumed: bool) -> None:
        """A running request's new blocks: appended; a resumed one's: its table.

        (``CachedRequestData``: "For request ids not in resumed_req_ids,
        new_block_ids will be appended ... For those in the set, new_block_ids
        will be used as the request's block IDs", vllm/v1/core/sched/output.py.)
        """
        if resumed:
            self._block_ids[rid] = block_ids
        else:
            self._block_ids.setdefault(rid, []).extend(block_ids)

    def _computed_after(self, rid: str, num_computed: int, scheduled: int) -> int:
        """Tokens computed once this step ran: vLLM's count plus this step's."""
        return num_computed + scheduled

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; delay freeing its blocks in the delayed shape."""
        rid = request.request_id
        for d in (self._requests, self._block_ids, self._planned, self._saved_upto):
            d.pop(rid, None)
        self._loads = [j for j in self._loads if j.req_id != rid]
        return self.DELAY_FREE, None

    # ----------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the per-layer KV tensors (layer order as registered)."""
        self._kv = dict(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Load every planned chunk now (both shapes load in this step)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, PanelMetadata)
        failed, invalid = self._load_all(meta.loads)
        self._invalid |= invalid
        self._failed_reqs |= failed
        if self.LOAD_ASYNC:
            self._recv_done |= {j.req_id for j in meta.loads}

    def _load_all(self, jobs: list[ChunkJob]) -> tuple[set[str], set[int]]:
        """Load every job: (requests whose load failed, blocks to report)."""
        failed: set[str] = set()
        invalid: set[int] = set()
        for job in jobs:
            if job.req_id in failed:
                invalid.update(job.block_ids[job.first:])
                continue
            bad = self._load(job)
            if bad is not None:
                # quarantine the damaged entry: a later lookup (vLLM asks again
                # for an asynchronous load that failed) must miss it
                self._path(job.key, self.rank).unlink(missing_ok=True)
                failed.add(job.req_id)
                invalid.update(job.block_ids[bad:])
        return failed, invalid

    def _load(self, job: ChunkJob) -> int | None:
        """Copy one chunk into its blocks; the index of the first failed block."""
        names = list(self._kv)
        path = self._path(job.key, self.rank)
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                data = [f.get_tensor(n) for n in names]
        except Exception as exc:  # noqa: BLE001 - any unreadable entry is a failure
            log.warning("panel: cannot read %s: %s", path, exc)
            return job.first
        digests = meta.get("digests", "").split(",")
        bdim = _block_dim(next(iter(self._kv.values())))
        if len(digests) != len(job.block_ids) or any(
                d.shape[bdim] != len(job.block_ids) for d in data):
            return job.first
        good = job.first
        for i in range(job.first, len(job.block_ids)):
            if _digest(data, bdim, i) != digests[i]:
                break
            good = i + 1
        if good < len(job.block_ids) and not self.BLOCK_EXACT_REPORTS:
            return job.first
        if good > job.first:
            idx = torch.arange(job.first, good)
            dst = torch.tensor(job.block_ids[job.first:good])
            for name, src in zip(names, data, strict=True):
                kv = self._kv[name]
                kv.index_copy_(bdim, dst.to(kv.device),
                               src.index_select(bdim, idx).to(kv.device, kv.dtype))
        return None if good == len(job.block_ids) else good

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in ``start_load_kv``."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Saves run in ``wait_for_save``, after every layer computed."""

    def wait_for_save(self) -> None:
        """Copy this step's chunks to save; write them now (or next step)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, PanelMetadata)
        names = list(self._kv)
        if not names:
            return
        bdim = _block_dim(self._kv[names[0]])
        for job in meta.saves:
            idx = torch.tensor(job.block_ids)
            data = [self._kv[n].index_select(bdim, idx.to(self._kv[n].device))
                    .to("cpu").contiguous() for n in names]
            if self.DELAY_FREE:
                self._staged_now.append((job, data))
            else:
                self._write(job, names, data)

    def _write(self, job: ChunkJob, names: list[str],
               data: list[torch.Tensor]) -> None:
        """Write one chunk atomically (temp file + rename); absorb a failure."""
        path = self._path(job.key, self.rank)
        if path.is_file():
            return
        bdim = _block_dim(self._kv[names[0]])
        digests = ",".join(_digest(data, bdim, i) for i in range(len(job.block_ids)))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file(dict(zip(names, data, strict=True)), str(tmp),
                      metadata={"digests": digests})
            os.replace(tmp, path)
        except Exception as exc:  # noqa: BLE001 - a failed save is a future miss
            log.warning("panel: save of %s failed: %s", path, exc)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Finished receives of this step; finished sends (delayed shape)."""
        recv, self._recv_done = self._recv_done, set()
        sending: set[str] | None = None
        if self.DELAY_FREE:
            names = list(self._kv)
            for job, data in self._staged:  # staged in an earlier step
                self._write(job, names, data)
            self._staged, self._staged_now = self._staged_now, []
            self._finished |= set(finished_req_ids)
            pending = {job.req_id for job, _ in self._staged}
            sending = {r for r in self._finished if r not in pending}
            self._finished -= sending
        return sending or None, recv or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (then cleared)."""
        out, self._invalid = self._invalid, set()
        return out


class SyncPanelConnector(FileChunkConnector):
    """Synchronous loads in the step that schedules the request."""


class AsyncPanelConnector(FileChunkConnector):
    """Asynchronous loads that complete in the admission step."""

    LOAD_ASYNC = True


class ThreadedAsyncPanelConnector(FileChunkConnector):
    """Asynchronous loads copied by a background thread after ``LOAD_DELAY_S``
    (extra config ``load_delay_s`` overrides it).

    A transfer that takes wall time (a disk or a network), not engine steps:
    ``finished_recving`` names a request only once its thread has copied it, and
    the engine may step any number of times meanwhile (vLLM sets no bound:
    ``Scheduler._try_promote_blocked_waiting_request`` waits for the name).
    """

    LOAD_ASYNC = True
    LOAD_DELAY_S = 0.1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()  # the copy threads' results
        self._threads: list[threading.Thread] = []

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Hand this step's loads to a thread; it reports them when copied."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, PanelMetadata)
        if not meta.loads:
            return
        jobs = list(meta.loads)
        delay = float(self._kv_transfer_config.get_from_extra_config(
            "load_delay_s", self.LOAD_DELAY_S))

        def copy() -> None:
            time.sleep(delay)
            failed, invalid = self._load_all(jobs)
            with self._lock:
                self._invalid |= invalid
                self._failed_reqs |= failed
                self._recv_done |= {j.req_id for j in jobs}

        t = threading.Thread(target=copy, name="panel-load", daemon=True)
        self._threads.append(t)
        t.start()

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Receives the thread has copied (under its lock)."""
        with self._lock:
            return super().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (under the lock)."""
        with self._lock:
            return super().get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        """Wait for the copies in flight."""
        for t in self._threads:
            t.join(timeout=5)
        super().shutdown()


class DelayedFreePanelConnector(FileChunkConnector):
    """Writes saves a step later; frees blocks through ``finished_sending``."""

    DELAY_FREE = True


class RankAwarePanelConnector(FileChunkConnector):
    """One file per TP rank, named by ``parallel_config.rank``."""

    RANK_FILES = True


class FullPromptPanelConnector(FileChunkConnector):
    """Answers ``len - 1`` for a stored whole prompt (synchronous loads)."""

    FULL_PROMPT = True


class AsyncFullPromptPanelConnector(FileChunkConnector):
    """Answers ``len - 1`` for a stored whole prompt (asynchronous loads)."""

    FULL_PROMPT = True
    LOAD_ASYNC = True


class FailureReportingPanelConnector(FileChunkConnector):
    """Reports exactly the blocks from the first damaged one, and the requests."""

    BLOCK_EXACT_REPORTS = True

    def get_request_ids_with_load_errors(self) -> set[str]:
        """Requests whose load failed since the last call (then cleared)."""
        out, self._failed_reqs = self._failed_reqs, set()
        return out


class DeferredLookupPanelConnector(FileChunkConnector):
    """Answers ``None`` to the first lookup of each request ("needs more time to
    determine the number of matched tokens", base.py), the store's answer from
    the next; vLLM skips the request and asks again a step later
    (``Scheduler.schedule``: ``if ext_tokens is None: ... continue``)."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """``(None, False)`` the first time a request is asked about."""
        asked = self.__dict__.setdefault("_asked", set())
        if request.request_id not in asked:
            asked.add(request.request_id)
            return None, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


class ThresholdPanelConnector(FileChunkConnector):
    """Stores only prompts of at least ``min_store_tokens`` tokens (extra config).

    A shape vLLM allows: ``build_connector_meta`` / ``save_kv_layer`` leave what
    to save to the connector (vLLM's LMCache adapter skips saves per request,
    ``lmcache.skip_save``), and ``get_num_new_matched_tokens`` answers what can
    be loaded, 0 for a prompt never stored. Its rule:
    ``(len - 1) // C * C if len >= min_store_tokens else 0``.
    """

    INCLUSIVE = True  # len >= min_store_tokens is stored

    def _stores(self, request: Any) -> bool:
        n = request.num_prompt_tokens
        least = int(self._kv_transfer_config.get_from_extra_config(
            "min_store_tokens", 0))
        return n >= least if self.INCLUSIVE else n > least

    def build_connector_meta(self, scheduler_output: Any) -> PanelMetadata:
        """The base class's meta without saves of prompts below the threshold."""
        meta = super().build_connector_meta(scheduler_output)
        meta.saves = [j for j in meta.saves
                      if j.req_id not in self._requests
                      or self._stores(self._requests[j.req_id])]
        return meta
