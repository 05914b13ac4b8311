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
ROUND_TRIP = "test_loaded_kv_is_bit_identical and cpu and B16-H2-D64-float16"
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
[scratch]
dir = "{scratch}"
"""


def _run(tmp_path: Path, cls: str, select: str, *, devices: str = '["cpu"]',
         report: str = "", rule: str = "(len - 1) // B * B",
         name: str = "run") -> object:
    prof = tmp_path / f"{name}.toml"
    prof.write_text(PROFILE.format(cls=cls, store=tmp_path / "store", rule=rule,
                                   devices=devices, report=report,
                                   scratch=tmp_path / "scratch"))
    env = {"PYTHONPATH": os.pathsep.join(
        [str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    return run_suite(["suites/contract", "-m", "contract", "-k", select,
                      f"--tvc-profile={prof}", "-q"], tmp_path / f"{name}-report",
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


def test_hit_rule_expecting_no_hit_at_all_fails(tmp_path) -> None:
    run = _run(tmp_path, "WorkerMetaResidencyConnector", HIT_RULE, rule="0 * len")
    t = _hit_rule_test(run)
    assert t["outcome"] == "failed" and "would pass without a single hit" in \
        t["message"], f"{t['outcome']}: {t['message']}\n{run.tail()}"


# ------------------------------------------------------------- worker harness
def test_cross_layer_kv_tensor_and_tp_group_are_set_up(tmp_path) -> None:
    run = _run(tmp_path, "CrossLayerConnector", ROUND_TRIP,
               rule="(len - 2) // B * B * ((len - 1 - (len - 1) // B * B + B - 1)"
                    " // B)")
    t = run.test("B16-H2-D64-float16-cpu")
    assert t["outcome"] == "passed", f"{t['message']}\n{run.tail()}"


@pytest.mark.parametrize(("cls", "needle"), [
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
    run = _run(tmp_path, cls, ROUND_TRIP)
    t = run.test("B16-H2-D64-float16-cpu")
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
    """Under tvc.faults fail_load, the stand-in reports the planned blocks as vLLM
    expects (invalid_block_ids in the load's step), and vLLM recomputes them."""
    from tvc import contract as C
    from tvc.contract.standins import HookWorker
    from tvc.faults import wrap_kv_transfer_config
    from tvc.profile import load

    monkeypatch.syspath_prepend(str(HERE))
    prof = tmp_path / "p.toml"
    prof.write_text(PROFILE.format(cls="WorkerMetaResidencyConnector",
                                   store=tmp_path / "store", rule="(len - 1) // B * B",
                                   devices='["cuda"]', report=STANDIN,
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
