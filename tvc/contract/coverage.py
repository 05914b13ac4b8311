"""Coverage of the connector API and of KV-relevant settings, derived from vLLM.

:func:`inventory` reads from the *installed* vLLM every connector API member
(``api``), request field (``request``), engine setting (``config``) and
``KVCacheSpec`` kind (``layer``); :data:`CURATED` and :data:`REVIEWED_NOT_KV`
hold what the suite knows, anything else is :data:`NEW`. A
:class:`CoverageLog` per rig records meaningful calls (:data:`MEANINGFUL`);
:func:`coverage_table` turns the tests' ``tvc_coverage`` properties into the
table of ``summary.json``. Read docs/coverage.md.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

NEW = "new in this vLLM: not yet covered"
NOT_CALLED_HMA = ("not called by vLLM for a SupportsHMA connector "
                  "(Scheduler._connector_finished calls request_finished_all_groups)")
HMA_NOT_CALLED = frozenset({"api:KVConnectorBase_V1.request_finished"})
# settings every rig has: exercised only when the run drove two values or more
VARIED = frozenset({
    "config:ModelConfig.dtype", "config:ModelConfig.max_model_len",
    "config:CacheConfig.block_size", "config:CacheConfig.enable_prefix_caching",
    "config:KVTransferConfig.kv_role", "config:KVTransferConfig.kv_load_failure_policy",
})
PROPERTY = "tvc_coverage"  # the test property carrying a test's log


# ------------------------------------------------------------------ inventory
@dataclass(frozen=True)
class Owner:
    """A vLLM class whose members are inventoried.

    Attributes:
        kind: ``api``, ``request``, ``config`` or ``layer``.
        members: how members are listed: ``methods`` (public class-body
            attributes), ``struct`` (msgspec ``__struct_fields__``), ``init``
            (``__init__`` parameters), ``pydantic`` (``model_fields``),
            ``dataclass`` (``dataclasses.fields``), ``subclasses`` (recursive).

    """

    kind: str
    module: str
    name: str
    members: str


OWNERS: tuple[Owner, ...] = (
    Owner("api", "vllm.distributed.kv_transfer.kv_connector.v1.base",
          "KVConnectorBase_V1", "methods"),
    Owner("api", "vllm.distributed.kv_transfer.kv_connector.v1.base",
          "SupportsHMA", "methods"),
    Owner("api", "vllm.distributed.kv_transfer.kv_connector.v1.base",
          "KVConnectorWorkerMetadata", "methods"),
    Owner("api", "vllm.distributed.kv_transfer.kv_connector.v1.metrics",
          "KVConnectorStats", "methods"),
    Owner("api", "vllm.distributed.kv_events", "KVConnectorKVEvents", "methods"),
    Owner("request", "vllm.sampling_params", "SamplingParams", "struct"),
    Owner("request", "vllm.v1.request", "Request", "init"),
    Owner("request", "vllm.v1.engine", "EngineCoreRequest", "struct"),
    Owner("request", "vllm.entrypoints.openai.completion.protocol",
          "CompletionRequest", "pydantic"),
    Owner("config", "vllm.config", "ModelConfig", "dataclass"),
    Owner("config", "vllm.config", "CacheConfig", "dataclass"),
    Owner("config", "vllm.config", "ParallelConfig", "dataclass"),
    Owner("config", "vllm.config", "KVTransferConfig", "dataclass"),
    Owner("layer", "vllm.v1.kv_cache_interface", "KVCacheSpec", "subclasses"),
)


@dataclass
class Member:
    """One inventoried entry of the installed vLLM.

    Attributes:
        key: ``<kind>:<Owner>.<name>`` (``layer:<SpecClass>`` for layer kinds).
        source: ``vllm/<path>:<line>`` of its definition (``?`` if unreadable).
        obj: the attribute itself (``api`` only), for override checks.

    """

    key: str
    kind: str
    owner: str
    name: str
    source: str
    obj: Any = None


def _vllm_relpath(path: str) -> str:
    """``.../site-packages/vllm/x/y.py`` -> ``vllm/x/y.py``."""
    norm = path.replace(os.sep, "/")
    i = norm.rfind("/vllm/")
    return norm[i + 1:] if i >= 0 else norm


def _func_of(attr: Any) -> Any:
    """The plain function behind a method, property, classmethod or staticmethod."""
    if isinstance(attr, property):
        return attr.fget
    if isinstance(attr, (classmethod, staticmethod)):
        return attr.__func__
    return attr


def source_of(obj: Any) -> str:
    """``vllm/<path>:<line>`` of a function, property or class, or ``?``.

    The line is the definition's first, decorators included
    (:func:`inspect.getsourcelines`).
    """
    fn = inspect.unwrap(_func_of(obj))
    try:
        path = inspect.getsourcefile(fn) or "?"
        _lines, line = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return "?"
    return f"{_vllm_relpath(path)}:{line}"


def _field_lines(cls: type) -> dict[str, int]:
    """Field name -> source line of its annotation in ``cls`` (and its bases)."""
    import ast
    import textwrap

    out: dict[str, int] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.split(".")[0] != "vllm":
            continue
        try:
            lines, start = inspect.getsourcelines(klass)
        except (OSError, TypeError):
            continue
        try:
            tree = ast.parse(textwrap.dedent("".join(lines)))
        except SyntaxError:
            continue
        first = tree.body[0] if tree.body else None
        body = first.body if isinstance(first, ast.ClassDef) else []
        for node in body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out[node.target.id] = start + node.lineno - 1
    return out


def _param_lines(fn: Any) -> dict[str, int]:
    """Line of each parameter of ``fn``'s signature in its source file."""
    import ast
    import textwrap

    try:
        lines, start = inspect.getsourcelines(fn)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return {}
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return {}
    args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
    return {a.arg: start + a.lineno - 1 for a in args}


def _cls_file(cls: type) -> str:
    try:
        return _vllm_relpath(inspect.getsourcefile(cls) or "?")
    except TypeError:
        return "?"


def import_owners(owners: Iterable[Owner] = OWNERS) -> None:
    """Import the vLLM modules :func:`inventory` reads (the slow part, ~6-12 s)."""
    import importlib

    for o in owners:
        try:
            importlib.import_module(o.module)
        except ImportError:
            pass  # inventory() names the owner absent


def inventory(owners: Iterable[Owner] = OWNERS) -> list[Member]:
    """Every member of ``owners`` as the installed vLLM defines it.

    Returns:
        one :class:`Member` per public method/property (``api``), field
        (``request``, ``config``) or subclass (``layer``), in source order where
        vLLM has one; an owner vLLM lacks gives one member ``*`` saying so.

    """
    import dataclasses
    import importlib

    out: list[Member] = []
    for o in owners:
        try:
            cls = getattr(importlib.import_module(o.module), o.name)
        except (ImportError, AttributeError) as exc:
            out.append(Member(f"{o.kind}:{o.name}.*", o.kind, o.name, "*",
                              f"absent in this vLLM ({type(exc).__name__})"))
            continue
        if o.members == "methods":
            for name, attr in vars(cls).items():
                if name.startswith("_"):
                    continue
                if not callable(_func_of(attr)) and not isinstance(attr, property):
                    continue
                out.append(Member(f"api:{o.name}.{name}", o.kind, o.name, name,
                                  source_of(attr), attr))
            continue
        if o.members == "subclasses":
            seen: list[type] = []
            todo = list(cls.__subclasses__())
            while todo:
                sub = todo.pop(0)
                if sub in seen or not sub.__module__.startswith("vllm"):
                    continue
                seen.append(sub)
                todo.extend(sub.__subclasses__())
            for sub in seen:
                out.append(Member(f"layer:{sub.__name__}", o.kind, o.name,
                                  sub.__name__, source_of(sub)))
            continue
        if o.members == "struct":
            names = [n for n in getattr(cls, "__struct_fields__", ())]
        elif o.members == "pydantic":
            names = list(getattr(cls, "model_fields", {}))
        elif o.members == "dataclass":
            names = [f.name for f in dataclasses.fields(cls)]
        else:  # init
            names = [p for p in inspect.signature(cls.__init__).parameters
                     if p != "self"]
        names = [n for n in names if not n.startswith("_")]
        lines = _field_lines(cls)
        if o.members == "init":
            lines = _param_lines(cls.__init__) | lines
        path = _cls_file(cls)
        for n in names:
            src = f"{path}:{lines[n]}" if n in lines else f"{path}:?"
            out.append(Member(f"{o.kind}:{o.name}.{n}", o.kind, o.name, n, src))
    return out


