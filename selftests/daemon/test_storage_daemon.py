"""Self-tests of tvc/procs/daemon.py against fake daemons rooted in a temp dir."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tvc.procs.daemon import DaemonError, DaemonSpec, StorageDaemon

pytestmark = pytest.mark.hw_any

FAKE = textwrap.dedent("""\
    import os, signal, subprocess, sys, time
    mode, root, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
    print("fake daemon starting", mode, flush=True)
    if mode == "crash":
        print("fatal: cannot open /dev/nvme0: Permission denied", flush=True)
        sys.exit(3)
    if mode == "crash-plain":
        print("fatal: controller 0000:3b:00.0 did not answer", flush=True)
        sys.exit(5)
    # a child in the same process group, as a real daemon's worker would be
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.path.join(root, "child.pid"), "w") as fh:
        fh.write(str(child.pid))
    time.sleep(delay)
    if mode == "ok":
        os.makedirs(os.path.join(root, "dev"), exist_ok=True)
        open(os.path.join(root, "dev", "snvme0"), "w").close()
        open(os.path.join(root, "dev", "ssnvme0"), "w").close()
        os.makedirs(os.path.join(root, "mnt", "nvme0"), exist_ok=True)
        open(os.path.join(root, "mnt", "nvme0", "store.bin"), "w").close()
        print("store up", flush=True)
    if mode == "empty-mount":
        os.makedirs(os.path.join(root, "dev"), exist_ok=True)
        open(os.path.join(root, "dev", "snvme0"), "w").close()
        open(os.path.join(root, "dev", "ssnvme0"), "w").close()
        os.makedirs(os.path.join(root, "mnt", "nvme0"), exist_ok=True)
    while True:
        time.sleep(1)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); read its state
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def world(tmp_path: Path):
    """A fake sysfs with the module loaded, a fake daemon script and a spec builder."""
    sysfs = tmp_path / "sys"
    (sysfs / "module" / "snvme").mkdir(parents=True)
    script = tmp_path / "fake_daemon.py"
    script.write_text(FAKE)
    root = tmp_path / "root"
    root.mkdir()

    def spec(mode: str = "ok", delay: float = 0.3, timeout: float = 10.0,
             **over) -> DaemonSpec:
        kw = dict(
            kernel_module="snvme",
            argv=(sys.executable, str(script), mode, str(root), str(delay)),
            env={"TUTTI_VERBOSE": "1"},
            cwd=str(tmp_path),
            log_file=str(tmp_path / "logs" / "daemon.log"),
            device_globs=(str(root / "dev" / "snvme*"), str(root / "dev" / "ssnvme*")),
            mount_globs=(str(root / "mnt" / "nvme*"),),
            start_timeout_s=timeout,
            sysfs_root=str(sysfs),
        )
        kw.update(over)
        return DaemonSpec(**kw)

    return {"spec": spec, "root": root, "sysfs": sysfs, "tmp": tmp_path}


def test_missing_kernel_module_is_reported_before_starting(world) -> None:
    (world["sysfs"] / "module" / "snvme").rmdir()
    d = StorageDaemon(world["spec"]())
    with pytest.raises(DaemonError, match=r"kernel module snvme is not loaded.*"
                       r"modprobe snvme") as exc:
        d.start()
    assert exc.value.kind == "module"
    assert not d.started
    assert not (world["root"] / "child.pid").exists(), "daemon ran without module"


def test_daemon_is_started_waited_for_and_stopped_with_its_group(world) -> None:
    t0 = time.monotonic()
    with StorageDaemon(world["spec"](delay=0.5)) as d:
        assert d.started and not d.reused
        assert time.monotonic() - t0 >= 0.5, "returned before the nodes appeared"
        assert (world["root"] / "dev" / "snvme0").exists()
        pid = d.proc.pid
        child = int((world["root"] / "child.pid").read_text())
        assert _alive(pid) and _alive(child)
        log = Path(d.spec.log_file).read_text()
        assert "fake daemon starting ok" in log
    time.sleep(0.2)
    assert not _alive(pid), "daemon still running after the context exited"
    assert not _alive(child), "daemon's child survived: the process group was not "\
        "stopped"


def test_environment_reaches_the_daemon(world, tmp_path: Path) -> None:
    out = tmp_path / "env.txt"
    code = ("import os; open({!r},'w').write(os.environ.get('TUTTI_VERBOSE','')); "
            "os.makedirs({!r}); os.makedirs({!r}); open({!r},'w').close(); "
            "import time; time.sleep(60)").format(
        str(out), str(world["root"] / "dev" / "snvme0"),
        str(world["root"] / "mnt" / "nvme0"),
        str(world["root"] / "mnt" / "nvme0" / "f"))
    spec = world["spec"](argv=(sys.executable, "-c", code),
                         device_globs=(str(world["root"] / "dev" / "snvme*"),))
    with StorageDaemon(spec) as d:
        assert d.started
        assert out.read_text() == "1"


