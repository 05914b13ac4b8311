#!/usr/bin/env python3
"""Reliability probe of the never-harm cases (ownership, paths, run folders); not CI.

Runs this issue's cases, each ``--rounds`` times, and prints counts:

- **foreign writes**: bytes of another writer's files changed at any time (a live
  writer reads each file back before rewriting it, so even damage it later
  overwrites counts), and files the suite made outside scratch (the checkout, the
  working folder: ``kvstore``, ``~``, ``file:``). Writers sit in an empty folder a
  profile names (scratch, store.path, test_devices, a store path), in the session's
  store folder during the store-fault scenarios, beside the contract tier, and in
  the exploration's store folder;
- **INTERNALERROR**: runs whose output holds ``INTERNALERROR`` or a traceback, for
  bad report paths (a 300-character name, ``/proc/1/cwd``, ``/dev/null``, an
  unknown ``~user``, a FIFO, a symlinked ``summary.md``, a folder in use) and bad
  ``tvc summary`` input (deep, 65 MiB, a folder, ``/dev/zero``, a FIFO);
- **hangs**: runs that did not end within their time limit;
- **spurious signal messages**: ``SIGINT while finishing`` lines in ``-n 2`` runs no
  one signalled (a quick worker clean-up, and one slower than execnet's 5 s grace).

Usage (from the checkout, with the suite's venv)::

    PYTHONPATH=. .venv/bin/python scripts/probe_never_harm.py [--rounds 3] [--quick]

``--quick`` leaves out the subprocess runs of the contract tier (minutes each).
Exit 0 when every count is 0.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from selftests.conftest import SUITE_ENV_VARS  # noqa: E402
from selftests.foundation.synthetic import write_tests  # noqa: E402

COUNTS: Counter[str] = Counter()
RUN_LIMIT_S = 900  # a suite run in this probe; over it counts as a hang
CLI_LIMIT_S = 60  # one tvc summary
HEAD = '[profile]\nname = "probe"\nextends = "example"\n'
TINY = {"test_tiny.py": """
    import pytest

    pytestmark = [pytest.mark.level1, pytest.mark.hw_any]

    @pytest.mark.parametrize("i", range(4))
    def test_ok(i):
        pass
    """}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SUITE_ENV_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO),
                                                      env.get("PYTHONPATH")]))
    return {**env, **extra}


def run(argv: list[str], what: str, limit_s: float = RUN_LIMIT_S,
        env: dict[str, str] | None = None, cwd: Path = REPO) -> tuple[int, str]:
    """Run a command; count INTERNALERRORs, tracebacks and hangs."""
    try:
        proc = subprocess.run(argv, cwd=cwd, env=env or _env(), text=True,
                              capture_output=True, timeout=limit_s, check=False)
    except subprocess.TimeoutExpired:
        COUNTS["hangs"] += 1
        print(f"  HANG {what}")
        return -1, ""
    out = proc.stdout + proc.stderr
    if "INTERNALERROR" in out or "Traceback (most recent call last)" in out:
        COUNTS["internal_errors"] += 1
        print(f"  INTERNALERROR/traceback {what}: {out[-600:]}")
    if "SIGINT while finishing" in out:
        COUNTS["spurious_signal_messages"] += 1
        print(f"  SIGINT line {what}")
    return proc.returncode, out


def pytest_argv(*args: str) -> list[str]:
    """``python -m pytest -p no:cacheprovider *args``."""
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]


def foreign(files: dict[str, str], damaged: list[str], what: str) -> None:
    """Count a writer's damaged files (read back before each rewrite, and now)."""
    bad = list(damaged) + [p for p, data in files.items()
                           if not _same(Path(p), base64.b64decode(data))]
    COUNTS["foreign_writes"] += len(bad)
    if bad:
        print(f"  FOREIGN WRITE {what}: {bad[:3]}")


def _same(path: Path, data: bytes) -> bool:
    try:
        return path.read_bytes() == data
    except OSError:
        return False


# ------------------------------------------------------------------ the cases

