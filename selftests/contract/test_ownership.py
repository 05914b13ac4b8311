"""The suite touches only what it created: folders it may own, entries it saw written.

Load-time rules (:func:`tvc.store.run_store.ownership_problem`): a scratch dir, a
``store.path`` or a connector store path outside scratch is new, empty (adopted and
marked) or carries the suite's ``.tvc-owned`` marker; anything else is refused in one
line naming the key. The store fault injector
(:class:`tvc.contract.faults.FileStoreInjector`)
works only inside a marked folder and damages only files it saw written that are
still the same file.

The end-to-end check runs a writer process beside the contract tier's store-fault
tests (they delete, bit-flip and truncate store entries) and compares the writer's
files byte for byte afterwards: files in a folder of its own outside scratch, in a
folder of its own inside the suite's scratch, and in a folder named like a dead
run's store folder (``run-stores/<pid>-<id>``, without a marker).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from selftests.conftest import run_suite
from tvc.config.profile import ProfileError, claim_owned_paths, load
from tvc.contract.faults import FaultConfigError, FileStoreInjector, fault_injector_for
from tvc.store import run_store

HEAD = '[profile]\nname = "owned"\nextends = "example"\n'
STORE_FAULT_TESTS = "suites/contract/test_scenarios.py"
STORE_FAULT_K = "store_fault and cpu"
# the store-fault cases of the example profile on CPU: lose, corrupt, tear and
# fail_save under both load-failure policies, minus the corrupt/fail and
# fail_save/fail cases the profile deselects or skips; each xfails only when its
# known-failure match (the defect's symptom after the damage) is in the failure
MIN_DAMAGING_CASES = 6


def _profile(tmp_path: Path, body: str, name: str = "owned.toml") -> Path:
    path = tmp_path / name
    path.write_text(HEAD + body)
    return path


def _marker(folder: Path) -> dict:
    return json.loads((folder / run_store.OWNER_MARKER).read_text())


# ------------------------------------------------------------------ load-time rules

def test_new_and_empty_folders_are_claimed_and_marked(tmp_path: Path) -> None:
    empty = tmp_path / "empty-store"
    empty.mkdir()
    path = _profile(tmp_path, f'[scratch]\ndir = "{tmp_path / "new" / "scratch"}"\n'
                    f'[connector]\nname = "ExampleConnector"\n'
                    f'extra_config = {{ shared_storage_path = "{empty}", '
                    'dev = "/dev/null" }\n')
    prof = load(str(path), env={})
    assert not prof.scratch.exists()  # loading writes nothing
    claimed = claim_owned_paths(prof)
    assert claimed == [prof.scratch, empty]
    for folder in claimed:
        facts = _marker(folder)
        assert facts["suite"] == run_store.SUITE and facts["pid"] == os.getpid()
        assert facts["run"] == run_store.RUN_ID
    assert _marker(empty)["adopted"] is True
    assert sorted(p.name for p in empty.iterdir()) == [run_store.OWNER_MARKER]
    # marked now: the next load accepts it even after the connector wrote there
    (empty / "entry.safetensors").write_bytes(b"kv")
    load(str(path), env={})


def test_a_folder_of_user_files_is_refused_everywhere_and_left_as_it_is(
        tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.json").write_text('{"user": 1}')
    before = sorted((p.name, p.read_bytes()) for p in theirs.iterdir())
    for body, key in [
        (f'[scratch]\ndir = "{theirs}"\n', "scratch.dir"),
        (f'[store]\npath = "{theirs}"\n', "store.path"),
        (f'[connector]\nname = "ExampleConnector"\nextra_config = '
         f'{{ shared_storage_path = "{theirs}" }}\n',
         "connector.extra_config.shared_storage_path"),
        (f'[connector]\nname = "ExampleConnector"\nextra_config = '
         f'{{ store = {{ root = "{theirs}/rank{{LOCAL_RANK}}" }} }}\n',
         "connector.extra_config.store.root"),
    ]:
        with pytest.raises(ProfileError) as exc:
            load(str(_profile(tmp_path, body)), env={})
        msg = str(exc.value)
        assert f"key {key}:" in msg and "\n" not in msg, msg
        assert run_store.OWNER_MARKER in msg, msg
    assert sorted((p.name, p.read_bytes()) for p in theirs.iterdir()) == before


def test_a_new_store_folder_is_created_and_marked_by_the_suite(tmp_path: Path
                                                                ) -> None:
    """A store path not there yet (even inside someone's folder) is one the suite
    creates for the run, marked; the folder around it is left as it is."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep")
    path = _profile(tmp_path, f'[scratch]\ndir = "{tmp_path / "scratch"}"\n'
                    '[connector]\nname = "ExampleConnector"\nextra_config = '
                    f'{{ shared_storage_path = "{theirs / "kv" / "store"}", '
                    f'root = "{tmp_path / "nvme"}/rank{{LOCAL_RANK}}" }}\n')
    prof = load(str(path), env={})
    assert not (theirs / "kv").exists()  # loading writes nothing
    claimed = claim_owned_paths(prof)
    assert sorted(claimed) == sorted([prof.scratch, theirs / "kv" / "store",
                                      tmp_path / "nvme"])
    for folder in claimed:
        assert _marker(folder)["run"] == run_store.RUN_ID
    assert run_store.owner_of(theirs) is None  # the folder around it is not claimed
    assert sorted(p.name for p in theirs.iterdir()) == ["kv", "notes.txt"]
    assert (theirs / "notes.txt").read_text() == "keep"
    assert not (tmp_path / "nvme" / "rank{LOCAL_RANK}").exists()  # the connector's


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

