"""Self-tests of tvc/e2e/acceptance.py and the baseline comparison (e2e/two_pass.py).

Every check runs against fake vLLM servers (selftests/e2e/fake_vllm_server.py): a
baseline server (no ``--kv-transfer-config``, no store) and connector servers that
are good or known-bad (loads corrupted KV, computes differently, serves one
request's output to another under concurrency, stores nothing, mishandles a failed
load). Each known-bad target must fail its check for the right reason.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tvc.e2e import acceptance as acc
from tvc.e2e import two_pass as tp
from tvc.procs.client import Completion
from tvc.procs.vllm_server import VllmServer

pytestmark = pytest.mark.hw_any

FAKE = Path(__file__).resolve().parent / "fake_vllm_server.py"
KV = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
B = 16


def fake_rule(n: int) -> int:
    """The fake connector's hit rule ((len - 2) // 16 * 16, ExampleConnector's)."""
    return (n - 2) // B * B


def server(tmp_path: Path, name: str, connector: bool = True, **env: str
           ) -> VllmServer:
    return VllmServer(tmp_path / "model", launcher=[sys.executable, str(FAKE)],
                      kv_transfer_config=KV if connector else None,
                      log_path=tmp_path / f"{name}.log", startup_timeout_s=30,
                      stop_timeout_s=5, env=env)


def book(concurrency: int = 16) -> acc.PromptBook:
    return acc.PromptBook(seed=7, token_range=(3, 512), block_size=B,
                          concurrency=concurrency, rule=fake_rule)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> acc.Baseline:
    """The fake baseline server's outputs for every prompt of the book."""
    tmp = tmp_path_factory.mktemp("baseline")
    b = book()
    with server(tmp, "baseline", connector=False) as srv:
        outs = acc.collect_baseline(srv.client(), b.prompts())
    return acc.Baseline(b, outs)


# ------------------------------------------------------------ baseline comparison

def comp(tokens: list[int]) -> Completion:
    tops = [{t: -0.5, t + 1: -1.5} for t in tokens]
    return Completion(list(tokens), "", [-0.5] * len(tokens), tops)


def test_output_diff_speaks_vllms_vocabulary_and_names_both_sides():
    msg = tp.output_diff(comp([3, 4, 5, 6]), comp([3, 4, 9, 9]), "baseline (no "
                         "connector)", "connector pass 2")
    assert ("output token ids differ between baseline (no connector) and "
            "connector pass 2 at position 2: 2 identical output token(s) before it "
            "([3, 4])") in msg
    first = tp.output_diff(comp([3, 4]), comp([5, 4]), "a", "b")
    assert "at position 0: no identical output token before it" in first, first
    assert "Matched tokens" not in msg + first  # not the connector's matched tokens
    assert "baseline (no connector): [5, 6], connector pass 2: [9, 9]" in msg
    assert "1.0000 nats, not a tie" in msg
    assert tp.output_diff(comp([3, 4]), comp([3, 4]), "a", "b") == ""


def test_verdict_blames_the_load_when_only_pass_2_differs():
    msg = tp.baseline_verdict(comp([3, 4]), comp([3, 4]), comp([3, 7]))
    assert msg.startswith("connector pass 2 differs from the baseline (no "
                          "connector); connector pass 1 agrees with the baseline — "
                          "the KV the connector loaded is wrong")


def test_verdict_blames_the_connector_server_when_only_pass_1_differs():
    msg = tp.baseline_verdict(comp([3, 4]), comp([8, 4]), comp([3, 4]))
    assert msg.startswith("connector pass 1 differs from the baseline (no "
                          "connector) while connector pass 2 agrees")


def test_verdict_when_both_passes_differ_from_the_baseline_and_each_other():
    msg = tp.baseline_verdict(comp([3, 4]), comp([8, 4]), comp([9, 4]))
    assert "differ from the baseline (no connector) and from each other" in msg


def test_corrupting_connector_is_caught_against_the_baseline(tmp_path, baseline):
    prompt = baseline.book.get("acceptance")
    with server(tmp_path, "corrupt", FAKE_VLLM_CONNECTOR="corrupt") as srv:
        r = tp.run_two_passes(srv, prompt)
    with pytest.raises(AssertionError, match=r"^connector pass 2 differs from the "
                       r"baseline \(no connector\); connector pass 1 agrees with "
                       r"the baseline — the KV the connector loaded is wrong \(the "
                       r"connector, not vLLM\): output token ids differ"):
        tp.check_against_baseline(r, baseline.get("acceptance"))


