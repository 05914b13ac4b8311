"""Findings: every defect a run found, with how to reproduce it, in ``summary.json``.

Each failed, errored or known-failure (strict xfail) test becomes a finding with its
message and a rerun command (:func:`findings`); a defect in :data:`CATALOGUE` adds its
title, a minimal reproduction and its upstream source, one finding for all its tests.
``tvc certify`` reads known failures from here (they leave pytest's exit status 0).
The Tutti entries are for the public connector (xPU-IO/Tutti
``integration/vllm-connector`` at 33a8fb8), found by the contract and e2e tiers
(CPU: scheduler side through vLLM 0.28's scheduler; H200: worker and server).
"""

from __future__ import annotations

import itertools
import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CATALOGUE", "KnownDefect", "causes", "cut", "findings", "normalise_cause"]


@dataclass(frozen=True)
class KnownDefect:
    """A defect the suite knows by its symptom.

    Attributes:
        key: short id, e.g. ``tutti-cache-salt``.
        title: one sentence.
        nodeid: regex a test's node id must contain (``""`` = any test).
        message: regex the test's message must contain.
        reproduction: the smallest input that shows it, in the field's terms.
        source: upstream file and function.
        connector: the ``kv_connector`` class the defect belongs to: another
            connector's failure in the same test is not this defect.
        link: the upstream issue or pull request (``""``: none filed).
        vllm: PEP 440 specifier of the vLLM versions it applies to (``""``: all).
        package: PEP 508 requirement of the connector package versions it
            applies to, e.g. ``lmcache>=0.5.3,<=0.5.6`` (``""``: any).

    """

    key: str
    title: str
    nodeid: str
    message: str
    reproduction: str
    source: str
    connector: str = "TuttiConnectorV1"
    link: str = ""
    vllm: str = ""
    package: str = ""

    def matches(self, nodeid: str, message: str, connector: str = "",
                versions: Mapping[str, str] | None = None) -> bool:
        """Whether a test's node id and message show this defect.

        ``connector`` is the run's ``kv_connector`` (``""``: unknown); another
        class never matches. ``versions`` (distribution -> installed version,
        ``vllm`` included) rules out other versions; one not recorded does not.
        """
        if connector and connector != self.connector:
            return False
        if versions and not self.applies_to(versions):
            return False
        return bool(re.search(self.nodeid, nodeid) and re.search(self.message,
                                                                  message))

    def applies_to(self, versions: Mapping[str, str]) -> bool:
        """Whether the recorded versions are among those the defect applies to."""
        from packaging.requirements import Requirement
        from packaging.version import InvalidVersion, Version

        wants = []
        if self.vllm:
            wants.append(("vllm", self.vllm))
        if self.package:
            req = Requirement(self.package)
            wants.append((req.name, str(req.specifier)))
        for name, spec in wants:
            have = versions.get(name)
            if not have:
                continue
            try:
                ok = Requirement(f"x{spec}").specifier.contains(
                    Version(have).public, prereleases=True)
            except InvalidVersion:
                continue
            if not ok:
                return False
        return True


_T = "xPU-IO/Tutti 33a8fb8 integration/vllm-connector/"
_MC = "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/"
# the LMCacheMPConnector vLLM runs: vLLM's in-tree module hands over to LMCache's
# own class when it imports ("Using external LMCacheMPConnector from lmcache...")
_LMC_MP = "lmcache 0.5.3 lmcache/integration/vllm/lmcache_mp_connector.py "

