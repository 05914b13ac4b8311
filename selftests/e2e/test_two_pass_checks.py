"""Self-tests of tvc/e2e/two_pass.py: the acceptance checks pass on a good target and
fail, for the right reason, on known-bad ones (a fake server emulating a connector,
and hand-made results)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from tvc.e2e import two_pass as tp
from tvc.procs.client import Completion, MetricsSnapshot
from tvc.procs.vllm_server import VllmServer

pytestmark = pytest.mark.hw_any

FAKE = Path(__file__).resolve().parent / "fake_vllm_server.py"
EXAMPLE_RULE = 592  # (600 - 2) // 16 * 16, the fake's hit rule at B = 16
PATTERN = "External Cache Hit!"


KV = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}


def fake(tmp_path: Path, connector: str, **env: str) -> VllmServer:
    return VllmServer(tmp_path / "model", launcher=[sys.executable, str(FAKE)],
                      kv_transfer_config=KV, log_path=tmp_path / "server.log",
                      startup_timeout_s=30, stop_timeout_s=5,
                      env={"FAKE_VLLM_CONNECTOR": connector, **env})


def prompt(n: int = tp.ACCEPTANCE_PROMPT_TOKENS) -> list[int]:
    return tp.make_prompt(random.Random(n), n, 3, 512)


def test_good_connector_passes_every_check(tmp_path):
    with fake(tmp_path, "good") as srv:
        r = tp.run_two_passes(srv, prompt(), hit_log_pattern=PATTERN)
        tp.check_acceptance(r, EXAMPLE_RULE, PATTERN, srv.log_path)
    props = r.properties()
    assert props["external_hits_pass2"] == EXAMPLE_RULE
    assert props["external_hits_pass1"] == 0 and props["prefix_cache_hits_pass2"] == 0
    assert props["ttft_pass1_s"] > 0 and props["ttft_pass2_s"] > 0


def test_corrupting_connector_fails_on_output_equality(tmp_path):
    with fake(tmp_path, "corrupt") as srv:
        r = tp.run_two_passes(srv, prompt(), hit_log_pattern=PATTERN)
    with pytest.raises(AssertionError,
                       match="output token ids differ between pass 1 and pass 2 at "
                             "position 0"):
        tp.check_acceptance(r, EXAMPLE_RULE, PATTERN, srv.log_path)


def test_forgetful_connector_fails_on_the_hit_count(tmp_path):
    with fake(tmp_path, "forgetful") as srv:
        r = tp.run_two_passes(srv, prompt())
    with pytest.raises(AssertionError, match=r"expected 592 tokens \(600-token "
                       r"prompt, block 16\), saw 0 .* stored nothing"):
        tp.check_acceptance(r, EXAMPLE_RULE, "", srv.log_path)


def test_missing_reset_shows_as_gpu_prefix_cache_hits(tmp_path):
    with fake(tmp_path, "good") as srv:
        p = prompt()
        p1 = tp.run_pass(srv, p)
        p2 = tp.run_pass(srv, p)  # no reset in between
    r = tp.TwoPassResult(p, 16, p1, p2)
    with pytest.raises(AssertionError, match="GPU prefix-cache hits in pass 2: "
                       "expected 0 after POST /reset_prefix_cache, saw 592"):
        tp.check_no_prefix_cache_hits(r)


def test_wrong_hit_rule_and_missing_log_line_are_named(tmp_path):
    with fake(tmp_path, "good") as srv:
        r = tp.run_two_passes(srv, prompt(63))
    assert r.pass2.deltas["external_hits"] == 48  # (63 - 2) // 16 * 16
    with pytest.raises(AssertionError, match="saw 48 .* hit rule"):
        tp.check_external_hits(r, 32)
    with pytest.raises(AssertionError, match="expected a line matching 'Tutti hit'"):
        tp.check_hit_logged(r, "Tutti hit", srv.log_path)


def result(lp1: dict[int, float], lp2: dict[int, float]) -> tp.TwoPassResult:
    def comp(lp: dict[int, float]) -> Completion:
        top = max(lp, key=lp.__getitem__)
        return Completion([top], "", [lp[top]], [lp])

    def pr(c: Completion) -> tp.PassResult:
        return tp.PassResult(c, {k: 0.0 for k in tp.COUNTERS}, "", MetricsSnapshot(()))

    return tp.TwoPassResult([1] * 64, 16, pr(comp(lp1)), pr(comp(lp2)))


def test_logprob_drift_beyond_tolerance_fails():
    r = result({7: -0.10, 8: -2.0}, {7: -0.35, 8: -2.0})
    tp.check_same_output_tokens(r)
    with pytest.raises(AssertionError, match=r"logprob of token 7 at position 0: "
                       r"pass 1 -0.1000, pass 2 -0.3500, \|diff\| 0.2500 > "
                       r"tolerance 0.1"):
        tp.check_logprobs_agree(r)


def test_logprob_drift_within_tolerance_passes():
    tp.check_logprobs_agree(result({7: -0.10, 8: -2.0}, {7: -0.12, 8: -1.97}))


def test_disjoint_top_k_fails():
    with pytest.raises(AssertionError, match="do not share their top tokens"):
        tp.check_logprobs_agree(result({7: -0.1, 8: -2.0}, {9: -0.1, 10: -2.0}))


def sequences(tokens1, tokens2, lps1, lps2) -> tp.TwoPassResult:
    """A two-pass result from explicit token ids and per-position top-k logprobs."""
    def pr(tokens, lps) -> tp.PassResult:
        chosen = [lp[t] for t, lp in zip(tokens, lps, strict=True)]
        c = Completion(list(tokens), "", chosen, list(lps))
        return tp.PassResult(c, {k: 0.0 for k in tp.COUNTERS}, "", MetricsSnapshot(()))

    return tp.TwoPassResult([1] * 64, 16, pr(tokens1, lps1), pr(tokens2, lps2))


def test_divergence_at_an_exact_tie_is_a_tie_break_not_a_failure():
    # position 1: tokens 5 and 6 tie in pass 1 (as seen on the GPU host: gap 0.0000)
    lp1 = [{3: -0.1, 4: -3.0}, {5: -0.69, 6: -0.69}, {9: -0.2, 8: -2.0}]
    lp2 = [{3: -0.1, 4: -3.0}, {6: -0.69, 5: -0.69}, {1: -0.1, 2: -4.0}]
    r = sequences([3, 5, 9], [3, 6, 1], lp1, lp2)
    assert tp.comparable_positions(r) == 2
    tp.check_same_output_tokens(r)
    tp.check_logprobs_agree(r)  # position 2 follows different histories: skipped


def test_divergence_without_a_tie_still_fails():
    lp1 = [{3: -0.1, 4: -3.0}, {5: -0.1, 6: -2.5}]
    lp2 = [{3: -0.1, 4: -3.0}, {6: -0.1, 5: -2.5}]
    r = sequences([3, 5], [3, 6], lp1, lp2)
    with pytest.raises(AssertionError, match=r"differ .* at position 1: .* gap there: "
                       r"2.4000 nats, not a tie"):
        tp.check_same_output_tokens(r)


def test_logprobs_before_a_tie_break_are_still_compared():
    lp1 = [{3: -0.1, 4: -3.0}, {5: -0.69, 6: -0.69}]
    lp2 = [{3: -0.6, 4: -1.0}, {6: -0.69, 5: -0.69}]
    r = sequences([3, 5], [3, 6], lp1, lp2)
    with pytest.raises(AssertionError, match="logprob of token 3 at position 0"):
        tp.check_logprobs_agree(r)


def test_hit_log_is_not_required_when_the_rule_expects_no_hit(tmp_path):
    with fake(tmp_path, "good") as srv:
        r = tp.run_two_passes(srv, prompt(63))
    tp.check_hit_logged(r, "Tutti hit", srv.log_path, expected=0)
    with pytest.raises(AssertionError, match="expected a line matching"):
        tp.check_hit_logged(r, "Tutti hit", srv.log_path, expected=48)


# ------------------------------------------- the red names what the connector served
LMCACHE_LINE = ("[2026-12-01 10:00:01,123] LMCache INFO: Reqid: cmpl-1, Total tokens "
                "769, Inference Engine computed tokens: 0, LMCache hit tokens: 768, "
                "need to load: 768 (vllm_v1_adapter.py:1474:lmcache.integration)")
LMCACHE_PATTERN = r"LMCache hit tokens: (?P<tokens>\d+)"


def served(deltas: dict[str, float], log: str = "", pattern: str = ""
           ) -> tp.TwoPassResult:
    """Pass 2 differing from pass 1 at token 0, with these counters and log."""
    lp1, lp2 = [{3: -0.1, 4: -3.0}], [{4: -0.1, 3: -3.0}]
    r = sequences([3], [4], lp1, lp2)
    r.prompt = [1] * 769
    r.pass2.deltas.update(deltas)
    r.pass2.log = log
    r.hit_log_pattern = pattern
    return r


@pytest.mark.parametrize(("deltas", "log", "pattern", "says"), [
    ({"external_source_tokens": 768.0, "external_hits": 768.0}, "", "",
     'served 768 of 769 prompt tokens by the connector (vllm:prompt_tokens_by_'
     'source_total{source="external_kv_transfer"})'),
    ({"external_hits": 768.0}, "", "",
     "served 768 of 769 prompt tokens by the connector "
     "(vllm:external_prefix_cache_hits_total)"),
    # no counter moved (an older vLLM, a connector that reports no stats): its log
    ({}, LMCACHE_LINE, LMCACHE_PATTERN,
     "served 768 of 769 prompt tokens by the connector (the connector's log"),
    ({}, "", LMCACHE_PATTERN, "was served no prompt token by the connector"),
], ids=["by-source", "external-hits", "connector-log", "none"])
def test_a_red_at_token_0_names_the_tokens_served(deltas, log, pattern, says):
    r = served(deltas, log, pattern)
    for check in (tp.check_same_output_tokens, tp.check_logprobs_agree):
        with pytest.raises(AssertionError) as e:
            check(r)
        msg = str(e.value)
        assert says in msg, msg
        assert "Matched tokens" not in msg, msg
    assert "at position 0: no identical output token before it" in str(
        pytest.raises(AssertionError, tp.check_same_output_tokens, r).value)


def test_the_hit_count_is_read_from_the_connectors_own_log():
    assert tp.logged_hit_tokens(LMCACHE_PATTERN, "x\n" + LMCACHE_LINE) == 768
    assert tp.logged_hit_tokens("LMCache hit tokens: (\\d+)", LMCACHE_LINE) == 768
    assert tp.logged_hit_tokens("External Cache Hit!", LMCACHE_LINE + "\n"
                                "External Cache Hit!") is None  # no number
    assert tp.logged_hit_tokens("", LMCACHE_LINE) is None


def test_a_log_line_is_awaited_until_it_comes_or_the_log_settles() -> None:
    """A line written late is waited for; a settled log ends the wait early."""
    import threading
    import time

    from tvc.e2e.two_pass import await_log_line

    log = ["engine: step\n"]
    read = lambda: "".join(log)  # noqa: E731
    hit = lambda text: "External Cache Hit!" in text  # noqa: E731

    # the line comes 0.6 s later, while the log still grows: it is waited for
    def write_late() -> None:
        for _ in range(3):
            time.sleep(0.2)
            log.append("engine: step\n")
        log.append("External Cache Hit!\n")

    writer = threading.Thread(target=write_late)
    t0 = time.monotonic()
    writer.start()
    text = await_log_line(read, hit, 5.0, "hit", quiet_s=0.5)
    writer.join()
    assert "External Cache Hit!" in text and time.monotonic() - t0 < 2.0, text

    # no line, a settled log: the wait ends after quiet_s, not max_s
    log[:] = ["engine: step\n"]
    t0 = time.monotonic()
    text = await_log_line(read, hit, 5.0, "hit", quiet_s=0.5)
    waited = time.monotonic() - t0
    assert text == "engine: step\n" and 0.5 <= waited < 1.5, waited

    # a log that keeps growing without the line: the whole max_s
    stop = threading.Event()

    def keep_writing() -> None:
        while not stop.is_set():
            log.append("engine: step\n")
            time.sleep(0.1)

    writer = threading.Thread(target=keep_writing)
    writer.start()
    t0 = time.monotonic()
    await_log_line(read, hit, 1.5, "hit", quiet_s=0.5)
    waited = time.monotonic() - t0
    stop.set()
    writer.join()
    assert waited >= 1.4, waited
