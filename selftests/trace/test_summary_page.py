"""The summary page renders from a run folder: tiers, reasons, trace table, charts."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tvc.plugin import summary_page as sp
from tvc.trace import replay as tr

REPO = Path(__file__).resolve().parents[2]


def fake_run(mode: str, variant: str, base_ms: float, rng: random.Random
             ) -> dict:
    results = []
    for i in range(30):
        ttft = (base_ms + rng.expovariate(1 / (base_ms * 0.3))) / 1000
        r = tr.RequestResult(i, ok=True, prompt_tokens=700, output_tokens=32,
                             start_s=i * 0.1, ttft_s=ttft, e2e_s=ttft + 31 * 0.004,
                             tpot_s=0.004)
        results.append(r)
    before = {tr.METRIC_EXTERNAL_HITS: 0.0, tr.METRIC_LOCAL_HITS: 0.0}
    after = {tr.METRIC_EXTERNAL_HITS: 18000.0 if variant == "connector" else 0.0,
             tr.METRIC_LOCAL_HITS: 2100.0}
    return tr.RunResult(mode, variant, 3.2, results, before, after).figures()


def make_run_dir(root: Path) -> Path:
    rng = random.Random(3)
    run = root / "20261130-120000-example"
    (run / "trace").mkdir(parents=True)
    figs = {}
    for mode in tr.MODES:
        for variant, base in (("connector", 22.0), ("baseline", 61.0)):
            f = fake_run(mode, variant, base, rng)
            figs[variant, mode] = f
            tr.write_json(run / "trace" / f"{variant}-{mode}.json", f)
    gain = {"gain": {m: tr.ttft_gain(figs["baseline", m], figs["connector", m])
                     for m in ("interleave", "stream")}}
    tr.write_json(run / "trace" / "ttft.json", gain)

    def t(nodeid: str, outcome: str, tier: str, msg: str = "", **props: object
          ) -> dict:
        return {"nodeid": nodeid, "outcome": outcome, "duration_s": 0.1,
                "tiers": [tier], "properties": props, "message": msg}

    gpu_skip = ("no CUDA GPU: nvidia-smi not found on PATH. Fix: run this tier on a "
                "GPU host.")
    per_size = {str(s): {"median_gbps": g, "min_gbps": g * 0.9, "max_gbps": g * 1.1}
                for s, g in ((262144, 2.1), (1048576, 4.8), (4194304, 6.9),
                             (16777216, 7.6), (67108864, 7.8))}
    read = {k: {kk: vv * 1.3 for kk, vv in v.items()} for k, v in per_size.items()}
    (run / "bandwidth.json").write_text(json.dumps({
        "write": per_size, "read": read, "threshold_gbps": 7.0,
        "tier": "one disk (graded: 7 GB/s)", "refs": {}}))
    summary = {
        "run": {"started_utc": "2026-11-30T12:00:00Z", "args": "-m 'not contract'",
                "exit_status": 1, "outcome": "failed", "duration_s": 412.5,
                "seed": 1234, "seed_source": "random",
                "xdist": "xdist: --dist load: tests that own a GPU server, daemon or "
                         "store run one after another on one worker "
                         "(tvc-gpu-owners); the others are load-balanced"},
        "deselected": [
            {"tier": "contract", "count": 24, "why": "[cpu] worker variants: "
             "connector.worker_devices = ['cuda']"},
            {"tier": "contract", "count": 40, "why": "-m 'not contract'"},
            {"tier": "level2", "count": 1, "why": "-m 'not contract'"}],
        "profile": {"name": "example", "connector": "ExampleConnector",
                    "source": "/work/profiles/example.toml"},
        "versions": {"vllm": "0.26.0", "vllm_location": "/root/vllm-bundle/site/vllm",
                     "torch": "2.11.0+cu130", "python": "3.12.3"},
        "hardware": {"gpus": [{"name": "NVIDIA H200"}], "levels": {
            "any": True, "gpu": True, "nvme": False}},
        "counts": {"passed": 5, "failed": 1, "skipped": 3, "error": 0},
        "tests": [
            t("suites/level1/test_vllm_install.py::test_vllm_imports", "passed",
              "level1"),
            t("suites/level1/test_vllm_install.py::test_torch_matches_vllm_pin",
              "failed", "level1", "torch 2.13.0 installed, vLLM pins 2.11.0: "
              "reinstall torch==2.11.0"),
            t("suites/e2e/test_two_pass.py::test_second_pass_hits", "passed", "e2e"),
            t("suites/bandwidth/test_store.py::test_read[1]", "passed", "bandwidth",
              read_gbps=6.4, threshold_gbps=7.0),
            t("suites/bandwidth/test_store.py::test_write[1]", "passed", "bandwidth",
              write_gbps=7.9),
            t("suites/real_nvme/test_pool.py::test_a", "skipped", "real_nvme",
              gpu_skip),
            t("suites/real_nvme/test_pool.py::test_b", "skipped", "real_nvme",
              gpu_skip),
            t("suites/trace/test_replay_modes.py::test_populate[connector]",
              "passed", "trace"),
            t("selftests/x.py::test_y", "skipped", "", "not on this box"),
        ],
    }
    summary["tests"][-1]["tiers"] = []
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_page_renders_tiers_reasons_trace_and_bandwidth(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run = make_run_dir(tmp_path)
    out = sp.write_page(run)
    assert set(out) == {"markdown", "html", "ttft", "bandwidth"}
    md = out["markdown"].read_text()
    assert md.startswith("# Conformance run: FAIL")
    assert "| level1 | 1 | 1 | 0 | 0 | 0 | 0 |" in md
    assert "| real_nvme | 0 | 0 | 0 | 0 | 2 | 0 |" in md  # passed..not_run columns
    assert "| other | 0 | 0 | 0 | 0 | 1 | 0 |" in md
    assert "`test_torch_matches_vllm_pin`: torch 2.13.0 installed" in md
    assert "`test_a` and `test_b` (2 tests): no CUDA GPU" in md  # merged, all named
    assert "- **profile file**: /work/profiles/example.toml" in md
    assert "interleave: TTFT p50" in md and "![TTFT CDF](charts/ttft_cdf.png)" in md
    assert "| 4 MiB | 6.90 | 8.97 |" in md  # from bandwidth.json, not properties
    assert "![bandwidth](charts/bandwidth.png)" in md
    assert "- **seed**: 1234 (random; rerun with --tvc-seed=1234)" in md
    assert "- **xdist**: --dist load: tests that own a GPU server" in md
    assert ("- **deselected**: contract 24 ([cpu] worker variants: "
            "connector.worker_devices = ['cuda']); level2 1, contract 40 "
            "(-m 'not contract')") in md
    page = out["html"].read_text()
    assert page.count("data:image/png;base64,") == 2
    assert "<span class='badge FAIL'>FAIL</span>" in page
    assert "<code>test_a</code> and <code>test_b</code> (2 tests): no CUDA" in page
    assert "/work/profiles/example.toml" in page
    for png in (out["ttft"], out["bandwidth"]):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bw = sp.bandwidth_figures(json.loads((run / "summary.json").read_text()))
    assert [(b["name"], b["limit"]) for b in bw] == [
        ("read_gbps", False), ("threshold_gbps", True), ("write_gbps", False)]


def test_page_embeds_the_bandwidth_tiers_own_chart(tmp_path: Path) -> None:
    run = make_run_dir(tmp_path)
    png = run / "bandwidth.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n tier's own chart")
    out = sp.write_page(run)
    assert out["bandwidth"] == png  # embedded as it is, not redrawn
    assert not (run / "charts" / "bandwidth.png").exists()
    assert "![bandwidth](bandwidth.png)" in out["markdown"].read_text()
    import base64

    assert base64.b64encode(png.read_bytes()).decode() in out["html"].read_text()


def test_page_without_matplotlib_says_so_once(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import -> ImportError
    run = make_run_dir(tmp_path)
    notes: list[str] = []
    out = sp.write_page(run, notes)
    assert set(out) == {"markdown", "html"}
    assert notes == [sp.NO_MATPLOTLIB]
    assert out["markdown"].read_text().count("matplotlib is not installed") == 1
    assert "| 4 MiB | 6.90 | 8.97 |" in out["markdown"].read_text()  # table stays


def test_page_without_trace_or_bandwidth_has_no_charts(tmp_path: Path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({
        "run": {}, "counts": {"passed": 2}, "tests": [
            {"nodeid": "a::t1", "outcome": "passed", "tiers": ["level1"]},
            {"nodeid": "a::t2", "outcome": "passed", "tiers": ["level1"]}]}))
    out = sp.write_page(run)
    assert set(out) == {"markdown", "html"}
    assert "# Conformance run: PASS" in out["markdown"].read_text()
    assert not (run / "charts").exists()


def test_cli_writes_the_page_and_refuses_a_folder_without_summary(tmp_path: Path
                                                                  ) -> None:
    run = make_run_dir(tmp_path)
    ok = subprocess.run([sys.executable, "-m", "tvc.plugin.summary_page", str(run)],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "html: " in ok.stdout and (run / "summary.html").is_file()
    bad = subprocess.run([sys.executable, "-m", "tvc.plugin.summary_page",
                          str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "no summary.json here" in bad.stderr


def test_merged_reasons_name_every_test_they_cover(tmp_path: Path) -> None:
    """Tests sharing a reason are listed by name, not hidden behind the first one."""
    reason = ("CUDA_HOME is not set and no nvcc is on PATH. Fix: install the CUDA "
              "toolkit and set CUDA_HOME.")
    names = ["test_cuda_home_has_nvcc", "test_nvcc_matches_torch_cuda",
             "test_nvcc_compiles_cub_with_cxx17"]
    many = [f"test_many_{i}" for i in range(sp.NAMES_SHOWN + 3)]
    tests = [{"nodeid": f"suites/level1/test_build_preflight.py::{n}",
              "outcome": "skipped", "tiers": ["level1"], "message": reason}
             for n in names]
    tests += [{"nodeid": f"suites/e2e/test_x.py::{n}", "outcome": "failed",
               "tiers": ["e2e"], "message": "same failure"} for n in many]
    run = tmp_path / "r"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({
        "run": {}, "profile": {"name": "p", "source": "/x/p.toml"},
        "counts": {"skipped": 3, "failed": len(many)}, "tests": tests}))
    out = sp.write_page(run)
    md = out["markdown"].read_text()
    assert ("`test_cuda_home_has_nvcc`, `test_nvcc_matches_torch_cuda` and "
            "`test_nvcc_compiles_cub_with_cxx17` (3 tests): CUDA_HOME is not set"
            ) in md
    shown = ", ".join(f"`{n}`" for n in many[:sp.NAMES_SHOWN])
    assert f"{shown} and 3 more ({len(many)} tests): same failure" in md
    page = out["html"].read_text()
    for n in names + many[:sp.NAMES_SHOWN]:
        assert f"<code>{n}</code>" in page, n
    assert "and 3 more" in page
    assert sp.name_list(["a"]) == "`a`"
    assert sp.name_list(["a", "b"], quote=str) == "a and b"
    assert sp.name_list(["a", "b", "c"], limit=2, quote=str) == "a, b and 1 more"


def test_an_interrupted_run_is_not_called_a_pass() -> None:
    from tvc.plugin.summary_page import verdict

    interrupted = {"run": {"exit_status": 2},
                   "counts": {"passed": 3, "failed": 0, "skipped": 1, "error": 0,
                              "not_run": 1}}
    word, why = verdict(interrupted)
    assert word == "INCOMPLETE" and "interrupted" in why and "1 test(s)" in why
    clean = {"run": {"exit_status": 0},
             "counts": {"passed": 3, "failed": 0, "skipped": 1, "error": 0}}
    assert verdict(clean)[0] == "PASS"


def test_files_of_an_earlier_run_in_a_reused_folder_are_left_out(tmp_path: Path
                                                                 ) -> None:
    """A reused run folder still holds the earlier run's trace and bandwidth files;
    they must not show as this run's figures."""
    import os
    import time

    run = make_run_dir(tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    summary["run"]["started_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                  time.gmtime())
    (run / "summary.json").write_text(json.dumps(summary))
    old = time.time() - 3600
    for f in [*(run / "trace").glob("*.json"), run / "bandwidth.json"]:
        os.utime(f, (old, old))
    data = sp.load_run(run)
    assert data["trace"] == {} and data["gain"] == {} and data["bandwidth_run"] == {}
    assert "trace/ttft.json" in data["stale"] and "bandwidth.json" in data["stale"]
    md = sp.write_page(run)["markdown"].read_text()
    assert "older than this run" in md and "| 4 MiB |" not in md
