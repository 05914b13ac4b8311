"""Trace machinery on fixed inputs: percentiles, prompts, plans, checks, settings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tvc.config.profile import load
from tvc.trace import replay as tr
from tvc.trace.bench import SIZES, resolve_settings


def _message(check, *args) -> str:
    """The message ``check(*args)`` fails with (it must fail)."""
    with pytest.raises(AssertionError) as exc:
        check(*args)
    return str(exc.value)


def rec(i: int, ids: list[int], length: int, ts: float = 0.0, out: int = 8
        ) -> tr.TraceRecord:
    return tr.TraceRecord(i, ts, length, out, tuple(ids))


# -- percentile math --

def test_percentiles_are_linear_interpolation_between_ranks() -> None:
    s = tr.summarize([float(v) for v in range(1, 11)])  # 1..10
    # type 7: h = (n-1) p; x[floor h] + frac(h) * (x[ceil h] - x[floor h])
    assert s["p50"] == pytest.approx(5.5)
    assert s["p90"] == pytest.approx(9.1)
    assert s["p99"] == pytest.approx(9.91)
    assert (s["n"], s["min"], s["max"], s["mean"]) == (10, 1.0, 10.0, 5.5)


def test_percentiles_skip_missing_values_and_handle_small_inputs() -> None:
    s = tr.summarize([0.2, None, 0.4])
    assert s["n"] == 2 and s["p50"] == pytest.approx(0.3)
    assert s["p99"] == pytest.approx(0.398)
    one = tr.summarize([0.7])
    assert one["p50"] == one["p90"] == one["p99"] == 0.7
    empty = tr.summarize([None])
    assert empty["n"] == 0 and empty["p50"] is None


def test_percentiles_are_unordered_input_safe() -> None:
    vals = [3.0, 1.0, 2.0, 10.0, 4.0]
    assert tr.summarize(vals) == tr.summarize(sorted(vals))


def test_ttft_gain_is_baseline_over_connector() -> None:
    b = {"ttft_s": {"p50": 1.0, "p90": 2.0, "p99": 4.0}}
    c = {"ttft_s": {"p50": 0.25, "p90": 1.0, "p99": None}}
    g = tr.ttft_gain(b, c)
    assert g["p50"] == 4.0 and g["p50_reduction_pct"] == 75.0
    assert g["p90"] == 2.0 and g["p99"] is None


# -- prompt synthesis --

def test_equal_hash_ids_give_identical_blocks_and_different_ids_differ() -> None:
    s = tr.PromptSynth(tokens_per_hash_id=16, token_low=3, token_high=512)
    assert np.array_equal(s.block(7), s.block(7))
    assert not np.array_equal(s.block(7), s.block(8))
    assert s.block(7).shape == (16,)
    again = tr.PromptSynth(tokens_per_hash_id=16, token_low=3, token_high=512)
    assert np.array_equal(s.block(123), again.block(123))  # across instances
    other_seed = tr.PromptSynth(16, 3, 512, seed=1)
    assert not np.array_equal(s.block(7), other_seed.block(7))


def test_prompts_share_exactly_their_common_leading_blocks() -> None:
    s = tr.PromptSynth(tokens_per_hash_id=16, token_low=3, token_high=512)
    a = s.prompt(rec(0, [1, 2, 3], 3 * 512))
    b = s.prompt(rec(1, [1, 2, 9], 3 * 512))
    c = s.prompt(rec(2, [5, 2, 3], 3 * 512))
    assert len(a) == len(b) == 48
    assert a[:32] == b[:32] and a[32:] != b[32:]
    assert a[:16] != c[:16] and a[16:] == c[16:]  # equal ids, equal blocks
    assert all(3 <= t < 512 for t in a)


def test_prompt_length_scales_and_stays_in_the_last_block() -> None:
    s = tr.PromptSynth(tokens_per_hash_id=64)
    assert s.prompt_length(rec(0, [0, 1], 1024)) == 128
    assert s.prompt_length(rec(0, [0, 1], 520)) == 65  # round(520/8) clamped to 65
    assert s.prompt_length(rec(0, [0, 1], 5000)) == 128  # never past k blocks
    assert s.prompt_length(rec(0, [0, 1, 2], 1100)) == 138
    assert len(s.prompt(rec(0, [0, 1, 2], 1100))) == 138


def test_bad_synth_settings_are_refused() -> None:
    with pytest.raises(tr.TraceError, match="tokens_per_hash_id"):
        tr.PromptSynth(tokens_per_hash_id=0)
    with pytest.raises(tr.TraceError, match="token range"):
        tr.PromptSynth(16, token_low=10, token_high=10)


# -- trace files --

def test_trace_reader_names_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, '
                 '"hash_ids": [0]}\n\n{"timestamp": 5, "input_length": 10}\n')
    with pytest.raises(tr.TraceError, match=r"t\.jsonl:3: missing key 'output_length'"):
        tr.load_trace(p)
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, '
                 '"hash_ids": [-1]}\n')
    with pytest.raises(tr.TraceError, match=r":1: key 'hash_ids'"):
        tr.load_trace(p)
    p.write_text("{not json\n")
    with pytest.raises(tr.TraceError, match=r":1: not valid JSON"):
        tr.load_trace(p)
    p.write_text("\n")
    with pytest.raises(tr.TraceError, match="no records"):
        tr.load_trace(p)
    with pytest.raises(tr.TraceError, match="cannot read"):
        tr.load_trace(tmp_path / "missing.jsonl")


def test_shipped_trace_is_reproducible_from_its_seed() -> None:
    text = tr.dump_trace(tr.generate_trace(seed=0))
    assert tr.SHIPPED_TRACE.read_text() == text, (
        "tvc/data/traces/smoke.jsonl differs from "
        "`python3 scripts/make_trace.py --seed 0`")
    recs = tr.load_trace(tr.SHIPPED_TRACE)
    firsts = [r.hash_ids[0] for r in recs]
    assert len(set(firsts)) < len(recs)  # shared prefixes
    assert len({r.hash_ids for r in recs}) < len(recs)  # exact repeats
    lengths = [r.input_length for r in recs]
    assert 4096 < min(lengths) and max(lengths) <= 8192  # 4-8k tokens at 512/id


def test_generator_depends_on_the_seed() -> None:
    assert tr.generate_trace(seed=1) != tr.generate_trace(seed=0)
    assert tr.generate_trace(seed=1) == tr.generate_trace(seed=1)


# -- modes --

TRACE = [rec(0, [0, 1, 2], 1536, 0), rec(1, [0, 1, 3], 1536, 100),
         rec(2, [4, 5], 1024, 200), rec(3, [0, 1, 2], 1536, 300),
         rec(4, [0, 1], 1024, 400), rec(5, [6], 512, 2500)]
SYN = tr.PromptSynth(tokens_per_hash_id=8, token_low=3, token_high=500)


def test_populate_sends_each_distinct_prompt_once_in_trace_order() -> None:
    p = tr.plan(TRACE, "populate", SYN)
    assert [x.record_index for x in p] == [0, 1, 2, 4, 5]  # record 3 repeats 0
    assert all(x.max_tokens == 1 and x.send_at_s is None for x in p)
    assert len({tuple(x.prompt) for x in p}) == len(p)


def test_interleave_round_robins_over_prefix_groups() -> None:
    p = tr.plan(TRACE, "interleave", SYN, max_output_tokens=4)
    assert [x.record_index for x in p] == [0, 2, 5, 1, 3, 4]
    assert [x.group for x in p] == [0, 4, 6, 0, 0, 0]
    assert all(x.max_tokens == 4 for x in p)


def test_stream_follows_timestamps_scaled_and_bounded() -> None:
    p = tr.plan(TRACE, "stream", SYN, time_scale=0.5, max_duration_s=1.0)
    assert [x.record_index for x in p] == [0, 1, 2, 3, 4]  # 2.5 s * 0.5 > 1.0
    assert [x.send_at_s for x in p] == pytest.approx([0, 0.05, 0.1, 0.15, 0.2])
    with pytest.raises(tr.TraceError, match="unknown replay mode"):
        tr.plan(TRACE, "replay", SYN)


def test_plan_caps_requests_prompts_and_outputs() -> None:
    p = tr.plan(TRACE, "interleave", SYN, max_requests=2, max_prompt_tokens=10)
    assert sorted(x.record_index for x in p) == [0, 1]
    assert all(len(x.prompt) == 10 for x in p)


# -- checks --

def fig(**over: object) -> dict:
    base = {"variant": "connector", "mode": "interleave", "requests": 4,
            "failed": 0, "errors": [],
            "ttft_s": tr.summarize([0.1, 0.2, 0.3]),
            "tpot_s": tr.summarize([0.01, 0.02]),
            "e2e_s": tr.summarize([0.5, 0.6]),
            "prefix_cache": {"external_hit_tokens": 100.0, "local_hit_tokens": 0.0}}
    base.update(over)
    return base


def test_checks_pass_on_a_good_run() -> None:
    f = fig()
    tr.check_all_succeeded(f)
    tr.check_percentiles_ordered(f)
    tr.check_external_hits_rose(f)


def test_failed_requests_fail_with_count_and_first_errors() -> None:
    msg = _message(tr.check_all_succeeded, fig(failed=2, errors=["HTTP 500: boom"]))
    assert "expected all 4 requests to complete, 2 failed" in msg
    assert "HTTP 500: boom" in msg
    assert "sent no request" in _message(tr.check_all_succeeded, fig(requests=0))


def test_out_of_order_percentiles_fail() -> None:
    bad = tr.summarize([0.1, 0.2])
    bad["p90"] = 0.05
    msg = _message(tr.check_percentiles_ordered, fig(ttft_s=bad))
    assert "ttft_s percentiles out of order" in msg
    msg = _message(tr.check_percentiles_ordered, fig(e2e_s=tr.summarize([0.01])))
    assert "exceeds max end-to-end latency" in msg


def test_no_external_hits_fails_naming_the_counter() -> None:
    msg = _message(tr.check_external_hits_rose, fig(prefix_cache={
        "external_hit_tokens": 0.0, "local_hit_tokens": 512.0}))
    assert "vllm:external_prefix_cache_hits_total +0" in msg
    assert "local hits +512" in msg
    msg = _message(tr.check_external_hits_rose,
                   fig(prefix_cache={"external_hit_tokens": None}))
    assert "exports no vllm:external_prefix_cache_hits_total" in msg
    msg = _message(tr.check_no_external_hits, fig(variant="baseline"))
    assert "baseline server (no --kv-transfer-config) reported 100" in msg


def test_metrics_parser_sums_engines_and_keeps_sources() -> None:
    text = "\n".join([
        "# TYPE vllm:external_prefix_cache_hits counter",
        'vllm:external_prefix_cache_hits_total{engine="0"} 592.0',
        'vllm:external_prefix_cache_hits_total{engine="1"} 8.0',
        "# TYPE vllm:prompt_tokens_by_source counter",
        'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} 592.0',
        'vllm:prompt_tokens_by_source_total{source="local_compute"} 8.0',
        "# TYPE vllm:num_requests_running gauge",
        "vllm:num_requests_running 1.0", ""])
    m = tr.parse_metrics(text)
    assert m["vllm:external_prefix_cache_hits_total"] == 600.0
    assert m['vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}'] == 592
    assert "vllm:num_requests_running" not in m
    d = tr.metric_delta({"a": 1.0}, {"a": 3.0, "b": 2.0})
    assert d == {"a": 2.0, "b": 2.0}


# -- settings --

def test_settings_take_cli_over_profile_over_size(tmp_path: Path) -> None:
    prof_path = tmp_path / "p.toml"
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 5,
                                 "output_length": 1, "hash_ids": [0]}) + "\n")
    prof_path.write_text(
        '[profile]\nname = "p"\n[connector]\nname = "ExampleConnector"\n'
        f'[trace]\npath = "{trace}"\nconcurrency = 8\nsize = "large"\n')
    prof = load(str(prof_path), env={})
    s = resolve_settings(prof, {"concurrency": 2, "time_scale": None})
    assert s.path == trace and s.size == "large"
    assert s.concurrency == 2 and s.sources["concurrency"] == "cli"
    assert s.tokens_per_hash_id == SIZES["large"].tokens_per_hash_id
    assert s.sources["tokens_per_hash_id"] == "default"
    with pytest.raises(tr.TraceError, match="trace size 'huge' is not known"):
        resolve_settings(prof, {"size": "huge"})
    with pytest.raises(tr.TraceError, match="does not exist"):
        resolve_settings(prof, {"path": str(tmp_path / "nope.jsonl")})


def test_default_settings_use_the_shipped_smoke_trace() -> None:
    s = resolve_settings(load("example", env={}))
    assert s.path == tr.SHIPPED_TRACE and s.size == "smoke"
    assert s.tokens_per_hash_id == 64 and s.max_output_tokens == 32
