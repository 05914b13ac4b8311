"""contract (scenarios): the engine scenarios where real connector faults live.

Each test is one scenario, written as vLLM's own connector tests are: numbered
steps (store, drop vLLM's local prefix cache, replay; schedule, forward,
update_from_output through an :class:`~tvc.contract.driver.EngineDriver`) that
drive vLLM's own V1 scheduler and the connector's worker side (real on CPU where
``connector.worker_devices`` lists ``cpu``, else the transfer-acknowledging
stand-in; the ``[cuda]`` variants run the real worker on a GPU), with the asserts
where the step happens. The shared steps and invariants (len - 1 bound, block
alignment, bit-identical KV for every loaded request, nothing else changed,
scheduler empty, every block free) are in :mod:`tvc.contract.steps`. A scenario
that did not happen (no hit, no preemption, no load in flight) fails: each test
asserts its premise.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from tvc.contract.driver import external_hit
from tvc.contract.invariants import (
    assert_hit_matches_rule,
    assert_untouched_outside,
    snapshot_kv,
)
from tvc.contract.steps import (
    BLOCK_SIZE,
    DEFERRED_LOOKUP_STEPS,
    WRITE_META_BYTES,
    WRITE_META_ENTRIES,
    WRITE_SLACK,
    check_every_load,
    check_hit,
    chunk_tokens,
    close_rig,
    cold,
    fault_point,
    finish,
    hit_rule_of,
    kv_bytes_per_block,
    prompt_len,
    real_worker,
    replay_of,
    require_hits,
    round_trip_len,
    rule_edge_lengths,
    rule_hit,
    shared_prefixes,
    store,
)

pytestmark = [pytest.mark.contract]


def test_local_prefix_cache_hit_then_external_hit(make_rig, contract_profile,
                                                  record_property) -> None:
    """The first k blocks in vLLM's local prefix cache, the rest in the store.

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
    b, c = rig.block_size, chunk_tokens(contract_profile, rig.block_size)
    k = next(k for k in range(1, c // b + 2) if c <= b or (k * b) % c)
    n = prompt_len(contract_profile, b, -(-k * b // c) + 2, b // 2 + 1)
    full = store(rig, n)  # 1
    cold(rig)
    head = rig.request(k * b + 1, shared_prefix=full.prompt_token_ids[:k * b])
    rig.driver.run(head)  # 2
    w = real_worker(rig)
    snap = snapshot_kv(w) if w else None
    replay = replay_of(rig, full)
    rig.driver.run(replay)  # 3
    local, matched, _ = external_hit(rig.driver, replay)
    assert local == k * b, (
        f"scenario did not happen: vLLM's local prefix cache held {local} tokens "
        f"of the replayed prompt, expected the {k * b} tokens (k={k} blocks) run "
        "just before")
    expected = rule_hit(contract_profile, n, b)
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
            if d is None:  # not shifted: missing or wrong, as msg says
                raise AssertionError(
                    f"local + external: the KV loaded for tokens [{local}, {end}) "
                    f"is wrong: {msg}")
            raise AssertionError(
                f"local + external: loaded KV of tokens [{local}, {end}) is not at "
                f"the right slots: {msg}; the loaded KV sits {d} tokens from its "
                f"slots (num_computed_tokens mod chunk = {local % c})")
        check_every_load(rig, [replay], "local + external")
        assert_untouched_outside(w, snap, w.block_table[rid], "local + external")  # type: ignore[arg-type]
    finish(rig)
    record_property("scenario", {
        "k_blocks": k, "chunk": c, "prompt_len": n, "local": local,
        "matched": matched})


@pytest.mark.parametrize("together", [True, False], ids=["one_step", "staggered"])
def test_shared_prefixes_every_load_bit_identical(make_rig, contract_profile,
                                                  together, record_property) -> None:
    """Three stored prompts sharing two chunks, replayed in one step or staggered.

    Every request that loads must get exactly its own KV, with several loads of
    one prefix in flight (:func:`tvc.contract.steps.shared_prefixes`).
    """
    out = shared_prefixes(make_rig, contract_profile, together)
    record_property("scenario", out)
    assert out["loads"] >= 2, out  # several loads of one prefix were in flight


def test_preemption_and_resume(make_rig, contract_profile, record_property) -> None:
    """A small KV pool and long decodes force preemption; re-admission is sane.

    1. store three prompts;
    2. drop vLLM's local cache; replay them with long decodes in a pool too small
       for all three (vLLM preempts one, frees its blocks, re-admits it later and
       asks the connector again with ``num_computed_tokens`` from its local
       prefix cache);
    3. every answer is checked when given (never negative, never beyond
       ``len - 1``); a resumed request's computed tokens are verified again.
    """
    b = BLOCK_SIZE
    n = prompt_len(contract_profile, b, 2, b // 2 + 1)
    decode_blocks = 4  # max_tokens = 4 * B below
    blocks_per_req = -(-n // b) + decode_blocks
    # room for two requests' prompts and decodes, not three (short prompts);
    # for long prompts (large chunks) that pool admits only two and never
    # preempts, so then: room for the three prompts (admitted together) and a
    # third of their decodes. Either way vLLM must preempt while they decode.
    prompt_blocks = -(-(n + 1) // b)
    rig = make_rig(block_size=b, num_blocks=max(
        2 * blocks_per_req + 2, 3 * prompt_blocks + decode_blocks + 1))
    stored = [store(rig, n) for _ in range(3)]  # 1
    cold(rig)
    replays = [replay_of(rig, s, max_tokens=4 * b) for s in stored]

    def readmission(request: Any, local: int, matched: int, _async: bool) -> None:
        # 3: what the store can hold beyond vLLM's local hit (the rule at the
        # prompt's and at the current length: decoded blocks may be stored too)
        if request.num_preemptions == 0:
            return
        totals = [rule_hit(contract_profile, m, b) for m in
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
    rig.driver.run(*replays)  # 2
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
    record_property("scenario", {
        "preempted": len(preempted), "readmission_answers": readmit,
        "loads": loads})


def test_freed_blocks_handed_to_the_next_request_at_once(
        make_rig, contract_profile, record_property) -> None:
    """A finished request's blocks go to the request queued behind it.

    vLLM may hand a block to another request the step after it freed it
    (``request_finished`` returned False); that request's forward overwrites
    it. A save still reading the blocks then stores another request's KV, unless
    the connector delays the free or finishes the save in ``handle_preemptions``
    (base.py: "evicted blocks BEFORE they are overwritten"; vLLM's
    OffloadingConnector: ``jobs_to_flush``).
    """
    b = BLOCK_SIZE
    n = round_trip_len(contract_profile, b)
    # 1. a pool for one request at a time (+1: vLLM's null block): B, queued
    #    behind A, is admitted once A's blocks are free (vLLM admits a request
    #    only when its whole sequence fits) and gets A's blocks
    rig = make_rig(block_size=b, num_blocks=-(-(n + 2) // b) + 1)
    w = real_worker(rig)
    if w is None:
        pytest.skip("no real worker side on this device: the KV in a reused "
                    "block cannot be read")
    first, second = rig.request(n), rig.request(n)
    rig.driver.run(first, second)
    reused = set(w.block_table[first.request_id]) & set(
        w.block_table[second.request_id])
    assert reused, ("scenario did not happen: the second request got none of "
                    f"the first one's blocks ({w.block_table})")
    # 2. replay the first prompt: its local cache went with its blocks, so the
    #    connector loads it; every loaded token must be the first request's KV
    replay = rig.request(n, shared_prefix=first.prompt_token_ids)
    rig.driver.run(replay)
    local, matched = check_hit(rig, replay, rule_hit(contract_profile, n, b),
                                 "replay after its blocks were reused")
    assert local == 0 and matched > 0, (
        f"scenario did not happen: the replay found {local} tokens in vLLM's "
        f"local prefix cache and matched {matched} external tokens of a stored "
        f"{n}-token prompt")
    check_every_load(rig, [replay], "replay after its blocks were reused")
    finish(rig)
    record_property("scenario", {"prompt_len": n, "reused_blocks": len(reused),
                                 "matched": matched,
                                 "is_async": external_hit(rig.driver, replay)[2]})


# the request's vLLM RequestStatus when it is aborted, per parameter
ABORTED_WHILE = {"waiting_for_remote_kv": "WAITING_FOR_REMOTE_KVS",
                 "running": "RUNNING", "queued": "WAITING"}


@pytest.mark.parametrize("when", list(ABORTED_WHILE))
def test_abort_leaves_nothing_behind(make_rig, contract_profile, when,
                                     record_property) -> None:
    """Abort a request while it waits for remote KV, while it runs, or queued.

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
    n = prompt_len(contract_profile, rig.block_size, 2, rig.block_size // 2 + 1)
    stored = store(rig, n)  # 1
    cold(rig)
    r = replay_of(rig, stored, max_tokens=16)
    rig.driver.add(r)
    seen = r.status.name
    if when == "waiting_for_remote_kv":
        rig.driver.step()
        seen = r.status.name
        if r.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            pytest.skip(
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
    aborted = rig.scheduler.finish_requests(r.request_id,  # 2
                                            RequestStatus.FINISHED_ABORTED)
    assert [a.request_id for a in aborted] == [r.request_id], (
        f"vLLM did not abort request {r.request_id} (status {seen})")
    rig.driver.run_until_idle()  # 3
    finish(rig)
    record_property("scenario", {"aborted_while": seen})


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_reported_load_failure_affects_that_request_only(
        make_rig, contract_profile, policy, record_property) -> None:
    """A failed load reported through vLLM's interface, under a policy.

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

    ktc = dict(contract_profile.kv_transfer_config(), kv_load_failure_policy=policy)
    rig = make_rig(block_size=BLOCK_SIZE,
                   kv_transfer_config=wrap_kv_transfer_config(ktc, "fail_load", 2))
    n = prompt_len(contract_profile, rig.block_size, 2, rig.block_size // 2 + 1)
    stored = [rig.request(n) for _ in range(3)]
    rig.driver.run(*stored)  # 1
    cold(rig)
    replays = [replay_of(rig, s) for s in stored]
    rig.driver.run(*replays)  # 2
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
    record_property("scenario", {"faulted": bad.request_id, "policy": policy,
            "reported_blocks": sorted(reported)})


PLAN_TRIES = 3  # prompt lengths the resumed-prefill plan tries (one chunk apart)

STORE_FAULTS = [("lose", "recompute"), ("lose", "fail"), ("corrupt", "recompute"),
                ("tear", "recompute"), ("tear", "fail"), ("fail_save", "recompute")]


@pytest.mark.parametrize(("kind", "policy"), STORE_FAULTS,
                         ids=[f"{k}-{p}" for k, p in STORE_FAULTS])
def test_store_fault_is_reported_never_silent(make_rig, contract_profile, kind,
                                              policy, record_property) -> None:
    """The connector's own store fails: entry lost, corrupted, torn, save fails.

    The store's fault injector is :func:`tvc.contract.faults.fault_injector_for`'s
    (``connector.fault_injector`` where the profile names one).

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
         is never silently wrong;
      4. when A failed: A asked again misses, fails again (reported) or loads
         the stored KV, never the blocks of its failed load.
    fail_save:
      1. store A while every save fails, then B normally;
      2. replay both: no exception escapes; A matches nothing or loads correct
         KV (a failed save is never visible to a later lookup); B hits the rule.
    """
    from vllm.v1.request import RequestStatus

    ktc = dict(contract_profile.kv_transfer_config(), kv_load_failure_policy=policy)
    rig = make_rig(block_size=BLOCK_SIZE, kv_transfer_config=ktc)
    from tvc.contract.faults import server_held_store

    inj = _fault_injector(contract_profile, rig)
    if inj is None and (server := server_held_store(contract_profile)):
        pytest.skip(
            f"the connector keeps its KV in its own server ([kv_server] kind = "
            f"{server}), which no built-in fault injector reaches: set "
            "connector.fault_injector to module:function returning one that "
            "damages the server's entries")
    if inj is None or kind not in inj.kinds:
        pytest.skip(
            f"no fault injector for '{kind}' on this connector's store "
            f"({type(inj).__name__ if inj else 'none found'}): set "
            "connector.fault_injector to module:function returning one")
    b = rig.block_size
    n = prompt_len(contract_profile, b, 2, b // 2 + 1)
    w = real_worker(rig)
    failed = RequestStatus.FINISHED_ERROR
    if kind == "fail_save":
        a = rig.request(n)
        if w is None:
            pytest.skip(
                "a failing save needs the connector's real worker side, which does "
                "not run on this device (connector.worker_devices)")
        with inj.failing_saves(w):
            rig.driver.run(a)  # 1
        bb = store(rig, n)
        cold(rig)
        ra, rb = replay_of(rig, a), replay_of(rig, bb)
        rig.driver.run(ra, rb)  # 2
        _, ma, _ = external_hit(rig.driver, ra)
        check_hit(rig, rb, rule_hit(contract_profile, n, b), "after a failed save, B")
        check_every_load(rig, [ra, rb], "after a failed save")
        finish(rig)
        record_property("scenario", {"kind": kind, "matched_after_failed_save": ma})
        return
    from tvc.contract.faults import ForeignWriter

    a_mark = inj.mark()
    a = store(rig, n)
    try:
        a_entries = inj.entries_since(a_mark)
    except ForeignWriter as exc:
        pytest.skip(str(exc))
    assert a_entries, (
        f"the {type(inj).__name__} found no store entry written for a stored "
        f"{n}-token prompt")
    bb = store(rig, n)  # 1
    cold(rig)
    ra, rb = replay_of(rig, a), replay_of(rig, bb)
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
    rig.driver.run(ra, rb)  # 2
    rig.driver.before_worker = None
    refused = list(getattr(inj, "refused", ()))
    if refused:  # another writer's file (or one changed since) is never touched
        pytest.skip(
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
    full = rule_hit(contract_profile, n, b)
    reported = bool(getattr(rig.driver.worker, "reported_invalid_blocks", ()))
    less = full is not None and ma < full
    when = at["state"]
    if not (reported or less or ra.status == failed):
        if w is None:
            # the damage is in the bytes; what finds it is the worker's load
            pytest.skip(
                f"store fault '{kind}': the connector matched all {ma} tokens of the "
                "damaged entries and no worker side runs on this device "
                f"(connector.worker_devices = "
                f"{contract_profile['connector']['worker_devices']}) "
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
    if ra.status == failed:
        # 4. A again: vLLM never computed the blocks of its failed load
        #    (FINISHED_ERROR); a miss, a reported failure or the stored KV
        #    (a connector that saved those blocks serves the harness's mark)
        cold(rig)
        again = replay_of(rig, a)
        rig.driver.run(again)
        check_every_load(rig, [again], f"store fault '{kind}', A asked again")
    finish(rig)
    reported_from = None if w is None else w.reported_before_compute.get(
        ra.request_id, w.reported_loads.get(ra.request_id))
    record_property("scenario", {
        "kind": kind, "policy": policy, "matched": ma, "full": full,
        "reported": reported, "reported_from": reported_from,
        "failed": ra.status == failed, "at": when})


def test_volume_of_stores_and_loads(make_rig, contract_profile, tvc_seed,
                                    tvc_depth, record_property) -> None:
    """A seeded stress: at least ``n`` stores and ``n`` loads, mixed lengths.

    ``n`` is the depth's (standard: 1,000, so a fault of one in a few hundred
    operations shows; ``--tvc-depth deep``: 10,000). Prompts of 1 to 4 chunks
    plus a random tail (seeded), ``batch`` per step, until both counts reach
    ``n`` (a replay the rule gives 0 loads nothing).
    """
    n, seed, batch = tvc_depth.scenario_volume, tvc_seed, 32
    rng = random.Random(seed)
    b = BLOCK_SIZE
    max_len = 4 * chunk_tokens(contract_profile, b) + b
    rig = make_rig(block_size=b, num_blocks=batch * (-(-max_len // b) + 1) + 8,
                   max_num_seqs=batch)
    stores = loads = hits_total = 0
    t_store = t_load = 0.0
    while (stores < n or loads < n) and stores < 2 * n:
        # 1. store a batch
        lens = [prompt_len(contract_profile, b, rng.randint(1, 4), rng.randint(1, b))
                for _ in range(batch)]
        stored = [rig.request(m) for m in lens]
        t0 = time.perf_counter()
        rig.driver.run(*stored)
        t_store += time.perf_counter() - t0
        stores += len(stored)
        # 2. drop the local cache and zero the KV; 3. replay the batch: every
        # replay hits the rule and (real worker) loads bit-identical KV
        cold(rig)
        replays = [replay_of(rig, r) for r in stored]
        t0 = time.perf_counter()
        rig.driver.run(*replays)
        t_load += time.perf_counter() - t0
        for r in replays:
            _, m = check_hit(rig, r, rule_hit(contract_profile, r.num_prompt_tokens,
                                              b), f"volume (seed {seed})")
            hits_total += m
        loads += check_every_load(rig, replays, f"volume (seed {seed})")
        rig.forget_local_cache()
    assert loads >= n, (f"scenario did not happen: only {loads} of {stores} "
                        f"replays loaded (wanted {n})")
    assert hits_total >= loads, (hits_total, loads)  # every load matched >= 1
    finish(rig)
    stores_per_s = round(stores / max(t_store, 1e-9), 1)
    loads_per_s = round(loads / max(t_load, 1e-9), 1)
    record_property("scenario", {
        "stores": stores, "loads": loads, "hit_tokens": hits_total,
        "store_s": round(t_store, 2), "load_s": round(t_load, 2),
        "stores_per_s": stores_per_s, "loads_per_s": loads_per_s})
    print(f"volume: {stores} stores at {stores_per_s}/s, {loads} loads at "
          f"{loads_per_s}/s (seed {seed})")


def test_tenant_isolation_cache_salt_and_lora(make_rig, contract_profile,
                                              record_property) -> None:
    """The same tokens under another cache_salt or LoRA adapter match nothing.

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
    n = prompt_len(contract_profile, b, 2, b // 2 + 1)
    stored = store(rig, n)  # 1
    seen = {}
    for label, kw in (("cache_salt", {"cache_salt": "tvc-tenant-b"}),
                      ("LoRA adapter", {"lora_request": LoRARequest(
                          "tvc-adapter-b", 1, "/nonexistent/tvc-adapter-b")})):
        cold(rig)
        r = replay_of(rig, stored, **kw)
        rig.driver.run(r)  # 2
        _, m, _ = external_hit(rig.driver, r)
        seen[label] = m
        assert m == 0, (
            f"tenant isolation: the same {n} tokens under another {label} matched "
            f"{m} external tokens, expected 0: the connector ignores {label} when "
            "keying its store, so one tenant (or adapter) reads another's KV. Key "
            "entries by vLLM's block hashes (they include cache_salt and the LoRA "
            "name) or mix them in")
    cold(rig)
    plain = replay_of(rig, stored)
    rig.driver.run(plain)  # 3
    _, m = check_hit(rig, plain, rule_hit(contract_profile, n, b), "tenant isolation")
    assert m > 0, ("scenario did not happen: the plain replay matched nothing, so "
                   "the 0 hits above prove nothing")
    check_every_load(rig, [plain], "tenant isolation")
    finish(rig)
    record_property("scenario", {"hits": seen, "plain": m})


def test_granularity_prompts_at_chunk_boundaries(make_rig, contract_profile,
                                                 record_property) -> None:
    """Prompts at chunk boundaries and at the hit rule's first hit.

    Chunk boundaries: 1 to 3 chunks, -1 / +0 / +1 / +B/2 tokens; the rule's
    first hit: -1 / +0 / +1 (a threshold's edge). Each prompt is stored and
    replayed from an empty local cache; the hit must equal the rule, and at
    least one hit must be non-zero.
    """
    rig = make_rig(block_size=BLOCK_SIZE)
    b, c = rig.block_size, chunk_tokens(contract_profile, rig.block_size)
    max_len = rig.vllm_config.model_config.max_model_len
    # chunk boundaries, and where the rule starts to expect a hit (a threshold)
    lengths = sorted({k * c + d for k in (1, 2, 3) for d in (-1, 0, 1, b // 2)
                      if k * c + d >= c} | set(
                          rule_edge_lengths(contract_profile, b, max_len // 2)))
    require_hits(contract_profile, lengths, b, max_len)
    seen = {}
    for n in lengths:
        stored = store(rig, n)
        cold(rig)
        replay = replay_of(rig, stored)
        rig.driver.run(replay)
        expected = rule_hit(contract_profile, n, b)
        _, m, _ = external_hit(rig.driver, replay)
        seen[n] = m
        if expected and m == 0 and expected < n:  # a whole-prompt rule: below
            raise AssertionError(
                f"granularity: a stored {n}-token prompt ({n // c} whole chunk(s) of "
                f"{c} tokens + {n % c}) matched 0 on replay, the hit_rule expects "
                f"{expected}: the connector stores nothing for it")
        if expected is not None:
            assert_hit_matches_rule(m, expected, n, b, *hit_rule_of(contract_profile))
        check_every_load(rig, [replay], f"granularity ({n} tokens)")
    assert any(seen.values()), f"vacuous: no prompt of {lengths} hit"
    finish(rig)
    record_property("scenario", {"chunk": c, "hits": seen})


def test_chunked_prefill_stores_the_whole_prompt(make_rig, contract_profile,
                                                 record_property) -> None:
    """A prompt longer than ``max_num_batched_tokens``, prefilled over steps.

    1. store a prompt of 4 chunks + a tail with a step budget of about one chunk
       (vLLM schedules it over several steps);
    2. drop the local cache; replay it (same budget): the whole prompt must have
       been stored, the replay hits the rule with bit-identical KV.
    """
    b = BLOCK_SIZE
    c = chunk_tokens(contract_profile, b)
    n = prompt_len(contract_profile, b, 4, b // 2 + 1)
    budget = max(c, 2 * b)
    rig = make_rig(block_size=b, max_num_batched_tokens=budget, max_num_seqs=4)
    first = rig.request(n)
    rig.driver.run(first)  # 1
    steps = sum(1 for s in rig.driver.history
                if first.request_id in s.scheduled
                and s.scheduled[first.request_id] > 1)
    assert steps >= 2, (f"scenario did not happen: the {n}-token prompt was "
                        f"prefilled in {steps} step(s) with a budget of {budget}")
    cold(rig)
    replay = replay_of(rig, first)
    rig.driver.run(replay)  # 2
    expected = rule_hit(contract_profile, n, b)
    _, m = check_hit(rig, replay, expected, f"chunked prefill ({steps} steps)")
    check_every_load(rig, [replay], f"chunked prefill ({steps} prefill steps)")
    finish(rig)
    record_property("scenario", {
        "prompt_len": n, "budget": budget, "prefill_steps": steps,
        "matched": m})


def test_chunked_prefill_preempted_and_resumed(make_rig, contract_profile,
                                               record_property) -> None:
    """A chunked prefill preempted midway and resumed on other blocks, twice.

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
    """
    b = BLOCK_SIZE
    # L's share of a step is 2B + 6 tokens (B + 6 mod B): its chunks end off
    # block boundaries, and after a preemption at 2 such chunks a count that
    # was not reset runs B - 4 tokens ahead across a chunk boundary
    budget = 2 * b + 8
    d_len = b - 2  # D1, D2 cross into their second block in L's third step
    first = prompt_len(contract_profile, b, 7, b // 2 + 1)
    # which block ids L gets back depends on vLLM's free-block queue, so on L's
    # length: where L resumes on its own ids, the plan is tried again with L
    # one chunk longer (a fresh rig), at most PLAN_TRIES times
    c = chunk_tokens(contract_profile, b)
    for attempt in range(PLAN_TRIES):
        n = first + attempt * c
        steps = -(-n // (budget - 2))  # L's prefill steps beside two decodes
        # null block + L's prompt + D2's blocks when D1 ends (steps + 2 tokens
        # on): L resumes exactly then, and any growth preempts it again;
        # before, D1 and D2 hold more, so L cannot finish its prefill
        pool = 1 + -(-n // b) + -(-(d_len + steps + 3) // b)
        rig = make_rig(block_size=b, num_blocks=pool,
                       max_num_batched_tokens=budget, max_num_seqs=4)
        sched, d = rig.scheduler, rig.driver
        # D1 ends soon after L's prefill would have (L resumes on its blocks);
        # D2 decodes on, crossing into a new block every B steps
        d1 = rig.request(d_len, max_tokens=steps + 2)
        d2 = rig.request(d_len, max_tokens=steps + 3 * b)
        d.add(d1, d2)  # 1
        # a connector may answer None ("ask again later", KVConnectorBase_V1.
        # get_num_new_matched_tokens): vLLM then admits it in a later step
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
        d.add(long)  # 2
        rid = long.request_id
        before: list[int] = []  # tokens computed the step before each preemption
        tables: list[list[int]] = []  # L's table before its 1st preemption, after
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
        moved = len(tables) == 2 and tables[0] != tables[1][:len(tables[0])]
        if moved or attempt == PLAN_TRIES - 1:
            break
        close_rig(rig)
    mid = [t for t in before if t < n]
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
    assert moved, (
        "scenario did not happen: the prompt resumed on the block ids it had "
        f"before its preemption ({tables}), at {first} to {n} tokens: nothing "
        "else took its freed blocks")
    cold(rig)  # 3
    replay = replay_of(rig, long)
    rig.driver.run(replay)
    _, m = check_hit(rig, replay, rule_hit(contract_profile, n, b),
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
    record_property("scenario", {"prompt_len": n, "budget": budget, "pool": pool,
            "preempted_after": before, "tables": tables, "matched": m})


def test_writes_no_more_than_vllm_asked_to_store(make_rig, contract_profile,
                                                 record_property) -> None:
    """What a connector writes per request is bounded by what vLLM asked.

    vLLM hands a connector the blocks of a request to store: the blocks of its
    prompt (``build_connector_meta`` sees them scheduled, ``request_finished``
    gets the block ids of its computed tokens, ``vllm/v1/core/sched/
    scheduler.py`` ``_connector_finished``), and the blocks of its output for a
    connector that stores decoded tokens too (``connector.stores_decode``). A
    connector that stores more (every chunk again at every step, each decode
    step's whole sequence, several copies of an entry) fills its store many
    times faster than it needs to, and evicts what it could serve.

    The bound, per request, in KV bytes: ``blocks * kv_bytes_per_block * (1 +
    WRITE_SLACK) + WRITE_META_BYTES`` and ``blocks * (layers + 1) +
    WRITE_META_ENTRIES`` files (a file per block and layer, and one per block:
    its index or manifest), where ``blocks`` is ``ceil(prompt / B)`` (a
    partial last block may be stored too), ``ceil((prompt + output) / B)``
    with ``stores_decode``. Checked cumulatively after each request (a write
    that lands after its request ended counts against the next one's bound
    too, never twice).

    1. three prompts (1 chunk + B/2, 2 chunks + 1, 4 chunks + B/2 + 1 tokens)
       with ``2 B`` output tokens each, one after the other;
    2. after each, the files under the connector's store folder written or
       changed since the start (:class:`tvc.contract.faults.FileStoreInjector`)
       stay within the sum of the bounds so far.

    Skips when the connector's store is not files under a folder of
    its ``kv_connector_extra_config`` (nothing to measure).
    """
    from tvc.contract.faults import FileStoreInjector

    rig = make_rig(block_size=BLOCK_SIZE)
    inj = _fault_injector(contract_profile, rig)
    if not isinstance(inj, FileStoreInjector):
        pytest.skip(
            "the connector's store is no folder of files named in its "
            f"kv_connector_extra_config ({type(inj).__name__}): the bytes it "
            "writes cannot be measured here")
    b, c = rig.block_size, chunk_tokens(contract_profile, rig.block_size)
    per_block = kv_bytes_per_block(rig)
    layers = sum(len(g.layer_names) for g in rig.kv_cache_config.kv_cache_groups)
    decode = bool(contract_profile["connector"]["stores_decode"])
    out_tokens = 2 * b
    start = inj.mark()
    bound_bytes = bound_entries = 0
    rows = []
    for chunks, tail in ((1, b // 2), (2, 1), (4, b // 2 + 1)):
        n = prompt_len(contract_profile, b, chunks, tail)
        r = store(rig, n, max_tokens=out_tokens)  # 1
        blocks = -(-(n + (out_tokens if decode else 0)) // b)
        bound_bytes += int(blocks * per_block * (1 + WRITE_SLACK)) + WRITE_META_BYTES
        bound_entries += blocks * (layers + 1) + WRITE_META_ENTRIES
        files = inj.entries_since(start)  # 2
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
            f"{layers + 1} entries per block (one per layer, one index) and "
            f"{WRITE_META_ENTRIES} of metadata per request. The connector "
            "stores more than it is asked (each chunk again at every step, the "
            "output's tokens, several entries per block): store each block vLLM "
            "hands over once (build_connector_meta / save_kv_layer / "
            "wait_for_save)")
    assert rows[-1]["bytes"] > 0, (
        f"scenario did not happen: the connector wrote nothing under {inj.root} "
        f"for {len(rows)} stored prompts")
    cold(rig)
    replay = replay_of(rig, r)
    rig.driver.run(replay)
    check_hit(rig, replay, rule_hit(contract_profile, replay.num_prompt_tokens, b),
              "write volume (the store holds what it was asked)")
    check_every_load(rig, [replay], "write volume")
    finish(rig)
    record_property("scenario", {
        "kv_bytes_per_block": per_block, "chunk": c, "requests": rows,
        "bound_bytes": bound_bytes, "bound_entries": bound_entries})


def _fault_injector(profile, rig):
    """Return ``tvc.contract.faults.fault_injector_for(profile, rig)``.

    Imported here: tvc.contract.faults needs vLLM, and this module must collect on a box
    without vLLM (level1 says what is missing there).
    """
    from tvc.contract.faults import fault_injector_for

    return fault_injector_for(profile, rig)