def test_connector_server_that_computes_differently_is_told_apart(tmp_path,
                                                                  baseline):
    prompt = baseline.book.get("acceptance")
    with server(tmp_path, "skew", FAKE_VLLM_CONNECTOR="skew") as srv:
        r = tp.run_two_passes(srv, prompt)
    tp.check_same_output_tokens(r)  # the two passes agree with each other...
    with pytest.raises(AssertionError, match="connector pass 1 and connector pass "
                       "2 agree with each other but both differ from the baseline "
                       r"\(no connector\) — vLLM with a kv_transfer_config computes "
                       "differently"):
        tp.check_against_baseline(r, baseline.get("acceptance"))  # ...not with it


def test_good_connector_passes_acceptance_with_the_baseline(tmp_path, baseline):
    prompt = baseline.book.get("acceptance")
    with server(tmp_path, "good") as srv:
        r = tp.run_two_passes(srv, prompt, hit_log_pattern="External Cache Hit!")
        tp.check_acceptance(r, fake_rule(len(prompt)), "External Cache Hit!",
                            srv.log_path, baseline=baseline.get("acceptance"))


# ---------------------------------------------------------------- the prompt book

def test_prompts_follow_the_seed_and_the_concurrency_plan_is_exact():
    a, b = book().prompts(), book().prompts()
    assert a == b and a != acc.PromptBook(8, (3, 512), B, rule=fake_rule).prompts()
    assert [len(a[f"boundary-{t}"]) for t in ("kB-1", "kB", "kB+1")] == [63, 64, 65]
    p = book().concurrency_plan()
    assert p.length == 600 and p.twins and fake_rule(600) == 599 // B * B
    assert len(p.requests) == 16 and len(p.distinct) == 12
    assert p.expected_cached == 16 * 592 and p.shared_prefix == 288
    # 12 distinct prompts with siblings: each needs 592 - 288 from the store; the
    # 4 second twins may be served wholly by the GPU cache
    assert p.min_external == 12 * (592 - 288)
    groups = {tuple(a[n][:288]) for n in p.distinct}
    assert len(groups) == 4 and len({tuple(a[n]) for n in p.distinct}) == 12


