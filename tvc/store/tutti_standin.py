"""The suite's stand-in for a Tutti KV store: device memory, torch copies, CUDA events.

Tutti's engine (xPU-IO/Tutti ``integration/vllm-connector``, 33a8fb8: ``engine/core.py``
``KVEngine``) moves layer segments between its staging ring (``engine/staging.py``
``RingWindow``) and a ``KVStore`` (``stores/base.py``). No public store serves a CUDA
worker without NVMe (``MemoryKVStore`` needs ``memoryview()`` and lacks
``wait_write_event``), so this one implements the protocol in device memory:
``put_batch``/``get_batch`` copy with torch on the store's write/read stream; the put
path is ordered only by the engine's events (as Tutti's NVMe store), the get stream also
waits for the current stream (more conservative than a real store may be).
:attr:`StandInKVStore.stats` counts what moved; reports name :data:`UNDER_TEST`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

#: the store type name the suite registers in Tutti's ``stores.registry``
STANDIN_TYPE = "tvc_standin"

#: what a run with this store tests, named in every report
UNDER_TEST = ("Tutti's connector, worker and transfer kernels with the suite's "
              "stand-in store, not Tutti's NVMe store")

#: the keys of ``store.options`` the stand-in takes (``segment_bytes`` is set
#: by the connector from the KV cache config)
OPTIONS = ("num_chunks", "segment_bytes", "order", "busy_us")
#: ``store.options.order`` values: ``events`` (default) orders a put only by the
#: engine's events, as Tutti's NVMe store; ``stream`` also waits for the current
#: stream; ``sync`` syncs the device after each put/get (diagnostics).
ORDERS = ("events", "stream", "sync")
#: the most ``store.options.busy_us`` may ask (10 ms per put or get)
MAX_BUSY_US = 10_000

#: live stores of this process, for tiers that assert bytes moved
INSTANCES: list[StandInKVStore] = []


class StandInStoreError(ValueError):
    """Bad ``store.options`` for the stand-in; the message names the key."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Completion:
    """Completion handle (``stores/base.py`` ``Completion``): ``wait`` / ``query``."""

    __slots__ = ("_event",)

    def __init__(self, event: Any = None) -> None:
        self._event = event

    def wait(self) -> None:
        """Block until the batch's copies are done (a host wait on the event)."""
        if self._event is not None:
            self._event.synchronize()

    def query(self) -> bool:
        """Whether the batch's copies are done, without blocking."""
        return True if self._event is None else bool(self._event.query())


