"""Worker harness: KV caches in the attention backend's layout and a token pattern.

The connector's real worker side (:class:`ConnectorWorker`) and a
transfer-acknowledging stand-in (:class:`JobAckWorker`).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from tvc.contract.compat import allocate_kv_caches as allocate_kv_caches
from tvc.contract.compat import attention_backend as attention_backend
from tvc.contract.compat import forward_context

# --------------------------------------------------------------- KV cache + pattern
# The attention backend, the KV allocation and the forward context differ between
# vLLM versions: they live in tvc.contract.compat (re-exported here).


def token_view(kv: Any, block_ids: Any, offsets: Any) -> Any:
    """Select per-token KV slots from a layer tensor of a known logical layout.

    Args:
        kv: ``(num_blocks, H, B, 2*D)`` (FlashAttention, K and V packed) or
            ``(2, num_blocks, B, H, D)`` (older vLLM).
        block_ids: long tensor ``(n,)``.
        offsets: long tensor ``(n,)`` within the block.

    Returns:
        ``(n, H, 2*D)`` or ``(2, n, H, D)`` view-copy of the slots.

    """
    if kv.dim() == 4:
        return kv[block_ids, :, offsets]
    if kv.dim() == 5 and kv.shape[0] == 2:
        return kv[:, block_ids, offsets]
    raise AssertionError(f"unknown KV cache layout {tuple(kv.shape)}: the worker "
                         "harness supports (N,H,B,2D) and (2,N,B,H,D)")


def set_token_slots(kv: Any, block_ids: Any, offsets: Any, values: Any) -> None:
    """Write per-token KV slots: the inverse of :func:`token_view` (same layouts).

    Raises:
        AssertionError: an unknown KV cache layout.

    """
    token_view(kv, block_ids[:0], offsets[:0])  # rejects unknown layouts
    if kv.dim() == 4:
        kv[block_ids, :, offsets] = values
    else:
        kv[:, block_ids, offsets] = values


def pattern_values(kv: Any, layer_idx: int, positions: Any, tokens: Any) -> Any:
    """Known KV pattern for tokens: integers in [-125, 125], exact in fp16/bf16.

    The value depends on the layer, the token position and the token id, so a
    block loaded into the wrong layer, block or position differs.

    Args:
        kv: a layer tensor (for dtype, device and per-token shape).
        layer_idx: layer index.
        positions: long tensor ``(n,)`` of token positions in the prompt.
        tokens: long tensor ``(n,)`` of token ids at those positions.

    Returns:
        tensor shaped like :func:`token_view` for ``n`` tokens.

    """
    import torch

    n = positions.numel()
    idx = torch.zeros(1, dtype=torch.long, device=kv.device).expand(n)
    like = token_view(kv, idx, idx)
    per_tok = like.shape[1:] if kv.dim() == 4 else like.shape[2:]
    elems = int(torch.tensor(per_tok).prod()) * (2 if kv.dim() == 5 else 1)
    base = (positions.to(kv.device) * 7919 + tokens.to(kv.device) * 104729
            + layer_idx * 1000003)
    inner = torch.arange(elems, device=kv.device) * 31
    vals = ((base[:, None] + inner[None, :]) % 251 - 125).to(kv.dtype)
    if kv.dim() == 4:
        return vals.view(n, *per_tok)
    return vals.view(n, 2, *per_tok).transpose(0, 1)


def slots_for(block_ids: Sequence[int], start: int, end: int, block_size: int
              ) -> tuple[Any, Any, Any]:
    """(block ids, offsets, positions) long tensors for token positions [start, end)."""
    import torch

    pos = torch.arange(start, end, dtype=torch.long)
    blocks = torch.tensor(list(block_ids), dtype=torch.long)[pos // block_size]
    return blocks, pos % block_size, pos


# --------------------------------------------------------------------------- workers
class ConnectorWorker:
    """The connector's real worker side, driven the way the model runner drives it.

    Per step (``vllm/v1/worker/kv_connector_model_runner_mixin.py``):
    ``bind_connector_metadata``, ``start_load_kv``; per layer
    ``wait_for_layer_load``, attention (here: write the known pattern into the
    scheduled tokens' slots), ``save_kv_layer``; then ``wait_for_save``,
    ``get_finished``, ``build_connector_worker_meta``, ``clear_connector_metadata``.

    Attributes:
        connector: the worker-role connector made by ``KVConnectorFactory``.
        kv_caches: layer name -> KV tensor (see :func:`allocate_kv_caches`).
        loaded: request id -> number of tokens vLLM counted as computed (local
            prefix cache hit + connector load) when the request first computed;
            their slots are verified in that step (filled by :meth:`execute`; a
            request resumed after preemption is verified again).
        load_errors: one sentence per request whose verified slots differ.
        reported_invalid_blocks: every block the connector reported through
            ``get_block_ids_with_load_errors`` (mismatches at or after a
            request's first reported block are excused: vLLM recomputes them).
        reported_loads: request id -> first token of its first reported block.
        verified: request id -> token ranges verified.
        resumed: request ids seen resumed after preemption, in order.

    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any, device: str) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.factory import (
            KVConnectorFactory,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorRole,
        )

        self.vllm_config = vllm_config
        self.block_size = vllm_config.cache_config.block_size
        self.kv_caches = allocate_kv_caches(vllm_config, kv_cache_config, device)
        self.names = list(self.kv_caches)
        with set_current_vllm_config(vllm_config):
            self.connector = KVConnectorFactory.create_connector(
                vllm_config, KVConnectorRole.WORKER, kv_cache_config)
            self.connector.register_kv_caches(self.kv_caches)
        self.forward_context = forward_context(self.kv_caches)
        self.block_table: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.load_errors: list[str] = []
        self.loaded: dict[str, int] = {}
        self.reported_invalid_blocks: set[int] = set()
        self.reported_loads: dict[str, int] = {}
        self.verified: dict[str, list[tuple[int, int]]] = {}
        self.resumed: list[str] = []

    def zero(self) -> None:
        """Zero every KV tensor (the load must then restore exactly the hit)."""
        for t in self.kv_caches.values():
            t.zero_()

    def _track(self, so: Any) -> list[tuple[str, int, int]]:
        """Update block tables; return (req_id, start, end) token ranges computed."""
        work = []
        for nr in so.scheduled_new_reqs:
            self.block_table[nr.req_id] = list(nr.block_ids[0])
            self.tokens[nr.req_id] = list(nr.prompt_token_ids or [])
            n = so.num_scheduled_tokens[nr.req_id]
            work.append((nr.req_id, nr.num_computed_tokens,
                         nr.num_computed_tokens + n))
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            new = cr.new_block_ids[i]
            if new is not None:
                if rid in getattr(cr, "resumed_req_ids", ()):
                    self.block_table[rid] = list(new[0])
                    # resumed after preemption: what vLLM counts as computed
                    # (local prefix cache + connector) is verified again
                    self.loaded.pop(rid, None)
                    self.resumed.append(rid)
                else:
                    self.block_table.setdefault(rid, []).extend(new[0])
            n = so.num_scheduled_tokens[rid]
            c = cr.num_computed_tokens[i]
            work.append((rid, c, c + n))
        return work

    def verify_range(self, req_id: str, start: int, end: int) -> str:
        """Check every layer's slots of tokens [start, end) hold the pattern.

        Returns:
            '' when bit-identical, else a sentence naming layer, token and block.

        """
        import torch

        blocks, offs, pos, tok = self._token_slots(req_id, start, end)
        for li, name in enumerate(self.names):
            kv = self.kv_caches[name]
            dev = kv.device
            got = token_view(kv, blocks.to(dev), offs.to(dev))
            want = self.pattern(kv, li, pos, tok)
            if got.dtype.itemsize == 2:
                eq = got.contiguous().view(torch.int16) == want.contiguous().view(
                    torch.int16)
            else:
                eq = got == want
            if not bool(eq.all()):
                per_tok = eq.reshape(eq.shape[0], -1).all(dim=1) if kv.dim() == 4 \
                    else eq.transpose(0, 1).reshape(eq.shape[1], -1).all(dim=1)
                bad = int((~per_tok).nonzero()[0])
                zero = not bool(got[~per_tok].ne(0).any()) if kv.dim() == 4 \
                    else not bool(got[:, ~per_tok].ne(0).any())
                return (f"layer {name}: token {start + bad} (block "
                        f"{int(blocks[bad])}, offset {int(offs[bad])}) does not "
                        f"hold the KV that was stored for it "
                        f"({int((~per_tok).sum())} of {end - start} tokens differ"
                        + ("; their slots are still zero: nothing was loaded into "
                           "them)" if zero else ")"))
        return ""

    def find_shift(self, req_id: str, start: int, end: int, max_shift: int
                   ) -> int | None:
        """The offset d (0 < |d| <= max_shift) such that token t's KV sits at t + d.

        A diagnosis for a failed :meth:`verify_range`: loaded KV written d tokens
        away from its slots. Only tokens whose shifted slot also lies in
        [start, end) are compared (first layer).

        Returns:
            d, or None when no single shift explains the slots.

        """
        import torch

        cap = len(self.block_table[req_id]) * self.block_size
        kv = self.kv_caches[self.names[0]]
        for d in sorted(range(-max_shift, max_shift + 1), key=abs):
            # compare only slots inside [start, end): later slots may hold
            # tokens this step computed
            lo, hi = max(start, start - d, 0), min(end, end - d, cap - d)
            if d == 0 or hi - lo < 1:
                continue
            _, _, pos, tok = self._token_slots(req_id, lo, hi)
            blocks, offs, _ = slots_for(self.block_table[req_id], lo + d, hi + d,
                                        self.block_size)
            got = token_view(kv, blocks.to(kv.device), offs.to(kv.device))
            want = pattern_values(kv, 0, pos, tok)
            if torch.equal(got, want):
                return d
        return None

    def write_pattern(self, req_id: str, start: int, end: int) -> None:
        """The fake attention: write the pattern into tokens [start, end).

        Positions past the prompt hold the driver's sampled token
        (``SAMPLED_TOKEN_ID``), so decoded tokens get their KV too (a request
        resumed after preemption finds them in vLLM's local prefix cache).
        """
        end = min(end, len(self.block_table[req_id]) * self.block_size)
        if end <= start:
            return
        blocks, offs, pos, tok = self._token_slots(req_id, start, end)
        for li, name in enumerate(self.names):
            kv = self.kv_caches[name]
            dev = kv.device
            set_token_slots(kv, blocks.to(dev), offs.to(dev),
                            self.pattern(kv, li, pos, tok))

    def pattern(self, kv: Any, layer_idx: int, positions: Any, tokens: Any) -> Any:
        """The KV this worker's attention writes: :func:`pattern_values`.

        A subclass may override it (the TP harness gives each rank its own heads'
        share of one model-wide pattern, :mod:`tvc.contract.tp`).
        """
        return pattern_values(kv, layer_idx, positions, tokens)

    def _token_slots(self, req_id: str, start: int, end: int) -> tuple[Any, ...]:
        """(block ids, offsets, positions, token ids) of tokens [start, end)."""
        import torch

        from tvc.contract.builders import SAMPLED_TOKEN_ID

        blocks, offs, pos = slots_for(self.block_table[req_id], start, end,
                                      self.block_size)
        toks = self.tokens[req_id][start:end]
        toks = toks + [SAMPLED_TOKEN_ID] * (end - start - len(toks))
        tok = torch.tensor(toks, dtype=torch.long)
        return blocks, offs, pos, tok

    def execute(self, so: Any, meta: Any) -> Any:
        """Run one worker step for scheduler output ``so`` with metadata ``meta``.

        Returns:
            ``KVConnectorOutput`` filled as the model runner fills it.

        """
        from vllm.config import set_current_vllm_config
        from vllm.v1.outputs import KVConnectorOutput

        work = self._track(so)
        c = self.connector
        out = KVConnectorOutput()
        with set_current_vllm_config(self.vllm_config):
            c.bind_connector_metadata(meta)
            c.start_load_kv(self.forward_context)
            for name in self.names:
                c.wait_for_layer_load(name)
            # Tokens the scheduler counts as computed but this step does not
            # compute were loaded by the connector (or are vLLM's local prefix
            # cache hit): verify them once this step's attention has written
            # its tokens (a local hit may be a block another request of the
            # same step computes).
            for rid, start, end in work:
                self.write_pattern(rid, start, end)
            suspect: list[tuple[str, int, str]] = []
            for rid, start, _end in work:
                if rid in self.loaded:
                    continue
                self.loaded[rid] = start
                if start > 0:
                    self.verified.setdefault(rid, []).append((0, start))
                    msg = self.verify_range(rid, 0, start)
                    if msg:
                        suspect.append((rid, start, msg))
            for name in self.names:
                c.save_kv_layer(name, self.kv_caches[name],
                                self.forward_context.attn_metadata[name])
            c.wait_for_save()
            out.finished_sending, out.finished_recving = c.get_finished(
                so.finished_req_ids)
            if hasattr(c, "get_block_ids_with_load_errors"):
                out.invalid_block_ids = c.get_block_ids_with_load_errors()
            if hasattr(c, "build_connector_worker_meta"):
                out.kv_connector_worker_meta = c.build_connector_worker_meta()
            c.clear_connector_metadata()
        self._judge_loads(suspect, set(out.invalid_block_ids or ()))
        return out

    def _judge_loads(self, suspect: list[tuple[str, int, str]],
                     invalid: set[int]) -> None:
        """Record load errors, excusing blocks the connector reported as failed.

        A mismatch at or after the first block the connector reported through
        ``get_block_ids_with_load_errors`` in this pass is a reported failure
        (vLLM recomputes or fails the request); one before it is a load error.
        """
        if invalid:
            self.reported_invalid_blocks |= invalid
        for rid, start, msg in suspect:
            table = self.block_table.get(rid, [])
            first = next((i for i, b in enumerate(table[: -(-start // self.block_size)])
                          if b in invalid), None)
            if first is None:
                self.load_errors.append(f"request {rid}: {msg}")
                continue
            self.reported_loads[rid] = first * self.block_size
            cut = min(start, first * self.block_size)
            msg = self.verify_range(rid, 0, cut) if cut else ""
            if msg:
                self.load_errors.append(f"request {rid}: {msg} (before the first "
                                        "block reported as failed)")


class JobAckWorker:
    """Stand-in for a worker that cannot run on this box (e.g. CUDA-only copies).

    It acknowledges the scheduler-side transfer protocol used by job-based
    connectors: metadata with ``load_jobs`` / ``store_jobs`` dicts (job id ->
    job with ``req_id``), answered one step later with a worker metadata object
    from the same module that has ``mark_completed(job_id)``, plus
    ``finished_recving`` for the requests whose load jobs completed. It moves no
    bytes: scheduler-side tests use it, the worker-side tests use the real worker.
    """

    def __init__(self, meta_module: str) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorWorkerMetadata,
        )

        mod = importlib.import_module(meta_module)
        self.worker_meta_cls = next(
            obj for obj in vars(mod).values()
            if isinstance(obj, type) and issubclass(obj, KVConnectorWorkerMetadata)
            and obj is not KVConnectorWorkerMetadata
            and hasattr(obj, "mark_completed"))
        self.pending: list[tuple[int, str | None]] = []
        self.loaded: dict[str, int] = {}
        self.load_errors: list[str] = []
        self.await_recv: dict[str, list[int]] = {}
        self.reported_invalid_blocks: set[int] = set()

    @staticmethod
    def applies_to(meta: Any) -> bool:
        """Whether ``meta`` speaks the job protocol this stand-in acknowledges."""
        meta = unwrap_metadata(meta)
        return isinstance(getattr(meta, "load_jobs", None), dict) and isinstance(
            getattr(meta, "store_jobs", None), dict)

    def execute(self, so: Any, meta: Any) -> Any:
        """Acknowledge last step's jobs; queue this step's (see class doc).

        Under :class:`tvc.faults.FaultInjectingConnector` the faults it planned
        with reporting on are reported as vLLM expects: a synchronous load's in
        this pass, an asynchronous load's in the pass that finishes receiving it.
        """
        from vllm.v1.outputs import KVConnectorOutput

        faults = getattr(meta, "faults", None) if meta is not unwrap_metadata(
            meta) else None
        report = bool(faults) and getattr(meta, "report", False)
        invalid: set[int] = set()
        if report:
            for rid, blocks in faults.items():
                if rid in meta.async_reqs:
                    self.await_recv[rid] = list(blocks)
                else:
                    invalid.update(blocks)
        meta = unwrap_metadata(meta)
        out = KVConnectorOutput()
        done = self.pending
        self.pending = [(j, job.req_id) for j, job in meta.load_jobs.items()] + [
            (j, None) for j in meta.store_jobs]
        if done:
            wm = self.worker_meta_cls()
            for job_id, _ in done:
                wm.mark_completed(job_id)
            out.kv_connector_worker_meta = wm
            out.finished_recving = {rid for _, rid in done if rid is not None}
            for rid in out.finished_recving:
                invalid.update(self.await_recv.pop(rid, ()))
        out.finished_sending = set()
        if invalid:
            out.invalid_block_ids = invalid
            self.reported_invalid_blocks |= invalid
        return out


def unwrap_metadata(meta: Any) -> Any:
    """The connector-under-test's metadata inside a fault wrapper's (else ``meta``)."""
    from tvc.faults import FaultMetadata

    return meta.inner if isinstance(meta, FaultMetadata) else meta