def empty_folders(tmp: Path) -> None:
    """An empty folder with a live writer, named under every ownership key."""
    from selftests.contract.test_ownership import LiveWriter
    from tvc.config.profile import ProfileError, claim_owned_paths, load

    empty = tmp / "empty"
    empty.mkdir()
    bodies = [f'[scratch]\ndir = "{empty}"\n', f'[store]\npath = "{empty}"\n',
              f'[store]\ntest_devices = ["{empty}"]\n',
              f'[connector]\nextra_config = {{ shared_storage_path = "{empty}" }}\n',
              '[connector]\nextra_config = { shared_storage_path = "/var/tmp" }\n']
    with LiveWriter(lambda: [empty]) as writer:
        while writer.rounds < 2:
            time.sleep(0.01)
        for i, body in enumerate(bodies):
            path = tmp / f"e{i}.toml"
            path.write_text(HEAD + body)
            try:
                claim_owned_paths(load(str(path), env={}))
                COUNTS["empty_folder_adopted"] += 1
            except ProfileError:
                pass
    foreign({str(p): base64.b64encode(d).decode() for p, d in writer.last.items()},
            writer.damaged, "empty folder")


def path_forms(tmp: Path) -> None:
    """Every store path form: nothing made in the working folder, home or checkout."""
    from selftests.contract.test_ownership import PATH_FORMS
    from tvc.config.profile import ProfileError, claim_owned_paths, load

    cwd = tmp / "cwd"
    cwd.mkdir()
    here = Path.cwd()
    os.chdir(cwd)
    try:
        for value, want in PATH_FORMS:
            scratch = tmp / "scratch"
            v = value.format(S=scratch)
            path = tmp / "form.toml"
            path.write_text(HEAD + f'[scratch]\ndir = "{scratch}"\n[connector]\n'
                            f'extra_config = {{ shared_storage_path = "{v}" }}\n')
            try:
                prof = load(str(path), env={})
                claim_owned_paths(prof)
                got = prof.kv_transfer_config()["kv_connector_extra_config"][
                    "shared_storage_path"]
                inside = got.removeprefix("file://").startswith(str(scratch))
                if want is None or not inside:
                    COUNTS["path_forms_wrong"] += 1
                    print(f"  PATH FORM {value!r} accepted as {got!r}")
            except ProfileError:
                if want is not None:
                    COUNTS["path_forms_wrong"] += 1
                    print(f"  PATH FORM {value!r} refused")
    finally:
        os.chdir(here)
    made = [p.name for p in cwd.iterdir()]
    COUNTS["foreign_writes"] += len(made)
    if made:
        print(f"  MADE IN THE WORKING FOLDER: {made}")


def _writer(tmp: Path, inside: bool, body: object) -> None:
    from selftests.contract.test_ownership import WRITER

    theirs, scratch = tmp / "theirs", tmp / "scratch"
    theirs.mkdir()
    stop, manifest = tmp / "stop", tmp / "manifest.json"
    (tmp / "writer.py").write_text(WRITER)
    proc = subprocess.Popen([sys.executable, str(tmp / "writer.py"), str(theirs),
                             str(scratch), str(stop), str(manifest),
                             "1" if inside else "0"])
    try:
        body(scratch)  # type: ignore[operator]
        time.sleep(0.3)
    finally:
        stop.write_text("stop")
        proc.wait(timeout=60)
    record = json.loads(manifest.read_text())
    foreign(record["files"], record["damaged"],
            "session store" if inside else "beside the contract tier")


def store_faults(tmp: Path, inside: bool) -> None:
    """The store-fault scenarios with a writer beside them or in their store."""
    def body(scratch: Path) -> None:
        prof = tmp / "p.toml"
        prof.write_text(HEAD + f'[scratch]\ndir = "{scratch}"\n')
        rc, out = run(pytest_argv("suites/contract/test_scenarios.py", "-k",
                                  "store_fault and cpu", f"--tvc-profile={prof}",
                                  "-p", "no:xdist", f"--tvc-report-dir={tmp / 'r'}"),
                      "store-fault scenarios")
        if rc != 0:
            COUNTS["unexpected_exit"] += 1
            print(f"  EXIT {rc}: {out[-1500:]}")

    _writer(tmp, inside, body)