# ------------------------------------------------------------- curated tables
@dataclass(frozen=True)
class Curated:
    """What the suite knows about one entry.

    Attributes:
        reason: why it matters (what KV it selects or bytes it changes).
        expectation: what must hold when exercised (a miss, identical output, a
            clean refusal naming the key; never wrong KV).
        tests: where it is exercised (``""`` = no test yet).
        needs: the log key(s) that count as exercising it (default: its own key).

    """

    reason: str
    expectation: str
    tests: str = ""
    needs: tuple[str, ...] = ()


_SCEN = "contract test_scenarios"
# request fields the OpenAI front end resolves into prompt token ids before the
# engine: the connector only ever sees the tokens they produce
_FRONT_END = "front end -> Request.prompt_token_ids (contract test_scenarios)"
_FRONT_END_WHY = ("resolved by the front end before the engine "
                  "(CompletionRequest.build_tok_params -> the renderer's "
                  "TokenizeParams -> Request.prompt_token_ids); the connector sees "
                  "only the resulting token ids")
_API = "contract test_connector_api"
_C = Curated
CURATED: dict[str, Curated] = {
    # --- scheduler side
    "api:KVConnectorBase_V1.get_num_new_matched_tokens": _C(
        "the external prefix cache hit: how many prompt tokens vLLM will not compute",
        "within [0, len - 1 - local], whole blocks, bit-identical KV once loaded",
        _SCEN),
    "api:KVConnectorBase_V1.update_state_after_alloc": _C(
        "the blocks vLLM allocated for the matched tokens (the load's destination)",
        "the load fills exactly those blocks", _SCEN),
    "api:KVConnectorBase_V1.build_connector_meta": _C(
        "the step's load/save plan sent to every worker",
        "survives serialization; the worker loads/saves what it names", _SCEN),
    "api:KVConnectorBase_V1.update_connector_output": _C(
        "the workers' finished transfers and worker metadata for the scheduler",
        "residency only after every rank committed; finished requests freed",
        _SCEN),
    "api:KVConnectorBase_V1.request_finished": _C(
        "hands the request's blocks over (delay_free_blocks) and kv_transfer_params",
        "blocks freed after finished_sending; no leak", _SCEN),
    "api:KVConnectorBase_V1.on_new_request": _C(
        "called by Scheduler.add_request for every request",
        "no state that outlives the request", _SCEN),
    "api:KVConnectorBase_V1.take_events": _C(
        "the KV cache events vLLM publishes (BlockStored / BlockRemoved)",
        "every BlockStored names blocks this run stored, with their tokens; "
        "BlockRemoved only for stored blocks", _API),
    "api:KVConnectorBase_V1.get_kv_connector_stats": _C(
        "per-interval transfer stats vLLM aggregates, reduces and logs",
        "None or KVConnectorStats; after idle steps an answer adds nothing when "
        "aggregated with itself (counters reset per interval); aggregate/reduce/"
        "build_kv_connector_stats work as vLLM's logger uses them",
        _API),
    "api:KVConnectorBase_V1.reset_cache": _C(
        "Scheduler.reset_prefix_cache(reset_connector=True) empties the connector",
        "True -> the next lookup of a stored prompt is a miss", _API),
    "api:KVConnectorBase_V1.has_pending_push_work": _C(
        "keeps the engine stepping while push transfers drain",
        "False once every transfer finished (the engine may quiesce)", _API),
    "api:KVConnectorBase_V1.bind_gpu_block_pool": _C(
        "Scheduler.__init__ hands the connector vLLM's block pool",
        "ref counts the connector takes are given back (no leak)", _SCEN),
    "api:KVConnectorBase_V1.requires_kv_delivery": _C(
        "read by Scheduler.__init__: drop stale output until KV is delivered",
        "a bool; the scenarios run with vLLM's own handling", _SCEN),
    "api:KVConnectorBase_V1.supports_divergent_local_hybrid_hits": _C(
        "read by the scheduler for hybrid (multi-group) local hits",
        "a bool", _API),
    "api:KVConnectorBase_V1.set_xfer_handshake_metadata": _C(
        "the engine core hands the scheduler side every worker's handshake",
        "accepts what the worker side published", _API),
    "api:KVConnectorBase_V1.set_xfer_handshake_metadata_pp_aware": _C(
        "EngineCore.__init__ calls it with {(pp_rank, tp_rank): metadata}",
        "accepts what the worker side published", _API),
    "api:SupportsHMA.request_finished_all_groups": _C(
        "request_finished for every KV cache group (hybrid memory allocator)",
        "as request_finished, for every group", _SCEN),
    # --- worker side
    "api:KVConnectorBase_V1.register_kv_caches": _C(
        "the per-layer KV tensors the worker loads into and saves from",
        "loads fill only the blocks named", _SCEN),
    "api:KVConnectorBase_V1.register_cross_layers_kv_cache": _C(
        "the cross-layer KV tensor (prefer_cross_layer_blocks)",
        "loads fill only the blocks named", _SCEN),
    "api:KVConnectorBase_V1.prefer_cross_layer_blocks": _C(
        "selects the cross-layer KV layout", "a bool", _SCEN),
    "api:KVConnectorBase_V1.bind_connector_metadata": _C(
        "the step's plan on the worker", "called every step", _SCEN),
    "api:KVConnectorBase_V1.clear_connector_metadata": _C(
        "end of the step's plan", "called every step", _SCEN),
    "api:KVConnectorBase_V1.has_connector_metadata": _C(
        "whether a plan is bound", "True between bind and clear", _API),
    "api:KVConnectorBase_V1.start_load_kv": _C(
        "starts the step's loads", "the loaded KV is bit-identical", _SCEN),
    "api:KVConnectorBase_V1.wait_for_layer_load": _C(
        "a layer's load is complete", "the loaded KV is bit-identical", _SCEN),
    "api:KVConnectorBase_V1.save_kv_layer": _C(
        "saves a layer's KV", "a later load returns these bytes", _SCEN),
    "api:KVConnectorBase_V1.wait_for_save": _C(
        "the step's saves are complete", "a later load returns these bytes", _SCEN),
    "api:KVConnectorBase_V1.get_finished": _C(
        "async sends/receives finished", "every transfer ends exactly once", _SCEN),
    "api:KVConnectorBase_V1.get_block_ids_with_load_errors": _C(
        "blocks whose load failed (vLLM recomputes or fails the request)",
        "exactly the failed blocks", _SCEN),
    "api:KVConnectorBase_V1.handle_preemptions": _C(
        "the model runner reports preempted requests before their blocks are reused",
        "no load or save into a preempted request's blocks afterwards", _SCEN),
    "api:KVConnectorBase_V1.build_connector_worker_meta": _C(
        "worker -> scheduler residency report, aggregated over ranks",
        "a chunk resident only when every rank committed it", _SCEN),
    "api:KVConnectorBase_V1.get_kv_connector_kv_cache_events": _C(
        "worker-side KV cache events, combined over ranks by KVOutputAggregator",
        "None or KVConnectorKVEvents naming blocks this run stored", _API),
    "api:KVConnectorBase_V1.get_handshake_metadata": _C(
        "worker handshake published to the engine core",
        "None or KVConnectorHandshakeMetadata that survives pickling", _API),
    "api:KVConnectorBase_V1.get_finished_count": _C(
        "expected completions per transfer (KVOutputAggregator)",
        "None or a positive int", _API),
    "api:KVConnectorBase_V1.shutdown": _C(
        "worker shutdown", "returns; leaves no thread or file behind", _SCEN),
    "api:KVConnectorBase_V1.role": _C(
        "which side this instance is", "the role vLLM created it with", _API),
    # --- classmethods
    "api:KVConnectorBase_V1.get_required_kvcache_layout": _C(
        "the KV layout the connector needs (HND/NHD)",
        "None or a layout this vLLM defines", _API),
    "api:KVConnectorBase_V1.requires_piecewise_for_cudagraph": _C(
        "forces PIECEWISE CUDA graphs for layer-wise transfers",
        "a bool for the profile's extra config", _API),
    "api:KVConnectorBase_V1.build_kv_connector_stats": _C(
        "rebuilds stats from their data dict (vLLM's logger, MultiConnector)",
        "the same type and reduce() as the worker's stats", _API),
    "api:KVConnectorBase_V1.build_prom_metrics": _C(
        "per-connector Prometheus metrics (vLLM's KVConnectorProm)",
        "builds and observes a non-empty interval on a private registry", _API),
    "api:KVConnectorBase_V1.set_host_xfer_buffer_ops": _C(
        "host-buffer copy op (platforms without device-direct transfer)",
        "not driven (no such platform here)"),
    # --- added in vLLM 0.33
    "api:KVConnectorBase_V1.supports_sleep_mode": _C(
        "whether the connector follows sleep mode's KV cache remap",
        "a bool; not driven (sleep mode needs a GPU worker)"),
    "api:KVConnectorBase_V1.get_mem_pool_context": _C(
        "a custom allocation context for the KV cache (GPU worker)",
        "None or a context manager; not driven"),
    "api:KVConnectorBase_V1.unregister_kv_caches": _C(
        "drops KV registrations before sleep", "idempotent; not driven"),
    "api:KVConnectorBase_V1.restore_kv_caches": _C(
        "redoes the registrations after wake-up", "idempotent; not driven"),
    "api:KVConnectorBase_V1.finish_forward": _C(
        "the forward no longer reads this step's KV (model runner V2)",
        "called every step; no load or save changes KV the forward read", _SCEN),
    "api:KVConnectorBase_V1.reset_capture_state": _C(
        "resets state mutated while capturing CUDA graphs",
        "not driven (CUDA graphs: e2e tier)"),
    "api:KVConnectorBase_V1.get_transfer_results": _C(
        "finished sends, receives and failed receives of the step",
        "every transfer ends exactly once; a failed receive is reported failed",
        _SCEN),
    "api:KVConnectorBase_V1.bind_kv_cache_manager": _C(
        "Scheduler.__init__ hands the connector vLLM's KV cache manager",
        "ref counts the connector takes are given back (no leak)", _SCEN),
    "api:KVConnectorBase_V1.get_loaded_kv_cache_group_ids": _C(
        "which KV cache groups a load restores (hybrid models)",
        "exactly the groups the load fills", _SCEN),
    "api:KVConnectorBase_V1.get_external_cache_hit_sources": _C(
        "splits an external hit by the cache tier that supplied it",
        "counts sum to num_external_tokens", _SCEN),
    "api:KVConnectorBase_V1.register_finished_partial_tail": _C(
        "finish-time partial-tail offloads (hybrid models)",
        "blocks kept until get_finished; not driven (full attention only)"),
    "api:KVConnectorBase_V1.has_pending_block_frees": _C(
        "pending transfers may free blocks instead of a preemption",
        "a bool; False once every transfer finished", _SCEN),
    "api:KVConnectorStats.to_dict": _C(
        "the stats payload vLLM 0.33 sends to its logger (make_stats)",
        "rebuilt by build_kv_connector_stats with the same figures", _API),
    "request:Request.kv_hints": _C(
        "orchestrator KV hints (actions such as pin/prefetch) for the request",
        "never changes the KV a request reads; not driven"),
    "request:EngineCoreRequest.kv_hints": _C(
        "as Request.kv_hints", "not driven", needs=("request:Request.kv_hints",)),
    "request:SamplingParams.prompt_logprob_start": _C(
        "first prompt row scored: rows from there must be computed, not cached",
        "no cached KV for the scored rows; not driven"),
    "request:CompletionRequest.mm_payload": _C(
        "-> Request.mm_features", "a miss across different media",
        f"{_API}::test_multimodal_item_hits_never_serve_another_image",
        needs=("request:Request.mm_features",)),
    "config:CacheConfig.kv_cache_layout": _C(
        "the byte layout of every block (HND / NHD)",
        "loads fill the layout registered; a clean refusal otherwise"),
    "config:CacheConfig.hash_block_size": _C(
        "tokens per block hash (the external keys)", "a miss across sizes"),
    "config:CacheConfig.cache_hit_alignment_tokens": _C(
        "hits rounded to this many tokens", "matched tokens are multiples"),
    "config:CacheConfig.effective_attention_block_size": _C(
        "tokens per attention block", "whole blocks"),
    "config:CacheConfig.swa_bounded_replay": _C(
        "sliding-window hits recompute the last window", "identical output"),
    "config:CacheConfig.enable_mamba_shared_prefix_checkpoint": _C(
        "mamba state checkpoints at shared prefixes", "refusal or identical"),
    "config:CacheConfig.use_kda_recoverssm": _C(
        "recovers SSM state", "refusal or identical"),
    "config:ParallelConfig.dcp_q_replicate": _C(
        "DCP query replication: which ranks hold which tokens",
        "each rank its own tokens"),
    "config:ParallelConfig.enable_hc_sp": _C(
        "sequence parallelism for HyperConnection (tokens split over TP ranks)",
        "each rank its own tokens"),
    "layer:HiSparseHotSpec": _C("sparse attention, hot part", "refusal or identical"),
    "layer:HiSparseResidentSpec": _C(
        "sparse attention, resident part", "refusal or identical"),
    "layer:CircularBufferSpec": _C(
        "a ring of blocks reused in place", "refusal or identical"),
    # --- stats / events / worker metadata containers
    "api:KVConnectorStats.reset": _C(
        "clears an interval", "empty afterwards", _API),
    "api:KVConnectorStats.aggregate": _C(
        "merges two intervals (scheduler + workers)", "same type; counts add up",
        _API),
    "api:KVConnectorStats.reduce": _C(
        "the logged figures", "dict of int/float", _API),
    "api:KVConnectorStats.is_empty": _C(
        "whether anything was observed", "a bool", _API),
    "api:KVConnectorWorkerMetadata.aggregate": _C(
        "merges the ranks' worker metadata (KVOutputAggregator)",
        "residency only when every rank committed", "contract test_tp"),
    "api:KVConnectorKVEvents.add_events": _C("combines ranks' events", "", _API),
    "api:KVConnectorKVEvents.aggregate": _C("events every rank emitted", "", _API),
    "api:KVConnectorKVEvents.increment_workers": _C("counts ranks", "", _API),
    "api:KVConnectorKVEvents.get_all_events": _C(
        "the events", "naming blocks this run stored", _API),
    "api:KVConnectorKVEvents.get_number_of_workers": _C("ranks seen", "", _API),
    "api:KVConnectorKVEvents.clear_events": _C("empties", "", _API),
    "api:KVConnectorKVEvents.merge": _C("adds another container", "", _API),
    # --- request fields
    "request:Request.prompt_token_ids": _C(
        "the tokens every block hash covers", "identical output, whole blocks", _SCEN),
    "request:Request.cache_salt": _C(
        "mixed into the first block's hash: tenants must not share KV",
        "a miss across salts", f"{_SCEN}::test_tenant_isolation_cache_salt_and_lora"),
    "request:Request.lora_request": _C(
        "the adapter's name is mixed into every block hash",
        "a miss across adapters",
        f"{_SCEN}::test_tenant_isolation_cache_salt_and_lora"),
    "request:Request.prompt_embeds": _C(
        "embeddings instead of token ids (prompt_token_ids None, all_token_ids "
        "0s): the embeds' hash keys the blocks",
        "a miss across embeddings of one length; a hit of the same embeddings",
        "contract test_exploration [tenants]"),
    "request:Request.mm_features": _C(
        "multimodal inputs: their hashes key the blocks holding placeholders",
        "no block overlapping a placeholder served for another image with the "
        "same placeholder tokens; bit-identical loads",
        f"{_API}::test_multimodal_item_hits_never_serve_another_image"),
    "request:Request.pooling_params": _C(
        "pooling tasks set skip_reading_prefix_cache",
        "a miss when skip_reading_prefix_cache"),
    "request:Request.sampling_params": _C(
        "carries prompt_logprobs / skip_reading_prefix_cache / kv_transfer_params",
        "see SamplingParams", _API, needs=("request:SamplingParams.prompt_logprobs",)),
    "request:SamplingParams.prompt_logprobs": _C(
        "prompt logprobs need every prompt token computed: vLLM sets "
        "skip_reading_prefix_cache (sampling_params.py, __post_init__)",
        "a miss (0 matched tokens): no cached KV is read", _API),
    "request:SamplingParams.skip_reading_prefix_cache": _C(
        "the request must not read cached KV (Request.skip_reading_prefix_cache)",
        "a miss (0 matched tokens)", _API),
    "request:SamplingParams.extra_args": _C(
        "carries kv_transfer_params (Request.kv_transfer_params)",
        "a P/D connector reads/writes the remote KV it names", "pd tier"),
    "request:SamplingParams.truncate_prompt_tokens": _C(
        "changes the prompt tokens; the renderer truncates before the engine "
        "(TokenizeParams), the connector sees the kept tokens",
        "as Request.prompt_token_ids: a hit of exactly the kept tokens' prefix",
        _FRONT_END, needs=("request:Request.prompt_token_ids",)),
    "request:EngineCoreRequest.prompt_token_ids": _C(
        "as Request.prompt_token_ids", "", _SCEN,
        needs=("request:Request.prompt_token_ids",)),
    "request:EngineCoreRequest.cache_salt": _C(
        "as Request.cache_salt", "a miss across salts", _SCEN,
        needs=("request:Request.cache_salt",)),
    "request:EngineCoreRequest.lora_request": _C(
        "as Request.lora_request", "a miss across adapters", _SCEN,
        needs=("request:Request.lora_request",)),
    "request:EngineCoreRequest.prompt_embeds": _C(
        "as Request.prompt_embeds", "a miss", needs=("request:Request.prompt_embeds",)),
    "request:EngineCoreRequest.mm_features": _C(
        "as Request.mm_features", "a miss", _API,
        needs=("request:Request.mm_features",)),
    "request:EngineCoreRequest.sampling_params": _C(
        "as Request.sampling_params", "", _API,
        needs=("request:SamplingParams.prompt_logprobs",)),
    "request:EngineCoreRequest.pooling_params": _C(
        "as Request.pooling_params", "a miss",
        needs=("request:Request.pooling_params",)),
    "request:CompletionRequest.prompt": _C(
        "the prompt (tokenized by the front end)", "identical output", "e2e tier"),
    "request:CompletionRequest.model": _C(
        "selects base model or LoRA adapter", "a miss across adapters", "e2e tier"),
    "request:CompletionRequest.cache_salt": _C(
        "-> Request.cache_salt", "a miss across salts", "e2e tier",
        needs=("request:Request.cache_salt",)),
    "request:CompletionRequest.prompt_logprobs": _C(
        "-> SamplingParams.prompt_logprobs", "a miss", "e2e tier",
        needs=("request:SamplingParams.prompt_logprobs",)),
    "request:CompletionRequest.echo": _C(
        "echo with logprobs asks for prompt logprobs (CompletionRequest."
        "to_sampling_params: prompt_logprobs = logprobs when echo)", "a miss",
        f"{_API}::test_request_that_must_not_read_cached_kv_gets_a_miss",
        needs=("request:SamplingParams.prompt_logprobs",)),
    "request:CompletionRequest.prompt_embeds": _C(
        "-> Request.prompt_embeds", "a miss", needs=("request:Request.prompt_embeds",)),
    "request:CompletionRequest.kv_transfer_params": _C(
        "-> SamplingParams.extra_args['kv_transfer_params'] (P/D)",
        "the remote KV named", "pd tier"),
    "request:CompletionRequest.add_special_tokens": _C(
        "changes the prompt tokens (a BOS or not): " + _FRONT_END_WHY,
        "as Request.prompt_token_ids", _FRONT_END,
        needs=("request:Request.prompt_token_ids",)),
    "request:CompletionRequest.truncate_prompt_tokens": _C(
        "changes the prompt tokens (the last k kept): " + _FRONT_END_WHY,
        "as Request.prompt_token_ids", _FRONT_END,
        needs=("request:Request.prompt_token_ids",)),
    "request:CompletionRequest.truncation_side": _C(
        "which end truncation removes: " + _FRONT_END_WHY,
        "as Request.prompt_token_ids", _FRONT_END,
        needs=("request:Request.prompt_token_ids",)),
    # --- engine settings
    "config:ModelConfig.model": _C(
        "another model's KV must never load (shapes or values differ); vLLM's "
        "block hashes do not cover the model",
        "a miss or a clean refusal naming the key",
        "contract test_connector_api::test_another_model_on_one_store_gets_a_miss"),
    "config:ModelConfig.dtype": _C(
        "element type of every KV byte", "a miss across dtypes on one store; "
        "bit-identical loads for each", f"{_SCEN}; {_API}::"
        "test_another_model_on_one_store_gets_a_miss"),
    "config:ModelConfig.revision": _C(
        "other weights, other KV", "a miss", ""),
    "config:ModelConfig.quantization": _C(
        "other weights, other KV", "a miss", ""),
    "config:ModelConfig.hf_overrides": _C(
        "may change layers, heads, head size", "a miss or refusal", ""),
    "config:ModelConfig.max_model_len": _C(
        "longest prompt the connector is asked about", "matched <= len - 1", _SCEN),
    "config:ModelConfig.disable_sliding_window": _C(
        "full attention instead of sliding window", "a miss or refusal", ""),
    "config:ModelConfig.enable_prompt_embeds": _C(
        "allows prompt_embeds requests", "see Request.prompt_embeds", "",
        needs=("request:Request.prompt_embeds",)),
    "config:CacheConfig.block_size": _C(
        "tokens per block: the unit of every hit and every block hash",
        "whole blocks; identical output for each size", _SCEN),
    "config:CacheConfig.cache_dtype": _C(
        "KV element type (auto, fp8...): same shape, other bytes",
        "a miss or refusal across KV cache dtypes on one store",
        "contract test_connector_api::test_another_model_on_one_store_gets_a_miss"),
    "config:CacheConfig.sliding_window": _C(
        "blocks outside the window are freed", "a miss or refusal", ""),
    "config:CacheConfig.enable_prefix_caching": _C(
        "local prefix cache on/off: the local part of each hit",
        "local + external consistent either way", _SCEN),
    "config:CacheConfig.prefix_caching_hash_algo": _C(
        "the block hash function: every Request.block_hashes value and width",
        "the hit rule and bit-identical loads under each algorithm",
        "contract test_connector_api::"
        "test_block_hash_algorithm_keeps_hits_and_loads_exact"),
    "config:CacheConfig.kv_cache_dtype_skip_layers": _C(
        "per-layer KV dtype", "a miss or refusal", ""),
    "config:CacheConfig.mamba_cache_dtype": _C("mamba state dtype", "refusal", ""),
    "config:CacheConfig.mamba_block_size": _C("mamba state block", "refusal", ""),
    "config:CacheConfig.mamba_cache_mode": _C("mamba state caching", "refusal", ""),
    "config:CacheConfig.kv_sharing_fast_prefill": _C(
        "layers sharing KV", "identical output", ""),
    "config:CacheConfig.prefix_match_unit": _C(
        "granularity of prefix matches", "whole units", ""),
    "config:ParallelConfig.tensor_parallel_size": _C(
        "heads per rank: the bytes each rank holds", "identical output per rank",
        "contract test_tp"),
    "config:ParallelConfig.rank": _C(
        "which heads this rank owns", "each rank loads its own heads",
        "contract test_tp"),
    "config:ParallelConfig.pipeline_parallel_size": _C(
        "layers per worker: each pipeline stage registers its own layers",
        "each stage loads exactly its own layers (bit-identical)",
        "contract test_tp::test_pp_round_trip_is_bit_identical_on_every_stage"),
    "config:ParallelConfig.decode_context_parallel_size": _C(
        "tokens split across ranks", "each rank loads its own tokens", ""),
    "config:ParallelConfig.prefill_context_parallel_size": _C(
        "tokens split across ranks", "each rank loads its own tokens", ""),
    "config:ParallelConfig.dcp_kv_cache_interleave_size": _C(
        "token interleave across DCP ranks", "each rank its own tokens", ""),
    "config:ParallelConfig.cp_kv_cache_interleave_size": _C(
        "token interleave across CP ranks", "each rank its own tokens", ""),
    "config:ParallelConfig.data_parallel_rank": _C(
        "DP ranks share one store", "a hit from another DP rank is identical", ""),
    "config:ParallelConfig.world_size": _C(
        "ranks per engine", "as tensor_parallel_size", "contract test_tp"),
    "config:KVTransferConfig.kv_connector": _C(
        "which connector", "resolves or refuses naming it",
        "contract test_connector_config"),
    "config:KVTransferConfig.kv_connector_module_path": _C(
        "where the connector lives", "resolves or refuses naming it",
        "contract test_connector_config"),
    "config:KVTransferConfig.kv_role": _C(
        "may the engine store (producer), load (consumer) or both",
        "a clean refusal or the role kept", "contract test_connector_config"),
    "config:KVTransferConfig.kv_connector_extra_config": _C(
        "the connector's own settings", "a clean refusal naming the key",
        "contract test_connector_config"),
    "config:KVTransferConfig.kv_load_failure_policy": _C(
        "recompute or fail a request whose load failed",
        "only that request recomputed (identical) or failed", _SCEN),
    "config:KVTransferConfig.engine_id": _C(
        "P/D peer identity", "the named peer's KV only", "pd tier"),
    "config:KVTransferConfig.kv_rank": _C("P/D rank", "own rank's KV", "pd tier"),
    "config:KVTransferConfig.kv_parallel_size": _C("P/D ranks", "", "pd tier"),
    "config:KVTransferConfig.kv_buffer_device": _C(
        "where transfer buffers live", "identical output", ""),
    "config:KVTransferConfig.enable_permute_local_kv": _C(
        "permutes the local KV layout for transfer", "identical output", ""),
    # --- layer kinds
    "layer:FullAttentionSpec": _C(
        "full attention: every block of the prompt", "bit-identical loads", _SCEN),
    "layer:SlidingWindowSpec": _C(
        "only the window's blocks are kept", "a miss, identical output or refusal"),
    "layer:ChunkedLocalAttentionSpec": _C(
        "attention within chunks", "a miss, identical output or refusal"),
    "layer:MLAAttentionSpec": _C(
        "one latent vector per token (no heads split)",
        "identical output or refusal"),
    "layer:SlidingWindowMLASpec": _C("MLA in a window", "refusal or identical"),
    "layer:MambaSpec": _C("recurrent state, not per-token KV", "refusal or identical"),
    "layer:CrossAttentionSpec": _C(
        "encoder KV (not the prompt's)", "refusal or identical"),
    "layer:EncoderOnlyAttentionSpec": _C("no KV cache kept", "nothing stored"),
    "layer:SinkFullAttentionSpec": _C("attention sinks", "refusal or identical"),
    "layer:RSWASpec": _C("sliding window variant", "refusal or identical"),
    "layer:HiddenStateCacheSpec": _C("hidden states, not KV", "refusal or identical"),
    "layer:UniformTypeKVCacheSpecs": _C(
        "several specs of one type in one group", "as its members"),
    "layer:AttentionSpec": _C("base of the attention specs", "as its subclasses"),
}

