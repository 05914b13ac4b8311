"""contract (connector API): the paths vLLM drives that the scenarios never judged.

Derived from vLLM's connector base class (see ``docs/coverage.md``): the stats vLLM
aggregates, reduces and logs every step; the KV cache events it publishes; the
connector reset behind ``reset_prefix_cache(reset_connector=True)``; the block hash
function (``--prefix-caching-hash-algo``); requests that
must not read cached KV (``prompt_logprobs``, ``skip_reading_prefix_cache``); a
store that another model's engine shares (vLLM's block hashes do not cover the
model, its dtype or the KV cache dtype); and the answers vLLM reads outside a step
(role, layout, handshake, push work). Each test drives vLLM's own scheduler (and
the real worker side where the profile allows) and compares the connector's
answers with what the run stored and loaded.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tvc.contract.driver import external_hit
from tvc.contract.steps import (
    BLOCK_SIZE,
    HASH_ALGOS,
    IDLE_STEPS,
    OTHER_MODEL,
    PLACEHOLDER_TOKEN_ID,
    SAME_KV,
    SKIP_READING,
    check_every_load,
    chunk_tokens,
    close_rig,
    cold,
    finish,
    kv_cache_layouts,
    overrides,
    prompt_len,
    real_worker,
    replay_of,
    scenario_lengths,
    shared_prefixes,
    store,
    stored_then_served,
)

pytestmark = [pytest.mark.contract]


def test_stats_are_per_interval_and_usable_by_vllms_logger(
        make_rig, contract_profile, record_property) -> None:
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

    Skips when the connector keeps vLLM's default (no stats).
    """
    from tvc.contract.api_checks import check_prom_metrics, check_stats

    rig = make_rig(block_size=BLOCK_SIZE)
    if not overrides(rig, "get_kv_connector_stats"):
        pytest.skip(
            "the connector keeps KVConnectorBase_V1.get_kv_connector_stats "
            "(no stats): nothing to check")
    _stored, _replay_req, hit = stored_then_served(contract_profile, rig)
    log = rig.driver.coverage
    cls = type(rig.scheduler.connector)
    checked = check_stats(log, cls, idle_steps=IDLE_STEPS)
    busy = [o for _side, _s, o in log.stats if o is not None and not o.is_empty()]
    samples = check_prom_metrics(cls, rig.vllm_config, busy[0], log) if (
        busy and overrides(rig, "build_prom_metrics")) else 0
    finish(rig)
    assert log.stats, "vLLM never asked the connector for stats"
    record_property("scenario", {
        "hit_tokens": hit, "answers": len(log.stats),
        "non_empty_checked": checked, "prom_samples": samples})