CATALOGUE: tuple[KnownDefect, ...] = (
    KnownDefect(
        "tutti-load-start-ignores-local-hit",
        "a request with a GPU prefix-cache hit and an external hit loads the "
        "wrong chunks: update_state_after_alloc takes the load start from "
        "request.num_computed_tokens, which vLLM 0.26/0.28 set only after that "
        "call (still 0), so the chunks from token 0 land in the blocks after the "
        "local hit and the rest is never loaded; not the stand-in store (the same "
        "with store.options.order = \"sync\")",
        r"test_local_prefix_cache_hit_then_external_hit"
        r"|test_concurrent_requests_match_the_baseline",
        r"after vLLM's local hit of \d+ tokens is wrong"
        r"|shares its first \d+\+ tokens with another request"
        r"|the KV loaded while several requests load at once is wrong",
        "e2e on the H200 (vLLM 0.26.0, tutti-public-v1, --tvc-seed=1708249249): "
        "store a 600-token prompt, reset the GPU prefix cache, send its first "
        "19.5 blocks, then the prompt: 304 tokens from the GPU cache + 256 from "
        "the connector, output differs from the baseline at token 0 (every run); "
        "16 requests at once over 4 groups sharing 288 tokens: every request "
        "admitted after the first of its group differs (8 of 16 at "
        "max_chunks_per_wave 8, 10-11 of 16 at 2 and 1, under order sync too); "
        "one 600-token prompt alone loads right at every wave size. Tutti's hit "
        "line shows it: 'tokens=320 computed=288'",
        _T + "adapter/connector.py:581-594 update_state_after_alloc "
             "(load_start_token = request.num_computed_tokens); vLLM 0.26 "
             "scheduler.py L963 calls it, L1031 sets num_computed_tokens"),
    KnownDefect(
        "tutti-slot-mapping-race",
        "(suspected) intermittent wrong KV after a store of two chunks in one "
        "wave: the worker's slot mapping rewrites one pinned host buffer for every "
        "block pair while its non-blocking copy to the GPU may not have run, and "
        "caches the device result per block pair",
        r"test_hit_count_at_block_boundaries\[kB(\+1)?\]",
        r"some only: an intermittent fault",
        "seen once in e2e on the H200 (2026-12-02, kB: 64 tokens, 32 loaded, "
        "output wrong from token 0), then 0 of 90 fresh-prompt repeats "
        "(boundary_repeats, 2026-12-03); Tutti's PagedTransferHooks._slot_mapping "
        "alone on the H200 with the current stream busy >= 100 us before a "
        "two-chunk gather: 59 and 60 of 60 gathers put chunk 1's KV in chunk 0; "
        "with a blocking copy 0 of 300",
        _T + "adapter/worker.py:355-384 PagedTransferHooks._slot_mapping "
             "(host_ids.copy_ into self._slot_host, ids.copy_(non_blocking=True), "
             "_slot_cache)"),
    KnownDefect(
        "tutti-cache-salt",
        "chunk keys ignore cache_salt and the LoRA adapter: one tenant's prompt "
        "hits another tenant's KV",
        r"test_tenant_isolation|test_contract_holds_over_explored_event_sequences"
        r"\[tenants\]",
        r"tenant isolation|invariant 'no hit across tenants or adapters' broken",
        "store a 129-token prompt; replay the same tokens with "
        "cache_salt='tvc-tenant-b' (or a LoRA adapter): get_num_new_matched_tokens "
        "returns 128 instead of 0 (chunk_tokens = 32)",
        _T + "index/chunk_index.py (hash_keys folds token ids only), "
        "adapter/connector.py get_num_new_matched_tokens"),
    KnownDefect(
        "tutti-mm-hash",
        "chunk keys ignore multimodal items: the same placeholder tokens with "
        "another image hit the first image's KV",
        r"test_multimodal_item_hits_never_serve_another_image",
        r"ignore the item's hash",
        "store a 137-token prompt with image A's placeholder at [72, 104) "
        "(chunk_tokens = 32); the same tokens with image B (another "
        "mm_features identifier) match 128 tokens instead of at most 64 (CPU, "
        "vLLM 0.28.0)",
        _T + "index/chunk_index.py (hash_keys folds token ids only), "
        "adapter/connector.py get_num_new_matched_tokens"),
    KnownDefect(
        "tutti-skip-reading",
        "a request that must not read cached KV (prompt_logprobs, "
        "skip_reading_prefix_cache) is served from the store: vLLM 0.26/0.28's "
        "scheduler uses the connector's answer as is (0.33 zeroes it)",
        r"test_request_that_must_not_read_cached_kv_gets_a_miss",
        r"the connector ignores Request\.skip_reading_prefix_cache",
        "store a 73-token prompt; replay it with prompt_logprobs = 1 (vLLM sets "
        "skip_reading_prefix_cache): get_num_new_matched_tokens answers 64 "
        "(CPU, vLLM 0.28.0)",
        _T + "adapter/connector.py get_num_new_matched_tokens (never reads "
        "request.skip_reading_prefix_cache)"),
    KnownDefect(
        "tutti-local-hit-alignment",
        "a local prefix-cache hit breaks chunk alignment: the match starts at "
        "num_computed_tokens, off the chunk grid, and the worker loads only whole "
        "chunks inside it",
        r"test_local_prefix_cache_hit_then_external_hit", r"local \+ external",
        "one 16-token block in vLLM's local cache, a 105-token prompt whose chunks "
        "are all stored: the connector matches 64 tokens ([16, 80)) instead of 80 "
        "(96 in total, chunk_tokens = 32); its worker loads only [32, 64)",
        _T + "adapter/connector.py:550-579 get_num_new_matched_tokens"),
    KnownDefect(
        "tutti-num-chunks-type",
        "store.options.num_chunks of a wrong type raises a TypeError that names "
        "no key",
        r"test_bad_size_value_fails_at_creation_naming_it.*num_chunks.*wrong_type"
        r"|test_bad_size_value_fails_at_creation_naming_it.*wrong_type.*num_chunks",
        r"does not name the key",
        "kv_connector_extra_config.store.options.num_chunks = \"not-a-number\": "
        "TypeError: '<=' not supported between instances of 'str' and 'int'",
        _T + "stores/metadata.py MemoryMetadataStore.__init__ (num_chunks <= 0)"),
    KnownDefect(
        "tutti-rank4-per-layer",
        "the worker refuses vLLM's per-layer KV tensors (N, H, B, 2D): the V2 "
        "model runner (vLLM 0.26/0.28's default for dense models, 0.33's always) "
        "cannot serve the connector",
        r"", r"is vLLM's per-layer tensor \(N, H, B, 2D\)",
        "vLLM 0.26 or 0.28, a dense model, VLLM_USE_V2_MODEL_RUNNER unset: "
        "register_kv_caches raises AssertionError 'unsupported paged KV tensor "
        "rank 4'",
        _T + "transfer/tutti_kv_transfer (paged KV format detection), "
        "adapter/worker.py register_kv_caches"),
    KnownDefect(
        "tutti-kv-heads",
        "on the V1 runner the worker takes the cross-layer KV tensor only with "
        "exactly 2 KV heads per rank (it reads the KV-head axis as the K/V axis)",
        r"", r"is a layer slice \(N, B, H, 2D\) of the V1 runner's cross-layer"
             r"|K/V axis must be shape\[3\] == 2",
        "VLLM_USE_V2_MODEL_RUNNER=0 and a model with 8 KV heads: "
        "register_cross_layers_kv_cache refuses its (N, L, 16, 8, 2D) tensor",
        _T + "adapter/worker.py register_cross_layers_kv_cache"),
    KnownDefect(
        "tutti-memory-store-cuda",
        "Tutti's memory store cannot serve a CUDA worker: it refuses the CUDA "
        "staging buffer",
        r"", r"staging 环窗被 store 拒收",
        "store.type = \"memory\" on a CUDA worker: KVEngine.bind raises "
        "'staging 环窗被 store 拒收' (memoryview of a CUDA tensor)",
        _T + "stores/memory.py register_buffer, engine/core.py KVEngine.bind"),
    KnownDefect(
        "tutti-prompt-embeds-typeerror",
        "a prompt-embeddings request (no prompt token ids) makes Tutti's "
        "build_connector_meta raise TypeError out of the scheduler step",
        r"",
        r"raised TypeError: 'NoneType' object is not iterable inside "
        r"TuttiConnectorV1\.build_connector_meta",
        "CPU, vLLM 0.28.0, Tutti's current tree (scheduler side rebuilt from the "
        "stored files): the exploration's tenants family, engine step 1 of an "
        "embeddings-only request",
        "xPU-IO/Tutti 218f667 tutti/integration/vllm/connector.py L453 "
        "build_connector_meta (list(new_req.prompt_token_ids); vLLM 0.28.0 "
        "v1/core/sched/output.py L37 types it list[int] | None, None for "
        "prompt_embeds)"),
    KnownDefect(
        "lmcache-packed-kv-corruption",
        "LMCache's in-process connector loads wrong KV on vLLM 0.26's packed K/V "
        "layout (per-layer (N, H, B, 2D) tensors): the hit is served, silently "
        "corrupt",
        r"",
        r"does not hold the KV that was stored for it"
        r"|the KV the connector loaded (is wrong|differs|is not the KV)"
        r"|the connector loaded after vLLM's local hit of \d+ tokens is wrong"
        r"|the KV loaded while several requests load at once is wrong"
        r"|loaded KV of tokens \[\d+, \d+\) is not at the right slots"
        r"|the KV loaded for tokens \[\d+, \d+\) is wrong"
        r"|differ between baseline \(no connector\) and pass 2 \(load failed, "
        r"recomputed\)"
        # its writes land at the wrong offsets of the packed tensor, blocks
        # vLLM had free among them
        r"|block\(s\) written while vLLM had them free"
        # the exploration's words for the same writes (H200 gate, 2026-12-04:
        # 17 blocks of a finished request written by the replay's load)
        r"|invariant 'no write into a free block' broken",
        "H200, vLLM 0.26.0, lmcache 0.5.3: LMCache logs 'Retrieved 768 out of 768 "
        "required tokens', pass 2 differs from pass 1 at token 0 (top-2 gap "
        "0.1-0.7 nats), on the V2 and the V1 model runner (2026-12); vLLM PR "
        "#44455 introduced the packed layout; see also ai-dynamo/dynamo#14416",
        "LMCache lmcache/v1/gpu_connector (the paged KV format it assumes); vLLM "
        "0.26.0 FlashAttention per-layer KV (num_blocks, H, B, 2*D)",
        connector="LMCacheConnectorV1",
        link="https://github.com/LMCache/LMCache/issues/4463",
        vllm=">=0.26,<0.27", package="lmcache>=0.5.3"),
    KnownDefect(
        "lmcache-cache-salt",
        "LMCache's in-process connector keys its chunks by token ids only: a "
        "prompt under another cache_salt (tenant) hits the first tenant's KV",
        r"test_tenant_isolation|test_contract_holds_over_explored_event_sequences"
        r"\[tenants\]",
        r"tenant isolation|invariant 'no hit across tenants or adapters' broken",
        "H200, vLLM 0.26.0, lmcache 0.5.3 (2026-12-04): the same 521 tokens "
        "under another cache_salt matched 512 external tokens, expected 0",
        "lmcache 0.5.6 lmcache/integration/vllm/vllm_v1_adapter.py "
        "get_num_new_matched_tokens (L1360; the file never reads cache_salt; "
        "its multi-process adapter, lmcache_mp_metadata.py, does)",
        connector="LMCacheConnectorV1", vllm=">=0.26", package="lmcache>=0.5.3"),
    KnownDefect(
        "lmcache-skip-reading",
        "a request that must not read cached KV (prompt_logprobs, "
        "skip_reading_prefix_cache) is served from LMCache: vLLM 0.26/0.28's "
        "scheduler uses the connector's answer as is",
        r"test_request_that_must_not_read_cached_kv_gets_a_miss",
        r"the connector ignores Request\.skip_reading_prefix_cache",
        "H200, vLLM 0.26.0, lmcache 0.5.3 (2026-12-04): a stored 521-token "
        "prompt replayed with prompt_logprobs started with 512 tokens counted "
        "as computed",
        "lmcache 0.5.6 lmcache/integration/vllm/vllm_v1_adapter.py "
        "get_num_new_matched_tokens (L1360; skip_reading_prefix_cache is never "
        "read)",
        connector="LMCacheConnectorV1", vllm=">=0.26,<0.33", package="lmcache>=0.5.3"),
    KnownDefect(
        "lmcache-mp-skip-reading",
        "a request that must not read cached KV (prompt_logprobs, "
        "skip_reading_prefix_cache) is served from LMCache's server: vLLM "
        "0.26/0.28's scheduler uses the connector's answer as is",
        r"test_request_that_must_not_read_cached_kv_gets_a_miss",
        r"the connector ignores Request\.skip_reading_prefix_cache",
        "H100, vLLM 0.26.0, lmcache 0.5.3 (2026-12-05): a stored 521-token "
        "prompt replayed with prompt_logprobs started with 512 tokens counted "
        "as computed",
        _LMC_MP + "get_num_new_matched_tokens L1030-L1100 (never reads "
        "skip_reading_prefix_cache); vLLM 0.26.0 scheduler.py L764-L780 takes "
        "the answer as is (vLLM 0.33.0 guards it itself, scheduler.py L1143)",
        connector="LMCacheMPConnector", vllm=">=0.26,<0.33",
        package="lmcache>=0.5.3"),
    KnownDefect(
        "lmcache-mp-finished-after-free",
        "LMCache's MP connector names a request in finished_sending after vLLM "
        "freed it (aborted while its load ran, or failed under "
        "kv_load_failure_policy=fail): vLLM's scheduler asserts and the engine "
        "dies",
        r"test_abort_leaves_nothing_behind|test_reported_load_failure_affects"
        r"|test_contract_holds_over_explored_event_sequences",
        r"_update_from_kv_xfer_finished\): assert req_id in self\.requests",
        "H100, vLLM 0.26.0, lmcache 0.5.3 (2026-12-05): req-90 aborted while "
        "WAITING_FOR_REMOTE_KVS; vLLM freed it at its finished_recving, then "
        "get_finished named it in finished_sending (scheduler.py L2639); req-105, "
        "failed under policy fail, the same one step later (L2648)",
        _LMC_MP + "request_finished L1261 (returns True for every request, "
        "whether a store was sent or not); vllm_multi_process_adapter.py "
        "L1523-L1540, L1603 (finished stores minus finished retrieves only "
        "within one call, only when unhealthy)",
        connector="LMCacheMPConnector",
        link="https://github.com/LMCache/LMCache/issues/4938",
        package="lmcache>=0.5.3"),
    KnownDefect(
        "lmcache-mp-under-store",
        "after vLLM's local prefix-cache hit (or a preemption) LMCache's MP "
        "connector stores from token 0 as if nothing was cached: the chunks "
        "past the local hit are never stored, so a later lookup matches fewer "
        "chunks than the prompt filled",
        r"test_shared_prefixes_every_load_bit_identical"
        r"|test_block_hash_algorithm_keeps_hits_and_loads_exact"
        r"|test_chunked_prefill_preempted_and_resumed|test_preemption_and_resume",
        r"the connector matched \d+ \(local \+ matched = \d+\), the profile's "
        r"hit_rule expects",
        "H100, vLLM 0.26.0, lmcache 0.5.3 (2026-12-05): three 778-token prompts "
        "sharing 512 tokens stored in one step; B and C got a 512-token local "
        "hit, stored only [0, 256) again; their replays found 2 of 3 chunks "
        "('2/3 retained keys' in the server log), 512 where 768 were filled; a "
        "prefill preempted twice: 7 of 8 chunks",
        _LMC_MP + "get_num_new_matched_tokens returns before L1089 records "
        "num_vllm_hit_tokens when the lookup answers 0 (L1077) or the request "
        "was preempted (L1064); GetStoreMetadata L394 then counts only the "
        "scheduled tokens (related, not settled the same: LMCache/LMCache#3640)",
        connector="LMCacheMPConnector", package="lmcache>=0.5.3"),
    KnownDefect(
        "lmcache-mp-dtype-key",
        "LMCache's MP server keys a chunk by model name, world size, worker, "
        "tokens and cache_salt: a model served with another dtype or KV cache "
        "dtype reads the first one's KV",
        r"test_another_model_on_one_store_gets_a_miss\[[^\]]*dtype\]",
        r"its keys ignore the (model's dtype|KV cache dtype)",
        "H100, vLLM 0.26.0, lmcache 0.5.3 (2026-12-05): the same checkpoint "
        "served with --dtype bfloat16 'Retrieved 512 tokens' stored in float16; "
        "with --kv-cache-dtype fp8 the server raised 'Size mismatch: memory_obj "
        "nbytes=262144, gpu_buffer nbytes=131072' and the client never reported "
        "the blocks as failed",
        "lmcache 0.5.3 lmcache/v1/multiprocess/custom_types.py L41-L61 (the key "
        "has no dtype); vllm_multi_process_adapter.py L1629-L1635 (a failed "
        "retrieve only logged)",
        connector="LMCacheMPConnector", package="lmcache>=0.5.3"),
    KnownDefect(
        "lmcache-mp-lora-key",
        "LMCache's MP connector keys by token ids and cache_salt only: the same "
        "prompt under another LoRA adapter hits the first adapter's KV",
        r"test_tenant_isolation|test_contract_holds_over_explored_event_sequences"
        r"\[tenants\]",
        r"under another LoRA adapter|the connector ignores LoRA adapter"
        r"|invariant 'no hit across tenants or adapters' broken",
        "H100, vLLM 0.26.0, lmcache 0.5.3 (2026-12-05): the same 521 tokens "
        "under another LoRA adapter matched 512 external tokens, expected 0",
        "lmcache 0.5.3 lmcache/v1/multiprocess/custom_types.py L41-L61 (no "
        "adapter in the key); open fix vllm-project/vllm#45549, LoRA-aware "
        "keying LMCache/LMCache#2961",
        connector="LMCacheMPConnector",
        link="https://github.com/vllm-project/vllm/issues/44250",
        package="lmcache>=0.5.3"),
    KnownDefect(
        "mooncake-store-event-parent-none",
        "MooncakeStoreConnector publishes the first block it stores for a request "
        "with parent_block_hash None when the blocks before it were already in "
        "the store (extended prompt, decode block): the event chain breaks",
        r"test_kv_cache_events_name_only_stored_blocks"
        r"|test_contract_holds_over_explored_event_sequences",
        r"names no parent for block",
        "CPU, vLLM 0.28.0, mooncake-transfer-engine-non-cuda 0.3.13.post1 "
        "(2026-12-06): store a 41-token prompt, then a 73-token prompt extending "
        "it; the BlockStored event of its first new block names no parent",
        _MC + "worker.py KVCacheStoreSendingThread._handle_request (parent from "
        "prev_key_per_group, empty at each batch: L949 in 0.28.0, L660 in "
        "0.26.0); fixed upstream by deriving it from the request's hash chain",
        connector="MooncakeStoreConnector",
        link="https://github.com/vllm-project/vllm/pull/52466", vllm="<0.33"),
    KnownDefect(
        "mooncake-store-skip-reading",
        "a request that must not read cached KV (prompt_logprobs, "
        "skip_reading_prefix_cache) is served from Mooncake's store: vLLM "
        "0.26/0.28's scheduler uses the connector's answer as is (0.33 zeroes it)",
        r"test_request_that_must_not_read_cached_kv_gets_a_miss",
        r"the connector ignores Request\.skip_reading_prefix_cache",
        "CPU, vLLM 0.28.0, mooncake-transfer-engine-non-cuda 0.3.13.post1 "
        "(2026-12-06): a stored prompt replayed with prompt_logprobs started "
        "with 32 tokens counted as computed",
        _MC + "scheduler.py MooncakeStoreScheduler.get_num_new_matched_tokens "
        "(L91 in 0.28.0, L73 in 0.26.0; skip_reading_prefix_cache is never read)",
        connector="MooncakeStoreConnector", vllm="<0.33"),
    KnownDefect(
        "mooncake-store-prompt-embeds-assert",
        "a prompt-embeddings request (prompt_embeds, no prompt token ids) fails "
        "MooncakeStoreConnector's own assert in build_connector_meta: the engine "
        "step raises",
        r"",
        r"MooncakeStoreConnector\.build_connector_meta.*prompt_token_ids is not None",
        "CPU, vLLM 0.28.0, mooncake-transfer-engine-non-cuda 0.3.13.post1 "
        "(2026-12-06): the exploration's tenants family, the first schedule of an "
        "embeddings-only request (tenant 'embeds:...')",
        _MC + "scheduler.py _new_req_prefill_tokens (assert request."
        "prompt_token_ids is not None: L47 in 0.28.0, L43 in 0.26.0, L58 in "
        "0.33.0), called from MooncakeStoreScheduler.build_connector_meta",
        connector="MooncakeStoreConnector"),
    KnownDefect(
        "lmcache-prompt-embeds-typeerror",
        "a prompt-embeddings request (prompt_embeds, no prompt token ids) makes "
        "LMCache's build_connector_meta raise TypeError out of the scheduler step",
        r"",
        r"TypeError.*LMCache\w*\.build_connector_meta"
        r"|LMCache\w*\.build_connector_meta.*TypeError",
        "CPU, vLLM 0.28.0 and 0.33.0, lmcache 0.5.6 (reproduced 2026-12-04): the "
        "exploration's tenants family, engine step 1 of an embeddings-only "
        "request: replay_explorer('lmcache', family='tenants', policy='recompute')"
        ".warm([(1, 1), (1, 1), (1, 1)], tenant='embeds:tvc-table-b') raises "
        "TypeError: object of type 'NoneType' has no len()",
        "lmcache 0.5.6 lmcache/integration/vllm/vllm_v1_adapter.py L190 "
        "RequestTracker.from_new_request (prompt_len=len(new_request."
        "prompt_token_ids), None for prompt_embeds), called from "
        "LMCacheConnectorV1Impl.build_connector_meta L1665; vLLM 0.28.0 "
        "lmcache_connector.py L301",
        connector="LMCacheConnectorV1",
        link="",  # a new finding: not filed upstream yet
        vllm=">=0.28", package="lmcache>=0.5.6"),
)


