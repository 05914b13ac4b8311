"""Blocks vLLM freed, marked in the worker's KV so that a later use is named.

vLLM frees a request's blocks at once when ``request_finished`` returns False
(``Scheduler._free_request`` -> ``_free_request_blocks`` -> ``KVCacheManager.free``,
``vllm/v1/core/sched/scheduler.py`` 0.28 L2388-2438) or on preemption
(``Scheduler._preempt_request``); the next step may reuse them. The way out is
the delayed free (``KVConnectorBase_V1.request_finished``, base.py) or finishing
in ``handle_preemptions`` (base.py: "Handle preempted requests or evicted blocks
BEFORE they are overwritten"; OffloadingConnector's ``jobs_to_flush``).
:class:`FreedBlocks` keeps freed blocks as they are (a change while free is a
write after free) and writes :data:`UNWRITTEN` into blocks handed out fresh
(``BlockPool.get_new_blocks``) after ``handle_preemptions``; a load that brings
the mark back was saved from uncomputed tokens (:func:`mark_meaning`). The mark is
no pattern value nor the load poison (0.5), and exact in float16, bfloat16 and
fp8 (e4m3).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

#: a block vLLM allocated that neither the forward nor a load has written yet
UNWRITTEN = 0.125
#: a block of a load that failed under kv_load_failure_policy = "fail": vLLM
#: ends the request FINISHED_ERROR and never computes it
FAILED_LOAD = 0.375

USED_AFTER_FREE = "used after vLLM freed it"
#: what a load that brings back another request's KV says (a save after reuse)
SAVED_AFTER_REUSE = (
    ": the entry was saved from a block after vLLM had handed it to that request "
    f"— {USED_AFTER_FREE} (a save that still read its request's blocks after "
    "request_finished let vLLM free them, or one through a block table kept "
    "across a preemption). Fix: ")
DELAYED_FREE_FIX = (
    "return True from request_finished while a save from the request's blocks is "
    "queued and name the request in finished_sending once it is done (vLLM's "
    "delayed free: Scheduler._free_request frees the blocks at once otherwise), "
    "or finish the save in handle_preemptions once vLLM hands one of those "
    "blocks to another request (as vLLM's OffloadingConnector does)")
FAILED_SAVE_FIX = (
    "save only what vLLM counts computed: request.num_computed_tokens, which "
    "vLLM truncates at the first block reported failed "
    "(Scheduler._update_requests_with_invalid_blocks), not the connector's own "
    "count of what it loaded")
RESUME_FIX = (
    "after a preemption vLLM resumes the request with a whole new block table "
    "(scheduled_cached_reqs.resumed_req_ids, new_block_ids replace the old ones) "
    "and recomputes from num_computed_tokens: drop the request's old block ids "
    "and finish or cancel its transfers in handle_preemptions")

ENDED_FIX = (
    "a load of a request vLLM ended (finished or aborted) must not write after "
    "vLLM freed its blocks: vLLM keeps them while the request waits for remote "
    "KV until the connector names it in finished_recving (Scheduler."
    "finish_requests), or while request_finished returned True; otherwise it "
    "frees them at once, so cancel the load in request_finished, or report it "
    "finished only once its copy is done")


def mark_meaning(value: float) -> str:
    """What a mark in loaded KV says about its store entry ("; ..." clause, or "")."""
    if value == UNWRITTEN:
        return ("; it holds the harness's mark of a block vLLM had allocated but "
                "nothing had computed yet: the entry was saved from tokens before "
                "vLLM computed them (the connector counts computed tokens itself "
                "and its count ran ahead of num_computed_tokens, e.g. it was not "
                "reset when vLLM preempted the request and recomputed it), or "
                "from a block after vLLM had freed it and handed it to another "
                "request, before that request computed there (request_finished "
                "returned False while a save from the block was queued)")
    if value == FAILED_LOAD:
        return ("; it holds the harness's mark of a block whose load failed under "
                "kv_load_failure_policy = \"fail\": the entry was saved from a "
                f"request vLLM ended FINISHED_ERROR, from blocks it never computed. "
                f"Fix: {FAILED_SAVE_FIX}")
    return ""


#: exploration invariant -> connector method(s) at fault, for what a mark says
INVARIANTS = {
    "no block table kept across a preemption": (
        "build_connector_meta / update_state_after_alloc (block ids of before "
        "the preemption)"),
    "no use of blocks vLLM freed": (
        "request_finished (returned False while a save from the blocks was "
        "queued) / save_kv_layer / wait_for_save"),
    "saves hold computed KV": (
        "build_connector_meta / save_kv_layer (saves tokens not yet computed), "
        "or request_finished (returned False while a save from the blocks was "
        "queued)"),
    "no save of a failed load": (
        "request_finished / save_kv_layer / wait_for_save (saved the blocks of a "
        "load that failed)"),
    "no write into a free block": (
        "start_load_kv / wait_for_layer_load (a load into a block vLLM freed)"),
}


def blame(text: str) -> tuple[str, str] | None:
    """The invariant and method a worker load error's mark names (None: no mark)."""
    if USED_AFTER_FREE in text:
        name = "no use of blocks vLLM freed"
    elif "before vLLM computed them" in text:
        name = "saves hold computed KV"
    elif "a block whose load failed" in text:
        name = "no save of a failed load"
    else:
        return None
    return name, INVARIANTS[name]


