"""The server pool through the real fixtures (tvc/fixtures/vllm.py), fake servers.

A pytest run of selftests/e2e/pool_target/pool_target.py with
selftests/e2e/fake_pool_plugin.py: the session's baseline and connector servers
and the module's planned factory servers must start together when the first test
is set up, two tests of one spec share one process, and the run folder gets the
timeline with every server's start, ready and stop.
"""

from __future__ import annotations

import json

import pytest

from selftests.conftest import run_suite

pytestmark = pytest.mark.hw_any

TARGET = "selftests/e2e/pool_target/pool_target.py"


def test_fixtures_prestart_the_planned_servers_together_and_share_a_spec(tmp_path):
    run = run_suite([TARGET, "-p", "selftests.e2e.fake_pool_plugin",
                     "--tvc-parallel-starts=4"],
                    tmp_path / "report", env={"FAKE_VLLM_DELAY_S": "3"})
    assert run.rc == 0, run.stdout[-3000:]
    tl = json.loads((tmp_path / "report" / "timeline.json").read_text())
    recs = {s["name"]: s for s in tl["servers"]}
    want = {"vllm-baseline", "vllm-server", "vllm-extra-1", "vllm-extra-2"}
    assert want <= set(recs), sorted(recs)
    assert len(recs) == 4, f"a spec started twice: {sorted(recs)}"  # shared
    first = [recs[n] for n in want]
    assert all(r["start"] and r["ready"] and r["stop"] for r in first), first
    # planned at the first test's set-up: every start began before any was ready
    assert max(r["start"] for r in first) < min(r["ready"] for r in first), first
    assert {r["gpus"] for r in first} == {"0", "1"}, first  # spread over both GPUs
    assert any("waited" in line for line in tl["critical_path"]), tl["critical_path"]
    tests = {t["test"].rsplit("::", 1)[1]: t for t in tl["tests"]}
    assert len(tests) == 4 and all(t["outcome"] == "passed" for t in tests.values())
    assert "Where the time went" in (tmp_path / "report" / "summary.md").read_text()


@pytest.mark.parametrize("value", ["gpu0", "0,,1", "1,1", ""])
def test_bad_tvc_gpus_is_a_usage_error_naming_the_option(tmp_path, value):
    run = run_suite(["suites/level1/test_connector_resolves.py",
                     f"--tvc-gpus={value}"], tmp_path / "report")
    assert run.rc == 4, run.stdout[-2000:]  # pytest's usage error
    assert "--tvc-gpus" in run.stdout, run.stdout[-2000:]
    assert ("expected 'all' or CUDA device indices" in run.stdout
            or "a GPU is listed twice" in run.stdout), run.stdout[-2000:]


def test_ctrl_c_during_prestart_leaves_no_server_process(tmp_path):
    """SIGINT to a suite run whose pool is still starting servers: all are gone."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from selftests.conftest import REPO_ROOT, SUITE_ENV_VARS

    env = {k: v for k, v in os.environ.items() if k not in SUITE_ENV_VARS}
    env.update(FAKE_VLLM_DELAY_S="120", PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", TARGET, "-p",
         "selftests.e2e.fake_pool_plugin", "--tvc-parallel-starts=4",
         f"--tvc-report-dir={tmp_path / 'report'}"], cwd=REPO_ROOT, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        servers: list[psutil.Process] = []
        while len(servers) < 4:  # baseline, connector, two extra: all starting
            assert time.monotonic() < deadline, "the pool never started 4 servers"
            time.sleep(0.5)
            servers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                       if "fake_vllm_server.py" in " ".join(p.cmdline())]
        tree = [*servers, *(c for s in servers for c in s.children(recursive=True))]
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(1.0)
    alive = [p.pid for p in tree if p.is_running()
             and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"server processes outlived Ctrl-C: {alive}"
    tl = (tmp_path / "report" / "timeline.json")
    assert tl.is_file(), "an interrupted run must still write its timeline"


def test_suite_modules_plan_exactly_the_servers_their_tests_start(tmp_path):
    """The e2e modules' tvc_servers build the same specs as their test bodies.

    A plan that drifts from the body makes the pool start a second process for
    the test (named ``<stem>-2``) or start one twice (``<name>#2``): slower, and
    the timeline shows it. The fake servers do not emulate faults or variants, so
    the tests' own outcomes are not asserted here, only the servers.
    """
    run = run_suite(["suites/e2e/test_load_failure.py",
                     "suites/e2e/test_engine_variants.py",
                     "-p", "selftests.e2e.fake_pool_plugin",
                     "--tvc-parallel-starts=4"],
                    tmp_path / "report", env={"FAKE_VLLM_DELAY_S": "1"},
                    timeout_s=600)
    tl = json.loads((tmp_path / "report" / "timeline.json").read_text())
    names = sorted(s["name"] for s in tl["servers"])
    expected = sorted(
        ["vllm-baseline"]
        + [f"vllm-fail-load-{c}" for c in ("recompute-async", "recompute-sync",
                                           "fail-async", "fail-sync")]
        + [f"vllm{kind}-{v}" for v in ("sliding_window", "ngram_spec_decode",
                                       "chunked_prefill")
           for kind in ("", "-baseline")])
    assert names == expected, (names, run.tail())
