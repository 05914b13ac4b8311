"""A pool of ``vllm serve`` processes sharing the run's GPUs, started concurrently.

A server is a spec (:meth:`tvc.procs.vllm_server.VllmServer.spec_key`). The pool
prestarts known specs in the background (:meth:`ServerPool.prestart`, at most
``max_starting`` at once), shares a server between the tests of one spec
(:meth:`ServerPool.register` / :meth:`ServerPool.release`), places servers by
``CUDA_VISIBLE_DEVICES``, keeps KV + weights + :data:`SERVER_OVERHEAD_BYTES` within each
GPU's free memory and ``cpu_bytes_to_use`` within host RAM (queues what does not fit
now, refuses what never will), and records events in a
:class:`tvc.core.timeline.Timeline`.

Each server gets a fixed ``--kv-cache-memory-bytes`` (:func:`kv_cache_bytes`) and its
share as ``--gpu-memory-utilization``: with the latter alone, concurrent memory
profiling races (one of four servers got 0.32 GiB of KV cache on the H200). vLLM
0.26-0.33 skip profiling with the flag (``vllm/v1/worker/gpu_worker.py``
``determine_available_memory``; ``CacheConfig.kv_cache_memory_bytes``) but still refuse
to start below ``total x gpu_memory_utilization`` free (``vllm/v1/worker/utils.py``
``request_memory``). Wired into a run by :mod:`tvc.fixtures.vllm`.
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
# Per-server GPU memory beside weights and KV cache: CUDA context and cuBLAS workspaces
# (about 0.5 GiB per process on an H100/H200 in nvidia-smi), first forward passes'
# activations and allocator slack. An upper bound for the tiny models (enforce-eager);
# larger models' activation peak (--max-num-batched-tokens) is not modelled.
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

    ``2 x num_hidden_layers x num_key_value_heads x head_dim x dtype bytes`` from
    ``config.json`` (``head_dim`` or ``hidden_size / num_attention_heads``; dtype from
    ``--kv-cache-dtype``, ``--dtype``, the config's ``torch_dtype``/``dtype``, else 2
    bytes). The tiny Llama: 2 x 4 x 2 x 64 x 2 = 2048 bytes.

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

    Estimated from config.json at 2 bytes per parameter with ``--load-format dummy`` or
    no ``*.safetensors``/``*.bin``/``*.pt`` file.
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
    """The KV cache size in bytes the pool gives a server (``--kv-cache-memory-bytes``).

    The serve args' own value when set; else ``kv_bytes_per_token x max-model-len x``
    :data:`KV_CACHE_SEQUENCES`, at least :data:`MIN_KV_CACHE_BYTES` and what
    ``--num-gpu-blocks-override`` blocks need (``--block-size``, default 16).

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
    """OffloadingConnector's ``cpu_bytes_to_use`` (pinned host RAM, bytes), or 0.

    Nested tables count too (a wrapped connector's ``inner``); the largest value wins.
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
    """What one server takes while it runs (bytes, per GPU; weights split over TP).

    ``gpus`` is its tensor-parallel size, ``kv_bytes`` its ``--kv-cache-memory-bytes``,
    ``overhead_bytes`` :data:`SERVER_OVERHEAD_BYTES` by default, ``cpu_bytes`` host RAM
    for CPU KV buffers; ``whole_gpu`` servers run alone.
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
    """One GPU the pool may use (sizes in bytes).

    ``index`` is the CUDA index (PCI bus order); ``capacity_bytes`` what the pool may
    hand out; ``total_bytes`` the device's memory (for ``--gpu-memory-utilization``).
    """

    index: int
    capacity_bytes: int
    total_bytes: int
    used_bytes: int = 0
    holders: set[str] = field(default_factory=set)
    whole: bool = False


def query_gpus(selected: Sequence[int] | None = None) -> list[Gpu]:
    """The GPUs with their free memory, from ``nvidia-smi`` (PCI bus order).

    ``selected`` (``--tvc-gpus``) None keeps every GPU ``CUDA_VISIBLE_DEVICES`` leaves
    visible. ``capacity_bytes`` is :data:`GPU_FREE_FRACTION` of free memory. Empty
    without nvidia-smi or when ``CUDA_VISIBLE_DEVICES`` uses UUIDs or MIG names (then
    servers run one at a time).
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

    Empty ``gpus`` (:func:`query_gpus`): no accounting, one start at a time, no
    placement. ``host_bytes`` defaults to :data:`HOST_FREE_FRACTION` of psutil's
    available memory; ``max_starting`` bounds background starts only;
    ``queue_timeout_s`` is seconds a start may wait for memory.
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

        ``users`` are test node ids; :meth:`release` of the last one stops it. ``order``
        is the background start priority (lower first).
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

        Returns True when stopped. With ``stop`` False it stays up (the pool may evict
        it).
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

        Called by :meth:`VllmServer.start`; without GPUs only ``max_starting`` bounds
        it.

        Raises:
            ServerError: it can never fit (naming the spec and the numbers), or it
                waited ``queue_timeout_s`` (naming the servers holding memory).

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

        Idle: running, started, and unclaimed-prestarted or claimed with no user left.
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
        """Stop every server (those still starting too); return psutil survivors."""
        with self._cv:
            self.closed = True
            servers = list(self._servers.values())
            self._cv.notify_all()
        left: list[Any] = []
        for srv in servers:
            srv.stop()
            left += srv.leftovers()
        return left