def holds(t: Any, value: float) -> bool:
    """Whether some element of ``t`` is ``value``, bit for bit (any KV dtype)."""
    import torch

    want = torch.full((1,), value, dtype=t.dtype, device=t.device)
    size = t.element_size()
    got = t.contiguous().view(torch.uint8).reshape(-1, size)
    return bool(got.eq(want.view(torch.uint8).reshape(1, size)).all(dim=1).any())


def _block_dim(kv: Any) -> int:
    """The block dimension of a layer tensor (``(N, ...)`` or ``(2, N, ...)``)."""
    return 0 if kv.dim() == 4 else 1


def _rows(kv: Any, ids: Any) -> Any:
    """A copy of the given blocks of a layer tensor (block dimension kept)."""
    return kv.index_select(_block_dim(kv), ids.to(kv.device))


def fill_blocks(kv: Any, ids: Any, value: float) -> None:
    """Fill the given blocks of a layer tensor with ``value`` (in place).

    Through an integer view of the bytes where possible: a float16 fill through
    advanced indexing is slow on a busy CPU.
    """
    import torch

    ids = ids.to(kv.device)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}.get(kv.element_size())
    try:
        if ints is None:
            raise RuntimeError("no integer view")
        bits = torch.full((1,), value, dtype=kv.dtype).view(ints).item()
        kv.view(ints).index_fill_(_block_dim(kv), ids, bits)
    except RuntimeError:
        kv.index_fill_(_block_dim(kv), ids, value)


