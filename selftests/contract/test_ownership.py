"""The suite touches only what it created: folders it made, entries it saw written.

Load-time rules: a scratch dir, a ``store.path`` or a ``store.test_devices`` folder is
new (the suite creates and marks it) or carries the suite's ``.tvc-owned`` marker from
an earlier run; an existing folder without it is refused, even an empty one
(:func:`tvc.core.run_store.ownership_problem`). Every store path of
``connector.extra_config`` is resolved once (``~``, ``file://``, relative to scratch)
and must lie in scratch or a declared test device
(:func:`tvc.config.checks.resolve_store_paths`); the connector receives the resolved
path. The store fault injector (:class:`tvc.contract.faults.FileStoreInjector`)
works only in a folder this run made, damages only files it recorded as the
connector wrote them and that are still the same file, and stops when another writer
changes files in the store folder.

Live writers (a thread or a process writing and rewriting files) sit inside an
empty folder a profile names, inside the session's store folder during the
store-fault scenarios and the exploration, and beside the contract tier; their files
are compared byte for byte afterwards.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from selftests.conftest import REPO_ROOT, SUITE_ENV_VARS, run_suite
from tvc.config.profile import ProfileError, claim_owned_paths, load
from tvc.contract.faults import (
    FaultConfigError,
    FileStoreInjector,
    ForeignWriter,
    fault_injector_for,
)
from tvc.core import run_store

HEAD = '[profile]\nname = "owned"\nextends = "example"\n'
STORE_FAULT_TESTS = "suites/contract/test_scenarios.py"
STORE_FAULT_K = "store_fault and cpu"
# the store-fault cases of the example profile on CPU: lose, corrupt, tear and
# fail_save under both load-failure policies, minus the corrupt/fail and
# fail_save/fail cases the profile deselects or skips; each xfails only when its
# known-failure match (the defect's symptom after the damage) is in the failure
MIN_DAMAGING_CASES = 6
FILE_CASES = 5  # of them, those that damage files (not fail_save)


def _profile(tmp_path: Path, body: str, name: str = "owned.toml") -> Path:
    path = tmp_path / name
    path.write_text(HEAD + body)
    return path


def _marker(folder: Path) -> dict:
    return json.loads((folder / run_store.OWNER_MARKER).read_text())


WRITER_FILES = ("config.json", "layer.0.safetensors", "entry.bin")


class LiveWriter:
    """A thread that writes and rewrites three files in each folder every 10 ms.

    Before each rewrite it reads the file back: one that no longer holds its
    last write (damaged, truncated or deleted meanwhile, even if rewritten
    since) is listed in :attr:`damaged`.

    Args:
        folders: called each round: the folders to write in now (those that do
            not exist yet are skipped, never created).

    """

    def __init__(self, folders: Callable[[], Iterable[Path]]) -> None:
        self.folders = folders
        self.last: dict[Path, bytes] = {}
        self.damaged: list[str] = []
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for folder in list(self.folders()):
                if not folder.is_dir():
                    continue
                for name in WRITER_FILES:
                    path = folder / name
                    if path in self.last and self._read(path) != self.last[path]:
                        self.damaged.append(str(path))
                    data = f"{folder}/{name}/{self.rounds}:".encode() * 40
                    path.write_bytes(data)
                    self.last[path] = data
            self.rounds += 1
            time.sleep(0.01)

    @staticmethod
    def _read(path: Path) -> bytes | None:
        try:
            return path.read_bytes()
        except OSError:
            return None

    def __enter__(self) -> LiveWriter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def intact(self) -> list[str]:
        """Files damaged at any time, or not holding their last write now."""
        return self.damaged + [str(p) for p, data in self.last.items()
                               if self._read(p) != data]


# ------------------------------------------------------------------ load-time rules

def test_new_folders_are_created_and_marked_by_the_suite(tmp_path: Path) -> None:
    """A new scratch and a new test-device folder (even inside someone's folder)
    are created and marked at start-up; the folder around them is left alone."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep")
    device = theirs / "kv"
    path = _profile(tmp_path, f'[scratch]\ndir = "{tmp_path / "new" / "scratch"}"\n'
                    f'[store]\ntest_devices = ["{device}", "{tmp_path / "nvme"}"]\n'
                    '[connector]\nname = "ExampleConnector"\nextra_config = '
                    f'{{ shared_storage_path = "{device / "store"}", '
                    f'root = "{tmp_path / "nvme"}/rank{{LOCAL_RANK}}", '
                    'dev = "/dev/null" }\n')
    prof = load(str(path), env={})
    assert not prof.scratch.exists() and not device.exists()  # loading writes nothing
    claimed = claim_owned_paths(prof)
    assert claimed == [prof.scratch, device, tmp_path / "nvme"]
    for folder in claimed:
        facts = _marker(folder)
        assert facts["suite"] == run_store.SUITE and facts["pid"] == os.getpid()
        assert facts["run"] == run_store.RUN_ID and "adopted" not in facts
    assert run_store.owner_of(theirs) is None
    assert sorted(p.name for p in theirs.iterdir()) == ["kv", "notes.txt"]
    assert not (tmp_path / "nvme" / "rank{LOCAL_RANK}").exists()  # the connector's
    # marked now: the next load accepts them with the connector's files in them
    (device / "store").mkdir()
    (device / "store" / "entry.safetensors").write_bytes(b"kv")
    again = load(str(path), env={})
    assert claim_owned_paths(again) == [again.scratch]


