"""Self-tests of the trace tier's honest gain: bootstrap interval, verdict, load rate.

Synthetic per-request figures with known TTFTs (no server), plus the campaign's
repeat against the fake trace servers.
"""

from __future__ import annotations

import numpy as np
import pytest

from selftests.trace.fake_server import FakeServer
from selftests.trace.test_replay_fake_server import campaign
from tvc.trace import replay as tr

pytestmark = pytest.mark.hw_any


def fig(ttfts, start_step: float = 1.0, failed=()) -> dict:
    rows = [{"record_index": i, "ok": i not in failed, "ttft_s": t,
             "start_s": i * start_step} for i, t in enumerate(ttfts)]
    return {"per_request": rows}


def noisy(center: float, n: int, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    return list(center * np.exp(rng.normal(0, 0.15, n)))


def test_clear_gain_clears_the_threshold_with_its_lower_bound():
    base, conn = fig(noisy(0.2, 40, 1)), fig(noisy(0.1, 40, 2))
    iv = tr.ttft_gain_interval([base], [conn], seed=3)
    assert iv["n"] == 40 and iv["repeats"] == 1
    assert 1.6 < iv["low"] < iv["p50"] < iv["high"] < 2.6, iv
    verdict, text = tr.gain_verdict(iv, 1.1)
    assert verdict == "pass" and "clears 1.1x" in text and "[" in text


def test_no_gain_straddles_and_is_undecided_not_passed():
    same = noisy(0.2, 40, 5)  # the connector: the same TTFTs, other requests
    shuffled = list(np.random.default_rng(6).permutation(same))
    iv = tr.ttft_gain_interval([fig(same)], [fig(shuffled)], seed=3)
    assert iv["p50"] == 1.0 and iv["low"] < 1.0 < iv["high"], iv
    verdict, text = tr.gain_verdict(iv, 1.0)
    assert verdict == "undecided" and "straddles 1x: the run cannot tell" in text


def test_slower_connector_fails_on_the_upper_bound():
    iv = tr.ttft_gain_interval([fig(noisy(0.1, 40, 7))], [fig(noisy(0.2, 40, 8))])
    verdict, text = tr.gain_verdict(iv, 1.1)
    assert iv["high"] < 1.0 and verdict == "fail" and "below 1.1x" in text


def test_a_small_sample_is_too_small_to_decide():
    iv = tr.ttft_gain_interval([fig([0.3, 0.3, 0.3, 0.3])], [fig([0.1] * 4)])
    verdict, text = tr.gain_verdict(iv, 1.1)
    assert verdict == "too_small" and "4 paired requests" in text, text
    assert tr.gain_verdict(tr.ttft_gain_interval([fig([])], [fig([])]), 1.1)[0] == \
        "too_small"


def test_pairs_are_by_record_and_repeat_and_the_seed_makes_it_reproducible():
    base = fig(noisy(0.2, 20, 9), failed={0, 1})
    conn = fig(noisy(0.1, 20, 10), failed={2})
    iv = tr.ttft_gain_interval([base, base], [conn, conn], seed=11)
    assert iv["n"] == 2 * 17 and iv["repeats"] == 2  # failed on either side: out
    again = tr.ttft_gain_interval([base, base], [conn, conn], seed=11)
    assert again == iv


def test_kv_load_rate_divides_loaded_bytes_by_the_load_window():
    f = fig([0.5, 0.5, 0.5], start_step=0.25)  # windows [0,.5] [.25,.75] [.5,1]
    f["token_sources"] = {"tokens": {tr.EXTERNAL_SOURCE_LABEL: 1000.0}}
    rate = tr.kv_load_rate(f, bytes_per_token=2048)
    assert rate["load_window_s"] == pytest.approx(1.0)  # union, not the sum 1.5
    assert rate["loaded_bytes"] == 2048 * 1000
    assert rate["gbps"] == pytest.approx(2048 * 1000 / 1.0 / 1e9, rel=1e-3)
    f["token_sources"]["tokens"][tr.EXTERNAL_SOURCE_LABEL] = 0.0
    assert tr.kv_load_rate(f, 2048)["gbps"] is None  # nothing loaded: no rate


def test_repeat_replays_again_and_refills_a_restarted_servers_store(tmp_path):
    conn = FakeServer(ttft_s=0.08, hit_ttft_s=0.01, connector=True)
    base = FakeServer(ttft_s=0.08)
    camp = campaign(tmp_path, {"connector": conn, "baseline": base})
    try:
        first = camp.run("connector", "interleave")
        sent = len(conn.bodies)
        camp.run("baseline", "interleave")  # not pooled: stops the connector
        assert not conn.is_alive()
        again = camp.repeat("connector", "interleave")
        assert conn.is_alive()
        populate = camp.results["connector", "populate"]["requests"]
        # a new server process: populate again, then the interleave replay
        assert len(conn.bodies) - sent == populate + again["requests"]
        assert again["requests"] == first["requests"]
        assert (tmp_path / "trace" / "connector-interleave-r2.json").is_file()
        assert camp.repeats["connector", "interleave"] == [again]
    finally:
        camp.close()


def test_summary_page_states_the_interval_and_the_load_rate():
    from tvc.plugin.summary_page import gain_lines

    iv = tr.ttft_gain_interval([fig(noisy(0.2, 40, 1))], [fig(noisy(0.1, 40, 2))])
    verdict, text = tr.gain_verdict(iv, 1.1)
    lines = gain_lines({"gain_interval": {"interleave": {**iv, "verdict": verdict,
                                                         "text": text}},
                        "kv_load_rate": {"interleave": {
                            "gbps": 1.234, "loaded_bytes": 2e6, "load_window_s": 1.5,
                            "host_to_device_ceiling": {"median_gbps": 52.3}}}})
    assert any("95% interval [" in line and "verdict: pass" in line for line in lines)
    assert any("effective KV load rate 1.234 GB/s" in line and "ceiling 52.3 GB/s"
               in line for line in lines), lines