def findings(tests: Iterable[Mapping[str, Any]], profile: Mapping[str, Any],
             seed: Any = None, pythonpath: str = "",
             require: Iterable[str] = (),
             versions: Mapping[str, str] | None = None,
             depth: Mapping[str, Any] | None = None,
             pytest: str = "pytest", root: str = "") -> list[dict[str, Any]]:
    """The findings of a run, from its ``summary.json`` test entries.

    Args:
        tests: entries with ``nodeid``, ``outcome``, ``message``.
        profile: the summary's ``profile`` section (``name``, ``source``).
        seed: the run's seed (``--tvc-seed``), kept in the rerun command.
        pythonpath: the run's ``PYTHONPATH``, put in front of the rerun command.
        require: the run's ``--tvc-require`` levels, kept (a strict red reruns
            strict).
        depth: ``run.depth`` of ``summary.json``; a non-default depth or override
            stays in the rerun command.
        versions: distribution -> version of the run; a catalogued defect of other
            versions is not matched (:meth:`KnownDefect.applies_to`).
        pytest: the pytest the rerun command calls (:func:`pytest_command`).
        root: the run's rootdir when not where it started (an installed suite): the
            rerun keeps it so the node id stays ``suites/<tier>/...``.

    Returns:
        one dict per finding: ``key`` (catalogue key, or ``test``), ``title``,
        ``tests`` (node ids), ``outcome`` (``failed``/``error``/``xfailed``),
        ``message`` (the first test's), ``rerun`` (a pytest command line),
        ``reproduction`` and ``source`` (catalogued defects; ``""`` otherwise).

    """
    prof = str(profile.get("source") or profile.get("name") or "")
    levels = ",".join(sorted(require))
    opts, env = _depth_options(depth)
    out: dict[str, dict[str, Any]] = {}
    for t in tests:
        if t.get("outcome") not in ("failed", "error", "xfailed"):
            continue
        nodeid, msg = str(t.get("nodeid", "")), str(t.get("message", ""))
        known = next((d for d in CATALOGUE
                      if d.matches(nodeid, msg, str(profile.get("connector") or ""),
                                   versions)), None)
        key = known.key if known else f"test:{nodeid}"
        rerun = ([pytest, f"{root.rstrip('/')}/{nodeid}", f"--rootdir={root}"]
                 if root else [pytest, nodeid])
        if prof:
            rerun.append(f"--tvc-profile={prof}")
        if seed is not None:
            rerun.append(f"--tvc-seed={seed}")
        if levels:
            rerun.append(f"--tvc-require={levels}")
        rerun += opts
        entry = out.setdefault(key, {
            "key": known.key if known else "test",
            "title": known.title if known else f"{nodeid} {t.get('outcome')}",
            "tests": [], "outcome": t.get("outcome"), "message": msg[:2000],
            # an assignment word must stay unquoted before "=" for the shell
            "rerun": env + (f"PYTHONPATH={shlex.quote(pythonpath)} " if pythonpath
                            else "") + shlex.join(rerun),
            "reproduction": known.reproduction if known else "",
            "source": known.source if known else "",
            "link": known.link if known else "",
            "applies_to": ", ".join(x for x in (
                f"vLLM {known.vllm}" if known and known.vllm else "",
                known.package if known else "") if x)})
        entry["tests"].append(nodeid)
    return list(out.values())


