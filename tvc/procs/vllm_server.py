"""One owner for a ``vllm serve`` process, and the helpers the fixtures build it with.

:class:`VllmServer` (a context manager) builds the argv, claims a free port (safe under
xdist), sets ``VLLM_SERVER_DEV_MODE=1`` (for ``POST /reset_prefix_cache``) and
``HF_HUB_OFFLINE=1``, starts the server in its own process group with a log file, and
polls ``/health`` while checking the process lives. Leaving the block kills the group
(SIGTERM, wait, SIGKILL) and checks with psutil that nothing survived.

One GPU server at a time: two servers starting on one GPU race for its memory
("Available KV cache memory: -0.01 GiB" on the GPU host), so an ``exclusive_gpu`` server
first parks any other of this process. Separate pytest processes are not coordinated.
HTTP: :mod:`tvc.procs.client`; see docs/servers.md.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil
import requests

from tvc.core.error_hints import hint_prefix
from tvc.core.run_store import isolate_store_paths
from tvc.procs.client import ServerError, VllmClient
from tvc.procs.polling import PollTimeout, wait_until
from tvc.procs.process import alive, family, stop_tree
from tvc.procs.server_env import NO_TELEMETRY_ENV, server_environ

VLLM_LAUNCHER = (sys.executable, "-m", "vllm.entrypoints.openai.api_server")
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1",
              "PYTHONUNBUFFERED": "1", **NO_TELEMETRY_ENV}
# A tiny model starts in 55-92 s on the GPU host, a 7B model in a few minutes: 600 s
# bounds both without hanging a run forever.
DEFAULT_STARTUP_TIMEOUT_S = 600.0
DEFAULT_STOP_TIMEOUT_S = 30.0  # SIGTERM grace before SIGKILL
HEALTH_POLL_S = 0.5
LOG_TAIL_LINES = 40
LOG_LEVEL_ENV = "VLLM_LOGGING_LEVEL"  # vllm/envs.py (0.26 and 0.28), default INFO
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


# ----------------------------------------------------------------------------- ports

def _port_registry() -> Path:
    path = Path(tempfile.gettempdir()) / f"tvc-ports-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def free_port(host: str = "127.0.0.1", max_tries: int = 50) -> int:
    """Pick a TCP port that is free now and not handed out before (by any process).

    The OS picks it (bind to 0); it is claimed with ``O_EXCL`` on
    ``$TMPDIR/tvc-ports-<uid>/<port>`` so xdist workers never share one; claims expire
    after an hour.

    Raises:
        ServerError: no unclaimed free port in ``max_tries`` attempts.

    """
    registry = _port_registry()
    now = time.time()
    for entry in registry.iterdir():
        with contextlib.suppress(OSError):
            if now - entry.stat().st_mtime > 3600:
                entry.unlink()
    for _ in range(max_tries):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        try:
            fd = os.open(registry / str(port), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return port
    raise ServerError(f"no free TCP port on {host} after {max_tries} tries")


# ----------------------------------------------------------------------------- server

_LIVE: set[VllmServer] = set()
_LIVE_LOCK = threading.Lock()
_GPU_HOLDER: list[VllmServer] = []  # the exclusive server running now (0 or 1)


def _stop_all_at_exit() -> None:
    for srv in list(_LIVE):
        with contextlib.suppress(Exception):
            srv.stop()


atexit.register(_stop_all_at_exit)

try:  # resolved in the parent: the child only calls it between fork and exec
    _PRCTL: Callable[..., int] | None = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _PRCTL = None


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the thread that started it exits."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


class VllmServer:
    """Owns one ``vllm serve`` process (OpenAI API server) and its process group.

    A context manager; ``__enter__`` returns once ``/health`` answers 200. ``model`` (a
    local directory is made absolute, else a hub name) goes to ``--model``;
    ``kv_transfer_config`` None means no connector; ``log_path`` is appended to; ``env``
    overrides a copy of ``os.environ`` plus :data:`SERVER_ENV`; ``port`` defaults to
    :func:`free_port` on each start; ``launcher`` defaults to ``python -m
    vllm.entrypoints.openai.api_server``; ``cwd`` to the log's folder (nothing in the
    repo root shadows imports). ``die_with_parent``: Linux SIGTERMs the server when the
    starting thread exits. ``exclusive_gpu`` holds the process's one GPU slot (parks any
    other; pooled servers never park). ``whole_gpu``: alone on its GPU(s) in a pool.

    Attributes:
        port: the port of the current (or last) start; 0 before the first.
        parked_by: the server whose start parked this one (None when not parked).
        pool: the :class:`tvc.procs.pool.ServerPool` that admits and places it, or None.
        placement_env / placement_args: what the pool adds (``CUDA_VISIBLE_DEVICES``,
            ``--kv-cache-memory-bytes``, ``--gpu-memory-utilization``).
        claimed: a caller started (or waited for) it; an unclaimed prestarted server may
            be stopped by the pool to make room.

    """

    def __init__(self, model: str | os.PathLike[str], *,
                 kv_transfer_config: Mapping[str, Any] | None = None,
                 serve_args: Sequence[str] = (), log_path: str | os.PathLike[str],
                 env: Mapping[str, str] | None = None, host: str = "127.0.0.1",
                 port: int | None = None,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
                 stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
                 launcher: Sequence[str] = VLLM_LAUNCHER,
                 cwd: str | os.PathLike[str] | None = None,
                 die_with_parent: bool = True, exclusive_gpu: bool = True,
                 name: str | None = None, whole_gpu: bool = False) -> None:
        self.model = absolute_model_path(model)
        self.kv_transfer_config = (dict(kv_transfer_config)
                                   if kv_transfer_config is not None else None)
        self.serve_args = list(serve_args)
        self.log_path = Path(log_path)
        self.env_overrides = dict(env or {})
        self.host = host
        self._fixed_port = port
        self.port = 0
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.launcher = list(launcher)
        self.cwd = Path(cwd) if cwd is not None else self.log_path.parent
        self.die_with_parent = die_with_parent
        self.exclusive_gpu = exclusive_gpu
        self.name = name or self.log_path.stem
        self.whole_gpu = whole_gpu
        self.pool: Any = None
        self.placement_env: dict[str, str] = {}
        self.placement_args: list[str] = []
        self.claimed = False
        self._bg: threading.Thread | None = None
        self._bg_done = threading.Event()
        self._bg_error: BaseException | None = None
        self._bg_release = threading.Event()
        self._cancel = False
        self.parked_by: VllmServer | None = None
        self.argv: list[str] = []
        self.startup_s = 0.0
        self._proc: subprocess.Popen[bytes] | None = None
        self._family: dict[int, psutil.Process] = {}
        self._survivors: list[psutil.Process] = []

    # -- context manager ------------------------------------------------------------
    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- facts ------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """PID of the server process (also its process-group id), or None."""
        return self._proc.pid if self._proc is not None else None

    def is_alive(self) -> bool:
        """Whether the server process is running."""
        return self._proc is not None and self._proc.poll() is None

    def client(self, timeout_s: float = 300.0) -> VllmClient:
        """Return a new :class:`VllmClient` for this server."""
        return VllmClient(self.url, timeout_s=timeout_s)

    def build_argv(self, port: int) -> list[str]:
        """Return the server's argv for ``port``."""
        argv = [*self.launcher, "--model", self.model, "--host", self.host,
                "--port", str(port)]
        if self.kv_transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return argv + self.serve_args + self.placement_args

    def spec_key(self) -> str:
        """Hex digest of what makes two servers interchangeable.

        Launcher, model, kv config, serve args, env overrides (not port, log,
        placement).
        """
        spec = [self.launcher, self.model, self.kv_transfer_config, self.serve_args,
                sorted(self.env_overrides.items()), self.whole_gpu]
        return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()
                              ).hexdigest()

    def build_env(self) -> dict[str, str]:
        """Return the server's environment (see :mod:`tvc.procs.server_env`).

        ``os.environ`` less ``TVC_*`` and unknown ``VLLM_*``, then :data:`SERVER_ENV`,
        then the overrides.
        """
        return {**server_environ(os.environ), **SERVER_ENV, **self.env_overrides,
                **self.placement_env}

    def log_offset(self) -> int:
        """Return the log file's size in bytes (to read only what follows)."""
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def log_text(self, since: int = 0) -> str:
        """Return the log from byte offset ``since`` (bad bytes replaced)."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(since)
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """Return the last ``lines`` lines of the log."""
        with contextlib.suppress(FileNotFoundError):
            size = self.log_path.stat().st_size
            return "\n".join(
                self.log_text(max(0, size - 200 * lines)).splitlines()[-lines:])
        return ""

    def log_note(self, text: str) -> None:
        """Append a ``=== <time> <text>`` line to the log."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError), self.log_path.open("ab") as log:
            log.write(f"=== {time.strftime('%Y-%m-%dT%H:%M:%S')} {text}\n".encode())

    def leftovers(self) -> list[psutil.Process]:
        """Return the processes of the server's tree alive after :meth:`stop`."""
        return [p for p in self._survivors if alive(p)]

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        """Start the server and wait for ``/health`` (a taken port is retried twice).

        Raises:
            ServerError: the process exited before ``/health`` answered 200, or the
                deadline passed; the message has the last log lines; the process group
                is gone.
            KeyboardInterrupt: passed on after the process group is stopped.

        """
        if self._bg is not None:  # started in the background: wait for it
            self._claim_background()
            return
        if self.is_alive():
            if self.pool is not None:  # shared by the tests of one spec
                self.claimed = True
                return
            raise ServerError(f"server already running (pid {self.pid})")
        self.claimed = True
        t0 = time.time()
        self._start_direct()
        if self.pool is not None:  # the caller waited for this start
            self.pool.timeline.wait(self.name, t0, time.time())

    def _start_direct(self) -> None:
        self._cancel = False
        if self.pool is not None:
            self.pool.admit(self)
        elif self.exclusive_gpu:
            self._take_gpu_slot()
        attempts = 1 if self._fixed_port else 3
        try:
            for attempt in range(attempts):
                try:
                    self._start_once()
                    break
                except ServerError as exc:
                    self.stop()
                    if (attempt + 1 < attempts and not self._cancel
                            and "Address already in use" in str(exc)):
                        if self.pool is not None:
                            self.pool.admit(self)
                        continue
                    raise
                except BaseException:
                    self.stop()
                    raise
        except BaseException as exc:
            if self.pool is not None:
                self.pool.started(self, False, str(exc).splitlines()[0][:300])
            raise
        if self.pool is not None:
            self.pool.started(self, True)

    def start_in_background(self) -> None:
        """Begin :meth:`start` in a thread; :meth:`start` later waits for it.

        The thread lives until the server stops, so ``die_with_parent`` keeps its
        meaning.
        """
        if self._bg is not None or self.is_alive():
            return
        self._bg_done.clear()
        self._bg_release.clear()
        self._bg_error = None
        self._cancel = False

        def run() -> None:
            try:
                self._start_direct()
            except BaseException as exc:  # noqa: BLE001 - handed to start()
                self._bg_error = exc
            finally:
                self._bg_done.set()
            if self._bg_error is None:
                self._bg_release.wait()

        self._bg = threading.Thread(target=run, name=f"start-{self.name}",
                                    daemon=True)
        self._bg.start()

    def start_pending(self) -> bool:
        """Whether a background start was begun and nobody has waited for it yet."""
        return self._bg is not None and not self.claimed

    def _claim_background(self) -> None:
        """Wait for the background start; raise its error (ServerError)."""
        if not self._bg_done.is_set() and self.pool is not None:
            self.pool.hurry(self)
            t0 = time.time()
            self._bg_done.wait()
            self.pool.timeline.wait(self.name, t0, time.time())
        self._bg_done.wait()
        self.claimed = True
        err, self._bg_error = self._bg_error, None
        if err is not None:
            self._bg = None
            if isinstance(err, ServerError):
                raise ServerError(f"server {self.name}: {err}") from None
            raise err

    def _take_gpu_slot(self) -> None:
        """Park (stop) the exclusive server holding the GPU slot, then take it.

        Raises:
            ServerError: the parked server left processes behind (holding GPU memory).

        """
        with _LIVE_LOCK:
            holders = [s for s in _GPU_HOLDER if s is not self]
            _GPU_HOLDER[:] = [self]
        for other in holders:
            if not other.is_alive():
                continue
            with contextlib.suppress(OSError), other.log_path.open("ab") as log:
                log.write(f"=== {time.strftime('%Y-%m-%dT%H:%M:%S')} parked: one "
                          f"vLLM server per GPU at a time, {self.log_path.name} "
                          "starts\n".encode())
            other.stop()
            other.parked_by = self
            left = other.leftovers()
            if left:
                raise ServerError(
                    f"stopping the server of {other.log_path} to free the GPU left "
                    f"{len(left)} process(es) alive: "
                    + ", ".join(f"pid {p.pid}" for p in left)
                    + "; kill them and report this as a suite bug")
        self.parked_by = None

    def ensure_running(self) -> bool:
        """Start the server again if it is not running (parked, or died).

        Returns True when it had to start (new port, empty GPU prefix cache); raises as
        :meth:`start`.
        """
        if self._bg is not None and not self.claimed:
            self._claim_background()
        if self.is_alive():
            return False
        self.stop()  # reap a dead process and free its port claim
        self.start()
        return True

    def _start_once(self) -> None:
        self.port = self._fixed_port or free_port(self.host)
        self.argv = self.build_argv(self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.cwd.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} start: "
                      f"{' '.join(self.argv)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, env=self.build_env(), cwd=self.cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent if self.die_with_parent else None)
        with _LIVE_LOCK:
            _LIVE.add(self)
        self._family = {}
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        proc = self._proc
        t0 = time.monotonic()
        health = f"{self.url}/health"

        def healthy() -> bool:
            self._remember_family()
            rc = proc.poll()
            if rc is not None:
                recent = self.log_tail(400)  # known causes (tvc/core/error_hints.py)
                recent = recent[recent.rfind("\n=== ") + 1:]  # this start only
                raise ServerError(
                    f"{hint_prefix(recent)}vLLM server exited with code {rc} after "
                    f"{time.monotonic() - t0:.1f} s, before {health} answered; "
                    f"log {self.log_path}, last lines:\n{self.log_tail()}")
            try:
                if requests.get(health, timeout=2.0).status_code == 200:
                    return True
            except requests.RequestException:
                pass
            if self._cancel:
                raise ServerError(f"vLLM server {self.name}: start cancelled (the "
                                  "run is stopping)")
            return False

        try:
            wait_until(healthy, self.startup_timeout_s, HEALTH_POLL_S,
                       f"{health} to answer 200")
        except PollTimeout:
            raise ServerError(
                f"vLLM server (pid {proc.pid}) did not answer {health} "
                f"within {self.startup_timeout_s:.0f} s; raise the startup "
                f"timeout or look at the log {self.log_path}, last lines:\n"
                f"{self.log_tail()}") from None
        self.startup_s = time.monotonic() - t0

    def _remember_family(self) -> None:
        """Record the process tree (children may leave the group; keep them known)."""
        if self._proc is None:
            return
        for p in family(self._proc.pid):
            self._family.setdefault(p.pid, p)

    def stop(self) -> None:
        """Stop the whole process tree: SIGTERM to the group, wait, then SIGKILL.

        Idempotent (safe from ``finally``, atexit or after a failed start);
        :meth:`leftovers` then lists survivors.
        """
        if self._bg is not None and threading.current_thread() is not self._bg:
            self._cancel = not self._bg_done.is_set()
            self._bg_release.set()  # the starting thread may end now
        proc = self._proc
        if proc is None:
            if self._bg is not None and self._bg_done.is_set():
                self._bg = None
            return
        self._remember_family()
        self._survivors = stop_tree(proc, self._family.values(),
                                    grace_s=self.stop_timeout_s)
        self._proc = None
        with _LIVE_LOCK:
            _LIVE.discard(self)
            if self in _GPU_HOLDER:
                _GPU_HOLDER.remove(self)
        if self.port and not self._fixed_port:
            with contextlib.suppress(OSError):
                (_port_registry() / str(self.port)).unlink()
        with contextlib.suppress(OSError), self.log_path.open("ab") as log:
            log.write(f"=== {time.strftime('%Y-%m-%dT%H:%M:%S')} stopped (exit "
                      f"{proc.returncode})\n".encode())
        if self._bg is not None and self._bg_done.is_set():
            self._bg = None
        self.claimed = False
        if self.pool is not None:
            self.pool.left(self)

    def restart(self) -> None:
        """Stop the server and start it again with the same arguments (new port)."""
        self.stop()
        self.start()


