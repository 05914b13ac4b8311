"""Trace tier: a Mooncake trace replayed in three modes, with and without the connector.

Each mode runs once per variant (``connector``: the profile's
``--kv-transfer-config``; ``baseline``: the same server without it), one server at a
time; figures go to ``<run folder>/trace/<variant>-<mode>.json`` and into the test's
properties. See tvc/trace/replay.py (modes, measurement) and tvc/trace/bench.py
(settings, sizes, servers).
"""

from __future__ import annotations

from typing import Any

import pytest

from tvc.trace import replay as tr
from tvc.trace.bench import VARIANTS

pytestmark = [pytest.mark.trace, pytest.mark.hw_gpu]


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> str:
    """``connector`` or ``baseline``; module scope keeps one server per variant."""
    return request.param


def record_figures(record_property: Any, fig: dict[str, Any]) -> None:
    """Put a run's headline figures into the test's properties."""
    pre = f"trace.{fig['variant']}.{fig['mode']}"
    record_property(f"{pre}.requests", fig["requests"])
    record_property(f"{pre}.succeeded", fig["succeeded"])
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        for p in tr.PERCENTILES:
            record_property(f"{pre}.{key[:-2]}_p{p}_s", fig[key][f"p{p}"])
    for key, value in fig["throughput"].items():
        record_property(f"{pre}.{key}", value)
    for key, value in fig["prefix_cache"].items():
        record_property(f"{pre}.{key}", value)
    record_property(f"{pre}.wall_s", fig["wall_s"])


def expect_local_cache_reset(fig: dict[str, Any]) -> None:
    """The run started with an empty local prefix cache (else reuse is not tested)."""
    bad = [n for n in fig["notes"] if "NOT reset" in n]
    assert not bad, (f"{fig['variant']} {fig['mode']}: {bad[0]}; without the reset "
                     "the GPU prefix cache serves the reuse and the store is not "
                     "exercised")


def test_populate_sends_every_distinct_prompt_once(variant: str, trace_campaign: Any,
                                                   record_property: Any) -> None:
    camp = trace_campaign
    fig = camp.run(variant, "populate")
    record_figures(record_property, fig)
    tr.check_all_succeeded(fig)
    tr.check_percentiles_ordered(fig)
    distinct = set()
    for rec in camp.records[: camp.settings.max_requests or None]:
        if rec.hash_ids:
            p = camp.synth.prompt(rec)
            distinct.add(tuple(p[: camp.max_prompt_tokens or None]))
    assert fig["requests"] == len(distinct), (
        f"populate: expected one request per distinct prompt of the trace "
        f"({len(distinct)}), sent {fig['requests']}")
    if variant == "baseline":
        tr.check_no_external_hits(fig)


def test_interleaved_replay_is_served_from_the_store(variant: str,
                                                     trace_campaign: Any,
                                                     record_property: Any) -> None:
    fig = trace_campaign.run(variant, "interleave")
    record_figures(record_property, fig)
    tr.check_all_succeeded(fig)
    tr.check_percentiles_ordered(fig)
    expect_local_cache_reset(fig)
    if variant == "connector":
        tr.check_external_hits_rose(fig)
    else:
        tr.check_no_external_hits(fig)


def test_timed_stream_replay_keeps_the_trace_pace(variant: str, trace_campaign: Any,
                                                  record_property: Any) -> None:
    fig = trace_campaign.run(variant, "stream")
    record_figures(record_property, fig)
    tr.check_all_succeeded(fig)
    tr.check_percentiles_ordered(fig)
    expect_local_cache_reset(fig)
    starts = [r["start_s"] for r in fig["per_request"]]
    s = trace_campaign.settings
    planned = tr.plan(trace_campaign.records, "stream", trace_campaign.synth,
                      time_scale=s.time_scale, max_duration_s=s.max_duration_s,
                      max_requests=s.max_requests)
    last_at = max(p.send_at_s or 0.0 for p in planned)
    record_property(f"trace.{variant}.stream.trace_span_s", round(last_at, 3))
    assert max(starts) >= last_at - 0.05, (
        f"stream: the last request was sent {max(starts):.3f} s after the start, "
        f"before its trace time {last_at:.3f} s; the replay is not paced")