def cut(text: str, limit: int = 400) -> str:
    """``text`` on one line, at most ``limit`` characters (``…`` included).

    Cut at the last whitespace that fits; a single word longer than ``limit`` is cut
    inside it. A closing ``Fix: ...`` sentence past the cut is kept after the ``…``
    when it fits in half of ``limit``.
    """
    flat = " ".join(str(text).split())
    if len(flat) <= limit:
        return flat
    fix = flat.rfind("Fix: ")
    if fix > 0 and len(flat) - fix <= limit // 2:
        return cut(flat[:fix], limit - (len(flat) - fix) - 1) + " " + flat[fix:]
    head = flat[:max(limit - 1, 0)]
    space = head.rfind(" ")
    if space > 0 and flat[len(head)] != " ":
        head = head[:space]
    return head.rstrip(" ,;:") + "…"


# what varies between two runs of one cause: paths, addresses and ids, numbers
_MASKS = (
    (re.compile(r"(?:[A-Za-z]:)?(?:[\w.~-]*/)+[\w.@+-]+"), "<path>"),
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "<addr>"),
    (re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
                r"[0-9a-fA-F]{12}\b"), "<id>"),
    (re.compile(r"\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,}\b"),
     "<id>"),
    (re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"), "<n>"),
)


def _first_line(message: str) -> str:
    """The first non-empty line of a message, or ``(no message)``."""
    return next((ln.strip() for ln in str(message).splitlines() if ln.strip()),
                "(no message)")


