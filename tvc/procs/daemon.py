"""The storage daemon: one owner that brings the GPU-direct store up and down.

:class:`StorageDaemon` follows the operators' bring-up from ``[daemon]``: kernel module
loaded, daemon started (argv, env, cwd, log file), ready once every device glob matches
and every mount glob matches a non-empty directory. A daemon already up is reused and
never stopped; one it started is stopped on exit (SIGTERM to its group, then SIGKILL).
Each failure is one :class:`DaemonError`. Fixture: ``storage_daemon`` (session scope).
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tvc.procs.polling import PollTimeout, wait_until
from tvc.procs.process import stop_tree

LOG_TAIL_LINES = 20  # lines of the daemon log quoted in an error
STOP_GRACE_S = 10.0  # seconds between SIGTERM and SIGKILL when stopping
POLL_S = 0.2  # seconds between readiness checks
_PERMISSION = re.compile(r"permission denied|operation not permitted|EACCES|EPERM",
                         re.IGNORECASE)


class DaemonError(Exception):
    """The storage daemon could not be brought up (one readable sentence or more).

    Attributes:
        kind: ``module``, ``permission``, ``not_found``, ``exited``, ``timeout`` or
            ``config``; lets a fixture decide between skip and failure.

    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class DaemonSpec:
    """What to check and start; the fields of a profile's ``[daemon]`` section.

    "" or [] means none: ``kernel_module`` (``<sysfs_root>/module/<name>``), ``argv`` (a
    list, never a shell string), ``log_file`` (output discarded). Each of
    ``device_globs`` must match a path and each of ``mount_globs`` a non-empty directory
    within ``start_timeout_s`` seconds. ``sysfs_root`` is ``/sys`` (tests use a temp
    dir).
    """

    kernel_module: str = ""
    argv: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str = ""
    log_file: str = ""
    device_globs: Sequence[str] = ()
    mount_globs: Sequence[str] = ()
    start_timeout_s: float = 60.0
    sysfs_root: str = "/sys"

    @classmethod
    def from_section(cls, section: Mapping[str, Any], sysfs_root: str = "/sys"
                     ) -> DaemonSpec:
        """Build a spec from a profile's ``[daemon]`` section (already interpolated)."""
        return cls(
            kernel_module=section.get("kernel_module", ""),
            argv=tuple(section.get("argv", ())),
            env={k: str(v) for k, v in dict(section.get("env", {})).items()},
            cwd=section.get("cwd", ""),
            log_file=section.get("log_file", ""),
            device_globs=tuple(section.get("device_globs", ())),
            mount_globs=tuple(section.get("mount_globs", ())),
            start_timeout_s=float(section.get("start_timeout_s", 60.0)),
            sysfs_root=sysfs_root,
        )

    @property
    def manages_anything(self) -> bool:
        """True when the spec names a module, a daemon or globs to wait for."""
        return bool(self.kernel_module or self.argv or self.device_globs
                    or self.mount_globs)


def missing_pieces(spec: DaemonSpec) -> list[str]:
    """Readiness globs not satisfied yet, as phrases (empty = ready).

    E.g. ``["no device node matches /dev/snvme*", "no non-empty mount matches
    /mnt/nvme*"]``.
    """
    out = [f"no device node matches {p}" for p in spec.device_globs
           if not glob.glob(p)]
    for pat in spec.mount_globs:
        full = [p for p in glob.glob(pat) if os.path.isdir(p) and _non_empty(p)]
        if not full:
            out.append(f"no non-empty mount matches {pat}")
    return out


def _non_empty(path: str) -> bool:
    try:
        with os.scandir(path) as it:
            return any(True for _ in it)
    except OSError:
        return False


def module_loaded(name: str, sysfs_root: str = "/sys") -> bool:
    """Whether kernel module ``name`` is loaded (``<sysfs_root>/module/<name>``)."""
    return (Path(sysfs_root) / "module" / name).is_dir()


def log_tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
    """Return the last ``lines`` lines of a log file, or a note that there is none."""
    if not path:
        return "(no log file configured: set [daemon] log_file to see its output)"
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            text = fh.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"(log file {path} unreadable: {exc.strerror})"
    tail = text.splitlines()[-lines:]
    return "\n".join(tail) if tail else f"(log file {path} is empty)"


