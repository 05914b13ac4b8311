"""Findings: every failure of a run is listed with its rerun command; the Tutti
defects the suite knows get their title and reproduction, each from its own
symptom only."""

from __future__ import annotations

from pathlib import Path

import pytest

from tvc.core.error_hints import hint_prefix
from tvc.plugin.findings import CATALOGUE, findings

pytestmark = [pytest.mark.hw_any]

PROFILE = {"name": "tutti-public", "source": "/x/profiles/tutti-public.toml",
           "connector": "TuttiConnectorV1"}


def _t(nodeid: str, message: str, outcome: str = "failed") -> dict:
    return {"nodeid": nodeid, "outcome": outcome, "message": message}


def _rank4(shape: str) -> str:
    msg = f"AssertionError: unsupported paged KV tensor rank 4 (shape={shape})"
    return hint_prefix(msg) + "The connector's worker side failed ... " + msg


def test_tutti_defects_are_named_from_their_symptoms() -> None:
    tests = [
        _t("suites/contract/test_scenarios.py::test_tenant_isolation_cache_salt_and_"
           "lora", "tenant isolation: the same 129 tokens under another cache_salt "
           "matched 128"),
        _t("suites/contract/test_scenarios.py::test_local_prefix_cache_hit_then_"
           "external_hit", "local + external: 105-token prompt, 16 tokens in vLLM's "
           "local prefix cache: the connector matched 64"),
        _t("suites/contract/test_connector_config.py::test_bad_size_value_fails_at_"
           "creation_naming_it[store.options.num_chunks-wrong_type]",
           "creating the connector with store.options.num_chunks='not-a-number' "
           "failed, but the message does not name the key: TypeError"),
        _t("suites/contract/test_worker_roundtrip.py::test_x[B16-H2-D64-float16-"
           "cuda-NHD]", _rank4("(64, 2, 16, 128)")),
        _t("suites/contract/test_worker_roundtrip.py::test_x[B16-H8-D64-float16-"
           "cuda-NHD]", _rank4("(64, 16, 8, 128)")),
        _t("suites/e2e/test_x.py::test_y", "server died", "error"),
        _t("suites/e2e/test_x.py::test_z", "known upstream defect", "xfailed"),
        _t("suites/e2e/test_x.py::test_ok", "", "passed"),
        _t("suites/e2e/test_x.py::test_skip", "no GPU", "skipped"),
    ]
    got = findings(tests, PROFILE, seed=7)
    keys = [f["key"] for f in got]
    assert keys == ["tutti-cache-salt", "tutti-local-hit-alignment",
                    "tutti-num-chunks-type", "tutti-rank4-per-layer",
                    "tutti-kv-heads", "test", "test"], keys
    for f in got:
        assert f["rerun"].startswith("pytest ") and \
            "--tvc-profile=/x/profiles/tutti-public.toml --tvc-seed=7" in f["rerun"]
    assert all(f["reproduction"] and f["source"] for f in got[:5])
    assert got[-1]["outcome"] == "xfailed"
    # a strict run's red reruns strict: without --tvc-require it could skip
    strict = findings(tests[-3:-2], PROFILE, seed=7, require=["nvme", "gpu"])
    assert strict[0]["rerun"].endswith("--tvc-seed=7 --tvc-require=gpu,nvme"), strict
    assert "--tvc-require" not in got[-1]["rerun"]


def test_a_symptom_elsewhere_is_not_that_defect() -> None:
    """The tenant-isolation title needs the tenant test and its message."""
    got = findings([_t("suites/contract/test_scenarios.py::test_abort_leaves_"
                       "nothing_behind", "tenant isolation")], PROFILE)
    assert [f["key"] for f in got] == ["test"]


def test_the_same_symptom_of_another_connector_is_not_tuttis_defect() -> None:
    """A tenant-isolation failure of another connector gets no Tutti title,
    reproduction or source (fresh-user finding: an ExampleConnector subclass's
    red was titled with Tutti's chunk keys and source)."""
    tenant = _t("suites/contract/test_scenarios.py::test_tenant_isolation_cache_"
                "salt_and_lora", "tenant isolation: the same 41 tokens under "
                "another cache_salt matched 32")
    mine = {"name": "my", "source": "/x/my.toml", "connector": "MyConnector"}
    got = findings([tenant], mine)
    assert [f["key"] for f in got] == ["test"]
    assert not got[0]["reproduction"] and not got[0]["source"], got
    assert [f["key"] for f in findings([tenant], PROFILE)] == ["tutti-cache-salt"]


