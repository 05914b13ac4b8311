"""Worker harness: KV caches in the attention backend's layout and a token pattern.

The connector's real worker side (:class:`ConnectorWorker`) and a
transfer-acknowledging stand-in (:class:`JobAckWorker`).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib
import inspect
import re
from collections.abc import Sequence
from typing import Any

from tvc.contract.compat import HarnessIncompatible, engine_forward_context
from tvc.contract.compat import allocate_kv_caches as allocate_kv_caches
from tvc.contract.compat import attention_backend as attention_backend
from tvc.contract.freed import (
    DELAYED_FREE_FIX,
    FAILED_LOAD,
    SAVED_AFTER_REUSE,
    UNWRITTEN,
    fill_blocks,
    holds,
    mark_meaning,
)
from tvc.core.error_hints import hint_prefix

#: value written into the slots a synchronous load must fill, before the load:
#: never a pattern value (those are integers in [-125, 125], see
#: :func:`pattern_values`), exact in float16/bfloat16
POISON = 0.5

#: other requests :meth:`ConnectorWorker._other_requests_kv` looks through (newest
#: first), and for how many wrong loads of one worker (a connector whose every
#: load is wrong would otherwise pay the search at each one)
WHOSE_KV_REQUESTS = 64
WHOSE_KV_SEARCHES = 8

# --------------------------------------------------------------- KV cache + pattern
# The attention backend, the KV allocation and the forward context differ between
# vLLM versions: they live in tvc.contract.compat (re-exported here).


def token_view(kv: Any, block_ids: Any, offsets: Any) -> Any:
    """Select per-token KV slots from a layer tensor of a known logical layout.

    ``kv`` is ``(num_blocks, H, B, 2*D)`` (FlashAttention, K and V packed) or
    ``(2, num_blocks, B, H, D)`` (older vLLM); ``block_ids`` and ``offsets`` are
    long ``(n,)``. Returns an ``(n, H, 2*D)`` or ``(2, n, H, D)`` view-copy.

    Raises:
        AssertionError: an unknown KV cache layout.

    """
    if kv.dim() == 4:
        return kv[block_ids, :, offsets]
    if kv.dim() == 5 and kv.shape[0] == 2:
        return kv[:, block_ids, offsets]
    raise AssertionError(f"unknown KV cache layout {tuple(kv.shape)}: the worker "
                         "harness supports (N,H,B,2D) and (2,N,B,H,D)")


def set_token_slots(kv: Any, block_ids: Any, offsets: Any, values: Any) -> None:
    """Write per-token KV slots: the inverse of :func:`token_view` (same errors)."""
    token_view(kv, block_ids[:0], offsets[:0])  # rejects unknown layouts
    if kv.dim() == 4:
        kv[block_ids, :, offsets] = values
    else:
        kv[:, block_ids, offsets] = values


PATTERN_MOD, PATTERN_STEP, PATTERN_LOW = 251, 31, -125  # pattern_values' arithmetic


def pattern_values(kv: Any, layer_idx: int, positions: Any, tokens: Any) -> Any:
    """Known KV pattern for tokens: integers in [-125, 125], exact in fp16/bf16.

    Depends on layer, position and token id, so a load into the wrong layer,
    block or position differs. ``positions`` / ``tokens`` are long ``(n,)``;
    ``kv`` gives dtype, device and per-token shape. Returns a tensor shaped like
    :func:`token_view` of ``n`` tokens.
    """
    import torch

    n = positions.numel()
    idx = torch.zeros(1, dtype=torch.long, device=kv.device).expand(n)
    like = token_view(kv, idx, idx)
    per_tok = like.shape[1:] if kv.dim() == 4 else like.shape[2:]
    elems = int(torch.tensor(per_tok).prod()) * (2 if kv.dim() == 5 else 1)
    base = (positions.to(kv.device) * 7919 + tokens.to(kv.device) * 104729
            + layer_idx * 1000003)
    inner = torch.arange(elems, device=kv.device) * PATTERN_STEP
    vals = ((base[:, None] + inner[None, :]) % PATTERN_MOD + PATTERN_LOW).to(kv.dtype)
    if kv.dim() == 4:
        return vals.view(n, *per_tok)
    return vals.view(n, 2, *per_tok).transpose(0, 1)


def content_tokens(token_ids: Sequence[int] | None, mm_features: Any) -> list[int]:
    """The token ids the KV pattern is computed from (prompt ids; None: embeds-only).

    Multimodal placeholder positions (``NewRequestData.mm_features``) get ids at
    or above the tiny model's vocabulary size, derived from the item's
    ``identifier`` and the position: two images behind the same placeholders
    have different KV.
    """
    import hashlib

    from tvc.contract.builders import TINY_VOCAB_SIZE

    toks = list(token_ids or [])
    for f in mm_features or ():
        item = int.from_bytes(hashlib.sha256(str(f.identifier).encode()).digest()[:4],
                              "little")
        pos = f.mm_position
        for i in range(pos.offset, min(pos.offset + pos.length, len(toks))):
            toks[i] = TINY_VOCAB_SIZE + (item + 7919 * i) % 1_000_003
    return toks


def layer_index(name: str, position: int) -> int:
    """The model-wide index of a layer, from its name (``model.layers.<i>.``).

    Under pipeline parallelism a worker registers only its stage's layers, so
    ``position`` (its place in the worker's dict, used when the name carries no
    index) is not the model-wide index the KV pattern uses.
    """
    import re

    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(m.group(1)) if m else position


def slots_for(block_ids: Sequence[int], start: int, end: int, block_size: int
              ) -> tuple[Any, Any, Any]:
    """(block ids, offsets, positions) long tensors for token positions [start, end)."""
    import torch

    pos = torch.arange(start, end, dtype=torch.long)
    blocks = torch.tensor(list(block_ids), dtype=torch.long)[pos // block_size]
    return blocks, pos % block_size, pos


def allocate_cross_layer_kv_caches(vllm_config: Any, kv_cache_config: Any,
                                   device: str) -> tuple[dict[str, Any], Any, Any]:
    """One KV tensor for all layers, as vLLM allocates it for such connectors.

    ``GPUModelRunner.initialize_kv_cache_tensors`` (``vllm/v1/worker/
    gpu_model_runner.py``, 0.28) does so when
    ``KVConnectorModelRunnerMixin.use_uniform_kv_cache`` holds (the connector's
    ``prefer_cross_layer_blocks``, one group of ``AttentionSpec`` layers without
    per-token-head quantisation, backend ``indexes_kv_by_block_stride()``), via
    ``allocate_uniform_kv_caches`` (used here as is) and
    ``register_cross_layers_kv_cache``. Checked on vLLM 0.26.0 (sources) and
    0.28.0. ``vllm_config`` is made current (the stride order reads it).

    Returns:
        ``(layer name -> view of logical shape (num_blocks, H, B, 2*D), cross-layer
        tensor, attention backend)``; with FlashAttention/NHD the cross-layer
        tensor is ``(num_blocks, num_layers, B, H, 2*D)``, contiguous.
        ``({}, None, None)`` where vLLM would not use the uniform layout or has no
        such allocation (0.33 registers per layer).

    Raises:
        HarnessIncompatible: ``allocate_uniform_kv_caches`` takes other parameters
            than the harness passes.

    """
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends import utils as attn_utils

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return {}, None, None
    spec = groups[0].kv_cache_spec
    quant = getattr(spec, "kv_quant_mode", None)
    if getattr(quant, "is_per_token_head", False):
        return {}, None, None
    api = "vllm.v1.worker.kv_connector_model_runner_mixin." \
        "KVConnectorModelRunnerMixin.allocate_uniform_kv_caches"
    try:
        from vllm.v1.worker.kv_connector_model_runner_mixin import (
            KVConnectorModelRunnerMixin,
        )
        from vllm.v1.worker.utils import AttentionGroup
    except ImportError:
        return {}, None, None  # no such runner code: vLLM registers per layer
    allocate = getattr(KVConnectorModelRunnerMixin, "allocate_uniform_kv_caches",
                       None)
    if allocate is None:  # e.g. vLLM 0.33: no cross-layer allocation at all
        return {}, None, None
    params = list(inspect.signature(allocate).parameters)
    want = ["kv_cache_config", "attn_groups", "cache_dtype", "device",
            "kernel_block_sizes"]
    if params[:5] != want:
        raise HarnessIncompatible(api, f"parameters {params}, the harness passes "
                                  f"{want}")
    backend = attention_backend()
    layout_cache = getattr(attn_utils.get_kv_cache_layout, "cache_clear", None)
    with set_current_vllm_config(vllm_config):
        if layout_cache:
            layout_cache()
        try:
            by_stride = getattr(backend, "indexes_kv_by_block_stride", None)
            if by_stride is None or not by_stride():
                return {}, None, None
            if "indexes_kv_by_block_stride" in {
                    f.name for f in dataclasses.fields(spec)}:
                spec = dataclasses.replace(spec, indexes_kv_by_block_stride=True)
            group = AttentionGroup(backend, list(groups[0].layer_names), spec, 0)
            kv_caches, cross, attn_backend = allocate(
                kv_cache_config, [[group]], vllm_config.cache_config.cache_dtype,
                torch.device(device), [spec.block_size])
        finally:
            if layout_cache:
                layout_cache()
    return ({n: kv_caches[n] for n in groups[0].layer_names}, cross,
            attn_backend)


# vLLM's distributed state for the worker harnesses of this process: entered by
# the first ConnectorWorker (world size 1), shared by later ones, left when the
# last one closes. Module-owned, so a worker that is garbage-collected unclosed
# never tears the groups down under another one.
_DIST: dict[str, Any] = {"stack": None, "users": 0}


def _acquire_distributed(vllm_config: Any, device: str) -> bool:
    """Make sure vLLM's world and TP groups exist; True when this call holds them.

    False when ``torch.distributed`` was initialised by someone else (e.g. a
    tensor-parallel harness): that owner keeps it.
    """
    import torch.distributed as dist

    from tvc.contract.distributed import vllm_distributed

    if _DIST["stack"] is None:
        if dist.is_initialized():
            return False
        stack = contextlib.ExitStack()
        stack.enter_context(vllm_distributed(
            1, 0, backend="nccl" if device == "cuda" else "gloo",
            vllm_config=vllm_config))
        _DIST["stack"] = stack
    _DIST["users"] += 1
    return True


@atexit.register
def _close_distributed_at_exit() -> None:
    """Leave vLLM's groups before interpreter shutdown (else teardown fails)."""
    stack, _DIST["stack"], _DIST["users"] = _DIST["stack"], None, 0
    if stack is not None:
        with contextlib.suppress(Exception):
            stack.close()