class StorageDaemon:
    """Context manager owning the storage daemon (reuse, start, wait, stop).

    ``poll_s`` is seconds between readiness checks.
    """

    def __init__(self, spec: DaemonSpec, poll_s: float = POLL_S) -> None:
        self.spec = spec
        self.poll_s = poll_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.reused = False
        self.daemonized = False  # the started process exited 0 (it forked away)
        self._log: Any = None

    @property
    def started(self) -> bool:
        """True when this object started the daemon (and will stop it)."""
        return self.proc is not None

    def __enter__(self) -> StorageDaemon:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Bring the store up, or reuse it when it is already up.

        Raises:
            DaemonError: module not loaded, no permission, daemon not found, daemon
                exited, or readiness timeout.

        """
        s = self.spec
        if s.kernel_module and not module_loaded(s.kernel_module, s.sysfs_root):
            raise DaemonError("module", (
                f"kernel module {s.kernel_module} is not loaded (expected "
                f"{Path(s.sysfs_root) / 'module' / s.kernel_module} to exist). Load it "
                f"first (e.g. `modprobe {s.kernel_module}` or `insmod "
                f"{s.kernel_module}.ko` as root); it does not persist across reboots."))
        missing = missing_pieces(s)
        if not missing:
            self.reused = True  # up already: never restart or stop it
            return
        if not s.argv:
            raise DaemonError("config", (
                f"the store is not up ({'; '.join(missing)}) and the profile names no "
                "daemon to start ([daemon] argv is empty). Start the daemon by hand or "
                "set [daemon] argv."))
        self._spawn()
        self._wait_ready()

    def _spawn(self) -> None:
        s = self.spec
        env = {**os.environ, **s.env}
        try:
            if s.log_file:
                Path(s.log_file).parent.mkdir(parents=True, exist_ok=True)
                self._log = open(s.log_file, "ab")  # noqa: SIM115 - closed in stop()
            out = self._log if self._log is not None else subprocess.DEVNULL
            self.proc = subprocess.Popen(  # noqa: S603 - argv list, no shell
                list(s.argv), env=env, cwd=s.cwd or None, stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        except PermissionError as exc:
            self._close_log()
            raise DaemonError("permission", (
                f"no permission to start the storage daemon {s.argv[0]!r} "
                f"(or to write its log {s.log_file!r}): {exc.strerror}. The daemon "
                "needs root: run the suite as root (or with sudo), or start the "
                "daemon yourself and let the suite reuse it.")) from None
        except FileNotFoundError as exc:
            self._close_log()
            raise DaemonError("not_found", (
                f"cannot start the storage daemon: {exc.filename or s.argv[0]!r} not "
                f"found ({exc.strerror}). Check [daemon] argv and cwd in the profile "
                "(and the variables they use).")) from None

    def _wait_ready(self) -> None:
        s = self.spec
        assert self.proc is not None
        proc = self.proc
        missing: list[str] = []

        def ready() -> bool:
            missing[:] = missing_pieces(s)
            if not missing:
                return True
            rc = proc.poll()
            if rc is not None and rc != 0:
                self._raise_exited(rc, missing)
            if rc == 0:
                self.daemonized = True  # forked into the background; keep waiting
            return False

        try:
            wait_until(ready, s.start_timeout_s, self.poll_s,
                       f"the storage daemon {s.argv[0]!r} to bring the store up")
        except PollTimeout:
            tail = log_tail(s.log_file)
            forked = (" Its launcher exited 0 (it forked away)."
                      if self.daemonized else "")
            self.stop()
            raise DaemonError("timeout", (
                f"the storage daemon {s.argv[0]!r} did not bring the store up "
                f"within {s.start_timeout_s:g} s: {'; '.join(missing)}. It was "
                f"stopped.{forked} "
                "Check its configuration and the kernel log (dmesg); "
                "raise [daemon] start_timeout_s if bring-up is just slow. Log "
                f"tail:\n{tail}")) from None

    def _raise_exited(self, rc: int, missing: list[str]) -> None:
        s = self.spec
        tail = log_tail(s.log_file)
        self.proc = None  # nothing left to stop (its group may hold children)
        self._close_log()
        hint = ("It reports a permission problem: the daemon needs root (run the "
                "suite as root or start the daemon yourself). "
                if _PERMISSION.search(tail) else "")
        how = f"signal {-rc}" if rc < 0 else f"exit status {rc}"
        raise DaemonError("exited", (
            f"the storage daemon {s.argv[0]!r} exited with {how} before the store "
            f"was up ({'; '.join(missing)}). {hint}Read its log "
            f"({s.log_file or 'none configured'}); tail:\n{tail}"))

    def stop(self) -> None:
        """Stop the daemon if, and only if, this object started it.

        SIGTERM to its process group, up to ``STOP_GRACE_S`` seconds, then SIGKILL.
        """
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_tree(proc, grace_s=STOP_GRACE_S)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
