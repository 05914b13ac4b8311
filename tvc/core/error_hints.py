"""Plain-language causes for connector error messages the suite has seen.

:func:`explain` maps a known message to one sentence (what is wrong, what to do);
the worker harness and :mod:`tvc.procs.vllm_server` put it before the original.
Each entry of :data:`KNOWN_ERRORS` cites where the message comes from. The Tutti
entries come from the public connector (xPU-IO/Tutti ``integration/vllm-connector``
at 33a8fb8) as rebuilt and run on CPU; file:line are upstream's.
"""

from __future__ import annotations

import linecache
import os
import re
import traceback
from collections.abc import Callable, Iterable

__all__ = ["KNOWN_ERRORS", "explain", "hint_prefix", "read_rank4_shape"]

_SHAPE = re.compile(r"shape=\((\d+), (\d+), (\d+), (\d+)\)")


def read_rank4_shape(message: str, block_size: int | None = None) -> str:
    """Say which 4-D tensor a ``shape=(a, b, c, d)`` in a message is ('' if none).

    Per-layer is ``(N, H, B, 2*D)``, a cross-layer slice ``(N, B, H, 2*D)``; told
    apart by the block size's axis (``block_size``, else the one power of two >= 16).
    """
    m = _SHAPE.search(message)
    if not m:
        return ""
    n, b1, b2, last = (int(x) for x in m.groups())

    def is_block(x: int) -> bool:
        if block_size is not None:
            return x == block_size
        return x >= 16 and x & (x - 1) == 0

    if is_block(b2) and not is_block(b1):
        return (f"shape ({n}, {b1}, {b2}, {last}) is vLLM's per-layer tensor "
                f"(N, H, B, 2D) with H = {b1} KV heads and B = {b2}: the engine "
                "ran the V2 model runner (per-layer only)")
    if is_block(b1) and not is_block(b2):
        return (f"shape ({n}, {b1}, {b2}, {last}) is a layer slice (N, B, H, 2D) "
                f"of the V1 runner's cross-layer tensor with B = {b1} and H = {b2} "
                "KV heads")
    return (f"shape ({n}, {b1}, {b2}, {last}): (N, H, B, 2D) per layer (V2 "
            "runner) or (N, B, H, 2D) cross-layer slice (V1 runner), ambiguous "
            "here because H and B look alike")


def _rank4_hint(text: str) -> str:
    """The cause of Tutti's "unsupported paged KV tensor rank 4", by the shape."""
    shape = read_rank4_shape(text)
    head = ("the connector's worker accepts only vLLM's cross-layer KV tensor, "
            "which only the V1 model runner hands over (one KV cache group, a "
            "backend that indexes by block stride; vLLM 0.26/0.28, not 0.33), and "
            "then only with exactly 2 KV heads per rank (it reads the KV-head axis "
            "as the K/V axis); ")
    if "cross-layer tensor with" in shape:
        return (head + shape + ": the V1 runner is already in use; this model's "
                "KV-head count per rank is what the connector refuses")
    return (head + (shape or "a rank-4 tensor is per layer (N, H, B, 2D) from the "
                    "V2 model runner or a cross-layer slice (N, B, H, 2D)")
            + ". vLLM 0.26/0.28 pick the V2 runner for dense models: set "
            "VLLM_USE_V2_MODEL_RUNNER=0 (profile [vllm] env) for the V1 runner")


