"""vLLM's distributed environment for a harness process (tensor parallelism).

:func:`vllm_distributed` initialises one rank as vLLM's GPU worker does
(``vllm/v1/worker/gpu_worker.py`` ``init_worker_distributed_environment``:
``init_distributed_environment`` then ``ensure_model_parallel_initialized``, from
``vllm.distributed.parallel_state``, under ``set_current_vllm_config``), so
connectors see ``get_tp_group()`` as in a served engine, and tears it down again.
The ``torch.distributed`` variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``) are set only inside the context.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

__all__ = ["DistributedSetupError", "free_init_method", "vllm_distributed"]

_ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")


class DistributedSetupError(RuntimeError):
    """The harness could not set up vLLM's distributed state.

    Bad arguments, a ``torch.distributed`` group already initialised in the
    process, or a backend missing from the torch build.
    """


def free_init_method(host: str = "127.0.0.1") -> str:
    """A ``tcp://host:port`` rendezvous address on a port free right now.

    The parent picks it once and passes it to every rank of one world. Another
    process may take the port before rank 0 binds it (the caller retries).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    return f"tcp://{host}:{port}"


def _host_port(init_method: str) -> tuple[str, str]:
    """(MASTER_ADDR, MASTER_PORT) for a ``tcp://`` address; loopback otherwise."""
    if init_method.startswith("tcp://"):
        host, _, port = init_method.removeprefix("tcp://").rpartition(":")
        return host, port
    return "127.0.0.1", "0"


@contextmanager
def vllm_distributed(world_size: int = 1, rank: int = 0, backend: str = "gloo",
                     init_method: str | None = None, *,
                     vllm_config: Any | None = None,
                     pipeline_parallel_size: int = 1) -> Iterator[Any]:
    """Initialise vLLM's distributed environment and model-parallel groups.

    TP size = ``world_size // pipeline_parallel_size``; context and data parallel
    sizes are 1. Call once per process, in every rank, with the same ``world_size``
    and ``init_method``.

    Args:
        world_size: ranks (TP size x PP size). 1 works in-process.
        rank: in ``[0, world_size)``; also the local rank and, with ``nccl``,
            the CUDA device index.
        backend: ``gloo`` (CPU) or ``nccl`` (CUDA); vLLM always adds a gloo CPU
            group.
        init_method: ``tcp://host:port`` or ``file:///path`` shared by all ranks;
            None: a free loopback port (world size 1 only).
        vllm_config: made current while the groups are built and inside the
            context; default the current config, else a bare ``VllmConfig``.
        pipeline_parallel_size: PP stages; rank r is TP rank ``r % tp`` of stage
            ``r // tp``, as vLLM lays them out.

    Yields:
        vLLM's TP ``GroupCoordinator`` (``get_tp_group()``).

    Raises:
        DistributedSetupError: ``world_size`` < 1, ``rank`` out of range, no
            ``init_method`` for ``world_size`` > 1, ``torch.distributed`` already
            initialised in this process, or the backend is unavailable.

    """
    import torch
    import torch.distributed as dist
    from vllm.config import (
        DeviceConfig,
        VllmConfig,
        get_current_vllm_config_or_none,
        set_current_vllm_config,
    )
    from vllm.distributed import parallel_state as ps

    if world_size < 1 or not 0 <= rank < world_size or \
            world_size % max(1, pipeline_parallel_size):
        raise DistributedSetupError(
            f"vllm_distributed: rank {rank} is not in [0, world_size={world_size}) "
            f"or {pipeline_parallel_size} pipeline stages do not divide it")
    if init_method is None:
        if world_size > 1:
            raise DistributedSetupError(
                f"vllm_distributed: world_size {world_size} needs one init_method "
                "shared by every rank (pick it in the parent with free_init_method())")
        init_method = free_init_method()
    if dist.is_initialized():
        raise DistributedSetupError(
            "vllm_distributed: torch.distributed is already initialised in this "
            "process; run each harness world in its own process")
    if not dist.is_backend_available(backend):
        raise DistributedSetupError(
            f"vllm_distributed: torch.distributed backend {backend!r} is not "
            "available in this torch build (use 'gloo' on CPU, 'nccl' on CUDA)")
    if backend == "nccl":
        if not torch.cuda.is_available() or torch.cuda.device_count() <= rank:
            raise DistributedSetupError(
                f"vllm_distributed: backend 'nccl' for rank {rank} needs CUDA device "
                f"{rank}; torch sees {torch.cuda.device_count()} device(s)")
        torch.cuda.set_device(rank)

    config = vllm_config or get_current_vllm_config_or_none()
    if config is None:
        config = VllmConfig(device_config=DeviceConfig(
            "cuda" if backend == "nccl" else "cpu"))
    host, port = _host_port(init_method)
    saved = {k: os.environ.get(k) for k in _ENV_KEYS}
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=port, RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    same = config is get_current_vllm_config_or_none()
    try:
        with nullcontext() if same else set_current_vllm_config(config):
            try:
                ps.init_distributed_environment(
                    world_size=world_size, rank=rank,
                    distributed_init_method=init_method, local_rank=rank,
                    backend=backend)
                ps.ensure_model_parallel_initialized(
                    world_size // pipeline_parallel_size, pipeline_parallel_size)
                yield ps.get_tp_group()
            finally:
                ps.destroy_model_parallel()
                ps.destroy_distributed_environment()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
