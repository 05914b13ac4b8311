"""Run folders that cannot be hijacked or shared, bad report paths, bounded input.

A run folder is resolved once and created fresh (or an earlier run's), locked for the
run (:mod:`tvc.report.run_folder`); its files are written never through a link
(:func:`tvc.core.files.write_file`); ``tvc summary`` reads a bounded regular file
(:func:`tvc.core.files.read_json`). Found by a fresh user: a reused run folder whose
``summary.md`` linked to a user's file overwrote it (exit 0); two runs on one
``--tvc-report-dir`` mixed their files; a 300-character name or ``/proc/1/cwd`` gave
an INTERNALERROR; ``tvc summary`` raised RecursionError on a deep ``summary.json``
and hung on a FIFO.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from selftests.conftest import REPO_ROOT, SUITE_ENV_VARS
from selftests.foundation.synthetic import write_tests
from selftests.foundation.test_cli import make_run
from tvc import cli
from tvc.core.files import LinkInTheWay, read_json, write_file
from tvc.report import run_folder

pytestmark = pytest.mark.hw_any

TINY = {"test_tiny.py": """
    import os
    import time
    from pathlib import Path

    import pytest

    pytestmark = [pytest.mark.level1, pytest.mark.hw_any]

    @pytest.mark.parametrize("i", range(3))
    def test_ok(i):
        gate = os.environ.get("TVC_SELFTEST_GATE")
        if gate and i == 0:  # hold the run until the test says so
            (Path(gate) / "started").write_text("1")
            deadline = time.monotonic() + 120
            while not (Path(gate) / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
    """}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SUITE_ENV_VARS}
    return {**env, **extra}


def _pytest(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
            timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p",
            "no:xdist", *write_tests(tmp_path / "t", TINY), *args]
    return subprocess.run(argv, cwd=REPO_ROOT, env=env or _env(), text=True,
                          capture_output=True, timeout=timeout_s, check=False)


# ------------------------------------------------------------- bad report paths

LONG_NAME = "/tmp/" + "a" * 300


BAD_REPORT_PATHS = [(LONG_NAME, "option"), ("/proc/1/cwd", "option"),
                    ("/dev/null", "option"), ("~no-such-user-tvc/r", "option"),
                    (LONG_NAME, "env")]


@pytest.mark.parametrize(("value", "where"), BAD_REPORT_PATHS,
                         ids=["300-char-name", "proc-1-cwd", "dev-null", "no-user",
                              "300-char-name-env"])
def test_a_bad_report_path_is_one_clean_error(tmp_path: Path, value: str,
                                              where: str) -> None:
    if where == "option":
        proc = _pytest(tmp_path, f"--tvc-report-dir={value}")
    else:
        proc = _pytest(tmp_path, env=_env(TVC_REPORT_DIR=value))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, out[-3000:]
    assert "INTERNALERROR" not in out and "Traceback" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot write reports" in lines[0], lines
    assert ("--tvc-report-dir" if where == "option" else "TVC_REPORT_DIR") in lines[0]


def test_resolve_run_dir_refuses_every_bad_form_in_one_line(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    for value, why in [(LONG_NAME, "longer than a path"),
                       ("/tmp/" + "b/" * 2100, "longer than a path"),
                       ("/proc/1/cwd", "cannot be resolved"),
                       ("~no-such-user-tvc/x", "no such user"),
                       ("a\0b", "NUL")]:
        try:
            path = run_folder.resolve_run_dir(value)
        except run_folder.RunFolderUnusable as exc:
            assert why in str(exc) and "\n" not in str(exc), exc
            continue
        # /proc/1/cwd resolves where this process may read it: then it is a
        # folder of someone's files and refused as such
        with pytest.raises(run_folder.RunFolderUnusable, match="holds no earlier"):
            run_folder.open_run_dir(path, fresh=False)
    with pytest.raises(run_folder.RunFolderUnusable, match="not a directory"):
        run_folder.open_run_dir(afile, fresh=False)


def test_default_run_folders_are_made_fresh(tmp_path: Path) -> None:
    base = tmp_path / "reports" / "20261204-000000-example"
    first, lock1 = run_folder.open_run_dir(base, fresh=True)
    second, lock2 = run_folder.open_run_dir(base, fresh=True)
    assert (first, second) == (base, base.with_name(base.name + "-2"))
    run_folder.release(lock1)
    run_folder.release(lock2)


# ------------------------------------------------------------ links in the way

def test_write_file_never_writes_through_a_link(tmp_path: Path) -> None:
    run, theirs = tmp_path / "run", tmp_path / "theirs"
    run.mkdir()
    theirs.mkdir()
    notes = theirs / "notes.txt"
    notes.write_text("user notes")
    (run / "summary.md").symlink_to(notes)
    (run / "charts").symlink_to(theirs)
    os.link(notes, run / "summary.html")  # a hard link: its inode is never written
    with pytest.raises(LinkInTheWay, match=r"summary\.md is a symbolic link"):
        write_file(run / "summary.md", "page")
    with pytest.raises(LinkInTheWay, match=r"charts is a symbolic link or a file"):
        write_file(run / "charts" / "ttft.png", b"png", root=run)
    write_file(run / "summary.html", "page")
    assert (run / "summary.html").read_text() == "page"
    assert notes.read_text() == "user notes" and sorted(
        p.name for p in theirs.iterdir()) == ["notes.txt"]
    write_file(run / "trace" / "a.json", "{}", root=run)  # folders made as needed
    assert (run / "trace" / "a.json").read_text() == "{}"


def test_a_symlinked_summary_md_is_refused_by_the_run_and_by_tvc_summary(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    earlier = tmp_path / "r"
    proc = _pytest(tmp_path, f"--tvc-report-dir={earlier}")
    assert proc.returncode == 0, proc.stdout[-2000:]
    notes = tmp_path / "notes.txt"
    notes.write_text("user notes")
    (earlier / "summary.md").unlink()
    (earlier / "summary.md").symlink_to(notes)
    again = _pytest(tmp_path, f"--tvc-report-dir={earlier}")
    out = again.stdout + again.stderr
    lines = [line for line in out.splitlines() if line.strip()]
    assert again.returncode == 4 and len(lines) == 1, out[-2000:]
    assert f"{earlier / 'summary.md'} is a symbolic link" in lines[0], lines[0]
    assert cli.main(["summary", str(earlier)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "summary.md is a symbolic link" in err[0], err
    assert notes.read_text() == "user notes"


# ------------------------------------------------------------ one run per folder

def test_a_second_run_on_a_folder_in_use_is_refused(tmp_path: Path) -> None:
    gate, report = tmp_path / "gate", tmp_path / "r"
    gate.mkdir()
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p",
            "no:xdist", *write_tests(tmp_path / "t", TINY),
            f"--tvc-report-dir={report}"]
    first = subprocess.Popen(argv, cwd=REPO_ROOT, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT,
                             env=_env(TVC_SELFTEST_GATE=str(gate)))
    try:
        deadline = time.monotonic() + 120
        while not (gate / "started").exists():
            assert first.poll() is None and time.monotonic() < deadline, (
                first.communicate()[0][-2000:])
            time.sleep(0.05)
        second = _pytest(tmp_path, f"--tvc-report-dir={report}")
    finally:
        (gate / "go").write_text("1")
        out = first.communicate(timeout=120)[0]
    lines = [line for line in (second.stdout + second.stderr).splitlines()
             if line.strip()]
    assert second.returncode == 4 and len(lines) == 1, lines
    assert f"{report} is in use by another run (pid {first.pid}" in lines[0], lines
    assert first.returncode == 0, out[-2000:]
    summary = json.loads((report / "summary.json").read_text())
    assert summary["counts"]["passed"] == 3 and len(summary["tests"]) == 3
    # the lock goes with the run: no lock file is left, the folder is reusable now
    assert not (report / run_folder.LOCK_NAME).exists()
    assert _pytest(tmp_path, f"--tvc-report-dir={report}").returncode == 0
    assert not (report / run_folder.LOCK_NAME).exists()


def test_a_lock_file_removed_by_the_run_before_is_not_taken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the run before releases (removes) the lock file between this run's open and
    # flock: this run must lock the folder's new lock file, not the removed one
    folder = tmp_path / "r"
    _, before = run_folder.open_run_dir(folder, fresh=False)
    flock, calls = run_folder.fcntl.flock, []

    def released_in_between(fd: int, op: int) -> None:
        if not calls:
            run_folder.release(before, folder)
        calls.append(fd)
        flock(fd, op)

    monkeypatch.setattr(run_folder.fcntl, "flock", released_in_between)
    _, fd = run_folder.open_run_dir(folder, fresh=False)
    monkeypatch.undo()
    try:
        assert len(calls) == 2  # the removed file's lock was let go, a new one taken
        assert os.path.samestat(os.fstat(fd), os.stat(folder / run_folder.LOCK_NAME))
        with pytest.raises(run_folder.RunFolderUnusable, match="in use by another"):
            run_folder.open_run_dir(folder, fresh=False)
    finally:
        run_folder.release(fd, folder)
    assert not (folder / run_folder.LOCK_NAME).exists()


def test_a_reused_folder_loses_the_earlier_runs_files_not_the_users(
        tmp_path: Path) -> None:
    folder, user = tmp_path / "r", tmp_path / "user"
    (folder / "logs").mkdir(parents=True)
    (folder / "logs" / "vllm-server.log").write_text("the earlier run's server")
    (folder / "summary.json").write_text(json.dumps(
        {"run": {}, "counts": {}, "tests": []}))
    (folder / "failures.md").write_text("earlier failures")
    (folder / "notes.md").write_text("a user's notes")
    user.mkdir()
    (user / "keep.txt").write_text("kept")
    (folder / "e2e").symlink_to(user)  # a link the earlier run did not make
    _, fd = run_folder.open_run_dir(folder, fresh=False)
    run_folder.release(fd, folder)
    assert sorted(p.name for p in folder.iterdir()) == ["notes.md"]
    assert (user / "keep.txt").read_text() == "kept"


def test_a_folder_left_by_a_killed_run_is_reused_and_a_refusal_leaves_no_lock(
        tmp_path: Path) -> None:
    """Fresh-user findings: a run killed (SIGKILL) before its summary left its lock
    file and a live failures.md, and the folder was refused as "holds no earlier
    run"; a start-up refused for a link where a report goes left the lock file."""
    folder = tmp_path / "killed"
    folder.mkdir()
    (folder / run_folder.LOCK_NAME).write_text('{"pid": 999999}')  # not held
    (folder / "failures.md").write_text("live: the run is going on")
    (folder / "notes.txt").write_text("a user's notes")
    _, fd = run_folder.open_run_dir(folder, fresh=False)
    run_folder.release(fd, folder)
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    (folder / "summary.json").write_text(json.dumps(
        {"run": {}, "counts": {}, "tests": []}))  # as the new run would leave it
    (folder / "charts").symlink_to(tmp_path)
    with pytest.raises(run_folder.RunFolderUnusable, match="charts is a symbolic"):
        run_folder.open_run_dir(folder, fresh=False)
    assert sorted(p.name for p in folder.iterdir()) == ["charts", "notes.txt",
                                                        "summary.json"]


# ------------------------------------------------------------------ tvc summary

def test_tvc_summary_bounds_its_input(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    deep = make_run(tmp_path, "deep", "h", ["passed", "passed", "passed"])
    (deep / "summary.json").write_text('{"run": ' + "[" * 100_000 + "]" * 100_000
                                       + "}")
    big = make_run(tmp_path, "big", "h", ["passed", "passed", "passed"])
    with open(big / "summary.json", "r+b") as f:
        f.truncate(65 << 20)  # sparse: 65 MiB read as zeros
    folder = make_run(tmp_path, "folder", "h", ["passed", "passed", "passed"])
    (folder / "summary.json").unlink()
    (folder / "summary.json").mkdir()
    device = make_run(tmp_path, "device", "h", ["passed", "passed", "passed"])
    (device / "summary.json").unlink()
    (device / "summary.json").symlink_to("/dev/zero")
    for run, why in [(deep, "nested deeper than 64"), (big, "larger than 64 MiB"),
                     (folder, "Is a directory"), (device, "not a regular file")]:
        assert cli.main(["summary", str(run)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], (run.name, err)


def test_tvc_summary_does_not_hang_on_a_fifo(tmp_path: Path) -> None:
    fifo = make_run(tmp_path, "fifo", "h", ["passed", "passed", "passed"])
    (fifo / "summary.json").unlink()
    os.mkfifo(fifo / "summary.json")
    proc = subprocess.run([sys.executable, "-m", "tvc.cli", "summary", str(fifo)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 2, proc.stderr
    assert "not a regular file" in proc.stderr and "Traceback" not in proc.stderr


def test_read_json_refuses_deep_nesting_below_the_recursion_limit(
        tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text("[" * 500 + "]" * 500)  # parses; rendering it would recurse
    with pytest.raises(ValueError, match="nested deeper than 64"):
        read_json(path)
    path.write_text(json.dumps({"a": [[{"b": 1}]]}))
    assert read_json(path) == {"a": [[{"b": 1}]]}