# Fields read in vLLM 0.28.0 and 0.33.0 and judged not to change which KV a
# request may read or write, a block's bytes, or which blocks a rank owns.
_SAMPLING = ("sampling and output shaping: acts on logits or text after the "
             "prompt's KV exists")
_FRONT = "front-end / transport / bookkeeping; no effect on the KV of a block"
_RUNTIME = "runtime, memory or launch settings; no effect on the bytes of a block"
REVIEWED_NOT_KV: dict[str, tuple[str, tuple[str, ...]]] = {
    "SamplingParams": (_SAMPLING, (
        "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
        "ignore_eos", "max_tokens", "min_tokens", "logprobs", "logprob_token_ids",
        "flat_logprobs", "detokenize", "skip_special_tokens",
        "spaces_between_special_tokens", "include_stop_str_in_output",
        "output_kind", "stream_interval", "skip_clone",
        "output_text_buffer_length", "structured_outputs", "logit_bias",
        "allowed_token_ids", "routed_experts_prompt_start", "bad_words",
        "thinking_token_budget", "repetition_detection", "guided_decoding",
        "logits_processors", "watermarking", "prompt_logprob_token_ids",
        "trace_decode_token_ids")),
    "Request": (_FRONT, (
        "request_id", "client_index", "arrival_time", "prompt_is_token_ids",
        "priority", "trace_headers", "block_hasher", "resumable", "session_id",
        "reasoning_ended", "reasoning_parser_kwargs", "abort_immediately",
        "structured_output_request", "eos_token_id")),
    "EngineCoreRequest": (_FRONT, (
        "request_id", "arrival_time", "data_parallel_rank", "prompt_is_token_ids",
        "client_index", "current_wave", "priority", "trace_headers", "resumable",
        "external_req_id", "reasoning_ended", "reasoning_parser_kwargs",
        "abort_immediately", "session_id", "eos_token_id")),
    "CompletionRequest": (_SAMPLING + "; or " + _FRONT, (
        "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
        "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
        "temperature", "top_p", "user", "use_beam_search", "top_k", "min_p",
        "repetition_penalty", "length_penalty", "stop_token_ids",
        "include_stop_str_in_output", "ignore_eos", "min_tokens",
        "skip_special_tokens", "spaces_between_special_tokens",
        "allowed_token_ids", "logprob_token_ids", "bad_words", "response_format",
        "structured_outputs", "priority", "request_id", "session_id",
        "return_tokens_as_token_ids", "return_token_ids",
        "routed_experts_prompt_start", "return_token_offsets",
        "ec_transfer_params", "vllm_xargs", "repetition_detection",
        "thinking_token_budget", "stream_interval", "guided_json",
        "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
        "guided_whitespace_pattern", "logits_processors", "watermarking",
        "return_weight_versions", "return_mm_kwargs")),
    "ModelConfig": (_RUNTIME + "; or " + _FRONT, (
        "model_weights", "runner", "convert", "tokenizer", "tokenizer_mode",
        "trust_remote_code", "seed", "hf_config", "hf_text_config",
        "hf_config_path", "allowed_local_media_path", "allowed_media_domains",
        "code_revision", "tokenizer_revision", "spec_target_max_model_len",
        "quantization_config", "allow_deprecated_quantization", "enforce_eager",
        "enable_return_routed_experts", "return_sampling_mask", "max_logprobs",
        "logprobs_mode", "use_fp64_gumbel", "disable_cascade_attn",
        "skip_tokenizer_init", "served_model_name", "config_format", "hf_token",
        "model_class_overrides", "generation_config", "override_generation_config",
        "enable_sleep_mode", "sleep_mode_backend", "enable_cumem_allocator",
        "model_impl", "logits_processors", "io_processor_plugin",
        "renderer_num_workers", "pooler_config", "multimodal_config",
        "is_submodel_config", "word_embeddings_untied_by_checkpoint",
        "enable_trace_replay", "sleep_preserve_parameter_names",
        "sleep_mode_offload_cudagraph", "enable_nccl_comm_suspend")),
    "CacheConfig": (_RUNTIME, (
        "user_specified_block_size", "user_specified_mamba_block_size",
        "gpu_memory_utilization", "is_attention_free", "num_gpu_blocks_override",
        "mamba_page_size_padded", "skip_page_size_padded", "mamba_ssm_cache_dtype",
        "replayssm_buffer_len", "use_replayssm", "num_gpu_blocks",
        "num_cpu_blocks", "kv_cache_size_tokens", "kv_cache_max_concurrency",
        "kv_cache_memory_bytes", "kv_offloading_size", "kv_offloading_backend",
        "calculate_kv_scales", "cpu_offload_gb", "swap_space",
        "prefix_cache_retention_interval", "simple_cpu_offload_num_blocks")),
    "ParallelConfig": (_RUNTIME, (
        "data_parallel_size", "data_parallel_size_local", "data_parallel_rank_local",
        "data_parallel_master_ip", "data_parallel_rpc_port",
        "data_parallel_master_port", "data_parallel_backend",
        "data_parallel_external_lb", "data_parallel_hybrid_lb", "is_moe_model",
        "enable_expert_parallel", "enable_ep_weight_filter", "enable_eplb",
        "eplb_config", "expert_placement_strategy", "all2all_backend",
        "max_parallel_loading_workers", "disable_custom_all_reduce",
        "enable_elastic_ep", "enable_dbo", "ubatch_size",
        "dbo_decode_token_threshold", "dbo_prefill_token_threshold",
        "disable_nccl_for_dp_synchronization", "ray_workers_use_nsight",
        "ray_runtime_env", "placement_group", "distributed_executor_backend",
        "worker_cls", "sd_worker_cls", "worker_extension_cls", "master_addr",
        "master_port", "node_rank", "nnodes", "numa_bind", "numa_bind_nodes",
        "numa_bind_cpus", "assigned_physical_gpu_ids", "distributed_timeout_seconds",
        "cpu_distributed_timeout_seconds", "dcp_comm_backend",
        "data_parallel_index", "enable_fault_tolerance", "fault_tolerance_config",
        "dp_sync_interval", "enable_batch_sharded_sampling",
        "enable_shm_tensor_arena", "elastic_ep_max_dp_size")),
    "KVTransferConfig": (_FRONT, ("kv_buffer_size", "kv_ip", "kv_port")),
}