def test_file_injector_refuses_a_folder_the_suite_does_not_own(tmp_path: Path
                                                               ) -> None:
    (tmp_path / "theirs").mkdir()
    with pytest.raises(FaultConfigError, match="no folder the suite owns"):
        FileStoreInjector(tmp_path / "theirs")
    extra = {"shared_storage_path": str(tmp_path / "theirs")}
    rig = SimpleNamespace(vllm_config=SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra)))
    with pytest.raises(FaultConfigError, match="shared_storage_path|no folder"):
        fault_injector_for({"connector": {"fault_injector": ""}}, rig)


def test_file_injector_damages_only_files_it_saw_written(tmp_path: Path) -> None:
    root = run_store.claim_dir(tmp_path / "store")
    old = root / "old.bin"
    old.write_bytes(b"o" * 64)  # written before the mark: never an entry
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x" * 64)
    inj = FileStoreInjector(root)
    mark = inj.mark()
    seen = [root / "a.bin", root / "b.bin", root / "c.bin"]
    for p in seen:
        p.write_bytes(bytes(range(64)))
    (root / "link.bin").symlink_to(outside)  # a symlink is never an entry
    entries = inj.entries_since(mark)
    assert entries == seen
    # b.bin is replaced by another writer (a new file) after it was seen
    (root / "b.tmp").write_bytes(b"theirs" * 10)
    os.replace(root / "b.tmp", root / "b.bin")
    inj.corrupt([entries[0], entries[1]])
    assert (root / "a.bin").read_bytes() != bytes(range(64))  # damaged: premise
    assert (root / "b.bin").read_bytes() == b"theirs" * 10
    inj.tear([entries[1]])
    inj.lose([entries[1], old, outside, root / "link.bin"])
    assert (root / "b.bin").read_bytes() == b"theirs" * 10
    assert old.read_bytes() == b"o" * 64 and outside.read_bytes() == b"x" * 64
    inj.lose([entries[2]])
    assert not (root / "c.bin").exists()  # seen and unchanged: lost


# -------------------------------------------------- a writer beside the contract tier

WRITER = textwrap.dedent('''
    """Write and rewrite files in three folders until told to stop; record them."""
    import json, base64, os, sys, time
    from pathlib import Path

    theirs, scratch, stop, manifest = map(Path, sys.argv[1:5])
    folders = [theirs]
    last = {}
    gen = 0
    while not stop.exists():
        if len(folders) == 1 and (scratch / "run-stores").is_dir():
            # the suite made its scratch and store folders: write beside them
            folders += [scratch / "user-files", scratch / "run-stores" / "9999999-dead"]
            for f in folders[1:]:
                f.mkdir(exist_ok=True)
        for folder in folders:
            for name in ("config.json", "layer.0.safetensors", f"entry-{gen % 7}.bin"):
                data = (f"{folder.name}/{name}/{gen}:" * 64).encode()
                path = folder / name
                path.write_bytes(data)
                last[str(path)] = base64.b64encode(data).decode()
        gen += 1
        time.sleep(0.02)
    manifest.write_text(json.dumps({"generations": gen, "inside_scratch":
                                    len(folders) == 3, "files": last}))
''')


def test_a_writer_beside_the_contract_tier_keeps_every_byte(tmp_path: Path) -> None:
    theirs, scratch = tmp_path / "theirs", tmp_path / "scratch"
    theirs.mkdir()
    stop, manifest = tmp_path / "stop", tmp_path / "manifest.json"
    (tmp_path / "writer.py").write_text(WRITER)
    writer = subprocess.Popen([sys.executable, str(tmp_path / "writer.py"),
                               str(theirs), str(scratch), str(stop), str(manifest)])
    try:
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
        time.sleep(0.2)
    finally:
        stop.write_text("stop")
        writer.wait(timeout=60)
    record = json.loads(manifest.read_text())

    # the premise: the store faults were injected while the writer wrote, inside
    # and outside the suite's scratch
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert run.rc == 0, run.tail()
    assert summary["counts"].get("failed", 0) == 0, summary["counts"]
    assert summary["counts"].get("xfailed", 0) >= MIN_DAMAGING_CASES, (
        summary["counts"])
    assert record["inside_scratch"] and record["generations"] >= 20, record
    # every file of the writer holds exactly its last write
    files = record["files"]
    assert len(files) >= 3 * 3, sorted(files)
    for path, data in files.items():
        assert Path(path).read_bytes() == base64.b64decode(data), path
    for folder in (theirs, scratch / "user-files", scratch / "run-stores" /
                   "9999999-dead"):
        assert sorted(str(p) for p in folder.iterdir()) == sorted(
            p for p in files if Path(p).parent == folder), folder
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


def test_writer_test_can_fail(tmp_path: Path) -> None:
    """The byte-for-byte comparison catches damage: the same injector, unguarded."""
    root = tmp_path / "unguarded"
    root.mkdir()
    (root / "theirs.bin").write_bytes(b"t" * 64)
    inj = object.__new__(FileStoreInjector)  # skip the ownership check on purpose
    inj.root, inj._seen = root, {}
    mark: dict = {}
    entries = inj.entries_since(mark)  # the writer's file "changed since" an old mark
    inj.corrupt(entries)
    assert (root / "theirs.bin").read_bytes() != b"t" * 64
