"""A fresh connector store location for every test session, removed at its end.

A persistent store reused across runs turns a replayed run's cold prompts into false
hits and grows without end. :func:`isolate_store_paths` moves every
``kv_connector_extra_config`` path under the profile's scratch (or a
``[store] test_devices`` folder) into this session's
``<scratch>/run-stores/<pid>-<random>/`` (:func:`session_store_root`), removed when
the session ends (:func:`remove_session_stores`); a killed run's folders go at the
next session's start. Ownership: the suite deletes only folders holding its
:data:`OWNER_MARKER` that name it (:func:`make_owned_dir`, :func:`owner_of`,
:func:`remove_owned_dir`); see docs/safety.md.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import json
import os
import shutil
import stat
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

STORES_DIRNAME = "run-stores"  # <profile scratch>/run-stores/<pid>-<hex>/
EXTRA_CONFIG_KEY = "kv_connector_extra_config"
OWNER_MARKER = ".tvc-owned"  # JSON: {"suite", "pid", "id", "run", "created_utc"}
SUITE = "tutti-vllm-conformance"
RUN_ID = uuid.uuid4().hex[:12]  # this process's run, recorded in the markers it writes
MAX_MARKER_BYTES = 4096  # a marker is a few dozen bytes; anything bigger is not ours

# profile scratch (normalized) -> this process's store root. Process-wide on purpose:
# the folders belong to the process (its pid is in their markers) and are removed
# at exit and by signal handlers, where no pytest config is at hand.
_ROOTS: dict[Path, Path] = {}
_ATEXIT_REGISTERED = False


def _norm(path: str | os.PathLike[str]) -> Path:
    return Path(os.path.normpath(os.path.abspath(os.path.expanduser(path))))


def _facts(folder_id: str = "") -> dict[str, Any]:
    return {"suite": SUITE, "pid": os.getpid(), "id": folder_id or uuid.uuid4().hex[:8],
            "run": RUN_ID,
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _write_marker(marker: Path, facts: dict[str, Any]) -> None:
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w") as fh:
        json.dump(facts, fh)


def _read_marker(marker: Path) -> dict[str, Any] | None:
    try:
        if marker.is_symlink() or not marker.is_file() or (
                marker.stat().st_size > MAX_MARKER_BYTES):
            return None
        facts = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(facts, dict) or facts.get("suite") != SUITE:
        return None
    return facts


def make_owned_dir(path: Path, folder_id: str = "") -> Path:
    """Create ``path`` (and parents) and mark it as made by this process.

    ``folder_id`` is recorded in the marker (e.g. the ``<hex>`` of ``<pid>-<hex>``;
    default a fresh random one). FileExistsError if ``path`` exists (never adopted).
    """
    path.mkdir(parents=True)
    _write_marker(path / OWNER_MARKER, _facts(folder_id))
    return path


def ownership_problem(path: Path) -> str:
    """Why the suite may not write or delete in folder ``path`` ('' when it may).

    The suite owns a folder holding its :data:`OWNER_MARKER`, or one not yet there;
    not an unmarked folder (even empty), a file, a symlinked marker or an unreadable
    folder. The phrase is for a one-line error, e.g. ``"an existing folder of 3
    entries the suite did not create (no .tvc-owned marker)"``.
    """
    try:
        if path.is_symlink():
            return "a symbolic link (the suite owns only real folders)"
        if not path.exists():
            return ""
        if not path.is_dir():
            return "an existing file, not a folder"
        if owner_of(path) is not None:
            return ""
        with os.scandir(path) as it:
            entries = sum(1 for _ in it)
    except OSError as exc:
        return f"not usable ({exc.strerror or type(exc).__name__})"
    what = "an existing empty folder" if entries == 0 else (
        f"an existing folder of {entries} entries")
    return f"{what} the suite did not create (no {OWNER_MARKER} marker)"


class NotOwnedError(OSError):
    """A folder the suite would write in holds files it did not create."""


def claim_dir(path: Path, adopt_unmarked: bool = False) -> Path:
    """Make ``path`` a folder the suite owns: ``mkdir`` (never ``exist_ok``) and mark.

    ``adopt_unmarked`` also marks an existing unmarked folder (only for the suite's
    own ``<checkout>/.scratch/<name>``, whose folders predate markers).

    Raises:
        NotOwnedError: ``path`` exists and is not the suite's
            (:func:`ownership_problem`), or appeared between check and ``mkdir``.

    """
    if adopt_unmarked and path.is_dir() and not path.is_symlink():
        if owner_of(path) is None:
            with contextlib.suppress(FileExistsError):
                _write_marker(path / OWNER_MARKER, {**_facts(), "adopted": True})
        return path
    why = ownership_problem(path)
    if why:
        raise NotOwnedError(f"{path}: {why}")
    if owner_of(path) is None:
        try:
            make_owned_dir(path)
        except FileExistsError:
            raise NotOwnedError(f"{path}: created by another program meanwhile (the "
                                "suite owns only folders it creates)") from None
    return path


def mark_if_missing(path: Path) -> Path:
    """Create ``path`` with the suite's marker when it does not exist yet; return it.

    For the first writer outside a suite run (a script's rig, a session store).
    """
    if not path.exists():
        with contextlib.suppress(FileExistsError):
            make_owned_dir(path)
    return path


def owned_ancestor(path: Path) -> Path | None:
    """The nearest folder at or above ``path`` that holds the suite's marker."""
    for folder in (_norm(path), *_norm(path).parents):
        if owner_of(folder) is not None:
            return folder
    return None


def made_in_this_run(path: Path) -> Path | None:
    """The nearest folder at or above ``path`` this process made in this run.

    Its marker names this ``pid`` and :data:`RUN_ID`; never an adopted folder.
    """
    for folder in (_norm(path), *_norm(path).parents):
        facts = owner_of(folder)
        if facts is not None and facts.get("pid") == os.getpid() and (
                facts.get("run") == RUN_ID) and not facts.get("adopted"):
            return folder
    return None


def owner_of(path: Path) -> dict[str, Any] | None:
    """The marker's facts (``suite``, ``pid``, ``id``, ``created_utc``), or None.

    None unless ``path`` is a real folder (no symlink) with a regular-file marker.
    """
    try:
        if path.is_symlink() or not path.is_dir():
            return None
    except OSError:
        return None
    return _read_marker(path / OWNER_MARKER)


def file_marker(file: Path) -> Path:
    """The ownership marker of a suite-made file: ``<file>.tvc-owned`` beside it."""
    return file.with_name(file.name + OWNER_MARKER)


def mark_file_owned(file: Path) -> None:
    """Record that the suite makes ``file`` (call before creating it; idempotent)."""
    with contextlib.suppress(FileExistsError):
        _write_marker(file_marker(file), _facts())


def file_owned(file: Path) -> bool:
    """Whether ``file`` carries the suite's ownership marker."""
    return _read_marker(file_marker(file)) is not None


def remove_owned_file(file: Path) -> bool:
    """Remove ``file`` and its marker if the suite's marker is there; True if so."""
    if not file_owned(file) or file.is_symlink():
        return False
    file.unlink(missing_ok=True)
    file_marker(file).unlink(missing_ok=True)
    return True


def remove_owned_dir(path: Path, pid: int | None = None, folder_id: str | None = None
                     ) -> bool:
    """Remove a folder only if its marker names ``pid``/``folder_id`` (None: any)."""
    facts = owner_of(path)
    if facts is None or (pid is not None and facts.get("pid") != pid) or (
            folder_id is not None and facts.get("id") != folder_id):
        return False
    _remove_marker_last(path, facts)
    return not path.exists()


def _remove_marker_last(path: Path, facts: dict[str, Any], tries: int = 3) -> None:
    """Empty ``path`` and remove it, its marker last (kept if a writer adds files)."""
    for _ in range(tries):
        try:
            rest = [c for c in path.iterdir() if c.name != OWNER_MARKER]
        except OSError:
            return
        if not rest:
            break
        for child in rest:
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    child.unlink()
    else:
        return
    try:
        (path / OWNER_MARKER).unlink()
        path.rmdir()
    except OSError:
        if path.is_dir() and not (path / OWNER_MARKER).exists():
            with contextlib.suppress(OSError):
                _write_marker(path / OWNER_MARKER, facts)


def remove_if_only_marker(path: Path) -> bool:
    """Remove a suite-made folder that holds only its marker; True if removed."""
    if owner_of(path) is None:
        return False
    try:
        if [p.name for p in path.iterdir()] != [OWNER_MARKER]:
            return False
        (path / OWNER_MARKER).unlink()
        path.rmdir()
    except OSError:
        return False
    return True


def _split_name(folder: Path) -> tuple[int, str] | None:
    pid_text, _, folder_id = folder.name.partition("-")
    if not pid_text.isdigit() or not folder_id:
        return None
    return int(pid_text), folder_id


def remove_orphaned_stores(scratch: Path) -> list[Path]:
    """Remove ``<scratch>/run-stores/<pid>-<id>`` folders of runs that are gone.

    Only when the marker names that same pid and id and the process no longer runs;
    returns the folders removed.
    """
    parent = _norm(scratch) / STORES_DIRNAME
    removed: list[Path] = []
    if not parent.is_dir() or parent.is_symlink():
        return removed
    for folder in sorted(parent.iterdir()):
        name = _split_name(folder)
        if name is None or name[0] == os.getpid() or psutil.pid_exists(name[0]) or (
                (owner_of(folder) or {}).get("kept")):
            continue
        if remove_owned_dir(folder, pid=name[0], folder_id=name[1]):
            removed.append(folder)
    return removed


def session_store_root(scratch: Path) -> Path:
    """``<scratch>/run-stores/<pid>-<8 hex digits>``: this session's store folder.

    Made on first use, holding only its marker; the same for the process's life (one
    session or xdist worker), so a server restart finds what was stored before it.
    """
    global _ATEXIT_REGISTERED
    key = _norm(scratch)
    root = _ROOTS.get(key)
    if root is not None and root.is_dir():
        return root
    mark_if_missing(key)
    remove_orphaned_stores(key)
    parent = key / STORES_DIRNAME
    if not parent.exists():
        with contextlib.suppress(FileExistsError):  # another session made it first
            make_owned_dir(parent)
    folder_id = uuid.uuid4().hex[:8]
    root = make_owned_dir(parent / f"{os.getpid()}-{folder_id}", folder_id)
    _ROOTS[key] = root
    if not _ATEXIT_REGISTERED:
        atexit.register(remove_session_stores)
        _ATEXIT_REGISTERED = True
    return root


Identity = tuple[int, int, int, int]  # st_dev, st_ino, st_mtime_ns, st_size
SETTLE_S = 0.1  # a folder no one writes in shows no change for this long (a writer
#   of many files a second changes one within it; mtimes are at most ~10 ms coarse)
MAX_LOAD_FACTOR = 10.0  # settle_s grows with the box's load up to 10x


def file_identities(root: Path) -> dict[Path, Identity]:
    """Every regular file under ``root`` (no symlinks) with its identity."""
    out = {}
    for p in root.rglob("*") if root.is_dir() and not root.is_symlink() else ():
        with contextlib.suppress(OSError):
            st = p.lstat()
            if stat.S_ISREG(st.st_mode):
                out[p] = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
    return out


def settle_s() -> float:
    """:data:`SETTLE_S` times the load per CPU (1 to :data:`MAX_LOAD_FACTOR`)."""
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        load = 1.0
    return SETTLE_S * min(max(1.0, load), MAX_LOAD_FACTOR)


END_WATCH_S = 1.2  # how long a session store is watched before it is removed: a
#   writer of one file a second in it was missed by one settle time (fresh-user trial)


def _written_now(root: Path, watch_s: float | None = None) -> Path | None:
    """A file that changes under ``root`` within ``watch_s`` (None: quiet).

    ``watch_s`` defaults to a settle time; polled every settle time, so a change
    ends the wait.
    """
    settle = settle_s()
    deadline = time.monotonic() + (settle if watch_s is None else watch_s)
    before = file_identities(root)
    while True:
        time.sleep(settle)
        after = file_identities(root)
        changed = sorted(p for p in before.keys() | after.keys()
                         if before.get(p) != after.get(p))
        if changed or time.monotonic() >= deadline:
            return changed[0] if changed else None


#: how a store-fault test that met another writer in the store folder skips
#: (:class:`tvc.contract.faults.ForeignWriter`; the verdict line counts them)
FOREIGN_WRITER = "store fault not injected"
# session store root -> a file another program changed in it (seen by the store
# fault injector): the folder is kept at the end, not removed with that file
_FOREIGN: dict[Path, Path] = {}


def note_foreign_writer(inside: Path, file: Path) -> None:
    """Remember that another program writes in this session's store folder.

    ``inside`` is a folder in it (the injector's root), ``file`` the changed file. The
    clean-up then keeps that folder (marked ``kept``) and says so in one line.
    """
    for root in _ROOTS.values():
        if _norm(inside).is_relative_to(root):
            _FOREIGN.setdefault(root, file)


def _keep(root: Path, file: Path) -> None:
    facts = owner_of(root)
    if facts is None:
        return
    tmp = root / f"{OWNER_MARKER}.{os.getpid()}.tmp"
    with contextlib.suppress(OSError):
        _write_marker(tmp, {**facts, "kept": f"another program wrote {file}"})
        os.replace(tmp, root / OWNER_MARKER)
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"tvc: kept {root}: another program wrote {file} in it; "
                         "the suite removes only stores it alone wrote: remove the "
                         "folder once that program is done\n")


