"""A rig: config, scheduler, worker and driver for one connector.

Also the hypothesis settings profile (``tvc-ci``) used by the contract tier.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tvc.contract.builders import (
    DEFAULT_NUM_BLOCKS,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
)
from tvc.contract.driver import EngineDriver
from tvc.contract.standins import BUILTIN_STANDIN, load_worker_report
from tvc.contract.worker import ConnectorWorker
from tvc.profile import Profile


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
        """:func:`make_request` with this rig's block size."""
        return make_request(num_tokens=num_tokens, block_size=self.block_size, **kw)

    def forget_local_cache(self) -> None:
        """Drop vLLM's local prefix cache: the next hit must be the connector's.

        Uses ``Scheduler.reset_prefix_cache``; the connector keeps its store.
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



def make_rig(profile: Profile, scratch: Path, *, device: str = "cpu",
             real_worker: bool | None = None, num_blocks: int = DEFAULT_NUM_BLOCKS,
             **config_kw: Any) -> Rig:
    """Build config, KV cache config, scheduler, worker and driver.

    Args:
        profile: the target profile.
        scratch: suite-owned directory.
        device: where the worker's KV tensors live (``cpu`` / ``cuda``).
        real_worker: drive the connector's real worker side; default: when the
            profile's ``connector.worker_devices`` lists ``device``. Otherwise
            the profile's ``connector.worker_report`` stand-in
            (``module:function``, :func:`tvc.contract.standins.load_worker_report`)
            runs, or the driver picks the built-in :class:`JobAckWorker` where the
            metadata speaks its protocol, and refuses to drive a connector that
            publishes residency through worker metadata with neither
            (:class:`tvc.contract.standins.WorkerReportMissing`).
        num_blocks: KV blocks in the pool.
        **config_kw: passed to :func:`make_vllm_config`.

    Returns:
        the :class:`Rig`.

    Raises:
        tvc.contract.standins.WorkerReportError: the declared stand-in cannot be
            built.

    """
    vc = make_vllm_config(profile, scratch=scratch, device=device, **config_kw)
    kcc = make_kv_cache_config(vc, num_blocks)
    sched = make_scheduler(vc, kcc)
    devices = profile["connector"]["worker_devices"]
    if real_worker is None:
        real_worker = device in devices
    spec = profile["connector"]["worker_report"]
    worker: Any = None
    if real_worker:
        worker = ConnectorWorker(vc, kcc, device)
    elif spec and spec != BUILTIN_STANDIN:
        worker = load_worker_report(spec, vc, kcc, sched.connector)
    why = (f"rig device {device!r}, connector.worker_devices = {devices}" if
           device not in devices else "this test drives the scheduler side only")
    return Rig(vc, kcc, sched, worker, EngineDriver(
        sched, worker=worker, worker_report=spec, no_worker_reason=why))


def adapter_missing_reason(profile: Profile) -> str:
    """Why the profile's out-of-tree connector module cannot be found ('' if it can).

    Only a module that is *absent* counts; one that is present but fails to
    import is a real failure (level1 ``test_connector_resolves`` names the cause).
    """
    import importlib.util

    mod = profile["connector"]["module_path"]
    if not mod:
        return ""
    try:
        found = importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:
        found = False
    if found:
        return ""
    return (f"The connector module {mod!r} of profile {profile.name!r} is not "
            "installed on this box, so its contract cannot be driven. Put the "
            "adapter's package on PYTHONPATH (or pip install it) and rerun; "
            "level1 test_connector_resolves reports the same as a failure.")


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
