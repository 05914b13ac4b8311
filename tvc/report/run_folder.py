"""The run folder: resolved once, created fresh or an earlier run's, locked.

:func:`default_run_dir` names ``reports/<UTC time>-<profile>/``; :func:`open_run_dir`
creates it (``-2``, ``-3``... when taken) or reuses a ``--tvc-report-dir`` folder
that is new, empty or an earlier run's, and takes its ``flock`` (:data:`LOCK_NAME`),
so a second run on a folder in use is refused in one line. Path errors are one line
(:class:`RunFolderUnusable`), never a traceback. See docs/safety.md#run-folders.
Nothing here imports pytest.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import tempfile
import time
from pathlib import Path

from tvc.config.paths import reports_root

LOCK_NAME = ".tvc-run.lock"  # held (flock) by the run writing in the folder
MAX_PATH_CHARS = 4096  # Linux PATH_MAX (limits.h)
MAX_NAME_CHARS = 255  # Linux NAME_MAX (limits.h)
_OWN_NAMES = (LOCK_NAME,)  # the suite's own files that do not make a folder "used"
# what a run writes in its folder: (name, is a folder); pytest writes junit.xml
# itself, through links, so none may be there
RUN_FILES = (("junit.xml", False), ("summary.json", False), ("summary.md", False),
             ("summary.html", False), ("timeline.json", False),
             ("bandwidth.json", False), ("bandwidth.png", False), ("charts", True),
             ("timeline", True), ("trace", True))
# what an earlier run in a reused folder leaves and a new run removes first (its
# server logs, baseline, live failures, certificate): RUN_FILES and these. Other
# names (a user's notes beside a run) are kept.
EARLIER_RUN_FILES = (*(name for name, _ in RUN_FILES), "logs", "e2e",
                     "failures.md", "certification.json")


class RunFolderUnusable(ValueError):
    """The run folder cannot be used; the message is one line."""


def _why(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or type(exc).__name__


def resolve_run_dir(text: str) -> Path:
    """The absolute path a run-folder setting names (``~`` expanded, links followed).

    Raises:
        RunFolderUnusable: a NUL byte, an unknown ``~user``, over
            :data:`MAX_PATH_CHARS`/:data:`MAX_NAME_CHARS`, or unresolvable
            (``/proc/1/cwd``).

    """
    if "\0" in text:
        raise RunFolderUnusable(f"{text!r} contains a NUL byte")
    expanded = os.path.expanduser(text)
    if expanded.startswith("~"):
        raise RunFolderUnusable(f"cannot expand {expanded.split('/', 1)[0]!r}: no "
                                "such user")
    if len(expanded.encode()) > MAX_PATH_CHARS or any(
            len(part.encode()) > MAX_NAME_CHARS for part in expanded.split("/")):
        raise RunFolderUnusable(
            f"{expanded[:60]!r}... is longer than a path can be ({MAX_PATH_CHARS} "
            f"bytes, {MAX_NAME_CHARS} per name)")
    try:
        return Path(expanded).resolve()
    except (OSError, RuntimeError) as exc:
        raise RunFolderUnusable(f"{expanded} cannot be resolved ({_why(exc)})"
                                ) from None


def default_run_dir(profile_name: str, selftests: bool = False,
                    invocation_dir: Path | None = None) -> Path:
    """A fresh run folder name: ``reports/<YYYYmmdd-HHMMSS>-<profile>``.

    ``reports/`` is :func:`tvc.config.paths.reports_root`. ``selftests`` runs go under
    ``reports/selftests/``, so they never become ``reports/latest``.

    Raises:
        RunFolderUnusable: ``$TVC_REPORTS_ROOT`` cannot be resolved.

    """
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    try:
        base_root = reports_root(invocation_dir)
    except (OSError, RuntimeError) as exc:
        raise RunFolderUnusable(f"TVC_REPORTS_ROOT cannot be resolved ({_why(exc)})"
                                ) from None
    root = base_root / "selftests" if selftests else base_root
    return root / f"{stamp}-{profile_name}"


def holds_suite_run(path: Path) -> bool:
    """True when ``path`` holds a run of this suite.

    Its ``summary.json`` is a JSON object with ``run``, ``counts`` and ``tests``, or
    the folder holds the suite's lock file (a regular file, not a link): a run killed
    before it wrote its summary (SIGKILL, out of memory) leaves that.
    """
    from tvc.core.files import read_json

    lock = path / LOCK_NAME
    if lock.is_file() and not lock.is_symlink():
        return True

    try:
        data = read_json(path / "summary.json")
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"run", "counts", "tests"} <= data.keys()


def check_run_dir(path: Path) -> str:
    """Why ``path`` cannot be a run folder ('' when it can).

    It must be a directory this user can create and write, empty or an earlier run's
    (a stray ``--tvc-report-dir=.`` never mixes reports into someone's files).
    """
    try:
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            return f"{path} exists and is not a directory"
        probe = path
        while not probe.exists():
            probe = probe.parent
        if not os.access(probe, os.W_OK | os.X_OK):
            return f"{probe} is not writable by this user"
        if path.is_dir() and any(p.name not in _OWN_NAMES for p in path.iterdir()
                                 ) and not holds_suite_run(path):
            return (f"{path} is a non-empty folder that holds no earlier run of "
                    "this suite (a summary.json it wrote); choose an empty or new "
                    "folder")
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".tvc-write-test-"):
            pass
    except OSError as exc:  # the only sure test: create it and write into it
        return f"{path} cannot be created or written ({_why(exc)})"
    return ""


def _create_fresh(base: Path) -> Path:
    """Make ``base``, else ``base-2``, ``base-3``...: a folder no one else made."""
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        path = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(errno.EEXIST, f"{base} and 999 more names are taken")


def _lock(path: Path, stamp: bool = True) -> int:
    """Take the folder's lock (held by the returned fd).

    With ``stamp``, write this run's pid and start time into the lock file.
    """
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = {}
        with contextlib.suppress(OSError, ValueError):
            holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        os.close(fd)
        raise RunFolderUnusable(
            f"{path} is in use by another run (pid {holder.get('pid', '?')}, "
            f"started {holder.get('started_utc', '?')}); give each run its own "
            "folder") from None
    except OSError:
        os.close(fd)
        raise
    try:  # the run before released it and removed the file after we opened it
        same = os.path.samestat(os.fstat(fd), os.stat(path / LOCK_NAME,
                                                       follow_symlinks=False))
    except OSError:
        same = False
    if not same:
        os.close(fd)
        return _lock(path, stamp)
    if stamp:
        _stamp(fd)
    return fd


def _stamp(fd: int) -> None:
    """Write this run's pid and start time into a held lock file."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "started_utc": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode(), 0)


def open_run_dir(path: Path, fresh: bool) -> tuple[Path, int]:
    """Create (or reuse) the run folder and lock it for this run.

    ``fresh`` makes a new folder (``path``, else ``path-2``...); otherwise ``path``
    may exist when :func:`check_run_dir` accepts it.

    Returns:
        ``(folder, lock descriptor)``; :func:`release` it once the reports are
        written (the process's end releases it too).

    Raises:
        RunFolderUnusable: not a folder, not writable, someone's files, in use by
            another run, a link where a report goes (:data:`RUN_FILES`).

    """
    try:
        fd = -1
        if fresh:
            path = _create_fresh(path)
        else:
            lock = path / LOCK_NAME
            if path.is_dir() and not path.is_symlink() and lock.is_file() and (
                    not lock.is_symlink()):  # a run in it says so before its files do
                fd = _lock(path, stamp=False)
            why = check_run_dir(path)
            if why:
                release(fd, path)
                raise RunFolderUnusable(why)
            if fd >= 0:
                _stamp(fd)
        if fd < 0:
            fd = _lock(path)
    except OSError as exc:
        raise RunFolderUnusable(f"{path} cannot be created or written "
                                f"({_why(exc)})") from None
    for name, folder in RUN_FILES:  # a link in the way: refused now, not mid-run
        p = path / name
        if p.is_symlink() or (p.exists() and p.is_dir() != folder):
            release(fd, path)
            raise RunFolderUnusable(
                f"{p} is {'a symbolic link' if p.is_symlink() else 'in the way'}; "
                "the suite writes only its own files, never through a link: remove "
                "it")
    if not fresh:  # accepted: empty, or an earlier run's (check_run_dir)
        try:
            _clear_earlier_run(path)
        except OSError as exc:
            release(fd, path)
            raise RunFolderUnusable(f"{path}: the earlier run's files cannot be "
                                    f"removed ({_why(exc)})") from None
    return path, fd


def _clear_earlier_run(path: Path) -> None:
    """Remove what an earlier run wrote (:data:`EARLIER_RUN_FILES`), links unfollowed.

    Its server logs and live failures would otherwise read as this run's.
    """
    import shutil

    for name in EARLIER_RUN_FILES:
        p = path / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)  # removes links inside, never what they point to
        elif p.is_symlink() or p.exists():
            p.unlink()


def release(fd: int, path: Path | None = None) -> None:
    """Release the folder's lock (call once, when the reports are written).

    With ``path`` (the run folder), its lock file goes too while still held, so a
    finished folder holds only the run's files; a run that opened the file just
    before finds it gone and takes a new one (:func:`_lock`).
    """
    if path is not None and fd >= 0:
        with contextlib.suppress(OSError):
            if os.path.samestat(os.fstat(fd), os.stat(path / LOCK_NAME,
                                                      follow_symlinks=False)):
                (path / LOCK_NAME).unlink()
    with contextlib.suppress(OSError):
        os.close(fd)