def relative_store(tmp: Path) -> None:
    """``shared_storage_path = "kvstore"``: nothing written into the checkout."""
    before = set(subprocess.run(["git", "status", "--porcelain", "--ignored"],
                                cwd=REPO, capture_output=True, text=True,
                                check=False).stdout.splitlines())
    prof = tmp / "rel.toml"
    prof.write_text(HEAD + f'[scratch]\ndir = "{tmp / "s"}"\n[connector]\n'
                    'extra_config = { shared_storage_path = "kvstore" }\n')
    run(pytest_argv("suites/contract/test_scenarios.py", "-k",
                    "store_fault and cpu-lose-fail", f"--tvc-profile={prof}", "-p",
                    "no:xdist", f"--tvc-report-dir={tmp / 'r'}"), "relative store")
    after = set(subprocess.run(["git", "status", "--porcelain", "--ignored"],
                               cwd=REPO, capture_output=True, text=True,
                               check=False).stdout.splitlines())
    new = [line for line in after - before if "reports/" not in line]
    COUNTS["foreign_writes"] += len(new)
    if new:
        print(f"  WRITTEN INTO THE CHECKOUT: {new[:5]}")


def exploration(tmp: Path) -> None:
    """The exploration's store fault with a live writer in its store folder."""
    from selftests.contract.test_ownership import LiveWriter
    from tvc.config.profile import claim_owned_paths, load
    from tvc.contract import explore as E
    from tvc.contract import make_rig
    from tvc.contract.faults import fault_injector_for
    from tvc.contract.steps import chunk_tokens
    from tvc.core import run_store

    path = tmp / "x.toml"
    path.write_text(HEAD + f'[scratch]\ndir = "{tmp / "xs"}"\n')
    prof = load(str(path), env={})
    claim_owned_paths(prof)
    ex = E.Explorer(lambda **kw: make_rig(prof, prof.scratch / "contract",
                                          real_worker=True, **kw),
                    chunk_tokens(prof, E.BLOCK_SIZE), E.FAMILIES["faults"],
                    "recompute", prof.kv_transfer_config(),
                    lambda rig: fault_injector_for(prof, rig), label="probe",
                    scratch=prof.scratch)
    root = ex.injector.root
    try:
        with LiveWriter(lambda: [root]) as writer:
            while writer.rounds < 2:
                time.sleep(0.01)
            ex.warm([(2, 3)])
            for kind in ("lose", "corrupt", "tear"):
                ex.add(chunks=2, tail=3, replay_of=0)
                ex.fault(kind, "matched")
                ex.step(3)
            ex.finish()
        ex.close()
    finally:
        run_store.remove_session_stores(prof.scratch)
    foreign({str(p): base64.b64encode(d).decode() for p, d in writer.last.items()},
            writer.damaged, "exploration store")


def report_paths(tmp: Path) -> None:
    """Bad report paths: exit 4 in one line, never an INTERNALERROR."""
    fifo = tmp / "fifo"
    os.mkfifo(fifo)
    args = write_tests(tmp / "t", TINY)
    for value in ["/tmp/" + "a" * 300, "/proc/1/cwd", "/dev/null",
                  "~no-such-user-tvc/r", str(fifo), "/tmp/" + "b/" * 2100]:
        for env_form in (False, True):
            extra = [] if env_form else [f"--tvc-report-dir={value}"]
            env = _env(TVC_REPORT_DIR=value) if env_form else None
            rc, out = run(pytest_argv("-p", "no:xdist", *args, *extra),
                          f"report dir {value[:40]!r}", 120, env)
            if rc != 4:
                COUNTS["unexpected_exit"] += 1
                print(f"  EXIT {rc} for {value[:40]!r}: {out[-500:]}")
    # a symlinked summary.md, and a folder in use
    earlier = tmp / "earlier"
    run(pytest_argv("-p", "no:xdist", *args, f"--tvc-report-dir={earlier}"), "run")
    notes = tmp / "notes.txt"
    notes.write_text("user notes")
    (earlier / "summary.md").unlink(missing_ok=True)
    (earlier / "summary.md").symlink_to(notes)
    rc, _ = run(pytest_argv("-p", "no:xdist", *args, f"--tvc-report-dir={earlier}"),
                "symlinked summary.md")
    rc2, _ = run([sys.executable, "-m", "tvc.cli", "summary", str(earlier)],
                 "tvc summary, symlinked summary.md", CLI_LIMIT_S)
    if notes.read_text() != "user notes":
        COUNTS["foreign_writes"] += 1
        print("  FOREIGN WRITE: the linked summary.md target")
    if (rc, rc2) != (4, 2):
        COUNTS["unexpected_exit"] += 1