# ---------------------------------------------------------------- run record
def _n(x: Any) -> int:
    try:
        return len(x or ())
    except TypeError:
        return 0


def _first_int(ret: Any) -> int:
    n = ret[0] if isinstance(ret, tuple) else ret
    try:
        return int(n or 0)
    except (TypeError, ValueError):
        return 0


def _has_work(so: Any) -> bool:
    return bool(getattr(so, "total_num_scheduled_tokens", 0))


# method -> predicate(args, ret) deciding "called with a meaningful input"
MEANINGFUL: dict[str, Callable[[tuple, Any], bool]] = {
    "get_num_new_matched_tokens": lambda a, r: _first_int(r) > 0,
    "update_state_after_alloc": lambda a, r: len(a) > 2 and int(a[2] or 0) > 0,
    "build_connector_meta": lambda a, r: bool(a) and _has_work(a[0]),
    "update_connector_output": lambda a, r: bool(a) and bool(
        _n(a[0].finished_sending) or _n(a[0].finished_recving)
        or getattr(a[0], "kv_connector_worker_meta", None) is not None
        or _n(getattr(a[0], "invalid_block_ids", ()))),
    "request_finished": lambda a, r: len(a) > 1 and _n(a[1]) > 0,
    "request_finished_all_groups": lambda a, r: len(a) > 1 and any(
        _n(g) for g in a[1]),
    "take_events": lambda a, r: _n(r) > 0,
    "get_kv_connector_stats": lambda a, r: r is not None and not _empty(r),
    "get_kv_connector_kv_cache_events": lambda a, r: r is not None,
    "get_finished": lambda a, r: bool(a and _n(a[0])) or bool(
        isinstance(r, tuple) and any(_n(x) for x in r)),
    "build_connector_worker_meta": lambda a, r: r is not None,
    "save_kv_layer": lambda a, r: True,
    "reset_cache": lambda a, r: r is not False,
    "get_transfer_results": lambda a, r: bool(a and _n(a[0])) or any(
        _n(getattr(r, f, ())) for f in ("finished_sending", "finished_recving",
                                        "failed_recving")),
    "get_external_cache_hit_sources": lambda a, r: len(a) > 1 and int(
        a[1] or 0) > 0,
}


