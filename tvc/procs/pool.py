"""A pool of ``vllm serve`` processes sharing the run's GPUs, started concurrently.

A server the run needs is a spec: model, serve args, ``--kv-transfer-config``,
environment (:meth:`tvc.procs.vllm_server.VllmServer.spec_key`). The pool

- starts the specs known at collection **concurrently** in the background
  (:meth:`ServerPool.prestart`), first-needed first, at most ``max_starting`` at a
  time (each start is CPU-bound: imports and engine set-up);
- gives each server a **fixed KV cache** (``--kv-cache-memory-bytes``, from the
  model's bytes per token, :func:`kv_cache_bytes`) and a ``--gpu-memory-utilization``
  of its own share, so the engines' memory profiling cannot race (seen on the H200:
  with ``--gpu-memory-utilization`` alone, one of four concurrent servers got 0.32 GiB
  of KV cache; with ``--kv-cache-memory-bytes`` 2 GiB each, six were healthy in
  31-35 s, one alone in 30 s). vLLM 0.26-0.33 accept the flag
  (``vllm/engine/arg_utils.py``, ``CacheConfig.kv_cache_memory_bytes``) and skip the
  profiling run with it (``vllm/v1/worker/gpu_worker.py``,
  ``determine_available_memory``); they still refuse to start when the GPU's free
  memory is below ``total x gpu_memory_utilization`` (``vllm/v1/worker/utils.py``,
  ``request_memory``), hence the share;
- keeps the sum of KV bytes, weights and :data:`SERVER_OVERHEAD_BYTES` per server
  within each GPU's free memory, and OffloadingConnector's ``cpu_bytes_to_use``
  within host RAM (psutil), **queues** what does not fit now and **refuses** (one
  :class:`ServerError` naming the spec) what can never fit;
- places servers on the selected GPUs (``CUDA_VISIBLE_DEVICES`` per server; a
  ``--tensor-parallel-size N`` server takes N GPUs; a ``whole_gpu`` server gets a
  GPU no other server uses while it runs);
- shares a server between the tests of one spec (:meth:`ServerPool.register`
  returns the one already there) and stops it after its last planned user
  (:meth:`ServerPool.release`);
- records every server's queue, start, ready and stop in a
  :class:`tvc.core.timeline.Timeline`.

Works without pytest; :mod:`tvc.fixtures.vllm` wires it into a run.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tvc.core.timeline import Timeline
from tvc.procs.client import ServerError
from tvc.procs.polling import PollTimeout, wait_until

GiB = 1 << 30
# Per-server GPU memory beside weights and KV cache: the CUDA context and cuBLAS
# workspaces (about 0.5 GiB per process on an H100/H200 in nvidia-smi), the
# activations of the first forward passes and torch's allocator slack. An upper
# bound for the suite's tiny models (enforce-eager); larger models add their
# activation peak through --max-num-batched-tokens, which this does not model.
SERVER_OVERHEAD_BYTES = 2 * GiB
# The smallest KV cache the pool gives a server: 2 GiB each for six concurrent
# tiny-model servers on the H200 (all healthy in 31-35 s, identical greedy output).
MIN_KV_CACHE_BYTES = 2 * GiB
# Requests of max-model-len tokens the KV cache holds at once by default: the e2e
# concurrency wave sends 16 (tvc.e2e.acceptance.DEFAULT_CONCURRENCY).
KV_CACHE_SEQUENCES = 16
# Fraction of a GPU's free memory (nvidia-smi, at pool creation) the pool hands out;
# the rest absorbs estimate errors and other processes' growth.
GPU_FREE_FRACTION = 0.92
QUEUE_POLL_S = 1.0  # longest wait for GPU memory between looks (notify wakes sooner)
HOST_FREE_FRACTION = 0.8  # of psutil's available host memory, for CPU KV buffers
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "half": 2, "float32": 4, "float": 4,
               "float8": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "auto": 2}
CPU_BYTES_KEY = "cpu_bytes_to_use"  # OffloadingConnector's CPU buffer (bytes)


# ------------------------------------------------------------------------- sizing

def last_arg(args: Sequence[str], *flags: str) -> str | None:
    """The value of the last ``flag V`` / ``flag=V`` of ``flags`` in ``args``."""
    value: str | None = None
    for i, a in enumerate(args):
        for flag in flags:
            if a == flag and i + 1 < len(args):
                value = args[i + 1]
            elif a.startswith(flag + "="):
                value = a.split("=", 1)[1]
    return value


def parse_bytes(text: str, key: str) -> int:
    """Bytes from ``123``, ``2G``/``2GiB``/``512M``/``1.5g`` (binary units).

    Raises:
        ServerError: not a size, naming ``key``.

    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", text, re.I)
    if not m:
        raise ServerError(f"{key} {text!r}: expected a size in bytes (e.g. "
                          "2147483648 or 2G)")
    scale = 1 << (10 * " kmgt".index((m.group(2) or " ").lower()))
    return int(float(m.group(1)) * scale)