def _dropped(kind: str) -> str:
    return ("replaying a stored 72-token prompt matched 0 tokens; ...; the worker "
            f"side returned 2 non-empty worker metadata object(s) ({kind}) from "
            "build_connector_worker_meta, and vLLM's scheduler handed each to the "
            "connector's update_connector_output, yet get_num_new_matched_tokens "
            "matched 0: the scheduler side did not publish what its workers "
            "reported as stored")


def test_withdrawn_residency_finding_is_gone() -> None:
    """docs/tutti.md withdrew tutti-residency-unpublished (an older reconstruction
    file, not a Tutti defect): such a red is a plain test failure now."""
    node = "suites/contract/test_worker_roundtrip.py::t[B16-H2-D64-cuda-NHD]"
    got = findings([_t(node, _dropped("TuttiWorkerMetadata"))], PROFILE)
    assert [f["key"] for f in got] == ["test"], got
    assert "tutti-residency-unpublished" not in {d.key for d in CATALOGUE}


LMCACHE = {"name": "lmcache", "source": "lmcache.toml",
           "connector": "LMCacheConnectorV1"}


def test_lmcache_corruption_is_matched_only_on_the_versions_it_applies_to() -> None:
    node = "suites/e2e/test_external_prefix_hit.py::test_second_pass_is_served[x]"
    msg = ("pass 2 differs from the baseline; pass 1 agrees with the baseline — the "
           "KV the connector loaded is wrong (the connector, not vLLM): token 0")
    on_026 = findings([_t(node, msg)], LMCACHE,
                      versions={"vllm": "0.26.0", "lmcache": "0.5.3"})
    assert [f["key"] for f in on_026] == ["lmcache-packed-kv-corruption"]
    assert on_026[0]["link"] == "https://github.com/LMCache/LMCache/issues/4463"
    assert on_026[0]["applies_to"] == "vLLM >=0.26,<0.27, lmcache>=0.5.3"
    on_028 = findings([_t(node, msg)], LMCACHE,
                      versions={"vllm": "0.28.0", "lmcache": "0.5.6"})
    assert [f["key"] for f in on_028] == ["test"], on_028
    other = findings([_t(node, msg)], {**LMCACHE, "connector": "ExampleConnector"},
                     versions={"vllm": "0.26.0"})
    assert [f["key"] for f in other] == ["test"]
    server_side = ("pass 1 differs from the baseline while pass 2 agrees with it — "
                   "the connector server computes the prompt differently")
    got = findings([_t(node, server_side)], LMCACHE, versions={"vllm": "0.26.0"})
    assert [f["key"] for f in got] == ["test"], got
    harness = ("request r1: layer model.layers.0.self_attn.attn: token 0 (block 3, "
               "offset 0) does not hold the KV that was stored for it (512 of 512 "
               "tokens differ)")
    node2 = "suites/contract/test_worker_roundtrip.py::test_x[B16-cuda-NHD]"
    got = findings([_t(node2, harness)], LMCACHE,
                   versions={"vllm": "0.26.0", "lmcache": "0.5.3"})
    assert [f["key"] for f in got] == ["lmcache-packed-kv-corruption"], got
    free = ("exploration: invariant 'no write into a free block' broken: 17 "
            "block(s): layer model.layers.0.self_attn.attn: block 16, freed when "
            "request req-330 ended (FINISHED_LENGTH_CAPPED), engine step 2, was "
            "written in the worker step of engine step 7 while free")
    node3 = ("suites/contract/test_exploration.py::test_contract_holds_over_"
             "explored_event_sequences[faults]")
    got = findings([_t(node3, free)], LMCACHE,
                   versions={"vllm": "0.26.0", "lmcache": "0.5.3"})
    assert [f["key"] for f in got] == ["lmcache-packed-kv-corruption"], got
    got = findings([_t(node3, free)], LMCACHE,
                   versions={"vllm": "0.28.0", "lmcache": "0.5.6"})
    assert [f["key"] for f in got] == ["test"], got