def _empty(stats: Any) -> bool:
    try:
        return bool(stats.is_empty())
    except Exception:  # noqa: BLE001 - a broken stats object counts as empty
        return True


@dataclass
class CoverageLog:
    """What one rig exercised, with a meaningful input.

    Attributes:
        hits: entry key -> short notes of the inputs seen (at most a few).
        connector_cls: ``module.Class`` of the connector.
        overrides: base-class API entries the connector class overrides.
        stats: every ``get_kv_connector_stats`` answer, ``(side, step, obj)``.
        events: every ``take_events`` / ``get_kv_connector_kv_cache_events``
            answer, ``(side, step, list_of_events)``.
        step: the engine step now running (set by the driver).
        loading: whether a request with an external hit is pending this step.
        preempted: whether this step's scheduler output preempted a request.
        calls: connector calls running now, outermost first, ``(side,
            Class.method, requests)`` (named by the driver's watchdog).
        hma: a ``SupportsHMA`` connector (vLLM then calls
            ``request_finished_all_groups``, never ``request_finished``).

    """

    hits: dict[str, list[str]] = field(default_factory=dict)
    connector_cls: str = ""
    overrides: set[str] = field(default_factory=set)
    stats: list[tuple[str, int, Any]] = field(default_factory=list)
    events: list[tuple[str, int, list[Any]]] = field(default_factory=list)
    step: int = 0
    loading: bool = False
    preempted: bool = False
    hma: bool = False
    calls: list[tuple[str, str, str]] = field(default_factory=list)

    def hit(self, key: str, note: str = "") -> None:
        """Record ``key`` as exercised (``note``: what input, kept for 3 calls)."""
        notes = self.hits.setdefault(key, [])
        if note and len(notes) < 3 and note not in notes:
            notes.append(note)

    def as_property(self) -> dict[str, Any]:
        """The JSON form given to the report (``tvc_coverage``)."""
        return {"connector": self.connector_cls, "hma": self.hma,
                "overrides": sorted(self.overrides),
                "hits": {k: v for k, v in sorted(self.hits.items())}}

    # --------------------------------------------------------------- wrapping
    def attach(self, connector: Any, side: str) -> None:
        """Wrap ``connector``'s API methods (on the instance) so each call is recorded.

        A wrapper with an ``inner`` connector (the fault injector) is seen through.
        A call records ``api:<Owner>.<method>`` when :data:`MEANINGFUL` (default: any
        call) accepts it; ``take_events`` answers are materialised into a list, and
        stats and event answers kept on :attr:`stats` / :attr:`events`. ``side`` is
        ``scheduler`` or ``worker``.
        """
        if connector is None or getattr(connector, "_tvc_coverage", None) is self:
            return
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorBase_V1,
            supports_hma,
        )

        inner = getattr(connector, "inner", None)
        if isinstance(inner, KVConnectorBase_V1):
            # the suite's own wrapper (tvc.contract.faults.FaultInjectingConnector):
            # record the connector under test, not the wrapper
            self.attach(inner, side)
            return
        api = api_members()
        cls = type(connector)
        self.connector_cls = f"{cls.__module__}.{cls.__qualname__}"
        self.overrides |= overridden(cls, api)
        self.hma = self.hma or bool(supports_hma(cls))
        for key, m in api.items():
            if m.owner not in ("KVConnectorBase_V1", "SupportsHMA"):
                continue
            raw = inspect.getattr_static(cls, m.name, None)
            if isinstance(raw, property) or isinstance(m.obj, property):
                continue
            if isinstance(raw, (classmethod, staticmethod)):
                continue
            orig = getattr(connector, m.name, None)
            if not callable(orig):
                continue
            setattr(connector, m.name, self._wrap(key, m.name, orig, side))
        connector._tvc_coverage = self

    def _wrap(self, key: str, name: str, orig: Callable, side: str) -> Callable:
        judge = MEANINGFUL.get(name)
        log = self

        bound_to = getattr(orig, "__self__", None)
        owner = type(bound_to).__name__ if bound_to is not None else "connector"

        def recorded(*args: Any, **kwargs: Any) -> Any:
            log.calls.append((side, f"{owner}.{name}", _requests_of(args)))
            try:
                ret = orig(*args, **kwargs)
            finally:
                log.calls.pop()
            if name == "take_events":
                ret = list(ret or ())
                log.events.append((side, log.step, ret))
            elif name == "get_kv_connector_kv_cache_events":
                log.events.append((side, log.step, _all_events(ret)))
            elif name == "get_kv_connector_stats":
                from tvc.contract.api_checks import assert_stats_type

                assert_stats_type(ret, side, log.step)
                log.stats.append((side, log.step, _snapshot(ret)))
            if name == "handle_preemptions":
                ok = log.preempted
            elif name in ("start_load_kv", "wait_for_layer_load",
                        "get_block_ids_with_load_errors"):
                ok = log.loading or bool(name == "get_block_ids_with_load_errors"
                                         and _n(ret))
            elif judge is not None:
                try:
                    ok = bool(judge(args, ret))
                except Exception:  # noqa: BLE001 - odd input: not meaningful
                    ok = False
            else:
                ok = True
            if ok:
                log.hit(key, f"{side} step {log.step}")
            return ret

        recorded.__wrapped__ = orig  # type: ignore[attr-defined]
        return recorded

    def running_call(self) -> str:
        """The innermost connector call running now, in words ('' if none)."""
        if not self.calls:
            return ""
        side, method, reqs = self.calls[-1]
        return f"{method} ({side} side{', ' + reqs if reqs else ''})"

    def note_construction(self, scheduler: Any) -> None:
        """Record the connector members vLLM's ``Scheduler.__init__`` uses.

        Every ``self.connector.<member>`` in the installed scheduler's ``__init__``
        source (e.g. ``bind_gpu_block_pool``) ran when the rig built it.
        """
        import re

        if getattr(scheduler, "connector", None) is None:
            return
        try:
            src = inspect.getsource(type(scheduler).__init__)
        except (OSError, TypeError):
            return
        api = api_members()
        for name in sorted(set(re.findall(r"self\.connector\.(\w+)", src))):
            key = f"api:KVConnectorBase_V1.{name}"
            if key in api:
                self.hit(key, "Scheduler.__init__")

    def note_request(self, request: Any) -> None:
        """Record the KV-relevant fields a ``vllm.v1.request.Request`` carries."""
        self.hit("request:Request.prompt_token_ids",
                 f"{len(request.prompt_token_ids or ())} tokens")
        if getattr(request, "cache_salt", None) is not None:
            self.hit("request:Request.cache_salt", "salted")
        if getattr(request, "lora_request", None) is not None:
            self.hit("request:Request.lora_request",
                     getattr(request.lora_request, "lora_name", "lora"))
        if getattr(request, "prompt_embeds", None) is not None:
            self.hit("request:Request.prompt_embeds", "embeds")
        if getattr(request, "mm_features", None):
            self.hit("request:Request.mm_features", "mm")
        if getattr(request, "pooling_params", None) is not None:
            self.hit("request:Request.pooling_params", "pooling")
        sp = getattr(request, "sampling_params", None)
        if sp is not None and sp.prompt_logprobs is not None:
            self.hit("request:SamplingParams.prompt_logprobs",
                     f"prompt_logprobs={sp.prompt_logprobs}")
        if getattr(request, "skip_reading_prefix_cache", False):
            self.hit("request:SamplingParams.skip_reading_prefix_cache", "True")
        if getattr(request, "kv_transfer_params", None):
            self.hit("request:SamplingParams.extra_args", "kv_transfer_params")

    def note_config(self, vllm_config: Any) -> None:
        """Record the engine settings a rig was built with (values as notes)."""
        mc, cc = vllm_config.model_config, vllm_config.cache_config
        pc, kt = vllm_config.parallel_config, vllm_config.kv_transfer_config
        self.hit("config:ModelConfig.dtype", str(mc.dtype).removeprefix("torch."))
        self.hit("config:ModelConfig.max_model_len", str(mc.max_model_len))
        self.hit("config:CacheConfig.block_size", str(cc.block_size))
        self.hit("config:CacheConfig.enable_prefix_caching",
                 str(cc.enable_prefix_caching))
        if cc.cache_dtype != "auto":
            self.hit("config:CacheConfig.cache_dtype", str(cc.cache_dtype))
        algo = getattr(cc, "prefix_caching_hash_algo", "sha256")
        if algo != "sha256":
            self.hit("config:CacheConfig.prefix_caching_hash_algo", str(algo))
        if pc.tensor_parallel_size > 1:
            self.hit("config:ParallelConfig.tensor_parallel_size",
                     str(pc.tensor_parallel_size))
        if pc.pipeline_parallel_size > 1:
            self.hit("config:ParallelConfig.pipeline_parallel_size",
                     str(pc.pipeline_parallel_size))
        if pc.world_size > 1:
            self.hit("config:ParallelConfig.world_size", str(pc.world_size))
        if kt is not None:
            self.hit("config:KVTransferConfig.kv_role", str(kt.kv_role))
            self.hit("config:KVTransferConfig.kv_connector", str(kt.kv_connector))
            policy = getattr(kt, "kv_load_failure_policy", None)
            if policy is not None:
                self.hit("config:KVTransferConfig.kv_load_failure_policy",
                         str(policy))
            if kt.kv_connector_extra_config:
                self.hit("config:KVTransferConfig.kv_connector_extra_config",
                         ",".join(sorted(kt.kv_connector_extra_config))[:60])
            if kt.kv_connector_module_path:
                self.hit("config:KVTransferConfig.kv_connector_module_path",
                         kt.kv_connector_module_path)

    def note_layers(self, kv_cache_config: Any) -> None:
        """Record the layer kinds (KV cache specs) a rig registered."""
        for group in getattr(kv_cache_config, "kv_cache_groups", ()):
            self.hit(f"layer:{type(group.kv_cache_spec).__name__}",
                     f"{len(group.layer_names)} layers")


