"""FaultInjectingConnector (tvc.contract.faults) works as a kv_connector by module path.

vLLM's ``KVConnectorFactory`` builds the wrapper from ``kv_connector_module_path =
"tvc.contract.faults"`` on both sides and the wrapper builds vLLM's ExampleConnector
through
the same factory. Driven in the contract rig on CPU: every fault mode does what its
documentation says, the failure is reported through vLLM's interface, and
``kv_load_failure_policy`` acts on the affected request only.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tvc import contract as C
from tvc.config.profile import Profile, load
from tvc.contract.faults import (
    FaultConfigError,
    FaultInjectingConnector,
    wrap_kv_transfer_config,
)

pytestmark = pytest.mark.hw_any

N = 4 * 16 + 5  # 4 whole blocks stored, a 5-token tail


@pytest.fixture
def example(tmp_path: Path) -> Profile:
    """vLLM's ExampleConnector with a store and scratch under ``tmp_path``."""
    prof = tmp_path / "example.toml"
    prof.write_text(f"""\
[profile]
name = "fault-wrapper"
[connector]
name = "ExampleConnector"
extra_config = {{ shared_storage_path = "{tmp_path}/scratch/store" }}
worker_devices = ["cpu"]
[scratch]
dir = "{tmp_path}/scratch"
""")
    return load(str(prof))


def _rig(profile: Profile, mode: str, every: int = 2, policy: str = "recompute"
         ) -> C.Rig:
    ktc = dict(profile.kv_transfer_config(), kv_load_failure_policy=policy)
    return C.make_rig(profile, profile.scratch / "contract",
                      kv_transfer_config=wrap_kv_transfer_config(ktc, mode, every),
                      real_worker=True, num_blocks=64)


def _store_then_replay(rig: C.Rig, k: int = 3) -> list:
    firsts = [rig.request(N) for _ in range(k)]
    rig.driver.run(*firsts)
    rig.forget_local_cache()
    rig.worker.zero()
    seconds = [rig.request(N, shared_prefix=f.prompt_token_ids) for f in firsts]
    rig.driver.run(*seconds)
    return seconds


def test_wrapped_config_names_the_wrapper_and_keeps_vllm_fields() -> None:
    cfg = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
           "kv_load_failure_policy": "fail",
           "kv_connector_extra_config": {"shared_storage_path": "/x"}}
    out = wrap_kv_transfer_config(cfg, "fail_load", every=3, seed=5)
    assert out["kv_connector"] == "FaultInjectingConnector"
    assert out["kv_connector_module_path"] == "tvc.contract.faults"
    assert out["kv_role"] == "kv_both" and out["kv_load_failure_policy"] == "fail"
    assert out["kv_connector_extra_config"] == {"tvc_fault": {
        "inner": cfg, "mode": "fail_load", "every": 3, "seed": 5}}
    with pytest.raises(FaultConfigError, match="tvc_fault.mode = 'explode'"):
        wrap_kv_transfer_config(cfg, "explode")
    with pytest.raises(FaultConfigError, match="tvc_fault.every = 0"):
        wrap_kv_transfer_config(cfg, "fail_load", every=0)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_fail_load_is_reported_and_the_policy_acts_on_that_request_only(
        example, policy) -> None:
    from vllm.v1.request import RequestStatus

    rig = _rig(example, "fail_load", every=2, policy=policy)
    sched_side, worker_side = rig.scheduler.connector, rig.worker.connector
    assert isinstance(sched_side, FaultInjectingConnector)
    assert type(sched_side.inner).__name__ == "ExampleConnector"
    assert type(worker_side.inner).__name__ == "ExampleConnector"
    seconds = _store_then_replay(rig)
    hits = [C.external_hit(rig.driver, s)[1] for s in seconds]
    assert hits == [64, 64, 64], hits
    # every=2, seed=0: the second load (event 1) fails, exactly one block.
    assert len(worker_side.injected) == 1, worker_side.injected
    _, rid, blocks = worker_side.injected[0]
    assert rid == seconds[1].request_id and len(blocks) == 1
    assert rig.worker.reported_invalid_blocks == set(blocks), (
        "the failed block must come back through get_block_ids_with_load_errors")
    assert rig.worker.load_errors == [], rig.worker.load_errors
    failed = RequestStatus.FINISHED_ERROR
    status = {s.request_id: s.status for s in seconds}
    if policy == "fail":
        assert status[rid] == failed
    else:
        assert status[rid] != failed
        assert not rig.worker.verify_range(rid, 0, N), "recomputed KV is wrong"
    assert all(st != failed for r, st in status.items() if r != rid), status
    for s in seconds:
        if s.request_id != rid:
            assert not rig.worker.verify_range(s.request_id, 0, N)
    C.assert_scheduler_empty_and_no_leaked_blocks(rig.scheduler)