def _after_first_line(message: str) -> str:
    """What follows the first non-empty line of a message (``""`` if nothing).

    pytest's re-statement of a failed assert's expression (and ``where`` lines) after
    its own message is left out.
    """
    lines = [ln for ln in str(message).splitlines() if ln.strip()]
    if lines and lines[0].startswith("AssertionError: ") and not lines[0].startswith(
            "AssertionError: assert "):
        lines = list(itertools.takewhile(lambda ln: not ln.startswith("assert "),
                                         lines))
    return "\n".join(lines[1:])


def normalise_cause(message: str) -> str:
    """The cause of a failure as a key that equal causes share.

    The first non-empty line with paths (``<path>``), addresses (``<addr>``), uuids and
    hex ids of 8+ digits (``<id>``) and numbers (``<n>``; not glued to a word, as in
    ``sha256``) masked: ``AssertionError: matched <n> tokens, expected <n>``;
    ``(no message)`` for an empty one.
    """
    line = _first_line(message)
    if line == "(no message)":
        return line
    for pattern, mask in _MASKS:
        line = pattern.sub(mask, line)
    return " ".join(line.split())


#: outcome -> the group it is shown in (what failed first, then known, skips)
OUTCOME_GROUP = {"failed": "failed", "error": "failed", "not_run": "not_run",
                 "xfailed": "xfailed", "skipped": "skipped"}


