"""A rig: config, scheduler, worker and driver for one connector.

Also the hypothesis settings profile (``tvc-ci``) used by the contract tier.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tvc.config.profile import Profile, claim_store_paths
from tvc.contract.builders import (
    DEFAULT_NUM_BLOCKS,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
)
from tvc.contract.coverage import CoverageLog
from tvc.contract.driver import (
    REAL_WORKER_ONLY,
    EngineDriver,
    NoWorkerHere,
    no_worker_message,
)
from tvc.contract.layout import (
    LAYOUT_ENV,
    allowed_kv_layouts,
    decide_model_runner,
    vllm_env,
)
from tvc.contract.standins import BUILTIN_STANDIN, load_worker_report
from tvc.contract.worker import ConnectorWorker, ConnectorWorkerError
from tvc.core import run_store

#: vLLM's folder for IPC sockets (``vllm.envs``; default the system temp folder):
#: sockets named only by host and rank (MooncakeStoreConnector's lookup,
#: ``get_zmq_rpc_path_lookup``) would be shared by every rig and xdist worker
RPC_ENV = "VLLM_RPC_BASE_PATH"


#: connectors of closed rigs that left threads running (see :meth:`Rig.close`)
_KEPT_UNTIL_EXIT: list[tuple[Any, Any]] = []


# ------------------------------------------------------------------- rig + fixtures
class SchedulerSideMixin:
    """What every rig offers on the scheduler side (:class:`Rig`, TP rigs).

    Needs the attributes ``vllm_config`` and ``scheduler``.
    """

    vllm_config: Any
    scheduler: Any

    @property
    def block_size(self) -> int:
        """KV block size B in tokens."""
        return self.vllm_config.cache_config.block_size

    def request(self, num_tokens: int, **kw: Any) -> Any:
        """:func:`make_request` with this rig's block size and hash algorithm."""
        algo = self.vllm_config.cache_config.prefix_caching_hash_algo
        return make_request(num_tokens=num_tokens, block_size=self.block_size,
                            hash_algo=algo, **kw)

    def forget_local_cache(self) -> None:
        """Drop vLLM's local prefix cache: the next hit must be the connector's.

        ``Scheduler.reset_prefix_cache``; the connector keeps its store.
        """
        assert self.scheduler.reset_prefix_cache(), (
            "vLLM refused to reset its prefix cache: a request still holds blocks")



@dataclass
class Rig(SchedulerSideMixin):
    """Everything one contract test drives: config, scheduler, worker, driver."""

    vllm_config: Any
    kv_cache_config: Any
    scheduler: Any
    worker: Any
    driver: EngineDriver
    #: (runner, source) from :func:`tvc.contract.layout.decide_model_runner`
    runner: tuple[str, str] = ("V1", "given")
    #: the rig's own ``VLLM_RPC_BASE_PATH`` folder (made by :func:`make_rig`)
    rpc_dir: Path | None = None

    #: idents of the threads alive before the rig was built
    threads_before: frozenset[int] = frozenset()
    closed: bool = False

    def close(self) -> None:
        """Shut the worker and scheduler-side connector down; drop the IPC folder.

        Once; best effort: a connector's error at shutdown is ignored. Connectors whose
        shutdown leaves threads running are kept referenced until the process
        exits, as in vLLM, where ``shutdown`` runs as the worker process ends
        (``KVConnectorBase_V1.shutdown``): collecting them early can block for
        ever (a ZMQ context whose socket a thread still reads waits in ``term``).
        """
        if self.closed:
            return
        self.closed = True
        conns = (self.scheduler.connector, getattr(self.worker, "connector", None))
        closers = [getattr(self.worker, "close", None)]
        if closers[0] is None:
            closers = [getattr(getattr(self.worker, "connector", None), "shutdown",
                               None)]
        closers.append(getattr(self.scheduler.connector, "shutdown", None))
        for close in closers:
            if close is not None:
                with contextlib.suppress(Exception):
                    close()
        if self.rpc_dir is not None:
            _remove_rpc_dir(self.rpc_dir)
        if any(t.ident not in self.threads_before for t in threading.enumerate()):
            _KEPT_UNTIL_EXIT.append(conns)



