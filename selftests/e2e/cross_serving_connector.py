"""Negative control: ExampleConnector that serves one request's KV to another.

Loaded by vLLM through ``kv_connector_module_path = "cross_serving_connector"`` (this
folder on ``PYTHONPATH``). It stores and matches exactly like ExampleConnector; when
one forward step loads KV for several requests whose stored prefixes have the same
length, it rotates which stored prompt each request's blocks are filled from, so
every such request attends to another prompt's KV. One request at a time (the
two-pass test) loads correctly; the concurrency test must FAIL on output equality.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
)


class CrossServingConnector(ExampleConnector):
    """ExampleConnector whose loads in one step are served from each other's KV."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Rotate the stored prompts among same-length loads, load, then restore."""
        metadata = self._get_connector_metadata()
        groups: dict[int, list[Any]] = defaultdict(list)
        for req in getattr(metadata, "requests", []):
            if not req.is_store:
                groups[len(req.token_ids)].append(req)
        swapped: list[tuple[Any, Any, Any]] = []
        for group in groups.values():
            if len(group) < 2:
                continue
            keys = [(r.token_ids, r.mm_hashes) for r in group]
            for req, (ids, mm) in zip(group, keys[1:] + keys[:1], strict=True):
                swapped.append((req, req.token_ids, req.mm_hashes))
                req.token_ids, req.mm_hashes = ids, mm
        try:
            super().start_load_kv(forward_context, **kwargs)
        finally:
            for req, ids, mm in swapped:
                req.token_ids, req.mm_hashes = ids, mm