def _text_config(model_dir: Path) -> dict[str, Any]:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return {**cfg, **cfg.get("text_config", {})}


def kv_bytes_per_token(model_dir: Path, serve_args: Sequence[str] = ()) -> int:
    """KV cache bytes of one token across all layers (K and V), per GPU at TP = 1.

    ``2 x num_hidden_layers x num_key_value_heads x head_dim x dtype bytes`` from the
    model's ``config.json`` (``head_dim`` or ``hidden_size / num_attention_heads``;
    dtype from ``--kv-cache-dtype``, else ``--dtype``, else the config's
    ``torch_dtype``/``dtype``; 2 bytes when unknown). The tiny Llama: 2 x 4 x 2 x 64
    x 2 = 2048 bytes.

    Raises:
        ServerError: the folder has no readable config.json.

    """
    try:
        cfg = _text_config(model_dir)
    except (OSError, ValueError) as exc:
        raise ServerError(f"model {model_dir}: cannot read config.json ({exc}) to "
                          "size the KV cache") from None
    layers = int(cfg.get("num_hidden_layers") or cfg.get("n_layer") or 1)
    heads = int(cfg.get("num_attention_heads") or cfg.get("n_head") or 1)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", 64)) // heads)
    dtype = (last_arg(serve_args, "--kv-cache-dtype") or "auto").lower()
    if dtype == "auto":
        dtype = (last_arg(serve_args, "--dtype")
                 or str(cfg.get("torch_dtype") or cfg.get("dtype") or "auto")).lower()
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 2)


