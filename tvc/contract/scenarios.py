"""Engine scenarios where real connector faults live, each a plain function.

Every scenario drives vLLM's own V1 scheduler (and the connector's real worker side
where ``connector.worker_devices`` allows, else the transfer-acknowledging stand-in)
step by step — ``schedule()``, the worker, ``update_from_output()`` — through an
:class:`~tvc.contract.driver.EngineDriver`, then applies the contract invariants:

* every answer of ``get_num_new_matched_tokens``: ``0 <= matched`` and
  ``local + matched <= len - 1`` (``len`` when asynchronous), checked when the
  connector answers (:func:`~tvc.contract.invariants.assert_match_within_prompt`);
* matched tokens are whole blocks;
* the KV of EVERY request that loaded is bit-identical to what was stored, at the
  right slots (:class:`~tvc.contract.worker.ConnectorWorker` verifies the tokens
  vLLM counts as computed in the step a request first computes, and again after a
  preemption); no block outside the phase's requests changed;
* the scheduler is empty and every KV block is free at the end.

A scenario that did not happen (no hit, no preemption, no load in flight) fails:
each asserts its premise. Prompt lengths come from the connector's granularity
(``profile.granularity_tokens(B)``: tokens per stored unit, default ``B``), so every
scenario stores whole chunks; :class:`ScenarioError` names a plan that cannot work
(a prompt shorter than one chunk, a tier whose every expected hit is 0).

Each function takes ``make_rig`` (``**kw -> Rig``, see :func:`tvc.contract.make_rig`)
and the profile, and returns a summary dict (recorded as a test property).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tvc.contract.driver import external_hit
from tvc.contract.invariants import (
    assert_block_aligned,
    assert_hit_matches_rule,
    assert_loaded_kv_bit_identical,
    assert_no_write_into_free_blocks,
    assert_scheduler_empty_and_no_leaked_blocks,
    assert_untouched_outside,
    snapshot_kv,
)
from tvc.contract.rig import Rig
from tvc.contract.worker import ConnectorWorker
from tvc.core.error_hints import describe_failure

MakeRig = Callable[..., Rig]
BLOCK_SIZE = 16  # B of every scenario rig (vLLM's default block size on CUDA)
#: steps a scenario waits for a request a connector deferred (a None answer)
DEFERRED_LOOKUP_STEPS = 4


class ScenarioError(Exception):
    """A scenario cannot be planned for this connector (message says why)."""


class NotApplicable(Exception):  # noqa: N818 - reads as a reason to skip
    """The scenario does not apply to this connector or box (message says why)."""


# ------------------------------------------------------------------ planning

def run_scenario(fn: Callable[..., Any], *args: Any,
                 record_property: Callable[[str, Any], None] | None = None,
                 **kw: Any) -> Any:
    """Run one scenario function: NotApplicable skips, ScenarioError fails.

    An AssertionError is re-raised naming the scenario and the failure
    (:func:`describe_failure`); the scenario's result is
    recorded as the test property ``scenario`` when ``record_property`` is given.
    """
    import pytest

    try:
        out = fn(*args, **kw)
    except NotApplicable as exc:
        pytest.skip(str(exc))
    except ScenarioError as exc:
        pytest.fail(str(exc), pytrace=False)
    except AssertionError as exc:
        raise AssertionError(f"scenario {fn.__name__}: {describe_failure(exc)}"
                             ) from exc
    if record_property is not None:
        record_property("scenario", out)
    return out


def chunk_tokens(profile: Any, block_size: int) -> int:
    """Tokens the connector stores per unit (``connector.granularity``, default B).

    Args:
        profile: the target profile.
        block_size: B in tokens.

    Returns:
        tokens per stored chunk (a multiple of nothing in particular; >= 1).

    """
    return int(profile.granularity_tokens(block_size))


def prompt_len(profile: Any, block_size: int, chunks: int, tail: int) -> int:
    """Length of a prompt of ``chunks`` whole chunks plus ``tail`` tokens.

    Raises:
        ScenarioError: the prompt is shorter than one chunk (the connector stores
            nothing for it, so the scenario would prove nothing).

    """
    c = chunk_tokens(profile, block_size)
    n = chunks * c + tail
    if n < c or n < 2:
        raise ScenarioError(
            f"a {n}-token prompt is shorter than one chunk: this connector stores "
            f"whole chunks of {c} tokens (connector.granularity at B={block_size}), "
            "so it stores nothing for it. Use prompts of at least one chunk")
    return n


def round_trip_len(profile: Any, block_size: int) -> int:
    """A prompt for a one-prompt round trip: whole chunks plus half a block.

    ``max(4 * B, 2 * chunk) + B // 2`` tokens: 4.5 blocks for a per-block store
    (``connector.granularity`` = B), two whole chunks and a tail for a chunked
    one, so the replay can hit whatever the chunk.

    Args:
        profile: the target profile.
        block_size: B in tokens.

    Returns:
        the prompt length in tokens.

    """
    return max(4 * block_size, 2 * chunk_tokens(profile, block_size)) + (
        block_size // 2)


def pool_blocks(num_tokens: int, block_size: int, requests: int = 2,
                minimum: int = 64) -> int:
    """KV blocks for ``requests`` prompts of ``num_tokens`` (+1 decode) at once.

    Returns:
        ``max(minimum, requests * (ceil((num_tokens + 1) / B) + 1) + 1)``: the
        +1 per request for its decode block, +1 for vLLM's null block.

    """
    per = -(-(num_tokens + 1) // block_size) + 1
    return max(minimum, requests * per + 1)


def hit_rule_of(profile: Any) -> tuple[str, str]:
    """``(rule, source)`` that applies to the installed vLLM (``("", "")``: none)."""
    return profile.select_hit_rule()


def rule_hit(profile: Any, n: int, block_size: int) -> int | None:
    """Tokens the profile's ``connector.hit_rule`` expects for a stored n-token prompt.

    The rule is :meth:`~tvc.config.profile.Profile.select_hit_rule`'s: the
    ``connector.hit_rules`` entry for the installed vLLM, else
    ``connector.hit_rule`` (a profile may give either form).

    Returns:
        the expected external hit from an empty local cache; None without a rule.

    """
    if not hit_rule_of(profile)[0]:
        return None
    return int(profile.expected_hit_tokens(n, block_size))


def require_hits(profile: Any, lengths: Iterable[int], block_size: int,
                 max_len: int) -> None:
    """A tier in which every expected hit is 0 is an error, never a pass.

    Raises:
        ScenarioError: ``vacuous: ...`` naming the chunk and the longest prompt.

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
    """The prompt length each scenario uses (whole chunks plus a short tail).

    Raises:
        ScenarioError: a length is shorter than a chunk, or every hit is 0.

    """
    c = chunk_tokens(profile, block_size)
    tail = max(1, block_size // 2 + 1)
    out = {
        "single": prompt_len(profile, block_size, 2, tail),
        "long": prompt_len(profile, block_size, 4, tail),
    }
    from tvc.contract.builders import DEFAULT_MAX_MODEL_LEN

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

    ``local + matched`` (vLLM's local prefix cache hit plus the connector's
    match) must equal the profile's rule for the prompt: the connector matches
    from ``num_computed_tokens`` on, to the same end as from an empty cache.

    Returns:
        (local, matched).

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

    With the real worker: each such request computed (``worker.loaded``) from at
    least ``min(local + matched, len - 1)`` (or from a block the connector
    reported as failed), and ``worker.load_errors`` is empty.

    Returns:
        how many requests loaded (matched > 0).

    Raises:
        AssertionError: a load did not land, or landed wrong (names the request).

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
        assert start is not None and start >= want, (
            f"{what}: request {rid} matched {matched} external tokens "
            f"({local} local) but started computing at token {start}, expected "
            f"{want}: the load was lost between the scheduler and the worker")
    if w is not None:
        assert_no_write_into_free_blocks(w, what)
        errs = list(w.load_errors)
        assert not errs, (
            f"{what}: loaded KV differs from what was stored for {len(errs)} "
            f"request(s): {errs[0]}. Every request that loads must get exactly its "
            "own KV")
    return n_loaded


def finish(rig: Rig) -> None:
    """End of every scenario: bit-identical loads, empty scheduler, no leak."""
    w = real_worker(rig)
    if w is not None:
        assert_no_write_into_free_blocks(w, "at the end")
        assert_loaded_kv_bit_identical(w)
    assert_scheduler_empty_and_no_leaked_blocks(rig.scheduler)


def _store(rig: Rig, n: int, **kw: Any) -> Any:
    """Run one prompt to completion (the connector stores it); return it."""
    r = rig.request(n, **kw)
    rig.driver.run(r)
    return r


def _replay(rig: Rig, stored: Any, **kw: Any) -> Any:
    """A new request with ``stored``'s prompt (not yet added)."""
    return rig.request(stored.num_prompt_tokens,
                       shared_prefix=stored.prompt_token_ids, **kw)


def _cold(rig: Rig) -> None:
    """Drop vLLM's local prefix cache and zero the worker's KV tensors.

    The next hit must then come from the connector and land in zeroed blocks.
    """
    rig.forget_local_cache()
    w = real_worker(rig)
    if w is not None:
        w.zero()


# ------------------------------------------------------------------ scenarios
def local_then_external(make_rig: MakeRig, profile: Any) -> dict[str, Any]:
    """1. The first k blocks in vLLM's local prefix cache, the rest in the store.

    k is chosen so that ``num_computed_tokens = k * B`` is not a multiple of the
    connector's chunk (where the chunk is larger than a block).

    1. store a prompt P of several chunks; drop vLLM's local cache (the store
       keeps P);
    2. run P's first k blocks (+1 token) locally: they enter vLLM's local prefix
       cache, which is NOT reset from here on;
    3. replay P: vLLM passes ``num_computed_tokens = k * B``; the connector must
       match from there to the rule's end, load at the right slots and leave the
       locally cached tokens untouched.
    """
    rig = make_rig(block_size=BLOCK_SIZE)
    b, c = rig.block_size, chunk_tokens(profile, rig.block_size)
    k = next(k for k in range(1, c // b + 2) if c <= b or (k * b) % c)
    n = prompt_len(profile, b, -(-k * b // c) + 2, b // 2 + 1)
    full = _store(rig, n)                                           # 1
    _cold(rig)
    head = rig.request(k * b + 1, shared_prefix=full.prompt_token_ids[:k * b])
    rig.driver.run(head)                                            # 2
    w = real_worker(rig)
    snap = snapshot_kv(w) if w else None
    replay = _replay(rig, full)
    rig.driver.run(replay)                                          # 3
    local, matched, _ = external_hit(rig.driver, replay)
    assert local == k * b, (
        f"scenario did not happen: vLLM's local prefix cache held {local} tokens "
        f"of the replayed prompt, expected the {k * b} tokens (k={k} blocks) run "
        "just before")
    expected = rule_hit(profile, n, b)
    check_hit(rig, replay, expected, "local + external")
    assert matched > 0, (
        f"scenario did not happen: the connector matched nothing beyond the "
        f"{local} locally cached tokens of a stored {n}-token prompt")
    if w is not None:
        rid = replay.request_id
        msg = w.verify_range(rid, 0, local)
        assert not msg, (
            f"local + external: the connector overwrote locally cached KV before "
            f"num_computed_tokens={local}: {msg}")
        end = local + matched
        msg = w.verify_range(rid, local, end)
        if msg:
            d = w.find_shift(rid, local, end, c)
            shift = (f"; the loaded KV sits {d} tokens from its slots "
                     f"(num_computed_tokens mod chunk = {local % c})"
                     if d is not None else "")
            raise AssertionError(
                f"local + external: loaded KV of tokens [{local}, {end}) is not at "
                f"the right slots: {msg}{shift}")
        check_every_load(rig, [replay], "local + external")
        assert_untouched_outside(w, snap, w.block_table[rid], "local + external")  # type: ignore[arg-type]
    finish(rig)
    return {"k_blocks": k, "chunk": c, "prompt_len": n, "local": local,
            "matched": matched}


def shared_prefixes(make_rig: MakeRig, profile: Any, together: bool
                    ) -> dict[str, Any]:
    """2. Several requests sharing a prefix, admitted in one step or staggered.

    1. store three prompts that share two chunks and differ after them;
    2. drop vLLM's local cache and zero the KV;
    3. replay all three in ONE step (``together``) or one per step (staggered);
       every request that loads must get exactly its own KV.
    """
    rig = make_rig(block_size=BLOCK_SIZE)
    b, c = rig.block_size, chunk_tokens(profile, rig.block_size)
    prefix = rig.request(2 * c).prompt_token_ids
    lens = [prompt_len(profile, b, 3, b // 2 + 1 + i) for i in range(3)]
    stored = [rig.request(n, shared_prefix=prefix) for n in lens]
    rig.driver.run(*stored)                                         # 1
    _cold(rig)                                                      # 2
    w = real_worker(rig)
    snap = snapshot_kv(w) if w else None
    replays = [_replay(rig, s) for s in stored]
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


def preemption_and_resume(make_rig: MakeRig, profile: Any) -> dict[str, Any]:
    """3. A small KV pool and long decodes force preemption; re-admission is sane.

    1. store three prompts;
    2. drop vLLM's local cache; replay them with long decodes in a pool too small
       for all three (vLLM preempts one, frees its blocks, re-admits it later and
       asks the connector again with ``num_computed_tokens`` from its local
       prefix cache);
    3. every answer is checked when given (never negative, never beyond
       ``len - 1``); a resumed request's computed tokens are verified again.
    """
    b = BLOCK_SIZE
    n = prompt_len(profile, b, 2, b // 2 + 1)
    decode_blocks = 4  # max_tokens = 4 * B below
    blocks_per_req = -(-n // b) + decode_blocks
    # room for two requests' prompts and decodes, not three (short prompts);
    # for long prompts (large chunks) that pool admits only two and never
    # preempts, so then: room for the three prompts (admitted together) and a
    # third of their decodes. Either way vLLM must preempt while they decode.
    prompt_blocks = -(-(n + 1) // b)
    rig = make_rig(block_size=b, num_blocks=max(
        2 * blocks_per_req + 2, 3 * prompt_blocks + decode_blocks + 1))
    stored = [_store(rig, n) for _ in range(3)]                      # 1
    _cold(rig)
    replays = [_replay(rig, s, max_tokens=4 * b) for s in stored]

    def readmission(request: Any, local: int, matched: int, _async: bool) -> None:
        # 3: what the store can hold beyond vLLM's local hit (the rule at the
        # prompt's and at the current length: decoded blocks may be stored too)
        if request.num_preemptions == 0:
            return
        totals = [rule_hit(profile, m, b) for m in
                  (request.num_prompt_tokens, request.num_tokens)]
        if None in totals:
            return
        allowed = max(0, max(totals) - local)  # type: ignore[operator,type-var]
        assert matched <= allowed, (
            f"preemption and resume: request {request.request_id} re-admitted "
            f"after {request.num_preemptions} preemption(s) with "
            f"num_computed_tokens={local} (vLLM's local prefix cache) matched "
            f"{matched}; the store holds at most {max(totals)} tokens of it, so "  # type: ignore[type-var]
            f"at most {allowed} lie beyond num_computed_tokens: the connector "
            "answers a stale count from before the preemption")

    rig.driver.on_match = readmission
    rig.driver.run(*replays)                                        # 2
    preempted = [r for r in replays if r.num_preemptions > 0]
    assert preempted, (
        f"scenario did not happen: no request was preempted (pool "
        f"{rig.kv_cache_config.num_blocks} blocks, 3 requests of up to "
        f"{blocks_per_req} blocks)")
    readmit = [a for r in preempted for a in rig.driver.matched[r.request_id][1:]]
    assert readmit, (
        "scenario did not happen: a preempted request was never looked up again")
    loads = check_every_load(rig, replays, "preemption and resume")
    w = real_worker(rig)
    if w is not None:
        assert set(w.resumed) >= {r.request_id for r in preempted}, (
            "scenario did not happen: the worker never saw the preempted request "
            "resumed")
    finish(rig)
    return {"preempted": len(preempted), "readmission_answers": readmit,
            "loads": loads}


def abort(make_rig: MakeRig, profile: Any, when: str) -> dict[str, Any]:
    """4. Abort a request while it waits for remote KV, while it runs, or queued.

    1. store a prompt; drop vLLM's local cache;
    2. replay it and abort it (``scheduler.finish_requests(..., FINISHED_ABORTED)``,
       as the API server does when a client goes away):
       ``waiting_for_remote_kv``: right after the step that admitted it with an
       asynchronous load; ``running``: after its first computed step with decodes
       left; ``queued``: before any step;
    3. run until idle: nothing is left, every block is free.
    """
    from vllm.v1.request import RequestStatus

    rig = make_rig(block_size=BLOCK_SIZE)
    n = prompt_len(profile, rig.block_size, 2, rig.block_size // 2 + 1)
    stored = _store(rig, n)                                         # 1
    _cold(rig)
    r = _replay(rig, stored, max_tokens=16)
    rig.driver.add(r)
    seen = r.status.name
    if when == "waiting_for_remote_kv":
        rig.driver.step()
        seen = r.status.name
        if r.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            raise NotApplicable(
                f"the connector loads synchronously (after admission the request "
                f"is {r.status.name}, not WAITING_FOR_REMOTE_KVS): no request ever "
                "waits for remote KV")
    elif when == "running":
        for _ in range(rig.driver.max_steps):
            rig.driver.step()
            if r.status == RequestStatus.RUNNING and r.num_output_tokens >= 1:
                break
        seen = r.status.name
        assert r.status == RequestStatus.RUNNING, (
            f"scenario did not happen: the request never ran (status {seen})")
    else:
        assert r.status == RequestStatus.WAITING, seen
    aborted = rig.scheduler.finish_requests(r.request_id,                # 2
                                            RequestStatus.FINISHED_ABORTED)
    assert [a.request_id for a in aborted] == [r.request_id], (
        f"vLLM did not abort request {r.request_id} (status {seen})")
    rig.driver.run_until_idle()                                     # 3
    finish(rig)
    return {"aborted_while": seen}


def fault_wrapper(make_rig: MakeRig, profile: Any, policy: str) -> dict[str, Any]:
    """5a. A failed load reported through vLLM's interface, under a policy.

    The connector runs inside :class:`tvc.contract.faults.FaultInjectingConnector`
    (``fail_load`` every 2nd load): the loaded range of one request is overwritten
    and one block reported via ``get_block_ids_with_load_errors`` (or in the pass
    that finishes the asynchronous receive).

    1. store three prompts; drop the local cache;
    2. replay them in one step with ``kv_load_failure_policy = policy``;
    3. the faulted request is recomputed bit-identically (``recompute``) or
       finished with an error (``fail``); the other two load bit-identical KV and
       finish normally; no exception escapes a step; nothing leaks.
    """
    from vllm.v1.request import RequestStatus

    from tvc.contract.faults import wrap_kv_transfer_config

    ktc = dict(profile.kv_transfer_config(), kv_load_failure_policy=policy)
    rig = make_rig(block_size=BLOCK_SIZE,
                   kv_transfer_config=wrap_kv_transfer_config(ktc, "fail_load", 2))
    n = prompt_len(profile, rig.block_size, 2, rig.block_size // 2 + 1)
    stored = [rig.request(n) for _ in range(3)]
    rig.driver.run(*stored)                                         # 1
    _cold(rig)
    replays = [_replay(rig, s) for s in stored]
    rig.driver.run(*replays)                                        # 2
    planned = {rid for mode, rid, _ in rig.scheduler.connector.injected
               if mode == "fail_load"}
    faulted = [r for r in replays if r.request_id in planned]
    assert len(faulted) == 1, (
        f"scenario did not happen: {len(faulted)} load(s) faulted, expected 1 of 3 "
        f"(hits {[external_hit(rig.driver, r)[1] for r in replays]})")
    bad = faulted[0]
    w = real_worker(rig)
    reported = rig.driver.worker.reported_invalid_blocks if rig.driver.worker else ()
    assert reported, ("the injected load failure never reached vLLM through "
                      "get_block_ids_with_load_errors")
    failed = RequestStatus.FINISHED_ERROR
    if policy == "fail":
        assert bad.status == failed, (
            f"kv_load_failure_policy=fail: the request whose load failed ended "
            f"{bad.status.name}, expected FINISHED_ERROR")
    else:
        assert bad.status != failed, (
            f"kv_load_failure_policy=recompute: the request whose load failed ended "
            f"{bad.status.name}; it must be recomputed and finish normally")
        if w is not None:
            msg = w.verify_range(bad.request_id, 0, bad.num_prompt_tokens)
            assert not msg, f"recomputed after a failed load: {msg}"
    others = [r for r in replays if r is not bad]
    assert all(r.status != failed for r in others), (
        "a load failure of one request failed other requests: "
        f"{[(r.request_id, r.status.name) for r in others]}")
    check_every_load(rig, others, f"failed load (policy {policy}), other requests")
    finish(rig)
    return {"faulted": bad.request_id, "policy": policy,
            "reported_blocks": sorted(reported)}


def store_fault(make_rig: MakeRig, profile: Any, kind: str, policy: str,
                injector_factory: Callable[[Rig], Any]) -> dict[str, Any]:
    """5b. The connector's own store fails: entry lost, corrupted, torn, save fails.

    ``injector_factory(rig)`` returns the store's fault injector
    (:func:`tvc.contract.faults.fault_injector_for`).

    lose / corrupt / tear:
      1. store two prompts A and B; drop the local cache;
      2. replay both in one step; damage A's entries as soon as the connector
         has answered A's lookup and before the worker step that follows it
         (:func:`fault_point`: the same engine step for a synchronous load and
         for an asynchronous one that loads in the admission step), or before
         the lookup where the injector cannot act in between;
      3. no exception escapes a step; A's failure is reported through vLLM's
         interface (or A matches less), and then: ``recompute`` -> A is
         recomputed and finishes with correct KV, ``fail`` -> A ends
         FINISHED_ERROR; B loads bit-identical KV and finishes normally; A's KV
         is never silently wrong.
    fail_save:
      1. store A while every save fails, then B normally;
      2. replay both: no exception escapes; A matches nothing or loads correct
         KV (a failed save is never visible to a later lookup); B hits the rule.
    """
    from vllm.v1.request import RequestStatus

    ktc = dict(profile.kv_transfer_config(), kv_load_failure_policy=policy)
    rig = make_rig(block_size=BLOCK_SIZE, kv_transfer_config=ktc)
    inj = injector_factory(rig)
    if inj is None or kind not in inj.kinds:
        raise NotApplicable(
            f"no fault injector for '{kind}' on this connector's store "
            f"({type(inj).__name__ if inj else 'none found'}): set "
            "connector.fault_injector to module:function returning one")
    b = rig.block_size
    n = prompt_len(profile, b, 2, b // 2 + 1)
    w = real_worker(rig)
    failed = RequestStatus.FINISHED_ERROR
    if kind == "fail_save":
        a = rig.request(n)
        if w is None:
            raise NotApplicable(
                "a failing save needs the connector's real worker side, which does "
                "not run on this device (connector.worker_devices)")
        with inj.failing_saves(w):
            rig.driver.run(a)                                       # 1
        bb = _store(rig, n)
        _cold(rig)
        ra, rb = _replay(rig, a), _replay(rig, bb)
        rig.driver.run(ra, rb)                                      # 2
        _, ma, _ = external_hit(rig.driver, ra)
        check_hit(rig, rb, rule_hit(profile, n, b), "after a failed save, B")
        check_every_load(rig, [ra, rb], "after a failed save")
        finish(rig)
        return {"kind": kind, "matched_after_failed_save": ma}
    from tvc.contract.faults import ForeignWriter

    a_mark = inj.mark()
    a = _store(rig, n)
    try:
        a_entries = inj.entries_since(a_mark)
    except ForeignWriter as exc:
        raise NotApplicable(str(exc)) from None
    assert a_entries, (
        f"the {type(inj).__name__} found no store entry written for a stored "
        f"{n}-token prompt")
    bb = _store(rig, n)                                             # 1
    _cold(rig)
    ra, rb = _replay(rig, a), _replay(rig, bb)
    damage = getattr(inj, kind)
    at: dict[str, Any] = {}
    if inj.between_lookup_and_load:
        def hook(_so: Any) -> None:
            if not at:
                at.update(fault_point(rig, ra))
                if at:
                    damage(a_entries)

        rig.driver.before_worker = hook
    else:
        damage(a_entries)
        at["state"] = "before the lookup"
    rig.driver.run(ra, rb)                                          # 2
    rig.driver.before_worker = None
    refused = list(getattr(inj, "refused", ()))
    if refused:  # another writer's file (or one changed since) is never touched
        raise NotApplicable(
            f"store fault '{kind}' not judged: {refused[0]} changed after the "
            "connector wrote it (another writer?), so it was left as it is")
    if not at:
        raise AssertionError(
            f"scenario did not happen: the connector never answered a lookup for "
            f"request {ra.request_id}, so its entries were never damaged")
    if at.get("done"):
        raise AssertionError(
            f"scenario did not happen: request {ra.request_id}'s load had already "
            f"completed ({at['state']}) when its entries were damaged")
    _, ma, _ = external_hit(rig.driver, ra)
    full = rule_hit(profile, n, b)
    reported = bool(getattr(rig.driver.worker, "reported_invalid_blocks", ()))
    less = full is not None and ma < full
    when = at["state"]
    if not (reported or less or ra.status == failed):
        if w is None:
            # the damage is in the bytes; what finds it is the worker's load
            raise NotApplicable(
                f"store fault '{kind}': the connector matched all {ma} tokens of the "
                "damaged entries and no worker side runs on this device "
                f"(connector.worker_devices = "
                f"{profile['connector']['worker_devices']}) "
                "to load them and find the damage: judged where the worker runs "
                "(the [cuda] variant on a GPU host)")
        errs = w.load_errors
        raise AssertionError(
            f"store fault '{kind}' of request {ra.request_id}'s entries ({when}): "
            "the connector neither reported it (get_block_ids_with_load_errors / "
            f"failed receive) nor matched less ({ma} of {full} tokens)"
            + (f"; it loaded the damaged entry silently: {errs[0]}" if errs else ""))
    if policy == "fail" and reported:
        assert ra.status == failed, (
            f"kv_load_failure_policy=fail: request {ra.request_id} with a reported "
            f"load failure ended {ra.status.name}, expected FINISHED_ERROR")
    if ra.status != failed and w is not None:
        msg = w.verify_range(ra.request_id, 0, n)
        assert not msg, (f"store fault '{kind}': request {ra.request_id} finished "
                         f"with wrong KV: {msg}")
    assert rb.status != failed, (
        f"store fault '{kind}' of one request failed the other ({rb.request_id})")
    check_hit(rig, rb, full, f"store fault '{kind}', the undamaged request")
    check_every_load(rig, [ra, rb], f"store fault '{kind}'")
    finish(rig)
    return {"kind": kind, "policy": policy, "matched": ma, "full": full,
            "reported": reported, "failed": ra.status == failed, "at": when}


def fault_point(rig: Rig, request: Any) -> dict[str, Any]:
    """Where ``request`` stands with the connector, for a store fault injected now.

    Called between ``schedule()`` and the worker step (the driver's
    ``before_worker`` hook). A store fault belongs after the connector's lookup
    answered (the scheduler planned a load on the entries) and before the
    worker's load of them, wherever the connector's shape puts that load: a
    synchronous load in the step that schedules the request, an asynchronous one
    in the admission step or later (never at a fixed step).

    Args:
        rig: the rig.
        request: the request whose entries are to be damaged.

    Returns:
        ``{}`` while the connector has not answered a lookup for the request
        (not yet: inject later); else ``{"state": sentence, "done": bool}``:
        what the connector has done (matched N tokens, load asynchronous or
        not), and whether its load already completed (the worker verified the
        request's computed tokens or it was reported in ``finished_recving``),
        in which case the fault cannot be judged.

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


def volume(make_rig: MakeRig, profile: Any, num_prompts: int, seed: int,
           batch: int = 32) -> dict[str, Any]:
    """6. A seeded stress: at least ``num_prompts`` stores and loads, mixed lengths.

    Prompts of 1 to 4 chunks plus a random tail (seeded), ``batch`` per step,
    until both counts reach ``num_prompts`` (a replay the rule gives 0 loads
    nothing):
    1. store a batch; 2. drop the local cache and zero the KV; 3. replay the batch:
    every replay hits the rule and (real worker) loads bit-identical KV. A fault
    of one in a few hundred operations shows.

    Returns:
        counts, seconds, stores/s and loads/s.

    """
    rng = random.Random(seed)
    b = BLOCK_SIZE
    c = chunk_tokens(profile, b)
    max_len = 4 * c + b
    rig = make_rig(block_size=b, num_blocks=batch * (-(-max_len // b) + 1) + 8,
                   max_num_seqs=batch)
    stores = loads = hits_total = 0
    t_store = t_load = 0.0
    while stores < num_prompts or loads < num_prompts:
        if stores >= 2 * num_prompts:
            break  # the premise check below reports it
        lens = [prompt_len(profile, b, rng.randint(1, 4), rng.randint(1, b))
                for _ in range(batch)]
        stored = [rig.request(n) for n in lens]
        t0 = time.perf_counter()
        rig.driver.run(*stored)                                     # 1
        t_store += time.perf_counter() - t0
        stores += len(stored)
        _cold(rig)                                                  # 2
        replays = [_replay(rig, s) for s in stored]
        t0 = time.perf_counter()
        rig.driver.run(*replays)                                    # 3
        t_load += time.perf_counter() - t0
        for r in replays:
            _, m = check_hit(rig, r, rule_hit(profile, r.num_prompt_tokens, b),
                             f"volume (seed {seed})")
            hits_total += m
        loads += check_every_load(rig, replays, f"volume (seed {seed})")
        rig.forget_local_cache()
    assert loads >= num_prompts, (
        f"scenario did not happen: only {loads} of {stores} replays loaded "
        f"(wanted {num_prompts})")
    finish(rig)
    return {"stores": stores, "loads": loads, "hit_tokens": hits_total,
            "store_s": round(t_store, 2), "load_s": round(t_load, 2),
            "stores_per_s": round(stores / max(t_store, 1e-9), 1),
            "loads_per_s": round(loads / max(t_load, 1e-9), 1)}


def tenant_isolation(make_rig: MakeRig, profile: Any) -> dict[str, Any]:
    """7. The same tokens under another cache_salt or LoRA adapter match nothing.

    vLLM mixes ``cache_salt`` into the first block's hash and the LoRA adapter's
    name into every block's (``vllm/v1/core/kv_cache_utils.py``
    ``generate_block_hash_extra_keys``); a connector must key its store the same
    way, or one tenant reads another's KV.

    1. store a prompt (no salt, no adapter); drop the local cache;
    2. replay it with ``cache_salt="tvc-tenant-b"``, then with a LoRA adapter:
       both match 0 external tokens;
    3. replay it plain: the rule's hit (the store does hold it).
    """
    from vllm.lora.request import LoRARequest

    rig = make_rig(block_size=BLOCK_SIZE)
    b = rig.block_size
    n = prompt_len(profile, b, 2, b // 2 + 1)
    stored = _store(rig, n)                                         # 1
    seen = {}
    for label, kw in (("cache_salt", {"cache_salt": "tvc-tenant-b"}),
                      ("LoRA adapter", {"lora_request": LoRARequest(
                          "tvc-adapter-b", 1, "/nonexistent/tvc-adapter-b")})):
        _cold(rig)
        r = _replay(rig, stored, **kw)
        rig.driver.run(r)                                           # 2
        _, m, _ = external_hit(rig.driver, r)
        seen[label] = m
        assert m == 0, (
            f"tenant isolation: the same {n} tokens under another {label} matched "
            f"{m} external tokens, expected 0: the connector ignores {label} when "
            "keying its store, so one tenant (or adapter) reads another's KV. Key "
            "entries by vLLM's block hashes (they include cache_salt and the LoRA "
            "name) or mix them in")
    _cold(rig)
    plain = _replay(rig, stored)
    rig.driver.run(plain)                                           # 3
    _, m = check_hit(rig, plain, rule_hit(profile, n, b), "tenant isolation")
    assert m > 0, ("scenario did not happen: the plain replay matched nothing, so "
                   "the 0 hits above prove nothing")
    check_every_load(rig, [plain], "tenant isolation")
    finish(rig)
    return {"hits": seen, "plain": m}


def granularity(make_rig: MakeRig, profile: Any) -> dict[str, Any]:
    """8. Prompts at chunk boundaries: 1 to 3 chunks, -1 / +0 / +1 / +B/2 tokens.

    Each prompt is stored and replayed from an empty local cache; the hit must
    equal the rule, and at least one hit must be non-zero.
    """
    rig = make_rig(block_size=BLOCK_SIZE)
    b, c = rig.block_size, chunk_tokens(profile, rig.block_size)
    lengths = sorted({k * c + d for k in (1, 2, 3) for d in (-1, 0, 1, b // 2)
                      if k * c + d >= c})
    require_hits(profile, lengths, b, rig.vllm_config.model_config.max_model_len)
    seen = {}
    for n in lengths:
        stored = _store(rig, n)
        _cold(rig)
        replay = _replay(rig, stored)
        rig.driver.run(replay)
        expected = rule_hit(profile, n, b)
        _, m, _ = external_hit(rig.driver, replay)
        seen[n] = m
        if expected and m == 0:
            raise AssertionError(
                f"granularity: a stored {n}-token prompt ({n // c} whole chunk(s) of "
                f"{c} tokens + {n % c}) matched 0 on replay, the hit_rule expects "
                f"{expected}: the connector stores nothing for it")
        if expected is not None:
            assert_hit_matches_rule(m, expected, n, b, *hit_rule_of(profile))
        check_every_load(rig, [replay], f"granularity ({n} tokens)")
    assert any(seen.values()), f"vacuous: no prompt of {lengths} hit"
    finish(rig)
    return {"chunk": c, "hits": seen}


def chunked_prefill(make_rig: MakeRig, profile: Any) -> dict[str, Any]:
    """9. A prompt longer than ``max_num_batched_tokens``, prefilled over steps.

    1. store a prompt of 4 chunks + a tail with a step budget of about one chunk
       (vLLM schedules it over several steps);
    2. drop the local cache; replay it (same budget): the whole prompt must have
       been stored, the replay hits the rule with bit-identical KV.
    """
    b = BLOCK_SIZE
    c = chunk_tokens(profile, b)
    n = prompt_len(profile, b, 4, b // 2 + 1)
    budget = max(c, 2 * b)
    rig = make_rig(block_size=b, max_num_batched_tokens=budget, max_num_seqs=4)
    first = rig.request(n)
    rig.driver.run(first)                                           # 1
    steps = sum(1 for s in rig.driver.history
                if first.request_id in s.scheduled
                and s.scheduled[first.request_id] > 1)
    assert steps >= 2, (f"scenario did not happen: the {n}-token prompt was "
                        f"prefilled in {steps} step(s) with a budget of {budget}")
    _cold(rig)
    replay = _replay(rig, first)
    rig.driver.run(replay)                                          # 2
    expected = rule_hit(profile, n, b)
    _, m = check_hit(rig, replay, expected, f"chunked prefill ({steps} steps)")
    check_every_load(rig, [replay], f"chunked prefill ({steps} prefill steps)")
    finish(rig)
    return {"prompt_len": n, "budget": budget, "prefill_steps": steps,
            "matched": m}


def resumed_prefill(make_rig: MakeRig, profile: Any) -> dict[str, Any]:
    """10. A chunked prefill preempted midway and resumed on other blocks, twice.

    vLLM preempts the last running request when a running one cannot get a
    block (``Scheduler.schedule``: ``preempted_req = self.running.pop()``),
    frees its blocks and zeroes its ``num_computed_tokens``
    (``_preempt_request``), and resumes it later with a whole new block table
    (``CachedRequestData.resumed_req_ids``: its ``new_block_ids`` replace the
    old ones) from its local prefix-cache hit and the connector's new answer
    (``vllm/v1/core/sched/scheduler.py``, 0.28 and 0.33). A connector that
    keeps per-request state across that (a block table appended to, a count of
    computed tokens) saves from blocks the request no longer has, or tokens not
    computed yet.

    1. D1 and D2 (``B - 2`` tokens: one block each) prefill in one step and
       decode; a step budget of ``2 B + 8`` tokens ends every prefill chunk off
       a block boundary;
    2. a long prompt L (7 chunks + ``B / 2 + 1``) arrives; the pool holds L's
       prompt and what D2 holds when D1 ends: while both D's grow, L cannot
       finish its prefill and vLLM preempts it midway; D1 ends, L resumes on
       other block ids (D1's, its own taken by the D's) with no block to
       spare, and the next block L or D2 needs preempts it again;
    3. every load on a re-admission is verified as it happens (the worker), and
       every block the connector read for a save after a resumption is verified
       by the replay: drop vLLM's prefix cache, replay L: the rule's hit,
       bit-identical loads; nothing leaks.

    Returns:
        L's length, the budget, its preemptions (with the tokens it had computed
        before each), its block tables before and after the first one, and the
        replay's hit.

    """
    b = BLOCK_SIZE
    n = prompt_len(profile, b, 7, b // 2 + 1)
    # L's share of a step is 2B + 6 tokens (B + 6 mod B): its chunks end off
    # block boundaries, and after a preemption at 2 such chunks a count that
    # was not reset runs B - 4 tokens ahead across a chunk boundary
    budget = 2 * b + 8
    d_len = b - 2  # D1, D2 cross into their second block in L's third step
    steps = -(-n // (budget - 2))  # L's prefill steps beside two decodes
    # null block + L's prompt + D2's blocks when D1 ends (steps + 2 tokens
    # on): L resumes exactly then, and any growth preempts it again; before,
    # D1 and D2 hold more, so L cannot finish its prefill
    pool = 1 + -(-n // b) + -(-(d_len + steps + 3) // b)
    rig = make_rig(block_size=b, num_blocks=pool, max_num_batched_tokens=budget,
                   max_num_seqs=4)
    sched, d = rig.scheduler, rig.driver
    # D1 ends soon after L's prefill would have (L resumes on its blocks);
    # D2 decodes on, crossing into a new block every B steps
    d1 = rig.request(d_len, max_tokens=steps + 2)
    d2 = rig.request(d_len, max_tokens=steps + 3 * b)
    d.add(d1, d2)                                                    # 1
    # a connector may answer None ("ask again later", KVConnectorBase_V1.
    # get_num_new_matched_tokens): vLLM then admits the request in a later step
    for _ in range(DEFERRED_LOOKUP_STEPS):
        d.step()
        if d1.num_output_tokens or d2.num_output_tokens:
            break
    assert d1.num_output_tokens and d2.num_output_tokens, (
        f"scenario did not happen: D1 and D2 ({d_len} tokens each) did not "
        f"prefill together in one step of {budget} tokens (within "
        f"{DEFERRED_LOOKUP_STEPS} steps; get_num_new_matched_tokens answers: "
        f"{d.matched.get(d1.request_id)}, {d.matched.get(d2.request_id)})")
    long = rig.request(n, max_tokens=2 * b)
    d.add(long)                                                      # 2
    rid = long.request_id
    before: list[int] = []  # tokens computed at the step before each preemption
    tables: list[list[int]] = []  # L's table before its first preemption, after
    off_boundary = 0
    computed = 0
    table: list[int] = []
    for _ in range(d.max_steps):
        if not sched.requests:
            break
        so = d.step()
        if long.num_preemptions > len(before):
            before.append(computed)
            if len(tables) == 0:
                tables.append(table)
        got = so.num_scheduled_tokens.get(rid, 0)
        if got > 1 and long.num_computed_tokens % b:
            off_boundary += 1
        if rid in sched.requests and long.status.name == "RUNNING":
            table = list(sched.kv_cache_manager.get_block_ids(rid)[0])
            if len(tables) == 1 and long.num_preemptions:
                tables.append(table)
        computed = long.num_computed_tokens
    d.run_until_idle()
    mid = [c for c in before if c < n]
    assert mid, (
        f"scenario did not happen: the {n}-token prompt was not preempted before "
        f"its prefill ended (preemptions after {before} computed tokens; pool "
        f"{pool} blocks, budget {budget})")
    assert len(before) >= 2, (
        f"scenario did not happen: the {n}-token prompt was preempted "
        f"{len(before)} time(s), expected at least 2 (pool {pool} blocks)")
    assert off_boundary, (
        f"scenario did not happen: no prefill chunk of the {n}-token prompt ended "
        f"off a block boundary (budget {budget})")
    assert len(tables) == 2 and tables[0] != tables[1][:len(tables[0])], (
        "scenario did not happen: the prompt resumed on the block ids it had "
        f"before its preemption ({tables}): nothing else took its freed blocks")
    _cold(rig)                                                        # 3
    replay = _replay(rig, long)
    rig.driver.run(replay)
    _, m = check_hit(rig, replay, rule_hit(profile, n, b),
                     f"resumed prefill ({len(before)} preemptions)")
    assert m > 0, (
        f"scenario did not happen: the replay of the {n}-token prompt matched "
        "nothing, so no saved block was checked")
    try:
        check_every_load(rig, [long, replay],
                         f"resumed prefill ({len(before)} preemptions, computed "
                         f"{before} before each)")
        finish(rig)
    except AssertionError as exc:
        from tvc.contract.freed import RESUME_FIX

        own = "another block of its own table" in str(exc)
        raise AssertionError(
            f"{exc} — request {rid} was preempted after computing {before} tokens "
            f"and resumed on other block ids (table {tables[0]} -> {tables[1]})"
            + (": the connector saved or loaded a chunk through the block table the "
               "request had before its preemption (block table appended to, or "
               f"kept; build_connector_meta / update_state_after_alloc). Fix: "
               f"{RESUME_FIX}" if own else "")) from exc
    return {"prompt_len": n, "budget": budget, "pool": pool,
            "preempted_after": before, "tables": tables, "matched": m}


#: slack of the write-volume bound over the KV bytes vLLM asked to store: a file
#: format's header, digests and alignment (safetensors: an 8-byte length and a
#: JSON header per file; the panel: a SHA-256 per block in it)
WRITE_SLACK = 0.5
#: bytes a request may write beyond its blocks' KV: metadata files (an index,
#: a manifest), whatever the KV size
WRITE_META_BYTES = 64 * 1024
#: entries (files) a request may write beyond one per block and layer
WRITE_META_ENTRIES = 2


def kv_bytes_per_block(rig: Rig) -> int:
    """Bytes of one KV block over every layer (``KVCacheSpec.page_size_bytes``).

    Args:
        rig: the rig (its ``kv_cache_config``: one group per attention kind).

    Returns:
        the sum over the KV cache groups of ``page_size_bytes`` times the
        group's layers: what one block of one request holds in vLLM's cache.

    """
    return sum(int(g.kv_cache_spec.page_size_bytes) * len(g.layer_names)
               for g in rig.kv_cache_config.kv_cache_groups)


def write_volume(make_rig: MakeRig, profile: Any,
                 injector_factory: Callable[[Rig], Any]) -> dict[str, Any]:
    """11. What a connector writes per request is bounded by what vLLM asked.

    vLLM hands a connector the blocks of a request to store: the blocks of its
    prompt (``build_connector_meta`` sees them scheduled, ``request_finished``
    gets the block ids of its computed tokens, ``vllm/v1/core/sched/
    scheduler.py`` ``_connector_finished``), and the blocks of its output for a
    connector that stores decoded tokens too (``connector.stores_decode``). A
    connector that stores more (every chunk again at every step, each decode
    step's whole sequence, several copies of an entry) fills its store many
    times faster than it needs to, and evicts what it could serve.

    The bound, per request, in KV bytes: ``blocks * kv_bytes_per_block * (1 +
    WRITE_SLACK) + WRITE_META_BYTES`` and ``blocks * layers +
    WRITE_META_ENTRIES`` files, where ``blocks`` is ``ceil(prompt / B)`` (a
    partial last block may be stored too), ``ceil((prompt + output) / B)``
    with ``stores_decode``. Checked cumulatively after each request (a write
    that lands after its request ended counts against the next one's bound
    too, never twice).

    1. three prompts (1 chunk + B/2, 2 chunks + 1, 4 chunks + B/2 + 1 tokens)
       with ``2 B`` output tokens each, one after the other;
    2. after each, the files under the connector's store folder written or
       changed since the start (:class:`tvc.contract.faults.FileStoreInjector`)
       stay within the sum of the bounds so far.

    Returns:
        bytes and entries written per request, the bounds, KV bytes per block.

    Raises:
        NotApplicable: the connector's store is not files under a folder of
            its ``kv_connector_extra_config`` (nothing to measure).

    """
    from tvc.contract.faults import FileStoreInjector

    rig = make_rig(block_size=BLOCK_SIZE)
    inj = injector_factory(rig)
    if not isinstance(inj, FileStoreInjector):
        raise NotApplicable(
            "the connector's store is no folder of files named in its "
            f"kv_connector_extra_config ({type(inj).__name__}): the bytes it "
            "writes cannot be measured here")
    b, c = rig.block_size, chunk_tokens(profile, rig.block_size)
    per_block = kv_bytes_per_block(rig)
    layers = sum(len(g.layer_names) for g in rig.kv_cache_config.kv_cache_groups)
    decode = bool(profile["connector"]["stores_decode"])
    out_tokens = 2 * b
    start = inj.mark()
    bound_bytes = bound_entries = 0
    rows = []
    for chunks, tail in ((1, b // 2), (2, 1), (4, b // 2 + 1)):
        n = prompt_len(profile, b, chunks, tail)
        r = _store(rig, n, max_tokens=out_tokens)                   # 1
        blocks = -(-(n + (out_tokens if decode else 0)) // b)
        bound_bytes += int(blocks * per_block * (1 + WRITE_SLACK)) + WRITE_META_BYTES
        bound_entries += blocks * layers + WRITE_META_ENTRIES
        files = inj.entries_since(start)                             # 2
        written = sum(p.stat().st_size for p in files if p.exists())
        rows.append({"request": r.request_id, "prompt": n, "blocks": blocks,
                     "bytes": written, "entries": len(files)})
        what = (f"{len(rows)} request(s) ({', '.join(str(x['prompt']) for x in rows)}"
                f"-token prompts, {out_tokens} output tokens each)")
        assert written <= bound_bytes and len(files) <= bound_entries, (
            f"write volume: after {what} the connector has written {written:,} "
            f"bytes in {len(files)} entries under {inj.root}, more than vLLM asked "
            f"it to store: at most {bound_bytes:,} bytes and {bound_entries} "
            f"entries — {sum(x['blocks'] for x in rows)} blocks of "
            f"{per_block:,} KV bytes ({'prompt and output' if decode else 'the prompt'}"
            f"'s blocks; connector.stores_decode = {str(decode).lower()}) "
            f"x {1 + WRITE_SLACK:g} + {WRITE_META_BYTES:,} bytes and "
            f"{WRITE_META_ENTRIES} entries of metadata per request. The connector "
            "stores more than it is asked (each chunk again at every step, the "
            "output's tokens, several entries per block): store each block vLLM "
            "hands over once (build_connector_meta / save_kv_layer / "
            "wait_for_save)")
    assert rows[-1]["bytes"] > 0, (
        f"scenario did not happen: the connector wrote nothing under {inj.root} "
        f"for {len(rows)} stored prompts")
    _cold(rig)
    replay = _replay(rig, r)
    rig.driver.run(replay)
    check_hit(rig, replay, rule_hit(profile, replay.num_prompt_tokens, b),
              "write volume (the store holds what it was asked)")
    check_every_load(rig, [replay], "write volume")
    finish(rig)
    return {"kv_bytes_per_block": per_block, "chunk": c, "requests": rows,
            "bound_bytes": bound_bytes, "bound_entries": bound_entries}


# ------------------------------------------------- connector API paths vLLM drives
IDLE_STEPS = 4  # EngineDriver.run_until_idle's empty steps after the last request


def _stored_then_served(profile: Any, rig: Rig) -> tuple[Any, Any, int]:
    """Store a prompt, drop vLLM's local cache, replay it: (stored, replay, hit).

    Raises:
        AssertionError: ``scenario did not happen``: the replay got no external
            hit (nothing would have been stored, loaded or reported).

    """
    n = scenario_lengths(profile, rig.block_size)["single"]
    stored = _store(rig, n)
    _cold(rig)
    replay = _replay(rig, stored)
    rig.driver.run(replay)
    _local, hit, _ = external_hit(rig.driver, replay)
    assert hit > 0, (
        f"scenario did not happen: the replay of a stored {n}-token prompt got no "
        "external hit, so no store, load, stat or event was exercised")
    return stored, replay, hit


def overrides(rig: Rig, *names: str) -> list[str]:
    """Which of ``names`` (``KVConnectorBase_V1`` methods) the connector overrides.

    Either side's connector class counts (they are the same class).
    """
    from tvc.contract.coverage import overridden

    mine = overridden(type(rig.scheduler.connector))
    return [n for n in names if f"api:KVConnectorBase_V1.{n}" in mine]


def stats_per_interval(make_rig: MakeRig, profile: Any) -> dict[str, Any]:
    """``get_kv_connector_stats`` as vLLM uses it, over a store and a load.

    1. store a prompt, drop vLLM's local cache, replay it (an external hit);
       vLLM's scheduler asks the scheduler side for stats in every
       ``update_from_output`` and the worker harness asks the worker side in
       every step, as the model runner does;
    2. :func:`tvc.contract.api_checks.check_stats` on every answer: the type
       vLLM needs, pickling, ``reduce``, ``build_kv_connector_stats`` and
       ``aggregate`` as vLLM's logger uses them, and empty answers in the idle
       steps after the last transfer;
    3. where the connector overrides ``build_prom_metrics``: vLLM's
       ``KVConnectorProm`` builds its metrics and observes a non-empty interval
       (:func:`tvc.contract.api_checks.check_prom_metrics`).

    Raises:
        NotApplicable: the connector keeps vLLM's default (no stats).

    """
    from tvc.contract.api_checks import check_prom_metrics, check_stats

    rig = make_rig(block_size=BLOCK_SIZE)
    if not overrides(rig, "get_kv_connector_stats"):
        raise NotApplicable(
            "the connector keeps KVConnectorBase_V1.get_kv_connector_stats "
            "(no stats): nothing to check")
    _stored, _replay_req, hit = _stored_then_served(profile, rig)
    log = rig.driver.coverage
    cls = type(rig.scheduler.connector)
    checked = check_stats(log, cls, idle_steps=IDLE_STEPS)
    busy = [o for _side, _s, o in log.stats if o is not None and not o.is_empty()]
    samples = check_prom_metrics(cls, rig.vllm_config, busy[0], log) if (
        busy and overrides(rig, "build_prom_metrics")) else 0
    finish(rig)
    return {"hit_tokens": hit, "answers": len(log.stats),
            "non_empty_checked": checked, "prom_samples": samples}


def kv_cache_events(make_rig: MakeRig, profile: Any) -> dict[str, Any]:
    """KV cache events (``take_events``, worker events) against what was stored.

    1. a rig with vLLM's KV cache events on (``--kv-events-config`` with
       ``enable_kv_cache_events``); store a prompt, then a prompt that extends
       it by two chunks (its first new block's parent is the first prompt's
       last block), then another; drop vLLM's local cache, replay the
       extended one (an external hit);
    2. :func:`tvc.contract.api_checks.check_events`: every ``BlockStored``
       names blocks these requests computed, in the form vLLM publishes, with
       their tokens, as a piece of vLLM's hash chain hung on an announced
       parent; ``BlockRemoved`` only stored blocks; every block the hit served
       was announced.

    Raises:
        NotApplicable: the connector keeps vLLM's default (no events).

    """
    from tvc.contract.api_checks import check_events

    rig = make_rig(block_size=BLOCK_SIZE, kv_events=True)
    names = overrides(rig, "take_events", "get_kv_connector_kv_cache_events")
    if not names:
        raise NotApplicable(
            "the connector keeps KVConnectorBase_V1.take_events and "
            "get_kv_connector_kv_cache_events (no KV cache events): nothing to "
            "check")
    n = scenario_lengths(profile, rig.block_size)["single"]
    first = _store(rig, n)
    c = chunk_tokens(profile, rig.block_size)
    longer = _store(rig, n + 2 * c, shared_prefix=first.prompt_token_ids)
    _store(rig, n)
    _cold(rig)
    replay = _replay(rig, longer)
    rig.driver.run(replay)
    _local, hit, _ = external_hit(rig.driver, replay)
    assert hit > n - c, (
        f"scenario did not happen: the replay of a stored {n + 2 * c}-token prompt "
        f"(extending a stored {n}-token one) matched {hit} tokens, not beyond the "
        "shorter prompt, so no extended chain was served")
    emitted = sum(len(evs) for _side, _step, evs in rig.driver.coverage.events)
    if not emitted:
        # an emitter that misses a block still gets every check below
        raise NotApplicable(
            f"the connector overrides {', '.join(names)} but emitted no KV cache "
            f"event in the whole scenario ({len(rig.driver.added)} requests, "
            f"a {hit}-token hit served) with vLLM's KV cache events on: its own "
            "events are off (e.g. LMCache's enable_kv_events: false), so it is not "
            "an event emitter here and there is nothing to check. Turn its events "
            "on in connector.extra_config to check them")
    counts = check_events(rig.driver.coverage, rig.driver.added, rig.block_size,
                          {replay.request_id: hit})
    assert counts["stored"] > 0, (
        f"the connector overrides {', '.join(names)} and vLLM's KV cache events "
        f"are on, but it announced no stored block after storing "
        f"{len(rig.driver.added)} prompts and serving a {hit}-token hit")
    finish(rig)
    return {"hit_tokens": hit, **counts}


def reset_cache_misses(make_rig: MakeRig, profile: Any) -> dict[str, Any]:
    """``reset_prefix_cache(reset_connector=True)``: the store is empty after.

    1. store a prompt (an external hit on replay proves it is stored);
    2. ``Scheduler.reset_prefix_cache(reset_connector=True)``, which calls the
       connector's ``reset_cache`` (True: reset done, False: refused);
    3. replay the prompt again: after a reset that succeeded it is a miss.

    Raises:
        NotApplicable: the connector keeps vLLM's default ``reset_cache``
            (returns None: "not implemented"), or refused (False) the reset.

    """
    rig = make_rig(block_size=BLOCK_SIZE)
    if not overrides(rig, "reset_cache"):
        raise NotApplicable(
            "the connector keeps KVConnectorBase_V1.reset_cache (no connector "
            "reset): nothing to check")
    stored, _replay_req, hit = _stored_then_served(profile, rig)
    w = real_worker(rig)
    ok = rig.scheduler.reset_prefix_cache(reset_connector=True)
    if not ok:
        raise NotApplicable(
            "vLLM's reset_prefix_cache(reset_connector=True) returned False (the "
            "connector refused the reset): nothing was reset")
    if w is not None:
        w.zero()
    again = _replay(rig, stored)
    rig.driver.run(again)
    _local, after, _ = external_hit(rig.driver, again)
    assert after == 0, (
        f"reset_cache returned success, but the replay of the stored "
        f"{stored.num_prompt_tokens}-token prompt still got an external hit of "
        f"{after} tokens (before the reset: {hit}): the connector's cache was not "
        "reset")
    rig.driver.coverage.hit("api:KVConnectorBase_V1.reset_cache",
                            f"hit {hit} -> {after}")
    finish(rig)
    return {"hit_before": hit, "hit_after": after}


#: Model B of :func:`another_model_on_one_store`, as ``make_rig`` arguments over
#: model A (the tiny Llama: 2 KV heads, head size 64, float16, KV cache ``auto``),
#: with what differs, what a key that ignores it ignores, and the coverage entry.
#: ``dtype`` and ``cache_dtype`` keep the same checkpoint (``ModelConfig.model``)
#: and the same KV shape: only the bytes differ, so a store that keys by the
#: model and the shape alone serves them (a raw-byte store loads them as they are).
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


def multimodal_items(make_rig: MakeRig, profile: Any) -> dict[str, Any]:
    """Multimodal items: a hit never serves one image's KV for another's.

    A multimodal prompt holds one placeholder token per position of an item
    (an image), and the KV there comes from the item's embedding. vLLM mixes
    each item's hash (``MultiModalFeatureSpec.identifier``) into the hash of
    every block its placeholder overlaps
    (``kv_cache_utils.generate_block_hash_extra_keys``); a connector keyed by
    the token ids alone serves image A's KV to a prompt with image B. The
    worker harness gives placeholder positions the KV of their item
    (:func:`tvc.contract.worker.content_tokens`), so such a load differs.

    1. store a prompt of two chunks of text, image A's placeholder (one chunk
       long, from the middle of a block) and text after it;
    2. drop vLLM's local cache; replay it with image A: the hit reaches past
       the placeholder (premise) and the load is bit-identical;
    3. drop it again; replay the same tokens with image B: no block that
       overlaps the placeholder is served (``local + matched`` at most the
       placeholder's offset rounded down to a block), every load bit-identical.

    Returns:
        ``hit_a``, ``hit_b`` (tokens), ``placeholder`` ``[offset, end)``.

    Raises:
        NotApplicable: the replay with image A was not served past the
            placeholder (the connector does not serve multimodal prompts).

    """
    import uuid

    from tvc.contract.builders import prompt_tokens

    rig = make_rig(block_size=BLOCK_SIZE)
    b, c = rig.block_size, chunk_tokens(profile, rig.block_size)
    total = prompt_len(profile, b, 4, b // 2 + 1)
    offset, length = 2 * c + b // 2, c
    nonce = uuid.uuid4().hex[:8]
    toks = prompt_tokens(offset, hash(nonce) % 10_000) + (
        [PLACEHOLDER_TOKEN_ID] * length) + prompt_tokens(
            total - offset - length + 1, 1 + hash(nonce) % 10_000)[1:]
    image_a, image_b = f"tvc-image-a-{nonce}", f"tvc-image-b-{nonce}"

    def with_image(ident: str) -> Any:
        return rig.request(total, shared_prefix=toks,
                           media=[(offset, length, ident)])

    rig.driver.run(with_image(image_a))                              # 1
    _cold(rig)
    again = with_image(image_a)
    rig.driver.run(again)                                            # 2
    local_a, hit_a, _ = external_hit(rig.driver, again)
    if local_a + hit_a <= offset + length:
        raise NotApplicable(
            f"the replay of a stored {total}-token prompt with image A at "
            f"[{offset}, {offset + length}) matched {hit_a} tokens ({local_a} "
            "local): the connector does not serve a multimodal prompt past its "
            "image, so there is no other image's KV it could serve")
    check_every_load(rig, [again], "multimodal, the same image")
    _cold(rig)
    other = with_image(image_b)
    rig.driver.run(other)                                            # 3
    local_b, hit_b, _ = external_hit(rig.driver, other)
    bound = offset // b * b
    assert local_b + hit_b <= bound, (
        f"multimodal items: a {total}-token prompt stored with image A (placeholder "
        f"tokens [{offset}, {offset + length})) was served {hit_b} tokens "
        f"({local_b} local) for the same tokens with image B: blocks past token "
        f"{bound} hold image A's KV. The connector's keys ignore the item's hash "
        "(Request.mm_features identifier, which vLLM mixes into the hash of every "
        "block the placeholder overlaps): key by vLLM's block hashes or add the "
        "mm hashes")
    check_every_load(rig, [other], "multimodal, another image")
    finish(rig)
    return {"hit_a": hit_a, "hit_b": hit_b, "placeholder": [offset, offset + length]}


#: vLLM's block hash functions besides the default ``sha256``
#: (``PrefixCachingHashAlgo``, ``vllm/config/cache.py``;
#: ``vllm/utils/hashing.py`` ``get_hash_fn_by_name``): the ``xxhash`` ones need
#: the optional ``xxhash`` package.
HASH_ALGOS = ("sha256_cbor", "xxhash", "xxhash_cbor")


def block_hash_algorithm(make_rig: MakeRig, profile: Any, algo: str
                         ) -> dict[str, Any]:
    """The hit rule and exact loads under another block hash function.

    ``--prefix-caching-hash-algo`` changes every ``Request.block_hashes`` value
    (``EngineCore`` builds the request block hasher from
    ``CacheConfig.prefix_caching_hash_algo``) and their width (sha256: 32 bytes,
    xxhash: 16). A connector whose keys assume one function (its own sha256 of
    the tokens compared with vLLM's hashes, a fixed digest width, a parsed
    digest) misses, or mismatches, under another. Runs
    :func:`shared_prefixes` (three stored prompts sharing two chunks, replayed
    in one step: each hit equals the rule, each load is bit-identical) on rigs
    whose requests hash with ``algo``.

    Raises:
        NotApplicable: ``algo`` needs a package this Python lacks.

    """
    import functools

    from vllm.utils.hashing import get_hash_fn_by_name

    try:
        get_hash_fn_by_name(algo)(b"probe")
    except ModuleNotFoundError as exc:
        pkg = exc.name or algo.split("_")[0]
        raise NotApplicable(
            f"prefix_caching_hash_algo={algo} needs the Python package {pkg!r}, "
            "an optional dependency of vLLM that this environment lacks. Fix: "
            f"pip install {pkg}") from None
    try:
        out = shared_prefixes(functools.partial(make_rig, hash_algo=algo), profile,
                              True)
    except AssertionError as exc:
        raise AssertionError(
            f"under --prefix-caching-hash-algo {algo} (vLLM hashes every "
            f"request's blocks with {algo}; the other contract tests run the "
            f"default sha256): {exc}. A connector whose keys assume sha256 (its "
            "own re-computation of vLLM's block hashes, a fixed digest width) "
            "misses or mismatches here: key by request.block_hashes as given, or "
            "hash the tokens itself on both sides") from exc
    return {"algo": algo, **out}


def _close_rig(rig: Rig) -> None:
    """Shut a rig's worker down (its KV tensors, vLLM's distributed state).

    The scheduler-side connector is left to the fixture's teardown; the next
    rig of the same test then builds its own worker.
    """
    closer = getattr(rig.worker, "close", None)
    if callable(closer):
        closer()


def another_model_on_one_store(make_rig: MakeRig, profile: Any, variant: str
                               ) -> dict[str, Any]:
    """One store, two models: a connector never serves one model's KV to another.

    vLLM's block hashes cover token ids and the request's extra keys (LoRA,
    cache salt, multimodal hashes), not the model (``vllm/v1/core/kv_cache_utils.py``
    ``hash_block_tokens``): a store shared by engines of different models (a
    disk, a daemon, LMCache's remote tier) must key its entries by what makes the
    KV differ (``ModelConfig.model``, the KV shape and dtype, the rank) itself.

    1. model A stores a prompt; a replay hits (premise);
    2. a new connector of model A on the same store hits too (premise: the store
       outlives a connector instance; an in-memory tier does not, nothing to check);
    3. a connector of model B (:data:`OTHER_MODEL` ``variant``) on the same store
       replays the prompt: a miss (0 matched tokens). Refusing to build for a
       store that holds another model's KV is a clean answer too.

    For :data:`SAME_KV` variants (another KV layout: the same values in
    another byte order) a hit is allowed when every load is bit-identical.

    Returns:
        ``hit_a``, ``hit_a_again``, ``hit_b`` (tokens), ``refused`` (the
        refusal's first line, or "") and, for :data:`SAME_KV` variants,
        ``same_kv_loads_exact`` (model B hit and loaded exactly its KV).

    Raises:
        NotApplicable: the store does not outlive the connector instance.

    """
    kw, what, ignored, entry = OTHER_MODEL[variant]
    a = make_rig(block_size=BLOCK_SIZE)
    stored, _replay_req, hit_a = _stored_then_served(profile, a)           # 1
    finish(a)
    _close_rig(a)
    a2 = make_rig(block_size=BLOCK_SIZE)
    again = _replay(a2, stored)
    a2.driver.run(again)                                                   # 2
    _local, hit_a2, _ = external_hit(a2.driver, again)
    finish(a2)
    _close_rig(a2)
    if hit_a2 == 0:
        raise NotApplicable(
            f"a new connector on the same store got no hit for a prompt the first "
            f"one stored ({hit_a} tokens then, 0 now): the store does not outlive a "
            "connector instance, so no second model can read it")
    try:
        b = make_rig(block_size=BLOCK_SIZE, **kw)
    except Exception as exc:  # noqa: BLE001 - a refusal is an answer; recorded
        line = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        return {"hit_a": hit_a, "hit_a_again": hit_a2, "hit_b": 0,
                "refused": f"{type(exc).__name__}: {line}"}
    model_b = b.vllm_config.model_config.model
    if variant in SAME_KV:
        wa, wb = real_worker(a), real_worker(b)
        if wa is None or wb is None:
            raise NotApplicable(
                f"{what}: a hit may be right (the same KV values), so only the "
                "loaded bytes can judge it, and no worker side runs on this device "
                f"(connector.worker_devices = "
                f"{profile['connector']['worker_devices']})")
        if wa.layout.kv_layout == wb.layout.kv_layout:
            raise NotApplicable(
                f"{what}: the connector's worker registered the {wb.layout.kv_layout} "
                "layout for both (it requires one: get_required_kvcache_layout), "
                "so no other byte order can reach it")
    replay_b = _replay(b, stored)
    crashed = ""
    try:
        b.driver.run(replay_b)                                             # 3
    except Exception as exc:  # noqa: BLE001 - named in the failure below
        first = (str(exc).splitlines() or [""])[0][:240]
        crashed = f" Loading it then raised {type(exc).__name__}: {first}"
    _local, hit_b, _ = external_hit(b.driver, replay_b)
    b.driver.coverage.hit(entry, f"{variant}: {hit_b} tokens matched for model B")
    if variant in SAME_KV and not crashed:
        w = real_worker(b)
        assert w is not None and not w.load_errors, (
            f"one store, two engines: an engine with {what} was served {hit_b} "
            f"tokens of a {stored.num_prompt_tokens}-token prompt the other engine "
            f"stored, and they are not its KV: {w.load_errors[0] if w else ''}. The "
            f"values are the same, so a hit is fine, but the connector's keys "
            f"ignore {ignored} and it copies raw block bytes: key entries by the "
            "layout too, or move KV through the tensors' logical shape")
        finish(b)
        return {"hit_a": hit_a, "hit_a_again": hit_a2, "hit_b": hit_b,
                "refused": "", "same_kv_loads_exact": hit_b > 0}
    assert hit_b == 0 and not crashed, (
        f"one store, two models: a connector for model B ({what}) answered {hit_b} "
        f"matched tokens for a {stored.num_prompt_tokens}-token prompt only model A "
        f"stored ({hit_a} tokens hit, {hit_a2} again after a restart): its keys "
        f"ignore {ignored}, so model B reads model A's KV. Key stored entries by "
        "what makes KV differ (ModelConfig.model, KV heads, head size, dtype, KV "
        f"cache dtype, rank), not by vLLM's block hash alone (model B: {model_b}, "
        f"dtype {b.vllm_config.model_config.dtype}, KV cache "
        f"{b.vllm_config.cache_config.cache_dtype}).{crashed}")
    finish(b)
    return {"hit_a": hit_a, "hit_a_again": hit_a2, "hit_b": hit_b, "refused": ""}


SKIP_READING = {
    "prompt_logprobs": {"prompt_logprobs": 1},
    "skip_reading_prefix_cache": {"skip_reading_prefix_cache": True},
}


def skip_reading_prefix_cache(make_rig: MakeRig, profile: Any, field: str
                              ) -> dict[str, Any]:
    """A request that must not read cached KV gets a miss from the connector.

    vLLM sets ``Request.skip_reading_prefix_cache`` for ``prompt_logprobs``
    (every prompt token's logits are needed, so none may come from a cache;
    ``SamplingParams.__post_init__``) or when asked directly; its own prefix
    cache then returns no hit (``KVCacheManager``), and the connector, asked
    anyway by the scheduler, must answer 0.

    1. store a prompt; drop vLLM's local cache; a plain replay hits (premise);
    2. replay it with ``field`` set: no token may count as computed when it
       first runs. (vLLM 0.33 zeroes the connector's answer itself in
       ``Scheduler.schedule``; 0.28 uses it, so there the connector must answer 0.)
    """
    rig = make_rig(block_size=BLOCK_SIZE)
    stored, _replay_req, hit = _stored_then_served(profile, rig)
    _cold(rig)
    req = _replay(rig, stored, sampling=SKIP_READING[field])
    assert req.skip_reading_prefix_cache, (
        f"vLLM did not set skip_reading_prefix_cache for {field}: the scenario "
        "cannot happen on this vLLM")
    rig.driver.run(req)
    local, matched, _ = external_hit(rig.driver, req)
    computed_before = rig.driver.first_compute[req.request_id][0]
    assert computed_before == 0, (
        f"a request with {field} (skip_reading_prefix_cache=True) started with "
        f"{computed_before} tokens counted as computed (the connector answered "
        f"{matched} external tokens, vLLM's local cache {local}) for a stored "
        f"{stored.num_prompt_tokens}-token prompt: the connector ignores "
        "Request.skip_reading_prefix_cache, so the request reads cached KV "
        f"(prompt logprobs for {computed_before} tokens are never computed)")
    rig.driver.coverage.hit(f"request:SamplingParams.{field}",
                            f"answer {matched}, read 0")
    finish(rig)
    return {"hit_plain": hit, "connector_answer": matched,
            "tokens_read_from_cache": computed_before, "field": field}


def kv_cache_layouts() -> set[str]:
    """The KV cache layout names the installed vLLM defines.

    ``KVCacheLayoutType`` (``Literal["NHD", "HND"]``,
    ``vllm/v1/attention/backends/utils.py``, 0.28) and the members of
    ``vllm.v1.kv_cache_layout.KVCacheLayout`` (0.33: ``LBHNC``...), where present.
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


def answers_vllm_reads(make_rig: MakeRig, profile: Any) -> dict[str, Any]:
    """The connector's answers to what vLLM reads outside a step, with values.

    ``role`` on each side is the role vLLM created it with; the classmethods
    ``get_required_kvcache_layout`` (a layout this vLLM defines) and
    ``requires_piecewise_for_cudagraph`` (a bool for the profile's extra
    config); the properties vLLM reads are bools; after a store and a served
    hit, ``has_pending_push_work`` is False (the engine may quiesce); on the
    worker side: ``get_finished_count`` is None or a positive int,
    ``has_connector_metadata`` follows bind/clear, and the handshake metadata
    is None or a ``KVConnectorHandshakeMetadata`` that pickles and that the
    scheduler side accepts as ``EngineCore`` hands it over
    (``set_xfer_handshake_metadata_pp_aware({(pp_rank, tp_rank): meta})``).
    """
    import pickle

    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorHandshakeMetadata,
        KVConnectorRole,
    )

    rig = make_rig(block_size=BLOCK_SIZE)
    log = rig.driver.coverage
    sched = rig.scheduler.connector
    cls = type(sched)
    assert sched.role == KVConnectorRole.SCHEDULER, (
        f"{cls.__name__}.role on the scheduler side is {sched.role!r}")
    log.hit("api:KVConnectorBase_V1.role", "scheduler")
    layout = cls.get_required_kvcache_layout(rig.vllm_config)
    accepted = kv_cache_layouts()
    assert layout is None or layout in accepted, (
        f"{cls.__name__}.get_required_kvcache_layout returned {layout!r}: this "
        f"vLLM knows None or {sorted(accepted)}")
    log.hit("api:KVConnectorBase_V1.get_required_kvcache_layout", str(layout))
    extra = dict(rig.vllm_config.kv_transfer_config.kv_connector_extra_config)
    piecewise = cls.requires_piecewise_for_cudagraph(extra)
    assert isinstance(piecewise, bool), (
        f"{cls.__name__}.requires_piecewise_for_cudagraph returned {piecewise!r}")
    log.hit("api:KVConnectorBase_V1.requires_piecewise_for_cudagraph",
            str(piecewise))
    for prop in ("requires_kv_delivery", "supports_divergent_local_hybrid_hits",
                 "prefer_cross_layer_blocks"):
        v = getattr(sched, prop, False)
        assert isinstance(v, bool), f"{cls.__name__}.{prop} is {v!r}, not a bool"
        log.hit(f"api:KVConnectorBase_V1.{prop}", str(v))
    _stored, _r, hit = _stored_then_served(profile, rig)
    push = sched.has_pending_push_work()
    assert push is False, (
        f"has_pending_push_work() is {push!r} after every request finished and "
        f"{IDLE_STEPS} idle steps: the engine would never quiesce")
    log.hit("api:KVConnectorBase_V1.has_pending_push_work", "after idle")
    out: dict[str, Any] = {"layout": layout, "piecewise": piecewise,
                           "hit_tokens": hit}
    w = real_worker(rig)
    if w is not None:
        wc = w.connector
        assert wc.role == KVConnectorRole.WORKER, (
            f"{cls.__name__}.role on the worker side is {wc.role!r}")
        count = wc.get_finished_count()
        assert count is None or (isinstance(count, int) and count > 0), (
            f"get_finished_count() returned {count!r}: KVOutputAggregator needs "
            "None or a positive int")
        log.hit("api:KVConnectorBase_V1.get_finished_count", str(count))
        if rig.driver.metas:
            wc.bind_connector_metadata(rig.driver.metas[-1])
            bound = wc.has_connector_metadata()
            wc.clear_connector_metadata()
            cleared = wc.has_connector_metadata()
            assert bound is True and cleared is False, (
                f"has_connector_metadata() is {bound!r} after bind and "
                f"{cleared!r} after clear")
            log.hit("api:KVConnectorBase_V1.has_connector_metadata", "bind/clear")
        meta = wc.get_handshake_metadata()
        assert meta is None or isinstance(meta, KVConnectorHandshakeMetadata), (
            f"get_handshake_metadata() returned {type(meta).__name__}, not None or "
            "KVConnectorHandshakeMetadata")
        log.hit("api:KVConnectorBase_V1.get_handshake_metadata",
                type(meta).__name__)
        if meta is not None:
            meta = pickle.loads(pickle.dumps(meta))
            sched.set_xfer_handshake_metadata_pp_aware({(0, 0): meta})
            log.hit("api:KVConnectorBase_V1.set_xfer_handshake_metadata_pp_aware",
                    "(0, 0)")
        out["finished_count"] = count
        out["handshake"] = type(meta).__name__
    finish(rig)
    return out