def test_an_empty_folder_is_never_adopted_even_with_a_live_writer(
        tmp_path: Path) -> None:
    """An empty folder (another program may be about to write there, as one does
    here) is refused under every key that names a folder the suite would own."""
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (f'[scratch]\ndir = "{empty}"\n', "scratch.dir"),
        (f'[store]\npath = "{empty}"\n', "store.path"),
        (f'[store]\ntest_devices = ["{empty}"]\n', "store.test_devices[0]"),
        (f'[connector]\nname = "ExampleConnector"\nextra_config = '
         f'{{ shared_storage_path = "{empty}" }}\n',
         "connector.extra_config.shared_storage_path"),
        ('[connector]\nname = "ExampleConnector"\nextra_config = '
         '{ shared_storage_path = "/var/tmp" }\n',
         "connector.extra_config.shared_storage_path"),
    ]
    with LiveWriter(lambda: [empty]) as writer:
        while writer.rounds < 2:
            time.sleep(0.01)
        for body, key in cases:
            with pytest.raises(ProfileError) as exc:
                prof = load(str(_profile(tmp_path, body)), env={})
                claim_owned_paths(prof)
            msg = str(exc.value)
            assert f"key {key}:" in msg and "\n" not in msg, msg
    assert writer.rounds >= 3 and writer.intact() == []
    assert run_store.OWNER_MARKER not in {p.name for p in empty.iterdir()}