def merge_logs(logs: Iterable[CoverageLog]) -> dict[str, Any]:
    """One ``tvc_coverage`` property for several rigs' logs (union of hits)."""
    out: dict[str, Any] = {"connector": "", "hma": False, "overrides": [],
                           "hits": {}}
    overrides: set[str] = set()
    for log in logs:
        prop = log.as_property()
        out["connector"] = out["connector"] or prop["connector"]
        out["hma"] = out["hma"] or prop["hma"]
        overrides |= set(prop["overrides"])
        for k, notes in prop["hits"].items():
            have = out["hits"].setdefault(k, [])
            have.extend(n for n in notes if n not in have and len(have) < 3)
    out["overrides"] = sorted(overrides)
    return out


def _snapshot(obj: Any) -> Any:
    """A pickled copy of a stats answer (vLLM aggregates into it), else the object."""
    import pickle

    if obj is None:
        return None
    try:
        return pickle.loads(pickle.dumps(obj))
    except Exception:  # noqa: BLE001 - reported by the check
        return obj


def _all_events(ret: Any) -> list[Any]:
    if ret is None:
        return []
    try:
        return list(ret.get_all_events())
    except Exception:  # noqa: BLE001 - the events check reports the type
        return [ret]


# -------------------------------------------------------------------- table
def api_members() -> dict[str, Member]:
    """The ``api`` part of :func:`inventory`, by key (cached per process)."""
    global _API_CACHE
    if _API_CACHE is None:
        _API_CACHE = {m.key: m for m in inventory(o for o in OWNERS
                                                  if o.kind == "api")}
    return _API_CACHE


