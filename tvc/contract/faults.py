"""Fault injection around any KV connector, for the contract tier and a real server.

:class:`FaultInjectingConnector` (``kv_connector_module_path =
"tvc.contract.faults"``) wraps the connector under test and faults every
``every``-th eligible event in one of :data:`MODES`;
:func:`wrap_kv_transfer_config` builds its config. Store-level injectors
(:class:`FileStoreInjector`, :class:`ObjectStoreInjector`) are picked by
:func:`fault_injector_for`. See docs/tiers.md and docs/safety.md.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from tvc.config.checks import store_base
from tvc.core import run_store

FAULT_KEY = "tvc_fault"  # kv_connector_extra_config key of the wrapper's settings
MODES = ("fail_load", "corrupt_load", "misreport_load", "lose_entry", "fail_save")
_LOAD_MODES = ("fail_load", "corrupt_load", "misreport_load")  # overwrite a block
# Written over a faulted block: the contract tier's KV pattern
# (tvc.contract.worker.pattern_values) only produces integers in [-125, 125].
SCRIBBLE_VALUE = 126
# KVTransferConfig fields that describe the connector class itself; every other
# field (kv_role, engine_id, kv_load_failure_policy, kv_rank, ...) is read by vLLM
# from the outer config and is copied there by wrap_kv_transfer_config.
_CONNECTOR_FIELDS = ("kv_connector", "kv_connector_module_path",
                     "kv_connector_extra_config")


class FaultConfigError(ValueError):
    """``kv_connector_extra_config.tvc_fault`` is missing or malformed."""


def wrap_kv_transfer_config(cfg: Mapping[str, Any], mode: str, every: int = 1,
                            seed: int = 0) -> dict[str, Any]:
    """The kv_transfer_config that runs ``cfg``'s connector inside the wrapper.

    ``cfg`` (as ``Profile.kv_transfer_config()`` returns it) is not modified; its
    non-connector fields (``kv_role``, ``kv_load_failure_policy``, ...) stay
    outside, and ``kv_connector_extra_config = {"tvc_fault": {"inner": cfg,
    "mode", "every", "seed"}}``. ``every``: fault every N-th eligible event;
    ``seed``: phase of the faulted events and choice of the faulted block.

    Raises:
        FaultConfigError: ``mode`` not in :data:`MODES`, ``every < 1``, or ``cfg``
            without ``kv_connector``.

    """
    _check_settings({"inner": cfg, "mode": mode, "every": every, "seed": seed})
    inner = copy.deepcopy(dict(cfg))
    outer = {k: copy.deepcopy(v) for k, v in inner.items()
             if k not in _CONNECTOR_FIELDS}
    outer.update(kv_connector="FaultInjectingConnector",
                 kv_connector_module_path="tvc.contract.faults",
                 kv_connector_extra_config={FAULT_KEY: {
                     "inner": inner, "mode": mode, "every": int(every),
                     "seed": int(seed)}})
    return outer


def _check_settings(s: Any) -> dict[str, Any]:
    where = f"kv_connector_extra_config.{FAULT_KEY}"
    if not isinstance(s, Mapping):
        raise FaultConfigError(f"{where} must be a table with inner, mode, every, "
                               f"seed; got {s!r}")
    mode = s.get("mode")
    if mode not in MODES:
        raise FaultConfigError(f"{where}.mode = {mode!r}: expected one of {MODES}")
    every = s.get("every", 1)
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise FaultConfigError(f"{where}.every = {every!r}: expected an integer >= 1")
    seed = s.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise FaultConfigError(f"{where}.seed = {seed!r}: expected an integer")
    inner = s.get("inner")
    if not isinstance(inner, Mapping) or not inner.get("kv_connector"):
        raise FaultConfigError(f"{where}.inner must be the wrapped connector's "
                               f"kv_transfer_config with kv_connector; got {inner!r}")
    if inner.get("kv_connector") == "FaultInjectingConnector":
        raise FaultConfigError(f"{where}.inner wraps FaultInjectingConnector in "
                               "itself; wrap the connector under test once")
    return {"inner": dict(inner), "mode": mode, "every": every, "seed": seed}


def _inner_transfer_config(outer: Any) -> KVTransferConfig:
    """The inner ``KVTransferConfig`` from the wrapper's outer one."""
    s = _check_settings(outer.kv_connector_extra_config.get(FAULT_KEY))
    inner = dict(s["inner"])
    inner.setdefault("engine_id", outer.engine_id)
    for k in ("kv_role", "kv_load_failure_policy"):
        inner.setdefault(k, getattr(outer, k))
    return KVTransferConfig(**inner)


