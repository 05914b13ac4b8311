"""The worker-report path and the worker harness catch what they must, rightly.

Each case runs the contract tier in a subprocess against one connector of
``report_connectors.py`` (CPU) and asserts the outcome and the message:

* a connector that publishes residency through worker metadata, driven where its
  worker cannot run and with no ``connector.worker_report``: the hit-rule test
  FAILS naming the residency path and the profile key (never a pass with 0 hits);
  with the declared stand-in it passes with hits > 0 and records
  ``worker = "stand-in: <hook>"`` in summary.json and junit.xml; with its real
  worker (``worker_devices = ["cpu"]``) it passes with hits and no stand-in;
* the worker harness allocates and registers vLLM's cross-layer KV tensor and
  vLLM's TP group (a connector that refuses anything else passes the round trip),
  and a connector that reads the cross-layer tensor's layer axis wrongly fails;
* a scheduler that drops its workers' metadata fails the round trip naming the
  worker metadata it was handed;
* load-error reports are checked: a bit-identical load reported as failed, a
  corrupt block before the first reported one, a request named by
  ``get_request_ids_with_load_errors`` although its load was bit-identical;
* a known connector error (Tutti's memory store refusing the staging buffer)
  comes with its cause;
* a hit rule that expects no hit for any length tried fails instead of passing;
* the tutti-public-nvme profile's hw_nvme tests skip naming the missing device
  nodes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from selftests.conftest import run_suite

pytestmark = [pytest.mark.hw_any]

HERE = Path(__file__).resolve().parent
ROUND_TRIP = "test_loaded_kv_is_bit_identical and cpu and B16-H2-D64-float16 and NHD"
#: vLLM's V1 model runner: the only one that hands a cross-layer KV tensor
V1 = '{ VLLM_USE_V2_MODEL_RUNNER = "0" }'
HIT_RULE = "test_second_pass_matches_declared_hit_rule and 16"
STANDIN = "report_connectors:stored_prefixes_report"

PROFILE = """\
[profile]
name = "report-{cls}"
[connector]
name = "{cls}"
module_path = "report_connectors"
kv_role = "kv_both"
extra_config = {{ shared_storage_path = "{store}" }}
hit_rule = "{rule}"
hit_rule_source = "report_connectors.py"
worker_devices = {devices}
worker_report = "{report}"
[vllm]
env = {env}
[scratch]
dir = "{scratch}"
"""


def _run(tmp_path: Path, cls: str, select: str, *, devices: str = '["cpu"]',
         report: str = "", rule: str = "(len - 1) // B * B",
         name: str = "run", env: str = "{}",
         extra: list[str] | None = None) -> object:
    prof = tmp_path / f"{name}.toml"
    prof.write_text(PROFILE.format(cls=cls, store="${SCRATCH}/store", rule=rule,
                                   devices=devices, report=report, env=env,
                                   scratch=tmp_path / "scratch"))
    env = {"PYTHONPATH": os.pathsep.join(
        [str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    return run_suite(["suites/contract", "-m", "contract", "-k", select,
                      f"--tvc-profile={prof}", "-q", *(extra or [])],
                     tmp_path / f"{name}-report",
                     env=env, timeout_s=600)


def _hit_rule_test(run) -> dict:
    return run.test("test_second_pass_matches_declared_hit_rule[16]")


# ------------------------------------------------------------ worker reports
def test_worker_meta_connector_without_report_fails_naming_the_key(tmp_path) -> None:
    run = _run(tmp_path, "WorkerMetaResidencyConnector", HIT_RULE,
               devices='["cuda"]')
    t = _hit_rule_test(run)
    assert run.rc == 1 and t["outcome"] == "failed", (
        f"a connector that publishes residency through worker metadata, with no "
        f"worker and no stand-in, was not a failure (rc {run.rc}, "
        f"{t['outcome']}):\n{run.tail()}")
    assert "publishes residency through worker metadata" in t["message"] and \
        "worker_report" in t["message"], t["message"]
    assert "worker" not in t["properties"], t["properties"]


@pytest.mark.parametrize("strict", [False, True], ids=["skip", "strict"])
def test_real_only_worker_report_without_a_gpu_is_a_hardware_skip(
        tmp_path, strict) -> None:
    # LMCache's MP connector: residency only its CUDA worker can report, so no
    # stand-in can exist; on a box without a GPU that is missing hardware
    run = _run(tmp_path, "WorkerMetaResidencyConnector", HIT_RULE,
               devices='["cuda"]', report="real-only",
               extra=["--tvc-require=gpu"] if strict else [])
    t = _hit_rule_test(run)
    if strict:
        assert t["outcome"] == "failed", t
        assert "strict mode (--tvc-require gpu)" in t["message"], t["message"]
    else:
        assert t["outcome"] == "skipped" and run.rc == 0, (t, run.tail())
        assert "no CUDA GPU" in t["message"], t["message"]
    assert "publishes residency through worker metadata" not in t["message"]


def test_worker_meta_connector_with_declared_standin_passes_and_says_so(
        tmp_path) -> None:
    run = _run(tmp_path, "WorkerMetaResidencyConnector", HIT_RULE,
               devices='["cuda"]', report=STANDIN)
    t = _hit_rule_test(run)
    assert t["outcome"] == "passed", f"{t['message']}\n{run.tail()}"
    hits = t["properties"]["hits_by_prompt_len"]
    assert any(v > 0 for v in hits.values()), hits  # scenario happened
    assert t["properties"]["worker"] == f"stand-in: {STANDIN}"
    props = {p.get("name"): p.get("value") for p in run.junit().iter("property")}
    assert props.get("worker") == f"stand-in: {STANDIN}", props


def test_worker_meta_connector_with_its_real_worker_passes_without_standin(
        tmp_path) -> None:
    run = _run(tmp_path, "WorkerMetaResidencyConnector", HIT_RULE)
    t = _hit_rule_test(run)
    assert t["outcome"] == "passed", f"{t['message']}\n{run.tail()}"
    assert any(v > 0 for v in t["properties"]["hits_by_prompt_len"].values())
    assert "worker" not in t["properties"], t["properties"]


def test_worker_meta_connector_passes_the_round_trip_with_its_worker(
        tmp_path) -> None:
    run = _run(tmp_path, "WorkerMetaResidencyConnector", ROUND_TRIP, env=V1)
    t = run.test("B16-H2-D64-float16-cpu-NHD")
    assert t["outcome"] == "passed", f"{t['message']}\n{run.tail()}"


def test_hit_rule_expecting_no_hit_at_all_fails(tmp_path) -> None:
    run = _run(tmp_path, "WorkerMetaResidencyConnector", HIT_RULE, rule="0 * len")
    t = _hit_rule_test(run)
    assert t["outcome"] == "failed" and "would pass without a single hit" in \
        t["message"], f"{t['outcome']}: {t['message']}\n{run.tail()}"


# ------------------------------------------------------------- worker harness
CROSS_RULE = ("(len - 2) // B * B * ((len - 1 - (len - 1) // B * B + B - 1) // B)")


def test_cross_layer_kv_tensor_and_tp_group_are_set_up_on_the_v1_runner(
        tmp_path) -> None:
    run = _run(tmp_path, "CrossLayerConnector", ROUND_TRIP, rule=CROSS_RULE, env=V1)
    t = run.test("B16-H2-D64-float16-cpu-NHD")
    assert t["outcome"] == "passed", f"{t['message']}\n{run.tail()}"
    assert t["properties"]["model_runner"] == "V1 (vllm)", t["properties"]
    layout = t["properties"]["kv_layout"]
    assert "cross-layer tensor" in layout and "NHD" in layout and \
        "(64, 2, 16, 2, 128)" in layout, layout  # (N, layers, B, H, 2D)


def test_v2_runner_hands_per_layer_tensors_whatever_the_connector_prefers(
        tmp_path) -> None:
    """vLLM 0.26/0.28 run a dense model on the V2 runner by default, which never
    registers a cross-layer tensor (v1/worker/gpu/kv_connector.py): a connector
    that takes only that tensor is red, naming the runner (the harness used to
    hand it the cross-layer tensor anyway: a green the server never gives)."""
    run = _run(tmp_path, "CrossLayerConnector", ROUND_TRIP, rule=CROSS_RULE)
    t = run.test("B16-H2-D64-float16-cpu-NHD")
    assert t["outcome"] == "failed", f"{t['outcome']}: {t['message']}\n{run.tail()}"
    assert "V2 model runner" in t["message"] and \
        "expected register_cross_layers_kv_cache, got register_kv_caches" in \
        t["message"], t["message"]


def test_rank4_refusal_names_runner_variable_and_shape(tmp_path) -> None:
    """Tutti's worker refuses per-layer tensors ("unsupported paged KV tensor rank
    4"): the failure names the V2 runner, VLLM_USE_V2_MODEL_RUNNER=0 and reads
    the shape as (N, H, B, 2D)."""
    run = _run(tmp_path, "Rank4RefusingConnector", ROUND_TRIP, rule=CROSS_RULE)
    t = run.test("B16-H2-D64-float16-cpu-NHD")
    assert t["outcome"] == "failed", f"{t['outcome']}: {t['message']}\n{run.tail()}"
    for needle in ("V2 model runner", "VLLM_USE_V2_MODEL_RUNNER=0",
                   "per-layer tensor (N, H, B, 2D) with H = 2 KV heads and B = 16"):
        assert needle in t["message"], (needle, t["message"])
    assert t["properties"].get("model_runner") == "V2 (vllm)", t["properties"]
    keys = [f["key"] for f in run.summary["findings"]]
    # a Tutti-like connector of another class: a plain finding, never Tutti's
    assert keys == ["test"], keys


def test_cross_layer_head_limit_is_red_with_8_kv_heads_on_v1(tmp_path) -> None:
    """On the V1 runner Tutti's worker takes the cross-layer tensor only with 2 KV
    heads per rank; with 8 the failure reads the shape as a cross-layer slice."""
    run = _run(tmp_path, "Rank4RefusingConnector",
               "test_loaded_kv_is_bit_identical and cpu and B16-H8-D64-float16 "
               "and NHD", rule=CROSS_RULE, env=V1)
    t = run.test("B16-H8-D64-float16-cpu-NHD")
    assert t["outcome"] == "failed", f"{t['outcome']}: {t['message']}\n{run.tail()}"
    assert "layer slice (N, B, H, 2D) of the V1 runner's cross-layer tensor with " \
        "B = 16 and H = 8" in t["message"], t["message"]


@pytest.mark.parametrize(("cls", "needle"), [
    ("WorkerMetaIgnoredConnector",
     "non-empty worker metadata object(s) (StoredPrefixes) from "
     "build_connector_worker_meta, and vLLM's scheduler handed each to the "
     "connector's update_connector_output, yet get_num_new_matched_tokens "
     "matched 0: the scheduler side did not publish"),
    ("CrossLayerWrongLayerConnector", "does not hold the KV that was stored"),
    ("FalseLoadErrorConnector", "a false load-error report"),
    ("LateLoadErrorConnector", "before the first block reported as failed"),
    ("RequestIdsFalseReportConnector",
     "get_request_ids_with_load_errors() names it, but its load"),
    ("StagingRefusedConnector",
     "the connector's memory store cannot serve a CUDA worker (staging buffer "
     "refused)"),
])
def test_worker_harness_catches_known_bad_connector(tmp_path, cls, needle) -> None:
    run = _run(tmp_path, cls, ROUND_TRIP, env=V1)
    t = run.test("B16-H2-D64-float16-cpu-NHD")
    assert t["outcome"] in ("failed", "error") and needle in run.stdout, (
        f"{cls}: expected a failure containing {needle!r}, got {t['outcome']}: "
        f"{t['message']}\n{run.tail()}")


# ------------------------------------------------------------ nvme profile
def test_tutti_public_nvme_hw_nvme_tests_skip_naming_device_nodes(tmp_path) -> None:
    if any(Path("/dev").glob("snvme*")):
        pytest.skip("this box has /dev/snvme*: the hw_nvme tests may run here")
    run = run_suite(["suites/real_nvme", "--tvc-profile", "tutti-public-nvme",
                     "-q"], tmp_path / "report",
                    env={"TUTTI_NVME_PRESET": "{type: local}",
                         "TUTTI_NVME_ROOT": str(tmp_path / "root")})
    tests = run.summary["tests"] if run.summary else []
    assert tests and all(t["outcome"] == "skipped" for t in tests), run.tail()
    for t in tests:
        assert "no device node matches /dev/snvme*" in t["message"], t["message"]


# ------------------------------------------------- the public Tutti connector
def _tutti_src() -> Path:
    src = os.environ.get("TUTTI_SRC", "")
    if not src or not (Path(src) / "adapter" / "connector.py").is_file():
        pytest.skip("set TUTTI_SRC to the public Tutti connector's "
                    "integration/vllm-connector folder (holding adapter/) to run "
                    "the tutti-public checks")
    return Path(src)


@pytest.mark.parametrize("report", ["", "tvc.contract.standins:tutti_worker_report"],
                         ids=["no-report", "standin"])
def test_tutti_public_hits_need_the_declared_stand_in(tmp_path, report) -> None:
    src = _tutti_src()
    prof = tmp_path / "tutti.toml"
    prof.write_text(f"""\