def test_a_folder_of_user_files_is_refused_everywhere_and_left_as_it_is(
        tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.json").write_text('{"user": 1}')
    before = sorted((p.name, p.read_bytes()) for p in theirs.iterdir())
    for body, key, why in [
        (f'[scratch]\ndir = "{theirs}"\n', "scratch.dir", run_store.OWNER_MARKER),
        (f'[store]\npath = "{theirs}"\n', "store.path", run_store.OWNER_MARKER),
        (f'[store]\ntest_devices = ["{theirs}"]\n', "store.test_devices[0]",
         run_store.OWNER_MARKER),
        (f'[connector]\nname = "ExampleConnector"\nextra_config = '
         f'{{ shared_storage_path = "{theirs}" }}\n',
         "connector.extra_config.shared_storage_path", "outside the scratch"),
        (f'[connector]\nname = "ExampleConnector"\nextra_config = '
         f'{{ store = {{ root = "{theirs}/rank{{LOCAL_RANK}}" }} }}\n',
         "connector.extra_config.store.root", "outside the scratch"),
    ]:
        with pytest.raises(ProfileError) as exc:
            load(str(_profile(tmp_path, body)), env={})
        msg = str(exc.value)
        assert f"key {key}:" in msg and "\n" not in msg, msg
        assert why in msg, msg
    assert sorted((p.name, p.read_bytes()) for p in theirs.iterdir()) == before


# every path form a store path may take: (value, what the connector receives, or
# None when the load refuses it); {S} is the scratch directory (absolute)
PATH_FORMS = [
    ("kvstore", "{S}/kvstore"), ("sub/dir", "{S}/sub/dir"), (".", "{S}"),
    ("./kv", "{S}/kv"), ("..", None), ("../kv", None), ("./a/../../kv", None),
    ("~", None), ("~/kv", None), ("~root/kv", None), ("~no-such-user-tvc/kv", None),
    ("file://localhost{S}/u", "{S}/u"), ("file://{S}/u", "{S}/u"),
    ("file:{S}/u", "{S}/u"), ("file://{S}/../u", None),
    ("file://tmp/kv", None), ("file:kv", None), ("file://{S}/a%20b", None),
    ("file://localhost/var/tmp/kv", None), ("${{SCRATCH}}/x/../y", "{S}/y"),
    ("{S}/../{S}/kv", None), (" {S}/kv", None), ("kv ", None),
]


@pytest.mark.parametrize(("value", "want"), PATH_FORMS,
                         ids=[v.replace("{S}", "S") for v, _ in PATH_FORMS])
def test_every_store_path_form_is_resolved_once_and_checked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str,
        want: str | None) -> None:
    """The connector receives the resolved absolute path; outside scratch and the
    test devices is refused in one line; nothing is created in the working folder."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    scratch = tmp_path / "scratch"
    value = value.format(S=scratch)
    path = _profile(tmp_path, f'[scratch]\ndir = "{scratch}"\n[connector]\n'
                    f'extra_config = {{ shared_storage_path = "{value}", '
                    f'store_paths = ["{value}"], size = 3 }}\n')
    if want is None:
        with pytest.raises(ProfileError) as exc:
            load(str(path), env={})
        msg = str(exc.value)
        assert "key connector.extra_config.shared_storage_path:" in msg, msg
        assert "\n" not in msg
    else:
        prof = load(str(path), env={})
        got = prof.kv_transfer_config()["kv_connector_extra_config"]
        resolved = want.format(S=scratch)
        assert got == {"shared_storage_path": resolved, "store_paths": [resolved],
                       "size": 3}, got
        claim_owned_paths(prof)
    assert list(cwd.iterdir()) == [], "a folder was made in the working folder"


def test_the_daemon_log_the_suite_appends_to_is_resolved_in_scratch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    scratch = tmp_path / "scratch"
    for value, want in [("daemon.log", scratch / "daemon.log"),
                        ("${SCRATCH}/d/x.log", scratch / "d" / "x.log"),
                        ("~/daemon.log", None), ("/etc/passwd", None),
                        ("../daemon.log", None)]:
        path = _profile(tmp_path, f'[scratch]\ndir = "{scratch}"\n[daemon]\n'
                        f'log_file = "{value}"\n')
        if want is None:
            with pytest.raises(ProfileError, match=r"key daemon\.log_file: .*"
                               "outside the scratch directory"):
                load(str(path), env={})
        else:
            assert load(str(path), env={})["daemon"]["log_file"] == str(want)


def test_a_relative_store_path_never_writes_into_the_checkout(tmp_path: Path
                                                              ) -> None:
    """``shared_storage_path = "kvstore"``: once, ExampleConnector wrote 176 files
    into the checkout; the path is now the scratch's ``kvstore``."""
    scratch = tmp_path / "scratch"
    prof = _profile(tmp_path, f'[scratch]\ndir = "{scratch}"\n[connector]\n'
                    'extra_config = { shared_storage_path = "kvstore" }\n')
    run = run_suite(["suites/contract/test_scenarios.py", "-k",
                     "test_store_fault_is_reported_never_silent and cpu-lose-fail",
                     f"--tvc-profile={prof}", "-p", "no:xdist"], tmp_path / "r",
                    timeout_s=600)
    assert run.summary is not None and run.summary["counts"]["xfailed"] == 1, (
        run.tail())  # the fault was injected into the connector's files
    assert not (REPO_ROOT / "kvstore").exists()
    assert run.summary["profile"]["kv_transfer_config"][
        "kv_connector_extra_config"]["shared_storage_path"] == str(scratch / "kvstore")


