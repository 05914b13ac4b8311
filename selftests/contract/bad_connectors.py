"""Known-bad connectors: each a small ExampleConnector subclass with ONE fault.

Loaded by vLLM through ``kv_connector_module_path = "bad_connectors"`` (the
self-tests put this folder on PYTHONPATH). ExampleConnector is the base because
both its sides run on CPU, so every fault is exercised on any box.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    align_to_block_size,
)


def _first_loaded_rows(conn: ExampleConnector, forward_context: Any):
    """Per loading request: (first layer's KV, block, offset, row) of its first
    loaded token, in the harness's (num_blocks, H, B, 2*D) layout."""
    for req in conn._get_connector_metadata().requests:
        if req.is_store or not len(req.slot_mapping):
            continue
        name = next(iter(forward_context.no_compile_layers))
        kv = forward_context.no_compile_layers[name].kv_cache
        slot = int(req.slot_mapping[0])
        block, offset = slot // conn._block_size, slot % conn._block_size
        yield kv, block, offset, kv[block, :, offset]


class CountsLastTokenConnector(ExampleConnector):
    """Fault: matches the whole prompt aligned down, including the last token."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        if not self._found_match_for_request(request):
            return 0, False
        n = len(request.prompt_token_ids) // self._block_size * self._block_size
        return n - num_computed_tokens, False


class OverMatchConnector(ExampleConnector):
    """Fault: a match rounded up one block (claims tokens past the prompt)."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        n, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return (n + self._block_size if n else n), is_async


class UnalignedConnector(ExampleConnector):
    """Fault: reports one token less than its whole blocks: a hit that ends inside
    a block mid-prompt (not at the prompt's last token)."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        n, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return (n - 1 if n > 1 else n), is_async


class ClaimsUnstoredTailConnector(ExampleConnector):
    """Fault: reports len - 1 tokens (a full-prompt answer) although it stores
    only the prompt's whole blocks: the tail it claims was never stored."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        n, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if not n:
            return n, is_async
        return len(request.prompt_token_ids) - 1 - num_computed_tokens, is_async


class PhantomHitConnector(ExampleConnector):
    """Fault: returns hits it cannot load (nothing stored for a cold prompt)."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        n = align_to_block_size(len(request.prompt_token_ids) - 1, self._block_size)
        return max(0, n - num_computed_tokens), False


class LongPromptRaisesConnector(ExampleConnector):
    """Fault: its lookup raises for prompts over 512 tokens (a fixed-size key
    buffer, say): only a contract tier that sends long prompts sees it."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        if len(request.prompt_token_ids) > 512:
            raise RuntimeError("lookup key buffer holds at most 512 tokens")
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


class NoneFinishedConnector(ExampleConnector):
    """Fault: request_finished returns None instead of (delay_free_blocks,
    kv_transfer_params); vLLM's scheduler fails unpacking it."""

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        super().request_finished(request, block_ids)
        return None


class CorruptingLoadConnector(ExampleConnector):
    """Fault: flips one byte of the first loaded token in the first layer."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        for kv, block, offset, row in _first_loaded_rows(self, forward_context):
            flat = row.contiguous().view(-1).view(dtype=__import__("torch").uint8)
            flat[0] ^= 0x01
            kv[block, :, offset] = flat.view(row.dtype).view(row.shape)


class WrongBlockConnector(ExampleConnector):
    """Fault: loads every token one block further than vLLM allocated."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for req in meta.requests:
            if not req.is_store:
                req.slot_mapping = req.slot_mapping + self._block_size
        super().start_load_kv(forward_context, **kwargs)


class StrayWriteConnector(ExampleConnector):
    """Fault: loads correctly, then also copies the first loaded token's KV into
    the same slot of the cache's last block, which the request does not own."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        for kv, _block, offset, row in _first_loaded_rows(self, forward_context):
            kv[kv.shape[0] - 1, :, offset] = row


class WrongLayerConnector(ExampleConnector):
    """Fault: loads each layer's KV into the next layer (first into the last)."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        layers = forward_context.no_compile_layers
        names = list(layers)
        real = {n: layers[n].kv_cache for n in names}
        rotated = {n: real[names[(i + 1) % len(names)]] for i, n in enumerate(names)}
        for n in names:
            layers[n].kv_cache = rotated[n]
        try:
            super().start_load_kv(forward_context, **kwargs)
        finally:
            for n in names:
                layers[n].kv_cache = real[n]


class NeverHitConnector(ExampleConnector):
    """Fault: stores, but never reports a hit."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return 0, False


class UnserializableMetaConnector(ExampleConnector):
    """Fault: metadata carries a lock, which pickle cannot send to the workers."""

    def build_connector_meta(self, scheduler_output: Any):
        meta = super().build_connector_meta(scheduler_output)
        meta.guard = threading.Lock()
        return meta


class NoCapacityCheckConnector(ExampleConnector):
    """Fault: accepts a missing (or bogus) capacity_bytes."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.capacity_bytes = self._kv_transfer_config.get_from_extra_config(
            "capacity_bytes", 1 << 30)


class LeakyConnector(ExampleConnector):
    """Fault: asks vLLM to delay freeing blocks and never reports them sent."""

    def request_finished(self, request: Any, block_ids: list[int]):
        return True, None