def test_kv_cache_events_name_only_stored_blocks(make_rig, contract_profile,
                                                 record_property) -> None:
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

    Skips when the connector keeps vLLM's default (no events).
    """
    from tvc.contract.api_checks import check_events

    rig = make_rig(block_size=BLOCK_SIZE, kv_events=True)
    names = overrides(rig, "take_events", "get_kv_connector_kv_cache_events")
    if not names:
        pytest.skip(
            "the connector keeps KVConnectorBase_V1.take_events and "
            "get_kv_connector_kv_cache_events (no KV cache events): nothing to "
            "check")
    n = scenario_lengths(contract_profile, rig.block_size)["single"]
    first = store(rig, n)
    c = chunk_tokens(contract_profile, rig.block_size)
    longer = store(rig, n + 2 * c, shared_prefix=first.prompt_token_ids)
    store(rig, n)
    cold(rig)
    replay = replay_of(rig, longer)
    rig.driver.run(replay)
    _local, hit, _ = external_hit(rig.driver, replay)
    assert hit > n - c, (
        f"scenario did not happen: the replay of a stored {n + 2 * c}-token prompt "
        f"(extending a stored {n}-token one) matched {hit} tokens, not beyond the "
        "shorter prompt, so no extended chain was served")
    emitted = sum(len(evs) for _side, _step, evs in rig.driver.coverage.events)
    if not emitted:
        # an emitter that misses a block still gets every check below
        pytest.skip(
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
    record_property("scenario", {"hit_tokens": hit, **counts})


def test_reset_cache_empties_the_connector(make_rig, contract_profile,
                                           record_property) -> None:
    """``reset_prefix_cache(reset_connector=True)``: the store is empty after.

    1. store a prompt (an external hit on replay proves it is stored);
    2. ``Scheduler.reset_prefix_cache(reset_connector=True)``, which calls the
       connector's ``reset_cache`` (True: reset done, False: refused);
    3. replay the prompt again: after a reset that succeeded it is a miss.

    Skips when the connector keeps vLLM's default ``reset_cache``
    (returns None: "not implemented"), or refused (False) the reset.
    """
    rig = make_rig(block_size=BLOCK_SIZE)
    if not overrides(rig, "reset_cache"):
        pytest.skip(
            "the connector keeps KVConnectorBase_V1.reset_cache (no connector "
            "reset): nothing to check")
    stored, _replay_req, hit = stored_then_served(contract_profile, rig)
    w = real_worker(rig)
    ok = rig.scheduler.reset_prefix_cache(reset_connector=True)
    if not ok:
        pytest.skip(
            "vLLM's reset_prefix_cache(reset_connector=True) returned False (the "
            "connector refused the reset): nothing was reset")
    if w is not None:
        w.zero()
    again = replay_of(rig, stored)
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
    record_property("scenario", {"hit_before": hit, "hit_after": after})


@pytest.mark.parametrize("field", sorted(SKIP_READING))
def test_request_that_must_not_read_cached_kv_gets_a_miss(
        make_rig, contract_profile, field, record_property) -> None:
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
    stored, _replay_req, hit = stored_then_served(contract_profile, rig)
    cold(rig)
    req = replay_of(rig, stored, sampling=SKIP_READING[field])
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
    record_property("scenario", {
        "hit_plain": hit, "connector_answer": matched,
        "tokens_read_from_cache": computed_before, "field": field})


def test_answers_vllm_reads_outside_a_step(make_rig, contract_profile,
                                           record_property) -> None:
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
    _stored, _r, hit = stored_then_served(contract_profile, rig)
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
    record_property("scenario", out)


def test_multimodal_item_hits_never_serve_another_image(
        make_rig, contract_profile, record_property) -> None:
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

    Skips when the replay with image A was not served past the
    placeholder (the connector does not serve multimodal prompts).
    """
    import uuid

    from tvc.contract.builders import prompt_tokens

    rig = make_rig(block_size=BLOCK_SIZE)
    b, c = rig.block_size, chunk_tokens(contract_profile, rig.block_size)
    total = prompt_len(contract_profile, b, 4, b // 2 + 1)
    offset, length = 2 * c + b // 2, c
    nonce = uuid.uuid4().hex[:8]
    toks = prompt_tokens(offset, hash(nonce) % 10_000) + (
        [PLACEHOLDER_TOKEN_ID] * length) + prompt_tokens(
            total - offset - length + 1, 1 + hash(nonce) % 10_000)[1:]
    image_a, image_b = f"tvc-image-a-{nonce}", f"tvc-image-b-{nonce}"

    def with_image(ident: str) -> Any:
        return rig.request(total, shared_prefix=toks,
                           media=[(offset, length, ident)])

    rig.driver.run(with_image(image_a))  # 1
    cold(rig)
    again = with_image(image_a)
    rig.driver.run(again)  # 2
    local_a, hit_a, _ = external_hit(rig.driver, again)
    if local_a + hit_a <= offset + length:
        pytest.skip(
            f"the replay of a stored {total}-token prompt with image A at "
            f"[{offset}, {offset + length}) matched {hit_a} tokens ({local_a} "
            "local): the connector does not serve a multimodal prompt past its "
            "image, so there is no other image's KV it could serve")
    check_every_load(rig, [again], "multimodal, the same image")
    cold(rig)
    other = with_image(image_b)
    rig.driver.run(other)  # 3
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
    record_property("scenario", {"hit_a": hit_a, "hit_b": hit_b,
                                 "placeholder": [offset, offset + length]})


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_block_hash_algorithm_keeps_hits_and_loads_exact(
        make_rig, contract_profile, algo, record_property) -> None:
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

    Skips when ``algo`` needs a package this Python lacks.
    """
    from vllm.utils.hashing import get_hash_fn_by_name

    try:
        get_hash_fn_by_name(algo)(b"probe")
    except ModuleNotFoundError as exc:
        pkg = exc.name or algo.split("_")[0]
        pytest.skip(
            f"prefix_caching_hash_algo={algo} needs the Python package {pkg!r}, "
            "an optional dependency of vLLM that this environment lacks. Fix: "
            f"pip install {pkg}")
    try:
        out = shared_prefixes(functools.partial(make_rig, hash_algo=algo),
                              contract_profile, True)
    except AssertionError as exc:
        raise AssertionError(
            f"under --prefix-caching-hash-algo {algo} (vLLM hashes every "
            f"request's blocks with {algo}; the other contract tests run the "
            f"default sha256): {exc}. A connector whose keys assume sha256 (its "
            "own re-computation of vLLM's block hashes, a fixed digest width) "
            "misses or mismatches here: key by request.block_hashes as given, or "
            "hash the tokens itself on both sides") from exc
    record_property("scenario", {"algo": algo, **out})
    # at least two of the three prefix-sharing replays loaded under this hash
    assert out["loads"] >= 2, out


@pytest.mark.parametrize("variant", sorted(OTHER_MODEL))
def test_another_model_on_one_store_gets_a_miss(make_rig, contract_profile, variant,
                                                record_property) -> None:
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

    Skips when the store does not outlive the connector instance.
    """
    kw, what, ignored, entry = OTHER_MODEL[variant]
    a = make_rig(block_size=BLOCK_SIZE)
    stored, _replay_req, hit_a = stored_then_served(contract_profile, a)  # 1
    finish(a)
    close_rig(a)
    a2 = make_rig(block_size=BLOCK_SIZE)
    again = replay_of(a2, stored)
    a2.driver.run(again)  # 2
    _local, hit_a2, _ = external_hit(a2.driver, again)
    finish(a2)
    close_rig(a2)
    if hit_a2 == 0:
        pytest.skip(
            f"a new connector on the same store got no hit for a prompt the first "
            f"one stored ({hit_a} tokens then, 0 now): the store does not outlive a "
            "connector instance, so no second model can read it")
    try:
        b = make_rig(block_size=BLOCK_SIZE, **kw)
    except Exception as exc:  # noqa: BLE001 - a refusal is an answer; recorded
        line = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        record_property("scenario", {
            "hit_a": hit_a, "hit_a_again": hit_a2, "hit_b": 0,
            "refused": f"{type(exc).__name__}: {line}"})
        return
    model_b = b.vllm_config.model_config.model
    if variant in SAME_KV:
        wa, wb = real_worker(a), real_worker(b)
        if wa is None or wb is None:
            pytest.skip(
                f"{what}: a hit may be right (the same KV values), so only the "
                "loaded bytes can judge it, and no worker side runs on this device "
                f"(connector.worker_devices = "
                f"{contract_profile['connector']['worker_devices']})")
        if wa.layout.kv_layout == wb.layout.kv_layout:
            pytest.skip(
                f"{what}: the connector's worker registered the {wb.layout.kv_layout} "
                "layout for both (it requires one: get_required_kvcache_layout), "
                "so no other byte order can reach it")
    replay_b = replay_of(b, stored)
    crashed = ""
    try:
        b.driver.run(replay_b)  # 3
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
        record_property("scenario", {
            "hit_a": hit_a, "hit_a_again": hit_a2, "hit_b": hit_b, "refused": "",
            "same_kv_loads_exact": hit_b > 0})
        return
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
    record_property("scenario", {"hit_a": hit_a, "hit_a_again": hit_a2,
                                 "hit_b": hit_b, "refused": ""})