_API_CACHE: dict[str, Member] | None = None


def overridden(cls: type, api: Mapping[str, Member] | None = None) -> set[str]:
    """API entries ``cls`` defines itself (not inherited from vLLM's base).

    Returns keys of ``KVConnectorBase_V1`` / ``SupportsHMA`` members whose
    attribute differs from the base's (``api``: :func:`api_members` if None).
    """
    api = api_members() if api is None else api
    out: set[str] = set()
    for key, m in api.items():
        if m.owner not in ("KVConnectorBase_V1", "SupportsHMA"):
            continue
        mine = inspect.getattr_static(cls, m.name, None)
        if mine is None:
            continue
        if _func_of(mine) is not _func_of(m.obj):
            out.add(key)
    return out


def coverage_table(logs: Iterable[Mapping[str, Any]],
                   members: list[Member] | None = None) -> dict[str, Any]:
    """The coverage table of a run.

    Args:
        logs: every test's ``tvc_coverage`` property
            (:meth:`CoverageLog.as_property`), optionally with the plugin's
            ``test`` and ``outcome``.
        members: :func:`inventory` (from the installed vLLM if None).

    Returns:
        ``{"rows": [...], "reviewed_not_kv": {owner: [count, reason]},
        "connector": str, "missing_overridden": [key...], "new": [key...],
        "counts": {...}}``; each row has ``key``, ``kind``, ``owner``, ``name``,
        ``source``, ``status`` (``exercised``, ``not exercised`` or :data:`NEW`),
        ``overridden`` (API rows: bool), ``reason``, ``expectation``, ``tests``,
        ``inputs`` (notes), ``failed_in`` (request rows: tests that sent the field
        and failed or xfailed).

    """
    members = inventory() if members is None else members
    hits: dict[str, list[str]] = {}
    overrides: set[str] = set()
    connectors: set[str] = set()
    hma = False
    failed_in: dict[str, set[str]] = {}
    for log in logs:
        if not isinstance(log, Mapping):
            continue
        if log.get("outcome") in ("failed", "error", "xfailed"):
            name = str(log.get("test", "?")).rsplit("::", 1)[-1]
            for k in log.get("hits") or {}:
                failed_in.setdefault(k, set()).add(name)
        for k, v in (log.get("hits") or {}).items():
            hits.setdefault(k, [])
            for note in v:
                if note not in hits[k] and len(hits[k]) < 4:
                    hits[k].append(note)
        overrides |= set(log.get("overrides") or ())
        hma = hma or bool(log.get("hma"))
        if log.get("connector"):
            connectors.add(str(log["connector"]))
    rows: list[dict[str, Any]] = []
    reviewed: dict[str, list[Any]] = {}
    for m in members:
        cur = CURATED.get(m.key)
        if cur is None and m.kind != "api" and m.kind != "layer":
            why, names = REVIEWED_NOT_KV.get(m.owner, ("", ()))
            if m.name in names:
                entry = reviewed.setdefault(m.owner, [0, why])
                entry[0] += 1
                continue
        needs = (cur.needs or (m.key,)) if cur else (m.key,)
        done = all(k in hits for k in needs)
        if m.key in VARIED and len(hits.get(m.key, ())) < 2:
            done = False  # one value only: the setting was never changed
        status = NEW if cur is None else ("exercised" if done else "not exercised")
        if hma and m.key in HMA_NOT_CALLED and not done:
            status = NOT_CALLED_HMA
        rows.append({
            "key": m.key, "kind": m.kind, "owner": m.owner, "name": m.name,
            "source": m.source, "status": status,
            "overridden": (m.key in overrides) if m.kind == "api" else None,
            "reason": cur.reason if cur else "",
            "expectation": cur.expectation if cur else "",
            "tests": cur.tests if cur else "",
            "inputs": [n for k in needs for n in hits.get(k, ())][:4],
            # request fields: tests that sent it and did not pass (methods and
            # settings are driven by nearly every test, so not listed)
            "failed_in": sorted({t for k in needs for t in failed_in.get(k, ())})
            if m.kind == "request" else [],
        })
    missing = [r["key"] for r in rows
               if r["overridden"] and r["status"] in ("not exercised", NEW)]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    return {"connector": ", ".join(sorted(connectors)), "rows": rows,
            "reviewed_not_kv": reviewed, "missing_overridden": missing,
            "new": [r["key"] for r in rows if r["status"] == NEW],
            "counts": counts}


