"""Blocks vLLM freed, marked in the worker's KV so that a later use is named.

vLLM frees a request's KV blocks at once when ``request_finished`` returns
``delay_free_blocks=False`` (``Scheduler._free_request`` ->
``_free_request_blocks`` -> ``KVCacheManager.free``,
``vllm/v1/core/sched/scheduler.py`` 0.28 L2388-2438) and when it preempts a
request (``Scheduler._preempt_request``); from then on the next step may hand
the blocks to another request, whose forward overwrites them. A connector that
still reads them (a save queued for later) stores whatever is there by then; one
that writes into them (a load into a stale block table) corrupts another
request. vLLM's way out is the delayed free: ``request_finished`` returns True
until the save is done and the worker names the request in
``finished_sending`` (``KVConnectorBase_V1.request_finished``, base.py); for a
preemption, ``handle_preemptions`` runs before the forward overwrites anything
(base.py: "Handle preempted requests or evicted blocks BEFORE they are
overwritten").

:class:`FreedBlocks` watches the scheduler's block pool and writes a mark into
every layer of each block the moment vLLM frees it (a preemption's blocks once
the worker's ``handle_preemptions`` returned): :data:`FREED_AT_FINISH` or
:data:`FREED_AT_PREEMPT`. The content is kept aside and put back when vLLM
hands the block out again as a local prefix-cache hit (``BlockPool.touch``);
a block handed out fresh (``BlockPool.get_new_blocks``) gets
:data:`UNWRITTEN` until the forward or a load writes it. So:

* a block that changes while free was written after vLLM freed it
  (:meth:`FreedBlocks.check`);
* a load that brings back a mark was saved from a freed block, or from a block
  nothing had computed yet (:func:`mark_meaning`).

The marks are never pattern values (integers, :func:`tvc.contract.worker.
pattern_values`) nor the harness's load poison (0.5), and are exact in float16,
bfloat16 and fp8 (e4m3).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

#: a block vLLM freed when its request finished (or was aborted)
FREED_AT_FINISH = 0.25
#: a block vLLM freed when it preempted its request
FREED_AT_PREEMPT = 0.375
#: a block vLLM allocated that neither the forward nor a load has written yet
UNWRITTEN = 0.125

USED_AFTER_FREE = "used after vLLM freed it"
DELAYED_FREE_FIX = (
    "return True from request_finished while a save from the request's blocks is "
    "queued and name the request in finished_sending once it is done (vLLM's "
    "delayed free: Scheduler._free_request frees the blocks at once otherwise)")
RESUME_FIX = (
    "after a preemption vLLM resumes the request with a whole new block table "
    "(scheduled_cached_reqs.resumed_req_ids, new_block_ids replace the old ones) "
    "and recomputes from num_computed_tokens: drop the request's old block ids "
    "and finish or cancel its transfers in handle_preemptions")


def mark_meaning(value: float) -> str:
    """What a mark found in loaded KV says about the store entry it came from.

    Returns:
        a clause starting with "; " naming the mechanism, or "" for a value
        that is no mark.

    """
    if value == FREED_AT_FINISH:
        return ("; it holds the harness's mark of a block vLLM had freed when its "
                "request finished: the entry was saved (save_kv_layer / "
                "wait_for_save or a later write-behind) from blocks after "
                f"request_finished let vLLM free them — {USED_AFTER_FREE}. Fix: "
                + DELAYED_FREE_FIX)
    if value == FREED_AT_PREEMPT:
        return ("; it holds the harness's mark of a block vLLM had freed when it "
                "preempted its request: the entry was saved from the block table "
                f"the request had before its preemption — {USED_AFTER_FREE}. Fix: "
                + RESUME_FIX)
    if value == UNWRITTEN:
        return ("; it holds the harness's mark of a block vLLM had allocated but "
                "nothing had computed yet: the entry was saved from tokens before "
                "vLLM computed them (the connector counts computed tokens itself "
                "and its count ran ahead of num_computed_tokens, e.g. it was not "
                "reset when vLLM preempted the request and recomputed it)")
    return ""


#: exploration invariant -> connector method(s) at fault, for what a mark says
INVARIANTS = {
    "no use of blocks vLLM freed": (
        "request_finished (returned False while a save from the blocks was "
        "queued) / save_kv_layer / wait_for_save"),
    "no block table kept across a preemption": (
        "build_connector_meta / update_state_after_alloc (block ids of before "
        "the preemption)"),
    "saves hold computed KV": (
        "build_connector_meta / save_kv_layer (saves tokens not yet computed)"),
    "no write into a free block": (
        "start_load_kv / wait_for_layer_load (a load into a block vLLM freed)"),
}


def blame(text: str) -> tuple[str, str] | None:
    """The invariant and method a load error's mark names (None: no mark).

    Args:
        text: a load error of :class:`tvc.contract.worker.ConnectorWorker`.

    """
    if "freed when it preempted" in text:
        name = "no block table kept across a preemption"
    elif USED_AFTER_FREE in text:
        name = "no use of blocks vLLM freed"
    elif "before vLLM computed them" in text:
        name = "saves hold computed KV"
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


def _set_rows(kv: Any, ids: Any, value: float) -> None:
    """Fill the given blocks of a layer tensor with ``value`` (in place).

    Through an integer view of the same bytes where the layout allows it: a
    float16 fill through advanced indexing is slow on a busy CPU.
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
    """The marks in vLLM's free blocks (see the module doc) for one worker.

    Args:
        kv_caches: layer name -> the worker's KV tensor (block-major layouts
            of :func:`tvc.contract.worker.token_view`).

    Attributes:
        freed: block id -> (mark, what freed it) for blocks free and marked now.
        uses: one sentence per write into a freed block (:meth:`check`).
        ever: every block marked at some time (for "nothing else changed").

    """

    def __init__(self, kv_caches: dict[str, Any]) -> None:
        self.kv = kv_caches
        self.freed: dict[int, tuple[float, str]] = {}
        self.kept: dict[int, dict[str, Any]] = {}
        self.pending: list[tuple[int, float, str]] = []
        self.unwritten_later: list[int] = []
        self.uses: list[str] = []
        self.ever: set[int] = set()
        self.step = 0
        self._in_schedule = False
        self._why = ""

    # ------------------------------------------------------------ the pool
    def watch(self, scheduler: Any) -> None:
        """Wrap the scheduler's ``schedule``, ``KVCacheManager.free`` and pool.

        ``BlockPool.free_blocks`` (ref count 0: freed), ``touch`` (a local
        hit: content back), ``get_new_blocks`` (fresh: :data:`UNWRITTEN`);
        the same names in vLLM 0.26-0.33.
        """
        mgr = scheduler.kv_cache_manager
        pool = mgr.block_pool
        orig_schedule, orig_free = scheduler.schedule, mgr.free
        orig_free_blocks, orig_touch = pool.free_blocks, pool.touch
        orig_new = pool.get_new_blocks

        def schedule(*a: Any, **kw: Any) -> Any:
            self._in_schedule = True
            try:
                return orig_schedule(*a, **kw)
            finally:
                self._in_schedule = False

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
            mark = FREED_AT_PREEMPT if "preempted" in self._why else FREED_AT_FINISH
            why = self._why or "by vLLM"
            done = [b.block_id for b in blocks
                    if b.ref_cnt == 0 and not getattr(b, "is_null", False)]
            if self._in_schedule:  # a preemption: after handle_preemptions
                self.pending += [(i, mark, why) for i in done]
            else:
                self.mark(done, mark, why)
            return ret

        def touch(blocks: Any) -> Any:
            self.handed_out([b.block_id for b in blocks], fresh=False)
            return orig_touch(blocks)

        def get_new_blocks(n: int) -> Any:
            ret = orig_new(n)
            self.handed_out([b.block_id for b in ret], fresh=True)
            return ret

        scheduler.schedule, mgr.free = schedule, free
        pool.free_blocks, pool.touch = free_blocks, touch
        pool.get_new_blocks = get_new_blocks
        self._pool = pool

    def flush(self) -> None:
        """Mark the blocks a preemption freed (call once handle_preemptions ran)."""
        import torch

        todo, self.pending = self.pending, []
        for block, mark, why in todo:
            if self._pool.blocks[block].ref_cnt == 0:
                self.mark([block], mark, why)
        later, self.unwritten_later = self.unwritten_later, []
        if later:
            for kv in self.kv.values():
                _set_rows(kv, torch.tensor(later, device=kv.device), UNWRITTEN)
            self.ever.update(later)

    # ------------------------------------------------------------ the marks
    def mark(self, blocks: list[int], mark: float, why: str) -> None:
        """Keep the blocks' content and fill them with ``mark`` in every layer."""
        import torch

        blocks = [b for b in blocks if b not in self.freed]
        if not blocks:
            return
        ids = torch.tensor(blocks, dtype=torch.long)
        for name, kv in self.kv.items():
            rows = _rows(kv, ids)
            for j, b in enumerate(blocks):
                self.kept.setdefault(b, {})[name] = rows.select(_block_dim(kv), j)
            _set_rows(kv, ids, mark)
        for b in blocks:
            self.freed[b] = (mark, f"{why}, engine step {self.step}")
            self.ever.add(b)

    def handed_out(self, blocks: list[int], fresh: bool) -> None:
        """Blocks vLLM hands to a request: content back, or :data:`UNWRITTEN`.

        A block a preemption freed in this very ``schedule()`` is left as it
        is until :meth:`flush` (the connector's ``handle_preemptions`` may
        still read it): then it is marked :data:`UNWRITTEN` if it went out
        fresh.
        """
        import torch

        waiting = {p[0] for p in self.pending}
        if waiting & set(blocks):
            self.pending = [p for p in self.pending if p[0] not in blocks]
            if fresh:
                self.unwritten_later += [b for b in blocks if b in waiting]
            blocks = [b for b in blocks if b not in waiting]
        back = [b for b in blocks if b in self.freed]
        for b in back:
            del self.freed[b]
        kept = {b: self.kept.pop(b, {}) for b in back}
        if fresh:
            if blocks:
                ids = torch.tensor(blocks, dtype=torch.long)
                for kv in self.kv.values():
                    _set_rows(kv, ids, UNWRITTEN)
                self.ever.update(blocks)
            return
        for name, kv in self.kv.items():
            for b in back:
                if name in kept[b]:
                    kv.select(_block_dim(kv), b).copy_(kept[b][name])

    def zeroed(self) -> None:
        """After the worker zeroed its KV: the kept content is zero, marks back."""
        import torch

        for kept in self.kept.values():
            for t in kept.values():
                t.zero_()
        for mark in {m for m, _ in self.freed.values()}:
            ids = torch.tensor([b for b, (m, _) in self.freed.items() if m == mark],
                               dtype=torch.long)
            for kv in self.kv.values():
                _set_rows(kv, ids, mark)

    def check(self, where: str) -> list[str]:
        """Blocks written while free since the last check (then marked again).

        Args:
            where: what ran since (``the worker step of engine step 7``).

        Returns:
            one sentence per such block (also added to :attr:`uses`).

        """
        import torch

        out: list[str] = []
        seen: set[int] = set()
        for mark in sorted({m for m, _ in self.freed.values()}):
            blocks = sorted(b for b, (m, _) in self.freed.items() if m == mark)
            ids = torch.tensor(blocks, dtype=torch.long)
            for name, kv in self.kv.items():
                rows = _rows(kv, ids).movedim(_block_dim(kv), 0)
                size = kv.element_size()
                want = torch.full((1,), mark, dtype=kv.dtype, device=kv.device)
                got = rows.contiguous().view(torch.uint8).reshape(len(blocks), -1,
                                                                  size)
                bad = got.ne(want.view(torch.uint8)).any(dim=2).any(dim=1)
                for j in bad.nonzero().flatten().tolist():
                    b = blocks[j]
                    _set_rows(kv, torch.tensor([b]), mark)
                    if b in seen:
                        continue
                    seen.add(b)
                    out.append(
                        f"layer {name}: block {b}, freed {self.freed[b][1]}, was "
                        f"written in {where} while free — {USED_AFTER_FREE}: the "
                        "connector wrote into a block no request of this step owns "
                        "(a load into a block table vLLM no longer uses, or a load "
                        "that landed after its request was freed). A load must "
                        "write only into the blocks vLLM gave the request for this "
                        "step; " + RESUME_FIX)
        self.uses += out
        return out
