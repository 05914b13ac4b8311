"""Known-bad connectors for the invariants of issue 31: ONE fault each.

Each subclasses a correct member of the panel (``panel_connectors.py``), so the
only thing wrong with it is its planted fault; loaded by vLLM through
``kv_connector_module_path = "invariant_bad_connectors"`` (the self-tests put
this folder on PYTHONPATH). Every fault is a public defect's shape:

* :class:`WaitsForSpaceConnector`: an allocation that waits (busy-loops) for
  room in a full store, which only a later engine step could make;
"""

from __future__ import annotations

import time
from typing import Any

from panel_connectors import SyncPanelConnector


class WaitsForSpaceConnector(SyncPanelConnector):
    """Fault: a store of ``capacity_chunks`` entries (extra config); when it is
    full, ``update_state_after_alloc`` waits for an entry to go, which nothing
    in this engine step can do: the call never returns."""

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        cap = int(self._kv_transfer_config.get_from_extra_config(
            "capacity_chunks", 1 << 30))
        while sum(1 for _ in self.root.rglob("*.safetensors")) >= cap:
            time.sleep(0.001)  # waits for room that never comes
        super().update_state_after_alloc(request, blocks, num_external_tokens)
