"""Trace tier: the connector's TTFT and throughput gain over the baseline.

Runs after test_replay_modes.py (file order) and reuses its runs; run alone, it
replays what is missing. Writes ``<run folder>/trace/ttft.json``: TTFT p50/p90/p99 per
variant and mode, the gain (baseline / connector) per percentile, the throughput gain
(connector / baseline) and where each run's prompt tokens came from (GPU prefix
cache, connector, compute). With GPU cache pressure (``[trace] pressure = true`` or
``--tvc-trace-pressure``) it also checks that the pressure made the baseline
recompute what the connector loaded.
"""

from __future__ import annotations

from typing import Any

import pytest

from tvc import trace as tr
from tvc.trace_bench import VARIANTS

pytestmark = [pytest.mark.trace, pytest.mark.hw_gpu]

GAIN_MODES = ("interleave", "stream")  # populate has nothing to reuse


def record_sources(record_property: Any, fig: dict[str, Any]) -> None:
    """Fractions of prompt tokens from the GPU cache, the connector and compute."""
    for src, frac in fig["token_sources"]["fractions"].items():
        record_property(f"trace.{fig['variant']}.{fig['mode']}.{src}_fraction", frac)


def test_connector_ttft_gain_is_reported(trace_campaign: Any, record_property: Any
                                         ) -> None:
    camp = trace_campaign
    runs = {(v, m): camp.run(v, m) for v in VARIANTS for m in tr.MODES}
    out: dict[str, Any] = {
        "percentile_method": tr.PERCENTILE_DOC,
        "settings": camp.settings.as_dict(),
        "gpu_cache_pressure": camp.pressure,
        "ttft_s": {f"{v}.{m}": {f"p{p}": runs[v, m]["ttft_s"][f"p{p}"]
                               for p in tr.PERCENTILES}
                   for v, m in runs},
        "throughput": {f"{v}.{m}": runs[v, m]["throughput"] for v, m in runs},
        "token_sources": {f"{v}.{m}": runs[v, m]["token_sources"]
                          for v, m in runs},
        "gain": {},
        "throughput_gain": {},
    }
    for mode in GAIN_MODES:
        gain = tr.ttft_gain(runs["baseline", mode], runs["connector", mode])
        out["gain"][mode] = gain
        for key, value in gain.items():
            record_property(f"trace.gain.{mode}.ttft_{key}", value)
        tgain = tr.throughput_gain(runs["baseline", mode], runs["connector", mode])
        out["throughput_gain"][mode] = tgain
        for key, value in tgain.items():
            record_property(f"trace.gain.{mode}.{key}", value)
        for v in VARIANTS:
            record_sources(record_property, runs[v, mode])
    tr.write_json(camp.out_dir / "ttft.json", out)
    need = camp.settings.min_ttft_gain
    got = out["gain"]["interleave"]["p50"]
    if need and (got is None or got < need):
        pytest.fail(
            f"interleave TTFT p50 gain: expected >= {need:g}x ([trace] "
            f"min_ttft_gain), saw {got}x (baseline "
            f"{runs['baseline', 'interleave']['ttft_s']['p50']} s, connector "
            f"{runs['connector', 'interleave']['ttft_s']['p50']} s) — the store "
            "serves prefixes slower than recomputing them; check its bandwidth",
            pytrace=False)


def test_gpu_cache_pressure_makes_the_baseline_recompute(trace_campaign: Any,
                                                         record_property: Any
                                                         ) -> None:
    camp = trace_campaign
    p = camp.pressure
    if p is None or not p["requested"]:
        pytest.skip("GPU cache pressure is off: set [trace] pressure = true in the "
                    "profile or pass --tvc-trace-pressure")
    for key in ("working_set_blocks", "floor_blocks", "num_gpu_blocks",
                "block_size", "max_model_len"):
        record_property(f"trace.pressure.{key}", p[key])
    assert p["under_pressure"], (
        f"pressure: the GPU cache ({p['num_gpu_blocks']} blocks of "
        f"{p['block_size']} tokens, source {p['source']}) holds the trace's whole "
        f"working set ({p['working_set_blocks']} blocks), so nothing is evicted; "
        f"vLLM needs at least {p['floor_blocks']} blocks for one "
        f"{p['max_model_len']}-token request — use a larger trace "
        "(--tvc-trace-size large) or a smaller [trace] num_gpu_blocks_override")
    runs = {(v, "interleave"): camp.run(v, "interleave") for v in VARIANTS}
    for fig in runs.values():
        record_sources(record_property, fig)
    msg = tr.check_pressure(runs["baseline", "interleave"],
                            runs["connector", "interleave"])
    if msg:
        pytest.fail(msg, pytrace=False)