_RPC_DIRS: set[Path] = set()  # this process's rig IPC folders not yet removed


def _remove_rpc_dirs() -> None:
    """At exit: the IPC folders of rigs a stop (Ctrl-C) left unclosed."""
    for path in list(_RPC_DIRS):
        _remove_rpc_dir(path)


atexit.register(_remove_rpc_dirs)


def _make_rpc_dir() -> Path:
    """A fresh IPC folder for one rig (``tvc-rpc-*`` in the temp folder)."""
    path = Path(tempfile.mkdtemp(prefix="tvc-rpc-"))
    _RPC_DIRS.add(path)
    return path


def _remove_rpc_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    _RPC_DIRS.discard(path)


def make_rig(profile: Profile, scratch: Path, *, device: str = "cpu",
             real_worker: bool | None = None, num_blocks: int = DEFAULT_NUM_BLOCKS,
             kv_layout: str | None = None, scheduler_only: bool = False,
             on_no_worker: Any = None, **config_kw: Any) -> Rig:
    """Build config, KV cache config, scheduler, worker and driver.

    Built under the profile's ``[vllm] env`` (``kv_layout`` sets
    ``VLLM_KV_CACHE_LAYOUT`` over it); the model runner is decided as vLLM decides
    (:func:`tvc.contract.layout.decide_model_runner`). ``real_worker`` defaults to
    whether ``connector.worker_devices`` lists ``device``; otherwise the
    ``connector.worker_report`` stand-in or the built-in :class:`JobAckWorker` runs
    (docs/profiles.md), and a connector that publishes residency through worker
    metadata with neither is refused
    (:class:`~tvc.contract.standins.WorkerReportMissing`).
    ``scheduler_only`` builds no worker (the driver acknowledges delayed frees and
    async loads); otherwise a rig where no worker can run fails at its first step
    with :class:`~tvc.contract.driver.NoWorkerHere` (``on_no_worker`` is called with
    the message first). ``config_kw`` goes to :func:`make_vllm_config`.

    Raises:
        tvc.contract.standins.WorkerReportError: the declared stand-in cannot be
            built.
        tvc.contract.driver.NoWorkerHere: ``connector.lookups_need_worker`` and no
            real worker.

    """
    threads_before = frozenset(t.ident for t in threading.enumerate()
                               if t.ident is not None)
    run_store.mark_if_missing(Path(profile.scratch))  # the suite's from the start
    claim_store_paths(profile)  # store folders outside scratch: made and marked
    env = dict(profile["vllm"]["env"])
    if kv_layout is not None:
        env[LAYOUT_ENV] = kv_layout
    devices = profile["connector"]["worker_devices"]
    if scheduler_only:
        real_worker = False
    if real_worker is None:
        real_worker = device in devices
    spec = profile["connector"]["worker_report"]
    worker: Any = None
    why = ("this test drives the scheduler side only" if scheduler_only else
           f"rig device {device!r}, connector.worker_devices = {devices}")
    if profile["connector"]["lookups_need_worker"] and not real_worker and \
            _rig_runs_profile_connector(profile, config_kw):
        # e.g. MooncakeStoreConnector: LookupKeyClient sends each lookup to
        # worker rank 0 and waits in socket.recv() with no timeout (vLLM 0.28.0
        # mooncake/store/worker.py L2037-L2049): no scheduler is built at all
        msg = no_worker_message(
            f"{why}; {profile['connector']['name']}'s scheduler side asks its "
            "worker for every lookup (connector.lookups_need_worker) and would "
            "wait for it without end, so no rig is built without the real worker")
        if on_no_worker is not None:
            on_no_worker(msg)  # the fixtures' hardware skip on a box without CUDA
        raise NoWorkerHere(msg)
    rpc_dir = None
    if RPC_ENV not in env:  # IPC sockets named from it are this rig's alone
        rpc_dir = _make_rpc_dir()
        env[RPC_ENV] = str(rpc_dir)
    try:
        with vllm_env(env):
            vc = make_vllm_config(profile, scratch=scratch, device=device,
                                  **config_kw)
            runner = decide_model_runner(vc, env)
            kcc = make_kv_cache_config(vc, num_blocks)
            if real_worker:  # the workers first, as EngineCore.__init__ does
                try:
                    worker = ConnectorWorker(vc, kcc, device, runner)
                except ConnectorWorkerError as exc:
                    exc.runner = runner  # type: ignore[attr-defined]  # reports
                    raise
            sched = make_scheduler(vc, kcc)
            if real_worker:
                worker.watch_frees(sched)  # marks the blocks vLLM frees
            elif spec and spec not in (BUILTIN_STANDIN, REAL_WORKER_ONLY):
                worker = load_worker_report(spec, vc, kcc, sched.connector)
    except BaseException:
        if rpc_dir is not None:
            _remove_rpc_dir(rpc_dir)
        raise
    driver = EngineDriver(sched, worker=worker, worker_report=spec,
                          no_worker_reason=why, scheduler_only=scheduler_only,
                          on_no_worker=on_no_worker,
                          call_timeout_s=float(
                              profile["connector"]["call_timeout_s"]),
                          min_stall_s=float(
                              profile["connector"]["transfer_timeout_s"]))
    note_rig(driver.coverage, vc, kcc, worker)
    return Rig(vc, kcc, sched, worker, driver, runner, rpc_dir, threads_before)


