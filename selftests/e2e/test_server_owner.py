"""Self-tests of tvc/procs/vllm_server.py against a fake server (no GPU, no vLLM)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tvc.procs.client import (
    CACHE_CONFIG_INFO_METRIC,
    EXTERNAL_HITS_METRIC,
    PREFIX_HITS_METRIC,
    PROMPT_TOKENS_BY_SOURCE_METRIC,
    REQUEST_SUCCESS_METRIC,
    ServerError,
    parse_metrics,
)
from tvc.procs.vllm_server import VllmServer, free_port

pytestmark = pytest.mark.hw_any

HERE = Path(__file__).resolve().parent
FAKE = HERE / "fake_vllm_server.py"
SAMPLE = HERE / "data" / "vllm_metrics_sample.txt"
REPO = HERE.parent.parent


def fake_server(tmp_path: Path, mode: str, **kw) -> VllmServer:
    env = {"FAKE_VLLM_MODE": mode, "FAKE_VLLM_PIDS": str(tmp_path / "pids.json"),
           "FAKE_VLLM_ARGV": str(tmp_path / "argv.json"),
           "FAKE_VLLM_METRICS": str(SAMPLE), **kw.pop("env", {})}
    kw.setdefault("startup_timeout_s", 30)
    kw.setdefault("stop_timeout_s", 5)
    return VllmServer(tmp_path / "model", launcher=[sys.executable, str(FAKE)],
                      kv_transfer_config={"kv_connector": "ExampleConnector",
                                          "kv_role": "kv_both"},
                      serve_args=["--enforce-eager", "--max-model-len", "2048"],
                      log_path=tmp_path / "logs" / "server.log", env=env, **kw)


def pids(tmp_path: Path, wait_s: float = 10) -> dict[str, int]:
    path = tmp_path / "pids.json"
    deadline = time.monotonic() + wait_s
    while not path.is_file() or not path.read_text():
        assert time.monotonic() < deadline, "fake server never wrote its pids"
        time.sleep(0.05)
    return json.loads(path.read_text())


def gone(pid: int, wait_s: float = 5) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_server_that_dies_early_fails_at_once_with_log_tail(tmp_path):
    srv = fake_server(tmp_path, "die", startup_timeout_s=120)
    t0 = time.monotonic()
    with pytest.raises(ServerError) as exc, srv:
        pass
    assert time.monotonic() - t0 < 15, "a dead server must fail at once, not time out"
    msg = str(exc.value)
    assert "exited with code 3" in msg
    assert "CUDA out of memory (fake)" in msg  # the log tail is in the message
    assert str(srv.log_path) in msg
    assert gone(pids(tmp_path)["child"]) and srv.leftovers() == []


def test_memory_profiling_race_is_named_as_not_the_connector(tmp_path):
    srv = fake_server(tmp_path, "die-profiling", startup_timeout_s=120)
    with pytest.raises(ServerError) as exc, srv:
        pass
    msg = str(exc.value)
    assert "another process released GPU memory" in msg and "not the connector" in msg
    assert "Error in memory profiling" in msg  # vLLM's own line stays in the message


def test_server_that_never_answers_health_times_out(tmp_path):
    srv = fake_server(tmp_path, "hang", startup_timeout_s=2)
    with pytest.raises(ServerError, match=r"did not answer .*/health within 2 s"):
        srv.start()
    p = pids(tmp_path)
    assert gone(p["server"]) and gone(p["child"]) and srv.leftovers() == []


def test_healthy_server_passes_argv_env_and_serves_the_client(tmp_path):
    with fake_server(tmp_path, "healthy", env={"FAKE_VLLM_DELAY_S": "1"}) as srv:
        assert srv.is_alive() and srv.startup_s >= 1.0
        seen = json.loads((tmp_path / "argv.json").read_text())
        argv = seen["argv"]
        assert argv[argv.index("--port") + 1] == str(srv.port)
        cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert cfg == {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
        assert argv[-3:] == ["--enforce-eager", "--max-model-len", "2048"]
        assert seen["env"]["VLLM_SERVER_DEV_MODE"] == "1"
        assert seen["env"]["HF_HUB_OFFLINE"] == "1"
        assert seen["cwd"] == str(srv.log_path.parent)
        c = srv.client()
        assert c.model == str(tmp_path / "model")
        prompt = [5, 6, 7, 8]
        want = [(26 + i) % 97 + 3 for i in range(16)]
        out = c.complete(prompt, max_tokens=16, logprobs=2)
        assert out.token_ids == want and out.ttft_s is None
        assert out.top_logprobs[0] == {want[0]: -0.5, want[0] + 1: -1.5}
        st = c.complete_streaming(prompt, max_tokens=16, logprobs=2)
        assert st.token_ids == want and st.prompt_token_ids == prompt
        assert st.top_logprobs == out.top_logprobs
        assert 0 < st.ttft_s < st.latency_s
        assert c.metrics().value(EXTERNAL_HITS_METRIC) == 592
        assert c.block_size() == 16
        c.reset_prefix_cache()
        p = pids(tmp_path)
    assert gone(p["server"]) and gone(p["child"]) and srv.leftovers() == []
    assert "stopped (exit" in srv.log_path.read_text()


def test_teardown_kills_a_server_that_ignores_sigterm(tmp_path):
    with fake_server(tmp_path, "ignore-term", stop_timeout_s=1) as srv:
        p = pids(tmp_path)
    assert gone(p["server"]) and gone(p["child"]) and srv.leftovers() == []


def test_restart_gives_a_new_process_on_a_new_port(tmp_path):
    with fake_server(tmp_path, "healthy") as srv:
        old_pid, old_port = srv.pid, srv.port
        srv.restart()
        assert srv.is_alive() and srv.pid != old_pid and srv.port != old_port
        assert srv.client().metrics().has(REQUEST_SUCCESS_METRIC)
    assert gone(old_pid) and srv.leftovers() == []


INNER = textwrap.dedent("""\
    import os, sys, time
    from pathlib import Path
    import pytest
    from tvc.procs.vllm_server import VllmServer

    TMP = Path(os.environ["INNER_TMP"])

    @pytest.fixture(scope="module")
    def server():
        srv = VllmServer(TMP / "model", launcher=[sys.executable, os.environ["FAKE"]],
                         log_path=TMP / "server.log", stop_timeout_s=3,
                         startup_timeout_s=60)
        with srv:
            yield srv

    @pytest.mark.hw_any
    def test_fails(server):
        assert server.is_alive()
        if os.environ.get("INNER_MODE") == "interrupt":
            raise KeyboardInterrupt
        assert False, "deliberate failure"
    """)


@pytest.mark.parametrize("mode", ["fail", "interrupt", "sigint-during-start"])
def test_no_process_outlives_a_failed_or_interrupted_run(tmp_path, mode):
    test_file = REPO / "selftests" / "e2e" / f"_inner_{os.getpid()}_{mode}_test.py"
    test_file.write_text(INNER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env |= {"INNER_TMP": str(tmp_path), "FAKE": str(FAKE), "INNER_MODE": mode,
            "FAKE_VLLM_PIDS": str(tmp_path / "pids.json"),
            "FAKE_VLLM_MODE": "hang" if mode == "sigint-during-start" else "healthy"}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", str(test_file), "-p", "no:cacheprovider",
             "--tvc-report-dir", str(tmp_path / "report"), "-q"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)
        if mode == "sigint-during-start":
            pids(tmp_path, wait_s=60)
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        test_file.unlink()
    p = pids(tmp_path)
    assert proc.returncode in (1, 2), out[-3000:]  # 1 failed, 2 interrupted
    if mode == "fail":
        assert "deliberate failure" in out
    assert gone(p["server"]), f"server pid {p['server']} outlived the run\n{out}"
    assert gone(p["child"]), f"grandchild pid {p['child']} outlived the run\n{out}"


def _ports(n: int, q) -> None:
    q.put([free_port() for _ in range(n)])


def test_free_ports_are_distinct_across_calls_and_processes():
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ports, args=(20, q)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [free_port() for _ in range(20)] + q.get(timeout=60) + q.get(timeout=60)
    for p in procs:
        p.join(timeout=60)
    assert len(got) == 60 and len(set(got)) == 60, sorted(got)


def test_metrics_sample_parses_to_the_counters_the_e2e_tier_reads():
    snap = parse_metrics(SAMPLE.read_text())
    assert snap.value(EXTERNAL_HITS_METRIC) == 592
    assert snap.value(PREFIX_HITS_METRIC) == 0 and snap.has(PREFIX_HITS_METRIC)
    assert snap.value(PROMPT_TOKENS_BY_SOURCE_METRIC,
                      source="external_kv_transfer") == 592
    assert snap.value(PROMPT_TOKENS_BY_SOURCE_METRIC, source="local_compute") == 608
    assert snap.value(REQUEST_SUCCESS_METRIC) == 2
    assert snap.labels(CACHE_CONFIG_INFO_METRIC)[0]["block_size"] == "16"
    assert not snap.has("vllm:no_such_metric")


def test_metrics_in_the_older_exposition_style_parse_the_same():
    text = textwrap.dedent("""\
        # HELP vllm:external_prefix_cache_hits External prefix cache hits.
        # TYPE vllm:external_prefix_cache_hits counter
        vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 576.0
        vllm:external_prefix_cache_hits_created{engine="0",model_name="m"} 1.7e+09
        # HELP vllm:prompt_tokens_by_source Number of prompt tokens by source.
        # TYPE vllm:prompt_tokens_by_source counter
        vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} 576.0
        vllm:prompt_tokens_by_source_total{source="local_compute"} 17.0
        """)
    snap = parse_metrics(text)
    assert snap.value(EXTERNAL_HITS_METRIC) == 576
    assert snap.value(PROMPT_TOKENS_BY_SOURCE_METRIC,
                      source="external_kv_transfer") == 576


def test_a_relative_model_path_reaches_the_server_absolute(tmp_path, monkeypatch):
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    srv = VllmServer("models/tiny", log_path=tmp_path / "logs" / "s.log")
    argv = srv.build_argv(1234)
    assert argv[argv.index("--model") + 1] == str(tmp_path / "models" / "tiny")
    assert VllmServer("org/hub-name", log_path=tmp_path / "s.log").model == (
        "org/hub-name")  # not a local path: as given


def test_starting_a_server_parks_the_running_one(tmp_path):
    a = fake_server(tmp_path / "a", "healthy")
    b = fake_server(tmp_path / "b", "healthy")
    side = fake_server(tmp_path / "c", "healthy", exclusive_gpu=False)
    for d in ("a", "b", "c"):
        (tmp_path / d).mkdir()
    try:
        a.start()
        side.start()
        b.start()
        assert b.is_alive() and not a.is_alive() and a.parked_by is b
        assert side.is_alive()  # not an exclusive GPU server: left alone
        assert "parked: one vLLM server per GPU at a time" in a.log_path.read_text()
        assert a.ensure_running() is True
        assert a.is_alive() and not b.is_alive() and b.parked_by is a
        assert a.ensure_running() is False
    finally:
        for srv in (a, b, side):
            srv.stop()
    assert a.leftovers() == b.leftovers() == side.leftovers() == []


def test_hit_log_level_sets_vllms_logging_level_on_connector_servers(tmp_path,
                                                                     monkeypatch):
    import tvc.fixtures.vllm as fv
    from tvc.config.profile import load

    text = (REPO / "tvc" / "data" / "profiles" / "example.toml").read_text().replace(
        'hit_log_pattern = "External Cache Hit!"',
        'hit_log_pattern = "External Cache Hit!"\nhit_log_level = "DEBUG"')
    (tmp_path / "p.toml").write_text(text)
    prof = load(str(tmp_path / "p.toml"), env={})
    monkeypatch.setattr(fv, "run_log_dir",
                        lambda config, profile=None: tmp_path / "logs")
    srv = fv.server_from_profile(None, tmp_path / "m", profile=prof)
    assert srv.env_overrides["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert srv.build_env()["VLLM_LOGGING_LEVEL"] == "DEBUG"
    mine = fv.server_from_profile(None, tmp_path / "m", profile=prof,
                                  env={"VLLM_LOGGING_LEVEL": "INFO"})
    assert mine.env_overrides["VLLM_LOGGING_LEVEL"] == "INFO"
    base = fv.server_from_profile(None, tmp_path / "m", profile=prof,
                                  kv_transfer_config=None)
    assert "VLLM_LOGGING_LEVEL" not in base.env_overrides
