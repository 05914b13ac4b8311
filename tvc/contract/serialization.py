"""Serialize scheduler-to-worker metadata the way vLLM's engine does, and compare."""

from __future__ import annotations

import copyreg
import io
import pickle
from collections.abc import Mapping
from typing import Any


# ------------------------------------------------------------------ serialization
def serialize_like_vllm(obj: Any) -> bytes:
    """Pickle ``obj`` as vLLM sends ``SchedulerOutput`` from scheduler to workers.

    As ``vllm.distributed.device_communicators.shm_broadcast.MessageQueue.enqueue``:
    ``HIGHEST_PROTOCOL``, out-of-band buffers (packed after the stream), and its
    ``_reduce_tensor`` for CPU tensors where present. Pickle's errors propagate.
    """
    from vllm.distributed.device_communicators import shm_broadcast

    buffers: list[pickle.PickleBuffer] = []
    with io.BytesIO() as bio:
        pickler = pickle.Pickler(bio, protocol=pickle.HIGHEST_PROTOCOL,
                                 buffer_callback=buffers.append)
        reducer = getattr(shm_broadcast, "_reduce_tensor", None)
        if reducer is not None:
            import torch

            table = dict(copyreg.dispatch_table)
            table[torch.Tensor] = reducer
            pickler.dispatch_table = table
        pickler.dump(obj)
        main = bio.getvalue()
    return pickle.dumps((main, [bytes(b.raw()) for b in buffers]))


def deserialize_like_vllm(data: bytes) -> Any:
    """Inverse of :func:`serialize_like_vllm` (``MessageQueue.dequeue``)."""
    main, oob = pickle.loads(data)
    return pickle.loads(main, buffers=oob)


def round_trip(obj: Any) -> Any:
    """Serialize and deserialize ``obj`` the way vLLM moves it to the workers."""
    return deserialize_like_vllm(serialize_like_vllm(obj))


def structurally_equal(a: Any, b: Any, path: str = "meta") -> str:
    """Compare two objects field by field; tensors by dtype, shape and values.

    Returns '' when equal, else the first differing path and both values.
    """
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(
                a.cpu(), b.cpu()):
            return f"{path}: tensor {a.dtype}{tuple(a.shape)} vs {b.dtype}" \
                   f"{tuple(b.shape)} (values differ or shape/dtype differ)"
        return ""
    if type(a) is not type(b):
        return f"{path}: type {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, Mapping):
        if set(a) != set(b):
            return f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            d = structurally_equal(a[k], b[k], f"{path}[{k!r}]")
            if d:
                return d
        return ""
    if isinstance(a, list | tuple):
        if len(a) != len(b):
            return f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = structurally_equal(x, y, f"{path}[{i}]")
            if d:
                return d
        return ""
    if isinstance(a, set | frozenset):
        return "" if a == b else f"{path}: {a!r} vs {b!r}"
    fields = _fields(a)
    if fields is not None:
        for name in fields:
            d = structurally_equal(getattr(a, name, None), getattr(b, name, None),
                                   f"{path}.{name}")
            if d:
                return d
        return ""
    try:
        return "" if a == b else f"{path}: {a!r} vs {b!r}"
    except Exception:  # noqa: BLE001 - objects without a usable __eq__
        return ""


def _fields(obj: Any) -> list[str] | None:
    if isinstance(obj, str | bytes | int | float | bool | type(None)):
        return None
    names: list[str] = []
    if hasattr(obj, "__dict__"):
        names += list(vars(obj))
    for cls in type(obj).__mro__:
        names += [s for s in getattr(cls, "__slots__", ()) if hasattr(obj, s)]
    return sorted(set(names)) if names else None