class StandInKVStore:
    """Tutti ``KVStore`` in device memory (see the module docstring).

    Args:
        segment_bytes: bytes of one layer's segment of a chunk (> 0; Tutti's connector
            sets ``chunk_kv_bytes // num_layers``).
        num_chunks: chunks the store holds (> 0, ``store.options.num_chunks``).
        order: one of :data:`ORDERS` (``store.options.order``, default ``events``).
        busy_us: microseconds of ``torch.cuda._sleep`` on the current stream before
            every put and get (0 to :data:`MAX_BUSY_US`), so host/stream races show
            every time; a timing diagnostic, no effect on CPU.
        **options: any other key is refused.

    Raises:
        StandInStoreError: a non-integer or non-positive size, an unknown ``order`` or
            option; names ``store.options.<key>``.

    Attributes:
        stats: ``puts`` / ``gets`` (segments), ``bytes_written`` / ``bytes_read``,
            ``unfenced_puts`` (CUDA puts with no ``wait_write_event`` since the previous
            put), ``buffers`` (registered; ``device`` of the last).

    """

    def __init__(self, segment_bytes: Any = None, num_chunks: Any = None,
                 order: Any = "events", busy_us: Any = 0, **options: Any) -> None:
        if not _is_int(busy_us) or not 0 <= busy_us <= MAX_BUSY_US:
            raise StandInStoreError(
                f"store.options.busy_us: expected an integer of 0 to {MAX_BUSY_US} "
                f"(microseconds), got {type(busy_us).__name__} {busy_us!r}")
        self.busy_us: int = busy_us
        self._busy_cycles: int | None = None
        if order not in ORDERS:
            raise StandInStoreError(
                f"store.options.order: expected one of {', '.join(ORDERS)}, got "
                f"{order!r}")
        self.order: str = order
        for key in options:
            raise StandInStoreError(
                f"store.options.{key}: not an option of the suite's stand-in store "
                f"(store.type = {STANDIN_TYPE!r} takes {', '.join(OPTIONS)})")
        for key, value in (("num_chunks", num_chunks),
                           ("segment_bytes", segment_bytes)):
            if not _is_int(value) or value <= 0:
                raise StandInStoreError(
                    f"store.options.{key}: expected a positive integer, got "
                    f"{type(value).__name__} {value!r}")
        self.segment_bytes: int = segment_bytes
        self.num_chunks: int = num_chunks
        self.layer_span = 1
        self.namespace = b""
        self._open = False
        self._buffers: dict[int, Any] = {}
        self._pool: Any = None
        self._rows: dict[bytes, int] = {}
        self._free: list[int] = []
        self._streams: dict[str, Any] = {}
        self._fenced = False
        self.stats: dict[str, Any] = {"puts": 0, "gets": 0, "bytes_written": 0,
                                      "bytes_read": 0, "unfenced_puts": 0,
                                      "buffers": 0, "device": ""}
        INSTANCES.append(self)

    # ------------------------------------------------------------- lifecycle
    @property
    def capacity_chunks(self) -> int:
        """Chunks the store holds (``num_chunks``)."""
        return self.num_chunks

    def set_key_namespace(self, namespace: bytes) -> None:
        """Remember the engine's key namespace (before ``open``, as Tutti's stores)."""
        if self._open:
            raise RuntimeError("stand-in store: the namespace is set before open")
        self.namespace = bytes(namespace)

    def set_layer_span(self, num_layers: int) -> None:
        """Layers per chunk: the pool holds ``num_chunks * num_layers`` segments."""
        if not _is_int(num_layers) or num_layers <= 0:
            raise ValueError(f"layer span must be a positive integer, got "
                             f"{num_layers!r}")
        if self._pool is not None and num_layers != self.layer_span:
            raise RuntimeError("stand-in store: layer span changed after the pool "
                               "was allocated")
        self.layer_span = num_layers

    def open(self) -> None:
        """Become usable; idempotent."""
        self._open = True

    def close(self) -> None:
        """Drop every segment, buffer and stream; idempotent."""
        self._open = False
        self._rows.clear()
        self._free.clear()
        self._buffers.clear()
        self._pool = None
        self._streams.clear()
        with contextlib.suppress(ValueError):
            INSTANCES.remove(self)

    def _require_open(self) -> None:
        if not self._open:
            raise RuntimeError("stand-in store is not open (or already closed)")

    # ---------------------------------------------------------------- buffers
    def register_buffer(self, buffer: Any, granularity: int) -> int | None:
        """Register a staging buffer; returns its id (from 1), or None when refused.

        ``buffer`` is a torch tensor (CUDA or host, viewed as bytes) or a writable
        buffer-protocol object; ``granularity`` (bytes per transfer) must be in ``1 ..
        segment_bytes``. None makes the engine raise.
        """
        import torch

        self._require_open()
        if not _is_int(granularity) or not 0 < granularity <= self.segment_bytes:
            return None
        if isinstance(buffer, torch.Tensor):
            if not buffer.is_contiguous():
                return None
            flat = buffer.view(torch.uint8).reshape(-1) if buffer.dim() else None
            if flat is None:
                return None
        else:
            try:
                view = memoryview(buffer)
            except TypeError:
                return None
            if view.readonly:
                return None
            flat = torch.frombuffer(view.cast("B"), dtype=torch.uint8)
        bid = len(self._buffers) + 1
        self._buffers[bid] = flat
        self.stats["buffers"] = len(self._buffers)
        self.stats["device"] = str(flat.device)
        return bid

    def _slice(self, buffer_id: int, offset: int) -> Any:
        flat = self._buffers.get(buffer_id)
        if flat is None:
            raise ValueError(f"stand-in store: buffer {buffer_id!r} is not "
                             "registered")
        if not _is_int(offset) or offset < 0 or \
                offset + self.segment_bytes > flat.numel():
            raise ValueError(
                f"stand-in store: offset {offset!r} + segment_bytes "
                f"{self.segment_bytes} leaves buffer {buffer_id} "
                f"({flat.numel()} bytes)")
        return flat.narrow(0, offset, self.segment_bytes)

    def _ensure_pool(self, like: Any) -> Any:
        import torch

        if self._pool is None:
            rows = self.num_chunks * self.layer_span
            self._pool = torch.empty((rows, self.segment_bytes), dtype=torch.uint8,
                                     device=like.device)
            self._free = list(range(rows - 1, -1, -1))
        return self._pool

    # ---------------------------------------------------------------- streams
    def _stream(self, direction: str, device: Any) -> Any:
        """The store's CUDA stream for ``direction`` on ``device`` (None on CPU)."""
        import torch

        if device.type != "cuda":
            return None
        s = self._streams.get(direction)
        if s is None:
            s = self._streams[direction] = torch.cuda.Stream(device=device)
        return s

    def _device(self) -> Any:
        import torch

        for flat in self._buffers.values():
            return flat.device
        return torch.device("cpu")

    @contextlib.contextmanager
    def _on(self, direction: str, device: Any) -> Iterator[Any]:
        import torch

        s = self._stream(direction, device)
        if s is None:
            yield None
            return
        with torch.cuda.stream(s):
            yield s

    def _record(self, stream: Any, event: Any = None) -> Any:
        import torch

        if stream is None:
            return None
        event = event if event is not None else torch.cuda.Event()
        event.record(stream)
        return event

    def wait_write_event(self, event: Any) -> None:
        """Make the write stream wait for ``event`` (the worker's gather)."""
        s = self._stream("write", self._device())
        if s is not None and event is not None:
            s.wait_event(event)
            self._fenced = True

    #: the older name the engine falls back to (``KVEngine.store_layer``)
    wait_event = wait_write_event

    def record_write_event(self) -> Any:
        """An event at the write stream's tail (None on CPU)."""
        return self._record(self._stream("write", self._device()))

    def wait_read_event(self, event: Any) -> None:
        """Make the read stream wait for ``event`` (staging reuse on reads)."""
        s = self._stream("read", self._device())
        if s is not None and event is not None:
            s.wait_event(event)

    def record_read_event(self, event: Any = None) -> Any:
        """Record ``event`` (or a new one) at the read stream's tail (None on CPU)."""
        return self._record(self._stream("read", self._device()), event)

    # ------------------------------------------------------------------ data
    def put_batch(self, batch: Sequence[tuple[bytes, int, int]]) -> _Completion:
        """Copy each entry's staging segment into the pool on the write stream.

        Raises:
            ValueError: an unregistered buffer or an offset out of range (whole batch
                checked first).
            RuntimeError: more distinct keys than ``num_chunks x layer span``.

        """
        self._require_open()
        entries = [(bytes(k), self._slice(b, o)) for k, b, o in batch]
        if not entries:
            return _Completion()
        device = entries[0][1].device
        self._busy(device)
        pool = self._ensure_pool(entries[0][1])
        if device.type == "cuda" and not self._fenced:
            self.stats["unfenced_puts"] += len(entries)
        self._fenced = False
        with self._on("write", device) as s:
            if s is not None and self.order != "events":
                import torch

                s.wait_stream(torch.cuda.current_stream(device))
            for key, src in entries:
                row = self._rows.get(key)
                if row is None:
                    if not self._free:
                        raise RuntimeError(
                            f"stand-in store full: {self.num_chunks} chunks x "
                            f"{self.layer_span} layers already held "
                            "(store.options.num_chunks)")
                    row = self._rows[key] = self._free.pop()
                pool[row].copy_(src, non_blocking=True)
            done = self._record(s)
        self._sync(device)
        self.stats["puts"] += len(entries)
        self.stats["bytes_written"] += len(entries) * self.segment_bytes
        return _Completion(done)

    def get_batch(self, batch: Sequence[tuple[bytes, int, int]]) -> _Completion:
        """Copy each key's segment from the pool into staging on the read stream.

        Raises:
            ValueError: an unknown key, an unregistered buffer or an offset out of range
                (whole batch checked first).

        """
        import torch

        self._require_open()
        entries = []
        for key, b, o in batch:
            row = self._rows.get(bytes(key))
            if row is None:
                raise ValueError(f"stand-in store: unknown key {bytes(key)!r}")
            entries.append((row, self._slice(b, o)))
        if not entries:
            return _Completion()
        device = entries[0][1].device
        self._busy(device)
        s0 = self._stream("read", device)
        if s0 is not None:
            s0.wait_stream(torch.cuda.current_stream(device))
        with self._on("read", device) as s:
            for row, dst in entries:
                dst.copy_(self._pool[row], non_blocking=True)
            done = self._record(s)
        self._sync(device)
        self.stats["gets"] += len(entries)
        self.stats["bytes_read"] += len(entries) * self.segment_bytes
        return _Completion(done)

    def _busy(self, device: Any) -> None:
        """``busy_us``: enqueue that much spinning on the current CUDA stream."""
        if not self.busy_us or device.type != "cuda":
            return
        import torch

        if self._busy_cycles is None:  # once: the clock does not change
            khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0)
            cycles_per_us = khz / 1000 if khz else 1500.0  # H200: 1,980 MHz
            self._busy_cycles = int(self.busy_us * cycles_per_us)
        torch.cuda._sleep(self._busy_cycles)

    def _sync(self, device: Any) -> None:
        """``order = "sync"``: wait for the whole device (a diagnostic)."""
        if self.order == "sync" and device.type == "cuda":
            import torch

            torch.cuda.synchronize(device)

    def drop(self, keys: Iterable[bytes]) -> None:
        """Forget keys (evicted by the engine's index); unknown keys are ignored."""
        self._require_open()
        for key in keys:
            row = self._rows.pop(bytes(key), None)
            if row is not None:
                self._free.append(row)

    def scan(self) -> Iterable[bytes]:
        """The keys held now (a snapshot)."""
        self._require_open()
        return iter(list(self._rows))


def under_test(kv_transfer_config: Mapping[str, Any]) -> str:
    """:data:`UNDER_TEST` when a config selects the stand-in store, else ``""``."""
    extra = kv_transfer_config.get("kv_connector_extra_config") or {}
    store = extra.get("store") if isinstance(extra, Mapping) else None
    if isinstance(store, Mapping) and store.get("type") == STANDIN_TYPE:
        return UNDER_TEST
    return ""


def totals() -> dict[str, int]:
    """Summed :attr:`StandInKVStore.stats` counters of this process's live stores."""
    out: dict[str, int] = {}
    for st in INSTANCES:
        for k, v in st.stats.items():
            if isinstance(v, int):
                out[k] = out.get(k, 0) + v
    return out
