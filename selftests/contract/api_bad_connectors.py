"""Connectors for the connector-API contract tests: one correct, each other one fault.

Loaded by vLLM through ``kv_connector_module_path = "api_bad_connectors"`` (the
self-tests put this folder on PYTHONPATH). :class:`ReportingExampleConnector` is
vLLM's ExampleConnector (both sides on CPU) made complete: per-interval transfer
stats (tokens saved and loaded, reset on every read), KV cache events for every
prompt it stores (vLLM's block hashes, tokens, block size), ``reset_cache`` that
empties its store, and a miss for requests that must not read cached KV. It must
pass every test of ``suites/contract/test_connector_api.py``; each subclass below
breaks exactly one of those.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    align_to_block_size,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash


@dataclass
class TokenStats(KVConnectorStats):
    """Tokens saved and loaded in one interval (counters)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"saved_tokens": 0, "loaded_tokens": 0}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for k, v in other.data.items():
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class ReportingExampleConnector(ExampleConnector):
    """Correct: stats per interval, events per store, reset, skip-reading miss,
    and a folder per model under ``shared_storage_path`` (one store, two models)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None
                 ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        from panel_connectors import FileChunkConnector

        self._storage_path = os.path.join(
            self._storage_path, FileChunkConnector.model_namespace(vllm_config))
        self._stats = TokenStats()
        self._events: list[Any] = []
        self._reqs: dict[str, Any] = {}

    # ---- worker side: count what moves
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for r in meta.requests:
            if not r.is_store:
                self._stats.data["loaded_tokens"] += int(r.slot_mapping.numel())
        super().start_load_kv(forward_context, **kwargs)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        for r in meta.requests:
            if r.is_store:
                self._stats.data["saved_tokens"] += int(r.slot_mapping.numel())
        super().wait_for_save()

    def get_kv_connector_stats(self) -> Any:
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, TokenStats()
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return TokenStats(data=dict(data)) if data is not None else TokenStats()

    # ---- scheduler side: events, reset, skip-reading
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        self._reqs[request.request_id] = request
        if request.skip_reading_prefix_cache:
            return 0, False
        n, is_async = super().get_num_new_matched_tokens(request,
                                                         num_computed_tokens)
        return max(0, n or 0), is_async

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        loads = set(self._requests_need_load)
        stores = []
        for new_req in scheduler_output.scheduled_new_reqs:
            token_ids = new_req.prompt_token_ids or []
            mm = [f.identifier for f in new_req.mm_features]
            if new_req.req_id not in loads and not self._found_match_for_prompt(
                    token_ids, mm):
                stores.append(new_req.req_id)
        meta = super().build_connector_meta(scheduler_output)
        for rid in stores:
            req = self._reqs.get(rid)
            if req is None:
                continue
            nb = align_to_block_size(len(req.prompt_token_ids), self._block_size) \
                // self._block_size
            if nb <= 0:
                continue
            self._events.append(self._stored_event(req, nb))
        return meta

    def _stored_event(self, req: Any, nb: int) -> Any:
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in req.block_hashes[:nb]],
            parent_block_hash=None,
            token_ids=list(req.all_token_ids[:nb * self._block_size]),
            block_size=self._block_size, lora_id=None, medium="CPU",
            lora_name=None)

    def take_events(self) -> Any:
        out, self._events = self._events, []
        return out

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        self._reqs.pop(request.request_id, None)
        return super().request_finished(request, block_ids)

    def reset_cache(self) -> bool | None:
        if os.path.isdir(self._storage_path):
            shutil.rmtree(self._storage_path)
        os.makedirs(self._storage_path, exist_ok=True)
        return True


class StatsNeverResetConnector(ReportingExampleConnector):
    """Fault: get_kv_connector_stats hands out the same, ever-growing counters."""

    def get_kv_connector_stats(self) -> Any:
        return None if self._stats.is_empty() else self._stats


class StatsWrongTypeConnector(ReportingExampleConnector):
    """Fault: the worker side returns a plain dict instead of KVConnectorStats."""

    def get_kv_connector_stats(self) -> Any:
        out = super().get_kv_connector_stats()
        return None if out is None else dict(out.data)


class PhantomEventConnector(ReportingExampleConnector):
    """Fault: announces a stored block that was never stored (or computed)."""

    def take_events(self) -> Any:
        out = super().take_events()
        if out:
            out.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(b"\x5a" * 32)],
                parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                medium="CPU", lora_name=None))
        return out


class EventsOffConnector(ReportingExampleConnector):
    """Correct: overrides take_events but its events are off (as LMCache with
    ``enable_kv_events: False``): it yields nothing, ever."""

    def take_events(self) -> Any:
        super().take_events()
        return []


class MissesOneEventConnector(ReportingExampleConnector):
    """Fault: announces every stored prompt's blocks but the last one."""

    def _stored_event(self, req: Any, nb: int) -> Any:
        return super()._stored_event(req, max(1, nb - 1))