def test_lmcache_prompt_embeds_typeerror_is_a_finding() -> None:
    node = ("suites/contract/test_exploration.py::test_contract_holds_over_explored_"
            "event_sequences[tenants]")
    msg = ("engine step 3 (scheduler step) raised TypeError: object of type "
           "'NoneType' has no len() inside LMCacheConnectorV1.build_connector_meta")
    got = findings([_t(node, msg)], LMCACHE,
                   versions={"vllm": "0.28.0", "lmcache": "0.5.6"})
    assert [f["key"] for f in got] == ["lmcache-prompt-embeds-typeerror"], got


def test_tutti_prompt_embeds_typeerror_is_its_own_finding() -> None:
    # the message of the current tree's CPU run (2026-12-05); LMCache's finding
    # of the same shape is another connector's
    node = ("suites/contract/test_exploration.py::test_contract_holds_over_explored_"
            "event_sequences[tenants]")
    msg = ("exploration: invariant 'no exception escapes an engine step' broken: "
           "engine step 1 (schedule (scheduler-side connector)) raised TypeError: "
           "'NoneType' object is not iterable inside "
           "TuttiConnectorV1.build_connector_meta (/x/tutti/integration/vllm/"
           "connector.py:453)")
    got = findings([_t(node, msg)], PROFILE, versions={"vllm": "0.28.0"})
    assert [f["key"] for f in got] == ["tutti-prompt-embeds-typeerror"], got
    got = findings([_t(node, msg)], LMCACHE,
                   versions={"vllm": "0.28.0", "lmcache": "0.5.6"})
    assert [f["key"] for f in got] == ["test"], got


def test_one_defect_seen_by_several_tests_is_one_finding() -> None:
    tests = [_t(f"suites/contract/test_worker_roundtrip.py::t[B16-H2-D{d}-cuda]",
                _rank4(f"(64, 2, 16, {2 * d})")) for d in (64, 128)]
    got = findings(tests, PROFILE)
    assert len(got) == 1 and len(got[0]["tests"]) == 2, got


def test_the_rerun_command_carries_the_runs_pythonpath() -> None:
    """An out-of-tree connector is found through PYTHONPATH: a rerun without it
    fails on the import (fresh-user finding), so the command names it."""
    tests = [_t("suites/contract/test_x.py::test_y", "boom")]
    got = findings(tests, PROFILE, seed=7, pythonpath="/home/me/my conn")
    assert got[0]["rerun"].startswith("PYTHONPATH='/home/me/my conn' pytest "), got
    assert findings(tests, PROFILE, seed=7)[0]["rerun"].startswith("pytest ")


def test_the_rerun_command_of_the_packaged_suite_names_its_folder(tmp_path) -> None:
    """Run from the user's folder, the installed suite's node ids are relative to
    its package: the rerun names the test's path there and that rootdir (a
    fresh user's rerun gave 'file or directory not found: suites/...')."""
    import shlex
    import subprocess
    import sys

    from selftests.conftest import REPO_ROOT

    tests = [_t("suites/level1/test_vllm_install.py::test_vllm_imports", "boom")]
    got = findings(tests, PROFILE, seed=7, root=str(REPO_ROOT))[0]["rerun"]
    words = shlex.split(got)
    assert words[1:3] == [
        f"{REPO_ROOT}/suites/level1/test_vllm_install.py::test_vllm_imports",
        f"--rootdir={REPO_ROOT}"], got
    # collected from elsewhere under that rootdir, the node id is the run's own
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
         "no:cacheprovider", *words[1:3]], cwd=tmp_path, capture_output=True,
        text=True, timeout=300, check=False)
    assert "suites/level1/test_vllm_install.py::test_vllm_imports" in proc.stdout, (
        proc.stdout[-2000:] + proc.stderr[-2000:])


