"""Trace tier: the connector's TTFT gain over the baseline, as JSON and properties.

Runs after test_replay_modes.py (file order) and reuses its runs; run alone, it
replays what is missing. Writes ``<run folder>/trace/ttft.json``: TTFT p50/p90/p99 per
variant and mode, and the gain (baseline / connector) per percentile.
"""

from __future__ import annotations

from typing import Any

import pytest

from tvc import trace as tr
from tvc.trace_bench import VARIANTS

pytestmark = [pytest.mark.trace, pytest.mark.hw_gpu]

GAIN_MODES = ("interleave", "stream")  # populate has nothing to reuse


def test_connector_ttft_gain_is_reported(trace_campaign: Any, record_property: Any
                                         ) -> None:
    camp = trace_campaign
    runs = {(v, m): camp.run(v, m) for v in VARIANTS for m in tr.MODES}
    out: dict[str, Any] = {
        "percentile_method": tr.PERCENTILE_DOC,
        "settings": camp.settings.as_dict(),
        "ttft_s": {f"{v}.{m}": {f"p{p}": runs[v, m]["ttft_s"][f"p{p}"]
                               for p in tr.PERCENTILES}
                   for v, m in runs},
        "gain": {},
    }
    for mode in GAIN_MODES:
        gain = tr.ttft_gain(runs["baseline", mode], runs["connector", mode])
        out["gain"][mode] = gain
        for key, value in gain.items():
            record_property(f"trace.gain.{mode}.ttft_{key}", value)
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
