"""Trace tier: the connector's TTFT and throughput gain over the baseline.

Runs after test_replay_modes.py (file order) and reuses its runs; run alone, it
replays what is missing. Writes ``<run folder>/trace/ttft.json``: TTFT p50/p90/p99 per
variant and mode, the gain (baseline / connector) per percentile, the throughput gain
(connector / baseline) and where each run's prompt tokens came from (GPU prefix
cache, connector, compute). The interleave p50 gain also gets a paired bootstrap
interval over requests (:func:`tvc.trace.replay.ttft_gain_interval`); ``[trace]
min_ttft_gain`` applies to its lower bound, the interleave mode is replayed again
(up to :data:`MAX_GAIN_REPEATS` times) while the interval straddles the threshold
or the sample is too small, and the test fails saying so when it still cannot
decide. Beside it: the connector's effective KV load rate (external tokens x KV
bytes per token / load window, :func:`tvc.trace.replay.kv_load_rate`) and the pinned
host-to-device copy ceiling (``<run>/bandwidth.json`` or measured here). With GPU
cache pressure (``[trace] pressure = true`` or
``--tvc-trace-pressure``) it also checks that the pressure made the baseline
recompute what the connector loaded.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tvc.trace import replay as tr
from tvc.trace.bench import VARIANTS

pytestmark = [pytest.mark.trace, pytest.mark.hw_gpu]

GAIN_MODES = ("interleave", "stream")  # populate has nothing to reuse
# Extra interleave replays (both variants) while the gain's interval cannot
# decide: each costs one replay per variant (~10-30 s for the shipped traces).
MAX_GAIN_REPEATS = 2


def copy_ceiling(camp: Any) -> dict[str, Any]:
    """The pinned host-to-device copy ceiling: the bandwidth tier's, else measured."""
    from tvc.store import bandwidth as bw

    path = camp.out_dir.parent / "bandwidth.json"
    try:
        ref = json.loads(path.read_text()).get("refs", {}).get("pinned_h2d")
    except (OSError, ValueError, AttributeError):
        ref = None
    if ref:
        return {"source": str(path), **ref}
    try:
        times = bw.measure_pinned_copy()["h2d"]
        return {"source": "measured by the trace tier (tvc.store.bandwidth."
                          "measure_pinned_copy)", **bw.summarize(bw.TOTAL_BYTES, times)}
    except Exception as exc:  # noqa: BLE001 - a reference figure, recorded
        return {"source": "not measured", "error": str(exc)[:200]}


def record_sources(record_property: Any, fig: dict[str, Any]) -> None:
    """Fractions of prompt tokens from the GPU cache, the connector and compute."""
    for src, frac in fig["token_sources"]["fractions"].items():
        record_property(f"trace.{fig['variant']}.{fig['mode']}.{src}_fraction", frac)


def test_connector_ttft_gain_is_reported(trace_campaign: Any, record_property: Any,
                                         tvc_seed: int) -> None:
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
    from tvc.procs.pool import kv_bytes_per_token

    need = camp.settings.min_ttft_gain
    seed = int(tvc_seed or 0)
    b_runs, c_runs = [runs["baseline", "interleave"]], [runs["connector", "interleave"]]
    interval = tr.ttft_gain_interval(b_runs, c_runs, seed=seed)
    verdict, text = tr.gain_verdict(interval, need or 0.0)
    while need and verdict in ("undecided", "too_small") and (
            len(b_runs) <= MAX_GAIN_REPEATS):
        b_runs.append(camp.repeat("baseline", "interleave"))
        c_runs.append(camp.repeat("connector", "interleave"))
        interval = tr.ttft_gain_interval(b_runs, c_runs, seed=seed)
        verdict, text = tr.gain_verdict(interval, need)
    out["gain_interval"] = {"interleave": {**interval, "verdict": verdict,
                                           "min_ttft_gain": need, "text": text}}
    for key in ("p50", "low", "high", "n", "repeats"):
        record_property(f"trace.gain.interleave.ttft_p50_ci_{key}", interval[key])
    rate = tr.kv_load_rate(runs["connector", "interleave"],
                           kv_bytes_per_token(camp.model_dir, camp.serve_args()))
    rate["host_to_device_ceiling"] = copy_ceiling(camp)
    out["kv_load_rate"] = {"interleave": rate}
    record_property("trace.connector.interleave.kv_load_gbps", rate["gbps"])
    record_property("trace.pinned_h2d_median_gbps",
                    rate["host_to_device_ceiling"].get("median_gbps"))
    tr.write_json(camp.out_dir / "ttft.json", out)
    if need and verdict != "pass":
        base_s = runs["baseline", "interleave"]["ttft_s"]["p50"]
        conn_s = runs["connector", "interleave"]["ttft_s"]["p50"]
        pytest.fail(
            f"[trace] min_ttft_gain {need:g}x applies to the interval's lower "
            f"bound: {text} (first run: baseline p50 {base_s} s, connector "
            f"{conn_s} s)" + (
                " — the store serves prefixes slower than recomputing them; check "
                "its bandwidth" if verdict == "fail" else
                " — replay a larger trace (--tvc-trace-size large) or more "
                "requests for a decision"), pytrace=False)


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
    tr.check_pressure(runs["baseline", "interleave"], runs["connector", "interleave"])
