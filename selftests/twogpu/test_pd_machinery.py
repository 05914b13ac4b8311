"""tvc.pd.pair on CPU: settings, role configs, start-up checks, and the router against
fake producer/consumer servers for every routing convention, good and faulty."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tvc.config.profile import load
from tvc.pd import pair as PD
from tvc.procs.client import Completion
from tvc.procs.vllm_server import VllmServer

pytestmark = [pytest.mark.hw_any]

HERE = Path(__file__).resolve().parent
FAKE = [sys.executable, str(HERE / "fake_pd_server.py")]
BASE = {"kv_connector": "FakeConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"keep": 1}}
PROMPTS = [[10 + i for i in range(40)], [200 - i for i in range(33)]]


# ------------------------------------------------------------------ configuration
def test_builtin_pd_profiles_load_and_declare_a_pair() -> None:
    for name, routing in (("p2p-nccl", "request_id"), ("pd-example", "shared_store")):
        s = PD.pd_settings(load(name))
        assert s.enabled and s.routing == routing
        assert (s.producer_gpu, s.consumer_gpu) == (0, 1)
    assert not PD.pd_settings(load("example")).enabled


def test_role_configs_set_roles_ports_and_per_role_overrides() -> None:
    s = PD.PDSettings(enabled=True, routing="request_id",
                      producer={"kv_buffer_size": 10.0,
                                "kv_connector_extra_config": {"send_type": "PUT"}},
                      consumer={"kv_buffer_size": 8e9})
    cfg = PD.build_role_configs(BASE, s, producer_kv_port=21001,
                                consumer_kv_port=22001)
    p, c = cfg["producer"], cfg["consumer"]
    assert (p["kv_role"], p["kv_rank"], p["kv_port"]) == ("kv_producer", 0, 21001)
    assert (c["kv_role"], c["kv_rank"], c["kv_port"]) == ("kv_consumer", 1, 22001)
    assert p["kv_parallel_size"] == c["kv_parallel_size"] == 2
    assert p["kv_buffer_size"] == 10.0 and c["kv_buffer_size"] == 8e9
    assert p["kv_connector_extra_config"] == {"keep": 1, "send_type": "PUT"}
    assert c["kv_connector_extra_config"] == {"keep": 1}
    assert BASE["kv_role"] == "kv_both", "the profile's dict was modified"
    with pytest.raises(PD.PDConfigError, match="kv_port are both 5"):
        PD.build_role_configs(BASE, s, producer_kv_port=5, consumer_kv_port=5)


def test_bad_pd_sections_name_the_key(tmp_path: Path) -> None:
    import dataclasses

    prof = load("pd-example")
    for bad, needle in (({"routing": "carrier-pigeon"}, "pd.routing"),
                        ({"consumer_gpu": 0}, "pd.producer_gpu and consumer_gpu"),
                        ({"prefill_max_tokens": 0}, "pd.prefill_max_tokens"),
                        ({"nonsense": 1}, "pd.nonsense: unknown key")):
        data = {**prof.data, "pd": {**prof.data["pd"], **bad}}
        with pytest.raises(PD.PDConfigError, match=re.escape(needle)):
            PD.pd_settings(dataclasses.replace(prof, data=data))


def test_static_check_names_every_mismatch() -> None:
    s = PD.PDSettings(enabled=True)
    cfg = PD.build_role_configs(BASE, s, producer_kv_port=1, consumer_kv_port=2)
    PD.check_pd_compatible(cfg, {"producer": ["--block-size", "16"],
                                 "consumer": ["--block-size=16"]})
    with pytest.raises(PD.PDConfigError) as err:
        PD.check_pd_compatible(cfg, {"producer": ["--block-size", "16", "--dtype",
                                                  "float16"],
                                     "consumer": ["--block-size", "32"]})
    msg = str(err.value)
    assert "--block-size (KV block size B) differs: producer 16, consumer 32" in msg
    assert "--dtype (model dtype) differs: producer float16, consumer default" in msg
    other = {**cfg, "consumer": {**cfg["consumer"], "kv_connector": "Other"}}
    with pytest.raises(PD.PDConfigError, match="kv_connector differs"):
        PD.check_pd_compatible(other, {"producer": [], "consumer": []})


def test_request_id_round_trips_through_the_connectors_regex() -> None:
    rid = PD.pd_request_id("10.0.0.1:21001", "10.0.0.2:22001", "abc123")
    assert rid == "___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001_abc123"
    engine_id = f"cmpl-{rid}-0"  # as vLLM's completion server names it
    assert PD.parse_pd_request_id(engine_id, True) == ("10.0.0.2", 22001)
    assert PD.parse_pd_request_id(engine_id, False) == ("10.0.0.1", 21001)
    with pytest.raises(PD.PDConfigError, match="no decode address"):
        PD.parse_pd_request_id("cmpl-plain", True)


def _completion(tokens: list[int], lp: float = -0.1) -> Completion:
    return Completion(token_ids=tokens, text="", token_logprobs=[lp] * len(tokens),
                      top_logprobs=[{t: lp, t + 1: -2.5} for t in tokens])


def test_baseline_comparison_fails_on_tokens_and_on_logprobs() -> None:
    ref = _completion([5, 6, 7])
    PD.check_same_as_baseline(ref, _completion([5, 6, 7], -0.15), "x", 0.1)
    with pytest.raises(AssertionError, match="differ from the single-engine baseline "
                                             "at position 1"):
        PD.check_same_as_baseline(ref, _completion([5, 9, 7]), "x", 0.1)
    with pytest.raises(AssertionError, match=r"logprob of token 5 at position 0"):
        PD.check_same_as_baseline(ref, _completion([5, 6, 7], -0.5), "x", 0.1)


# ------------------------------------------------------------ fake server pairs
def _pair(tmp_path: Path, routing: str, fault: str = "",
          router_routing: str | None = None) -> PD.PDPair:
    s = PD.PDSettings(enabled=True, routing=router_routing or routing)
    return PD.PDPair("fake-model", BASE, s, ["--block-size", "16"],
                     tmp_path / "logs", launcher=FAKE, startup_timeout_s=60,
                     env={"FAKE_PD_ROUTING": routing,
                          "FAKE_PD_DIR": str(tmp_path / "wire"),
                          "FAKE_PD_FAULT": fault})


def _baseline(tmp_path: Path) -> list[Completion]:
    with VllmServer("fake-model", log_path=tmp_path / "logs" / "base.log",
                    launcher=FAKE, serve_args=["--block-size", "16"]) as srv:
        return [srv.client().complete(p) for p in PROMPTS]


@pytest.mark.parametrize("routing", PD.ROUTINGS)
def test_router_moves_kv_and_output_equals_baseline(tmp_path: Path,
                                                    routing: str) -> None:
    with _pair(tmp_path, routing) as pair:
        assert pair.block_size == 16
        run = PD.route_prompts(pair, PROMPTS)
        log = pair.producer.log_text() + pair.consumer.log_text()
    assert "CUDA_VISIBLE_DEVICES=0" in log and "CUDA_VISIBLE_DEVICES=1" in log, log
    assert "VLLM_HOST_IP=127.0.0.1" in log, log
    PD.check_kv_came_from_producer(run, sum(len(p) - 1 for p in PROMPTS))
    assert all(r.prefill.token_ids and len(r.prefill.token_ids) == 1
               for r in run.results), "the prefill must ask for one token"
    for ref, r in zip(_baseline(tmp_path), run.results, strict=True):
        PD.check_same_as_baseline(ref, r.completion, "fake P/D", 0.1)
        assert r.ttft_s >= r.prefill_s > 0


def test_lost_transfer_fails_the_kv_check(tmp_path: Path) -> None:
    with _pair(tmp_path, "request_id", fault="lose") as pair:
        run = PD.route_prompts(pair, PROMPTS)
    with pytest.raises(AssertionError, match="the KV never arrived"):
        PD.check_kv_came_from_producer(run, sum(len(p) - 1 for p in PROMPTS))


def test_wrong_routing_convention_fails_the_kv_check(tmp_path: Path) -> None:
    with _pair(tmp_path, "request_id", router_routing="shared_store") as pair:
        run = PD.route_prompts(pair, PROMPTS)
    with pytest.raises(AssertionError, match="saw 0 — the consumer computed"):
        PD.check_kv_came_from_producer(run, sum(len(p) - 1 for p in PROMPTS))


def test_corrupt_transfer_fails_the_baseline_comparison(tmp_path: Path) -> None:
    with _pair(tmp_path, "shared_store", fault="corrupt") as pair:
        run = PD.route_prompts(pair, PROMPTS)
    PD.check_kv_came_from_producer(run, sum(len(p) - 1 for p in PROMPTS))
    ref = _baseline(tmp_path)[0]
    with pytest.raises(AssertionError, match="position 0"):
        PD.check_same_as_baseline(ref, run.results[0].completion, "fake P/D", 0.1)


def test_block_size_mismatch_seen_at_runtime_is_named(tmp_path: Path) -> None:
    def srv(name: str, bs: str) -> VllmServer:
        return VllmServer("fake-model", log_path=tmp_path / f"{name}.log",
                          launcher=FAKE, env={"FAKE_PD_BLOCK_SIZE": bs},
                          exclusive_gpu=False)

    with srv("p", "16") as p, srv("c", "32") as c:
        with pytest.raises(PD.PDConfigError, match="check_block_sizes_match: the "
                           "producer serves KV blocks of 16 tokens, the consumer "
                           "of 32"):
            PD.check_block_sizes_match(p.client(), c.client())


def test_pair_is_not_started_when_the_static_check_fails(tmp_path: Path) -> None:
    s = PD.PDSettings(enabled=True)
    pair = PD.PDPair("fake-model", BASE, s, [], tmp_path / "logs", launcher=FAKE,
                     producer_args=["--block-size", "16"],
                     consumer_args=["--block-size", "32"])
    with pytest.raises(PD.PDConfigError, match="check_pd_compatible"):
        pair.start()
    assert pair.producer.pid is None and pair.consumer.pid is None
