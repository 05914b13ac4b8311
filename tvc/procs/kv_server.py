"""The connector's own server: one owner that starts, checks and stops it.

LMCache's multiprocess server for ``LMCacheMPConnector`` (``python -m
lmcache.v1.multiprocess.http_server``) and Mooncake's master for
``MooncakeStoreConnector`` (``mooncake_master`` from ``mooncake-transfer-engine*``).
:class:`KvServer` picks loopback ports, logs to the run folder, starts the server in its
own process group, polls it (LMCache: ``GET /healthcheck`` 200,
``lmcache/v1/multiprocess/http_apis/info_api.py``; Mooncake: RPC port and metrics
endpoint), and stops it (:func:`tvc.procs.process.stop_tree`). Each problem is one
:class:`KvServerError` naming the server. The connector finds it through
:attr:`KvServer.extra_config` and :attr:`KvServer.client_env` (per kind, :data:`KINDS`).
Telemetry is off (``LMCACHE_TRACK_USAGE=false``, ``DO_NOT_TRACK=1``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tvc.procs.daemon import log_tail
from tvc.procs.polling import PollTimeout, wait_until
from tvc.procs.process import stop_tree

HOST = "127.0.0.1"  # the servers listen on loopback only
POLL_S = 0.25  # seconds between health checks while starting
PROBE_TIMEOUT_S = 2.0  # seconds one health probe may take
STOP_GRACE_S = 10.0  # seconds between SIGTERM and SIGKILL
#: no usage data leaves the box (LMCache: lmcache/usage_telemetry/identity.py)
NO_TELEMETRY = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}


class KvServerError(Exception):
    """The connector's server is missing, did not start, died or does not answer.

    Attributes:
        kind: ``not_installed``, ``exited``, ``timeout``, ``dead`` or
            ``unreachable``; a fixture skips on ``not_installed`` only.

    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def free_port() -> int:
    """A TCP port of ``127.0.0.1`` that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def tcp_answers(port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``127.0.0.1:port`` accepts a TCP connection."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def http_ok(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``GET url`` answers 200 within ``timeout_s`` seconds."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310
            return int(resp.status) == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


@dataclass(frozen=True)
class Kind:
    """How one server is found, started, probed and handed to the connector.

    ``ports`` names the ports to pick (the first is the connector's); ``locate`` returns
    the argv prefix or raises :class:`KvServerError` (``not_installed``); ``argv`` is
    ``(prefix, ports, args) -> argv``; ``healthy`` is ``ports -> bool``; ``connect`` is
    ``(ports, folder) -> (extra_config, client_env)`` and may write a config into
    ``folder``.
    """

    label: str
    ports: tuple[str, ...]
    locate: Callable[[], list[str]]
    argv: Callable[[list[str], Mapping[str, int], Sequence[str]], list[str]]
    healthy: Callable[[Mapping[str, int]], bool]
    health_what: str
    connect: Callable[[Mapping[str, int], Path],
                      tuple[dict[str, Any], dict[str, str]]]


# ------------------------------------------------------------------ LMCache (mp)
_LMCACHE_MODULE = "lmcache.v1.multiprocess.http_server"


def _lmcache_locate() -> list[str]:
    try:
        found = importlib.util.find_spec(_LMCACHE_MODULE) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise KvServerError("not_installed", (
            f"LMCache's multiprocess server ({_LMCACHE_MODULE}) is not installed in "
            f"{sys.executable}. Fix: pip install lmcache (the version the profile's "
            "[package] pairings name for this vLLM)"))
    return [sys.executable, "-m", _LMCACHE_MODULE]


def _lmcache_argv(prefix: list[str], ports: Mapping[str, int],
                  args: Sequence[str]) -> list[str]:
    # the flags of lmcache/v1/multiprocess/config.py (0.5.x) and the launcher
    # LMCache itself uses (integration/vllm/mp_server_launcher.py command())
    return [*prefix, "--host", HOST, "--port", str(ports["port"]),
            "--http-host", HOST, "--http-port", str(ports["http_port"]), *args]


def _lmcache_connect(ports: Mapping[str, int], folder: Path
                     ) -> tuple[dict[str, Any], dict[str, str]]:
    # vllm/distributed/kv_transfer/kv_connector/v1/lmcache_mp_connector.py:
    # lmcache.mp.host (default "tcp://localhost") and lmcache.mp.port (5555)
    return ({"lmcache.mp.host": f"tcp://{HOST}", "lmcache.mp.port": ports["port"]},
            dict(NO_TELEMETRY))


# ------------------------------------------------------------- Mooncake master
def _mooncake_locate() -> list[str]:
    here = Path(sys.executable).parent / "mooncake_master"
    exe = str(here) if here.is_file() else shutil.which("mooncake_master")
    if not exe:
        raise KvServerError("not_installed", (
            f"mooncake_master is not installed (not in {here.parent}, not on PATH). "
            "Fix: pip install mooncake-transfer-engine (CUDA 12), "
            "mooncake-transfer-engine-cuda13 or mooncake-transfer-engine-non-cuda "
            "(CPU; needs libibverbs1: apt-get install libibverbs1)"))
    return [exe]


def _mooncake_argv(prefix: list[str], ports: Mapping[str, int],
                   args: Sequence[str]) -> list[str]:
    # gflags of mooncake-store/src/master.cpp (0.3.13): RPC port, metrics port,
    # the embedded HTTP metadata server the clients' transfer engines use
    return [*prefix, f"--rpc_port={ports['port']}", f"--rpc_address={HOST}",
            f"--metrics_host={HOST}",
            f"--metrics_port={ports['metrics_port']}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={HOST}",
            f"--http_metadata_server_port={ports['metadata_port']}", *args]


def _mooncake_healthy(ports: Mapping[str, int]) -> bool:
    return tcp_answers(ports["port"]) and http_ok(
        f"http://{HOST}:{ports['metrics_port']}/metrics")


def _mooncake_connect(ports: Mapping[str, int], folder: Path
                      ) -> tuple[dict[str, Any], dict[str, str]]:
    # MooncakeStoreConfig.load_from_config (vllm .../mooncake/store/worker.py,
    # 0.28): the JSON file named by MOONCAKE_CONFIG_PATH; protocol tcp (no RDMA
    # on a CPU box or a single GPU host); a small segment for the tiny model
    cfg = {"metadata_server": f"http://{HOST}:{ports['metadata_port']}/metadata",
           "master_server_address": f"{HOST}:{ports['port']}",
           "protocol": "tcp", "device_name": "",
           "global_segment_size": "512MB", "local_buffer_size": "256MB"}
    path = folder / f"mooncake-{ports['port']}.json"
    path.write_text(json.dumps(cfg, indent=1) + "\n")
    return {}, {"MOONCAKE_CONFIG_PATH": str(path), **NO_TELEMETRY}


KINDS: dict[str, Kind] = {
    "lmcache": Kind(
        "LMCache's multiprocess server", ("port", "http_port"), _lmcache_locate,
        _lmcache_argv,
        lambda p: http_ok(f"http://{HOST}:{p['http_port']}/healthcheck"),
        "GET /healthcheck to answer 200", _lmcache_connect),
    "mooncake_master": Kind(
        "Mooncake's master (mooncake_master)",
        ("port", "metrics_port", "metadata_port"), _mooncake_locate, _mooncake_argv,
        _mooncake_healthy, "its RPC port to accept and GET /metrics to answer 200",
        _mooncake_connect),
}


@dataclass(frozen=True)
class KvServerSpec:
    """What to start; the fields of a profile's ``[kv_server]`` section.

    Attributes:
        kind: a key of :data:`KINDS`.
        start_timeout_s: seconds to wait for the first healthy answer.
        folder: where its log (and a client config file) go: the run folder's ``logs/``.

    """

    kind: str
    folder: Path
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    start_timeout_s: float = 60.0

    @classmethod
    def from_section(cls, section: Mapping[str, Any], folder: Path) -> KvServerSpec:
        """Build a spec from ``profile["kv_server"]`` (interpolated)."""
        return cls(kind=section["kind"], folder=folder,
                   args=tuple(section.get("args", ())),
                   env={k: str(v) for k, v in dict(section.get("env", {})).items()},
                   start_timeout_s=float(section.get("start_timeout_s", 60.0)))


class KvServer:
    """Context manager owning one connector server (start, probe, stop).

    Attributes:
        ports: port name -> port (picked at :meth:`start`).
        extra_config: keys to merge into ``kv_connector_extra_config``.
        client_env: environment every connector process needs.

    """

    def __init__(self, spec: KvServerSpec, poll_s: float = POLL_S) -> None:
        if spec.kind not in KINDS:
            raise ValueError(f"unknown kv_server kind {spec.kind!r} (known: "
                             f"{', '.join(KINDS)})")
        self.spec = spec
        self.kind = KINDS[spec.kind]
        self.poll_s = poll_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: dict[str, int] = {}
        self.log_file = Path()
        self.extra_config: dict[str, Any] = {}
        self.client_env: dict[str, str] = {}
        self.argv: list[str] = []
        self._log: Any = None

    @property
    def name(self) -> str:
        """The server in messages: label, pid and port."""
        pid = self.proc.pid if self.proc is not None else "-"
        return (f"{self.kind.label} (pid {pid}, {HOST}:{self.ports.get('port', '-')}"
                f", log {self.log_file})")

    def __enter__(self) -> KvServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the server and wait until it answers.

        Raises:
            KvServerError: not installed, exited while starting (with its log tail), or
                no healthy answer within ``start_timeout_s``.

        """
        prefix = self.kind.locate()
        self.ports = {name: free_port() for name in self.kind.ports}
        self.spec.folder.mkdir(parents=True, exist_ok=True)
        self.log_file = self.spec.folder / f"kv-server-{self.spec.kind}-" \
            f"{self.ports['port']}.log"
        self.argv = self.kind.argv(prefix, self.ports, self.spec.args)
        self.extra_config, self.client_env = self.kind.connect(self.ports,
                                                               self.spec.folder)
        env = {**os.environ, **NO_TELEMETRY, **self.spec.env}
        self._log = open(self.log_file, "ab")  # noqa: SIM115 - closed in stop()
        from tvc.procs.vllm_server import _die_with_parent

        # the server dies with the suite even when the suite is SIGKILLed:
        # Linux's PR_SET_PDEATHSIG, as vllm serve
        self.proc = subprocess.Popen(  # noqa: S603 - argv list, no shell
            self.argv, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent)  # noqa: PLW1509 - no threads in between
        try:
            wait_until(self._started, self.spec.start_timeout_s, self.poll_s,
                       f"{self.kind.label} to answer ({self.kind.health_what})")
        except PollTimeout:
            name = self.name
            self.stop()
            raise KvServerError("timeout", (
                f"{name} did not answer within {self.spec.start_timeout_s:g} s "
                f"({self.kind.health_what}); it was stopped. Its command: "
                f"{' '.join(self.argv)}. Raise [kv_server] start_timeout_s if it is "
                f"just slow. Log tail:\n{log_tail(str(self.log_file))}")) from None
        except KvServerError:
            self.stop()
            raise

    def _started(self) -> bool:
        rc = self.proc.poll() if self.proc is not None else None
        if rc is not None:
            raise KvServerError("exited", (
                f"{self.name} exited with {_how(rc)} before it answered. Its "
                f"command: {' '.join(self.argv)}. Log tail:\n"
                f"{log_tail(str(self.log_file))}"))
        return self.kind.healthy(self.ports)

    def problem(self) -> str:
        """Why the server cannot serve now (``""`` when it is alive and answers).

        One paragraph naming the server: dead (exit status, log tail) or not answering.
        """
        if self.proc is None:
            return f"{self.kind.label} is not running (never started or stopped)"
        rc = self.proc.poll()
        if rc is not None:
            return (f"{self.name} is dead: it exited with {_how(rc)}. Log tail:\n"
                    f"{log_tail(str(self.log_file))}")
        if not self.kind.healthy(self.ports):
            return (f"{self.name} is alive but unreachable: "
                    f"{self.kind.health_what} failed")
        return ""

    def stop(self) -> None:
        """Stop the server (SIGTERM to its group, wait, SIGKILL); idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_tree(proc, grace_s=STOP_GRACE_S)
        if self._log is not None:
            self._log.close()
            self._log = None


def _how(rc: int) -> str:
    return f"signal {-rc}" if rc < 0 else f"exit status {rc}"


def profile_with_server(profile: Any, server: KvServer) -> Any:
    """The profile as the connector must see it while ``server`` runs (a new Profile).

    :attr:`KvServer.extra_config` is merged into ``connector.extra_config`` and
    :attr:`KvServer.client_env` into ``vllm.env``; ``profile`` is unchanged.
    """
    import copy
    import dataclasses

    data = copy.deepcopy(dict(profile.data))
    data["connector"]["extra_config"].update(server.extra_config)
    data["vllm"]["env"] = {**data["vllm"]["env"], **server.client_env}
    return dataclasses.replace(profile, data=data)