[profile]
name = "tutti-selftest"
extends = "tutti-public"
[connector]
worker_report = "{report}"
[scratch]
dir = "{tmp_path / 'scratch'}"
""")
    run = run_suite(["suites/contract", "-m", "contract", "-k", HIT_RULE,
                     f"--tvc-profile={prof}", "-q"], tmp_path / "report",
                    env={"PYTHONPATH": os.pathsep.join(
                        [str(src), str(HERE.parents[1]),
                         os.environ.get("PYTHONPATH", "")])})
    t = _hit_rule_test(run)
    if not report:
        assert t["outcome"] == "failed" and "TuttiConnectorV1 publishes residency " \
            "through worker metadata" in t["message"] and "worker_report" in \
            t["message"], f"{t['outcome']}: {t['message']}\n{run.tail()}"
        return
    assert t["outcome"] == "passed", f"{t['message']}\n{run.tail()}"
    hits = t["properties"]["hits_by_prompt_len"]
    assert hits["33"] == 32 and hits["129"] == 128, hits  # C*floor((len-1)/C), C=32
    assert t["properties"]["worker"] == f"stand-in: {report}"


def test_declared_standin_reports_the_fault_wrappers_planned_load_failure(
        tmp_path, monkeypatch) -> None:
    """Under fail_load, the stand-in reports the planned blocks as vLLM
    expects (invalid_block_ids in the load's step), and vLLM recomputes them."""
    from tvc import contract as C
    from tvc.config.profile import load
    from tvc.contract.faults import wrap_kv_transfer_config
    from tvc.contract.standins import HookWorker

    monkeypatch.syspath_prepend(str(HERE))
    prof = tmp_path / "p.toml"
    prof.write_text(PROFILE.format(cls="WorkerMetaResidencyConnector",
                                   store="${SCRATCH}/store", rule="(len - 1) // B * B",
                                   devices='["cuda"]', report=STANDIN, env="{}",
                                   scratch=tmp_path / "scratch"))
    profile = load(str(prof))
    ktc = dict(profile.kv_transfer_config(), kv_load_failure_policy="recompute")
    rig = C.make_rig(profile, profile.scratch / "contract", num_blocks=64,
                     kv_transfer_config=wrap_kv_transfer_config(ktc, "fail_load"))
    assert isinstance(rig.worker, HookWorker)
    first = rig.request(4 * 16 + 5)
    rig.driver.run(first)
    rig.forget_local_cache()
    second = rig.request(4 * 16 + 5, shared_prefix=first.prompt_token_ids)
    rig.driver.run(second)
    assert C.external_hit(rig.driver, second)[1] == 64
    assert len(rig.worker.reported_invalid_blocks) == 1, (
        rig.worker.reported_invalid_blocks)
    C.assert_scheduler_empty_and_no_leaked_blocks(rig.scheduler)
