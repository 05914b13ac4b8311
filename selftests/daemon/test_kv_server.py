"""Self-tests of tvc/procs/kv_server.py and the ``kv_server`` fixture.

The owner's logic (start, probe, stop, a server that exits, hangs, dies or stops
answering) runs against a fake kind, a small HTTP server in Python, everywhere.
The real servers (LMCache's multiprocess server, ``mooncake_master``) are started
from their installed packages where they are installed; elsewhere those tests
skip naming the package to install.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from selftests.conftest import REPO_ROOT, run_suite
from selftests.foundation.fakes import minimal_profile
from selftests.foundation.synthetic import write_tests
from tvc.procs import kv_server as ks
from tvc.procs.kv_server import KINDS, KvServer, KvServerError, KvServerSpec

pytestmark = pytest.mark.hw_any

FAKE = textwrap.dedent("""\
    import http.server, sys, time
    mode, port = sys.argv[1], int(sys.argv[2])
    print("fake kv server", mode, port, flush=True)
    if mode == "crash":
        print("fatal: cannot allocate the L1 cache", flush=True)
        sys.exit(7)
    if mode == "silent":
        time.sleep(600)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *a):
            pass

    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


@pytest.fixture
def fake_kind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Register kind ``fake``: the script above, healthy when GET / answers 200."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE)
    kind = ks.Kind(
        "the fake server", ("port",), lambda: [sys.executable, str(script)],
        lambda prefix, ports, args: [*prefix, *(args or ["ok"]), str(ports["port"])],
        lambda ports: ks.http_ok(f"http://{ks.HOST}:{ports['port']}/"),
        "GET / to answer 200",
        lambda ports, folder: ({"fake.port": ports["port"]}, {"FAKE_ADDR": "x"}))
    monkeypatch.setitem(KINDS, "fake", kind)
    return "fake"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_server_starts_answers_and_is_torn_down(fake_kind: str, tmp_path: Path
                                                ) -> None:
    srv = KvServer(KvServerSpec(fake_kind, tmp_path / "logs", start_timeout_s=20))
    with srv:
        pid, port = srv.proc.pid, srv.ports["port"]
        assert srv.problem() == ""
        assert ks.http_ok(f"http://127.0.0.1:{port}/")
        assert srv.extra_config == {"fake.port": port}
        assert srv.log_file.parent == tmp_path / "logs"
    assert _gone(pid), "the server outlived its owner"
    assert not ks.tcp_answers(port)
    assert "fake kv server ok" in srv.log_file.read_text()


def test_server_that_exits_while_starting_is_named_with_its_log(
        fake_kind: str, tmp_path: Path) -> None:
    srv = KvServer(KvServerSpec(fake_kind, tmp_path, args=("crash",),
                                start_timeout_s=20))
    with pytest.raises(KvServerError) as err:
        srv.start()
    assert err.value.kind == "exited"
    msg = str(err.value)
    assert "the fake server" in msg and "exited with exit status 7" in msg
    assert "fatal: cannot allocate the L1 cache" in msg


def test_server_that_never_answers_times_out_and_is_stopped(
        fake_kind: str, tmp_path: Path) -> None:
    srv = KvServer(KvServerSpec(fake_kind, tmp_path, args=("silent",),
                                start_timeout_s=1.5))
    with pytest.raises(KvServerError) as err:
        srv.start()
    assert err.value.kind == "timeout"
    assert "did not answer within 1.5 s (GET / to answer 200)" in str(err.value)
    assert srv.proc is None  # stopped


def test_dead_and_unreachable_servers_are_named(fake_kind: str, tmp_path: Path
                                               ) -> None:
    with KvServer(KvServerSpec(fake_kind, tmp_path, start_timeout_s=20)) as srv:
        os.kill(srv.proc.pid, signal.SIGSTOP)  # alive, but answers nothing
        try:
            assert "is alive but unreachable" in srv.problem()
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(10)
        problem = srv.problem()
    assert "the fake server" in problem and "is dead" in problem
    assert "signal 9" in problem


def _real(kind: str) -> None:
    try:
        KINDS[kind].locate()
    except KvServerError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("kind", ["lmcache", "mooncake_master"])
