"""Every built-in profile's hit rule is the one the contract tier exercises.

``lab-disk`` once carried a stale copy of ExampleConnector's rule that nothing
checked, and its GPU run raised three false alarms. Here each built-in profile that
declares a hit rule runs the contract tier's hit-rule check with vLLM's real
scheduler: the check must be selected (not deselected, not skipped for lack of a
rule), pass, and record hits equal to the profile's rule, some of them above zero
(a rule checked only where it says 0 proves nothing).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from selftests.conftest import run_suite
from tvc.config.profile import BUILTIN_DIR, load
from tvc.contract.rig import adapter_missing_reason

CHECK = "test_second_pass_matches_declared_hit_rule"
BLOCK_SIZES = (16, 32)  # suites/contract/test_scheduler_contract.py BLOCK_SIZES
BUILTINS = sorted(p.stem for p in BUILTIN_DIR.glob("*.toml"))


def _has_rule(name: str) -> bool:
    return bool(load(name, env={}).select_hit_rule()[0])


def test_the_builtins_with_a_rule_are_known() -> None:
    """A new built-in with a rule is picked up below; one without says so here."""
    assert [n for n in BUILTINS if not _has_rule(n)] == ["tutti-operators"], (
        "tutti-operators declares no hit rule yet (its connector's matching is "
        "not public); every other built-in must declare one")


@pytest.mark.parametrize("name", [n for n in BUILTINS if _has_rule(n)])
def test_contract_tier_exercises_the_builtin_hit_rule(name: str,
                                                      tmp_path: Path) -> None:
    prof = load(name, env={})
    conn = prof["connector"]
    if not conn["module_path"]:
        from vllm.distributed.kv_transfer.kv_connector.factory import (
            KVConnectorFactory,
        )

        if conn["name"] not in getattr(KVConnectorFactory, "_registry", {conn["name"]}):
            pytest.skip(f"profile {name}: connector {conn['name']} is not in this "
                        "vLLM's KVConnectorFactory (removed upstream); its rule is "
                        "exercised where that vLLM is installed")
    why = adapter_missing_reason(prof)  # out-of-tree connector not on this box
    if why:
        pytest.skip(why)
    run = run_suite(["suites/contract", "-m", "contract", "-k", CHECK,
                     f"--tvc-profile={name}", "-p", "no:xdist"], tmp_path / "r",
                    timeout_s=900)
    assert run.summary is not None, run.tail()
    tests = {t["nodeid"].rsplit("[", 1)[-1].rstrip("]"): t
             for t in run.summary["tests"] if CHECK in t["nodeid"]}
    assert sorted(tests) == sorted(str(b) for b in BLOCK_SIZES), (
        f"{name}: the hit-rule check ran for {sorted(tests)}, expected block sizes "
        f"{BLOCK_SIZES}:\n{run.tail()}")
    for block, t in tests.items():
        assert t["outcome"] == "passed", (name, block, t["message"][:2000])
        seen = {int(n): hit for n, hit in t["properties"]["hits_by_prompt_len"].items()}
        want = {n: prof.expected_hit_tokens(n, int(block)) for n in seen}
        assert seen == want, (name, block, seen, want)
        assert any(hit > 0 for hit in seen.values()), (
            f"{name} B={block}: no prompt length gave a hit, so the rule was never "
            f"tested where it matters: {seen}")


def test_a_misspelt_module_path_is_named_with_the_close_module(
        tmp_path: Path) -> None:
    """Fresh-user finding: a typo in connector.module_path said only "Put the
    adapter's package on PYTHONPATH" (a Tutti word). It now offers the module
    on the path whose name is closest, and says to fix module_path."""
    pkg = tmp_path / "mods"
    pkg.mkdir()
    (pkg / "lagged_chunk_connector.py").write_text("")
    prof = tmp_path / "typo.toml"
    prof.write_text('[profile]\nname = "typo"\n[connector]\nname = "C"\n'
                    'module_path = "lagged_chunk_connectr"\nhit_rule = "0"\n')
    sys.path.insert(0, str(pkg))
    try:
        why = adapter_missing_reason(load(str(prof)))
    finally:
        sys.path.remove(str(pkg))
    assert "Did you mean 'lagged_chunk_connector'?" in why, why
    assert "connector.module_path" in why and "adapter" not in why, why


def test_a_whole_prompt_rule_is_blamed_not_the_connector(tmp_path: Path) -> None:
    """Fresh-user finding: a profile whose rule claims the whole prompt at a block
    boundary (``len // B * B``) was red as "the connector stores nothing" or "throws
    stored KV away" on a correct ExampleConnector. Where the rule expects the whole
    prompt and the connector answered less, the red names the rule first."""
    prof = tmp_path / "whole.toml"
    prof.write_text('[profile]\nname = "whole-prompt-rule"\nextends = "example"\n'
                    '[connector]\nhit_rules = []\nhit_rule = "len // B * B"\n'
                    'hit_rule_source = "a user\'s guess"\n')
    run = run_suite(["suites/contract", "-m", "contract", "-k",
                     f"({CHECK} and 16) or (granularity and cpu)",
                     f"--tvc-profile={prof}", "-p", "no:xdist"], tmp_path / "r",
                    timeout_s=900)
    assert run.summary is not None, run.tail()
    reds = {t["nodeid"]: t["message"] for t in run.summary["tests"]}
    assert len(reds) == 2, reds
    for nodeid, message in reds.items():
        assert "Fix the profile's connector.hit_rule first" in message, (nodeid,
                                                                         message)
        assert "expects 16 tokens, the whole prompt" in message, message
        assert "stores nothing" not in message and "throws" not in message, message