def test_no_twins_where_a_gpu_cache_hit_could_exceed_the_rule():
    # a chunked connector (256-token units) has rule(L) == (L-1)//B*B only at
    # L = 256k + 1..16; from 600 the search finds 769 (768 = 3 x 256)
    b = acc.PromptBook(1, (3, 512), B, rule=lambda n: n // 256 * 256,
                       granularity=256)
    p = b.concurrency_plan()
    assert p.length == 769 and p.twins and p.shared_prefix == 256
    never = acc.PromptBook(1, (3, 512), B, rule=lambda n: max(0, n - 40) // B * B)
    q = never.concurrency_plan()
    assert not q.twins and len(set(q.requests)) == len(q.requests) == 16
    assert "no identical requests" in q.notes[0]


def test_run_seed_prefers_a_chosen_seed_then_the_profile_then_the_run(monkeypatch):
    def use(seed, source, profile_seed=0, env=None):
        profile = SimpleNamespace(data={"e2e": {"seed": profile_seed}})
        monkeypatch.setattr(tp, "_SEED", [])
        if env is None:
            monkeypatch.delenv("TVC_SEED", raising=False)
        else:
            monkeypatch.setenv("TVC_SEED", env)
        return tp.run_seed(seed, source, profile)

    assert use(7, "--tvc-seed", profile_seed=5) == (7, "--tvc-seed")
    assert use(7, "TVC_SEED", profile_seed=5, env="7") == (7, "TVC_SEED")
    assert use(7, "controller", profile_seed=5, env="7") == (7, "controller")
    assert use(7, "random", profile_seed=5) == (5, "[e2e] seed")
    assert use(7, "random") == (7, "run seed (random)")
    assert tp._SEED == []  # a suite run's seed lives in its run state, not here
    # outside a suite run (no run seed): TVC_SEED, else random, fixed per process
    monkeypatch.setattr(tp, "_SEED", [])
    monkeypatch.setenv("TVC_SEED", "1234")
    assert tp.run_seed() == (1234, "TVC_SEED")
    monkeypatch.setenv("TVC_SEED", "99")
    assert tp.run_seed() == (1234, "TVC_SEED")  # fixed for the process
    monkeypatch.setattr(tp, "_SEED", [])
    monkeypatch.setenv("TVC_SEED", "abc")
    with pytest.raises(ValueError, match="TVC_SEED='abc': expected an integer"):
        tp.run_seed()
    monkeypatch.setattr(tp, "_SEED", [])
    monkeypatch.delenv("TVC_SEED")
    drawn = tp.run_seed()
    assert drawn[1] == "random (this run)" and tp.run_seed() == drawn


# -------------------------------------------------------------------- concurrency

def test_good_connector_passes_the_concurrency_checks(tmp_path, baseline):
    with server(tmp_path, "good") as srv:
        w = acc.run_wave(srv, baseline.book)
    acc.check_wave_outputs(w, baseline)
    acc.check_wave_hits(w)
    d = w.deltas
    assert d["local_source"] + d["external_source"] == 16 * 592
    assert d["external_hits"] == d["external_source"] >= w.plan.min_external


def test_connector_serving_another_requests_kv_under_concurrency_is_caught(
        tmp_path, baseline):
    with server(tmp_path, "cross", FAKE_VLLM_CONNECTOR="cross") as srv:
        r = tp.run_two_passes(srv, baseline.book.get("acceptance"))
        tp.check_against_baseline(r, baseline.get("acceptance"))  # alone: fine
        w = acc.run_wave(srv, baseline.book)
    with pytest.raises(AssertionError, match=r"concurrency: connector, concurrent "
                       r"request #\d+ \(concurrency-\d+.*\) differs from the baseline "
                       r"\(no connector\) — its output is the output of "
                       r"concurrency-\d+: the connector served another request's KV"):
        acc.check_wave_outputs(w, baseline)


def test_connector_that_stores_nothing_fails_the_hit_sum(tmp_path, baseline):
    with server(tmp_path, "forgetful", FAKE_VLLM_CONNECTOR="forgetful") as srv:
        w = acc.run_wave(srv, baseline.book)
    acc.check_wave_outputs(w, baseline)  # outputs are right, only the hits are not
    with pytest.raises(AssertionError, match=r"prompt tokens not computed .* = "
                       r"2368, expected 16 requests x hit rule 592 = 9472 .* fewer "
                       r"tokens from the store"):
        acc.check_wave_hits(w)


# ------------------------------------------------------------------ load failures

def load_failure(tmp_path: Path, baseline: acc.Baseline, mode: str, policy: str
                 ) -> acc.LoadFailureRun:
    """Run the load-failure exchange against the fake server in ``mode`` and check
    it; returns the run for the positive controls to inspect."""
    cid = acc.case_id(policy, True)
    with server(tmp_path, mode, FAKE_VLLM_LOAD_FAILURE=mode) as srv:
        run = acc.run_load_failure(srv, baseline.book.get(f"load-failure-{cid}"),
                                   baseline.book.get(f"load-failure-{cid}-after"),
                                   policy, True)
    acc.check_load_failure(run, baseline.get(f"load-failure-{cid}"),
                           baseline.get(f"load-failure-{cid}-after"))
    return run


def test_recompute_policy_handled_right_passes(tmp_path, baseline):
    run = load_failure(tmp_path, baseline, "recompute", "recompute")
    cid = acc.case_id("recompute", True)
    # the scenario happened: the failed load was recomputed into the baseline's output
    assert run.pass2.error == "" and run.healthy_after
    assert run.pass2.token_ids == baseline.get(f"load-failure-{cid}").token_ids
    assert run.after.token_ids == baseline.get(f"load-failure-{cid}-after").token_ids
    assert "Recovered from KV load failure" in run.log


def test_fail_policy_handled_right_passes(tmp_path, baseline):
    run = load_failure(tmp_path, baseline, "fail", "fail")
    cid = acc.case_id("fail", True)
    # the scenario happened: pass 2 ended in an error, the server lived on
    assert run.pass2.error and not run.pass2.token_ids, run.pass2
    assert run.healthy_after
    assert run.after.token_ids == baseline.get(f"load-failure-{cid}-after").token_ids


BAD_LOAD_FAILURES = {  # fake server mode -> (policy, the check's message)
    "recompute-garbage": ("recompute", r"kv_load_failure_policy=recompute, async "
                          r"scheduling on: output token ids differ between baseline "
                          r"\(no connector\) and pass 2 \(load failed, recomputed\)"),
    "recompute-silent": ("recompute", "never logged 'Recovered from KV load failure' "
                         "in pass 2 — no load failure reached the scheduler"),
    "fail-garbage": ("fail", r"kv_load_failure_policy=fail, async scheduling on: "
                     r"pass 2's KV load failed but the request completed with 16 "
                     r"tokens .* instead of an error"),
    "fail-empty": ("fail", r"kv_load_failure_policy=fail, async scheduling on: pass "
                   r"2 ended with an empty stream and no error .* cannot tell the "
                   r"request failed; vLLM did log"),
    "fail-dies": ("fail", r"(/health did not answer 200 after the failed load|the "
                  r"request after the failed load did not complete)"),
}


@pytest.mark.parametrize("mode", sorted(BAD_LOAD_FAILURES))
def test_wrong_load_failure_handling_is_caught(tmp_path, baseline, mode):
    policy, message = BAD_LOAD_FAILURES[mode]
    with pytest.raises(AssertionError, match=message):
        load_failure(tmp_path, baseline, mode, policy)


def test_streamed_error_event_reaches_the_caller_as_data(tmp_path):
    p = book().get("acceptance")
    with server(tmp_path, "fail", FAKE_VLLM_LOAD_FAILURE="fail") as srv:
        c = srv.client()
        assert c.stream(p).ok
        c.reset_prefix_cache()
        bad = c.stream(p)
        assert not bad.ok and bad.error.startswith("stream error:")
        assert '"code": 500' in bad.error and bad.status_code == 200
        from tvc.procs.client import ServerError

        with pytest.raises(ServerError, match="stream error"):
            c.reset_prefix_cache()
            c.complete_streaming(p)


def test_every_request_that_differs_is_named_with_what_they_share(baseline):
    """A connector whose load ignores vLLM's local prefix hit gets every request
    admitted after the first of its prefix group wrong (Tutti 33a8fb8 on the
    H200: 8 to 11 of 16, in an order that changes with arrival); the red names
    them all and the pattern, whichever of a group came first."""
    b = baseline.book
    plan = b.concurrency_plan()
    prompts = {n: b.get(n) for n in plan.distinct}
    # as in an H200 run: the groups' first admitted members were not the first sent
    first_admitted = {"concurrency-0", "concurrency-5", "concurrency-6",
                      "concurrency-11"}
    outs = []
    for name in plan.requests:
        good = baseline.get(name)
        outs.append((name, good if name in first_admitted
                     else comp([t + 1 for t in good.token_ids])))
    w = acc.WaveResult(plan, outs, {n: baseline.get(n) for n in plan.distinct},
                       {}, prompts)
    wrong = [f"#{i} ({n})" for i, (n, c) in enumerate(outs)
             if c.token_ids != baseline.get(n).token_ids]
    assert 0 < len(wrong) < len(outs), wrong
    with pytest.raises(AssertionError) as err:
        acc.check_wave_outputs(w, baseline)
    msg = str(err.value)
    assert msg.startswith(f"concurrency: connector, concurrent request {wrong[0]}")
    assert f"In all, {len(wrong)} of {len(outs)} requests differ: " in msg, msg
    assert all(x in msg for x in wrong[:8]), msg
    assert (f"shares its first {plan.shared_prefix}+ tokens with another request "
            "of the wave") in msg, msg
    assert "not the order they were sent" in msg, msg
    assert "where the connector's load starts" in msg, msg
    # every request wrong: no partial pattern to point at
    allwrong = acc.WaveResult(plan, [(n, comp([t + 1 for t in baseline.get(
        n).token_ids])) for n in plan.requests], w.store_outputs, {}, prompts)
    with pytest.raises(AssertionError) as err:
        acc.check_wave_outputs(allwrong, baseline)
    assert "In all, 16 of 16" in str(err.value)
    assert "where the connector's load starts" not in str(err.value)
