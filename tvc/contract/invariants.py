"""One named check per contract invariant.

Each raises ``AssertionError`` with a message saying what was expected, what was
seen and what to do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tvc.contract.serialization import round_trip, structurally_equal

if TYPE_CHECKING:
    from tvc.contract.driver import EngineDriver

# ------------------------------------------------------------------- invariants
def assert_scheduler_empty_and_no_leaked_blocks(scheduler: Any) -> None:
    """Every request is gone and every KV block is free again.

    The AssertionError names what is left (requests, queues, blocks with refs).
    """
    left = []
    for attr in ("requests", "waiting", "running", "finished_req_ids",
                 "finished_recving_kv_req_ids", "_inflight_prefills"):
        obj = getattr(scheduler, attr, None)
        if obj is not None and len(obj):
            left.append(f"{attr}={len(obj)}")
    pool = scheduler.kv_cache_manager.block_pool
    used = [b.block_id for b in pool.blocks if b.ref_cnt != 0 and not getattr(
        b, "is_null", False)]
    free = pool.free_block_queue.num_free_blocks
    expect_free = pool.num_gpu_blocks - 1  # block 0 is vLLM's null block
    assert not left and not used and free == expect_free, (
        "scheduler not empty after all requests finished: "
        f"left {', '.join(left) or 'no requests'}; {len(used)} KV block(s) still "
        f"referenced (first: {used[:8]}); free blocks {free} of {expect_free}. "
        "The connector holds blocks it never releases (request_finished returned "
        "delay_free=True without a later finished_sending, or a load never "
        "finished)")


def assert_hit_matches_rule(matched: int, expected: int, prompt_len: int,
                            block_size: int, rule: str, source: str) -> None:
    """The connector matched exactly the profile's declared hit rule.

    Neither more (claims tokens it may not have) nor fewer (throws hits away).
    """
    if matched == expected:
        return
    if expected >= prompt_len > matched:  # the rule, not the connector, is wrong
        raise AssertionError(
            f"external hit for a {prompt_len}-token prompt at block size "
            f"{block_size}: the profile's hit_rule {rule!r} ({source}) expects "
            f"{expected} tokens, the whole prompt or more, but vLLM always "
            f"computes the last prompt token (a sync load covers at most len - 1 = "
            f"{prompt_len - 1} tokens; an async full-prompt load is cut to that); "
            f"the connector answered {matched}. Fix the profile's connector."
            "hit_rule first (whole blocks "
            "of the first len - 1 tokens: (len - 1) // B * B), then rerun")
    what = ("throws stored KV away" if matched < expected
            else "claims more tokens than the declared rule allows")
    raise AssertionError(
        f"external hit for a {prompt_len}-token prompt at block size {block_size}: "
        f"expected {expected} tokens by the profile's hit_rule {rule!r} ({source}), "
        f"saw {matched} — the connector {what}. Fix the connector, or the "
        "profile's connector.hit_rule if the rule itself is wrong")


def assert_match_within_prompt(request: Any, local: int, matched: int,
                               is_async: bool) -> None:
    """The connector never claims the last prompt token a request must compute.

    Checked when the connector answers, before vLLM's scheduler acts on it:
    ``matched >= 0``; sync ``local + matched <= len - 1`` (vLLM's scheduler asserts
    otherwise); async ``<= len`` (vLLM recomputes the last token itself,
    ``Scheduler._update_waiting_for_remote_kv``).
    """
    n = request.num_tokens
    limit = n if is_async else n - 1
    assert matched >= 0, (
        f"get_num_new_matched_tokens for {request.request_id} ({n} tokens, "
        f"{local} computed locally, {request.num_preemptions} preemption(s)) "
        f"returned {matched}, a negative token count: the connector subtracts "
        "num_computed_tokens from a shorter match (after a preemption vLLM's "
        "local prefix cache can cover more than the connector's match); return "
        "max(0, match - num_computed_tokens)")
    if local and matched <= limit < local + matched:
        raise AssertionError(
            f"get_num_new_matched_tokens for {request.request_id} ({n} tokens) "
            f"returned {matched} although vLLM passed num_computed_tokens={local} "
            f"(its local prefix cache hit): local + matched = {local + matched} > "
            f"{limit}. The connector ignores the local hit (or answers a stale "
            "count from an earlier lookup); it must return only the tokens beyond "
            "num_computed_tokens")
    if local + matched > n:
        raise AssertionError(
            f"get_num_new_matched_tokens for {request.request_id} ({n} tokens, "
            f"{local} computed locally) returned {matched} "
            f"({'async' if is_async else 'sync'}): local + matched = "
            f"{local + matched}, {local + matched - n} token(s) beyond the end of "
            "the prompt. The connector claims KV it cannot hold (a match rounded "
            "up, or counted past the prompt); round down to whole blocks within "
            "the first len - 1 tokens")
    assert local + matched <= limit, (
        f"get_num_new_matched_tokens for {request.request_id} ({n} tokens, "
        f"{local} computed locally) returned {matched} "
        f"({'async' if is_async else 'sync'}): local + matched = "
        f"{local + matched} > {limit}. The connector counts the last prompt "
        "token, which vLLM must always recompute to sample; match at most "
        "the first len - 1 tokens")


def full_prompt_ends(prompt_len: int, is_async: bool) -> tuple[int, ...]:
    """Where a hit may end inside a block: at the prompt's last token.

    Returns the totals ``local + matched`` allowed to end inside a block:
    ``prompt_len - 1``, and ``prompt_len`` for an async load. vLLM allocates
    ``cdiv(local + matched, B)`` blocks
    (``SingleTypeKVCacheManager.allocate_external_computed_blocks``,
    ``vllm/v1/core/single_type_kv_cache_manager.py`` L320-L322 in 0.28.0) and cuts
    an async full-prompt load to ``num_tokens - 1``
    (``Scheduler._update_waiting_for_remote_kv``, ``scheduler.py`` L2759-L2762 in
    0.28.0, L3515-L3516 in 0.33.0); LMCache answers ``len - 1`` ("in the
    full-prompt-hit case we need to recompute the last token"). A partial block
    anywhere else would be split mid-prompt, which vLLM never presents (its local
    hit is block-aligned, ``scheduler.py`` L822-L828).
    """
    return (prompt_len - 1, prompt_len) if is_async else (prompt_len - 1,)


def assert_block_aligned(matched: int, block_size: int, prompt_len: int,
                         local: int = 0, is_async: bool = False) -> None:
    """Matched tokens are whole blocks, or end exactly at the prompt's last token.

    ``matched`` (tokens beyond ``local``, vLLM's block-aligned
    ``num_computed_tokens``) must be a multiple of ``block_size``, or
    ``local + matched`` one of :func:`full_prompt_ends`.
    """
    if matched % block_size == 0 or (
            matched > 0 and local + matched in full_prompt_ends(prompt_len, is_async)):
        return
    ends = " or ".join(f"{e}" for e in full_prompt_ends(prompt_len, is_async))
    raise AssertionError(
        f"external hit of {matched} tokens for a {prompt_len}-token prompt "
        f"({local} computed locally) is not a multiple of the block size "
        f"{block_size}: vLLM allocates and caches whole blocks, so a partial block "
        "would be split between the connector's load and the tokens vLLM computes "
        "mid-prompt. Only a hit that ends at the prompt's last token may end inside "
        f"a block (local + matched = {ends}; here {local + matched}). Align "
        "get_num_new_matched_tokens down to whole blocks")


def assert_last_token_recomputed(driver: EngineDriver, request: Any) -> None:
    """When the request first computes, at most ``len - 1`` tokens are computed.

    Fails also when the request never computed.
    """
    rid = request.request_id
    n = request.num_prompt_tokens
    assert rid in driver.first_compute, (
        f"request {rid} ({n} tokens) was never scheduled for compute: "
        "vLLM could not schedule it after the connector's match (a synchronous "
        "connector must leave at least the last prompt token to compute)")
    computed, scheduled = driver.first_compute[rid]
    assert computed <= n - 1 and scheduled >= 1, (
        f"request {rid}: {computed} of {n} prompt tokens counted as computed when "
        f"it was first scheduled ({scheduled} scheduled): at most {n - 1} may be, "
        "the last prompt token is always recomputed to sample the next token")


def assert_only_unmatched_tokens_run(driver: EngineDriver, request: Any,
                                     matched: int) -> None:
    """After the load, the request computes from token ``min(matched, len - 1)`` on."""
    rid = request.request_id
    n = request.num_prompt_tokens
    computed, _ = driver.first_compute[rid]
    expect = min(matched, n - 1)
    assert computed == expect, (
        f"request {rid}: after loading {matched} external tokens it started "
        f"computing at token {computed}, expected {expect} (min(matched, len-1)): "
        "the load did not complete through the finished-receiving path or vLLM "
        "recomputes tokens the connector loaded")


def assert_metadata_survives_serialization(meta: Any) -> None:
    """``meta`` is a ``KVConnectorMetadata`` that survives vLLM's pickling unchanged."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

    assert isinstance(meta, KVConnectorMetadata), (
        f"build_connector_meta returned {type(meta).__name__}, expected a "
        "KVConnectorMetadata subclass")
    try:
        back = round_trip(meta)
    except Exception as exc:  # noqa: BLE001 - report any pickling failure
        raise AssertionError(
            f"build_connector_meta returned {type(meta).__name__} which vLLM cannot "
            f"send to the workers: pickling it (as shm_broadcast.MessageQueue "
            f"does) fails with {type(exc).__name__}: {exc}. Keep connector "
            "metadata to plain data, tensors and picklable classes") from None
    diff = structurally_equal(meta, back)
    assert not diff, (
        f"{type(meta).__name__} changes when sent to the workers: {diff}")


def assert_request_finished_types(ret: Any, method: str) -> None:
    """``request_finished(_all_groups)`` returns ``(bool, dict | None)``."""
    ok = (isinstance(ret, tuple) and len(ret) == 2 and isinstance(ret[0], bool)
          and (ret[1] is None or isinstance(ret[1], dict)))
    assert ok, (f"{method} returned {ret!r}; vLLM expects (delay_free_blocks: bool, "
                "kv_transfer_params: dict | None)")


def assert_loaded_kv_bit_identical(worker: Any) -> None:
    """Every load verified by the worker harness was bit-identical."""
    errs = getattr(worker, "load_errors", [])
    assert not errs, (
        f"loaded KV differs from what was stored ({len(errs)} request(s)): "
        f"{errs[0]}. The connector's load corrupts data or writes into the wrong "
        "block or layer")


def assert_no_write_into_free_blocks(worker: Any, what: str) -> None:
    """No block was written while vLLM had it free (:mod:`tvc.contract.freed`).

    The AssertionError names the first such block, its layer, what freed it and
    when it was written ("used after vLLM freed it").
    """
    uses = list(getattr(worker, "freed_uses", ()))
    assert not uses, (f"{what}: {len(uses)} block(s) written while vLLM had them "
                      f"free: {uses[0]}")


def iter_finished_returns(driver: EngineDriver) -> Iterable[tuple[str, str, Any]]:
    """(request id, method name, returned value) for every finished request."""
    for rid, (name, ret) in driver.finished_returns.items():
        yield rid, name, ret


def snapshot_kv(worker: Any) -> dict[str, Any]:
    """A copy of every KV tensor of a worker, for :func:`assert_untouched_outside`."""
    return {name: t.clone() for name, t in worker.kv_caches.items()}


def assert_untouched_outside(worker: Any, snapshot: dict[str, Any],
                             owned: Iterable[int], what: str) -> None:
    """No KV block outside ``owned`` changed since ``snapshot``, in any layer.

    ``owned``: block ids the phase's requests hold (they may change). The
    AssertionError names the layer and the first block that changed.
    """
    import torch

    owned = set(owned)
    for name, kv in worker.kv_caches.items():
        before = snapshot[name]
        nb = kv.shape[0] if kv.dim() == 4 else kv.shape[1]
        others = torch.tensor(sorted(set(range(nb)) - owned), dtype=torch.long,
                              device=kv.device)
        if kv.dim() == 4:
            diff = kv[others].ne(before[others]).reshape(len(others), -1).any(1)
        else:
            diff = kv[:, others].ne(before[:, others]).transpose(0, 1).reshape(
                len(others), -1).any(1)
        if bool(diff.any()):
            bad = int(others[diff.nonzero()[0]])
            raise AssertionError(
                f"{what}: layer {name}, block {bad}, which no request of this "
                "phase holds, changed: the connector writes into blocks vLLM did "
                "not give it")