def summaries(tmp: Path) -> None:
    """``tvc summary`` on bounded-input cases: exit 2, one line, no hang."""
    from selftests.foundation.test_cli import make_run

    cases = {}
    for name in ("deep", "big", "folder", "device", "fifo"):
        cases[name] = make_run(tmp, name, "h", ["passed", "passed", "passed"])
        (cases[name] / "summary.json").unlink()
    (cases["deep"] / "summary.json").write_text('{"run": ' + "[" * 100_000
                                                + "]" * 100_000 + "}")
    with open(cases["big"] / "summary.json", "wb") as f:
        f.truncate(65 << 20)
    (cases["folder"] / "summary.json").mkdir()
    (cases["device"] / "summary.json").symlink_to("/dev/zero")
    os.mkfifo(cases["fifo"] / "summary.json")
    for name, folder in cases.items():
        rc, _ = run([sys.executable, "-m", "tvc.cli", "summary", str(folder)],
                    f"tvc summary {name}", CLI_LIMIT_S)
        if rc != 2:
            COUNTS["unexpected_exit"] += 1
            print(f"  EXIT {rc} for tvc summary {name}")


def xdist_signals(tmp: Path) -> None:
    """-n 2 runs no one signalled: quick clean-up, and one slower than execnet's."""
    from selftests.foundation.test_run_control import SLOW_CLEANUP

    for cleanup_s in (0.0, 7.0):
        args = write_tests(tmp / f"t{cleanup_s}", SLOW_CLEANUP)
        rc, out = run(pytest_argv(*args, "-n", "2",
                                  f"--tvc-report-dir={tmp / f'r{cleanup_s}'}"),
                      f"-n 2, worker clean-up {cleanup_s} s", 300,
                      _env(TVC_SELFTEST_CLEANUP_S=str(cleanup_s),
                           TVC_SELFTEST_HELD=str(tmp / f"held{cleanup_s}")))
        if rc != 0:
            COUNTS["unexpected_exit"] += 1
            print(f"  EXIT {rc}: {out[-800:]}")


def main() -> int:
    """Run every case ``--rounds`` times; print the counts; 0 when all are 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--quick", action="store_true",
                    help="leave out the contract-tier subprocess runs")
    ap.add_argument("--cases", default="",
                    help="comma-separated case names to run (default: all)")
    a = ap.parse_args()
    cases = [("empty folders", empty_folders), ("path forms", path_forms),
             ("report paths", report_paths), ("tvc summary", summaries),
             ("xdist signals", xdist_signals), ("exploration", exploration)]
    if not a.quick:
        cases += [("store faults, writer inside", lambda t: store_faults(t, True)),
                  ("store faults, writer beside", lambda t: store_faults(t, False)),
                  ("relative store path", relative_store)]
    if a.cases:
        cases = [c for c in cases if c[0] in a.cases.split(",")]
    t0 = time.monotonic()
    for r in range(a.rounds):
        for name, case in cases:
            print(f"round {r + 1}: {name}", flush=True)
            with tempfile.TemporaryDirectory(prefix="tvc-probe-") as tmp:
                case(Path(tmp))
            COUNTS["cases"] += 1
    keys = ("foreign_writes", "internal_errors", "hangs", "spurious_signal_messages",
            "empty_folder_adopted", "path_forms_wrong", "unexpected_exit")
    print(f"\n{COUNTS['cases']} cases in {a.rounds} round(s), "
          f"{time.monotonic() - t0:.0f} s")
    for k in keys:
        print(f"  {k}: {COUNTS[k]}")
    print(json.dumps({k: COUNTS[k] for k in ("cases", *keys)}))
    return 0 if not any(COUNTS[k] for k in keys) else 1


if __name__ == "__main__":
    raise SystemExit(main())
