"""Worker reports for the contract rig where a connector's worker side cannot run.

A connector that learns what was stored only from its workers' metadata
(``build_connector_worker_meta()`` -> ``KVConnectorOutput.kv_connector_worker_meta``
-> ``update_connector_output()``,
``vllm/v1/worker/kv_connector_model_runner_mixin.py``, 0.26-0.33) would see 0
hits without a worker. The rig then needs the real worker, the built-in
:class:`tvc.contract.worker.JobAckWorker`, or a profile-declared
``connector.worker_report = "module:function"`` (run by :class:`HookWorker`);
with none, :class:`WorkerReportMissing`. See docs/profiles.md.
:func:`tutti_worker_report` is the stand-in for the public ``TuttiConnectorV1``.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from typing import Any

__all__ = [
    "WORKER_REPORT_KEY",
    "HookWorker",
    "WorkerReportError",
    "WorkerReportMissing",
    "innermost_connector",
    "load_worker_report",
    "publishes_worker_meta",
    "tutti_worker_report",
]

#: the profile key that declares a stand-in (tvc/config/profile.py SCHEMA)
WORKER_REPORT_KEY = "connector.worker_report"
#: ``connector.worker_report`` value naming the built-in job-protocol stand-in
BUILTIN_STANDIN = "standin"


class WorkerReportError(RuntimeError):
    """A declared ``connector.worker_report`` cannot be loaded or misbehaves."""


class WorkerReportMissing(RuntimeError):
    """The connector needs a worker report that the rig cannot produce.

    Raised by :class:`tvc.contract.driver.EngineDriver` at the first step with
    connector metadata, so that no test passes with 0 hits.
    """


def innermost_connector(connector: Any) -> Any:
    """The connector under test, unwrapped from suite fault wrappers (``.inner``)."""
    from tvc.contract.faults import FaultInjectingConnector

    seen = 0
    while isinstance(connector, FaultInjectingConnector) and seen < 8:
        connector = connector.inner
        seen += 1
    return connector


def publishes_worker_meta(connector: Any) -> bool:
    """Whether a connector publishes state from its workers through worker metadata.

    True when its class (wrappers looked through) overrides
    ``KVConnectorBase_V1.build_connector_worker_meta`` (the base returns None,
    ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``, 0.26-0.33).
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    if connector is None:
        return False
    cls = type(innermost_connector(connector))
    base = getattr(KVConnectorBase_V1, "build_connector_worker_meta", None)
    own = getattr(cls, "build_connector_worker_meta", None)
    return base is not None and own is not None and own is not base


def missing_report_message(connector: Any, why_no_worker: str) -> str:
    """The one-paragraph error for a connector left without a worker report."""
    name = type(innermost_connector(connector)).__name__
    return (
        f"{name} publishes residency through worker metadata "
        "(worker build_connector_worker_meta() -> KVConnectorOutput."
        "kv_connector_worker_meta -> scheduler update_connector_output()), but "
        f"this rig runs no worker for it ({why_no_worker or 'no worker'}) and the "
        f"profile declares no stand-in: set [connector] worker_report = "
        "\"module:function\" (a function(vllm_config, kv_cache_config, connector) "
        "returning report(scheduler_output, metadata) -> KVConnectorOutput that "
        "reports exactly what the scheduler planned; see tvc/contract/standins.py), "
        f"or run where {WORKER_REPORT_KEY.split('.')[0]}.worker_devices lists the "
        "device. Without a worker report the scheduler never learns what was "
        "stored and every hit would be 0, so the contract cannot be checked")


class HookWorker:
    """Runs a profile-declared stand-in in place of the connector's worker side.

    Moves no bytes (``loaded`` and ``load_errors`` stay empty). Under
    :class:`tvc.contract.faults.FaultInjectingConnector` it reports the planned load
    failures in ``invalid_block_ids`` as :class:`tvc.contract.worker.JobAckWorker`
    does (sync: this step; async: the step that finishes receiving).

    Attributes:
        hook: the ``module:function`` the profile declared (also
            ``standin_label``, the test's ``worker`` property).
        steps: steps run; ``reports``: steps whose report was not empty.

    """

    def __init__(self, hook: str, report: Callable[[Any, Any], Any]) -> None:
        self.hook = hook
        self.standin_label = hook
        self.report = report
        self.loaded: dict[str, int] = {}
        self.load_errors: list[str] = []
        self.reported_invalid_blocks: set[int] = set()
        self.steps = 0
        self.reports = 0
        self.await_recv: dict[str, list[int]] = {}

    def execute(self, so: Any, meta: Any) -> Any:
        """Call the stand-in with this step's scheduler output and unwrapped metadata.

        Returns a ``KVConnectorOutput``; WorkerReportError when the stand-in raised or
        returned another type.
        """
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        from tvc.contract.worker import unwrap_metadata

        self.steps += 1
        inner = unwrap_metadata(meta)
        invalid: set[int] = set()
        if inner is not meta and getattr(meta, "report", False):
            for rid, blocks in (getattr(meta, "faults", None) or {}).items():
                if rid in meta.async_reqs:
                    self.await_recv[rid] = list(blocks)
                else:
                    invalid.update(blocks)
        try:
            ret = self.report(so, inner)
        except Exception as exc:  # noqa: BLE001 - named below
            raise WorkerReportError(
                f"{WORKER_REPORT_KEY} = {self.hook!r}: the stand-in raised "
                f"{type(exc).__name__}: {exc}") from exc
        if ret is None:
            out = KVConnectorOutput()
        elif isinstance(ret, KVConnectorWorkerMetadata):
            self.reports += 1
            out = KVConnectorOutput(kv_connector_worker_meta=ret)
        elif isinstance(ret, KVConnectorOutput):
            self.reports += 1
            out = ret
        else:
            raise WorkerReportError(
                f"{WORKER_REPORT_KEY} = {self.hook!r}: the stand-in returned "
                f"{type(ret).__name__}; expected KVConnectorOutput, a "
                "KVConnectorWorkerMetadata or None")
        for rid in out.finished_recving or ():
            invalid.update(self.await_recv.pop(rid, ()))
        if invalid:
            out.invalid_block_ids = set(out.invalid_block_ids or ()) | invalid
            self.reported_invalid_blocks |= invalid
        return out