def causes(tests: Iterable[Mapping[str, Any]], found: Iterable[Mapping[str, Any]] = (),
           group: str = "failed", label: Any = None) -> list[dict[str, Any]]:
    """Tests of one outcome group, one entry per cause, the largest first.

    A catalogued defect is one cause by its key; any other test joins the tests with
    the same :func:`normalise_cause`.

    Args:
        tests: ``summary.json`` test entries (``nodeid``, ``outcome``, ``message``,
            ``tiers``).
        found: the run's findings (:func:`findings`), for the catalogue keys.
        group: a value of :data:`OUTCOME_GROUP` (``failed`` takes failed and error).
        label: ``test -> str`` naming a test (default: the last part of its node
            id); a fleet summary prefixes the host.

    Returns:
        dicts with ``key``, ``title`` (catalogued title or first message line,
        :func:`cut` to 400 characters), ``finding`` (catalogue key or ``""``),
        ``outcomes`` (outcome -> count), ``tiers``, ``tests`` (node ids), ``names``
        (labels), ``message`` (first test's), ``detail`` (the rest, :func:`cut` to
        600 characters); most tests first, then key.

    """
    name = label or (lambda t: str(t.get("nodeid", "")).split("::")[-1])
    by_test = {nid: f["key"] for f in found if f.get("key") not in (None, "test")
               for nid in f.get("tests") or ()}
    title = {f["key"]: f["title"] for f in found if f.get("key") not in (None, "test")}
    out: dict[str, dict[str, Any]] = {}
    for t in tests:
        outcome = str(t.get("outcome", ""))
        if OUTCOME_GROUP.get(outcome) != group:
            continue
        nodeid, msg = str(t.get("nodeid", "")), str(t.get("message") or "")
        finding = by_test.get(nodeid, "") if group in ("failed", "xfailed") else ""
        key = f"finding:{finding}" if finding else normalise_cause(msg)
        entry = out.setdefault(key, {
            "key": key, "finding": finding,
            "title": title[finding] if finding else (
                cut(_first_line(msg)) if msg.strip() or outcome != "not_run"
                else "the run stopped before these tests finished"),
            "outcomes": {}, "tiers": [], "tests": [], "names": [], "message": msg,
            "detail": cut(msg if finding else _after_first_line(msg), 600)})
        entry["outcomes"][outcome] = entry["outcomes"].get(outcome, 0) + 1
        for tier in t.get("tiers") or ["other"]:
            if tier not in entry["tiers"]:
                entry["tiers"].append(tier)
        entry["tests"].append(nodeid)
        entry["names"].append(str(name(t)))
    return sorted(out.values(), key=lambda e: (-len(e["tests"]), e["key"]))


