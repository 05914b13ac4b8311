"""The TP = 2 contract tests pass a TP-safe connector and catch rank-local faults.

Runs ``suites/contract/test_tp.py`` (CPU / gloo variants) in a subprocess against
profiles built on :mod:`selftests.twogpu.tp_connectors`: the known-good
``PerRankExampleConnector`` passes every case; each faulty connector fails the
check meant for it, with the message naming the rank (and layer).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from selftests.conftest import run_suite
from selftests.foundation import fakes

HERE = Path(__file__).resolve().parent

pytestmark = [pytest.mark.hw_any]

PROFILE = """\
[profile]
name = "tp-{cls}"
[connector]
name = "{cls}"
module_path = "tp_connectors"
kv_role = "kv_both"
extra_config = {{ shared_storage_path = "{store}" }}
worker_devices = ["cpu"]
[vllm]
tensor_parallel_sizes = [1, 2]
[scratch]
dir = "{scratch}"
"""


def _run(tmp_path: Path, cls: str, select: str):
    prof = tmp_path / f"tp-{cls}.toml"
    prof.write_text(PROFILE.format(cls=cls, store="${SCRATCH}/store",
                                   scratch=tmp_path / "scratch"))
    return run_suite(
        ["suites/contract/test_tp.py", "-k", select, f"--tvc-profile={prof}", "-q",
         "-p", "no:xdist"],
        tmp_path / "report", env={"PYTHONPATH": fakes.pythonpath(HERE)},
        timeout_s=600)


def test_tp_safe_connector_passes_every_cpu_case(tmp_path: Path) -> None:
    run = _run(tmp_path, "PerRankExampleConnector", "cpu")
    assert run.rc == 0, run.tail()
    outcomes = {t["nodeid"].split("::")[-1]: t["outcome"]
                for t in run.summary["tests"]}
    tp = ["test_tp_round_trip_is_bit_identical_on_every_rank[B16-H2-cpu-gloo]",
          "test_tp_round_trip_is_bit_identical_on_every_rank[B16-H4-cpu-gloo]",
          "test_tp_load_error_on_one_rank_reaches_the_scheduler[cpu-gloo]"]
    # the profile claims TP 2 only: the pipeline-parallel cases skip, saying so
    pp = ["test_pp_round_trip_is_bit_identical_on_every_stage[TP1-PP2-cpu-gloo]",
          "test_pp_round_trip_is_bit_identical_on_every_stage[TP2-PP2-cpu-gloo]"]
    assert sorted(outcomes) == sorted(tp + pp), outcomes
    assert {outcomes[n] for n in tp} == {"passed"}, outcomes
    assert {outcomes[n] for n in pp} == {"skipped"}, outcomes
    pp_msg = [t["message"] for t in run.summary["tests"] if "test_pp_" in t["nodeid"]]
    assert all("pipeline_parallel_sizes" in m for m in pp_msg), pp_msg


@pytest.mark.parametrize(("cls", "select", "needles"), [
    ("HalfHeadsOnRank1Connector", "round_trip and cpu and H4",
     ("rank 1 of 2 (KV heads 2..3 of 4)", "layer model.layers.0.self_attn.attn",
      "does not hold the KV that was stored")),
    ("Rank1NeverFinishesConnector", "round_trip and cpu and H2",
     ("finished_sending was reported by rank(s) [0] but never by rank(s) [1]",)),
])
def test_tp_check_catches_rank_local_fault(tmp_path: Path, cls: str, select: str,
                                           needles: tuple[str, ...]) -> None:
    run = _run(tmp_path, cls, select)
    tests = run.summary["tests"] if run.summary else []
    assert run.rc == 1 and len(tests) == 1 and tests[0]["outcome"] == "failed", (
        f"{cls}: expected one failed TP test, got rc {run.rc}:\n{run.tail()}")
    for needle in needles:
        assert needle in tests[0]["message"], (
            f"{cls}: failed, but the message lacks {needle!r}: "
            f"{tests[0]['message'][:2000]}")


def test_delayed_free_reported_by_every_rank_passes(tmp_path: Path) -> None:
    """Positive control of the finished-agreement check (delay_free on all ranks)."""
    run = _run(tmp_path, "FinishesOnEveryRankConnector", "round_trip and cpu and H2")
    assert run.rc == 0, run.tail()
    assert [t["outcome"] for t in run.summary["tests"]] == ["passed"], run.tail()