def test_real_server_starts_answers_is_torn_down_and_named_dead(
        kind: str, tmp_path: Path) -> None:
    _real(kind)
    args = ("--l1-size-gb", "0.25", "--eviction-policy", "LRU") \
        if kind == "lmcache" else ()
    srv = KvServer(KvServerSpec(kind, tmp_path, args=args, start_timeout_s=120))
    with srv:
        pid, port = srv.proc.pid, srv.ports["port"]
        assert srv.problem() == ""
        assert ks.tcp_answers(port)
        os.kill(pid, signal.SIGKILL)
        srv.proc.wait(10)
        assert "is dead" in srv.problem() and KINDS[kind].label in srv.problem()
    assert _gone(pid) and not ks.tcp_answers(port)
    if kind == "mooncake_master":
        cfg = Path(srv.client_env["MOONCAKE_CONFIG_PATH"]).read_text()
        assert f'"master_server_address": "127.0.0.1:{port}"' in cfg
    else:
        assert srv.extra_config == {"lmcache.mp.host": "tcp://127.0.0.1",
                                    "lmcache.mp.port": port}


FIXTURE_TEST = {"test_kv.py": """
    import os, signal

    import pytest

    pytestmark = [pytest.mark.level1, pytest.mark.hw_any]

    def test_connector_sees_the_server(tvc_profile, kv_server):
        extra = tvc_profile["connector"]["extra_config"]
        assert os.environ["MOONCAKE_CONFIG_PATH"] == \\
            tvc_profile["vllm"]["env"]["MOONCAKE_CONFIG_PATH"]
        assert os.environ["DO_NOT_TRACK"] == "1"
        assert kv_server.problem() == ""
        print("SERVER_PID", kv_server.proc.pid)

    def test_server_dies_under_the_test(kv_server):
        os.kill(kv_server.proc.pid, signal.SIGKILL)
        kv_server.proc.wait(10)
        raise ConnectionError("the connector lost its store")
    """}


def test_fixture_hands_the_server_over_and_names_it_when_it_dies(tmp_path: Path
                                                                 ) -> None:
    _real("mooncake_master")
    prof = minimal_profile(tmp_path / "p.toml", tmp_path / "scratch",
                           kv_server={"kind": "mooncake_master"})
    run = run_suite([*write_tests(tmp_path / "t", FIXTURE_TEST), "-p", "no:xdist",
                     "-s", f"--tvc-profile={prof}"], tmp_path / "r")
    by = {t["nodeid"].split("::")[-1]: t for t in run.summary["tests"]}
    assert by["test_connector_sees_the_server"]["outcome"] == "passed", run.tail()
    dead = by["test_server_dies_under_the_test"]
    assert dead["outcome"] == "failed"
    assert dead["message"].startswith("the connector's server failed (an environment "
                                      "problem, not a connector defect)"), dead
    assert "Mooncake's master (mooncake_master)" in dead["message"]
    assert "is dead: it exited with signal 9" in dead["message"]
    logs = list((tmp_path / "r" / "logs").glob("kv-server-mooncake_master-*.log"))
    assert logs, "the server's log is not in the run folder"
    pid = int(run.stdout.split("SERVER_PID", 1)[1].split()[0])
    time.sleep(0.1)
    assert _gone(pid)


OWNER = textwrap.dedent("""\
    import os, signal, sys
    from pathlib import Path
    from tvc.procs import kv_server as ks
    script, folder = sys.argv[1], Path(sys.argv[2])
    ks.KINDS["fake"] = ks.Kind(
        "the fake server", ("port",), lambda: [sys.executable, script],
        lambda prefix, ports, args: [*prefix, "ok", str(ports["port"])],
        lambda ports: ks.http_ok(f"http://127.0.0.1:{ports['port']}/"), "GET /",
        lambda ports, folder: ({}, {}))
    srv = ks.KvServer(ks.KvServerSpec("fake", folder, start_timeout_s=20))
    srv.start()
    print(srv.proc.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no clean-up of ours runs
""")


def test_server_dies_with_a_killed_suite(tmp_path: Path) -> None:
    import subprocess

    script = tmp_path / "fake_server.py"
    script.write_text(FAKE)
    owner = tmp_path / "owner.py"
    owner.write_text(OWNER)
    proc = subprocess.run([sys.executable, str(owner), str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pid = int(proc.stdout.split()[0])
    for _ in range(50):
        if _gone(pid):
            break
        time.sleep(0.1)
    assert _gone(pid), "the server outlived the SIGKILLed suite"
