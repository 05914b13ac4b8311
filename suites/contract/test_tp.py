"""contract (TP = 2): every rank's KV round-trips bit-identically; ranks agree.

vLLM runs one worker per tensor-parallel rank, each with its own share of the KV
heads and its own connector worker; the executor merges the ranks' connector
outputs with ``KVOutputAggregator`` before the scheduler sees them. The harness
(:mod:`tvc.contract.tp`) does the same with two rank processes (gloo on CPU, NCCL
on two GPUs): each rank writes its heads' share of one model-wide KV pattern, the
connector saves it, the caches are zeroed and the prompt is replayed; every rank
must get back exactly its own heads. A request one rank reports finished must be
reported by every rank (else vLLM holds its blocks forever), and a load error one
rank reports must reach the scheduler.

Runs for profiles declaring ``[vllm] tensor_parallel_sizes`` with 2.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tvc import contract as C
from tvc.config.profile import Profile
from tvc.contract import steps as S
from tvc.contract import tp as TP
from tvc.contract.coverage import PROPERTY, merge_logs
from tvc.env import hardware

pytestmark = [pytest.mark.contract]

TP_SIZE = 2
DEVICES = [pytest.param("cpu", marks=pytest.mark.hw_any, id="cpu-gloo"),
           pytest.param("cuda", marks=pytest.mark.hw_gpu2, id="cuda-nccl")]
# (block size, model KV heads): one KV head per rank, and two per rank (a fault in
# part of a rank's heads shows only with two).
CASES = [(16, 2), (16, 4)]


def _gate(profile: Profile, device: str, missing_hardware: Any, hw: dict[str, Any],
          tp: int = TP_SIZE, pp: int = 1) -> None:
    """Skip a variant this profile does not claim or this host cannot run.

    The host decides before any rank process starts: the NCCL variant needs one
    GPU per rank; the gloo variant needs vLLM's platform to accept the world
    size. On a host where vLLM's platform is CUDA, ``ParallelConfig``
    (``vllm/config/parallel.py``, ``__post_init__``, 0.26-0.33) refuses a world
    size above the GPU count ("World size (2) is larger than the number of
    available GPUs (1) in this node") before any connector code runs: that is
    the host's limit, reported as the missing ``gpu2`` level (a skip, a failure
    only under ``--tvc-require gpu2``), never as a red against the profile.
    """
    sizes = TP.declared_tp_sizes(profile)
    if tp > 1 and tp not in sizes:
        pytest.skip(f"profile {profile.name} declares [vllm] tensor_parallel_sizes = "
                    f"{sizes}: TP {tp} is not claimed. Declare [1, {tp}] "
                    "when the connector keeps each rank's KV apart")
    stages = TP.declared_pp_sizes(profile)
    if pp > 1 and pp not in stages:
        pytest.skip(f"profile {profile.name} declares [vllm] pipeline_parallel_sizes "
                    f"= {stages}: PP {pp} is not claimed. Declare [1, {pp}] when the "
                    "connector keeps each pipeline stage's layers apart")
    if device not in profile["connector"]["worker_devices"]:
        pytest.skip(f"profile {profile.name}: connector.worker_devices "
                    f"{profile['connector']['worker_devices']} lacks {device}; this "
                    "case runs as the other device's variant")
    gpus = hardware.visible_gpus(hw)
    if device == "cuda" and gpus < tp * pp:
        missing_hardware("gpu2", f"this host has {gpus} CUDA device(s); TP {tp} x "
                         f"PP {pp} over NCCL needs one per rank.")
    if device == "cpu" and 0 < gpus < tp * pp:
        missing_hardware("gpu2", f"this host has {gpus} CUDA device(s), so vLLM's "
                         f"platform is CUDA and its ParallelConfig refuses a world "
                         f"size of {tp * pp} ('World size ({tp * pp}) is larger than "
                         f"the number of available GPUs ({gpus}) in this node'): the "
                         "gloo variant runs on a CPU-only box (CI runs it), the NCCL "
                         f"variant on a host with {tp * pp} GPUs.")


@pytest.fixture
def tp_rig_factory(contract_profile: Profile, contract_scratch: Path,
                   record_property: Any) -> Iterator[Any]:
    """Factory ``(**kw) -> TPRig`` (see :func:`tvc.contract.tp.make_tp_rig`).

    Every rig's rank processes are stopped after the test; the test records what
    its rigs exercised (``tvc_coverage``, :mod:`tvc.contract.coverage`).
    """
    rigs: list[TP.TPRig] = []

    def factory(**kw: Any) -> TP.TPRig:
        try:
            rig = TP.make_tp_rig(contract_profile, contract_scratch, **kw)
        except TP.TPHarnessError as exc:
            pytest.fail(str(exc), pytrace=False)
        rigs.append(rig)
        return rig

    yield factory
    for rig in rigs:
        rig.close()
    record_property(PROPERTY, merge_logs(TP.note_tp_rig(rig) for rig in rigs))


def _store_then_replay(rig: TP.TPRig, n: int) -> tuple[Any, Any]:
    first = rig.request(n)
    TP.run_tp(rig.driver, rig.group, first)
    rig.forget_local_cache()
    rig.group.zero()
    second = rig.request(n, shared_prefix=first.prompt_token_ids)
    TP.run_tp(rig.driver, rig.group, second)
    return first, second


def _check_round_trip(rig: TP.TPRig, n: int, what: str) -> None:
    """Store an n-token prompt, zero every rank's KV, replay it.

    Every rank's slots then hold exactly its own KV, nothing else changed,
    nothing leaked; ``what`` names the parallel layout in the messages.
    """
    _, second = _store_then_replay(rig, n)
    local, matched, _ = C.external_hit(rig.driver, second)
    assert matched > 0, (
        f"{what}: replaying a stored {n}-token prompt matched 0 tokens; the round "
        "trip needs a hit (check the TP = 1 contract tests first)")
    g = rig.group
    assert g.loaded.get(second.request_id, 0) >= min(local + matched, n - 1), (
        f"request {second.request_id} started computing at token "
        f"{g.loaded.get(second.request_id)} although {matched} tokens were matched")
    C.assert_loaded_kv_bit_identical(g)
    stray = g.stray_block(second.request_id)
    assert not stray, stray
    msg = g.verify_range(second.request_id, 0, n)
    assert not msg, f"after the replay: {msg}{_reported(g)}"
    C.assert_scheduler_empty_and_no_leaked_blocks(rig.scheduler)


def _reported(group: TP.TPWorkerGroup) -> str:
    """The ranks that reported load errors, as a sentence (or "")."""
    by_rank: dict[int, set[int]] = {}
    for outs in group.rank_outputs:
        for r, out in enumerate(outs):
            by_rank.setdefault(r, set()).update(out.invalid_block_ids or ())
    told = {r: sorted(b) for r, b in by_rank.items() if b}
    if not told:
        return ""
    return (f". The connector reported load errors on rank(s) "
            f"{', '.join(f'{r} (blocks {b})' for r, b in sorted(told.items()))} "
            "through get_block_ids_with_load_errors: their stored entries were "
            "missing or damaged when they loaded — another rank or pipeline stage "
            "wrote the same files (name them by parallel_config.rank, which is "
            "unique per worker), or the entries never reached the store")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("block_size", "num_kv_heads"), CASES,
                         ids=[f"B{b}-H{h}" for b, h in CASES])
def test_tp_round_trip_is_bit_identical_on_every_rank(
        tp_rig_factory, contract_profile, device, block_size, num_kv_heads,
        tvc_missing_hardware, tvc_hw) -> None:
    _gate(contract_profile, device, tvc_missing_hardware, tvc_hw)
    n = S.round_trip_len(contract_profile, block_size)  # whole chunks + a tail
    rig = tp_rig_factory(tp_size=TP_SIZE, device=device, block_size=block_size,
                         num_kv_heads=num_kv_heads,
                         num_blocks=S.pool_blocks(n, block_size))
    _check_round_trip(rig, n, f"TP {TP_SIZE}")


# (TP, PP): two stages of two layers each, with one TP rank and with two
PP_CASES = [(1, 2), (2, 2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("tp", "pp"), PP_CASES,
                         ids=[f"TP{t}-PP{p}" for t, p in PP_CASES])
def test_pp_round_trip_is_bit_identical_on_every_stage(
        tp_rig_factory, contract_profile, device, tp, pp,
        tvc_missing_hardware, tvc_hw) -> None:
    """Pipeline parallelism: each worker registers only its stage's layers.

    vLLM splits the model's layers over the stages (``get_pp_indices``) and runs
    one worker per (stage, TP rank); every worker's connector saves and loads
    the layers it registered, and the executor's ``KVOutputAggregator`` waits
    for all TP x PP workers. The tiny model has two layers per stage here
    (four in all), so each stage's layers carry their model-wide index into the
    KV pattern: a stage that stores its layers under names or indices another
    stage also uses (a layer's position in its dict, one file per rank and
    chunk named by the TP rank alone) loads the other stage's KV and differs.
    """
    _gate(contract_profile, device, tvc_missing_hardware, tvc_hw, tp=tp, pp=pp)
    n = S.round_trip_len(contract_profile, 16)
    rig = tp_rig_factory(tp_size=tp, pp_size=pp, device=device, block_size=16,
                         num_kv_heads=2, num_layers=2 * pp,
                         num_blocks=S.pool_blocks(n, 16))
    _check_round_trip(rig, n, f"TP {tp} x PP {pp}")


@pytest.mark.parametrize("device", DEVICES)
def test_tp_load_error_on_one_rank_reaches_the_scheduler(
        tp_rig_factory, contract_profile, device, tvc_missing_hardware, tvc_hw) -> None:
    """Rank 1 reports the blocks it loaded as invalid; rank 0 reports none.

    With ``kv_load_failure_policy = "fail"`` (vLLM's default) vLLM must finish
    the request with an error after merging the ranks' outputs, and the connector
    must release everything.
    """
    from vllm.v1.request import RequestStatus

    _gate(contract_profile, device, tvc_missing_hardware, tvc_hw)
    ktc = dict(contract_profile.kv_transfer_config(), kv_load_failure_policy="fail")
    n = S.round_trip_len(contract_profile, 16)
    rig = tp_rig_factory(tp_size=TP_SIZE, device=device, block_size=16,
                         num_kv_heads=2, num_blocks=S.pool_blocks(n, 16),
                         kv_transfer_config=ktc, rank_faults={1: "load_error"})
    _, second = _store_then_replay(rig, n)
    _, matched, _ = C.external_hit(rig.driver, second)
    assert matched > 0, (
        f"TP {TP_SIZE}: the replay matched 0 tokens, so no load happened and no "
        "load error could be injected on rank 1")
    injected = rig.group.injected_invalid()
    assert not injected[0] and injected[1], (
        f"the harness injected invalid blocks {injected} (rank 0 must report none, "
        "rank 1 some): the load-error scenario did not happen")
    rank0 = set().union(*(outs[0].invalid_block_ids or set()
                          for outs in rig.group.rank_outputs))
    merged = set().union(*(o.invalid_block_ids or set()
                           for o in rig.group.aggregated))
    assert not rank0 and set(injected[1]) <= merged, (
        f"KVOutputAggregator output lacks rank 1's invalid blocks {injected[1]} "
        f"(merged: {sorted(merged)})")
    assert second.status == RequestStatus.FINISHED_ERROR, (
        f"request {second.request_id}: rank 1 reported KV blocks {injected[1]} as "
        f"failed to load, yet the request ended {second.status.name} instead of "
        "FINISHED_ERROR (kv_load_failure_policy = fail): the scheduler did not act "
        "on a rank-local load error")
    C.assert_scheduler_empty_and_no_leaked_blocks(rig.scheduler)