def _depth_options(depth: Mapping[str, Any] | None) -> tuple[list[str], str]:
    """The rerun's depth options and environment words (``--tvc-depth`` ...)."""
    from tvc.config.depth import DEFAULT, DEPTHS

    if not depth or depth.get("name") not in DEPTHS:
        return [], ""
    own = DEPTHS[str(depth["name"])]
    opts = [] if own.name == DEFAULT else [f"--tvc-depth={own.name}"]
    if depth.get("explore_examples") not in (None, own.explore_examples):
        opts.append(f"--tvc-explore-examples={depth['explore_examples']}")
    vol = depth.get("scenario_volume")
    env = f"TVC_SCENARIO_VOLUME={vol} " if vol not in (None, own.scenario_volume) \
        else ""
    return opts, env


def pytest_command(executable: str, cwd: str) -> str:
    """The pytest a rerun command calls: the one beside the run's interpreter.

    A bare ``pytest`` is whatever is first on PATH (the README calls
    ``.venv/bin/pytest`` without activating it). Relative to ``cwd`` when inside it,
    else absolute; ``pytest`` when there is none.
    """
    script = Path(executable).with_name("pytest")
    if not script.is_file():
        return "pytest"
    try:
        return str(script.relative_to(Path(cwd)))
    except ValueError:
        return str(script)