def table_markdown(cov: Mapping[str, Any]) -> list[str]:
    """Markdown lines of the coverage table (for the summary page and reports)."""
    lines = [f"Connector: {cov.get('connector') or '(none driven)'}; "
             + ", ".join(f"{k}: {v}" for k, v in sorted(
                 (cov.get("counts") or {}).items())), ""]
    if cov.get("missing_overridden"):
        lines += ["**Overridden by the connector but never exercised:** "
                  + ", ".join(f"`{k}`" for k in cov["missing_overridden"]), ""]
    if cov.get("new"):
        lines += ["**New in this vLLM, not yet covered:** "
                  + ", ".join(f"`{k}`" for k in cov["new"]), ""]
    lines += ["| entry | source | overrides | status | expectation | exercised by |",
              "|---|---|---|---|---|---|"]
    for r in cov.get("rows", ()):
        ov = "" if r["overridden"] is None else ("yes" if r["overridden"] else "")
        inputs = "; ".join(r["inputs"])
        status = r["status"] + (f" ({inputs})" if inputs else "")
        if r.get("failed_in"):
            status += " — did not pass in " + ", ".join(r["failed_in"][:3])
        lines.append(f"| `{r['key']}` | {r['source']} | {ov} | {status} | "
                     f"{r['expectation']} | {r['tests']} |")
    rev = cov.get("reviewed_not_kv") or {}
    if rev:
        lines += ["", "Reviewed, not KV-relevant: " + "; ".join(
            f"{owner} {n} fields ({why})" for owner, (n, why) in sorted(rev.items()))]
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m tvc.contract.coverage``: print the inventory of this vLLM."""
    cov = coverage_table([])
    print("\n".join(table_markdown(cov)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())


def _requests_of(args: tuple[Any, ...]) -> str:
    """The request(s) a connector call is about, from its arguments ('' if none)."""
    if not args:
        return ""
    a = args[0]
    rid = getattr(a, "request_id", None)
    if isinstance(rid, str):
        return f"request {rid}"
    sched = getattr(a, "num_scheduled_tokens", None)
    if isinstance(sched, dict):
        ids = sorted(sched)
        return f"scheduling {', '.join(ids[:6])}" if ids else "nothing scheduled"
    if isinstance(a, set | frozenset) and all(isinstance(x, str) for x in a):
        return f"finished {', '.join(sorted(a)[:6])}" if a else ""
    return ""