def test_the_rerun_command_keeps_the_runs_depth() -> None:
    """A red of a ``--tvc-depth=quick`` run reruns at that depth, with its
    explored-sequence count and volume where they were not the depth's own
    (fresh-user finding: the rerun went back to standard depth)."""
    tests = [_t("suites/contract/test_x.py::test_y", "boom")]
    quick = {"name": "quick", "explore_examples": 10, "scenario_volume": 200}
    got = findings(tests, PROFILE, seed=7, depth=quick)[0]["rerun"]
    assert got.endswith("--tvc-seed=7 --tvc-depth=quick"), got
    odd = {"name": "quick", "explore_examples": 3, "scenario_volume": 1000}
    got = findings(tests, PROFILE, seed=7, depth=odd)[0]["rerun"]
    assert got.startswith("TVC_SCENARIO_VOLUME=1000 pytest "), got
    assert got.endswith("--tvc-depth=quick --tvc-explore-examples=3"), got
    standard = {"name": "standard", "explore_examples": 30, "scenario_volume": 1000}
    got = findings(tests, PROFILE, seed=7, depth=standard)[0]["rerun"]
    assert got.endswith("--tvc-seed=7"), got


def test_wrong_kv_after_a_local_hit_is_the_tutti_finding_only_there() -> None:
    """Seen on the H200: the local-then-external red and the wave red (every
    request admitted after the first of its prefix group) are Tutti's load-start
    defect; the same words for another connector, or another test's wrong-KV
    message, stay plain test findings."""
    wave = ("suites/e2e/test_concurrency.py::"
            "test_concurrent_requests_match_the_baseline_and_the_hit_rule")
    msg = ("concurrency: connector, concurrent request #8 (concurrency-4) differs "
           "from the baseline (no connector) — the KV loaded while several "
           "requests load at once is wrong (the same prompt alone agreed). In all, "
           "8 of 16 requests differ: #8 (concurrency-4); every one of them shares "
           "its first 288+ tokens with another request of the wave.")
    local = ("suites/e2e/test_external_prefix_hit.py::"
             "test_local_prefix_cache_hit_then_external_hit")
    lmsg = ("output token ids differ ... — the KV of tokens [304, 560) the "
            "connector loaded after vLLM's local hit of 304 tokens is wrong: ...")
    got = findings([_t(wave, msg), _t(local, lmsg)], PROFILE)
    assert [f["key"] for f in got] == ["tutti-load-start-ignores-local-hit"], got
    assert len(got[0]["tests"]) == 2, got
    assert "num_computed_tokens" in got[0]["title"], got
    assert "1708249249" in got[0]["reproduction"], got
    assert "computed=288" in got[0]["reproduction"], got
    other = findings([_t(wave, msg)], {**PROFILE, "connector": "ExampleConnector"})
    assert [f["key"] for f in other] == ["test"]
    kb = findings([_t("suites/e2e/test_external_prefix_hit.py::test_hit_count_at_"
                      "block_boundaries[kB]", "the KV the connector loaded is not "
                      "the KV pass 1 computed")], PROFILE)
    assert [f["key"] for f in kb] == ["test"]
    # an intermittent boundary red (some of the fresh prompts) names the
    # suspected race; a red of every prompt does not
    some = ("1 of 12 fresh 64-token prompts failed the two-pass check (some only: "
            "an intermittent fault, e.g. a race ...)")
    every = "12 of 12 fresh 64-token prompts failed the two-pass check (every one)"
    node = "suites/e2e/test_external_prefix_hit.py::test_hit_count_at_block_boundaries"
    assert [f["key"] for f in findings([_t(node + "[kB]", some)], PROFILE)] == [
        "tutti-slot-mapping-race"]
    assert [f["key"] for f in findings([_t(node + "[kB]", every)], PROFILE)] == [
        "test"]
    assert [f["key"] for f in findings([_t(node + "[kB-1]", some)], PROFILE)] == [
        "test"]