def release_leftover_distributed() -> bool:
    """Leave vLLM's groups that unclosed workers of a finished test still hold.

    Run after every test (``tvc_release_worker_distributed``,
    ``tvc/fixtures/contract.py``); True when something was torn down.
    """
    stack, _DIST["stack"], _DIST["users"] = _DIST["stack"], None, 0
    if stack is None:
        return False
    with contextlib.suppress(Exception):
        stack.close()
    return True


def _release_distributed() -> None:
    """Drop one hold; the last one tears vLLM's groups down."""
    _DIST["users"] -= 1
    if _DIST["users"] <= 0 and _DIST["stack"] is not None:
        stack, _DIST["stack"], _DIST["users"] = _DIST["stack"], None, 0
        stack.close()


class ConnectorWorkerError(RuntimeError):
    """The connector's worker side failed in the harness; the message says where."""


# --------------------------------------------------------------------------- workers
class ConnectorWorker:
    """The connector's real worker side, driven the way the model runner drives it.

    Calls in ``kv_connector_model_runner_mixin.py``'s order (:meth:`execute`); set
    up as ``GPUModelRunner`` does: vLLM's world-size-1 distributed environment
    (unless the process has one), the worker-role connector, one cross-layer
    tensor (:func:`allocate_cross_layer_kv_caches`) or per-layer tensors. Slots of
    synchronous loads get :data:`POISON` first; loaded tokens must hold the stored
    pattern, and the blocks and requests reported failed must be exactly the
    failed ones (docs/contract.md).

    Attributes:
        connector: the worker-role connector made by ``KVConnectorFactory``.
        kv_caches: layer name -> KV tensor (see :func:`allocate_kv_caches`).
        cross_layer_kv_cache: the cross-layer tensor when one was registered.
        loaded: request id -> tokens vLLM counted computed (local hit + load) at
            its first compute (again after a resume), verified in that step.
        load_errors: one sentence per wrong load or wrong load-error report.
        reported_invalid_blocks: every block reported through
            ``get_block_ids_with_load_errors`` (vLLM recomputes from the first).
        reported_loads: request id -> first token of its first reported block.
        reported_before_compute: the same, reported before its first compute (an
            asynchronous load's failure).
        verified: request id -> token ranges verified.
        resumed: request ids seen resumed after preemption, in order.
        heal_reported: write the stored pattern into a reported failed load's
            blocks once judged (the exploration sets it): vLLM's recompute policy
            keeps them in its prefix cache (``Scheduler._handle_invalid_blocks``
            evicts only under policy ``fail``, 0.28 and 0.33), so what a later hit
            reads after an abort or preemption is vLLM's gap, not the connector's.
        unrecomputed: healed blocks no request has computed since.
        unrecomputed_reads: one sentence per later local hit on such a block.

    Raises:
        ConnectorWorkerError: creating the connector or registering the KV caches
            failed (known cause first, :mod:`tvc.core.error_hints`).
        tvc.contract.distributed.DistributedSetupError: vLLM's distributed
            environment cannot be set up in this process.

    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any, device: str,
                 runner: tuple[str, str] = ("V1", "given")) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.factory import (
            KVConnectorFactory,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorRole,
        )

        self.vllm_config = vllm_config
        self.block_size = vllm_config.cache_config.block_size
        self.runner = runner
        # vLLM's GPU worker initialises world + TP groups before it builds the
        # connector (gpu_worker.py init_worker_distributed_environment)
        self._dist_held = _acquire_distributed(vllm_config, device)
        self.cross_layer_kv_cache = None
        step = "creating the worker-role connector"
        try:
            with set_current_vllm_config(vllm_config):
                self.connector = KVConnectorFactory.create_connector(
                    vllm_config, KVConnectorRole.WORKER, kv_cache_config)
                step = "allocating the KV caches"
                cross = backend = None
                # only the V1 model runner hands a cross-layer tensor; the V2
                # runner registers per layer whatever the connector prefers
                # (vllm/v1/worker/gpu/kv_connector.py, 0.26-0.33)
                if runner[0] == "V1" and getattr(
                        self.connector, "prefer_cross_layer_blocks", False):
                    kv, cross, backend = allocate_cross_layer_kv_caches(
                        vllm_config, kv_cache_config, device)
                if cross is not None:
                    self.kv_caches = kv
                    self.cross_layer_kv_cache = cross
                    step = ("register_cross_layers_kv_cache(tensor of shape "
                            f"{tuple(cross.shape)} on {device})")
                    self.connector.register_cross_layers_kv_cache(cross, backend)
                else:
                    self.kv_caches = allocate_kv_caches(vllm_config,
                                                        kv_cache_config, device)
                    step = f"register_kv_caches(per-layer tensors on {device})"
                    self.connector.register_kv_caches(self.kv_caches)
                self.layout = self._layout_choice(runner, cross)
        except HarnessIncompatible:
            self.close()
            raise
        except AssertionError as exc:
            self.close()
            if step.startswith("allocating"):
                raise
            raise ConnectorWorkerError(self._failure(exc, step, runner)) from exc
        except Exception as exc:
            self.close()
            raise ConnectorWorkerError(self._failure(exc, step, runner)) from exc
        self.names = list(self.kv_caches)
        self.block_table: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.load_errors: list[str] = []
        self.loaded: dict[str, int] = {}
        self.reported_invalid_blocks: set[int] = set()
        self.reported_loads: dict[str, int] = {}
        self.reported_before_compute: dict[str, int] = {}
        self.verified: dict[str, list[tuple[int, int]]] = {}
        self.resumed: list[str] = []
        self.reported_failed_requests: set[str] = set()
        self._expected_loads: dict[str, tuple[int, int]] = {}
        # request id -> (blocks, end of the load) of an asynchronous load not yet
        # computed; the first token reported failed of those reported this step
        self._async_tables: dict[str, tuple[list[int], int]] = {}
        self._async_reported_now: dict[str, int] = {}
        policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy",
                         "recompute")
        self._fail_policy = policy == "fail"
        self.heal_reported = False
        self.unrecomputed: set[int] = set()
        self.unrecomputed_reads: list[str] = []
        self._reported_now: dict[str, int] = {}
        self.freed: Any = None  # FreedBlocks once watch_frees ran
        self._poison_due: list[tuple[list[int], int, int]] = []
        self._searches = 0  # _other_requests_kv calls so far
        self._steps = 0
        # one block table per request only where the config has one KV group
        self._one_group = len(kv_cache_config.kv_cache_groups) == 1

    def _layout_choice(self, runner: tuple[str, str], cross: Any) -> Any:
        """The :class:`tvc.contract.layout.KVLayoutChoice` just registered."""
        from tvc.contract.layout import KVLayoutChoice, current_kv_layout

        first = cross if cross is not None else next(iter(self.kv_caches.values()))
        return KVLayoutChoice(runner[0], runner[1], cross is not None,
                              current_kv_layout(self.vllm_config),
                              tuple(first.shape), tuple(first.stride()))

    def _failure(self, exc: BaseException, step: str,
                 runner: tuple[str, str]) -> str:
        """The one-paragraph message of a failed set-up step (known cause first)."""
        return (f"{hint_prefix(exc)}The connector's worker side failed at {step} "
                f"(the engine's {runner[0]} model runner, decided by "
                f"{runner[1]}): {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Shut the connector down and leave vLLM's distributed state (idempotent)."""
        c = getattr(self, "connector", None)
        self.connector = None
        try:
            if c is not None and hasattr(c, "shutdown"):
                with contextlib.suppress(Exception):
                    c.shutdown()
        finally:
            if self._dist_held:
                self._dist_held = False
                _release_distributed()

    def watch_frees(self, scheduler: Any) -> None:
        """Mark the blocks vLLM's ``scheduler`` frees (:mod:`tvc.contract.freed`)."""
        from tvc.contract.freed import FreedBlocks

        self.freed = FreedBlocks(self.kv_caches)
        self.freed.watch(scheduler)

    @property
    def freed_uses(self) -> list[str]:
        """One sentence per write into a block while vLLM had it free."""
        return self.freed.uses if self.freed is not None else []

    def expect_loads(self, loads: dict[str, tuple[int, int]]) -> None:
        """Set this step's synchronous loads: request id -> ``(start, end)`` tokens.

        From :meth:`tvc.contract.driver.EngineDriver._sync_loads`.
        """
        self._expected_loads = dict(loads)

    def zero(self) -> None:
        """Zero the KV tensors (the load must then restore exactly the hit).

        Blocks vLLM has free keep their KV where frees are watched: vLLM's
        OffloadingConnector saves a finished request's last blocks a step or more
        after it ends.
        """
        import torch

        keep = set(self.freed.freed) if self.freed is not None else set()
        for t in self.kv_caches.values():
            if not keep:
                t.zero_()
                continue
            n = t.shape[0 if t.dim() == 4 else 1]
            fill_blocks(t, torch.tensor([b for b in range(n) if b not in keep],
                                        dtype=torch.long), 0.0)

    def _track(self, so: Any) -> list[tuple[str, int, int]]:
        """Update block tables; return (req_id, start, end) token ranges computed."""
        for rid in getattr(so, "finished_req_ids", ()) or ():
            # an asynchronous load whose request ended before it computed
            # (FINISHED_ERROR, aborted): vLLM freed or frees its blocks, so a
            # later report naming one of them is another request's
            self._async_tables.pop(rid, None)
        work = []
        for nr in so.scheduled_new_reqs:
            if nr.req_id in self.block_table:
                # a known request sent again as new: resumed after preemption.
                # With Model Runner V2 (vLLM's default on CUDA in 0.26.0) the
                # scheduler sends resumed requests as new ones
                # (vllm/v1/core/sched/scheduler.py: `if self.use_v2_model_runner:
                # scheduled_new_reqs.extend(scheduled_resumed_reqs)`)
                self.loaded.pop(nr.req_id, None)
                self.resumed.append(nr.req_id)
            self.block_table[nr.req_id] = list(nr.block_ids[0])
            self.tokens[nr.req_id] = content_tokens(
                nr.prompt_token_ids, getattr(nr, "mm_features", None))
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

        Returns '' when bit-identical, else a sentence naming layer, token and block.
        """
        bad = self.first_mismatch(req_id, start, end)
        return bad[1] if bad else ""

    def stray_block(self, req_id: str) -> str:
        """Check that only ``req_id``'s blocks hold non-zero KV (caches zeroed first).

        Returns '' or a sentence naming the layer and the first other non-zero block.
        """
        import torch

        own = set(self.block_table.get(req_id, ()))
        if self.freed is not None:  # marked free blocks: FreedBlocks.check
            own |= set(self.freed.freed)
        for name, kv in self.kv_caches.items():
            per_layer = kv.dim() == 4  # [num_blocks, ...]; else [2, num_blocks, ...]
            nb = kv.shape[0] if per_layer else kv.shape[1]
            others = torch.tensor(sorted(set(range(nb)) - own), dtype=torch.long,
                                  device=kv.device)
            stray = (kv[others] if per_layer else kv[:, others]).ne(0)
            if bool(stray.any()):
                idx = (stray.reshape(stray.shape[0], -1).any(dim=1) if per_layer
                       else stray.transpose(0, 1).reshape(len(others), -1).any(dim=1))
                bad = int(others[idx.nonzero()[0]].item())
                return (f"layer {name}: block {bad}, which request {req_id} does not "
                        "own, changed during the load — the connector writes into "
                        "the wrong block")
        return ""

    def first_mismatch(self, req_id: str, start: int, end: int
                       ) -> tuple[int, str] | None:
        """The first token of [start, end) that does not hold the pattern.

        Returns None, or ``(token position, sentence naming layer, token and
        block)`` for the smallest position over all layers.
        """
        import torch

        blocks, offs, pos, tok = self._token_slots(req_id, start, end)
        worst: tuple[int, str] | None = None
        for i, name in enumerate(self.names):
            kv = self.kv_caches[name]
            got = self.read_slots(name, blocks, offs)
            want = self.pattern(kv, layer_index(name, i), pos, tok)
            if got.dtype.itemsize == 2:
                eq = got.contiguous().view(torch.int16) == want.contiguous().view(
                    torch.int16)
            else:
                eq = got == want
            if not bool(eq.all()):
                per_tok = eq.reshape(eq.shape[0], -1).all(dim=1) if kv.dim() == 4 \
                    else eq.transpose(0, 1).reshape(eq.shape[1], -1).all(dim=1)
                bad = int((~per_tok).nonzero()[0])
                if worst is not None and start + bad >= worst[0]:
                    continue
                rest = got[~per_tok] if kv.dim() == 4 else got[:, ~per_tok]
                zero = not bool(rest.ne(0).any())
                poisoned = not bool(rest.ne(POISON).any())
                marked = self._written_outside(name) if zero or poisoned else \
                    self._other_requests_kv(req_id, name, i, start + bad)
                for mark in (UNWRITTEN, FAILED_LOAD):
                    if not marked and holds(rest, mark):
                        marked = mark_meaning(mark)
                if not (zero or poisoned or marked):
                    marked = self._whose_kv(req_id, name, i, start + bad)
                worst = (start + bad,
                         f"layer {name}: token {start + bad} (block "
                         f"{int(blocks[bad])}, offset {int(offs[bad])}) does not "
                         f"hold the KV that was stored for it "
                         f"({int((~per_tok).sum())} of {end - start} tokens differ"
                         + ("; their slots are still zero: nothing was loaded "
                            "into them)" if zero else
                            "; their slots still hold the harness's poison: "
                            "nothing was loaded into them)" if poisoned else ")")
                         + marked)
        return worst

    def _written_outside(self, name: str) -> str:
        """Blocks written that vLLM never gave anyone (a missing load's), or "".

        Needs vLLM's frees watched and one KV cache group; also names writes into
        free blocks (:attr:`freed_uses`).
        """
        import torch

        if self.freed is None or not self._one_group:
            return ""
        held = {0, *self.freed.freed}
        held.update(b for t in self.block_table.values() for b in t)
        held.update(b for t, _ in self._async_tables.values() for b in t)
        held.update(b for t, _, _ in self._poison_due for b in t)
        kv = self.kv_caches[name]
        dim = 0 if kv.dim() == 4 else 1
        rest = [b for b in range(kv.shape[dim]) if b not in held]
        if not rest:
            return ""
        rows = kv.index_select(dim, torch.tensor(rest, device=kv.device))
        nz = rows.movedim(dim, 0).contiguous().view(torch.uint8).reshape(
            len(rest), -1).ne(0).any(dim=1)  # bytes: fp8 has no ne()
        hit = [rest[j] for j in nz.nonzero().flatten().tolist()]
        uses = self.freed.uses
        if not hit and not uses:
            return ""
        shown = ", ".join(map(str, hit[:8])) + (", ..." if len(hit) > 8 else "")
        where = " and ".join(w for w in (
            f"{len(hit)} block(s) of layer {name} that no request holds were "
            f"written ({shown})" if hit else "",
            f"{len(uses)} block(s) were written while vLLM had them free "
            f"(first: {uses[0]})" if uses else "") if w)
        return (f"; meanwhile {where}: the load went to other blocks than the "
                "request's (a wrong block id, stride or KV layout)")

    def _whose_kv(self, req_id: str, name: str, layer: int, pos: int) -> str:
        """Whose KV the block of ``pos`` holds (another layer's or block's), or ""."""
        import torch

        b = self.block_size
        k = pos // b
        n = min(len(self.tokens.get(req_id, ())),
                len(self.block_table.get(req_id, ())) * b)
        if (k + 1) * b > n:
            return ""
        kv = self.kv_caches[name]
        blocks, offs, pos_k, tok_k = self._token_slots(req_id, k * b, (k + 1) * b)
        got = self.read_slots(name, blocks, offs)
        for i, other in enumerate(self.names):
            if i != layer and torch.equal(got, self.pattern(
                    kv, layer_index(other, i), pos_k, tok_k)):
                return (f"; the slots hold layer {other}'s KV of these tokens: the "
                        "connector loaded (or saved) another layer's KV into this "
                        "one (its layer order or the cross-layer axis read "
                        "wrongly)")
        for j in range(n // b):
            if j == k:
                continue
            pos_j = torch.arange(j * b, (j + 1) * b, dtype=torch.long)
            tok_j = torch.tensor(self.tokens[req_id][j * b:(j + 1) * b],
                                 dtype=torch.long)
            if torch.equal(got, self.pattern(kv, layer_index(name, layer), pos_j,
                                             tok_j)):
                return (f"; the block holds the KV of tokens [{j * b}, "
                        f"{(j + 1) * b}) of this request (another block of its own "
                        "table)")
        return ""

    def _other_requests_kv(self, req_id: str, name: str, layer: int, pos: int
                           ) -> str:
        """Whether the block of ``pos`` holds another request's KV, or ""."""
        import torch

        b = self.block_size
        k = pos // b
        n = min(len(self.tokens.get(req_id, ())),
                len(self.block_table.get(req_id, ())) * b, (k + 1) * b)
        if n <= k * b or self._searches >= WHOSE_KV_SEARCHES:
            return ""
        self._searches += 1
        kv = self.kv_caches[name]
        blocks, offs, pos_k, tok_k = self._token_slots(req_id, k * b, n)
        got = self.read_slots(name, blocks, offs)
        li = layer_index(name, layer)

        def per_token(eq: Any) -> Any:
            return eq.reshape(eq.shape[0], -1).all(dim=1) if kv.dim() == 4 \
                else eq.transpose(0, 1).reshape(eq.shape[1], -1).all(dim=1)

        wrong = ~per_token(got == self.pattern(kv, li, pos_k, tok_k))
        own = self.tokens[req_id]
        others = [r for r in self.tokens if r != req_id][-WHOSE_KV_REQUESTS:]
        for rid in reversed(others):
            toks = self.tokens[rid]
            for j in range(-(-len(toks) // b)):
                m = min(n - k * b, len(toks) - j * b)
                if toks[j * b:j * b + m] == own[j * b:j * b + m]:
                    continue  # a shared prefix: this request's own KV there
                pos_j = torch.arange(j * b, j * b + m, dtype=torch.long)
                tok_j = torch.tensor(toks[j * b:j * b + m], dtype=torch.long)
                part = got[:m] if kv.dim() == 4 else got[:, :m]
                hit = per_token(part == self.pattern(kv, li, pos_j, tok_j))
                if bool((hit & wrong[:m]).any()):
                    return (f"; the block holds the KV of tokens [{j * b}, "
                            f"{j * b + m}) of request {rid}" + SAVED_AFTER_REUSE
                            + DELAYED_FREE_FIX)
        return ""

    def read_slots(self, name: str, blocks: Any, offsets: Any) -> Any:
        """:func:`token_view` of layer ``name`` (a freed block keeps its KV)."""
        kv = self.kv_caches[name]
        return token_view(kv, blocks.to(kv.device), offsets.to(kv.device))

    def poison_blocks(self, block_ids: Sequence[int], start: int, end: int,
                      req_id: str | None = None) -> None:
        """Queue tokens [start, end) of a block table for :data:`POISON`.

        Written next worker step, right after ``handle_preemptions`` (what a
        connector finishes there may still read a reused block); tokens past the
        table are left out. ``req_id``: the asynchronous load into them (a failure it
        reports before computing names these blocks).
        """
        if req_id is not None and req_id not in self.loaded:
            self._async_tables[req_id] = (list(block_ids), end)
        end = min(end, len(block_ids) * self.block_size)
        if end > start:
            self._poison_due.append((list(block_ids), start, end))

    def poison(self, req_id: str, start: int, end: int) -> None:
        """Fill tokens [start, end) of a request with :data:`POISON` in every layer.

        Before a synchronous load, so an unloaded token never holds the pattern by
        chance (a reused block).
        """
        if end > start:
            self._poison_slots(self.block_table[req_id], start, end)

    def _poison_slots(self, table: list[int], start: int, end: int) -> None:
        self._fill_slots(table, start, end, POISON)

    def _fill_slots(self, table: list[int], start: int, end: int, value: float
                    ) -> None:
        """Fill tokens [start, end) of a block table with ``value``, every layer."""
        import torch

        blocks, offs, _pos = slots_for(table, start, end, self.block_size)
        for name in self.names:
            kv = self.kv_caches[name]
            b, o = blocks.to(kv.device), offs.to(kv.device)
            set_token_slots(kv, b, o, torch.full_like(token_view(kv, b, o), value))

    def _before_load(self, expected: dict[str, tuple[int, int]]) -> None:
        """The harness's writes after ``handle_preemptions``: marks, then poison."""
        import torch

        if self.freed is not None:
            self.freed.flush()
        for rid, (lo, hi) in expected.items():
            if rid in self.block_table:
                self.poison(rid, lo, hi)
        due, self._poison_due = self._poison_due, []
        for table, lo, hi in due:
            self._poison_slots(table, lo, hi)
        if any(kv.is_cuda for kv in self.kv_caches.values()):
            # the writes are the harness's, not the engine's: they must be in
            # memory before the load starts. A load on its own CUDA stream need
            # not wait for the compute stream (vLLM 0.26's OffloadingConnector
            # waits only when it offloads, v1/kv_offload/cpu/gpu_worker.py;
            # 0.28 always waits), so a write still queued there could land
            # after the load
            torch.cuda.synchronize()

    def find_shift(self, req_id: str, start: int, end: int, max_shift: int
                   ) -> int | None:
        """The offset d (0 < |d| <= max_shift tokens) putting token t's KV at t + d.

        None when no single shift explains the slots; diagnoses a failed
        :meth:`verify_range` (first layer, slots in [start, end)).
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
            got = self.read_slots(self.names[0], blocks, offs)
            want = pattern_values(kv, 0, pos, tok)
            if torch.equal(got, want):
                return d
        return None

    def write_pattern(self, req_id: str, start: int, end: int) -> None:
        """The fake attention: write the pattern into tokens [start, end).

        Positions past the prompt hold ``SAMPLED_TOKEN_ID``, so decoded tokens get KV
        too (a resumed request finds them in vLLM's prefix cache).
        """
        end = min(end, len(self.block_table[req_id]) * self.block_size)
        if end <= start:
            return
        blocks, offs, pos, tok = self._token_slots(req_id, start, end)
        for i, name in enumerate(self.names):
            kv = self.kv_caches[name]
            dev = kv.device
            set_token_slots(kv, blocks.to(dev), offs.to(dev),
                            self.pattern(kv, layer_index(name, i), pos, tok))
        if self.unrecomputed:
            self.unrecomputed -= {int(x) for x in blocks.tolist()}

    def pattern(self, kv: Any, layer_idx: int, positions: Any, tokens: Any) -> Any:
        """The KV this worker's attention writes: :func:`pattern_values`.

        The TP harness overrides it (:mod:`tvc.contract.tp`).
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
        """Run one worker step; return ``KVConnectorOutput`` as the model runner does.

        Raises:
            ConnectorWorkerError: a connector call raised an error whose cause
                :mod:`tvc.core.error_hints` knows; any other exception propagates with
                a note naming the call.

        """
        from vllm.config import set_current_vllm_config
        from vllm.v1.outputs import KVConnectorOutput

        self._steps += 1
        if self.freed is not None:
            self.freed.step = self._steps
        work = self._track(so)
        expected, self._expected_loads = self._expected_loads, {}
        c = self.connector
        out = KVConnectorOutput()
        failed_reqs: set[str] | None = None
        checks: list[tuple[str, int, tuple[int, str] | None]] = []
        v1 = self.runner[0] == "V1"
        step = "handle_preemptions"
        try:
            with set_current_vllm_config(self.vllm_config), \
                    contextlib.ExitStack() as fwd:
                # vLLM's forward context, as the model runner sets it: around the
                # whole connector lifecycle on the V1 runner, around pre_forward
                # (preemptions, bind, start_load_kv) on the V2 runner
                # (tvc.contract.compat.engine_forward_context cites the lines)
                ctx = fwd.enter_context(engine_forward_context(
                    self.vllm_config, self.kv_caches, self._slot_mapping(work),
                    sum(e - s for _r, s, e in work), with_metadata=bool(work)))
                # both runners hand every step's metadata to handle_preemptions
                # before binding it (gpu_model_runner.py 0.28.0 L4320,
                # gpu/kv_connector.py L67-L68)
                if hasattr(c, "handle_preemptions"):
                    c.handle_preemptions(meta)
                self._before_load(expected)
                step = "bind_connector_metadata"
                c.bind_connector_metadata(meta)
                step = "start_load_kv"
                c.start_load_kv(ctx)
                step = "wait_for_layer_load"
                for name in self.names:
                    c.wait_for_layer_load(name)
                # tokens counted computed but not computed now (a load or a local
                # hit) are verified after this step's attention wrote its tokens:
                # a local hit may be a block another request of this step computes
                for rid, start, end in work:
                    self.write_pattern(rid, start, end)
                for rid, start, _end in work:
                    if rid in self.loaded:
                        continue
                    self.loaded[rid] = start
                    self._async_tables.pop(rid, None)
                    self._note_unrecomputed_read(rid, start)
                    if start > 0:
                        self.verified.setdefault(rid, []).append((0, start))
                        checks.append((rid, start,
                                       self.first_mismatch(rid, 0, start)))
                step = "save_kv_layer"
                metadata = ctx.attn_metadata or {}
                for name in self.names:
                    c.save_kv_layer(name, self.kv_caches[name], metadata.get(name))
                if not v1:  # the V2 runner's post_forward runs after the forward
                    fwd.close()
                step = "after the forward"
                self._finish_step(c, so, out)
                failed_reqs = self._failed_requests
        except HarnessIncompatible:
            raise
        except Exception as exc:
            if step == "after the forward":
                step = self._step
            hint = hint_prefix(exc)
            if not hint:  # keep the connector's own exception, name the call
                exc.add_note(f"(raised by the connector's worker side in {step})")
                raise
            raise ConnectorWorkerError(
                f"{hint}The connector's worker side failed in {step}: "
                f"{type(exc).__name__}: {exc}") from exc
        self._judge_loads(checks, set(out.invalid_block_ids or ()), expected,
                          failed_reqs)
        self._judge_shared_block(work, expected)
        if self.freed is not None:
            self.freed.check(f"the worker step of engine step {self._steps}")
        if self._fail_policy:
            self._mark_failed_loads(checks)
        if self.heal_reported:
            self._heal(checks)
        return out

    def _mark_failed_loads(self, checks: list[tuple[str, int, tuple[int, str] | None]]
                           ) -> None:
        """Fill this step's reported failed blocks with FAILED_LOAD (policy ``fail``).

        vLLM never computes them (``Scheduler._handle_invalid_blocks``): a connector
        that saves them anyway serves the mark later (:func:`mark_meaning`).
        """
        for rid, start, _bad in checks:
            first = self._reported_now.get(rid)
            if first is not None and first < start:
                self._fill_slots(self.block_table[rid], first, start, FAILED_LOAD)
        for rid, first in self._async_reported_now.items():
            table, end = self._async_tables.get(rid, ([], 0))
            end = min(end, len(table) * self.block_size)
            if first < end:
                self._fill_slots(table, first, end, FAILED_LOAD)

    def _judge_shared_block(self, work: list[tuple[str, int, int]],
                            expected: dict[str, tuple[int, int]]) -> None:
        """Record a write after the forward into the block a load shares with it.

        A ``len - 1`` load ending inside a block leaves the rest to the forward
        (``reshape_and_cache``); a copy landing later replaces the last token's KV.
        """
        b = self.block_size
        for rid, start, end in work:
            lo, hi = expected.get(rid, (0, 0))
            if not hi % b or start != hi or rid not in self.block_table:
                continue
            tail = min(end, -(-hi // b) * b, len(self.block_table[rid]) * b)
            bad = self.first_mismatch(rid, hi, tail) if tail > hi else None
            if bad is None:
                continue
            pos = bad[0]
            block = self.block_table[rid][pos // b]
            self.load_errors.append(
                f"request {rid}: token {pos} (block {block}, offset {pos % b}) was "
                f"computed by vLLM in this step — the connector matched tokens "
                f"[{lo}, {hi}) only, its load ending inside that block — but at the "
                "end of the step its slot no longer held the KV the forward wrote: "
                "the connector wrote into the slot of a token it did not match, "
                "after the forward. A load that fills the whole block must land "
                "before the forward (start_load_kv / wait_for_layer_load), which "
                "then overwrites that slot; or copy only the matched tokens")

    def _slot_mapping(self, work: list[tuple[str, int, int]]) -> dict[str, Any]:
        """Layer name -> this step's slots (``block_id * B + offset``), as vLLM's."""
        import torch

        parts = []
        for rid, start, end in work:
            end = min(end, len(self.block_table[rid]) * self.block_size)
            if end > start:
                blocks, offs, _ = slots_for(self.block_table[rid], start, end,
                                            self.block_size)
                parts.append(blocks * self.block_size + offs)
        slots = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
        return {name: slots.to(kv.device) for name, kv in self.kv_caches.items()}

    def _finish_step(self, c: Any, so: Any, out: Any) -> None:
        """The connector calls after the forward, in the model runner's order.

        ``kv_connector_model_runner_mixin._get_kv_connector_output`` (0.28.0 L98-L112)
        and ``gpu/kv_connector.py post_forward`` (L77-L96); vLLM 0.33 adds
        ``finish_forward`` and ``get_transfer_results``. Fills ``out`` and
        :attr:`_failed_requests`; :attr:`_step` names the call under way.
        """
        self._failed_requests: set[str] | None = None
        self._step = "wait_for_save"
        c.wait_for_save()
        if hasattr(c, "finish_forward"):
            # vLLM 0.33's model runner: the forward no longer reads this
            # step's KV (gpu/kv_connector.py, finish_forward)
            self._step = "finish_forward"
            c.finish_forward()
        self._step = "get_finished"
        if hasattr(c, "get_transfer_results"):
            # vLLM 0.33: sends, receives and failed receives together
            # (kv_connector_model_runner_mixin, get_transfer_results)
            self._step = "get_transfer_results"
            res = c.get_transfer_results(so.finished_req_ids)
            out.finished_sending = set(res.finished_sending or ()) or None
            out.finished_recving = set(res.finished_recving or ()) or None
            if hasattr(out, "failed_recving"):
                out.failed_recving = set(res.failed_recving or ())
        else:
            out.finished_sending, out.finished_recving = c.get_finished(
                so.finished_req_ids)
        self._step = "get_block_ids_with_load_errors"
        if hasattr(c, "get_block_ids_with_load_errors"):
            out.invalid_block_ids = c.get_block_ids_with_load_errors()
        self._step = "get_request_ids_with_load_errors"
        if hasattr(c, "get_request_ids_with_load_errors"):
            self._failed_requests = set(c.get_request_ids_with_load_errors() or ())
        self._step = "get_kv_connector_stats"
        if hasattr(c, "get_kv_connector_stats"):
            out.kv_connector_stats = c.get_kv_connector_stats()
        self._step = "get_kv_connector_kv_cache_events"
        if hasattr(c, "get_kv_connector_kv_cache_events"):
            out.kv_cache_events = c.get_kv_connector_kv_cache_events()
        self._step = "build_connector_worker_meta"
        if hasattr(c, "build_connector_worker_meta"):
            out.kv_connector_worker_meta = c.build_connector_worker_meta()
        self._step = "clear_connector_metadata"
        c.clear_connector_metadata()

    def _note_unrecomputed_read(self, req_id: str, start: int) -> None:
        """Record a first compute whose counted tokens cover an unrecomputed block."""
        if not self.unrecomputed or start <= 0:
            return
        table = self.block_table.get(req_id, [])[: -(-start // self.block_size)]
        hit = [blk for blk in table if blk in self.unrecomputed]
        if hit:
            self.unrecomputed_reads.append(
                f"request {req_id} counts block(s) {hit} as computed (vLLM's "
                "prefix cache), which a reported failed load left there and no "
                "request recomputed since")

    def _heal(self, checks: list[tuple[str, int, tuple[int, str] | None]]) -> None:
        """Write the pattern into this step's reported failed blocks (heal_reported)."""
        for rid, start, _bad in checks:
            first = self._reported_now.get(rid)
            if first is None or first >= start:
                continue
            self.write_pattern(rid, first, start)
            b = self.block_size
            self.unrecomputed |= set(
                self.block_table[rid][first // b: -(-start // b)])

    def _mismatch_text(self, rid: str, start: int, bad: tuple[int, str]) -> str:
        """What was wrong in ``rid``'s first ``start`` tokens (or: a late load)."""
        now = self.verify_range(rid, 0, start)
        if now:
            return now
        where = getattr(self, "where", None)
        head = f"{where()}, " if callable(where) else ""
        seen = bad[1].replace(": nothing was loaded into them)",
                              ": the load had not landed yet)")
        return (f"{head}{seen} when the forward read it; by the end of the step "
                "the slots held the stored KV: the load landed after the forward "
                "(the connector reported it done — finished_recving, or "
                "start_load_kv / wait_for_layer_load returned — before its copy "
                "was complete)")

    def _judge_loads(self, checks: list[tuple[str, int, tuple[int, str] | None]],
                     invalid: set[int], expected: dict[str, tuple[int, int]],
                     failed_reqs: set[str] | None) -> None:
        """Record wrong loads and wrong load-error reports of one step.

        ``checks``: (request id, tokens counted computed, first mismatch or None) per
        newly computed request. vLLM recomputes from a request's first reported
        block; ``get_request_ids_with_load_errors()`` (vLLM 0.28 never calls it) must
        name exactly the failed requests.
        """
        b = self.block_size
        self._reported_now = {}
        self._async_reported_now = {}
        if invalid:
            self.reported_invalid_blocks |= invalid
            # an asynchronous load's failure is reported before its request
            # computes (with finished_recving); vLLM then recomputes it from
            # its first reported block (Scheduler._update_requests_with_
            # invalid_blocks), so it first computes from there
            tables = {r: t for r, (t, _e) in self._async_tables.items()}
            for rid, table in {**tables, **self.block_table}.items():
                first = next((i for i, blk in enumerate(table) if blk in invalid),
                             None)
                if rid not in self.loaded and first is not None:
                    self.reported_before_compute[rid] = min(
                        first * b, self.reported_before_compute.get(rid, first * b))
                    self._async_reported_now[rid] = first * b
        failed: set[str] = set()
        for rid, start, bad in checks:
            table = self.block_table.get(rid, [])
            first_rep = next((i for i, blk in enumerate(table[: -(-start // b)])
                              if blk in invalid), None)
            first_bad = None if bad is None else bad[0] // b
            # the sentence through verify_range (a subclass may name its rank)
            what = self._mismatch_text(rid, start, bad) if bad is not None else ""
            if first_rep is None:
                if bad is not None:
                    # a load that landed late is no short load (the slots
                    # held the stored KV by the end of the step)
                    late = "landed after the forward" in what
                    self.load_errors.append(f"request {rid}: {what}" + (
                        "" if late else short_load(bad, start)))
                    failed.add(rid)
                continue
            failed.add(rid)
            self.reported_loads[rid] = first_rep * b
            self._reported_now[rid] = first_rep * b
            if first_bad is not None and first_bad < first_rep:
                self.load_errors.append(f"request {rid}: {what} (before the "
                                        "first block reported as failed)")
            elif (first_bad is None or first_bad > first_rep) and rid in expected \
                    and first_rep * b >= expected[rid][0]:
                self.load_errors.append(
                    f"request {rid}: block {table[first_rep]} (tokens "
                    f"[{first_rep * b}, {(first_rep + 1) * b})) was reported through "
                    "get_block_ids_with_load_errors() but holds exactly the KV that "
                    "was stored for it: a false load-error report (vLLM recomputes "
                    "from that block although the load was bit-identical); the "
                    "error set must name the blocks that actually failed")
        if failed_reqs is None:
            return
        for rid in sorted(failed_reqs - failed):
            self.load_errors.append(
                f"request {rid}: get_request_ids_with_load_errors() names it, but "
                "its load in this step was bit-identical and no block of it was "
                "reported as failed (false report: its output would be discarded)")
        for rid in sorted(failed - failed_reqs):
            self.load_errors.append(
                f"request {rid}: its load failed (a block reported or not holding "
                "the stored KV) but get_request_ids_with_load_errors() does not "
                "name it")


#: the sentence of :func:`short_load` that names the lookup
SHORT_LOAD = "the connector claimed more tokens than its load brought"


def short_load(bad: tuple[int, str], start: int) -> str:
    """A diagnosis when only the tail of the computed tokens was never written.

    ``bad``: :meth:`ConnectorWorker.first_mismatch` of tokens [0, ``start``).
    Returns "; tokens [0, p) hold ... off-by-one ..." when every token from the
    mismatch on still holds zeros or the poison, else ''.
    """
    pos, text = bad
    m = re.search(r"\((\d+) of \d+ tokens differ; their slots (are still zero|"
                  r"still hold the harness's poison)", text)
    if pos == 0 or not m or int(m.group(1)) != start - pos:
        return ""
    return (f"; tokens [0, {pos}) hold the stored KV and the last {start - pos} of "
            f"the {start} tokens vLLM counted computed were never written: "
            f"{SHORT_LOAD} (get_num_new_matched_tokens matched tokens its store "
            "does not hold — an off-by-one in the lookup — or the load stops short)")


class JobAckWorker:
    """Stand-in for a worker that cannot run on this box (e.g. CUDA-only copies).

    Acknowledges job-based connectors: metadata ``load_jobs`` / ``store_jobs``
    (job id -> job with ``req_id``) answered one step later with the module's
    worker metadata (``mark_completed``) and ``finished_recving``. Moves no bytes.
    """

    #: recorded as the ``worker`` property of tests that ran with it
    standin_label = "tvc.contract.worker:JobAckWorker (job protocol)"

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
        """Acknowledge last step's jobs; queue this step's.

        Under :class:`tvc.contract.faults.FaultInjectingConnector`, planned faults with
        reporting on are reported as vLLM expects: a synchronous load's in this pass,
        an asynchronous load's in the pass that finishes receiving it.
        """
        from vllm.v1.outputs import KVConnectorOutput

        faults = getattr(meta, "faults", None) if meta is not unwrap_metadata(
            meta) else None
        report = bool(faults) and getattr(meta, "report", False)
        invalid: set[int] = set()
        if report:
            for rid, blocks in faults.items():  # type: ignore[union-attr]
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
    from tvc.contract.faults import FaultMetadata

    return meta.inner if isinstance(meta, FaultMetadata) else meta
