"""The worker harness hands a connector vLLM's forward context, as the runner does.

vLLM's model runners call ``start_load_kv(get_forward_context())`` inside
``set_forward_context`` whose ``no_compile_layers`` hold the attention layers
bound to their KV tensors (``tvc.contract.compat.engine_forward_context`` cites
the lines). A connector that finds its layers there (LMCache) must find them in
the harness too; the V1 runner keeps ``wait_for_save`` inside the context, the
V2 runner calls it after.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from selftests.contract import forward_context_connectors as fcc
from tvc import contract as C
from tvc.config.profile import Profile, load

pytestmark = pytest.mark.hw_any
N = 40  # tokens: two whole 16-token blocks and a half


def _profile(tmp_path: Path, cls: str, runner: str) -> Profile:
    prof = tmp_path / "p.toml"
    # V2 is the harness's default here (as on a CUDA host); on a CPU box vLLM's
    # config refuses VLLM_USE_V2_MODEL_RUNNER=1 (it requires Triton)
    env = "" if runner == "V2" else \
        '[vllm]\nenv = { VLLM_USE_V2_MODEL_RUNNER = "0" }\n'
    prof.write_text(f"""\
[profile]
name = "forward-context"
[connector]
name = "{cls}"
module_path = "selftests.contract.forward_context_connectors"
extra_config = {{ shared_storage_path = "{tmp_path}/scratch/store" }}
worker_devices = ["cpu"]
hit_rule = "0 if (len - 1) % B == 0 else (len - 2) // B * B"
{env}[scratch]
dir = "{tmp_path}/scratch"
""")
    return load(str(prof))


def _store_and_replay(profile: Profile) -> tuple[C.Rig, object]:
    rig = C.make_rig(profile, profile.scratch / "contract", real_worker=True,
                     num_blocks=64)
    first = rig.request(N)
    rig.driver.run(first)
    rig.forget_local_cache()
    rig.worker.zero()
    second = rig.request(N, shared_prefix=first.prompt_token_ids)
    rig.driver.run(second)
    return rig, second


@pytest.mark.parametrize("runner, wait_inside", [("V2", False), ("V1", True)])
def test_connector_calls_run_in_vllms_forward_context(tmp_path: Path, runner: str,
                                                      wait_inside: bool) -> None:
    fcc.SEEN.clear()
    rig, _ = _store_and_replay(_profile(tmp_path, "ForwardContextProbeConnector",
                                        runner))
    try:
        starts = fcc.SEEN["start_load_kv"]
        assert starts and all(s["inside"] and s["handed_is_current"]
                              and s["layers_bound"] for s in starts), starts
        assert any(s["metadata"] for s in starts)
        saves = fcc.SEEN["save_kv_layer"]
        assert saves and all(s["inside"] and s["layers_bound"] for s in saves)
        waits = fcc.SEEN["wait_for_save"]
        assert {w["inside"] for w in waits} == {wait_inside}, (
            f"runner {runner}: wait_for_save inside the "
            f"forward context = {waits}")
    finally:
        rig.worker.close()


def test_connector_finding_layers_through_the_context_loads_bit_identical(
        tmp_path: Path) -> None:
    rig, second = _store_and_replay(_profile(tmp_path, "ForwardContextLayersConnector",
                                             "V2"))
    try:
        assert rig.worker.loaded[second.request_id] == 32, rig.worker.loaded
        assert rig.worker.load_errors == []
        assert rig.worker.verify_range(second.request_id, 0, 32) == ""
    finally:
        rig.worker.close()


def test_a_context_without_layers_is_what_the_layer_finder_refuses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the old harness's empty layer table makes it fail."""
    import tvc.contract.compat as compat

    real = compat.engine_forward_context

    def no_layers(vllm_config, kv_caches, *a, **kw):
        return real(vllm_config, {}, *a, **kw)

    monkeypatch.setattr("tvc.contract.worker.engine_forward_context", no_layers)
    from tvc.contract.driver import EngineStepError

    with pytest.raises(EngineStepError, match="raised RuntimeError: no attention "
                       "layer in the forward context"):
        _store_and_replay(_profile(tmp_path, "ForwardContextLayersConnector", "V2"))


def test_a_scheduler_that_asks_its_worker_gets_no_rig_without_one(tmp_path: Path
                                                                   ) -> None:
    """connector.lookups_need_worker: refused before any lookup could wait."""
    from tvc.contract.driver import NoWorkerHere

    text = _profile(tmp_path, "ForwardContextProbeConnector", "V2").source.read_text()
    cuda_only = tmp_path / "cuda-only.toml"
    cuda_only.write_text(text.replace('worker_devices = ["cpu"]',
                                      'worker_devices = ["cuda"]\n'
                                      "lookups_need_worker = true"))
    prof = load(str(cuda_only))
    for kw in ({}, {"scheduler_only": True}):
        with pytest.raises(NoWorkerHere, match=r"asks its worker for every lookup "
                           r"\(connector.lookups_need_worker\)"):
            C.make_rig(prof, prof.scratch / "contract", num_blocks=64, **kw)
    with_worker = tmp_path / "cpu.toml"
    with_worker.write_text(text.replace('worker_devices = ["cpu"]',
                                        'worker_devices = ["cpu"]\n'
                                        "lookups_need_worker = true"))
    rig = C.make_rig(load(str(with_worker)), tmp_path / "scratch" / "contract",
                     num_blocks=64)
    rig.worker.close()