def absolute_model_path(model: str | os.PathLike[str]) -> str:
    """The ``--model`` value: an existing local path made absolute, else as given.

    The server's working directory is its log folder, so relative paths must be
    absolute; a hub name (``meta-llama/Llama-3.1-8B``) is returned as ``str(model)``.
    """
    p = Path(model).expanduser()
    return str(p.resolve()) if p.exists() else str(model)


# ------------------------------------------------------------------- pytest fixtures

RUN_DIR_KEY = "tvc_run_dir"  # workerinput key: the run folder (set by tvc.plugin.hooks)
def current_test() -> str:
    """Node id of the test running now (``PYTEST_CURRENT_TEST``), or ''."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]


def profile_server(profile: Any, model: str | os.PathLike[str], log_path: Path,
                   **overrides: Any) -> VllmServer:
    """A (not yet started) :class:`VllmServer` serving ``profile``'s connector.

    ``overrides`` replace the profile's :class:`VllmServer` arguments (an ``env``
    override adds key by key to ``connector.env`` then ``[vllm] env``). Store paths in
    scratch or a test device are moved to this session's store folder
    (:func:`tvc.core.run_store.isolate_store_paths`: shared by the session's servers,
    kept over restarts, removed at the end). A connector server logs at
    ``connector.hit_log_level`` (``VLLM_LOGGING_LEVEL``, vllm/envs.py 0.26 and 0.28)
    unless ``env`` sets it.
    """
    kwargs: dict[str, Any] = {
        "kv_transfer_config": profile.kv_transfer_config(),
        "serve_args": profile["vllm"]["serve_args"],
        "log_path": log_path,
    }
    # the connector's environment ([connector] env), then vLLM's ([vllm] env)
    profile_env = {k: str(v) for k, v in {
        **dict(profile["connector"].get("env") or {}),
        **dict(profile["vllm"].get("env") or {})}.items()}
    if profile_env:
        kwargs["env"] = profile_env
    kwargs.update(overrides)
    if profile_env and "env" in overrides:  # an override adds to the profile's
        kwargs["env"] = {**profile_env, **dict(overrides["env"] or {})}
    level = dict(profile["connector"]).get("hit_log_level", "")
    if level and kwargs.get("kv_transfer_config") is not None:
        kwargs["env"] = {LOG_LEVEL_ENV: level, **dict(kwargs.get("env") or {})}
    if kwargs.get("kv_transfer_config") is not None:
        # this session's own store: no KV of an earlier run, removed at the end
        kwargs["kv_transfer_config"] = isolate_store_paths(
            kwargs["kv_transfer_config"], profile.scratch,
            devices=profile["store"]["test_devices"])
    return VllmServer(model, **kwargs)
