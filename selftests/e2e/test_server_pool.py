"""Self-tests of tvc/procs/pool.py (the server pool) on fake servers (no GPU, no vLLM).

Concurrency is asserted as overlap of start spans (each fake start takes
``FAKE_VLLM_DELAY_S``), never as milliseconds of wall time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tvc.core.timeline import Timeline, build, critical_path
from tvc.procs import pool as pl
from tvc.procs.client import ServerError
from tvc.procs.vllm_server import VllmServer

pytestmark = pytest.mark.hw_any

HERE = Path(__file__).resolve().parent
FAKE = HERE / "fake_vllm_server.py"
REPO = HERE.parent.parent
GiB = pl.GiB
DELAY_S = 1.5  # each fake server's start (sleep before /health answers)


def fake(tmp_path: Path, name: str, mode: str = "healthy", delay: float = DELAY_S,
         args: tuple[str, ...] = (), **kw) -> VllmServer:
    env = {"FAKE_VLLM_MODE": mode, "FAKE_VLLM_DELAY_S": str(delay),
           "FAKE_VLLM_PIDS": str(tmp_path / f"pids-{name}.json"),
           "FAKE_VLLM_ARGV": str(tmp_path / f"argv-{name}.json"), **kw.pop("env", {})}
    return VllmServer(tmp_path / "model", launcher=[sys.executable, str(FAKE)],
                      serve_args=["--max-model-len", "2048", "--seed", name, *args],
                      log_path=tmp_path / "logs" / f"{name}.log", env=env,
                      startup_timeout_s=30, stop_timeout_s=5, exclusive_gpu=False,
                      name=name, **kw)


def gpu(index: int = 0, gib: float = 20) -> pl.Gpu:
    return pl.Gpu(index, int(gib * GiB), int(gib * GiB / pl.GPU_FREE_FRACTION))


def need_gib(gib: float, gpus: int = 1, whole: bool = False, cpu_gib: float = 0):
    return lambda srv: pl.Need(gpus=gpus, kv_bytes=int(gib * GiB), weight_bytes=0,
                               overhead_bytes=0, cpu_bytes=int(cpu_gib * GiB),
                               whole_gpu=whole)


def spans(pool: pl.ServerPool) -> dict[str, dict]:
    return {r["name"]: r for r in pool.timeline.as_dict()["servers"]}


def overlap(a: dict, b: dict) -> bool:
    return a["start"] < b["ready"] and b["start"] < a["ready"]


def test_specs_start_together_and_each_gets_its_gpu_and_kv_size(tmp_path):
    pool = pl.ServerPool([gpu(0), gpu(1)], max_starting=4, need=need_gib(4))
    servers = [pool.register(fake(tmp_path, f"s{i}")) for i in range(4)]
    try:
        pool.prestart()
        for srv in servers:
            srv.start()  # waits for the background start
        rec = spans(pool)
        starts = [rec[f"s{i}"] for i in range(4)]
        assert all(r["ready"] for r in starts), rec
        # every start overlaps every other: they ran together, not one by one
        assert all(overlap(a, b) for a in starts for b in starts if a is not b), rec
        placed = []
        for i in range(4):
            seen = json.loads((tmp_path / f"argv-s{i}.json").read_text())
            argv, env = seen["argv"], seen["env"]
            assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(4 * GiB)
            share = float(argv[argv.index("--gpu-memory-utilization") + 1])
            assert 0 < share <= 0.2, share  # 4 GiB of a ~21.7 GiB GPU, rounded up
            placed.append(env["CUDA_VISIBLE_DEVICES"])
            assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert sorted(placed) == ["0", "0", "1", "1"], placed  # spread over GPUs
    finally:
        assert pool.close() == []


def test_two_tests_of_one_spec_share_one_server(tmp_path):
    pool = pl.ServerPool([gpu()], need=need_gib(1))
    a = pool.register(fake(tmp_path, "same"), users=["t1"])
    b = pool.register(fake(tmp_path, "same"), users=["t2"])  # same spec again
    other = pool.register(fake(tmp_path, "other"), users=["t3"])
    assert a is b and a is not other
    try:
        a.start()
        pid = a.pid
        b.start()  # the second test: no second process
        assert b.pid == pid and len(pool.servers()) == 2
        assert not pool.release(a, "t1")  # t2 still planned: stays up
        assert a.is_alive()
        assert pool.release(b, "t2")  # the last user: stopped
        assert not a.is_alive()
    finally:
        pool.close()


def test_memory_budget_queues_what_does_not_fit_and_refuses_what_never_fits(
        tmp_path):
    pool = pl.ServerPool([gpu(0, 10)], need=need_gib(6), max_starting=4)
    first = pool.register(fake(tmp_path, "first"))
    second = pool.register(fake(tmp_path, "second"))
    try:
        pool.prestart()
        first.start()
        time.sleep(DELAY_S + 1.0)
        rec = spans(pool)
        assert rec["second"]["queued"] and not rec["second"].get("start"), rec
        assert pool.gpus[0].used_bytes == 6 * GiB  # only one 6 GiB server on 10 GiB
        first.stop()  # frees 6 GiB: the queued one starts now
        second.start()
        rec = spans(pool)
        assert rec["second"]["start"] >= rec["first"]["stop"], rec
    finally:
        pool.close()
    big = pl.ServerPool([gpu(0, 10)], need=need_gib(12))
    srv = big.register(fake(tmp_path, "huge"))
    with pytest.raises(ServerError) as exc:
        srv.start()
    msg = str(exc.value)
    assert "huge cannot start" in msg and "12.0 GiB per GPU" in msg, msg
    assert "largest free share of a GPU is 10.0 GiB" in msg, msg
    assert not srv.is_alive()
    cpu = pl.ServerPool([gpu(0, 10)], host_bytes=2 * GiB, need=need_gib(1, cpu_gib=4))
    srv = cpu.register(fake(tmp_path, "cpu-hungry"))
    with pytest.raises(ServerError, match="cpu_bytes_to_use = 4.0 GiB"):
        srv.start()
    tp = pl.ServerPool([gpu(0)], need=need_gib(1, gpus=2))
    srv = tp.register(fake(tmp_path, "tp2"))
    with pytest.raises(ServerError, match="needs 2 GPUs"):
        srv.start()


def test_a_whole_gpu_server_runs_alone(tmp_path):
    needs = {"alone": need_gib(1, whole=True)(None), "small": need_gib(1)(None)}
    pool = pl.ServerPool([gpu(0, 20)], need=lambda s: needs[s.name.split("-")[0]],
                         max_starting=4)
    small = pool.register(fake(tmp_path, "small"))
    alone = pool.register(fake(tmp_path, "alone"))
    small2 = pool.register(fake(tmp_path, "small-b"))
    try:
        small.start()
        alone.start_in_background()
        time.sleep(1.0)
        assert spans(pool)["alone"]["queued"] and not spans(pool)["alone"]["start"]
        small.stop()
        alone.start()
        small2.start_in_background()
        time.sleep(DELAY_S + 1.0)
        assert not spans(pool)["small-b"]["start"], "shared the whole-GPU server's GPU"
        alone.stop()
        small2.start()
        assert spans(pool)["small-b"]["start"] >= spans(pool)["alone"]["stop"]
    finally:
        pool.close()


def test_a_server_that_dies_during_start_names_its_spec_and_others_live(tmp_path):
    pool = pl.ServerPool([gpu()], need=need_gib(1))
    good = pool.register(fake(tmp_path, "good"))
    bad = pool.register(fake(tmp_path, "bad", mode="die", delay=0))
    try:
        pool.prestart()
        with pytest.raises(ServerError) as exc:
            bad.start()
        msg = str(exc.value)
        assert msg.startswith("server bad:"), msg
        assert "exited with code 3" in msg and "CUDA out of memory (fake)" in msg
        good.start()
        assert good.is_alive() and good.client().complete([5, 6, 7], max_tokens=2).ok
        assert spans(pool)["bad"]["error"]
        assert pool.gpus[0].used_bytes == 1 * GiB  # the dead one's share is back
    finally:
        pool.close()


def test_idle_prestarted_server_is_stopped_to_make_room_for_a_waiting_test(
        tmp_path):
    pool = pl.ServerPool([gpu(0, 10)], need=need_gib(6), max_starting=4)
    later = pool.register(fake(tmp_path, "later"), order=5)
    now = pool.register(fake(tmp_path, "now"), order=9)
    try:
        later.start_in_background()
        while not spans(pool).get("later", {}).get("ready"):
            time.sleep(0.1)
        now.start()  # a test waits on it (main thread): 'later' is idle, unclaimed
        assert now.is_alive() and not later.is_alive()
        assert "stopped by the pool to make room" in later.log_text()
        later.start()  # needed after all: started again when asked
    finally:
        pool.close()


def test_timeline_names_the_server_the_run_waited_on(tmp_path):
    tl = Timeline()
    pool = pl.ServerPool([gpu()], need=need_gib(1), timeline=tl)
    srv = pool.register(fake(tmp_path, "slow", delay=2.0))
    try:
        pool.prestart()
        srv.start()
    finally:
        pool.close()
    tl.write(tmp_path / "timeline", "main")
    data = build([{"test": "t::a", "lane": "main", "start": time.time() - 1,
                   "end": time.time(), "outcome": "passed"}], tmp_path / "timeline")
    assert data["waits"] and data["waits"][0]["server"] == "slow"
    text = " ".join(critical_path(data))
    assert "waited" in text and "on server slow start" in text, text


def test_parse_gpus_values():
    assert pl.parse_gpus("all") is None
    assert pl.parse_gpus("0,1") == [0, 1]
    for bad in ("", "gpu0", "0,,1", "1,1", "-1"):
        with pytest.raises(ValueError):
            pl.parse_gpus(bad)


def test_kv_size_from_the_models_bytes_per_token(tmp_path):
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "hidden_size": 256, "torch_dtype": "float16", "vocab_size": 512,
           "intermediate_size": 512, "max_position_embeddings": 2048}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert pl.kv_bytes_per_token(tmp_path) == 2 * 4 * 2 * 64 * 2
    assert pl.kv_cache_bytes(tmp_path, ["--max-model-len", "2048"]) == 2 * GiB
    big = pl.kv_cache_bytes(tmp_path, ["--max-model-len", "131072"])
    assert big == 2048 * 131072 * pl.KV_CACHE_SEQUENCES
    assert pl.kv_cache_bytes(tmp_path, ["--kv-cache-memory-bytes", "3G"]) == 3 * GiB
    assert pl.tensor_parallel_size(["--tensor-parallel-size", "2"]) == 2
    assert pl.cpu_buffer_bytes({"kv_connector_extra_config": {
        "cpu_bytes_to_use": 1 << 30}}) == 1 << 30
    with pytest.raises(ServerError, match="--kv-cache-memory-bytes 'lots'"):
        pl.kv_cache_bytes(tmp_path, ["--kv-cache-memory-bytes", "lots"])


def test_ctrl_c_tears_every_server_down(tmp_path):
    """SIGINT to a process whose pool is starting servers: no process survives."""
    script = tmp_path / "run_pool.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        sys.path.insert(0, {str(HERE)!r})
        from pathlib import Path
        from test_server_pool import fake, gpu, need_gib
        from tvc.procs import pool as pl
        tmp = Path({str(tmp_path)!r})
        pool = pl.ServerPool([gpu()], need=need_gib(1), max_starting=4)
        servers = [pool.register(fake(tmp, f"c{{i}}", delay=2 if i < 2 else 60))
                   for i in range(4)]
        try:
            pool.prestart()
            servers[0].start()
            print("READY", flush=True)
            time.sleep(120)
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
        finally:
            pool.close()
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            text=True, cwd=tmp_path)
    try:
        assert proc.stdout.readline().strip() == "READY"
        pids = []
        for i in range(4):
            path = tmp_path / f"pids-c{i}.json"
            deadline = time.monotonic() + 20
            while not (path.is_file() and path.read_text()):
                assert time.monotonic() < deadline, f"server c{i} never started"
                time.sleep(0.05)
            pids += list(json.loads(path.read_text()).values())
        assert all(psutil.pid_exists(p) for p in pids)
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert "INTERRUPTED" in out
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    assert not alive, f"processes outlived Ctrl-C: {alive}"


def test_background_starts_go_first_needed_first(tmp_path):
    pool = pl.ServerPool([gpu()], need=need_gib(1), max_starting=1)
    for name, order in (("third", 2), ("first", 0), ("second", 1)):
        pool.register(fake(tmp_path, name, delay=0.5), order=order)
    try:
        pool.prestart()
        for srv in pool.servers():
            srv.start()
        rec = spans(pool)
        assert rec["first"]["ready"] <= rec["second"]["start"], rec
        assert rec["second"]["ready"] <= rec["third"]["start"], rec
    finally:
        pool.close()


def test_query_gpus_reads_nvidia_smi_and_honours_cuda_visible_devices(
        tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, 100000, 143771'\necho '1, 50000, 143771'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpus = pl.query_gpus()
    assert [g.index for g in gpus] == [0, 1]
    assert gpus[0].capacity_bytes == int(100000 * (1 << 20) * pl.GPU_FREE_FRACTION)
    assert gpus[1].total_bytes == 143771 * (1 << 20)
    assert [g.index for g in pl.query_gpus([1])] == [1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert [g.index for g in pl.query_gpus()] == [1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-3f2a")
    assert pl.query_gpus() == []  # by UUID: no placement by index, no pool


def test_critical_path_keeps_each_lanes_server_of_one_name_apart():
    """Two lanes' pools each start a 'vllm-server': their waits are not one server's."""
    servers = [{"name": "vllm-server", "server": "vllm-server", "worker": w,
                "queued": None, "start": 10.0, "ready": 10.0 + r}
               for w, r in (("gw1", 30.0), ("gw4", 50.0))]
    waits = [{"test": f"t::{w}", "server": "vllm-server", "worker": w,
              "start": 10.0, "end": 10.0 + r} for w, r in (("gw1", 30.0),
                                                           ("gw4", 50.0))]
    text = " ".join(critical_path({"start": 0.0, "end": 70.0, "servers": servers,
                                   "waits": waits, "tests": []}))
    assert ("the run waited 50.0 s on server vllm-server start in lane gw4 "
            "(queued 0.0 s, start to ready 50.0 s); 80.0 s on server starts in "
            "all") in text, text