def test_test_devices_are_device_nodes_or_folders_the_suite_created(
        tmp_path: Path) -> None:
    for devices, ok in [(["/dev/null"], True), ([str(tmp_path / "new")], True),
                        ([str(tmp_path)], False), (["/var/tmp"], False),
                        (["~"], False), (["relative"], False), (["/"], False)]:
        body = f'[store]\ntest_devices = {json.dumps(devices)}\n'
        if ok:
            load(str(_profile(tmp_path, body)), env={})
            continue
        with pytest.raises(ProfileError, match=r"key store\.test_devices\[0\]:"):
            load(str(_profile(tmp_path, body)), env={})


def test_a_folder_the_suite_marked_earlier_is_accepted_with_its_files(
        tmp_path: Path) -> None:
    store = run_store.claim_dir(tmp_path / "lab-store")
    (store / "pool.bin").write_bytes(b"\0" * 64)
    prof = load(str(_profile(tmp_path, f'[store]\npath = "{store}"\n')), env={})
    assert prof["store"]["path"] == str(store)


def test_the_marker_must_be_the_suites_own(tmp_path: Path) -> None:
    """A marker that is a symlink, too big or another program's JSON is no marker."""
    for i, make in enumerate([
            lambda m: m.symlink_to(tmp_path / "elsewhere"),
            lambda m: m.write_text(json.dumps({"suite": "other"})),
            lambda m: m.write_text("{" + " " * run_store.MAX_MARKER_BYTES + "}")]):
        folder = tmp_path / f"f{i}"
        folder.mkdir()
        (folder / "data").write_text("user data")
        make(folder / run_store.OWNER_MARKER)
        assert run_store.owner_of(folder) is None
        assert "did not create" in run_store.ownership_problem(folder)


# ------------------------------------------------------------- the fault injector

def test_file_injector_works_only_in_a_folder_this_run_made(tmp_path: Path) -> None:
    (tmp_path / "theirs").mkdir()
    earlier = run_store.make_owned_dir(tmp_path / "earlier")
    marker = earlier / run_store.OWNER_MARKER
    marker.write_text(marker.read_text().replace(run_store.RUN_ID, "0" * 12))
    for folder in (tmp_path / "theirs", earlier, earlier / "sub"):
        with pytest.raises(FaultConfigError, match="no folder this run created"):
            FileStoreInjector(folder)
    extra = {"shared_storage_path": str(tmp_path / "theirs")}
    rig = SimpleNamespace(vllm_config=SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra)))
    with pytest.raises(FaultConfigError, match="shared_storage_path|no folder"):
        fault_injector_for({"connector": {"fault_injector": ""}}, rig)
    FileStoreInjector(run_store.make_owned_dir(tmp_path / "mine") / "store")