def test_running_daemon_is_reused_and_left_running(world) -> None:
    # someone else started the daemon: it is up before the suite looks
    other = subprocess.Popen(list(world["spec"](delay=0.0).argv),
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not (world["root"] / "mnt" / "nvme0" / "store.bin").exists():
            assert time.monotonic() < deadline, "helper daemon did not come up"
            time.sleep(0.05)
        never = world["tmp"] / "never-started"
        spec = world["spec"](argv=(sys.executable, "-c",
                                   f"open({str(never)!r}, 'w').close()"))
        with StorageDaemon(spec) as d:
            assert d.reused and not d.started
        assert not never.exists(), "the suite started a second daemon"
        assert other.poll() is None, "the suite stopped a daemon it did not start"
    finally:
        os.killpg(other.pid, 9)
        other.wait()


def test_daemon_that_exits_is_reported_with_its_log_tail(world) -> None:
    d = StorageDaemon(world["spec"](mode="crash-plain"))
    with pytest.raises(DaemonError, match=r"(?s)exited with exit status 5 before the "
                       r"store was up .*no device node matches .*snvme\*.*"
                       r"controller 0000:3b:00.0 did not answer") as exc:
        d.start()
    assert exc.value.kind == "exited"
    assert "permission" not in str(exc.value).lower()


def test_daemon_permission_failure_in_log_says_it_needs_root(world) -> None:
    d = StorageDaemon(world["spec"](mode="crash"))
    with pytest.raises(DaemonError, match=r"(?s)exit status 3.*permission problem: the "
                       r"daemon needs root.*Permission denied"):
        d.start()


def test_daemon_that_never_brings_the_store_up_times_out_and_is_stopped(world
                                                                       ) -> None:
    d = StorageDaemon(world["spec"](mode="hang", timeout=1.0))
    t0 = time.monotonic()
    with pytest.raises(DaemonError, match=r"(?s)did not bring the store up within 1 s: "
                       r"no device node matches .*It was stopped.*Log tail:\n"
                       r"fake daemon starting hang") as exc:
        d.start()
    assert exc.value.kind == "timeout"
    assert 1.0 <= time.monotonic() - t0 < 15
    child = int((world["root"] / "child.pid").read_text())
    time.sleep(0.2)
    assert not _alive(child), "timed-out daemon's process group left running"


def test_empty_mount_point_does_not_count_as_up(world) -> None:
    d = StorageDaemon(world["spec"](mode="empty-mount", delay=0.0, timeout=1.0))
    with pytest.raises(DaemonError, match=r"no non-empty mount matches .*nvme\*"):
        d.start()


def test_daemon_without_execute_permission_is_a_permission_error(world) -> None:
    exe = world["tmp"] / "tutti_daemon"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o644)
    d = StorageDaemon(world["spec"](argv=(str(exe), "/etc/tutti/daemon.yaml")))
    with pytest.raises(DaemonError, match=r"no permission to start the storage "
                       r"daemon .*tutti_daemon.*needs root") as exc:
        d.start()
    assert exc.value.kind == "permission"


def test_missing_daemon_binary_names_the_profile_keys(world) -> None:
    d = StorageDaemon(world["spec"](argv=("/nonexistent/tutti_daemon", "x.yaml")))
    with pytest.raises(DaemonError, match=r"not found.*\[daemon\] argv") as exc:
        d.start()
    assert exc.value.kind == "not_found"


def test_store_down_and_no_daemon_configured_is_a_config_error(world) -> None:
    d = StorageDaemon(world["spec"](argv=()))
    with pytest.raises(DaemonError, match=r"profile names no daemon to start"):
        d.start()


def test_spec_from_profile_section_reads_every_key(world) -> None:
    section = {"kernel_module": "snvme", "argv": ["d", "c.yaml"],
               "env": {"TUTTI_VERBOSE": "1"}, "cwd": "/tmp", "log_file": "/tmp/l",
               "device_globs": ["/dev/snvme*"], "mount_globs": ["/mnt/nvme*"],
               "start_timeout_s": 5.0, "nvme_preset": ""}
    spec = DaemonSpec.from_section(section, sysfs_root="/x")
    assert spec.argv == ("d", "c.yaml") and spec.env == {"TUTTI_VERBOSE": "1"}
    assert spec.start_timeout_s == 5.0 and spec.sysfs_root == "/x"
    assert spec.manages_anything
    assert not DaemonSpec.from_section({}).manages_anything
