"""The report leads with what failed: one cause once, with every test it failed.

Unit checks of :func:`tvc.plugin.findings.normalise_cause` / :func:`causes` /
:func:`cut`, of the verdict and outcome reason (a failed coverage gate, a
terminated run), of :func:`tvc.plugin.report.stamp_junit`, and of the page the
templates render from a synthetic ``summary.json``.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tvc.plugin import summary_page as sp
from tvc.plugin.findings import causes, cut, findings, normalise_cause
from tvc.plugin.report import OUTCOME_CASE, outcome_reason, stamp_junit

pytestmark = pytest.mark.hw_any


def _t(nodeid: str, outcome: str, msg: str = "", tier: str = "contract",
       **props: object) -> dict:
    return {"nodeid": nodeid, "outcome": outcome, "duration_s": 0.1,
            "tiers": [tier], "properties": props, "message": msg}


def _summary(tests: list[dict], run: dict | None = None, **extra: object) -> dict:
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    prof = {"name": "p", "source": "/x/p.toml", "connector": "SomeConnector"}
    s = {"run": {"outcome": "failed", "exit_status": 1, "seed": 7, **(run or {})},
         "profile": prof, "counts": counts, "tests": tests, **extra}
    s["findings"] = findings(tests, prof, 7)
    return s


def _page(tmp_path: Path, summary: dict) -> tuple[str, str]:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "summary.json").write_text(json.dumps(summary))
    out = sp.write_page(run)
    return out["markdown"].read_text(), out["html"].read_text()


# one cause seen in 40 tests: the numbers, paths and request ids differ
def _many(n: int = 40) -> list[dict]:
    return [_t(f"suites/contract/test_scenarios.py::test_case[v{i}]", "failed",
               f"AssertionError: req-{i}: matched {16 * i} tokens of "
               f"/tmp/tvc-{i}/store/k{i}.bin, expected {16 * i + 16} (block_size "
               "16)\nassert 0 == 1")
            for i in range(n)]


def test_one_cause_is_one_entry_listing_every_test_it_failed(tmp_path) -> None:
    other = [_t(f"suites/e2e/test_two_pass.py::test_hit[{i}]", "error",
                f"server exited with status {i} before ready", tier="e2e")
             for i in range(3)]
    skips = [_t(f"suites/real_nvme/test_pool.py::test_{i}", "skipped",
                "no NVMe device: nothing under /dev/nvme*", tier="real_nvme")
             for i in range(12)]
    passed = [_t("suites/level1/test_vllm_install.py::test_vllm_imports", "passed",
                 tier="level1")]
    s = _summary(_many() + other + skips + passed)
    groups = causes(s["tests"], s["findings"])
    assert [len(g["tests"]) for g in groups] == [40, 3], [g["key"] for g in groups]
    assert groups[0]["key"] == ("AssertionError: req-<n>: matched <n> tokens of "
                                "<path>, expected <n> (block_size <n>)")
    assert groups[1]["outcomes"] == {"error": 3}
    md, page = _page(tmp_path, s)
    # what failed comes first, before the tier table and the skips
    assert md.index("## What failed: 43 test(s), 2 cause(s)") < md.index("## Tiers")
    assert md.index("## Tiers") < md.index("## Skipped: 12 test(s), 1 reason(s)")
    assert md.count("matched 0 tokens") == 1, md  # the cause once, not 40 times
    assert "matched 16 tokens" not in md  # the other 39 messages are not repeated
    # every test once: the first six in the entry, the other 34 folded below it
    head = next(ln for ln in md.splitlines() if ln.startswith("- **failed**"))
    rest = next(ln for ln in md.splitlines() if ln.startswith("  - the other 34:"))
    assert rest.endswith("`test_case[" + ", ".join(
        f"v{i}" for i in range(6, 40)) + "]`"), rest
    for i in range(6):
        assert f"`test_case[v{i}]`" in head and f"v{i}," not in rest, i
    assert "(40 tests): AssertionError: req-0: matched 0 tokens" in md
    assert "rerun: `pytest 'suites/contract/test_scenarios.py::test_case[v0]' " \
           "--tvc-profile=/x/p.toml --tvc-seed=7`" in md
    # the title is the first line; the whole message once, as the detail
    assert "expected 16 (block_size 16)\n" in md
    # pytest's re-statement of an assert that has its own text is left out
    assert "assert 0 == 1" not in md
    assert "(12 tests): no NVMe device" in md
    assert "## Passed (1)" in md and "- level1 (1): `test_vllm_imports`" in md
    assert page.index("What failed") < page.index("<h2>Tiers")
    assert page.count("matched 0 tokens") == 1
    assert "v38, v39]</code>" in page  # every test, in the details


def test_different_causes_stay_apart() -> None:
    tests = [_t("a::t1", "failed", "AssertionError: matched 3 tokens, expected 0"),
             _t("a::t2", "failed", "AssertionError: loaded KV differs at block 3"),
             _t("a::t3", "failed", "TypeError: 'NoneType' object is not iterable"),
             _t("a::t4", "failed", "")]
    keys = [g["key"] for g in causes(tests)]
    assert len(keys) == 4, keys
    assert "(no message)" in keys
    # a number glued to a word is part of the word; an 8+ digit hex id is masked
    assert normalise_cause("sha256 of req2 is deadbeef0123 at 0x7f00") == (
        "sha256 of req2 is <id> at <addr>")
    assert normalise_cause("\n\n  first line 12\nsecond 3") == "first line <n>"


def test_pytests_restatement_of_an_assert_with_a_message_is_left_out() -> None:
    """An assert's own text is the detail; pytest's cut ``assert not [...]``
    re-statement after it is noise. A bare assert keeps its ``where`` lines."""
    said = ("AssertionError: local + external: loaded KV differs\n"
            "  (and 1 more)\nassert not ['request req-2: layer ...short)']\n"
            " +  where ['request...'] = list(w.load_errors)")
    bare = "AssertionError: assert 3 == 0\n +  where 3 = len(x)"
    got = {g["tests"][0]: g["detail"] for g in causes(
        [_t("a::said", "failed", said), _t("a::bare", "failed", bare)])}
    assert got == {"a::said": "(and 1 more)", "a::bare": "+ where 3 = len(x)"}, got


def test_a_catalogued_defect_is_one_cause_whatever_its_messages() -> None:
    tests = [_t("suites/contract/test_scenarios.py::test_tenant_isolation[a]",
                "failed", "tenant isolation: 128 tokens matched across tenants"),
             _t("suites/contract/test_scenarios.py::test_tenant_isolation[b]",
                "failed", "tenant isolation: prompt 7 hit another tenant's KV")]
    prof = {"name": "t", "connector": "TuttiConnectorV1"}
    found = findings(tests, prof)
    groups = causes(tests, found)
    assert len(groups) == 1 and groups[0]["finding"] == "tutti-cache-salt", groups
    assert groups[0]["title"].startswith("chunk keys ignore cache_salt")
    # another connector's same symptom is not Tutti's defect: two causes by message
    other = causes(tests, findings(tests, {"connector": "MyConnector"}))
    assert len(other) == 2 and not any(g["finding"] for g in other), other


@pytest.mark.parametrize("limit", [10, 25, 40, 79])
def test_text_is_never_cut_mid_word(limit) -> None:
    text = ("the connector matched ninety-six tokens but the worker loaded only "
            "sixty-four of them; vLLM recomputed the rest")
    out = cut(text, limit)
    assert len(out) <= limit and out.endswith("…"), out
    head = out[:-1]
    assert text.startswith(head) and text[len(head)] in " ;,", (out, limit)
    assert cut(text, len(text)) == text
    assert cut("a\nb   c", 20) == "a b c"


def test_a_cut_message_keeps_its_fix() -> None:
    """The ``Fix:`` sentence at the end of a long red survives the cut."""
    why = "the store reports direct_io=True, but " + "pages sat in the cache " * 30
    fix = "Fix: open the pool with O_DIRECT, or report direct_io=False."
    out = cut(f"{why}. {fix}", 400)
    assert len(out) <= 400 and out.endswith("… " + fix), out
    assert out.startswith("the store reports direct_io=True, but pages"), out
    long_fix = "Fix: " + "do this " * 40  # more than half the limit: cut as text
    assert cut(f"{why}. {long_fix}", 400).endswith("…")


def test_a_long_message_is_cut_at_a_word_on_the_page(tmp_path) -> None:
    word = "supercalifragilistic"
    msg = " ".join([word] * 60)  # 1259 characters
    md, _ = _page(tmp_path, _summary([_t("a::t", "failed", msg)]))
    line = next(ln for ln in md.splitlines() if ln.startswith("- **failed**"))
    title = line.split(": ", 1)[1]
    assert title.endswith(f"{word}…") and len(title) <= 400, title[-60:]


def test_a_failed_coverage_gate_is_named_not_incomplete(tmp_path) -> None:
    cov = {"strict": True, "connector": "X", "counts": {"exercised": 3},
           "missing_overridden": ["api:KVConnectorBase_V1.handle_preemptions"],
           "new": [], "rows": []}
    s = _summary([_t("a::t", "passed")], coverage=cov)
    word, why = sp.verdict(s)
    assert word == "FAIL" and why.startswith("coverage gate (--tvc-require "
                                             "coverage) failed"), (word, why)
    assert "handle_preemptions" in why
    md, _ = _page(tmp_path, s)
    assert md.startswith("# Conformance run: FAIL") and "INCOMPLETE" not in md
    # the same run without strict coverage passes: the gate, not the counts, failed
    loose = _summary([_t("a::t", "passed")], {"outcome": "passed", "exit_status": 0},
                     coverage={**cov, "strict": False})
    assert sp.verdict(loose)[0] == "PASS" and outcome_reason(loose) == ""


def test_a_terminated_run_is_incomplete_and_says_which_signal() -> None:
    s = _summary([_t("a::t", "passed"), _t("a::u", "not_run")],
                 {"outcome": "terminated", "exit_status": 2, "signal": "SIGTERM"})
    assert outcome_reason(s) == "terminated by SIGTERM; 1 test(s) never ran"
    word, why = sp.verdict(s)
    assert word == "INCOMPLETE" and "terminated by SIGTERM" in why, why
    (never,) = causes(s["tests"], group="not_run")
    assert never["title"] == "the run stopped before these tests finished"


def _junit(tmp_path: Path, failures: int = 0) -> Path:
    path = tmp_path / "junit.xml"
    cases = "".join(f'<testcase classname="a" name="t{i}"/>' for i in range(2))
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="s" '
                    f'tests="2" failures="{failures}" errors="0" skipped="0">'
                    f'{cases}</testsuite></testsuites>')
    return path


@pytest.mark.parametrize(("run", "coverage", "text"), [
    ({"outcome": "terminated", "exit_status": 2, "signal": "SIGTERM"}, None,
     "run terminated: terminated by SIGTERM"),
    ({"outcome": "failed", "exit_status": 1},
     {"strict": True, "missing_overridden": ["api:X.y"]},
     "run failed: coverage gate (--tvc-require coverage) failed"),
    ({"outcome": "no_tests", "exit_status": 5}, None, "run no_tests: no test ran"),
], ids=["terminated", "coverage-gate", "no-tests"])
def test_junit_of_a_non_passing_run_carries_a_failure(tmp_path, run, coverage,
                                                       text) -> None:
    """A gate that reads only junit.xml sees a red run whose cases are all green."""
    path = _junit(tmp_path)
    s = _summary([_t("a::t0", "passed"), _t("a::t1", "passed")], run,
                 **({"coverage": coverage} if coverage else {}))
    stamp_junit(path, s)
    stamp_junit(path, s)  # twice: one case
    suite = ET.parse(path).getroot().find("testsuite")
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["tvc.run.outcome"] == run["outcome"], props
    cases = [c for c in suite.iter("testcase") if c.get("name") == OUTCOME_CASE]
    assert len(cases) == 1, ET.tostring(suite)
    assert cases[0].find("failure").get("message").startswith(text)
    assert (suite.get("tests"), suite.get("failures")) == ("3", "1")


def test_junit_of_a_run_red_by_its_tests_gets_no_extra_case(tmp_path) -> None:
    path = _junit(tmp_path, failures=1)
    stamp_junit(path, _summary([_t("a::t0", "passed"), _t("a::t1", "failed", "x")]))
    suite = ET.parse(path).getroot().find("testsuite")
    assert not [c for c in suite.iter("testcase") if c.get("name") == OUTCOME_CASE]
    assert (suite.get("tests"), suite.get("failures")) == ("2", "1")
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["tvc.run.outcome"] == "failed"
    # terminated with a failure: still incomplete, which the cases do not show
    stamp_junit(path, _summary([_t("a::t0", "not_run"), _t("a::t1", "failed", "x")],
                               {"outcome": "terminated", "exit_status": 2,
                                "signal": "SIGHUP"}))
    suite = ET.parse(path).getroot().find("testsuite")
    (case,) = [c for c in suite.iter("testcase") if c.get("name") == OUTCOME_CASE]
    assert "terminated by SIGHUP" in case.find("failure").get("message")


def test_junit_of_a_passing_run_stays_green(tmp_path) -> None:
    path = _junit(tmp_path)
    stamp_junit(path, _summary([_t("a::t0", "passed"), _t("a::t1", "passed")],
                               {"outcome": "passed", "exit_status": 0}))
    suite = ET.parse(path).getroot().find("testsuite")
    assert not [c for c in suite.iter("testcase") if c.get("name") == OUTCOME_CASE]
    assert suite.get("failures") == "0" and suite.get("tests") == "2"
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["tvc.run.outcome"] == "passed"


def test_page_shows_the_exploration_and_its_stand_in_worker(tmp_path) -> None:
    stats = {"examples": 30, "steps": 410, "requests": 120, "hits": 41, "loads": 39,
             "aborts": {"WAITING": 4, "RUNNING": 6}, "preemptions": 0,
             "restarts": 5, "faults": {}, "failed_loads_reported": 0,
             "known": {}, "seconds": 9.5, "seeds": [1975927298], "budget": 30}
    nid = "suites/contract/test_exploration.py::test_contract_holds_over_explored_" \
          "event_sequences"
    tests = [_t(f"{nid}[core]", "passed", exploration=stats,
                worker="stand-in: tvc.contract.worker:JobAckWorker (job protocol)"),
             _t(f"{nid}[tenants]", "passed", exploration={
                 **stats, "hits": 7, "seeds": [1975927298, 1975927299]})]
    md, page = _page(tmp_path, _summary(tests, {"outcome": "passed",
                                                "exit_status": 0}))
    section = md[md.index("## Exploration"):]
    rows = [ln for ln in section.splitlines() if ln.startswith("| core |")
            or ln.startswith("| tenants |")]
    assert rows[0].startswith("| core | passed | stand-in: tvc.contract.worker:"
                              "JobAckWorker (job protocol) | 30 | 1975927298 | 410 "
                              "| 120 | 41 | 39 | RUNNING 6, WAITING 4 |"), rows[0]
    # how many sequences ran, and with which seed(s): one per round
    assert rows[1].startswith("| tenants | passed | real | 30 | 1975927298, "
                              "1975927299 | 410 | 120 | 7 |"), rows[1]
    assert "1 test(s) ran with a worker stand-in" in md
    assert "<h2>Exploration" in page and "JobAckWorker" in page


def test_templates_escape_html_but_not_markdown(tmp_path) -> None:
    s = _summary([_t("a::t", "failed", "expected <block> & got 'x'")])
    md, page = _page(tmp_path, s)
    assert "expected <block> & got 'x'" in md
    assert "expected &lt;block&gt; &amp; got &#39;x&#39;" in page
    assert "<block>" not in page


def test_page_lists_the_ten_slowest_tests_slowest_first(tmp_path) -> None:
    tests = [{**_t(f"suites/contract/test_x.py::test_{i}", "passed"),
              "duration_s": float(i)} for i in range(13)]
    tests.append({**_t("suites/contract/test_x.py::test_skip", "skipped"),
                  "duration_s": 0.0})
    md, page = _page(tmp_path, _summary(tests, {"outcome": "passed",
                                                "exit_status": 0}))
    section = md[md.index("## Where the time went"):]
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and "`" in ln]
    assert len(rows) == 10
    assert rows[0] == "| 12.0 | passed | `suites/contract/test_x.py::test_12` |"
    assert rows[-1] == "| 3.0 | passed | `suites/contract/test_x.py::test_3` |"
    assert "test_skip" not in section and "The 10 slowest tests" in page


def test_a_pass_whose_store_faults_met_another_writer_says_so(tmp_path) -> None:
    """Store-fault tests skipped for another writer in the store folder: the
    PASS line counts them (no store fault was injected)."""
    from tvc.contract.faults import ForeignWriter

    skip = _t("c::test_store_fault_is_reported_never_silent[cpu-lose]", "skipped")
    skip["message"] = str(ForeignWriter(tmp_path / "x.bin", "changed"))
    s = _summary([_t("a::t", "passed"), skip],
                 {"outcome": "passed", "exit_status": 0})
    word, why = sp.verdict(s)
    assert word == "PASS", (word, why)
    assert why.endswith("1 store-fault test(s) skipped: another program wrote in the "
                        "store folder, so no store fault was injected"), why
    skip["message"] = "no CUDA GPU"
    assert "store-fault" not in sp.verdict(s)[1]