class _Counter:
    """Every-N-th selection with a seeded phase; one decision per key."""

    def __init__(self, every: int, seed: int) -> None:
        self.every, self.seed, self.count = every, seed, 0
        self.decided: dict[Any, bool] = {}

    def hit(self, key: Any) -> bool:
        if key not in self.decided:
            self.decided[key] = (self.count + self.seed) % self.every == \
                self.every - 1
            self.count += 1
        return self.decided[key]


@dataclass
class FaultMetadata(KVConnectorMetadata):
    """Scheduler -> worker metadata: the inner connector's plus this step's faults.

    Attributes:
        faults: request id -> block ids to overwrite (and, for ``fail_load``,
            report) once that request's load has landed.
        reports: request id -> block ids to report instead (``misreport_load``).
        async_reqs: requests among ``faults`` loading asynchronously (faulted when
            ``get_finished`` returns them).
        report: whether the faulted blocks are reported.

    """

    inner: KVConnectorMetadata | None
    faults: dict[str, list[int]] = field(default_factory=dict)
    async_reqs: set[str] = field(default_factory=set)
    report: bool = True
    reports: dict[str, list[int]] = field(default_factory=dict)


class FaultInjectingConnector(KVConnectorBase_V1):
    """Wraps the connector under test and injects one kind of fault.

    Built through vLLM's ``KVConnectorFactory`` from
    ``kv_connector_extra_config["tvc_fault"]["inner"]``. Event ``i`` (per role,
    arrival order) is faulted iff ``(i + seed) % every == every - 1``, one
    decision per request (lookups repeat). Modes: ``fail_load`` overwrites one
    loaded block with :data:`SCRIBBLE_VALUE` and reports it through
    ``get_block_ids_with_load_errors()`` (in the loading pass, or with
    ``finished_recving`` when asynchronous); negative controls ``corrupt_load``
    (unreported) and ``misreport_load`` (reports the block after it, none for a
    one-block load); ``lose_entry`` answers a hit ``(0, False)``; ``fail_save``
    caps later lookups before a failed save's first block (the inner connector
    still writes).

    Attributes:
        inner: the wrapped connector.
        mode, every, seed: from ``kv_connector_extra_config.tvc_fault``.
        injected: ``(event, request id, detail)`` of every fault, for in-process
            tests.

    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role,
                         kv_cache_config=kv_cache_config)
        outer = vllm_config.kv_transfer_config
        s = _check_settings(outer.kv_connector_extra_config.get(FAULT_KEY))
        self.mode, self.every, self.seed = s["mode"], s["every"], s["seed"]
        inner_vc = copy.copy(vllm_config)
        inner_vc.kv_transfer_config = _inner_transfer_config(outer)
        self.inner = KVConnectorFactory.create_connector(inner_vc, role,
                                                         kv_cache_config)
        self._num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
        self._block_size = vllm_config.cache_config.block_size
        self._counter = _Counter(self.every, self.seed)
        self.injected: list[tuple[str, str, Any]] = []
        # scheduler side
        self._local: dict[str, int] = {}
        self._async: dict[str, bool] = {}
        self._pending: dict[str, list[int]] = {}
        self._misreport: dict[str, list[int]] = {}
        self._pending_async: set[str] = set()
        self._emitted: set[Any] = set()
        self._ok_hashes: set[Any] = set()
        self._failed_hashes: set[Any] = set()
        # worker side
        self._kv: list[Any] = []
        self._step_faults: dict[str, list[int]] = {}
        self._await_recv: dict[str, list[int]] = {}
        self._step_reports: dict[str, list[int]] = {}
        self._report_now: set[int] = set()
        self._report = self.mode in ("fail_load", "misreport_load")
        self._scribbled = False

    # ------------------------------------------------------------ properties
    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:  # noqa: D102
        return self.inner.supports_divergent_local_hybrid_hits

    @property
    def prefer_cross_layer_blocks(self) -> bool:  # noqa: D102
        return self.inner.prefer_cross_layer_blocks

    @property
    def requires_kv_delivery(self) -> bool:  # noqa: D102
        return self.inner.requires_kv_delivery

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """The inner connector class's required KV cache layout."""
        inner = _inner_transfer_config(vllm_config.kv_transfer_config)
        inner_cls = KVConnectorFactory.get_connector_class(inner)
        vc = copy.copy(vllm_config)
        vc.kv_transfer_config = inner
        return inner_cls.get_required_kvcache_layout(vc)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Whether the inner connector class needs PIECEWISE CUDA graphs."""
        inner = _check_settings(extra_config.get(FAULT_KEY))["inner"]
        inner_cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**inner))
        return inner_cls.requires_piecewise_for_cudagraph(
            inner.get("kv_connector_extra_config") or {})

    # --------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:  # noqa: D102
        self._kv = list(kv_caches.values())
        self.inner.register_kv_caches(kv_caches)

    def register_cross_layers_kv_cache(self, kv_cache: Any,  # noqa: D102
                                       attn_backend: Any) -> None:
        self._kv = [kv_cache]
        self.inner.register_cross_layers_kv_cache(kv_cache, attn_backend)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:  # noqa: D102
        self.inner.set_host_xfer_buffer_ops(copy_operation)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:  # noqa: D102
        super().bind_connector_metadata(connector_metadata)
        meta = connector_metadata
        if isinstance(meta, FaultMetadata):
            self._step_faults = {r: b for r, b in meta.faults.items()
                                 if r not in meta.async_reqs}
            for r in meta.async_reqs:
                self._await_recv[r] = meta.faults[r]
            self._step_reports.update(meta.reports)
            meta = meta.inner
        self._scribbled = False
        self.inner.bind_connector_metadata(meta)

    def clear_connector_metadata(self) -> None:  # noqa: D102
        self.inner.clear_connector_metadata()
        super().clear_connector_metadata()
        self._step_faults = {}

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:  # noqa: D102
        meta = kv_connector_metadata
        self.inner.handle_preemptions(
            meta.inner if isinstance(meta, FaultMetadata) else meta)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:  # noqa: D102
        self.inner.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait for the inner load, then overwrite this step's faulted blocks."""
        self.inner.wait_for_layer_load(layer_name)
        if self._step_faults and not self._scribbled:
            self._scribbled = True
            for rid, blocks in self._step_faults.items():
                self._scribble(blocks)
                self.injected.append((self.mode, rid, list(blocks)))
                if self._report:
                    self._report_now.update(self._step_reports.pop(rid, blocks))

    def save_kv_layer(self, layer_name: str, kv_layer: Any,  # noqa: D102
                      attn_metadata: Any, **kwargs: Any) -> None:
        self.inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:  # noqa: D102
        self.inner.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """The inner answer; a faulted async load lands here and is reported."""
        sending, recving = self.inner.get_finished(finished_req_ids)
        for rid in recving or ():
            blocks = self._await_recv.pop(rid, None)
            if blocks:
                self._scribble(blocks)
                self.injected.append((self.mode, rid, list(blocks)))
                if self._report:
                    self._report_now.update(self._step_reports.pop(rid, blocks))
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The inner connector's failed blocks plus this pass's injected ones."""
        out = set(self.inner.get_block_ids_with_load_errors() or ())
        out |= self._report_now
        self._report_now = set()
        return out

    def _scribble(self, blocks: Iterable[int]) -> None:
        """Overwrite ``blocks`` in every registered KV tensor with SCRIBBLE_VALUE."""
        for t in self._kv:
            dim = _block_dim(t, self._num_blocks)
            for b in blocks:
                t.select(dim, int(b)).fill_(SCRIBBLE_VALUE)

    def shutdown(self) -> None:  # noqa: D102
        self.inner.shutdown()

    def get_kv_connector_stats(self) -> Any:
        """None: the inner connector's stats cannot be rebuilt by this class.

        ``build_kv_connector_stats`` is a classmethod called without a config in the
        front-end process, so the inner class is unknown there.
        """
        return None

    def get_kv_connector_kv_cache_events(self) -> Any:  # noqa: D102
        return self.inner.get_kv_connector_kv_cache_events()

    def get_handshake_metadata(self) -> Any:  # noqa: D102
        return self.inner.get_handshake_metadata()

    def set_xfer_handshake_metadata(self, metadata: Any) -> None:  # noqa: D102
        self.inner.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: Any  # noqa: D102
                                             ) -> None:
        self.inner.set_xfer_handshake_metadata_pp_aware(metadata)

    def build_connector_worker_meta(self) -> Any:  # noqa: D102
        return self.inner.build_connector_worker_meta()

    def get_finished_count(self) -> int | None:  # noqa: D102
        return self.inner.get_finished_count()

    # ------------------------------------------------------ scheduler side
    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:  # noqa: D102
        self.inner.bind_gpu_block_pool(gpu_block_pool)

    def on_new_request(self, request: Any) -> None:  # noqa: D102
        self.inner.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """The inner answer, or a miss (``lose_entry``), or capped (``fail_save``)."""
        n, is_async = self.inner.get_num_new_matched_tokens(request,
                                                            num_computed_tokens)
        rid = request.request_id
        self._local[rid] = num_computed_tokens
        if not n:
            self._async[rid] = bool(is_async)
            return n, is_async
        if self.mode == "lose_entry" and self._counter.hit(("lookup", rid)):
            self.injected.append(("lose_entry", rid, int(n)))
            n, is_async = 0, False
        elif self.mode == "fail_save" and self._failed_hashes:
            cap = _first_in(request.block_hashes, self._failed_hashes)
            if cap is not None and num_computed_tokens + n > cap * self._block_size:
                n = max(0, cap * self._block_size - num_computed_tokens)
                is_async = bool(is_async) and n > 0
        self._async[rid] = bool(is_async)
        return n, is_async

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        """Delegate; pick the block of a faulted load (the three load modes)."""
        self.inner.update_state_after_alloc(request, blocks, num_external_tokens)
        rid = request.request_id
        key = ("load", rid, request.num_preemptions)
        if (self.mode not in _LOAD_MODES or num_external_tokens <= 0
                or key in self._emitted or not self._counter.hit(key)):
            return
        self._emitted.add(key)
        self.injected.append((self.mode, rid, "planned"))
        ids = blocks.get_block_ids()[0]
        b = self._block_size
        local = self._local.get(rid, 0)
        first, last = local // b, (local + num_external_tokens - 1) // b
        pick = first + int(hashlib.sha256(f"{self.seed}-{rid}".encode()).hexdigest(),
                           16) % (last - first + 1)
        if self.mode == "misreport_load":
            # Report the block AFTER the overwritten one: vLLM recomputes from the
            # first reported block on, so the overwritten block stays wrong (a
            # block before it would make vLLM repair it). One block: report none.
            pick = max(first, min(pick, last - 1))
            self._misreport[rid] = [ids[pick + 1]] if pick < last else []
        self._pending[rid] = [ids[pick]]
        if self._async.get(rid):
            self._pending_async.add(rid)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """The inner metadata wrapped with this step's faults."""
        inner = self.inner.build_connector_meta(scheduler_output)
        meta = FaultMetadata(inner=inner, faults=self._pending,
                             async_reqs=self._pending_async & set(self._pending),
                             report=self._report, reports=self._misreport)
        self._pending, self._pending_async, self._misreport = {}, set(), {}
        return meta

    def update_connector_output(self, connector_output: Any) -> None:  # noqa: D102
        self.inner.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Delegate (to ``request_finished_all_groups`` for an HMA connector)."""
        if isinstance(self.inner, SupportsHMA):
            ret = self.inner.request_finished_all_groups(request, (block_ids,))
        else:
            ret = self.inner.request_finished(request, block_ids)
        self._after_finish(request)
        return ret

    def _after_finish(self, request: Any) -> None:
        rid = request.request_id
        for d in (self._local, self._async):
            d.pop(rid, None)
        if self.mode != "fail_save":
            return
        hashes = list(getattr(request, "block_hashes", ()) or ())
        if self._counter.hit(("save", rid)):
            new = [h for h in hashes if h not in self._ok_hashes]
            self._failed_hashes.update(new)
            self.injected.append(("fail_save", rid, len(new)))
        else:
            self._ok_hashes.update(hashes)
            self._failed_hashes.difference_update(hashes)

    def take_events(self) -> Iterable[Any]:  # noqa: D102
        return self.inner.take_events()

    def has_pending_push_work(self) -> bool:  # noqa: D102
        return self.inner.has_pending_push_work()

    def reset_cache(self) -> bool | None:  # noqa: D102
        return self.inner.reset_cache()


def _first_in(hashes: Iterable[Any], wanted: set[Any]) -> int | None:
    """Index of the first element of ``hashes`` in ``wanted`` (None if none)."""
    for i, h in enumerate(hashes):
        if h in wanted:
            return i
    return None


def _block_dim(t: Any, num_blocks: int) -> int:
    """The dimension of a KV tensor of size ``num_blocks`` (a leading K/V 2 skipped)."""
    dims = [i for i, s in enumerate(t.shape) if s == num_blocks]
    if not dims:
        raise AssertionError(f"no dimension of a KV tensor of shape {tuple(t.shape)} "
                             f"has the pool's {num_blocks} blocks")
    if len(dims) > 1 and dims[0] == 0 and t.shape[0] == 2:
        return dims[1]
    return dims[0]


# ------------------------------------------------------- store-level fault injectors
class ForeignWriter(Exception):  # noqa: N818 - reads as what was found
    """Another writer changes ``path`` in the store folder: the injector stops."""

    def __init__(self, path: Path, why: str) -> None:
        """Name the file and why it counts as another writer's."""
        super().__init__(
            f"{run_store.FOREIGN_WRITER}: {path} {why}; the store-fault tests damage "
            "only files the connector under test wrote in this run, and another "
            "writer's files are left as they are (stop the other program, or give "
            "the connector a store folder of its own)")
        self.path = path