def test_file_injector_damages_only_files_it_saw_written(tmp_path: Path) -> None:
    root = run_store.make_owned_dir(tmp_path / "store")
    old = root / "old.bin"
    old.write_bytes(b"o" * 64)  # written before the mark: never an entry
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x" * 64)
    inj = FileStoreInjector(root)
    mark = inj.mark()
    seen = [root / "a.bin", root / "b.bin", root / "c.bin", root / "d.bin"]
    for p in seen:
        p.write_bytes(bytes(range(64)))
    (root / "link.bin").symlink_to(outside)  # a symlink is never an entry
    entries = inj.entries_since(mark)
    assert entries == seen
    # b.bin is replaced by another writer (a new file), d.bin rewritten in place
    (root / "b.tmp").write_bytes(b"theirs" * 10)
    os.replace(root / "b.tmp", root / "b.bin")
    with open(root / "d.bin", "ab") as f:
        f.write(b"theirs")
    inj.corrupt([entries[0], entries[1], entries[3]])
    assert (root / "a.bin").read_bytes() != bytes(range(64))  # damaged: premise
    assert (root / "b.bin").read_bytes() == b"theirs" * 10
    assert (root / "d.bin").read_bytes() == bytes(range(64)) + b"theirs"
    assert inj.refused == [root / "b.bin", root / "d.bin"]  # the test says so
    inj.tear([entries[0]])  # its own damage is no other writer's: still its entry
    assert len((root / "a.bin").read_bytes()) == 32
    inj.lose([entries[1], old, outside, root / "link.bin"])
    assert (root / "b.bin").read_bytes() == b"theirs" * 10
    assert old.read_bytes() == b"o" * 64 and outside.read_bytes() == b"x" * 64
    inj.lose([entries[2]])
    assert not (root / "c.bin").exists()  # seen and unchanged: lost


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32",
                                   "float8_e4m3fn"])
def test_a_file_holding_no_kv_of_the_harness_is_never_an_entry(
        tmp_path: Path, dtype: str) -> None:
    """Another writer's file written once during the connector's step, beside its
    entries (never-harm probe: a writer rewriting every 0.2 s lost 8 files to
    'lose'): only files that hold the harness's KV are entries."""
    import torch

    from tvc.contract.faults import carries_harness_kv
    from tvc.contract.worker import pattern_values

    root = run_store.make_owned_dir(tmp_path / "store")
    inj = FileStoreInjector(root)
    mark = inj.mark()
    kv = torch.zeros(4, 2, 16, 128, dtype=getattr(torch, dtype))  # (N, H, B, 2D)
    vals = pattern_values(kv, 1, torch.arange(16, 32), torch.arange(500, 516))
    entry = root / "9f3a" / "model.layers.1.self_attn.attn.safetensors"
    entry.parent.mkdir()
    # an odd-length header: the KV starts off the dtype's alignment
    entry.write_bytes(b"{hdr}" + vals[:, 1].contiguous().view(torch.uint8)
                      .numpy().tobytes())
    theirs = {root / "zz-writer-a.bin": os.urandom(4096),
              root / "9f3a" / "zz-writer-b.bin": b"folder/name/3:" * 300,
              root / "zz-writer-c.bin": bytes(range(256)) * 16}
    for path, data in theirs.items():
        path.write_bytes(data)
    assert inj.entries_since(mark) == [entry]
    assert sorted(inj.not_kv) == sorted(theirs)
    inj.lose([entry, *theirs])
    assert not entry.exists()  # the premise: the fault was made
    assert all(p.read_bytes() == d for p, d in theirs.items())
    assert not carries_harness_kv(root / "zz-writer-a.bin")


def test_file_injector_stops_at_a_live_writer_and_the_session_keeps_its_files(
        tmp_path: Path) -> None:
    scratch = run_store.make_owned_dir(tmp_path / "scratch")
    root = run_store.session_store_root(scratch) / "example-store"
    root.mkdir()
    inj = FileStoreInjector(root)
    try:
        with LiveWriter(lambda: [root]) as writer:
            while writer.rounds < 2:
                time.sleep(0.01)
            mark = inj.mark()
            (root / "connector.safetensors").write_bytes(b"kv" * 32)
            with pytest.raises(ForeignWriter) as exc:
                inj.entries_since(mark)
            assert str(exc.value.path.parent) == str(root), exc.value
            assert exc.value.path.name in {p.name for p in writer.last}
            t0 = time.monotonic()
            with pytest.raises(ForeignWriter):  # sticky: no second wait
                inj.entries_since(mark)
            assert time.monotonic() - t0 < run_store.SETTLE_S
        assert writer.intact() == [] and writer.rounds >= 10
    finally:
        kept = run_store.remove_session_stores(scratch)
    assert kept == [] and root.is_dir(), "a store with another writer's files is kept"
    assert writer.intact() == []
    session = root.parent
    assert "kept" in _marker(session)
    dead = session.parent / f"{2**22 + 7}-{session.name.split('-', 1)[1]}"
    session.rename(dead)  # as a later run sees it: its process gone
    assert run_store.remove_orphaned_stores(scratch) == [] and dead.is_dir()


