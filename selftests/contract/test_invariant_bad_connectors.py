"""The invariants vLLM implies catch each planted fault, in their own words.

Every connector of ``invariant_bad_connectors.py`` is a correct panel member
(``panel_connectors.py``) with ONE fault; each runs the one contract test
whose invariant names that fault (CPU, a generated profile) and must fail with
the expected message. The panel itself stays green on the same tests
(``test_panel_connectors.py`` runs it whole).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from selftests.conftest import REPO_ROOT, SuiteRun, run_suite

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.hw_any

SCEN = "suites/contract/test_scenarios.py"
RULE = "(len - 1) // max(chunk_tokens, B) * max(chunk_tokens, B)"

PROFILE = """\
[profile]
name = "issue31-{name}"
[connector]
name = "{cls}"
module_path = "invariant_bad_connectors"
kv_role = "kv_both"
extra_config = {{ store_path = "${{SCRATCH}}/store", chunk_tokens = {chunk}{extra} }}
granularity = "max(chunk_tokens, B)"
hit_rule = "{rule}"
hit_rule_source = "selftests/contract/panel_connectors.py"
persistent_store = true
worker_devices = ["cpu"]
{keys}
[scratch]
dir = "{scratch}"
"""


def run_one(tmp_path: Path, cls: str, select: list[str], *, chunk: int = 16,
            extra: str = "", keys: str = "", timeout_s: float = 600) -> SuiteRun:
    """Run ``select`` (pytest arguments) against connector ``cls`` on CPU.

    Args:
        tmp_path: the test's folder (profile, scratch, report).
        cls: a class of ``invariant_bad_connectors``.
        select: test path and ``-k`` / ``-m`` arguments.
        chunk: ``chunk_tokens`` of the extra config.
        extra: more extra-config entries (``", key = value"``).
        keys: more ``[connector]`` lines.
        timeout_s: wall-clock limit of the run.

    """
    prof = tmp_path / f"{cls}.toml"
    prof.write_text(PROFILE.format(name=cls, cls=cls, chunk=chunk, extra=extra,
                                   rule=RULE, keys=keys,
                                   scratch=tmp_path / "scratch"))
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), str(REPO_ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    return run_suite([*select, "-p", "no:xdist", f"--tvc-profile={prof}"],
                     tmp_path / "report", env=env, timeout_s=timeout_s)


# ------------------------------------------------------------------- watchdog
@pytest.mark.parametrize(("keys", "limit"), [
    ("call_timeout_s = 2", r"did not finish within 2 s \(connector\.call_timeout_s\)"),
    ("call_timeout_s = 600\ntest_timeout_s = 10",
     r"the test's time limit \(pytest-timeout, connector\.test_timeout_s\) ran out "
     r"\d+(\.\d+)? s into it"),
], ids=["call", "test"])
def test_a_call_that_never_returns_fails_its_test_and_the_run_reports(
        keys: str, limit: str, tmp_path: Path) -> None:
    run = run_one(tmp_path, "WaitsForSpaceConnector",
                  [SCEN, "-m", "contract", "-k", "local_prefix and cpu"],
                  extra=", capacity_chunks = 3", keys=keys, timeout_s=300)
    assert run.summary is not None, run.tail()  # the run wrote its report
    t = run.test("test_local_prefix_cache_hit_then_external_hit[cpu]")
    msg = t.get("message") or ""
    assert t["outcome"] == "failed" and run.rc == 1, (t, run.tail(3000))
    assert re.search(
        r"engine step \d+ \(schedule \(scheduler-side connector\)\) " + limit
        + r": WaitsForSpaceConnector\.update_state_after_alloc \(scheduler side, "
        r"request req-\d+\) never returned; stopped at \S+invariant_bad_connectors"
        r"\.py:\d+ in update_state_after_alloc: (time\.sleep\(0\.001\)|while sum)",
        msg), msg
    assert "never wait for space that only a later engine step can free" in msg, msg
    page = (run.report_dir / "summary.md").read_text()
    assert "test_local_prefix_cache_hit_then_external_hit" in page, page[-2000:]


# -------------------------------------------------------------- use after free
def test_a_save_from_blocks_vllm_freed_is_named(tmp_path: Path) -> None:
    run = run_one(tmp_path, "SavesAfterFreeConnector",
                  [SCEN, "-m", "contract", "-k", "freed_blocks and cpu"])
    t = run.test("test_freed_blocks_handed_to_the_next_request_at_once[cpu]")
    msg = t.get("message") or ""
    assert t["outcome"] == "failed", (t, run.tail(3000))
    assert re.search(
        r"does not hold the KV that was stored for it \(\d+ of \d+ tokens differ\); "
        r"the block holds the KV of tokens \[\d+, \d+\) of request req-\d+: the "
        r"entry was saved from a block after vLLM had handed it to that request "
        r"— used after vLLM freed it \(.*\)\. Fix: return True from "
        r"request_finished while a save from the request's blocks is queued", msg
    ), msg


# ------------------------------------------------------------ resumed prefills
RESUMED = ("test_chunked_prefill_preempted_and_resumed[cpu]")


@pytest.mark.parametrize(("cls", "needles"), [
    ("AppendsTableOnResumeConnector", (
        "the block holds the KV of tokens [",
        "of this request (another block of its own table)",
        "was preempted after computing [76, 128] tokens and resumed on other block "
        "ids (table [",
        "the connector saved or loaded a chunk through the block table the request "
        "had before its preemption (block table appended to, or kept; "
        "build_connector_meta / update_state_after_alloc). Fix: after a preemption "
        "vLLM resumes the request with a whole new block table")),
    ("CountsScheduledTokensConnector", (
        "it holds the harness's mark of a block vLLM had allocated but nothing had "
        "computed yet: the entry was saved from tokens before vLLM computed them "
        "(the connector counts computed tokens itself and its count ran ahead of "
        "num_computed_tokens, e.g. it was not reset when vLLM preempted the request "
        "and recomputed it)",)),
])
def test_state_kept_across_a_preemption_is_red(cls: str, needles: tuple[str, ...],
                                                tmp_path: Path) -> None:
    run = run_one(tmp_path, cls, [SCEN, "-m", "contract", "-k", "resumed and cpu"])
    t = run.test(RESUMED)
    msg = t.get("message") or ""
    assert t["outcome"] == "failed", (t, run.tail(3000))
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_the_exploration_finds_a_block_table_kept_across_a_preemption(
        tmp_path: Path) -> None:
    # a drawn sequence must resume a prefill that then saves a chunk the
    # prefix cache did not hand back (the family's fixed crowd sequence resumes
    # on the blocks the prefix cache kept, where the kept table is still right).
    # Which seeds draw one moves with the code: hypothesis mixes constants of the
    # suite's own modules into its draws (seed 4 did until 5a37b60 added some;
    # at 180b345 seeds 2 and 6 do, 1, 3, 4 and 5 do not), so the first of a few
    # seeds that breaks the invariant counts
    for seed in (2, 4, 6, 7):
        (tmp_path / f"seed-{seed}").mkdir()
        run = run_one(tmp_path / f"seed-{seed}", "AppendsTableOnResumeConnector",
                      ["suites/contract/test_exploration.py", "-m", "contract",
                       "-k", "preemption", f"--tvc-seed={seed}"], timeout_s=900)
        t = run.test("test_contract_holds_over_explored_event_sequences[preemption]")
        msg = t.get("message") or ""
        if "no block table kept across a preemption" in msg:
            break
    assert t["outcome"] == "failed", (t, run.tail(3000))
    assert "invariant 'no block table kept across a preemption' broken" in msg, msg
    assert ("connector method at fault: build_connector_meta / "
            "update_state_after_alloc (block ids of before the preemption)") in msg, msg
    assert "ex.crowd(" in msg and "replay_explorer(" in msg, msg


# --------------------------------------------------------------- write volume
def test_writing_more_than_vllm_asked_is_red(tmp_path: Path) -> None:
    run = run_one(tmp_path, "StoresEverythingConnector",
                  [SCEN, "-m", "contract", "-k", "writes_no_more and cpu"])
    t = run.test("test_writes_no_more_than_vllm_asked_to_store[cpu]")
    msg = t.get("message") or ""
    assert t["outcome"] == "failed", (t, run.tail(3000))
    assert re.search(
        r"write volume: after 1 request\(s\) \(24-token prompts, 32 output tokens "
        r"each\) the connector has written [\d,]+ bytes in \d+ entries under \S+, "
        r"more than vLLM asked it to store: at most 114,688 bytes and 8 entries — 2 "
        r"blocks of 16,384 KV bytes \(the prompt's blocks; connector.stores_decode "
        r"= false\) x 1.5 \+ 65,536 bytes and 3 entries per block \(one per layer, "
        r"one index\) and 2 of metadata per request",
        msg), msg
    assert "store each block vLLM hands over once" in msg, msg


# ---------------------------------------------------------------- attribution
def test_a_connector_assert_shows_its_file_and_line(tmp_path: Path) -> None:
    run = run_one(tmp_path, "AssertsWholeChunksConnector",
                  [SCEN, "-m", "contract", "-k", "local_prefix and cpu"], chunk=32)
    t = run.test("test_local_prefix_cache_hit_then_external_hit[cpu]")
    msg = t.get("message") or ""
    assert t["outcome"] == "failed", (t, run.tail(3000))
    assert re.search(
        r"engine step \d+ \(worker step \(worker-side connector\)\): the "
        r"connector's own assert failed in AssertsWholeChunksConnector\._load "
        r"\(\S+invariant_bad_connectors\.py:\d+ in _load: assert job\.first == 0, "
        r"\(\): load of chunk \w+ starts at its block 1 — an internal check of the "
        r"connector's code, not a check of this suite", msg), msg


def test_a_wrong_layer_red_names_the_layer_it_found(tmp_path: Path) -> None:
    run = run_one(tmp_path, "LoadsNextLayerConnector",
                  [SCEN, "-m", "contract", "-k", "local_prefix and cpu"])
    t = run.test("test_local_prefix_cache_hit_then_external_hit[cpu]")
    msg = t.get("message") or ""
    assert t["outcome"] == "failed", (t, run.tail(3000))
    assert ("does not hold the KV that was stored for it (16 of 16 tokens differ); "
            "the slots hold layer model.layers.1.self_attn.attn's KV of these "
            "tokens: the connector loaded (or saved) another layer's KV into this "
            "one") in msg, msg


def test_a_request_beyond_the_pool_is_named_the_plans_fault(tmp_path: Path
                                                            ) -> None:
    import sys

    from tvc import contract as C
    from tvc.config.profile import load
    from tvc.contract.driver import RigPlanError

    prof = tmp_path / "panel.toml"
    prof.write_text(PROFILE.format(
        name="pool", cls="SyncPanelConnector", chunk=16, extra="", rule=RULE,
        keys="", scratch=tmp_path / "scratch").replace(
            'module_path = "invariant_bad_connectors"',
            'module_path = "panel_connectors"'))
    sys.path.insert(0, str(HERE))
    try:
        profile = load(str(prof))
        rig = C.make_rig(profile, profile.scratch / "contract", num_blocks=5)
        rig.driver.max_steps = 20
        with pytest.raises(RigPlanError) as info:
            rig.driver.run(rig.request(5 * 16 + 1))
    finally:
        sys.path.remove(str(HERE))
        closer = getattr(locals().get("rig"), "worker", None)
        if closer is not None:
            closer.close()
    msg = str(info.value)
    assert re.search(
        r"the test's plan is wrong, not the connector: request\(s\) \{'req-\d+': "
        r"6\} \(blocks each needs for its tokens\) waited 20 steps for a KV pool of "
        r"4 usable blocks", msg), msg
