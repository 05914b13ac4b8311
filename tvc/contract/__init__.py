"""Connector contract machinery: build vLLM's own V1 scheduler around a connector.

Builders in the style of vLLM's connector unit tests (small factories with defaults
and keyword overrides) and one named helper per invariant, so that contract tests
read as "build, act, check":

* :func:`write_tiny_model` writes a local tiny Llama ``config.json`` (no hub access;
  vLLM's ``ModelConfig`` needs a local path).
* :func:`make_vllm_config` builds a CPU ``VllmConfig`` with the profile's
  ``kv_transfer_config``.
* :func:`make_kv_cache_config` builds a real ``KVCacheConfig`` (one full-attention
  group, one KV tensor per layer with its real byte size).
* :func:`make_scheduler` builds vLLM's real ``Scheduler``, which creates the
  scheduler-side connector through ``KVConnectorFactory``.
* :func:`make_request` builds a ``Request`` with vLLM's block hasher.
* :class:`EngineDriver` runs ``schedule()`` / ``update_from_output()`` the way the
  engine core does, with a worker: the connector's real worker side on KV tensors
  (:class:`ConnectorWorker`), or, where that worker cannot run on this box, a
  transfer-acknowledging stand-in (:class:`JobAckWorker`) that reports every
  transfer job of the scheduler-side metadata as completed.

Nothing here names a connector: capabilities come from the profile and from feature
detection on the installed vLLM (``hasattr`` / ``inspect.signature``). Every
difference between vLLM versions the harness handles lives in
:mod:`tvc.contract.compat`; an API it lacks raises
:class:`~tvc.contract.compat.HarnessIncompatible` (reported as an error).
"""

from tvc.contract.builders import *  # noqa: F403
from tvc.contract.compat import *  # noqa: F403
from tvc.contract.driver import *  # noqa: F403
from tvc.contract.invariants import *  # noqa: F403
from tvc.contract.rig import *  # noqa: F403
from tvc.contract.serialization import *  # noqa: F403
from tvc.contract.worker import *  # noqa: F403