def test_a_live_writer_in_the_exploration_store_is_left_alone(tmp_path: Path
                                                              ) -> None:
    """The exploration's ``faults`` family: a store fault armed while a writer writes
    in the sequence's store folder is not made (the test then skips naming the file);
    without the writer the same fault is made."""
    from tvc.contract import explore as E
    from tvc.contract import make_rig
    from tvc.contract.steps import chunk_tokens

    prof = load(str(_profile(tmp_path, f'[scratch]\ndir = "{tmp_path / "s"}"\n')),
                env={})
    claim_owned_paths(prof)

    def explorer() -> E.Explorer:
        return E.Explorer(
            lambda **kw: make_rig(prof, prof.scratch / "contract", real_worker=True,
                                  **kw),
            chunk_tokens(prof, E.BLOCK_SIZE), E.FAMILIES["faults"], "recompute",
            prof.kv_transfer_config(), lambda rig: fault_injector_for(prof, rig),
            label="owned", scratch=prof.scratch)

    def lose_after_a_hit(ex: E.Explorer) -> None:
        ex.warm([(2, 3)])
        ex.add(chunks=2, tail=3, replay_of=0)
        ex.fault("lose", "matched")
        with pytest.raises(E.ExplorationFailure):  # example's known defect
            ex.step(3)
            ex.finish()

    try:
        ex = explorer()
        root = ex.injector.root
        with LiveWriter(lambda: [root]) as writer:
            while writer.rounds < 2:
                time.sleep(0.01)
            ex.warm([(2, 3)])
            ex.add(chunks=2, tail=3, replay_of=0)
            ex.fault("lose", "matched")
            ex.step(3)
            ex.finish()
        assert "lose" not in ex.stats.faults, ex.stats.faults
        assert "store fault not injected" in ex.stats.foreign
        assert str(root) in ex.stats.foreign, ex.stats.foreign
        assert writer.intact() == [] and writer.rounds >= 10
        ex.close()
        control = explorer()  # the premise: the fault is made without the writer
        lose_after_a_hit(control)
        assert control.stats.faults.get("lose") == 1 and not control.stats.foreign
        control.close()
    finally:
        run_store.remove_session_stores(prof.scratch)
    assert writer.intact() == [], "the session's clean-up removed another's files"


# ------------------------------------ writers beside and inside the contract tier

WRITER = textwrap.dedent('''
    """Write and rewrite files in folders until told to stop; record them.

    Before each rewrite a file is read back: one that does not hold the last write
    (damaged, truncated or deleted meanwhile) is recorded as damaged.
    """
    import json, base64, sys, time
    from pathlib import Path

    theirs, scratch, stop, manifest, inside = sys.argv[1:6]
    theirs, scratch, stop, manifest = map(Path, (theirs, scratch, stop, manifest))
    folders = [theirs]
    last, damaged = {}, []
    gen = 0
    stores = set()
    while not stop.exists():
        runs = scratch / "run-stores"
        if len(folders) == 1 and runs.is_dir():
            # the suite made its scratch and store folders: write beside them
            folders += [scratch / "user-files", runs / "9999999-dead"]
            for f in folders[1:]:
                f.mkdir(exist_ok=True)
        if inside == "1" and runs.is_dir():
            # and inside the session's own store folder, once the connector made it
            for f in runs.glob("*-*/example-store"):
                if f.parent.name != "9999999-dead" and f not in stores:
                    stores.add(f)
                    folders.append(f)
        for folder in folders:
            for name in ("config.json", "layer.0.safetensors", "entry.bin"):
                path = folder / name
                if str(path) in last:
                    try:
                        ok = path.read_bytes() == base64.b64decode(last[str(path)])
                    except OSError:
                        ok = False
                    if not ok:
                        damaged.append(str(path))
                data = (f"{folder.name}/{name}/{gen}:" * 64).encode()
                try:
                    path.write_bytes(data)
                except OSError:
                    continue
                last[str(path)] = base64.b64encode(data).decode()
        gen += 1
        time.sleep(0.02)
    manifest.write_text(json.dumps({"generations": gen, "inside_scratch":
                                    len(folders) >= 3, "stores": len(stores),
                                    "damaged": damaged, "files": last}))
''')