@pytest.mark.parametrize(("nodeid", "message", "key"), [
    ("suites/contract/test_connector_api.py::test_multimodal_item_hits_never_serve_"
     "another_image[cpu]", "blocks past token 64 hold image A's KV. The connector's "
     "keys ignore the item's hash (Request.mm_features identifier ...)",
     "tutti-mm-hash"),
    ("suites/contract/test_connector_api.py::test_request_that_must_not_read_"
     "cached_kv_gets_a_miss[cpu-prompt_logprobs]", "started with 64 tokens counted "
     "as computed ...: the connector ignores Request.skip_reading_prefix_cache",
     "tutti-skip-reading"),
    ("suites/contract/test_exploration.py::test_contract_holds_over_explored_event_"
     "sequences[tenants]", "exploration: invariant 'no hit across tenants or "
     "adapters' broken: request req-1718 (tenant 'salt:tvc-tenant-a') matched 32",
     "tutti-cache-salt"),
])
def test_tuttis_cpu_reds_are_each_a_catalogued_finding(nodeid: str, message: str,
                                                        key: str) -> None:
    """Seen on CPU (vLLM 0.28.0, tutti-public, 2026-12-03): each red of the
    contract tier names its Tutti defect; another connector's same words do not."""
    assert [f["key"] for f in findings([_t(nodeid, message)], PROFILE)] == [key]
    other = {**PROFILE, "connector": "ExampleConnector"}
    assert [f["key"] for f in findings([_t(nodeid, message)], other)] == ["test"]


def test_the_rerun_command_calls_the_runs_own_pytest(tmp_path) -> None:
    """A bare ``pytest`` is whatever PATH finds first (fresh-user finding: a
    pyenv shim without the suite's dependencies); the command names the pytest
    beside the run's interpreter, relative to the folder the run started in."""
    from tvc.plugin.findings import pytest_command

    bin_ = tmp_path / ".venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "pytest").write_text("#!/bin/sh\n")
    python = str(bin_ / "python")
    assert pytest_command(python, str(tmp_path)) == ".venv/bin/pytest"
    assert pytest_command(python, "/elsewhere") == str(bin_ / "pytest")
    assert pytest_command(str(tmp_path / "python"), str(tmp_path)) == "pytest"
    tests = [_t("suites/contract/test_x.py::test_y", "boom")]
    got = findings(tests, PROFILE, seed=7, pytest=".venv/bin/pytest")[0]["rerun"]
    assert got.startswith(".venv/bin/pytest suites/contract/test_x.py::test_y "), got


LMCACHE_MP = {"name": "lmcache-mp", "source": "lmcache-mp.toml",
              "connector": "LMCacheMPConnector"}
MP_RUN = Path(__file__).parent / "data" / "lmcache_mp_h100_reds.json"


def test_each_lmcache_mp_red_of_the_h100_run_is_its_own_finding() -> None:
    """The 13 connector reds of LMCacheMPConnector on the H100 host (vLLM 0.26.0,
    lmcache 0.5.3, 2026-12-05), messages as the run wrote them: each is its
    catalogued defect, and only for that connector and those versions."""
    import json

    reds = json.loads(MP_RUN.read_text())
    on_026 = {"vllm": "0.26.0", "lmcache": "0.5.3"}
    got = {r["nodeid"].split("::")[-1]: [f["key"] for f in findings(
        [_t(r["nodeid"], r["message"])], LMCACHE_MP, versions=on_026)]
        for r in reds}
    want = {"skip-reading": 2, "under-store": 6, "finished-after-free": 2,
            "dtype-key": 2, "lora-key": 1}
    keys = [k[0].removeprefix("lmcache-mp-") for k in got.values() if len(k) == 1]
    assert {k: keys.count(k) for k in want} == want, got
    # the in-process connector's run, or a vLLM that guards skip_reading itself
    other = findings([_t(reds[0]["nodeid"], reds[0]["message"])], LMCACHE,
                     versions=on_026)
    assert not any(f["key"].startswith("lmcache-mp-") for f in other), other
    skip = [r for r in reds if "skip_reading" in r["message"]][0]
    got_033 = findings([_t(skip["nodeid"], skip["message"])], LMCACHE_MP,
                       versions={"vllm": "0.33.0", "lmcache": "0.5.6"})
    assert [f["key"] for f in got_033] == ["test"], got_033
