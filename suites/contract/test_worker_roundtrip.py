"""contract (worker side): saved KV loads back bit-identically, nothing else moves.

Loaded into the right blocks and layers; no other block or layer changes.

KV caches are allocated in the layout the installed vLLM uses for FlashAttention
(``get_kv_cache_shape`` + ``get_kv_cache_stride_order`` under the connector's
required layout in vLLM 0.26/0.28, ``vllm.v1.worker.utils.allocate_kv_cache`` in the
layout the engine resolves in 0.33; see ``tvc.contract.compat``). The model's
attention is replaced by writing a known pattern (a function of layer, position and
token id) into the scheduled tokens' slots;
``save_kv_layer`` per layer and ``wait_for_save`` store it; all caches are then
zeroed, vLLM's local prefix cache is dropped, and the same prompt is replayed:
``start_load_kv`` / ``wait_for_layer_load`` must restore exactly the hit.
"""

from __future__ import annotations

import itertools

import pytest

from tvc import contract as C
from tvc.contract import steps as S

pytestmark = [pytest.mark.contract]

MATRIX = list(itertools.product((16, 32), (1, 2, 8), (64, 128),
                                ("float16", "bfloat16")))
DEVICES = [pytest.param("cpu", marks=pytest.mark.hw_any, id="cpu"),
           pytest.param("cuda", marks=pytest.mark.hw_gpu, id="cuda")]
#: physical KV layouts: VLLM_KV_CACHE_LAYOUT or the connector's required layout
#: picks one (vllm/v1/attention/backends/utils.py get_kv_cache_layout)
KV_LAYOUTS = ("NHD", "HND")


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("block_size", "num_kv_heads", "head_size", "dtype"), MATRIX,
                         ids=[f"B{b}-H{h}-D{d}-{t}" for b, h, d, t in MATRIX])
def test_loaded_kv_is_bit_identical_and_nothing_else_changes(
        rig_factory, contract_profile, contract_scratch, device, kv_layout,
        block_size, num_kv_heads, head_size, dtype, tvc_missing_hardware) -> None:
    import torch

    if device not in contract_profile["connector"]["worker_devices"]:
        if device == "cpu":
            pytest.skip(f"profile {contract_profile.name}: the connector's worker side "
                        "needs CUDA (connector.worker_devices lacks cpu); this case "
                        "runs as the [cuda] variant on a GPU host")
        pytest.skip(f"profile {contract_profile.name} declares worker_devices "
                    f"{contract_profile['connector']['worker_devices']} without cuda")
    if device == "cuda" and not torch.cuda.is_available():
        tvc_missing_hardware("gpu", "torch cannot see a CUDA device for the KV "
                             "caches.")
    allowed = C.worker_kv_layouts(contract_profile, contract_scratch, device=device,
                                  block_size=block_size, num_kv_heads=num_kv_heads,
                                  head_size=head_size, dtype=dtype)
    if kv_layout not in allowed:
        pytest.skip(f"the engine hands this connector only {'/'.join(allowed)} "
                    "(VLLM_KV_CACHE_LAYOUT in [vllm] env or the process, or the "
                    "connector's get_required_kvcache_layout)")
    n = S.round_trip_len(contract_profile, block_size)  # whole chunks + a tail
    rig = rig_factory(device=device, real_worker=True, block_size=block_size,
                      num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype,
                      num_blocks=S.pool_blocks(n, block_size), kv_layout=kv_layout)
    assert rig.worker.layout.kv_layout == kv_layout == \
        rig.worker.layout.physical_layout(), (
        f"the harness asked vLLM for {kv_layout} (VLLM_KV_CACHE_LAYOUT) but vLLM "
        f"allocated {rig.worker.layout.label()}")
    w = rig.worker
    first = rig.request(n)
    rig.driver.run(first)
    rig.forget_local_cache()
    w.zero()
    second = rig.request(n, shared_prefix=first.prompt_token_ids)
    rig.driver.run(second)
    local, matched, _ = C.external_hit(rig.driver, second)
    assert matched > 0, (
        f"replaying a stored {n}-token prompt matched 0 tokens; the worker-side "
        "round trip needs a hit (check the scheduler-side tests first)"
        + (f"; {cause}" if (cause := C.zero_match_cause(rig.driver)) else ""))
    assert w.loaded.get(second.request_id, 0) >= min(local + matched, n - 1), (
        f"request {second.request_id} started computing at token "
        f"{w.loaded.get(second.request_id)} although {matched} tokens were matched")
    C.assert_loaded_kv_bit_identical(w)
    # Nothing outside the replayed request's blocks changed (caches were zeroed
    # before the replay; the request itself wrote only its own blocks).
    stray = w.stray_block(second.request_id)
    if stray:
        pytest.fail(stray, pytrace=False)
    # Within its own blocks, every prompt token holds the pattern, in every layer.
    msg = w.verify_range(second.request_id, 0, n)
    assert not msg, f"after the replay: {msg}"
    C.assert_scheduler_empty_and_no_leaked_blocks(rig.scheduler)