def _with_writer(tmp_path: Path, inside: bool, body: Callable[[Path, Path], Any]
                 ) -> tuple[Any, dict]:
    theirs, scratch = tmp_path / "theirs", tmp_path / "scratch"
    theirs.mkdir()
    stop, manifest = tmp_path / "stop", tmp_path / "manifest.json"
    (tmp_path / "writer.py").write_text(WRITER)
    writer = subprocess.Popen([sys.executable, str(tmp_path / "writer.py"),
                               str(theirs), str(scratch), str(stop), str(manifest),
                               "1" if inside else "0"])
    try:
        out = body(theirs, scratch)
        time.sleep(0.2)
    finally:
        stop.write_text("stop")
        writer.wait(timeout=60)
    record = json.loads(manifest.read_text())
    files = record["files"]
    assert record["generations"] >= 20 and len(files) >= 3 * 3, record
    assert record["damaged"] == [], record["damaged"]
    for path, data in files.items():
        assert Path(path).read_bytes() == base64.b64decode(data), path
    return out, record


def test_a_writer_beside_the_contract_tier_keeps_every_byte(tmp_path: Path) -> None:
    def body(theirs: Path, scratch: Path) -> Any:
        prof = _profile(tmp_path, f'[scratch]\ndir = "{scratch}"\n')
        run = run_suite([STORE_FAULT_TESTS, "-k", STORE_FAULT_K,
                         f"--tvc-profile={prof}", "-p", "no:xdist"], tmp_path / "r",
                        timeout_s=600)
        # a profile whose store is the writer's folder is refused, nothing run
        bad = _profile(tmp_path, f'[connector]\nname = "ExampleConnector"\n'
                       f'extra_config = {{ shared_storage_path = "{theirs}" }}\n'
                       f'[scratch]\ndir = "{scratch}"\n', "theirs.toml")
        refused = run_suite([STORE_FAULT_TESTS, "-k", STORE_FAULT_K,
                             f"--tvc-profile={bad}"], tmp_path / "r2", timeout_s=300)
        return run, refused

    (run, refused), record = _with_writer(tmp_path, False, body)
    theirs, scratch = tmp_path / "theirs", tmp_path / "scratch"
    # the premise: the store faults were injected while the writer wrote, inside
    # and outside the suite's scratch
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert run.rc == 0, run.tail()
    assert summary["counts"].get("failed", 0) == 0, summary["counts"]
    assert summary["counts"].get("xfailed", 0) >= MIN_DAMAGING_CASES, (
        summary["counts"])
    assert record["inside_scratch"], record
    for folder in (theirs, scratch / "user-files", scratch / "run-stores" /
                   "9999999-dead"):
        assert sorted(str(p) for p in folder.iterdir()) == sorted(
            p for p in record["files"] if Path(p).parent == folder), folder
    # the suite's own session store is gone (run-stores itself stays: it holds a
    # folder the suite did not make)
    left = [p.name for p in (scratch / "run-stores").iterdir()
            if p.name not in ("9999999-dead", run_store.OWNER_MARKER)]
    assert left == [], left
    # the refused profile: exit 4, one line naming the key, no run folder
    lines = [line for line in refused.stdout.splitlines() if line.strip()]
    assert refused.rc == 4 and len(lines) == 1, refused.tail()
    assert "key connector.extra_config.shared_storage_path" in lines[0], lines[0]
    assert not (tmp_path / "r2").exists()


