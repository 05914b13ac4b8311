"""Connector contract machinery: build vLLM's own V1 scheduler around a connector.

Builders in the style of vLLM's connector unit tests (:mod:`tvc.contract.builders`:
:func:`make_vllm_config`, :func:`make_scheduler`, :func:`make_request` ...), an
:class:`EngineDriver` that runs ``schedule()`` / ``update_from_output()`` as the
engine core does with the real worker (:class:`ConnectorWorker`) or a stand-in
(:class:`JobAckWorker`), and one named check per invariant. Nothing here names a
connector; vLLM version differences live in :mod:`tvc.contract.compat`. See
docs/contract.md.
"""

from tvc.contract.builders import *  # noqa: F403
from tvc.contract.compat import *  # noqa: F403
from tvc.contract.driver import *  # noqa: F403
from tvc.contract.invariants import *  # noqa: F403
from tvc.contract.rig import *  # noqa: F403
from tvc.contract.serialization import *  # noqa: F403
from tvc.contract.worker import *  # noqa: F403