Identity = run_store.Identity


PATTERN_RUN = 8  # consecutive KV values of one token that identify the harness's KV
SCAN_BYTES = 256 * 1024  # bytes of a file searched for them (KV comes early)


@functools.cache
def _pattern_needles() -> dict[int, frozenset[bytes]]:
    """Every run of :data:`PATTERN_RUN` harness KV values, as bytes, by run length.

    Along a token's KV the harness's values go up by ``PATTERN_STEP`` modulo
    ``PATTERN_MOD`` (:func:`tvc.contract.worker.pattern_values`), so 251 runs per
    dtype cover every layer, position, token, head and layout.
    """
    import torch

    from tvc.contract.worker import PATTERN_LOW, PATTERN_MOD, PATTERN_STEP

    dtypes = [torch.float16, torch.bfloat16, torch.float32,
              *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2")
                if hasattr(torch, n))]
    out: dict[int, set[bytes]] = {}
    for c in range(PATTERN_MOD):
        vals = torch.tensor([(c + PATTERN_STEP * k) % PATTERN_MOD + PATTERN_LOW
                             for k in range(PATTERN_RUN)], dtype=torch.float32)
        for dt in dtypes:
            raw = vals.to(dt).view(torch.uint8).numpy().tobytes()
            if len(set(raw)) > PATTERN_RUN // 2:  # fp8 rounding may flatten a run
                out.setdefault(len(raw), set()).add(raw)
    return {n: frozenset(v) for n, v in out.items()}


