"""Connectors for the exploration's self-tests: two correct ones and one fault each.

Loaded by vLLM through ``kv_connector_module_path = "explore_connectors"`` (the
self-tests put this folder on PYTHONPATH). Both sides run on CPU.

:class:`MemoryConnector` keeps KV in a process-wide dict (``STORES[store_id]``,
``kv_connector_extra_config["store_id"]``) keyed by vLLM's block hashes (which
include ``cache_salt`` and the LoRA adapter), with a checksum per entry:

* lookup: the longest run of stored blocks from the request's first block,
  capped at ``len - 1`` tokens (synchronous) or ``len`` (asynchronous), minus
  ``num_computed_tokens`` (never negative);
* save: when a request finishes, its computed full blocks, in the next step
  (``request_finished`` returns ``delay_free_blocks=True`` and the worker names
  the request in ``finished_sending`` once copied: the delayed-free shape);
* load: copies the entries into the blocks vLLM allocated; an entry that is
  gone, torn (a layer missing) or corrupt (checksum) is reported through
  ``get_block_ids_with_load_errors`` (and, asynchronously, the request is still
  named in ``finished_recving``) and dropped from the store: vLLM retries a
  failed asynchronous load by asking ``get_num_new_matched_tokens`` again
  (``Scheduler._update_waiting_for_remote_kv`` frees the blocks, the request
  waits again), so the damaged entry must miss then.

:class:`AsyncMemoryConnector` loads asynchronously: it copies in the step that
admits the request and reports ``finished_recving`` one step later.

:func:`memory_fault_injector` is the profiles' ``connector.fault_injector``: it
loses, tears and corrupts entries of the store between lookup and load.

Each ``Bad*`` class carries ONE fault, which one exploration invariant catches.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

#: store id -> block hash -> {"layers": {name: tensor}, "sum": str, "prompt": tuple}
STORES: dict[str, dict[Any, dict[str, Any]]] = {}


def _checksum(layers: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for name in sorted(layers):
        h.update(name.encode())
        h.update(layers[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _block_dim(t: Any, num_blocks: int) -> int:
    dims = [i for i, s in enumerate(t.shape) if s == num_blocks]
    if len(dims) > 1 and dims[0] == 0 and t.shape[0] == 2:
        return dims[1]
    return dims[0]


@dataclass
class MemoryMeta(KVConnectorMetadata):
    """loads: (request id, [(block id, key)]); saves: same; is_async flags."""

    loads: list[tuple[str, list[tuple[int, Any]]]] = field(default_factory=list)
    saves: list[tuple[str, list[tuple[int, Any]], tuple[int, ...]]] = field(
        default_factory=list)


class MemoryConnector(KVConnectorBase_V1):
    """A correct synchronous connector with an in-memory store (module doc)."""

    ASYNC = False

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role,
                         kv_cache_config=kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.store = STORES.setdefault(str(extra.get("store_id", "default")), {})
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
        # scheduler side
        self._local: dict[str, int] = {}
        self._loads: list[tuple[str, list[tuple[int, Any]]]] = []
        self._saves: list[tuple[str, list[tuple[int, Any]], tuple[int, ...]]] = []
        self._loading: set[str] = set()
        # worker side
        self.kv: dict[str, Any] = {}
        self._errors: set[int] = set()
        self._sent: set[str] = set()
        self._recv_next: set[str] = set()
        self._recv_now: set[str] = set()

    # ------------------------------------------------------------ keys
    def keys(self, request: Any) -> list[Any]:
        """The store key of each full block: vLLM's block hash."""
        return list(request.block_hashes)

    # ------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        n = 0
        for key in self.keys(request):
            if key not in self.store:
                break
            n += 1
        b = self.block_size
        limit = request.num_tokens if self.ASYNC else request.num_tokens - 1
        hit = min(n * b, limit // b * b)
        self._local[request.request_id] = num_computed_tokens
        ext = max(0, hit - num_computed_tokens)
        return ext, bool(self.ASYNC and ext > 0)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        b = self.block_size
        ids = blocks.get_block_ids()[0]
        local = self._local.get(request.request_id, 0)
        keys = self.keys(request)
        first, last = local // b, (local + num_external_tokens) // b
        self._loads.append((request.request_id,
                            [(ids[i], keys[i]) for i in range(first, last)]))
        if self.ASYNC:
            self._loading.add(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = MemoryMeta(loads=self._loads, saves=self._saves)
        self._loads, self._saves = [], []
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in connector_output.finished_recving or ():
            self._loading.discard(rid)

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._local.pop(rid, None)
        if rid in self._loading:  # its blocks do not hold its KV yet
            return False, None
        b = self.block_size
        keys = self.keys(request)
        n = min(len(keys), request.num_computed_tokens // b, len(block_ids))
        todo = [(block_ids[i], keys[i]) for i in range(n) if keys[i] not in self.store]
        if not todo:
            return False, None
        self._saves.append((rid, todo, tuple(request.prompt_token_ids or ())))
        return True, None

    # --------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.kv = dict(kv_caches)

    def _block(self, t: Any, block: int) -> Any:
        return t.select(_block_dim(t, self.num_blocks), int(block))

    def _load(self, rid: str, pairs: list[tuple[int, Any]]) -> None:
        for block, key in pairs:
            entry = self.store.get(key)
            if entry is None or set(entry["layers"]) != set(self.kv) or \
                    _checksum(entry["layers"]) != entry["sum"]:
                self._errors.add(int(block))
                # vLLM asks again after a failed asynchronous load: the damaged
                # entry must miss then, or the request loops
                self._drop(key)
                continue
            for name, t in self.kv.items():
                self._block(t, block).copy_(entry["layers"][name])

    def _drop(self, key: Any) -> None:
        """Remove a damaged entry (its load failed) from the store."""
        self.store.pop(key, None)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MemoryMeta)
        self._recv_now |= self._recv_next
        self._recv_next = set()
        for rid, pairs in meta.loads:
            self._load(rid, pairs)
            if self.ASYNC:
                self._recv_next.add(rid)
        for rid, pairs, prompt in meta.saves:
            for block, key in pairs:
                layers = {n: self._block(t, block).clone() for n, t in self.kv.items()}
                self.store[key] = {"layers": layers, "sum": _checksum(layers),
                                   "prompt": prompt}
            self._sent.add(rid)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        sent, self._sent = self._sent, set()
        recv, self._recv_now = self._recv_now, set()
        return (sent or None), (recv or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._errors = self._errors, set()
        return out


class AsyncMemoryConnector(MemoryConnector):
    """Correct, asynchronous: loads in the admission step, reports one step later."""

    ASYNC = True


# ------------------------------------------------------------------ fault injector
class MemoryStoreInjector:
    """Loses, tears (drops a layer) or corrupts (flips a value) store entries."""

    kinds = frozenset({"lose", "tear", "corrupt"})
    between_lookup_and_load = True

    def __init__(self, store: dict[Any, dict[str, Any]]) -> None:
        self.store = store

    def mark(self) -> set[Any]:
        return set(self.store)

    def entries_since(self, mark: set[Any]) -> list[Any]:
        return [k for k in self.store if k not in mark]

    def lose(self, entries: list[Any]) -> None:
        for k in entries:
            self.store.pop(k, None)

    def tear(self, entries: list[Any]) -> None:
        for k in entries:
            layers = self.store[k]["layers"]
            if layers:
                layers.pop(sorted(layers)[-1], None)

    def corrupt(self, entries: list[Any]) -> None:
        for k in entries:
            t = next(iter(self.store[k]["layers"].values()))
            t[(0,) * t.dim()] += 1


def memory_fault_injector(rig: Any) -> MemoryStoreInjector:
    """``connector.fault_injector`` hook: the store of the rig's connector (inside
    the suite's fault wrapper where the rig has one)."""
    conn = rig.scheduler.connector
    return MemoryStoreInjector(getattr(conn, "inner", conn).store)


# ------------------------------------------------------------------ bad connectors
class BadBoundsConnector(MemoryConnector):
    """Fault: counts every stored block, the last prompt token's included."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        n = 0
        for key in self.keys(request):
            if key not in self.store:
                break
            n += 1
        self._local[request.request_id] = num_computed_tokens
        return max(0, n * self.block_size - num_computed_tokens), False


class BadOverclaimsOneTokenConnector(MemoryConnector):
    """Fault: an off-by-one in the lookup: one token more than its whole stored
    blocks (within the prompt), which its load never writes."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        ext, is_async = super().get_num_new_matched_tokens(request,
                                                           num_computed_tokens)
        if ext > 0 and num_computed_tokens + ext + 1 < request.num_tokens:
            ext += 1
        return ext, is_async


class BadOverclaimsOnceConnector(BadOverclaimsOneTokenConnector):
    """Fault: the off-by-one above, once per process and only in a sequence
    hypothesis draws: its replay of that sequence passes (a timing-dependent
    fault), which hypothesis reports as flaky."""

    fired = False

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        from hypothesis.control import currently_in_test_context

        cls = BadOverclaimsOnceConnector
        if cls.fired or not currently_in_test_context():
            return MemoryConnector.get_num_new_matched_tokens(
                self, request, num_computed_tokens)
        ext, is_async = super().get_num_new_matched_tokens(request,
                                                           num_computed_tokens)
        base, _ = MemoryConnector.get_num_new_matched_tokens(
            self, request, num_computed_tokens)
        cls.fired = ext != base
        return ext, is_async


class BadShiftOnSharedPrefixConnector(MemoryConnector):
    """Fault: where the first entry to load was stored by another prompt (a
    shared prefix, not a replay of the same prompt), loads each block from the
    entry one block further on (the last block from itself)."""

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens > 0:
            rid, pairs = self._loads[-1]
            first = self.store.get(pairs[0][1], {})
            if first.get("prompt") != tuple(request.prompt_token_ids or ()) and \
                    len(pairs) > 1:
                keys = [k for _, k in pairs]
                self._loads[-1] = (rid, [(blk, keys[min(i + 1, len(keys) - 1)])
                                         for i, (blk, _) in enumerate(pairs)])


class BadLeakOnAbortWhileLoadingConnector(AsyncMemoryConnector):
    """Fault: a request aborted while its load is in flight is forgotten: its
    receive is never reported, so vLLM never frees its blocks."""

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        if request.request_id in self._loading:
            self._aborted_loading = getattr(self, "_aborted_loading", set())
            self._aborted_loading.add(request.request_id)
        return super().request_finished(request, block_ids)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        meta.forget = set(getattr(self, "_aborted_loading", set()))
        return meta

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        forget = getattr(self._get_connector_metadata(), "forget", set())
        self._recv_next -= forget
        self._recv_now -= forget


class BadIgnoresSaltConnector(MemoryConnector):
    """Fault: keys entries by the token ids alone (cache_salt and LoRA ignored)."""

    def keys(self, request: Any) -> list[Any]:
        b = self.block_size
        toks = request.all_token_ids
        out, h = [], b""
        for i in range(len(toks) // b):
            h = hashlib.sha256(h + repr(toks[i * b:(i + 1) * b]).encode()).digest()
            out.append(h)
        return out


class BadSilentLostLoadConnector(MemoryConnector):
    """Fault: an entry gone (or damaged) at load time is skipped silently."""

    def _load(self, rid: str, pairs: list[tuple[int, Any]]) -> None:
        for block, key in pairs:
            entry = self.store.get(key)
            if entry is None:
                continue
            for name, t in self.kv.items():
                if name in entry["layers"]:
                    self._block(t, block).copy_(entry["layers"][name])


class BadNeverFinishesAfterFaultConnector(AsyncMemoryConnector):
    """Fault: an asynchronous load that hits a damaged entry is never finished
    (neither finished_recving nor a reported block)."""

    def _load(self, rid: str, pairs: list[tuple[int, Any]]) -> None:
        before = set(self._errors)
        super()._load(rid, pairs)
        if self._errors - before:
            self._errors = before
            self._stuck = getattr(self, "_stuck", set()) | {rid}

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        stuck = getattr(self, "_stuck", set())
        self._recv_next -= stuck
        self._recv_now -= stuck


class BadRematchesFailedEntryConnector(AsyncMemoryConnector):
    """Fault: keeps an entry whose load failed: vLLM's retry of the failed
    asynchronous load matches and loads it again, forever."""

    def _drop(self, key: Any) -> None:
        return None


class BadIgnoresPromptEmbedsConnector(MemoryConnector):
    """Fault: keys entries by token ids, ``cache_salt`` and the LoRA adapter,
    but not by ``prompt_embeds``: an embeddings-only request's token ids are all
    0, so two prompts of one length share entries."""

    def keys(self, request: Any) -> list[Any]:
        b = self.block_size
        toks = request.all_token_ids
        lora = getattr(request.lora_request, "lora_name", None)
        out, h = [], repr((request.cache_salt, lora)).encode()
        for i in range(len(toks) // b):
            h = hashlib.sha256(h + repr(toks[i * b:(i + 1) * b]).encode()).digest()
            out.append(h)
        return out


def no_transfer_report(vllm_config, kv_cache_config, connector):
    """``connector.worker_report`` stand-in for the synchronous connectors here.

    Moves no bytes and reports nothing (a synchronous connector's worker has no
    finished transfers to report): the exploration then runs vLLM's scheduler
    with this stand-in in place of the worker side.
    """
    return lambda scheduler_output, metadata: None


class BadFreesBeforeSaveConnector(MemoryConnector):
    """Fault: ``request_finished`` returns False although the request's save is
    queued for the next step: vLLM frees the blocks at once, and the save reads
    them after that."""

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        super().request_finished(request, block_ids)
        return False, None

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        _sent, recv = super().get_finished(finished_req_ids)
        return None, recv  # nothing was delayed, so nothing to report


class BadSavesFailedLoadConnector(MemoryConnector):
    """Fault: at request_finished it saves the blocks it loaded, from the block
    table it kept at ``update_state_after_alloc``, rather than what vLLM hands
    it (vLLM 0.28 passes only the blocks of ``request.num_computed_tokens``,
    which it truncates at the first failed block): a request whose load failed
    under ``kv_load_failure_policy = "fail"`` has its never-computed blocks
    saved, and a later request loads them (a fresh user's connector did this)."""

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens > 0:
            tables = self.__dict__.setdefault("_tables", {})
            tables[request.request_id] = list(blocks.get_block_ids()[0])

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        table = self.__dict__.get("_tables", {}).pop(request.request_id, None)
        if request.status.name != "FINISHED_ERROR" or not table:
            return super().request_finished(request, block_ids)
        self._local.pop(request.request_id, None)
        keys = self.keys(request)
        n = min(len(keys), request.num_prompt_tokens // self.block_size, len(table))
        todo = [(table[i], keys[i]) for i in range(n) if keys[i] not in self.store]
        if not todo:
            return False, None
        self._saves.append((request.request_id, todo,
                            tuple(request.prompt_token_ids or ())))
        return True, None


class BadLandsAfterAbortConnector(AsyncMemoryConnector):
    """Fault: names a receive in ``finished_recving`` one step after it queued the
    copy, which lands one step later still (in the ``start_load_kv`` of the step
    that schedules the request, before its forward: right for a request vLLM
    goes on with). A request aborted while it waits for remote KV is freed at
    that ``finished_recving``, and its late copy writes into free blocks."""

    def _load(self, rid: str, pairs: list[tuple[int, Any]]) -> None:
        self.__dict__.setdefault("_late", []).append((rid, pairs))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        due, self._due = self.__dict__.get("_due", []), self.__dict__.get("_late", [])
        self._late = []
        for rid, pairs in due:  # queued two calls ago
            MemoryConnector._load(self, rid, pairs)
        super().start_load_kv(forward_context, **kwargs)
