"""The skeleton connector of ``docs/your-connector.md`` stays correct.

``docs/examples/skeleton_connector.py`` and ``skeleton.toml`` are what a connector
author copies; this runs them through a few contract tests on CPU (the hit rule,
a store fault and a failed save, preemption, the worker round trip), each of which
must pass, not skip. A copy that forgets vLLM's local prefix cache (one of the
traps the skeleton marks) goes red where the doc says.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from selftests.conftest import REPO_ROOT, run_suite

pytestmark = pytest.mark.hw_any

EXAMPLES = REPO_ROOT / "docs" / "examples"
SCEN = "suites/contract/test_scenarios.py"
TESTS = {  # node id part -> its file
    "test_second_pass_matches_declared_hit_rule[16]":
        "suites/contract/test_scheduler_contract.py",
    "test_store_fault_is_reported_never_silent[cpu-corrupt-recompute]": SCEN,
    "test_store_fault_is_reported_never_silent[cpu-fail_save-recompute]": SCEN,
    "test_preemption_and_resume[cpu]": SCEN,
    "test_local_prefix_cache_hit_then_external_hit[cpu]": SCEN,
    "test_loaded_kv_is_bit_identical_and_nothing_else_changes"
    "[B16-H2-D64-float16-cpu-NHD]": "suites/contract/test_worker_roundtrip.py",
}

FORGETS_LOCAL = '''
from skeleton_connector import SkeletonConnector


class ForgetsLocalCacheConnector(SkeletonConnector):
    """The skeleton with one trap walked into: vLLM's local prefix cache ignored."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return super().get_num_new_matched_tokens(request, 0)
'''


def _run(tmp_path: Path, profile: Path, tests: list[str]):
    env = {"PYTHONPATH": os.pathsep.join(
        [str(tmp_path), str(EXAMPLES), str(REPO_ROOT), os.environ.get(
            "PYTHONPATH", "")])}
    files = sorted({TESTS[t] for t in tests})
    return run_suite([*files, "-m", "contract", "-k", " or ".join(
        t.replace("[", " and ").replace("]", "").replace("-", " and ")
        for t in tests), f"--tvc-profile={profile}"], tmp_path / "report",
        env=env, timeout_s=900)


def _profile(tmp_path: Path, cls: str = "", module: str = "") -> Path:
    text = (EXAMPLES / "skeleton.toml").read_text()
    if cls:
        text = text.replace('name = "SkeletonConnector"', f'name = "{cls}"')
        text = text.replace('"skeleton_connector"', f'"{module}"')
    path = tmp_path / "skeleton.toml"
    path.write_text(text + f'\n[scratch]\ndir = "{tmp_path / "scratch"}"\n')
    return path


def test_the_skeleton_passes_the_contract_tests_it_marks(tmp_path: Path) -> None:
    run = _run(tmp_path, _profile(tmp_path), list(TESTS))
    assert run.summary is not None, run.tail()
    seen = {t["nodeid"].split("::")[-1]: t for t in run.summary["tests"]}
    for name in TESTS:
        t = seen.get(name)
        assert t is not None and t["outcome"] == "passed", (
            f"{name}: {t and t['outcome']}: {t and t['message']}\n{run.tail(3000)}")


def test_a_copy_that_forgets_the_local_cache_goes_red_where_the_doc_says(
        tmp_path: Path) -> None:
    (tmp_path / "forgets_local.py").write_text(FORGETS_LOCAL)
    name = "test_local_prefix_cache_hit_then_external_hit[cpu]"
    run = _run(tmp_path, _profile(tmp_path, "ForgetsLocalCacheConnector",
                                  "forgets_local"), [name])
    t = run.test(name)
    assert t["outcome"] == "failed", (t, run.tail(3000))
    assert "although vLLM passed num_computed_tokens=16 (its local prefix cache " \
        "hit)" in t["message"] and "The connector ignores the local hit" in \
        t["message"], t["message"]