def carries_harness_kv(path: Path) -> bool:
    """Whether a file holds KV the worker harness computed (any dtype, any layout).

    A connector's entry stores the KV it was handed; another program's file holds
    none. Reads at most :data:`SCAN_BYTES`.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            data = f.read(SCAN_BYTES)
    except OSError:
        return False
    for n, needles in _pattern_needles().items():
        for i in range(len(data) - n + 1):
            if data[i:i + n] in needles:
                return True
    return False


class FileStoreInjector:
    """Damages a file-based store (files under one directory), between steps.

    ``entries_since(mark())`` are the files a step wrote; ``lose`` deletes them,
    ``corrupt`` flips bits, ``tear`` truncates, and ``failing_saves`` lowers
    ``RLIMIT_FSIZE`` to :data:`FAILED_WRITE_LIMIT` bytes around ``save_kv_layer``
    / ``wait_for_save`` (CPython ignores ``SIGXFSZ``: the write returns
    ``EFBIG``, even as root). Only files the connector wrote in this run, in a
    folder this run made, are touched: of the files a step wrote, those holding the
    harness's KV (:func:`carries_harness_kv`) where any does; see docs/safety.md
    ("Store fault injection"). ``refused`` lists entries left alone because they
    changed after being recorded, ``not_kv`` new files that hold no KV.

    Raises:
        FaultConfigError: ``root`` is in no folder this run created.

    """

    kinds = frozenset({"lose", "corrupt", "tear", "fail_save"})
    between_lookup_and_load = True
    FAILED_WRITE_LIMIT = 16  # bytes a failing save may still write
    QUIET_MAX_S = 2.0  # how long the step's own late writes may take to end
    #   (at the box's load factor, as :func:`tvc.core.run_store.settle_s`)

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        if run_store.made_in_this_run(self.root) is None:
            raise FaultConfigError(
                f"{self.root} is in no folder this run created (a session store "
                f"folder holds a {run_store.OWNER_MARKER} marker naming this process "
                "and run); the store-fault tests damage only what the connector "
                "wrote in the suite's own folders of this run")
        self._seen: dict[Path, Identity] = {}
        self.refused: list[Path] = []
        self.not_kv: list[Path] = []  # new files left alone: they hold no KV
        self.foreign: ForeignWriter | None = None

    def mark(self) -> dict[Path, Identity]:
        """Every regular file under the root with its identity; no symlinks."""
        return run_store.file_identities(self.root)

    def _quiet(self) -> dict[Path, Identity]:
        """A snapshot of the store once nothing changed in it for a settle time.

        Raises :class:`ForeignWriter` when a file changes in two settle times running,
        or changes keep coming for :data:`QUIET_MAX_S` (scaled as the settle time).
        """
        if self.foreign is not None:
            raise self.foreign
        settle = run_store.settle_s()
        deadline = time.monotonic() + self.QUIET_MAX_S * settle / run_store.SETTLE_S
        now, before = self.mark(), None
        while True:
            time.sleep(settle)
            later = self.mark()
            if later == now:
                return later
            changed = sorted(p for p in later.keys() | now.keys()
                             if later.get(p) != now.get(p))
            again = [p for p in changed if before is not None and p in now
                     and p in before and now[p] != before[p]]
            if again or time.monotonic() > deadline:
                self.foreign = ForeignWriter((again or changed)[0], (
                    "was rewritten over and over after the connector's step"
                    if again else f"kept changing for {self.QUIET_MAX_S} s after "
                    "the connector's step") + " (another program writes in the "
                    "store folder, or the connector never stops writing)")
                run_store.note_foreign_writer(self.root, (again or changed)[0])
                raise self.foreign
            now, before = later, now

    def entries_since(self, mark: dict[Path, Identity]) -> list[Path]:
        """Files that appeared since ``mark``, recorded as the connector's.

        Raises :class:`ForeignWriter` when a file there at ``mark`` changed or the
        folder did not become quiet.
        """
        now = self._quiet()
        for p in sorted(mark):
            if p in now and now[p] != mark[p] and self._seen.get(p) != now[p]:
                self.foreign = ForeignWriter(p, (
                    "changed during the connector's step though it was there "
                    "before it (another program writes in the store folder, or "
                    "the connector rewrote an older file)"))
                run_store.note_foreign_writer(self.root, p)
                raise self.foreign
        new = sorted(p for p in now if p not in mark)
        # a file that appeared beside the connector's entries but holds none of the
        # harness's KV is another writer's (or an index): never damaged. A store
        # whose entries hold no recognisable KV (compressed, encrypted) keeps the
        # time-based attribution above.
        kv = [p for p in new if carries_harness_kv(p)]
        if kv:
            self.not_kv.extend(p for p in new if p not in kv)
            new = kv
        for p in new:
            self._seen[p] = now[p]
        return new

    @staticmethod
    def _identity(p: Path) -> Identity:
        st = p.lstat()
        if not stat.S_ISREG(st.st_mode):
            raise FileNotFoundError(p)
        return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)

    def _mine(self, entries: Iterable[Path]) -> list[Path]:
        """The entries recorded as the connector's that are still that same file."""
        out = []
        for p in entries:
            p = Path(p)
            if p not in self._seen or not p.is_relative_to(self.root):
                continue
            try:
                same = self._seen[p] == self._identity(p)
            except OSError:
                same = False
            if same:
                out.append(p)
            elif p.exists() or p.is_symlink():
                self.refused.append(p)
        return out

    def _remember(self, p: Path) -> None:
        """The file as this injector left it (its own write is no other writer's)."""
        with contextlib.suppress(OSError):
            self._seen[p] = self._identity(p)

    def lose(self, entries: Iterable[Path]) -> None:
        """Delete the entries' files."""
        for p in self._mine(entries):
            p.unlink(missing_ok=True)
            self._seen.pop(p, None)

    def corrupt(self, entries: Iterable[Path]) -> None:
        """Flip one bit in 8 bytes spread over the last quarter of one file.

        The entry's largest file (its KV, not an index beside it): a store that
        checks only its manifest loads the damaged KV silently.
        """
        mine = self._mine(entries)
        largest = sorted(mine, key=lambda q: (-q.stat().st_size, str(q)))[:1]
        for p in largest:
            fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW)
            with os.fdopen(fd, "r+b") as f:
                data = bytearray(f.read())
                lo = len(data) * 3 // 4
                for i in range(8):
                    j = lo + (len(data) - lo) * i // 8
                    if j < len(data):
                        data[j] ^= 0x40
                f.seek(0)
                f.write(bytes(data))
            self._remember(p)

    def tear(self, entries: Iterable[Path]) -> None:
        """Truncate each file to half its size (a torn write)."""
        for p in self._mine(entries):
            fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW)
            with os.fdopen(fd, "r+b") as f:
                f.truncate(os.fstat(fd).st_size // 2)
            self._remember(p)

    @contextlib.contextmanager
    def failing_saves(self, worker: Any) -> Iterator[None]:
        """Every save of ``worker`` (a ConnectorWorker) fails while inside."""
        import resource

        c = worker.connector
        names = ("save_kv_layer", "wait_for_save")
        saved = {n: getattr(c, n) for n in names}

        def failing(fn: Callable[..., Any]) -> Callable[..., Any]:
            def call(*a: Any, **kw: Any) -> Any:
                old = resource.getrlimit(resource.RLIMIT_FSIZE)
                resource.setrlimit(resource.RLIMIT_FSIZE,
                                   (self.FAILED_WRITE_LIMIT, old[1]))
                try:
                    return fn(*a, **kw)
                finally:
                    resource.setrlimit(resource.RLIMIT_FSIZE, old)
            return call

        for n in names:
            setattr(c, n, failing(saved[n]))
        try:
            yield
        finally:
            for n in names:
                setattr(c, n, saved[n])


class ObjectStoreInjector:
    """Damages a store that is a Python object of the scheduler-side connector.

    The store index is the dict (within :data:`MAX_DEPTH` attribute levels) that
    grew when a prompt was stored, preferring one whose owner has ``remove(key)``
    (keeps a cache policy's books), then the largest growth. ``tear`` removes the
    later half (insertion order). It acts before the lookup
    (``between_lookup_and_load = False``: vLLM plans the load in the lookup's
    ``schedule()`` call), as an eviction.
    """

    kinds = frozenset({"lose", "tear"})
    between_lookup_and_load = False
    MAX_DEPTH = 4

    def __init__(self, connector: Any) -> None:
        self.connector = connector

    def _mappings(self) -> list[tuple[Any, dict[Any, Any]]]:
        """(owner, dict) for every dict attribute reachable from the connector."""
        seen: set[int] = set()
        out: list[tuple[Any, dict[Any, Any]]] = []

        def walk(obj: Any, depth: int) -> None:
            if id(obj) in seen or depth > self.MAX_DEPTH:
                return
            seen.add(id(obj))
            attrs = getattr(obj, "__dict__", None)
            if not isinstance(attrs, dict) or type(obj).__module__.startswith(
                    ("torch", "builtins")):
                return
            for v in attrs.values():
                if isinstance(v, dict):
                    out.append((obj, v))
                else:
                    walk(v, depth + 1)

        walk(self.connector, 0)
        return out

    def mark(self) -> dict[int, set[Any]]:
        """Every reachable dict's keys."""
        return {id(m): set(m) for _, m in self._mappings()}

    def entries_since(self, mark: dict[int, set[Any]]
                      ) -> list[tuple[Callable[[Any], Any], Any]]:
        """(remover, key) for the new keys of the dict that grew the most."""
        grown = []
        for owner, m in self._mappings():
            before = mark.get(id(m), set())
            new = [k for k in list(m) if k not in before]
            remove = getattr(owner, "remove", None)
            if new:
                grown.append((callable(remove), len(new), owner, m, new))
        if not grown:
            return []
        owned, _, owner, m, new = max(grown, key=lambda g: (g[0], g[1]))
        rm = owner.remove if owned else (lambda k, _m=m: _m.pop(k, None))
        return [(rm, k) for k in new]

    def lose(self, entries: Sequence[tuple[Callable[[Any], Any], Any]]) -> None:
        """Remove every entry."""
        for remove, k in entries:
            remove(k)

    def tear(self, entries: Sequence[tuple[Callable[[Any], Any], Any]]) -> None:
        """Remove the later half of the entries (insertion order)."""
        self.lose(list(entries)[len(entries) // 2:])


def fault_injector_for(profile: Any, rig: Any) -> Any:
    """The store fault injector for a rig: the profile's hook, else a built-in.

    ``connector.fault_injector = "module:function"`` is called with the rig (an
    injector has ``kinds``, ``between_lookup_and_load``, ``mark``,
    ``entries_since`` and one method per kind). Else a :class:`FileStoreInjector`
    on the first directory path in
    ``kv_connector_extra_config`` (made when missing under a folder this run
    made), else an :class:`ObjectStoreInjector`, or None where a server holds the
    KV (:func:`server_held_store`).

    Raises:
        FaultConfigError: the hook cannot be imported or called, or a store path
            lies in no folder this run created.

    """
    import pkgutil

    spec = ""
    try:
        spec = profile["connector"]["fault_injector"]
    except KeyError:
        pass
    if spec:
        try:
            return pkgutil.resolve_name(spec)(rig)
        except (ImportError, AttributeError, TypeError, ValueError) as exc:
            raise FaultConfigError(
                f"connector.fault_injector = {spec!r}: {type(exc).__name__}: {exc}"
            ) from None
    extra = rig.vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    for v in _strings(extra):
        found = run_store.resolved_path_of(v)
        if found is None:
            continue
        # a templated part (rank{LOCAL_RANK}) is the connector's: watch above it
        path = store_base(found)
        if path.parent == path:
            continue
        if path.exists() and not path.is_dir():
            continue
        # a store folder not made yet (the exploration's per-sequence stores) is
        # one when this run made a folder above it
        if run_store.made_in_this_run(path) is not None:
            path.mkdir(parents=True, exist_ok=True)
            return FileStoreInjector(path)
        if run_store.owned_ancestor(path) is not None or path.parent.is_dir():
            raise FaultConfigError(
                f"kv_connector_extra_config path {v!r} is in no folder this run "
                f"created (no {run_store.OWNER_MARKER} marker of this process at or "
                "above it): the store-fault tests damage only what the connector "
                "wrote in the suite's own folders of this run")
    if server_held_store(profile):
        return None  # its store is another process's memory, not an object here
    conn = rig.scheduler.connector
    return ObjectStoreInjector(getattr(conn, "inner", conn))


def server_held_store(profile: Any) -> str:
    """The ``[kv_server]`` kind whose process holds the connector's KV, or ''.

    Such a store (LMCache's multiprocess server, Mooncake's master) is out of
    reach of :class:`ObjectStoreInjector`: the connector object's dicts are its
    books, not its KV.
    """
    try:
        return str(profile["kv_server"]["kind"] or "")
    except (KeyError, TypeError):
        return ""


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, Mapping):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str) and value:
        yield value