def _rig_runs_profile_connector(profile: Profile, config_kw: dict[str, Any]
                                ) -> bool:
    """Whether the rig's connector is the profile's (possibly in the fault wrapper)."""
    ktc = config_kw.get("kv_transfer_config") or profile.kv_transfer_config()
    inner = ((ktc.get("kv_connector_extra_config") or {}).get("tvc_fault") or {}
             ).get("inner") or {}
    want = (profile["connector"]["name"], profile["connector"]["module_path"])
    return any((c.get("kv_connector"), c.get("kv_connector_module_path", ""))
               == want for c in (ktc, inner))


def note_rig(log: CoverageLog, vllm_config: Any, kv_cache_config: Any,
             worker: Any) -> None:
    """Record a rig's settings, layer kinds and worker set-up on ``log``.

    Wraps a real worker's connector so its calls are recorded too.
    """
    log.note_config(vllm_config)
    log.note_layers(kv_cache_config)
    conn = getattr(worker, "connector", None) if isinstance(
        worker, ConnectorWorker) else None
    if conn is None:
        return
    log.attach(conn, "worker")
    log.hit("api:KVConnectorBase_V1.prefer_cross_layer_blocks",
            f"{bool(getattr(conn, 'prefer_cross_layer_blocks', False))}")
    if worker.cross_layer_kv_cache is not None:
        log.hit("api:KVConnectorBase_V1.register_cross_layers_kv_cache",
                f"shape {tuple(worker.cross_layer_kv_cache.shape)}")
    else:
        log.hit("api:KVConnectorBase_V1.register_kv_caches",
                f"{len(worker.kv_caches)} layers")