# (regex searched in the message or log, the cause in one sentence, or a function
# of the searched text giving it)
KNOWN_ERRORS: tuple[tuple[re.Pattern[str], str | Callable[[str], str]], ...] = (
    # engine/core.py:1271-1275 (bind) after stores/memory.py:88 memoryview(buffer)
    (re.compile(r"staging 环窗被 store 拒收"),
     "the connector's memory store cannot serve a CUDA worker (staging buffer "
     "refused): Tutti's MemoryKVStore registers its staging buffer through "
     "memoryview(), which a CUDA tensor cannot give (stores/memory.py:88, "
     "engine/core.py:1271-1275); use a store that registers device memory "
     "(profile tutti-public-nvme) or fix the memory store upstream"),
    # adapter/worker.py:1569-1572 staged fallback on a non-CUDA KV pool
    (re.compile(r"pin_memory=True requires a CUDA or other accelerator backend"),
     "the connector's worker allocates pinned host memory, which needs a CUDA "
     "torch: its worker side cannot run on this CPU-only box (the [cuda] variant "
     "runs it on a GPU host)"),
    # adapter/worker.py:956-960 after a failed get_tp_group() (worker.py:71-73)
    (re.compile(r"TP load failure collective poisoned the process group"),
     "the connector's worker needs vLLM's tensor-parallel group "
     "(init_distributed_environment + initialize_model_parallel) in the worker "
     "process; it was missing when a load ran"),
    # tutti_kv_transfer/__init__.py: from . import _native (CUDA extension)
    (re.compile(r"cannot import name '_native' from partially initialized module "
                r"'tutti_kv_transfer'|No module named 'tutti_kv_transfer"),
     "Tutti's CUDA extension tutti_kv_transfer._native is not built or not on "
     "PYTHONPATH: build transfer/ on the GPU host (pip install "
     "--no-build-isolation --no-deps --target DIR .) and add DIR to PYTHONPATH"),
    # adapter/connector.py:72-76 (_resolve_geometry)
    (re.compile(r"extra_config 缺少正整数引擎键 '(\w+)'"),
     "the connector's kv_connector_extra_config lacks a positive integer "
     "engine key: the public Tutti connector needs chunk_tokens and "
     "max_chunks_per_wave (and store.options.num_chunks); use profile "
     "tutti-public or add them"),
    # stores/tutti_nvme/store.py:263-267 (direct admission)
    (re.compile(r"K/V axis must be shape\[3\] == 2"),
     "the connector takes the cross-layer KV pool's shape[3] as the K/V axis, "
     "but in vLLM's FlashAttention NHD layout shape[3] is the KV-head count per "
     "rank: only models with exactly 2 KV heads per rank are accepted"),
    # adapter/worker.py:235 (staged path's layout check); seen on the H200 with
    # vLLM 0.26.0: its engine registers per-layer rank-4 tensors
    # The V2 model runner (vLLM's default for dense models in 0.26/0.28, always
    # in 0.33) registers only per-layer tensors (v1/worker/gpu/kv_connector.py)
    (re.compile(r"unsupported paged KV tensor rank 4"), lambda text: _rank4_hint(text)),
    # vllm/v1/worker/gpu_worker.py determine_available_memory (0.26.0-0.33.0): the
    # assert after the profile run when free memory grew meanwhile
    (re.compile(r"Error in memory profiling\. Initial free memory"),
     "another process released GPU memory while this vLLM server profiled its "
     "memory at start-up (e.g. an xdist worker of this run exiting): not the "
     "connector; rerun, or run without -n (CERTIFY_WORKERS=0) on a shared GPU"),
    # vllm/v1/core/sched/scheduler.py _update_from_kv_xfer_finished (0.26-0.33):
    # a request finished while WAITING_FOR_REMOTE_KVS is freed at finished_recving
    (re.compile(r"_update_from_kv_xfer_finished\)?: assert req_id in self\.requests"),
     "get_finished named a request vLLM no longer tracks: a request that "
     "finished while its KV was still being received (aborted, or failed under "
     "kv_load_failure_policy=fail) is freed by vLLM at its finished_recving, "
     "whatever request_finished answered, so get_finished must not name it in "
     "finished_sending afterwards (request_finished should return False for a "
     "request with nothing to save), nor name any request twice"),
    # the same function: a finished_recving for a request that is neither waiting
    # for remote KV nor finished
    (re.compile(r"_update_from_kv_xfer_finished\)?: assert "
                r"RequestStatus\.is_finished\(req\.status\)"),
     "get_finished named in finished_recving a request that is neither "
     "WAITING_FOR_REMOTE_KVS nor finished: a receive reported twice, one "
     "reported for a load get_num_new_matched_tokens declared synchronous "
     "(load_kv_async=False), or one reported after vLLM already counted it; "
     "report each asynchronous receive exactly once, in the step its load "
     "completed (KVConnectorBase_V1.get_finished)"),
    # stores/tutti_nvme/store.py:2013
    (re.compile(r"runtime=None 需要 TUTTI_NVME_PRESET"),
     "the tutti_nvme store needs TUTTI_NVME_PRESET (inline yaml/json or a file "
     "path) in the worker's environment"),
    # stores/tutti_nvme/store.py (_build_runtime)
    (re.compile(r"tutti_runtime 绑定不可用"),
     "Tutti's tutti_runtime binding is not importable: build bindings/python "
     "against the Tutti C++ tree and put it on PYTHONPATH"),
)


def explain(text: str | BaseException,
            table: Iterable[tuple[re.Pattern[str], str | Callable[[str], str]]]
            = KNOWN_ERRORS) -> list[str]:
    """Known causes in a message, a log, or an exception (with its cause/context chain).

    Returns:
        the causes of ``table`` whose regex occurs, in table order, without repeats.

    """
    if isinstance(text, BaseException):
        parts: list[str] = []
        exc: BaseException | None = text
        seen = 0
        while exc is not None and seen < 8:
            parts.append(f"{type(exc).__name__}: {exc}")
            exc = exc.__cause__ or exc.__context__
            seen += 1
        text = "\n".join(parts)
    return [cause(text) if callable(cause) else cause
            for rx, cause in table if rx.search(text)]


def hint_prefix(text: str | BaseException) -> str:
    """``"Known cause: <cause>. "`` for the first known cause, else ``""``."""
    causes = explain(text)
    return f"Known cause: {causes[0]}. " if causes else ""


def describe_failure(exc: AssertionError) -> str:
    """An assertion's message, or where it was raised when it has none.

    A bare ``assert`` in the connector or vLLM (e.g. OffloadingConnector's ``assert
    len(offload_keys) == len(offload_block_ids)``) carries no message.

    Returns:
        ``str(exc)`` when not empty, else ``"assertion failed in <file>:<line>
        (<function>): <source line>"``.

    """
    text = str(exc).strip()
    if text or exc.__traceback__ is None:
        return text or "assertion failed (no message, no traceback)"
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    line = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
    whose = "vLLM's" if f"{os.sep}vllm{os.sep}" in frame.filename else "the connector's"
    text = (f"assertion failed in {frame.filename}:{frame.lineno} ({frame.name}): "
            f"{line} — an internal check of {whose} code, not a message of this "
            "suite")
    causes = explain(text)
    return f"{text}. Known cause: {causes[0]}" if causes else text
