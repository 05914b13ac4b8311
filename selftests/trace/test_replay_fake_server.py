"""Replay against a fake streaming server: timing is measured right, checks bite."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import requests

from selftests.trace.fake_server import FakeServer
from tvc.config.profile import load
from tvc.trace import replay as tr
from tvc.trace.bench import TraceCampaign, resolve_settings

# Timing is asserted as order and bounds, never to a tolerance of milliseconds: a
# sleep lasts at least its time (the lower bounds, less CLOCK_SLACK_S for the
# clock's resolution) and on a loaded 2-core box may last far longer (the upper
# bounds, LATE_S late at most).
CLOCK_SLACK_S = 0.005
LATE_S = 10.0



def _message(check, *args) -> str:
    """The message ``check(*args)`` fails with (it must fail)."""
    with pytest.raises(AssertionError) as exc:
        check(*args)
    return str(exc.value)


def one(url: str, n: int = 5) -> tr.RequestResult:
    with requests.Session() as s:
        return tr.stream_completion(s, url, "fake-model", [5, 6, 7], n, 30.0)


def test_ttft_tpot_and_latency_match_the_servers_delays() -> None:
    with FakeServer(ttft_s=0.30, itl_s=0.05) as srv:
        r = one(srv.url, n=5)
    assert r.ok, r.error
    # the server waits 0.30 s before the first token and 0.05 s before each of the
    # 4 others: TTFT and latency are at least that, TPOT is their difference / 4
    assert 0.30 - CLOCK_SLACK_S <= r.ttft_s < 0.30 + LATE_S, r.ttft_s
    assert r.ttft_s + 4 * 0.05 - CLOCK_SLACK_S <= r.e2e_s < 0.50 + LATE_S, (
        r.ttft_s, r.e2e_s)
    assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 4, rel=1e-9)
    assert 0.05 - CLOCK_SLACK_S <= r.tpot_s < 0.05 + LATE_S, r.tpot_s
    assert r.output_tokens == 5 and r.prompt_tokens == 3
    assert srv.bodies[0]["prompt"] == [5, 6, 7] and srv.bodies[0]["ignore_eos"]


def test_one_token_has_no_tpot() -> None:
    with FakeServer(ttft_s=0.05) as srv:
        r = one(srv.url, n=1)
    assert r.ok and r.tpot_s is None and r.output_tokens == 1


def test_http_errors_and_truncated_streams_are_failures() -> None:
    with FakeServer(fail_status=500) as srv:
        r = one(srv.url)
    assert not r.ok and r.error.startswith("HTTP 500")
    with FakeServer(drop_done=True) as srv:
        r = one(srv.url)
    assert not r.ok and "without data: [DONE]" in r.error
    with requests.Session() as s:
        r = tr.stream_completion(s, "http://127.0.0.1:9", "m", [1], 1, 2.0)
    assert not r.ok and "ConnectionError" in r.error


def test_replay_bounds_concurrency_and_reads_metric_deltas() -> None:
    syn = tr.PromptSynth(8, 3, 500)
    recs = [tr.TraceRecord(i, 0, 1024, 3, (i % 2, 10 + i)) for i in range(8)]
    planned = tr.plan(recs, "interleave", syn)
    with FakeServer(ttft_s=0.05, itl_s=0.01) as srv:
        res = tr.replay(srv.url, "fake-model", planned, mode="interleave",
                        variant="baseline", concurrency=3)
    f = res.figures()
    assert 2 <= srv.max_in_flight <= 3, (
        f"replay with concurrency=3 had {srv.max_in_flight} requests in flight at "
        "once on the server (expected 2 or 3): the bound is not enforced")
    assert f["succeeded"] == 8 and f["failed"] == 0
    assert f["prefix_cache"]["local_query_tokens"] == 8 * 16
    assert f["prefix_cache"]["external_hit_tokens"] is None  # no connector metric
    tr.check_percentiles_ordered(f)
    assert f["throughput"]["output_tokens_per_s"] > 0
    json.dumps(f)  # JSON-ready


def test_stream_mode_sends_at_scaled_trace_times() -> None:
    syn = tr.PromptSynth(8, 3, 500)
    recs = [tr.TraceRecord(i, i * 1000.0, 8, 1, (i,)) for i in range(4)]
    planned = tr.plan(recs, "stream", syn, time_scale=0.2)
    with FakeServer(ttft_s=0.01) as srv:
        res = tr.replay(srv.url, "fake-model", planned, mode="stream",
                        variant="baseline", concurrency=4)
    by_record = sorted(res.results, key=lambda r: r.record_index)
    planned_s = [0.0, 0.2, 0.4, 0.6]  # trace times 0, 1, 2, 3 s x time_scale 0.2
    # sent in trace order, never before its scaled trace time, never hugely late
    starts = [r.start_s for r in by_record]
    assert starts == sorted(starts), starts
    for got, want in zip(starts, planned_s, strict=True):
        assert want - CLOCK_SLACK_S <= got < want + LATE_S, (starts, planned_s)


def campaign(tmp_path: Path, servers: dict[str, FakeServer]) -> TraceCampaign:
    prof = load("example", env={})
    settings = resolve_settings(prof, {"max_requests": 12, "time_scale": 0.1,
                                       "concurrency": 4})
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 512}))
    return TraceCampaign(prof, settings, model, tmp_path / "trace",
                         server_factory=lambda variant: servers[variant])


def run_all(camp: TraceCampaign) -> dict[tuple[str, str], dict[str, Any]]:
    try:
        return {(v, m): camp.run(v, m) for v in ("connector", "baseline")
                for m in tr.MODES}
    finally:
        camp.close()


def test_campaign_with_a_working_connector_shows_hits_and_gain(tmp_path: Path
                                                               ) -> None:
    servers = {"connector": FakeServer(ttft_s=0.08, hit_ttft_s=0.01, connector=True),
               "baseline": FakeServer(ttft_s=0.08)}
    runs = run_all(campaign(tmp_path, servers))
    for f in runs.values():
        tr.check_all_succeeded(f)
        tr.check_percentiles_ordered(f)
        if f["mode"] != "populate":
            assert "local prefix cache reset before the run" in f["notes"]
    tr.check_external_hits_rose(runs["connector", "interleave"])
    tr.check_no_external_hits(runs["baseline", "interleave"])
    gain = tr.ttft_gain(runs["baseline", "interleave"], runs["connector", "interleave"])
    assert gain["p50"] > 2.0
    written = sorted(p.name for p in (tmp_path / "trace").iterdir())
    assert written == sorted(f"{v}-{m}.json" for v in ("connector", "baseline")
                             for m in tr.MODES)
    on_disk = json.loads((tmp_path / "trace" / "connector-stream.json").read_text())
    assert on_disk["ttft_s"]["p50"] == runs["connector", "stream"]["ttft_s"]["p50"]
    assert len(on_disk["per_request"]) == on_disk["requests"]


def test_campaign_with_a_store_that_never_serves_fails_the_hit_check(
        tmp_path: Path) -> None:
    servers = {"connector": FakeServer(connector=True, store_serves=False),
               "baseline": FakeServer()}
    camp = campaign(tmp_path, servers)
    try:
        f = camp.run("connector", "interleave")
    finally:
        camp.close()
    msg = _message(tr.check_external_hits_rose, f)
    assert "expected external prefix-cache hits to rise" in msg
    assert "+0" in msg and "check its store path" in msg