def worker_kv_layouts(profile: Profile, scratch: Path, **config_kw: Any
                      ) -> tuple[str, ...]:
    """The KV layouts (``NHD``/``HND``) the engine may hand this connector's worker.

    ``VLLM_KV_CACHE_LAYOUT`` (profile env or process) fixes one; else the class's
    ``get_required_kvcache_layout``; else both
    (:func:`tvc.contract.layout.allowed_kv_layouts`).
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import (
        KVConnectorFactory,
    )

    env = dict(profile["vllm"]["env"])
    with vllm_env(env):
        vc = make_vllm_config(profile, scratch=scratch, **config_kw)
        cls = KVConnectorFactory.get_connector_class(vc.kv_transfer_config)
        return allowed_kv_layouts(cls, vc, env)


def package_missing_reason(profile: Profile) -> str:
    """Why the package of the profile's connector is absent ('' if it is installed).

    For a connector whose code lives in another distribution (``[package] name``,
    e.g. ``lmcache`` for ``LMCacheConnectorV1``).
    """
    import sys

    from packaging.requirements import Requirement

    from tvc.env.pairings import installed_version

    pkg = profile["package"]
    if not pkg["name"]:
        return ""
    reqs = [r for p in pkg["pairings"] if p["works"] for r in p["requires"]]
    names = [pkg["name"], *(Requirement(r).name for r in reqs)]
    if any(installed_version(n) is not None for n in names):
        return ""
    fix = f"pip install {reqs[0]}" if reqs else f"pip install {pkg['name']}"
    return (f"The connector {profile['connector']['name']} of profile "
            f"{profile.name!r} needs the package {pkg['name']!r}, which is not "
            f"installed in {sys.executable}, so its contract cannot be driven. "
            f"Fix: {fix} (the profile's [package] pairings name the version for "
            "each vLLM)")


def adapter_missing_reason(profile: Profile) -> str:
    """Why the profile's out-of-tree connector module cannot be found ('' if it can).

    Only an absent module counts; one that fails to import is level1
    ``test_connector_resolves``'s failure.
    """
    import importlib
    import importlib.util

    mod = profile["connector"]["module_path"]
    if not mod:
        return package_missing_reason(profile)
    try:
        found = importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:
        found = False
    upstream = ""
    if found and mod.startswith("tvc."):
        # a suite shim around an out-of-tree class names the module it needs
        upstream = getattr(importlib.import_module(mod), "UPSTREAM_MODULE", "")
        if upstream:
            try:
                found = importlib.util.find_spec(upstream) is not None
            except ModuleNotFoundError:
                found = False
    if found:
        return ""
    hint = _close_module(upstream or mod)
    if upstream:
        mod = f"{upstream} (wrapped by {mod})"
    return (f"The connector module {mod!r} of profile {profile.name!r} is not "
            f"installed on this box, so its contract cannot be driven.{hint} Put "
            "the folder holding the connector's module on PYTHONPATH (or pip "
            "install its package) and rerun, or fix connector.module_path; "
            "level1 test_connector_resolves reports the same as a failure.")


def _close_module(name: str) -> str:
    """" Did you mean 'x'?" for a top-level module name close to ``name``'s."""
    import difflib
    import pkgutil

    top = name.split(".")[0]
    near = difflib.get_close_matches(
        top, {m.name for m in pkgutil.iter_modules()}, n=1, cutoff=0.85)
    return (f" Did you mean {near[0] + name[len(top):]!r}?"
            if near and near[0] != top else "")


def class_missing_reason(profile: Profile) -> str:
    """Why ``connector.name`` is no class of ``module_path`` ('' if it is one).

    Else vLLM would raise a bare ``AttributeError`` in every test. Import failures are
    left to level1 ``test_connector_resolves``.
    """
    import importlib

    name = profile["connector"]["name"]
    mod = profile["connector"]["module_path"]
    if not mod:
        return ""
    try:
        module = importlib.import_module(mod)
    except Exception:  # noqa: BLE001 - reported by level1, not here
        return ""
    try:
        getattr(module, name)
        return ""
    except AttributeError:
        pass
    except Exception:  # noqa: BLE001 - a lazy attribute whose import fails: level1
        return ""
    have = sorted(n for n, v in vars(module).items()
                  if isinstance(v, type) and n.endswith("Connector")
                  and getattr(v, "__module__", "") == module.__name__)
    return (f"[connector] name = {name!r} of profile {profile.name!r} is not a "
            f"class in module {mod!r}, so no contract test can build it. Fix: set "
            "[connector] name to the connector's class"
            + (f" (there: {', '.join(have)})" if have else ""))


def register_hypothesis_profile() -> None:
    """Register ``tvc-ci``: derandomized, bounded, prints the reproduce blob."""
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "tvc-ci", derandomize=True, max_examples=int(
            os.environ.get("TVC_HYPOTHESIS_EXAMPLES", "8")),
        deadline=None, print_blob=True, database=None,
        suppress_health_check=[HealthCheck.too_slow,
                               HealthCheck.function_scoped_fixture])


try:  # registered at import so tests can use settings.get_profile("tvc-ci")
    register_hypothesis_profile()
except ImportError:  # pragma: no cover - hypothesis is a suite dependency
    pass