def remove_session_stores(scratch: Path | None = None) -> list[Path]:
    """Remove the store folders this process made (end of the session).

    A folder another program wrote in (:func:`note_foreign_writer`, or files still
    changing over :data:`END_WATCH_S`) is kept, marked ``kept`` and named on stderr.
    ``scratch``: only that scratch's folder (None: all). Returns the folders
    removed; ``<scratch>/run-stores`` goes too when the suite made it and it is empty.
    """
    removed = []
    keys = list(_ROOTS) if scratch is None else [_norm(scratch)]
    for key in keys:
        root = _ROOTS.pop(key, None)
        if root is None:
            continue
        name = _split_name(root)
        foreign = _FOREIGN.pop(root, None) or _written_now(root, END_WATCH_S)
        if foreign is not None:  # the session's connectors are stopped by now
            _keep(root, foreign)
        elif name is not None and remove_owned_dir(root, pid=os.getpid(),
                                                   folder_id=name[1]):
            removed.append(root)
        remove_if_only_marker(root.parent)
    return removed


def resolved_path_of(value: Any) -> str | None:
    """The absolute path a resolved store path string is, else None.

    The load resolved every store path (:func:`tvc.config.checks.resolve_store_paths`)
    to an absolute path, a ``file:`` URL's too.
    """
    return value if isinstance(value, str) and os.path.isabs(value) else None