def test_a_writer_inside_the_session_store_keeps_every_byte(tmp_path: Path) -> None:
    """A program writing in the session's own store folder during the store-fault
    scenarios: no fault touches its files (the tests skip naming one), and the
    session's clean-up keeps the folder instead of removing them."""
    def body(theirs: Path, scratch: Path) -> Any:
        prof = _profile(tmp_path, f'[scratch]\ndir = "{scratch}"\n')
        return run_suite([STORE_FAULT_TESTS, "-k", STORE_FAULT_K,
                          f"--tvc-profile={prof}", "-p", "no:xdist"], tmp_path / "r",
                         timeout_s=600)

    run, record = _with_writer(tmp_path, True, body)
    assert record["stores"] >= 1, record  # it wrote inside the session store
    assert run.rc == 0 and run.summary is not None, run.tail()
    outcomes = {t["nodeid"].split("[")[-1]: (t["outcome"], t["message"][:200])
                for t in run.summary["tests"]}
    skipped = [t for t in run.summary["tests"] if t["outcome"] == "skipped"]
    assert len(skipped) >= FILE_CASES, outcomes
    for t in skipped:
        assert "store fault not injected" in t["message"], t["message"]
        assert "example-store/" in t["message"], t["message"]
    assert "tvc: kept " in run.stdout and "another program wrote" in run.stdout


def test_writer_test_can_fail(tmp_path: Path) -> None:
    """The byte-for-byte comparison catches damage: the same injector, unguarded."""
    root = tmp_path / "unguarded"
    root.mkdir()
    (root / "theirs.bin").write_bytes(b"t" * 64)
    inj = object.__new__(FileStoreInjector)  # skip the ownership check on purpose
    inj.root, inj._seen, inj.refused, inj.foreign = root, {}, [], None
    entries = inj.entries_since({})  # the writer's file "changed since" an old mark
    inj.corrupt(entries)
    assert (root / "theirs.bin").read_bytes() != b"t" * 64


def test_a_store_held_by_the_connectors_server_gets_no_object_injector() -> None:
    """The connector object's dicts are not the KV of a server-held store."""
    from tvc.contract.faults import ObjectStoreInjector

    conn = SimpleNamespace(index={})
    rig = SimpleNamespace(
        vllm_config=SimpleNamespace(kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"lmcache.mp.port": 5555})),
        scheduler=SimpleNamespace(connector=conn))
    served = {"connector": {"fault_injector": ""}, "kv_server": {"kind": "lmcache"}}
    assert fault_injector_for(served, rig) is None
    in_process = {"connector": {"fault_injector": ""}, "kv_server": {"kind": ""}}
    assert isinstance(fault_injector_for(in_process, rig), ObjectStoreInjector)


def test_an_exploration_writes_nothing_in_the_working_folder(tmp_path: Path) -> None:
    """Hypothesis keeps its caches in the suite's scratch, not ``.hypothesis`` in
    the user's working folder (it writes its constants cache on every run)."""
    cwd = tmp_path / "project"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in (*SUITE_ENV_VARS, "HYPOTHESIS_STORAGE_DIRECTORY")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
         f"--rootdir={REPO_ROOT}", "-c", str(REPO_ROOT / "pyproject.toml"),
         str(REPO_ROOT / "suites/contract/test_exploration.py"), "-k", "one_token",
         "--tvc-depth=quick", f"--tvc-report-dir={tmp_path / 'run'}"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 xfailed" in proc.stdout or "1 passed" in proc.stdout, proc.stdout[-2000:]
    assert list(cwd.iterdir()) == [], sorted(p.name for p in cwd.iterdir())