def load_worker_report(spec: str, vllm_config: Any, kv_cache_config: Any,
                       connector: Any) -> HookWorker:
    """Build the stand-in a profile declares as ``connector.worker_report``.

    ``spec`` is ``"module:function"``; the function gets ``(vllm_config,
    kv_cache_config, connector)`` (the innermost connector) and returns
    ``report(scheduler_output, metadata)``, run by the returned :class:`HookWorker`.

    Raises:
        WorkerReportError: malformed spec, module or function not found, or the
            factory raised or returned something not callable; the message names
            the profile key and the spec.

    """
    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name:
        raise WorkerReportError(
            f"{WORKER_REPORT_KEY} = {spec!r}: expected \"module:function\" or "
            f"\"{BUILTIN_STANDIN}\"")
    try:
        factory = pkgutil.resolve_name(spec)
    except ImportError as exc:
        raise WorkerReportError(f"{WORKER_REPORT_KEY} = {spec!r}: cannot import "
                                f"{mod_name}: {exc}") from None
    except (AttributeError, ValueError):  # no such attribute; a malformed name
        factory = None
    if not callable(factory):
        raise WorkerReportError(f"{WORKER_REPORT_KEY} = {spec!r}: module {mod_name} "
                                f"has no function {fn_name}")
    try:
        report = factory(vllm_config, kv_cache_config, innermost_connector(
            connector))
    except WorkerReportError:
        raise
    except Exception as exc:  # noqa: BLE001 - named below
        raise WorkerReportError(f"{WORKER_REPORT_KEY} = {spec!r}: building the "
                                f"stand-in failed: {type(exc).__name__}: {exc}"
                                ) from exc
    if not callable(report):
        raise WorkerReportError(f"{WORKER_REPORT_KEY} = {spec!r}: the factory "
                                f"returned {type(report).__name__}, not a callable")
    return HookWorker(spec, report)


# ----------------------------------------------------------------- Tutti (public)
def tutti_worker_report(vllm_config: Any, kv_cache_config: Any, connector: Any
                        ) -> Callable[[Any, Any], Any]:
    """Stand-in worker report for the public ``TuttiConnectorV1`` (memory index).

    Mirrors Tutti's worker (xPU-IO/Tutti 33a8fb8): after ``wait_for_save`` it
    returns ``TuttiWorkerMetadata(committed={chunk_key: ranks})`` for newly reserved
    chunks (``_ReqMeta.save_chunk_start`` / ``save_chunk_count`` /
    ``save_generations``), keys from ``ChunkIndex.hash_keys`` (16-byte blake2b
    chain) under ``_key_namespace``. It reports ``tensor_parallel_size`` per key
    (every rank succeeded). Tutti's classes come from the user's checkout on
    ``PYTHONPATH``; see docs/tutti.md. The scheduler-side ``connector``'s own config
    (innermost) wins over ``vllm_config`` where they differ.

    Returns:
        ``report(scheduler_output, metadata) -> TuttiWorkerMetadata | None``.

    Raises:
        WorkerReportError: Tutti's packages are not importable.

    """
    vllm_config = getattr(connector, "_vllm_config", None) or vllm_config
    try:
        if type(connector).__module__.startswith("tutti."):
            # Tutti's current tree (the tutti package, PR #19 "Vllmconnector
            # v3"): the same classes under tutti.integration.vllm / tutti.index
            from tutti.index import chunk_index
            from tutti.integration.vllm import geometry, worker_meta

            key_namespace = geometry.key_namespace
            resolve_geometry = geometry.resolve_geometry
        else:
            import adapter.connector
            from adapter import worker_meta
            from index import chunk_index

            key_namespace = adapter.connector._key_namespace
            resolve_geometry = adapter.connector._resolve_geometry
        ChunkIndex = chunk_index.ChunkIndex
        TuttiWorkerMetadata = worker_meta.TuttiWorkerMetadata
    except ImportError as exc:
        raise WorkerReportError(
            "the Tutti stand-in imports the connector's geometry, worker metadata "
            "and chunk index from the Tutti checkout (tutti.integration.vllm and "
            "tutti.index for the current tree; adapter and index of "
            "integration/vllm-connector for v0.1.1): put it (TUTTI_SRC) on "
            f"PYTHONPATH ({exc})") from None
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    geom = resolve_geometry(extra, kv_cache_config)
    hasher = ChunkIndex(1, geom["chunk_tokens"], namespace=key_namespace(
        vllm_config, geom).encode())
    ranks = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)

    def report(scheduler_output: Any, metadata: Any) -> Any:
        del scheduler_output
        committed: dict[bytes, int] = {}
        for req in getattr(metadata, "requests", ()):
            count = req.save_chunk_count
            if count <= 0 or not req.save_generations:
                continue  # nothing newly reserved: the real worker saves nothing
            keys, _ = hasher.hash_keys(req.token_ids)
            for key in keys[req.save_chunk_start:req.save_chunk_start + count]:
                committed[key] = ranks
        return TuttiWorkerMetadata(committed=committed) if committed else None

    return report