def test_corrupt_load_is_silent_and_the_harness_sees_it(example) -> None:
    rig = _rig(example, "corrupt_load", every=3)
    _store_then_replay(rig)
    assert rig.worker.reported_invalid_blocks == set()
    assert len(rig.worker.load_errors) == 1, rig.worker.load_errors
    assert "does not hold the KV that was stored" in rig.worker.load_errors[0]
    # the scribbled blocks are freed (and marked) when the request finishes: the
    # wrapper's log and the load error name the same request
    injected = rig.worker.connector.injected
    assert [(m, len(b)) for m, _, b in injected] == [("corrupt_load", 1)], injected
    assert injected[0][1] in rig.worker.load_errors[0]
    assert "(16 of 64 tokens differ)" in rig.worker.load_errors[0]  # one block


@pytest.mark.parametrize("seed", range(6))
def test_misreport_load_reports_a_later_block_and_the_wrong_kv_stays(
        example, seed) -> None:
    ktc = dict(example.kv_transfer_config(), kv_load_failure_policy="recompute")
    rig = C.make_rig(example, example.scratch / "contract",
                     kv_transfer_config=wrap_kv_transfer_config(
                         ktc, "misreport_load", every=1, seed=seed),
                     real_worker=True, num_blocks=64)
    seconds = _store_then_replay(rig, k=1)
    worker_side = rig.worker.connector
    assert len(worker_side.injected) == 1, worker_side.injected
    _, rid, scribbled = worker_side.injected[0]
    assert rid == seconds[0].request_id and len(scribbled) == 1
    reported = rig.worker.reported_invalid_blocks
    assert len(reported) == 1 and reported.isdisjoint(scribbled), (
        f"misreport_load must report a block other than the overwritten "
        f"{scribbled}, reported {reported}")
    # vLLM recomputes from the reported block on; the overwritten block is before
    # it, so the request's KV stays wrong whichever block the seed picked.
    assert rig.worker.verify_range(rid, 0, N), "the overwritten block was repaired"


def test_lose_entry_answers_a_miss(example) -> None:
    rig = _rig(example, "lose_entry", every=2)
    seconds = _store_then_replay(rig)
    hits = [C.external_hit(rig.driver, s)[1] for s in seconds]
    assert hits == [64, 0, 64], hits
    C.assert_loaded_kv_bit_identical(rig.worker)
    C.assert_scheduler_empty_and_no_leaked_blocks(rig.scheduler)


def test_fail_save_is_never_visible_to_a_later_lookup(example) -> None:
    rig = _rig(example, "fail_save", every=2)
    seconds = _store_then_replay(rig)
    hits = [C.external_hit(rig.driver, s)[1] for s in seconds]
    # saves of the first pass: event 1 (the second prompt) failed.
    assert hits == [64, 0, 64], hits
    C.assert_loaded_kv_bit_identical(rig.worker)
    C.assert_scheduler_empty_and_no_leaked_blocks(rig.scheduler)


def test_profile_load_failure_faults_are_the_wrappers_load_modes(tmp_path) -> None:
    from tvc.config.profile import LOAD_FAILURE_FAULTS, ProfileError
    from tvc.contract import faults

    assert set(LOAD_FAILURE_FAULTS) == set(faults._LOAD_MODES)
    prof = tmp_path / "bad.toml"
    prof.write_text('[profile]\nname = "bad"\n[connector]\nname = "ExampleConnector"\n'
                    '[e2e]\nload_failure_fault = "lose_entry"\n')
    with pytest.raises(ProfileError, match="key e2e.load_failure_fault: 'lose_entry'"):
        load(str(prof))