class SkipsParentConnector(ReportingExampleConnector):
    """Fault: announces only the blocks it had not announced yet, the first of
    them without its parent: a prompt extending a stored one breaks the chain."""

    def _stored_event(self, req: Any, nb: int) -> Any:
        seen = self.__dict__.setdefault("_announced", set())
        hashes = [maybe_convert_block_hash(h) for h in req.block_hashes[:nb]]
        new = [i for i, h in enumerate(hashes) if h not in seen]
        seen.update(hashes)
        first = new[0] if new else nb
        return BlockStored(
            block_hashes=hashes[first:], parent_block_hash=None,
            token_ids=list(req.all_token_ids[first * self._block_size:
                                             nb * self._block_size]),
            block_size=self._block_size, lora_id=None, medium="CPU",
            lora_name=None)


class RawHashEventConnector(ReportingExampleConnector):
    """Fault: announces vLLM's raw BlockHash bytes instead of the external hash
    vLLM publishes (maybe_convert_block_hash)."""

    def _stored_event(self, req: Any, nb: int) -> Any:
        ev = super()._stored_event(req, nb)
        ev.block_hashes = [bytes(h) for h in req.block_hashes[:nb]]
        return ev


class ResetNoopConnector(ReportingExampleConnector):
    """Fault: reset_cache says it reset, but keeps every stored entry."""

    def reset_cache(self) -> bool | None:
        return True


class IgnoresSkipReadingConnector(ReportingExampleConnector):
    """Fault: serves cached KV to requests with skip_reading_prefix_cache."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        self._reqs[request.request_id] = request
        n, is_async = ExampleConnector.get_num_new_matched_tokens(
            self, request, num_computed_tokens)
        return max(0, n or 0), is_async


class UnusedHookConnector(ReportingExampleConnector):
    """Overrides handle_preemptions; a run without a preemption never drives it."""

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        return None


class PushDrainsLaterConnector(ReportingExampleConnector):
    """Correct: a finished request's store becomes visible only after its push
    drains, 8 scheduler steps later; ``has_pending_push_work`` says so meanwhile
    (as MooncakeStoreConnector holds its blocks until the store jobs end)."""

    PUSH_STEPS = 8  # beyond the driver's 4 idle steps after the last request

    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        self.__dict__["_push_steps"] = self.PUSH_STEPS
        return super().request_finished(request, block_ids)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        left = self.__dict__.get("_push_steps", 0)
        self.__dict__["_push_steps"] = max(0, left - 1)
        return super().build_connector_meta(scheduler_output)

    def has_pending_push_work(self) -> bool:
        return bool(self.__dict__.get("_push_steps", 0))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        if self.has_pending_push_work():
            return 0, False  # not in the store yet
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


class PushNeverDrainsConnector(PushDrainsLaterConnector):
    """Fault: once a request finished, ``has_pending_push_work`` answers True for
    ever: vLLM's engine never goes idle."""

    PUSH_STEPS = 10**9


class WorkerLookupConnector(ReportingExampleConnector):
    """Correct, Mooncake's shape: the worker serves lookups on a Unix socket under
    ``VLLM_RPC_BASE_PATH`` named by host only; the scheduler side connects to it
    when built (vLLM builds the workers first) and asks it on every lookup, which
    must reach this engine's worker."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None
                 ) -> None:
        import socket
        import threading

        from vllm import envs
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorRole,
        )

        super().__init__(vllm_config, role, kv_cache_config)
        self._engine = str(vllm_config.kv_transfer_config.engine_id)
        path = os.path.join(envs.VLLM_RPC_BASE_PATH,
                            f"tvc-lookup-{socket.gethostname()}")
        if role == KVConnectorRole.WORKER:
            if os.path.exists(path):
                os.unlink(path)
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(path)
            server.listen()

            def serve() -> None:
                while True:
                    conn, _ = server.accept()
                    with conn:
                        conn.recv(64)
                        conn.sendall(self._engine.encode())

            threading.Thread(target=serve, daemon=True).start()
        else:
            assert os.path.exists(path), (
                f"no lookup server at {path}: the scheduler was built before the "
                "worker")
            self._path = path

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        import socket

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(self._path)
            s.sendall(b"lookup")
            engine = s.recv(64).decode()
        assert engine == self._engine, (
            f"the lookup reached engine {engine}'s worker, not {self._engine}'s")
        return super().get_num_new_matched_tokens(request, num_computed_tokens)