def weight_bytes(model_dir: Path, serve_args: Sequence[str] = ()) -> int:
    """Bytes of the model's weights: the weight files' sizes, or an estimate.

    With ``--load-format dummy`` or no ``*.safetensors``/``*.bin``/``*.pt`` file in
    the folder, the parameter count is estimated from config.json (embeddings,
    attention and MLP of every layer) at 2 bytes each.
    """
    p = Path(model_dir)
    files = [f for pat in ("*.safetensors", "*.bin", "*.pt") for f in p.glob(pat)]
    if files and last_arg(serve_args, "--load-format") != "dummy":
        return sum(f.stat().st_size for f in files)
    try:
        cfg = _text_config(p)
    except (OSError, ValueError):
        return 0
    h = int(cfg.get("hidden_size", 0))
    inter = int(cfg.get("intermediate_size") or 4 * h)
    layers = int(cfg.get("num_hidden_layers", 0))
    heads = int(cfg.get("num_attention_heads") or 1)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or (h // heads if heads else 0))
    vocab = int(cfg.get("vocab_size", 0))
    per_layer = h * hd * (2 * heads + 2 * kv_heads) + 3 * h * inter
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return 2 * (embed + layers * per_layer)


def kv_cache_bytes(model_dir: Path, serve_args: Sequence[str]) -> int:
    """The KV cache size the pool gives a server (``--kv-cache-memory-bytes``).

    The serve args' own ``--kv-cache-memory-bytes`` when set (the profile's choice);
    else ``kv_bytes_per_token x max-model-len x`` :data:`KV_CACHE_SEQUENCES`, at
    least :data:`MIN_KV_CACHE_BYTES`, and at least what ``--num-gpu-blocks-override``
    blocks need (``--block-size``, default 16).

    Raises:
        ServerError: a size that does not parse, or an unreadable config.json.

    """
    explicit = last_arg(serve_args, "--kv-cache-memory-bytes")
    if explicit is not None:
        return parse_bytes(explicit, "--kv-cache-memory-bytes")
    bpt = kv_bytes_per_token(model_dir, serve_args)
    max_len = last_arg(serve_args, "--max-model-len", "--max_model_len")
    try:
        tokens = int(max_len) if max_len else int(_text_config(model_dir).get(
            "max_position_embeddings", 2048))
    except ValueError:
        raise ServerError(f"--max-model-len {max_len!r} is not an integer") from None
    need = max(MIN_KV_CACHE_BYTES, bpt * tokens * KV_CACHE_SEQUENCES)
    blocks = last_arg(serve_args, "--num-gpu-blocks-override")
    if blocks and blocks.isdigit():
        block = last_arg(serve_args, "--block-size")
        need = max(need, int(blocks) * int(block if block and block.isdigit()
                                           else 16) * bpt)
    return need


def tensor_parallel_size(serve_args: Sequence[str]) -> int:
    """``--tensor-parallel-size`` / ``-tp`` of the args (1 when absent)."""
    value = last_arg(serve_args, "--tensor-parallel-size", "-tp")
    return int(value) if value and value.isdigit() and int(value) > 0 else 1


def cpu_buffer_bytes(kv_transfer_config: Mapping[str, Any] | None) -> int:
    """OffloadingConnector's ``cpu_bytes_to_use`` (host RAM it pins), or 0.

    Searched through nested tables too (a wrapped connector's ``inner`` config,
    :func:`tvc.contract.faults.wrap_kv_transfer_config`); the largest value counts.
    """
    found: list[int] = []

    def walk(node: Any) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                if k == CPU_BYTES_KEY:
                    with contextlib.suppress(TypeError, ValueError):
                        found.append(int(v))
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk((kv_transfer_config or {}).get("kv_connector_extra_config"))
    return max(found, default=0)


@dataclass(frozen=True)
class Need:
    """What one server takes while it runs.

    Attributes:
        gpus: GPUs it spans (its tensor-parallel size).
        kv_bytes: KV cache per GPU (bytes, ``--kv-cache-memory-bytes``).
        weight_bytes: weights per GPU (bytes; split over the TP ranks).
        overhead_bytes: :data:`SERVER_OVERHEAD_BYTES` unless told otherwise.
        cpu_bytes: host RAM for CPU KV buffers (bytes).
        whole_gpu: it must run alone on its GPU(s).

    """

    gpus: int = 1
    kv_bytes: int = MIN_KV_CACHE_BYTES
    weight_bytes: int = 0
    overhead_bytes: int = SERVER_OVERHEAD_BYTES
    cpu_bytes: int = 0
    whole_gpu: bool = False

    @property
    def per_gpu_bytes(self) -> int:
        """GPU memory on each of its GPUs (bytes)."""
        return self.kv_bytes + self.weight_bytes + self.overhead_bytes


def need_of(srv: Any) -> Need:
    """The :class:`Need` of a :class:`~tvc.procs.vllm_server.VllmServer` (its spec)."""
    args = list(srv.serve_args)
    tp = tensor_parallel_size(args)
    model = Path(srv.model)
    has_config = (model / "config.json").is_file()
    kv = kv_cache_bytes(model, args) if has_config else MIN_KV_CACHE_BYTES
    weights = weight_bytes(model, args) if has_config else 0
    return Need(gpus=tp, kv_bytes=kv, weight_bytes=-(-weights // tp),
                cpu_bytes=cpu_buffer_bytes(srv.kv_transfer_config),
                whole_gpu=bool(getattr(srv, "whole_gpu", False)))


# -------------------------------------------------------------------- the GPUs

@dataclass
class Gpu:
    """One GPU the pool may use.

    Attributes:
        index: the CUDA device index (``CUDA_VISIBLE_DEVICES`` value, PCI bus order).
        capacity_bytes: memory the pool may hand out on it.
        total_bytes: the device's memory (for ``--gpu-memory-utilization``).
        used_bytes: handed out now.
        holders: names of the servers on it now.
        whole: a ``whole_gpu`` server holds it.

    """

    index: int
    capacity_bytes: int
    total_bytes: int
    used_bytes: int = 0
    holders: set[str] = field(default_factory=set)
    whole: bool = False


def query_gpus(selected: Sequence[int] | None = None) -> list[Gpu]:
    """The GPUs with their free memory, from ``nvidia-smi`` (PCI bus order).

    Args:
        selected: CUDA indices to keep (``--tvc-gpus``); None = every GPU that
            ``CUDA_VISIBLE_DEVICES`` (integer indices) leaves visible.

    Returns:
        one :class:`Gpu` each, ``capacity_bytes`` = :data:`GPU_FREE_FRACTION` of
        its free memory; empty without nvidia-smi, and when
        ``CUDA_VISIBLE_DEVICES`` names devices by UUID or MIG name (the pool
        places servers by index; without it servers run one at a time).

    """
    import os

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=index,memory.free,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and all(p.isdigit() for p in parts):
            idx, free, total = (int(p) for p in parts)
            gpus.append(Gpu(idx, int(free * (1 << 20) * GPU_FREE_FRACTION),
                            total * (1 << 20)))
    if selected is None:
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        if vis is not None:
            if not all(v.strip().isdigit() for v in vis.split(",") if v.strip()):
                return []  # UUIDs or MIG names: no placement by index (no pool)
            selected = [int(v) for v in vis.split(",") if v.strip()]
    if selected is not None:
        keep = {i: n for n, i in enumerate(selected)}
        gpus = sorted((g for g in gpus if g.index in keep), key=lambda g: keep[g.index])
    return gpus


def parse_gpus(text: str) -> list[int] | None:
    """``--tvc-gpus`` value: ``all`` (None) or comma-separated CUDA indices.

    Raises:
        ValueError: anything else (the message says what is expected).

    """
    text = text.strip()
    if text == "all":
        return None
    parts = [p.strip() for p in text.split(",")]
    if not text or not all(p.isdigit() for p in parts):
        raise ValueError(f"{text!r}: expected 'all' or CUDA device indices such as "
                         "0 or 0,1")
    out = [int(p) for p in parts]
    if len(set(out)) != len(out):
        raise ValueError(f"{text!r}: a GPU is listed twice")
    return out


# --------------------------------------------------------------------- the pool

class ServerPool:
    """Starts, places, shares and stops the run's vLLM servers (see the module doc).

    Args:
        gpus: the GPUs to use (:func:`query_gpus`); empty: no GPU accounting, one
            server starts at a time and none is placed (the old behaviour).
        host_bytes: host RAM the pool may give CPU KV buffers; default
            :data:`HOST_FREE_FRACTION` of psutil's available memory.
        max_starting: servers starting at once (background starts); a foreground
            start (a test waiting) is not held back by it.
        timeline: where server events go (a new one by default).
        need: ``(server) -> Need``; default :func:`need_of`.
        queue_timeout_s: how long a start may wait for memory before it fails.

    """

    def __init__(self, gpus: Sequence[Gpu], host_bytes: int | None = None, *,
                 max_starting: int = 8, timeline: Timeline | None = None,
                 need: Callable[[Any], Need] = need_of,
                 queue_timeout_s: float = 900.0) -> None:
        self.gpus = list(gpus)
        self.host_bytes = (int(psutil.virtual_memory().available * HOST_FREE_FRACTION)
                           if host_bytes is None else host_bytes)
        self.host_used = 0
        self.max_starting = max(1, max_starting)
        self.timeline = timeline or Timeline()
        self._need = need
        self.queue_timeout_s = queue_timeout_s
        self._cv = threading.Condition()
        self._servers: dict[str, Any] = {}  # spec key -> server
        self._order: dict[str, int] = {}  # spec key -> first planned use
        self._users: dict[str, set[str]] = {}  # spec key -> planned users left
        self._placed: dict[int, tuple[list[int], Need]] = {}  # id(server) -> place
        self._starting: set[int] = set()  # id(server) of starts under way
        self._urgent: set[int] = set()
        self._waiting: dict[int, int] = {}  # id(server) -> order, background starts
        self.closed = False

    # -- registry ---------------------------------------------------------------
    def register(self, srv: Any, users: Iterable[str] = (), order: int | None = None
                 ) -> Any:
        """Return the pool's server of ``srv``'s spec (``srv`` itself when new).

        Args:
            srv: a :class:`tvc.procs.vllm_server.VllmServer` (not started).
            users: names (test node ids) that will use it; :meth:`release` of the
                last one stops it.
            order: priority of its background start (lower first).

        """
        key = srv.spec_key()
        with self._cv:
            have = self._servers.get(key)
            if have is None:
                taken = {s.name for s in self._servers.values()}
                base, n = srv.name, 1
                while srv.name in taken:
                    n += 1
                    srv.name = f"{base}-{n}"
                srv.pool = self
                self._servers[key] = have = srv
                self._order[key] = order if order is not None else len(self._order)
            elif order is not None:
                self._order[key] = min(self._order[key], order)
            self._users.setdefault(key, set()).update(users)
        return have

    def get(self, srv: Any) -> Any:
        """The registered server of ``srv``'s spec, or ``srv`` registered now."""
        return self.register(srv)

    def servers(self) -> list[Any]:
        """Every registered server, first planned use first."""
        with self._cv:
            return sorted(self._servers.values(),
                          key=lambda s: self._order[s.spec_key()])

    def prestart(self, servers: Iterable[Any] | None = None) -> None:
        """Start ``servers`` (default: every registered one) in the background."""
        for srv in list(servers) if servers is not None else self.servers():
            if not srv.is_alive() and not srv.start_pending():
                srv.start_in_background()

    def release(self, srv: Any, user: str | Iterable[str], stop: bool = True
                ) -> bool:
        """``user`` is done with ``srv``: stop it when no planned user is left.

        Args:
            srv: a server of the pool.
            user: the name it was registered with (a test node id), or several.
            stop: stop it when ``user`` was the last (else it stays up, and the
                pool may stop it to make room).

        Returns:
            True when it was stopped.

        """
        key = srv.spec_key()
        with self._cv:
            left = self._users.get(key, set())
            left.difference_update([user] if isinstance(user, str) else user)
            if left or not stop:
                return False
        srv.stop()
        return True

    # -- admission ---------------------------------------------------------------
    def _fit(self, need: Need) -> list[int] | None:
        """GPU indices (positions in self.gpus) where ``need`` fits now, or None."""
        if need.cpu_bytes and self.host_used + need.cpu_bytes > self.host_bytes:
            return None
        ok = [i for i, g in enumerate(self.gpus)
              if not g.whole and g.used_bytes + need.per_gpu_bytes <= g.capacity_bytes
              and (not need.whole_gpu or not g.holders)]
        if len(ok) < need.gpus:
            return None
        ok.sort(key=lambda i: self.gpus[i].capacity_bytes - self.gpus[i].used_bytes,
                reverse=True)
        return sorted(ok[:need.gpus])

    def _never_fits(self, srv: Any, need: Need) -> str:
        if need.gpus > len(self.gpus):
            return (f"it needs {need.gpus} GPUs (--tensor-parallel-size) and the run "
                    f"has {len(self.gpus)} (--tvc-gpus)")
        best = sorted((g.capacity_bytes for g in self.gpus), reverse=True)
        if best[need.gpus - 1] < need.per_gpu_bytes:
            return (f"it needs {need.per_gpu_bytes / GiB:.1f} GiB per GPU (KV cache "
                    f"{need.kv_bytes / GiB:.1f} GiB + weights "
                    f"{need.weight_bytes / GiB:.2f} GiB + "
                    f"{need.overhead_bytes / GiB:.1f} GiB per-server overhead) and "
                    f"the largest free share of a GPU is {best[0] / GiB:.1f} GiB; "
                    "lower --kv-cache-memory-bytes in the profile's serve_args or "
                    "free the GPU")
        if need.cpu_bytes > self.host_bytes:
            return (f"its CPU KV buffer ({CPU_BYTES_KEY} = {need.cpu_bytes / GiB:.1f} "
                    f"GiB) exceeds the host RAM the pool may use "
                    f"({self.host_bytes / GiB:.1f} GiB)")
        return ""

    def admit(self, srv: Any) -> None:
        """Block until ``srv`` fits, reserve its memory and place it (env, args).

        Called by :meth:`VllmServer.start`. Without GPUs (``gpus`` empty) only
        ``max_starting`` bounds it and nothing is placed.

        Raises:
            ServerError: it can never fit (naming the spec and the numbers), or
                it waited ``queue_timeout_s`` (naming the servers holding memory).

        """
        need = self._need(srv)
        name = srv.name
        with self._cv:
            if self.closed:
                raise ServerError(f"server {name}: the pool is closed")
            if self.gpus:
                why = self._never_fits(srv, need)
                if why:
                    self.timeline.event(name, "error", message=why)
                    raise ServerError(f"server {name} cannot start: {why}")
            urgent = threading.current_thread() is threading.main_thread()
            queued = False
            order = self._order.get(srv.spec_key(), len(self._order))
            self._waiting[id(srv)] = order

            def placed() -> tuple[list[int]] | None:
                """``(GPU indices,)`` once ``srv`` has room and a start slot.

                Called under ``_cv``; the tuple is truthy also for no GPUs.
                """
                nonlocal urgent, queued
                while True:
                    urgent = urgent or id(srv) in self._urgent
                    if urgent:  # a test waits on it: not in the background queue
                        self._waiting.pop(id(srv), None)
                    place = self._fit(need) if self.gpus else []
                    first = order <= min(self._waiting.values(), default=order)
                    slot = urgent or (first
                                      and len(self._starting) < self.max_starting)
                    if place is not None and slot:
                        return (place,)
                    if not queued:
                        self.timeline.event(name, "queued")
                        queued = True
                    if self.closed:
                        self._waiting.pop(id(srv), None)
                        raise ServerError(f"server {name}: the pool closed while it "
                                          "waited for GPU memory")
                    if urgent and place is None and self._evict_one(exclude=srv):
                        continue  # room was made: look again at once
                    return None

            try:  # woken early by notify_all when a server stops or is placed
                got = wait_until(placed, self.queue_timeout_s, QUEUE_POLL_S,
                                 f"GPU memory for server {name}", sleep=self._cv.wait)
            except PollTimeout:
                self._waiting.pop(id(srv), None)
                held = ", ".join(sorted(h for g in self.gpus for h in g.holders))
                raise ServerError(
                    f"server {name}: waited {self.queue_timeout_s:.0f} s for "
                    f"{need.per_gpu_bytes / GiB:.1f} GiB of GPU memory; held by "
                    f"{held or 'no server of the pool'}") from None
            place = got[0]
            for i in place:
                g = self.gpus[i]
                g.used_bytes += need.per_gpu_bytes
                g.holders.add(name)
                g.whole = g.whole or need.whole_gpu
            self.host_used += need.cpu_bytes
            self._placed[id(srv)] = (place, need)
            self._starting.add(id(srv))
            self._waiting.pop(id(srv), None)
            self._cv.notify_all()
            self._urgent.discard(id(srv))
        if self.gpus:
            devices = [self.gpus[i] for i in place]
            srv.placement_env = {"CUDA_VISIBLE_DEVICES": ",".join(
                str(g.index) for g in devices), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
            share = max(need.per_gpu_bytes / min(g.total_bytes for g in devices), 0.01)
            args = []
            if last_arg(srv.serve_args, "--kv-cache-memory-bytes") is None:
                args += ["--kv-cache-memory-bytes", str(need.kv_bytes)]
            args += ["--gpu-memory-utilization", f"{math.ceil(share * 100) / 100:.2f}"]
            srv.placement_args = args
            gpu_text = ",".join(str(g.index) for g in devices)
        else:
            gpu_text = None
        self.timeline.event(name, "start", gpus=gpu_text, key=srv.spec_key()[:12],
                            log=str(srv.log_path),
                            kv_bytes=need.kv_bytes if self.gpus else None)

    def started(self, srv: Any, ok: bool, error: str = "") -> None:
        """Called by the server after its start ended (healthy or failed)."""
        with self._cv:
            self._starting.discard(id(srv))
            self._cv.notify_all()
        if ok:
            self.timeline.event(srv.name, "ready", startup_s=round(srv.startup_s, 1))
        else:
            self.timeline.event(srv.name, "error", message=error)

    def left(self, srv: Any) -> None:
        """Called by the server when it stopped: free its memory, wake the queue."""
        with self._cv:
            self._starting.discard(id(srv))
            placed = self._placed.pop(id(srv), None)
            if placed is not None:
                place, need = placed
                for i in place:
                    g = self.gpus[i]
                    g.used_bytes -= need.per_gpu_bytes
                    g.holders.discard(srv.name)
                    if need.whole_gpu:
                        g.whole = False
                self.host_used -= need.cpu_bytes
            self._cv.notify_all()
        if placed is not None:
            self.timeline.event(srv.name, "stop")

    def hurry(self, srv: Any) -> None:
        """A test waits for ``srv``'s background start: let it evict, jump the queue."""
        with self._cv:
            self._urgent.add(id(srv))
            self._cv.notify_all()

    def _evict_one(self, exclude: Any) -> bool:
        """Stop an idle server, the one needed last (lock held).

        Idle: running, started, and either prestarted and not claimed yet, or
        claimed with no planned user left.
        """
        idle = [s for s in self._servers.values()
                if s is not exclude and s.is_alive() and id(s) in self._placed
                and id(s) not in self._starting
                and (not s.claimed or not self._users.get(s.spec_key()))]
        if not idle:
            return False
        victim = max(idle, key=lambda s: self._order[s.spec_key()])
        self._cv.release()
        try:
            with contextlib.suppress(Exception):
                victim.log_note("stopped by the pool to make room for a server a "
                                "test waits on; it starts again when needed")
            victim.stop()
        finally:
            self._cv.acquire()
        return True

    def close(self) -> list[Any]:
        """Stop every server (those still starting too).

        Returns:
            the psutil processes that outlived their server's stop.

        """
        with self._cv:
            self.closed = True
            servers = list(self._servers.values())
            self._cv.notify_all()
        left: list[Any] = []
        for srv in servers:
            srv.stop()
            left += srv.leftovers()
        return left
