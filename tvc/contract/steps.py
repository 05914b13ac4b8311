"""The steps and checks the contract tier's scenario tests are written with.

The scenarios live in the test bodies (``suites/contract/test_scenarios.py``,
``test_connector_api.py``): numbered steps that drive vLLM's V1 scheduler through
an :class:`~tvc.contract.driver.EngineDriver`. This module holds what they share:
planning (prompt lengths in whole chunks of ``profile.granularity_tokens(B)``;
:class:`ScenarioError`, :class:`NotApplicable`), steps (:func:`store`,
:func:`replay_of`, :func:`cold`) and checks (:func:`check_hit`,
:func:`check_every_load`, :func:`finish`). See docs/contract.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tvc.contract.builders import DEFAULT_MAX_MODEL_LEN
from tvc.contract.driver import external_hit
from tvc.contract.invariants import (
    assert_block_aligned,
    assert_loaded_kv_bit_identical,
    assert_no_write_into_free_blocks,
    assert_scheduler_empty_and_no_leaked_blocks,
    assert_untouched_outside,
    snapshot_kv,
)
from tvc.contract.rig import Rig
from tvc.contract.worker import ConnectorWorker

MakeRig = Callable[..., Rig]
BLOCK_SIZE = 16  # B of every scenario rig (vLLM's default block size on CUDA)
#: steps a scenario waits for a request a connector deferred (a None answer)
DEFERRED_LOOKUP_STEPS = 4


class ScenarioError(Exception):
    """A scenario cannot be planned for this connector (message says why)."""


class NotApplicable(Exception):  # noqa: N818 - reads as a reason to skip
    """The scenario does not apply to this connector or box (message says why)."""


# ------------------------------------------------------------------ planning


def chunk_tokens(profile: Any, block_size: int) -> int:
    """Tokens (>= 1) the connector stores per unit (``connector.granularity``, or B)."""
    return int(profile.granularity_tokens(block_size))


def first_hit_len(profile: Any, block_size: int,
                  max_len: int = DEFAULT_MAX_MODEL_LEN) -> int | None:
    """The shortest prompt (tokens) for which the profile's hit rule expects a hit.

    None without a rule, or when no prompt up to ``max_len`` hits. A rule may expect
    nothing below a threshold; vLLM allows that
    (``KVConnectorBase_V1.get_num_new_matched_tokens`` answers what can be loaded;
    ``build_connector_meta`` / ``save_kv_layer`` leave what to save to the connector).
    """
    rule = hit_rule_of(profile)[0]
    if not rule:
        return None
    # the rule's variables: B, len and the connector's extra_config keys
    extra = json.dumps(profile["connector"]["extra_config"], sort_keys=True,
                       default=str)
    key = (rule, extra, block_size, max_len)
    if key not in _FIRST_HIT:
        _FIRST_HIT[key] = next((n for n in range(2, max_len + 1)
                                if rule_hit(profile, n, block_size)), None)
    return _FIRST_HIT[key]


_FIRST_HIT: dict[tuple[str, str, int, int], int | None] = {}


def rule_edge_lengths(profile: Any, block_size: int, max_len: int) -> list[int]:
    """Prompt lengths around where the hit rule starts to expect a hit.

    ``[n - 1, n, n + 1]`` within ``[1, max_len]`` for ``n`` = :func:`first_hit_len`
    (where an off-by-one threshold shows), or ``[]`` without a rule.
    """
    n = first_hit_len(profile, block_size, max_len)
    return [] if n is None else [m for m in (n - 1, n, n + 1) if 1 <= m <= max_len]


def prompt_len(profile: Any, block_size: int, chunks: int, tail: int) -> int:
    """Length of a prompt of ``chunks`` whole chunks plus ``tail`` tokens.

    Grown by whole chunks to the rule's first hit (:func:`at_least_first_hit`);
    ScenarioError when shorter than one chunk (nothing would be stored).
    """
    c = chunk_tokens(profile, block_size)
    n = chunks * c + tail
    if n < c or n < 2:
        raise ScenarioError(
            f"a {n}-token prompt is shorter than one chunk: this connector stores "
            f"whole chunks of {c} tokens (connector.granularity at B={block_size}), "
            "so it stores nothing for it. Use prompts of at least one chunk")
    return at_least_first_hit(profile, block_size, n)


def at_least_first_hit(profile: Any, block_size: int, n: int) -> int:
    """``n`` plus the whole chunks that bring it to the rule's first hit (tail kept)."""
    first = first_hit_len(profile, block_size)
    if first is None or n >= first:
        return n
    c = chunk_tokens(profile, block_size)
    return n + -(-(first - n) // c) * c


def round_trip_len(profile: Any, block_size: int) -> int:
    """A prompt for a one-prompt round trip: ``max(4 * B, 2 * chunk) + B // 2`` tokens.

    Raised to the rule's first hit where needed.
    """
    return at_least_first_hit(profile, block_size, max(
        4 * block_size, 2 * chunk_tokens(profile, block_size)) + block_size // 2)


def pool_blocks(num_tokens: int, block_size: int, requests: int = 2,
                minimum: int = 64) -> int:
    """KV blocks for ``requests`` prompts of ``num_tokens`` (+1 decode) at once.

    ``max(minimum, requests * (ceil((num_tokens + 1) / B) + 1) + 1)``: +1 per
    request for its decode block, +1 for vLLM's null block.
    """
    per = -(-(num_tokens + 1) // block_size) + 1
    return max(minimum, requests * per + 1)


def hit_rule_of(profile: Any) -> tuple[str, str]:
    """``(rule, source)`` that applies to the installed vLLM (``("", "")``: none)."""
    return profile.select_hit_rule()


def rule_hit(profile: Any, n: int, block_size: int) -> int | None:
    """Tokens the profile's hit rule expects for a stored n-token prompt.

    From an empty local cache, by :meth:`~tvc.config.profile.Profile.select_hit_rule`'s
    rule; None without a rule.
    """
    if not hit_rule_of(profile)[0]:
        return None
    return int(profile.expected_hit_tokens(n, block_size))


def require_hits(profile: Any, lengths: Iterable[int], block_size: int,
                 max_len: int) -> None:
    """A tier in which every expected hit is 0 is an error, never a pass.

    Raises ScenarioError ``vacuous: ...`` naming the chunk and the longest prompt.
    """
    lengths = sorted(set(lengths))
    hits = [rule_hit(profile, n, block_size) for n in lengths]
    if any(h is None for h in hits) or any(hits):
        return
    c = chunk_tokens(profile, block_size)
    raise ScenarioError(
        f"vacuous: this connector stores whole chunks of {c} tokens; the prompts "
        f"tried stop at {lengths[-1]} (max_model_len {max_len}), so its hit_rule "
        "expects 0 for every one and no scenario would load anything. Lower "
        "connector.granularity or raise the prompt lengths")


def scenario_lengths(profile: Any, block_size: int = BLOCK_SIZE) -> dict[str, int]:
    """The prompt length (tokens) each scenario uses: whole chunks plus a short tail.

    ScenarioError when a length is shorter than a chunk, or every hit is 0.
    """
    c = chunk_tokens(profile, block_size)
    tail = max(1, block_size // 2 + 1)
    out = {
        "single": prompt_len(profile, block_size, 2, tail),
        "long": prompt_len(profile, block_size, 4, tail),
    }
    if max(out.values()) > DEFAULT_MAX_MODEL_LEN - 128:
        raise ScenarioError(
            f"vacuous: this connector stores whole chunks of {c} tokens; the prompts "
            f"tried stop at {DEFAULT_MAX_MODEL_LEN - 128} (max_model_len "
            f"{DEFAULT_MAX_MODEL_LEN}), so no prompt of several chunks fits. Lower "
            "connector.granularity")
    require_hits(profile, out.values(), block_size, DEFAULT_MAX_MODEL_LEN)
    return out


# ------------------------------------------------------------------ checks
def real_worker(rig: Rig) -> ConnectorWorker | None:
    """The connector's real worker side, or None (stand-in / no worker)."""
    return rig.worker if isinstance(rig.worker, ConnectorWorker) else None


def check_hit(rig: Rig, request: Any, expected_total: int | None, what: str
              ) -> tuple[int, int]:
    """The connector's answer for ``request`` is aligned and equals the rule.

    ``local + matched`` must equal the rule for the prompt (the connector matches
    from ``num_computed_tokens`` on, to the same end as from an empty cache).
    Returns ``(local, matched)`` in tokens; AssertionError otherwise.
    """
    local, matched, is_async = external_hit(rig.driver, request)
    n = request.num_prompt_tokens
    assert_block_aligned(matched, rig.block_size, n, local, is_async)
    if expected_total is not None:
        want = max(expected_total, local)
        if local + matched != want:
            prof_rule = rig.vllm_config.kv_transfer_config
            raise AssertionError(
                f"{what}: {n}-token prompt, {local} tokens in vLLM's local prefix "
                f"cache: the connector matched {matched} (local + matched = "
                f"{local + matched}), the profile's hit_rule expects "
                f"{expected_total} in total, i.e. {want - local} beyond "
                f"num_computed_tokens={local} ({prof_rule.kv_connector})")
    return local, matched


def check_every_load(rig: Rig, requests: Sequence[Any], what: str) -> int:
    """Every request that matched external tokens loaded them bit-identically.

    With the real worker, each computed from at least ``min(local + matched,
    len - 1)`` (or from a block reported failed). Returns how many requests loaded
    (matched > 0); the AssertionError names the request.
    """
    w = real_worker(rig)
    n_loaded = 0
    for r in requests:
        local, matched, _ = external_hit(rig.driver, r)
        if matched <= 0:
            continue
        n_loaded += 1
        if w is None:
            continue
        rid = r.request_id
        start = w.loaded.get(rid)
        reported = w.reported_loads.get(rid)
        if reported is not None or getattr(r, "status", None) is not None and \
                "ERROR" in str(r.status):
            continue
        want = min(local + matched, r.num_prompt_tokens - 1)
        early = w.reported_before_compute.get(rid)
        if early is not None and start is not None and start >= min(want, early):
            continue  # recomputed from the first block its load reported failed
        assert start is not None and start >= want, (
            f"{what}: request {rid} matched {matched} external tokens "
            f"({local} local) but started computing at token {start}, expected "
            f"{want}: the load was lost between the scheduler and the worker")
    if w is not None:
        assert_no_write_into_free_blocks(w, what)
        errs = list(w.load_errors)
        assert not errs, (
            f"{what}: loaded KV differs from what was stored for {len(errs)} "
            f"request(s): {errs[0]}"
            + (f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""))
    return n_loaded


def finish(rig: Rig) -> None:
    """End of every scenario: bit-identical loads, empty scheduler, no leak."""
    w = real_worker(rig)
    if w is not None:
        assert_no_write_into_free_blocks(w, "at the end")
        assert_loaded_kv_bit_identical(w)
    assert_scheduler_empty_and_no_leaked_blocks(rig.scheduler)


def store(rig: Rig, n: int, **kw: Any) -> Any:
    """Run one prompt to completion (the connector stores it); return it."""
    r = rig.request(n, **kw)
    rig.driver.run(r)
    return r


def replay_of(rig: Rig, stored: Any, **kw: Any) -> Any:
    """A new request with ``stored``'s prompt (not yet added)."""
    return rig.request(stored.num_prompt_tokens,
                       shared_prefix=stored.prompt_token_ids, **kw)


def cold(rig: Rig) -> None:
    """Drop vLLM's local prefix cache and zero the worker's KV tensors."""
    rig.forget_local_cache()
    w = real_worker(rig)
    if w is not None:
        w.zero()


# ------------------------------------------------------------------ routines
def shared_prefixes(make_rig: MakeRig, profile: Any, together: bool
                    ) -> dict[str, Any]:
    """Several requests sharing a prefix, admitted in one step or staggered.

    Stores three prompts sharing two chunks, goes :func:`cold`, replays all three
    together or one per step; each load must get exactly its own KV.
    """
    rig = make_rig(block_size=BLOCK_SIZE)
    b, c = rig.block_size, chunk_tokens(profile, rig.block_size)
    prefix = rig.request(2 * c).prompt_token_ids
    lens = [prompt_len(profile, b, 3, b // 2 + 1 + i) for i in range(3)]
    stored = [rig.request(n, shared_prefix=prefix) for n in lens]
    rig.driver.run(*stored)                                         # 1
    cold(rig)                                                      # 2
    w = real_worker(rig)
    snap = snapshot_kv(w) if w else None
    replays = [replay_of(rig, s) for s in stored]
    if together:                                                    # 3
        rig.driver.add(*replays)
    else:
        for r in replays:
            rig.driver.add(r)
            rig.driver.step()
    admitted = {r.request_id for r in replays}
    rig.driver.run_until_idle()
    hits = []
    for r in replays:
        hits.append(check_hit(rig, r, rule_hit(profile, r.num_prompt_tokens, b),
                              "shared prefixes"))
    loads = check_every_load(rig, replays, "shared prefixes" + (
        " (admitted in one step)" if together else " (staggered)"))
    assert loads >= 2, (
        f"scenario did not happen: {loads} of 3 requests sharing a prefix loaded "
        f"external KV (hits {hits}); at least two loads in flight were expected")
    first_asked = {rid: rig.driver.match_steps.get(rid, [0])[0] for rid in admitted}
    if together:
        assert len(set(first_asked.values())) == 1, (
            "scenario did not happen: the three requests were not looked up in one "
            f"step (first lookup per request: {first_asked})")
    if w is not None:
        owned = set().union(*(w.block_table[r.request_id] for r in replays))
        assert_untouched_outside(w, snap, owned, "shared prefixes")  # type: ignore[arg-type]
    finish(rig)
    return {"hits": hits, "loads": loads, "first_lookup_step": first_asked}


def fault_point(rig: Rig, request: Any) -> dict[str, Any]:
    """Where ``request`` stands with the connector, for a store fault injected now.

    Called from the driver's ``before_worker`` hook: a store fault belongs after the
    lookup answered and before the worker's load (sync: the scheduling step; async:
    the admission step or later). Returns ``{}`` while no lookup was answered
    (inject later), else ``{"state": sentence, "done": bool}``; ``done``: the load
    already completed, so the fault cannot be judged.
    """
    answers = [a for a in rig.driver.matched.get(request.request_id, ())
               if a[1] is not None]
    if not answers:
        return {}
    local, n, is_async = answers[-1]
    w = rig.driver.worker
    done = request.request_id in rig.driver.finished_recving or (
        request.request_id in getattr(w, "loaded", {}))
    how = "asynchronous" if is_async else "synchronous"
    return {"state": f"after the connector matched {n} tokens beyond {local} "
                     f"local ({how} load), before its load",
            "done": done}


#: slack of the write-volume bound over the KV bytes vLLM asked to store: a file
#: format's header, digests and alignment (safetensors: an 8-byte length and a
#: JSON header per file; the panel: a SHA-256 per block in it)
WRITE_SLACK = 0.5
#: bytes a request may write beyond its blocks' KV: metadata files (an index,
#: a manifest), whatever the KV size
WRITE_META_BYTES = 64 * 1024
#: entries (files) a request may write beyond one per block and layer and one
#: per block (a block's index or manifest)
WRITE_META_ENTRIES = 2


def kv_bytes_per_block(rig: Rig) -> int:
    """Bytes of one KV block, all layers (``page_size_bytes`` x layers, per group)."""
    return sum(int(g.kv_cache_spec.page_size_bytes) * len(g.layer_names)
               for g in rig.kv_cache_config.kv_cache_groups)


# ------------------------------------------------- connector API paths vLLM drives
IDLE_STEPS = 4  # EngineDriver.run_until_idle's empty steps after the last request


def stored_then_served(profile: Any, rig: Rig) -> tuple[Any, Any, int]:
    """Store a prompt, drop vLLM's local cache, replay it: (stored, replay, hit).

    AssertionError ``scenario did not happen`` when the replay got no external hit.
    """
    n = scenario_lengths(profile, rig.block_size)["single"]
    stored = store(rig, n)
    cold(rig)
    again = replay_of(rig, stored)
    rig.driver.run(again)
    _local, hit, _ = external_hit(rig.driver, again)
    assert hit > 0, (
        f"scenario did not happen: the replay of a stored {n}-token prompt got no "
        "external hit, so no store, load, stat or event was exercised")
    return stored, again, hit


def overrides(rig: Rig, *names: str) -> list[str]:
    """Which ``KVConnectorBase_V1`` methods of ``names`` the connector overrides."""
    from tvc.contract.coverage import overridden

    mine = overridden(type(rig.scheduler.connector))
    return [n for n in names if f"api:KVConnectorBase_V1.{n}" in mine]


#: Model B of ``another_model_on_one_store`` over model A (tiny Llama: 2 KV heads,
#: head size 64, float16, KV cache ``auto``): ``make_rig`` arguments, what differs,
#: what a key that ignores it ignores, the coverage entry. ``dtype`` and
#: ``cache_dtype`` keep the checkpoint and KV shape: only the bytes differ.
OTHER_MODEL: dict[str, tuple[dict[str, Any], str, str, str]] = {
    "same_shape": ({"model_name": "tiny-llama-other"},
                   "another model of the same shape (other weights, other KV)",
                   "the model", "config:ModelConfig.model"),
    "head_size": ({"head_size": 32}, "head size 32 instead of 64", "the model",
                  "config:ModelConfig.model"),
    "num_kv_heads": ({"num_kv_heads": 4}, "4 KV heads instead of 2", "the model",
                     "config:ModelConfig.model"),
    "dtype": ({"dtype": "bfloat16", "checkpoint_dtype": "float16"},
              "the same checkpoint served with --dtype bfloat16 instead of float16 "
              "(same KV shape, other bytes)", "the model's dtype",
              "config:ModelConfig.dtype"),
    "cache_dtype": ({"cache_dtype": "fp8"},
                    "the same model with --kv-cache-dtype fp8 instead of auto "
                    "(float16)", "the KV cache dtype",
                    "config:CacheConfig.cache_dtype"),
    "kv_layout": ({"kv_layout": "HND"},
                  "the same model with VLLM_KV_CACHE_LAYOUT=HND instead of NHD (the "
                  "same KV values, another byte order in every block)",
                  "the KV cache layout", "config:CacheConfig.kv_cache_layout"),
}
#: variants whose KV VALUES equal model A's: a hit is right when the loaded KV is
#: bit-identical (a connector that moves KV through the logical tensor view), wrong
#: when it is not (raw block bytes reinterpreted in another layout)
SAME_KV = frozenset({"kv_layout"})


#: the token id of every multimodal placeholder position in the scenarios (one id
#: for every item, as a model's image token; its KV follows the item's content)
PLACEHOLDER_TOKEN_ID = 31990


#: vLLM's block hash functions besides the default ``sha256``
#: (``PrefixCachingHashAlgo``, ``vllm/config/cache.py``;
#: ``vllm/utils/hashing.py`` ``get_hash_fn_by_name``): the ``xxhash`` ones need
#: the optional ``xxhash`` package.
HASH_ALGOS = ("sha256_cbor", "xxhash", "xxhash_cbor")


def close_rig(rig: Rig) -> None:
    """Close a rig before the next is built (:meth:`tvc.contract.rig.Rig.close`)."""
    rig.close()


SKIP_READING = {
    "prompt_logprobs": {"prompt_logprobs": 1},
    "skip_reading_prefix_cache": {"skip_reading_prefix_cache": True},
}


def kv_cache_layouts() -> set[str]:
    """The KV cache layout names the installed vLLM defines.

    ``KVCacheLayoutType`` (``vllm/v1/attention/backends/utils.py``, 0.28) and
    ``vllm.v1.kv_cache_layout.KVCacheLayout`` members (0.33), where present.
    """
    import importlib
    import typing

    out: set[str] = set()
    try:
        utils = importlib.import_module("vllm.v1.attention.backends.utils")
        out |= {a for a in typing.get_args(getattr(utils, "KVCacheLayoutType", None))
                if isinstance(a, str)}
    except ImportError:
        pass
    try:
        mod = importlib.import_module("vllm.v1.kv_cache_layout")
        out |= set(mod.KVCacheLayout.__members__)
    except (ImportError, AttributeError):
        pass
    return out or {"NHD", "HND"}


