"""GPU cache pressure and token-source figures of the trace tier (no GPU).

The math (working set, cache size, fractions, gains) on fixed inputs, the campaign's
serve args under pressure, and the pressure check against fake servers: one whose
GPU cache is bounded (the baseline recomputes what the connector loads: passes) and
one whose cache holds everything (no pressure: the check fails, naming why).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from selftests.trace.fake_server import FakeServer
from tvc.config.profile import load
from tvc.trace import replay as tr
from tvc.trace.bench import TraceCampaign, resolve_settings

SRC = tr.source_metric_key


# -- working set and cache size --


def _message(check, *args) -> str:
    """The message ``check(*args)`` fails with (it must fail)."""
    with pytest.raises(AssertionError) as exc:
        check(*args)
    return str(exc.value)


def test_working_set_counts_shared_prefix_blocks_once() -> None:
    a = list(range(40))  # blocks of 16: [0-15] [16-31] [32-39]
    b = list(range(32)) + [99] * 8  # shares the first two blocks with a
    c = [7] + list(range(1, 40))  # differs in block 0, so in every block after
    assert tr.working_set_blocks([a], 16) == 3
    assert tr.working_set_blocks([a, a], 16) == 3
    assert tr.working_set_blocks([a, b], 16) == 4
    assert tr.working_set_blocks([a, b, c], 16) == 7
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        tr.working_set_blocks([a], 0)


def test_pressure_plan_takes_the_fraction_above_vllms_floor() -> None:
    prompts = [[i] * 1600 for i in range(4)]  # 4 x 100 distinct blocks of 16
    p = tr.pressure_plan(prompts, 16, max_model_len=1024)
    assert p["working_set_blocks"] == 400 and p["floor_blocks"] == 65
    assert p["num_gpu_blocks"] == 200 and p["under_pressure"]
    small = tr.pressure_plan(prompts[:1], 16, max_model_len=2048)
    assert small["num_gpu_blocks"] == 129 == small["floor_blocks"]  # floor wins...
    assert small["under_pressure"] is False  # ...and holds all 100 blocks
    o = tr.pressure_plan(prompts, 16, 1024, override=77)
    assert o["num_gpu_blocks"] == 77 and "num_gpu_blocks_override" in o["source"]
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\)"):
        tr.pressure_plan(prompts, 16, 1024, fraction=1.0)


# -- token sources and gains --

def test_token_sources_from_the_by_source_counter_sum_to_one() -> None:
    d = {SRC("local_cache_hit"): 300.0, SRC("external_kv_transfer"): 500.0,
         SRC("local_compute"): 200.0, "vllm:prefix_cache_hits_total": 999.0}
    t = tr.token_sources(d, prompt_tokens_sent=1000)
    assert t["method"].startswith("vllm:prompt_tokens_by_source_total")
    assert t["fractions"] == {"local_cache_hit": 0.3, "external_kv_transfer": 0.5,
                              "local_compute": 0.2}
    assert sum(t["fractions"].values()) == pytest.approx(1.0)


def test_token_sources_fall_back_to_the_hit_counters() -> None:
    d = {"vllm:prefix_cache_hits_total": 250.0,
         "vllm:external_prefix_cache_hits_total": 500.0}
    t = tr.token_sources(d, prompt_tokens_sent=1000)
    assert t["tokens"] == {"local_cache_hit": 250.0, "external_kv_transfer": 500.0,
                           "local_compute": 250.0}
    assert sum(t["fractions"].values()) == pytest.approx(1.0)
    empty = tr.token_sources({}, 0)
    assert empty["total_tokens"] == 0 and set(empty["fractions"].values()) == {None}


def test_throughput_gain_is_connector_over_baseline() -> None:
    b = {"throughput": {"requests_per_s": 2.0, "output_tokens_per_s": 100.0}}
    c = {"throughput": {"requests_per_s": 5.0, "output_tokens_per_s": None}}
    assert tr.throughput_gain(b, c) == {"requests_per_s": 2.5,
                                        "output_tokens_per_s": None}


def figs(local_b: float, local_c: float, ext_c: float, ideal: float = 800
         ) -> tuple[dict, dict]:
    def one(variant: str, local: float, ext: float) -> dict[str, Any]:
        return {"variant": variant, "mode": "interleave",
                "config": {"ideal_local_hit_tokens": ideal},
                "token_sources": tr.token_sources(
                    {SRC("local_cache_hit"): local, SRC("external_kv_transfer"): ext,
                     SRC("local_compute"): 1000 - local - ext}, 1000)}
    return one("baseline", local_b, 0.0), one("connector", local_c, ext_c)


def test_ideal_hits_count_full_blocks_seen_before_and_recompute_the_last() -> None:
    a = list(range(40))
    assert tr.ideal_local_hits([a], 16) == 0
    assert tr.ideal_local_hits([a, a], 16) == 32  # 2 full blocks, last token computed
    assert tr.ideal_local_hits([a, a[:32]], 16) == 16  # 32 tokens: cap (31)//16 = 1
    assert tr.ideal_local_hits([a, [7] + a[1:]], 16) == 0


def test_pressure_check_passes_when_the_connector_saves_compute() -> None:
    tr.check_pressure(*figs(100, 100, 600))


def test_pressure_check_fails_without_pressure_or_without_loads() -> None:
    msg = _message(tr.check_pressure, *figs(700, 700, 0))
    assert "expected the connector to serve prompt tokens the GPU cache evicted" in msg
    msg = _message(tr.check_pressure, *figs(750, 600, 200))
    assert "served 750 of the 800 prompt tokens an unbounded cache would have" in msg
    assert "not under pressure" in msg
    msg = _message(tr.check_pressure, *figs(700, 650, 50, ideal=1000))
    assert "the GPU cache was not under pressure" in msg
    assert "connector 0.700 = GPU 0.650 + store 0.050, baseline 0.700" in msg


# -- the campaign under pressure --

def campaign(tmp_path: Path, servers: dict[str, FakeServer] | None = None,
             **opts: Any) -> TraceCampaign:
    prof = load("example", env={})
    settings = resolve_settings(prof, {"max_requests": 24, "concurrency": 1,
                                       "time_scale": 0.05, **opts})
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"vocab_size": 512}))
    return TraceCampaign(prof, settings, model, tmp_path / "trace",
                         server_factory=(lambda v: servers[v]) if servers else None)


def test_pressure_sizes_both_servers_below_the_working_set(tmp_path: Path) -> None:
    camp = campaign(tmp_path, pressure=True)
    p = camp.pressure
    assert p is not None and p["requested"] and p["under_pressure"]
    args = camp.serve_args()
    assert args[-len(p["serve_args"]):] == p["serve_args"]
    assert args[args.index("--num-gpu-blocks-override") + 1] == str(
        p["num_gpu_blocks"])
    assert args[args.index("--block-size") + 1] == "16"
    # --max-model-len lowered from the profile's 2048 to the longest request
    assert int(args[len(args) - 1 - args[::-1].index("--max-model-len") + 1]) < 2048
    assert p["num_gpu_blocks"] == max(p["floor_blocks"],
                                      -(-p["working_set_blocks"] // 2))
    none = campaign(tmp_path)
    assert none.pressure is None and "--num-gpu-blocks-override" not in (
        none.serve_args())
    fixed = campaign(tmp_path, num_gpu_blocks_override=300)
    assert fixed.pressure["num_gpu_blocks"] == 300 and not fixed.pressure["requested"]


def run_interleave(tmp_path: Path, capacity: int) -> tuple[dict, dict]:
    """Interleave on both variants; ``capacity`` GPU-cache blocks (0 = unbounded)."""
    kw = {"ttft_s": 0.02, "by_source": True, "block_size": 16,
          "local_capacity": capacity}
    servers = {"connector": FakeServer(connector=True, **kw),
               "baseline": FakeServer(**kw)}
    camp = campaign(tmp_path, servers, pressure=True)
    try:
        return (camp.run("baseline", "interleave"),
                camp.run("connector", "interleave"))
    finally:
        camp.close()


def test_bounded_gpu_cache_makes_the_baseline_recompute(tmp_path: Path) -> None:
    b, c = run_interleave(tmp_path, capacity=8)
    fb, fc = b["token_sources"]["fractions"], c["token_sources"]["fractions"]
    assert sum(fb.values()) == pytest.approx(1) == sum(fc.values())
    assert fc["external_kv_transfer"] > 0 and fb["external_kv_transfer"] == 0
    tr.check_pressure(b, c)


def test_unbounded_gpu_cache_is_reported_as_no_pressure(tmp_path: Path) -> None:
    b, c = run_interleave(tmp_path, capacity=0)
    assert c["token_sources"]["tokens"]["external_kv_transfer"] > 0  # first uses
    msg = _message(tr.check_pressure, b, c)
    assert "the GPU cache was not under pressure" in msg
    assert b["token_sources"]["tokens"]["local_cache_hit"] == b["config"][
        "ideal_local_hit_tokens"] > 0
