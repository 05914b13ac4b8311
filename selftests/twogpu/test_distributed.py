"""tvc.contract.distributed: vLLM's distributed state at world size 1 and 2 (gloo)."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from tvc.contract.distributed import (
    DistributedSetupError,
    free_init_method,
    vllm_distributed,
)

pytestmark = [pytest.mark.hw_any]


def test_world_size_one_in_process() -> None:
    import torch
    from vllm.distributed import parallel_state as ps

    before = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    with vllm_distributed(1) as tp:
        assert (tp.world_size, tp.rank_in_group) == (1, 0)
        assert ps.get_tensor_model_parallel_world_size() == 1
        assert os.environ["WORLD_SIZE"] == "1" and os.environ["RANK"] == "0"
        t = torch.tensor([3.0])
        assert tp.all_reduce(t).tolist() == [3.0]
    assert not ps.model_parallel_is_initialized()
    assert not torch.distributed.is_initialized()
    assert {k: os.environ.get(k) for k in before} == before
    # a second world in the same process works after teardown
    with vllm_distributed(1) as tp:
        assert tp.world_size == 1


def _rank_main(rank: int, init_method: str, q: mp.Queue) -> None:
    import torch

    try:
        with vllm_distributed(2, rank, init_method=init_method) as tp:
            t = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
            out = tp.all_reduce(t)
            q.put((rank, tp.rank_in_group, tp.world_size, out.tolist()))
    except BaseException as exc:  # noqa: BLE001 - report to the parent
        q.put((rank, "error", repr(exc), None))


def test_world_size_two_gloo_all_reduce_through_tp_group() -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = free_init_method()
    procs = [ctx.Process(target=_rank_main, args=(r, init, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = sorted(q.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert got == [(0, 0, 2, [3.0, 30.0]), (1, 1, 2, [3.0, 30.0])], got


def test_bad_arguments_name_the_problem() -> None:
    with pytest.raises(DistributedSetupError, match="rank 2 is not in"):
        with vllm_distributed(2, 2, init_method="tcp://127.0.0.1:1"):
            pass
    with pytest.raises(DistributedSetupError, match="shared by every rank"):
        with vllm_distributed(2, 0):
            pass
    with pytest.raises(DistributedSetupError, match="already initialised"):
        with vllm_distributed(1), vllm_distributed(1):
            pass