def _relocate(value: Any, moves: list[tuple[Path, Path]]) -> Any:
    if isinstance(value, Mapping):
        return {k: _relocate(v, moves) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_relocate(v, moves) for v in value)
    text = resolved_path_of(value)
    if text is None:
        return value
    path = _norm(text)
    for base, root in moves:
        if path.is_relative_to(root):
            return value  # already this session's
        if path.is_relative_to(base):
            return str(root / path.relative_to(base))
    return value


def _mentions(value: Any, base: Path) -> bool:
    if isinstance(value, Mapping):
        return any(_mentions(v, base) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_mentions(v, base) for v in value)
    text = resolved_path_of(value)
    return text is not None and _norm(text).is_relative_to(base)


def isolate_store_paths(kv_transfer_config: Mapping[str, Any], scratch: Path,
                        root: Path | None = None,
                        devices: Sequence[str | os.PathLike[str]] = ()
                        ) -> dict[str, Any]:
    """A copy of ``kv_transfer_config`` whose store paths are this session's.

    Every string in ``kv_connector_extra_config`` (nested too) that is an absolute path
    inside ``scratch`` moves to the same relative path under
    ``root``; one inside a ``devices`` folder ``D`` goes under
    ``D/run-stores/<pid>-<hex>/``. The input is not modified. ``root`` defaults to
    :func:`session_store_root` of ``scratch`` (made only when a path moves);
    ``devices`` are the profile's ``[store] test_devices`` (device nodes are kept).

    Returns:
        e.g. ``{"shared_storage_path": "<scratch>/example-store"}`` becomes
        ``{"shared_storage_path": "<scratch>/run-stores/<pid>-<hex>/example-store"}``.

    """
    out = copy.deepcopy(dict(kv_transfer_config))
    extra = out.get(EXTRA_CONFIG_KEY)
    if not isinstance(extra, Mapping):
        return out
    moves: list[tuple[Path, Path]] = []
    scratch_n = _norm(scratch)
    if root is not None:
        moves.append((scratch_n, _norm(root)))
    elif _mentions(extra, scratch_n):
        moves.append((scratch_n, session_store_root(scratch_n)))
    for dev in devices:
        base = _norm(dev)
        if base.is_dir() and not base.is_relative_to(scratch_n) and _mentions(
                extra, base):
            moves.append((base, session_store_root(base)))
    # the deepest base first: a device folder inside another is its own
    moves.sort(key=lambda m: len(m[0].parts), reverse=True)
    out[EXTRA_CONFIG_KEY] = _relocate(extra, moves)
    return out