class FreedBlocks:
    """The blocks vLLM freed, and the mark in blocks it hands out fresh.

    Fresh blocks get :data:`UNWRITTEN` once ``handle_preemptions`` returned (where
    OffloadingConnector waits for saves still reading a reused block,
    ``jobs_to_flush``, offloading/worker.py 0.26-0.33).

    Args:
        kv_caches: layer name -> the worker's KV tensor (block-major layouts
            of :func:`tvc.contract.worker.token_view`).

    Attributes:
        freed: block id -> what freed it, for blocks free now.
        kept: block id -> layer name -> the block's content when vLLM freed it.
        due: blocks handed out fresh since the last :meth:`flush`.
        uses: one sentence per write into a freed block (:meth:`check`).

    """

    def __init__(self, kv_caches: dict[str, Any]) -> None:
        self.kv = kv_caches
        self.freed: dict[int, str] = {}
        self.kept: dict[int, dict[str, Any]] = {}
        self.due: set[int] = set()
        self.uses: list[str] = []
        self.step = 0
        self._why = ""

    # ------------------------------------------------------------ the pool
    def watch(self, scheduler: Any) -> None:
        """Wrap the scheduler's ``KVCacheManager.free`` and its block pool.

        ``BlockPool.free_blocks`` (ref count 0), ``touch`` (local hit) and
        ``get_new_blocks`` (fresh); the same names in vLLM 0.26-0.33.
        """
        mgr = scheduler.kv_cache_manager
        pool = mgr.block_pool
        orig_free, orig_free_blocks = mgr.free, pool.free_blocks
        orig_touch, orig_new = pool.touch, pool.get_new_blocks

        def free(request: Any) -> Any:
            status = request.status.name
            self._why = (f"when vLLM preempted request {request.request_id}"
                         if status == "PREEMPTED" else
                         f"when request {request.request_id} ended ({status})")
            try:
                return orig_free(request)
            finally:
                self._why = ""

        def free_blocks(blocks: Iterable[Any]) -> Any:
            blocks = list(blocks)
            ret = orig_free_blocks(blocks)
            self.freed_now([b.block_id for b in blocks
                            if b.ref_cnt == 0 and not getattr(b, "is_null", False)],
                           self._why or "by vLLM")
            return ret

        def touch(blocks: Any) -> Any:
            self.handed_out([b.block_id for b in blocks], fresh=False)
            return orig_touch(blocks)

        def get_new_blocks(n: int) -> Any:
            ret = orig_new(n)
            self.handed_out([b.block_id for b in ret], fresh=True)
            return ret

        mgr.free = free
        pool.free_blocks, pool.touch = free_blocks, touch
        pool.get_new_blocks = get_new_blocks

    def freed_now(self, blocks: list[int], why: str) -> None:
        """Note blocks vLLM just freed; keep their content for :meth:`check`."""
        import torch

        blocks = [b for b in blocks if b not in self.freed]
        if not blocks:
            return
        ids = torch.tensor(blocks, dtype=torch.long)
        for name, kv in self.kv.items():
            rows = _rows(kv, ids)
            for j, b in enumerate(blocks):
                self.kept.setdefault(b, {})[name] = rows.select(_block_dim(kv), j)
        for b in blocks:
            self.freed[b] = f"{why}, engine step {self.step}"

    def handed_out(self, blocks: list[int], fresh: bool) -> None:
        """Blocks vLLM hands out; fresh ones (no local hit) get the mark at flush."""
        for b in blocks:
            self.freed.pop(b, None)
            self.kept.pop(b, None)
            if fresh:
                self.due.add(b)

    def flush(self) -> None:
        """Mark the blocks handed out fresh (call after handle_preemptions).

        The caller makes the marks visible to other CUDA streams before the load starts.
        """
        import torch

        due, self.due = sorted(self.due), set()
        if due:
            ids = torch.tensor(due, dtype=torch.long)
            for kv in self.kv.values():
                fill_blocks(kv, ids, UNWRITTEN)

    def check(self, where: str) -> list[str]:
        """Blocks written while free since the last check, one sentence each.

        ``where`` names what ran since (``the worker step of engine step 7``); the
        sentences are also added to :attr:`uses`.
        """
        import torch

        out: list[str] = []
        seen: set[int] = set()
        blocks = sorted(self.freed)
        if not blocks:
            return out
        ids = torch.tensor(blocks, dtype=torch.long)
        for name, kv in self.kv.items():
            dim = _block_dim(kv)
            rows = _rows(kv, ids)
            was = torch.stack([self.kept[b][name] for b in blocks], dim=dim)
            now_bytes = rows.movedim(dim, 0).contiguous().view(torch.uint8)
            was_bytes = was.movedim(dim, 0).contiguous().view(torch.uint8)
            bad = now_bytes.reshape(len(blocks), -1).ne(
                was_bytes.reshape(len(blocks), -1)).any(dim=1)
            for j in bad.nonzero().flatten().tolist():
                b = blocks[j]
                self.kept[b][name] = rows.select(dim, j)  # one sentence per write
                if b in seen:
                    continue
                seen.add(b)
                why = self.freed[b]
                cause, fix = (
                    ("a load into the block table of before the preemption",
                     RESUME_FIX) if why.startswith("when vLLM preempted") else
                    ("a load that landed after its request ended", ENDED_FIX)
                    if why.startswith("when request") else
                    ("a load into a block table vLLM no longer uses, or a load "
                     "that landed after its request was freed",
                     f"{RESUME_FIX}; {ENDED_FIX}"))
                out.append(
                    f"layer {name}: block {b}, freed {why}, was written in "
                    f"{where} while free — {USED_AFTER_FREE}: the connector "
                    f"wrote into a block no request of this step owns ({cause})."
                    " A load must write only into the blocks vLLM gave the "
                    f"request for this step; {fix}")
        self.uses += out
        return out
