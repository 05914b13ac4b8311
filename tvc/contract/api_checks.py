"""Checks of the connector methods vLLM calls but no scenario judged before.

Each check compares what a rig's :class:`~tvc.contract.coverage.CoverageLog`
recorded with vLLM's own use of it and with what the run did, and raises
``AssertionError`` naming the method, the expected and seen values and the vLLM
source that relies on it. Entry points: :func:`check_stats`
(``get_kv_connector_stats``), :func:`check_prom_metrics` and
:func:`check_events` (``take_events`` / ``get_kv_connector_kv_cache_events``).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any

from tvc.contract.coverage import CoverageLog, source_of


def _stats_cls() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorStats,
    )

    return KVConnectorStats


def _where(name: str) -> str:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
    )

    return source_of(getattr(KVConnectorBase_V1, name))


def assert_stats_type(obj: Any, side: str, step: int) -> None:
    """A ``get_kv_connector_stats`` answer is None or a ``KVConnectorStats``.

    Checked when the connector answers (AssertionError naming method, side and
    step): vLLM's scheduler calls ``is_empty()`` / ``aggregate()`` and reads
    ``.data`` (``update_from_output``, ``make_stats``), so another type fails there,
    far from its cause.
    """
    if obj is not None and not isinstance(obj, _stats_cls()):
        raise AssertionError(
            f"get_kv_connector_stats ({side} side, step {step}) returned "
            f"{type(obj).__name__}, not a KVConnectorStats: vLLM calls "
            "is_empty()/aggregate()/reduce() and reads .data on it "
            f"({_where('get_kv_connector_stats')})")


def check_stats(log: CoverageLog, connector_cls: type[Any], *, idle_steps: int) -> int:
    """``get_kv_connector_stats`` answers follow vLLM's interval contract.

    Each answer in ``log.stats`` (``(side, step, obj)``) is None or a
    ``KVConnectorStats`` (``update_from_output``, ``vllm/v1/core/sched/scheduler.py``);
    a non-empty one pickles (workers -> logger process), ``reduce()`` gives
    ``{str: int | float}``, ``connector_cls.build_kv_connector_stats(data)`` rebuilds
    it to the same type and ``reduce()`` (``KVConnectorLogging.observe``), and
    ``aggregate`` keeps it non-empty. The last step's answer (after ``idle_steps``
    steps with nothing in flight) must add nothing aggregated with itself (only
    gauges remain): stats are "collected during the last interval" (base.py
    docstring). Returns the number of non-empty answers checked; AssertionError on
    a broken rule.
    """
    src = _where("get_kv_connector_stats")
    last_step = max((s for _side, s, _o in log.stats), default=0)
    checked = 0
    for side, step, obj in log.stats:
        if obj is None:
            continue
        assert_stats_type(obj, side, step)
        empty = obj.is_empty()
        assert isinstance(empty, bool), (
            f"{type(obj).__name__}.is_empty() returned {empty!r}, not a bool")
        if empty:
            continue
        if step == last_step:
            _assert_idle_interval(obj, connector_cls, side, step, idle_steps, src)
        checked += 1
        try:
            copy = pickle.loads(pickle.dumps(obj))
        except Exception as exc:  # noqa: BLE001 - any pickling failure
            raise AssertionError(
                f"{type(obj).__name__} does not pickle ({type(exc).__name__}: "
                f"{exc}): vLLM sends stats from the workers to the logger process"
            ) from exc
        figures = obj.reduce()
        assert isinstance(figures, dict) and all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(
                v, bool) for k, v in figures.items()), (
            f"{type(obj).__name__}.reduce() returned {figures!r}: vLLM logs it as "
            "'KV Transfer metrics: k=v' and needs {str: int | float}")
        rebuilt = connector_cls.build_kv_connector_stats(data=stats_payload(copy))
        log.hit("api:KVConnectorStats.to_dict", "payload")
        assert rebuilt is not None, (
            f"{connector_cls.__name__}.get_kv_connector_stats reports stats but "
            "build_kv_connector_stats(data) returns None: vLLM's logger "
            "(KVConnectorLogging.observe) drops them with a warning, so they are "
            f"never logged ({_where('build_kv_connector_stats')})")
        assert type(rebuilt) is type(obj) and rebuilt.reduce() == figures, (
            f"build_kv_connector_stats(data) gives {type(rebuilt).__name__} "
            f"reducing to {rebuilt.reduce()}, the worker's {type(obj).__name__} "
            f"reduces to {figures}: what vLLM logs differs from what was measured")
        again = connector_cls.build_kv_connector_stats(data=stats_payload(copy))
        merged = rebuilt.aggregate(again)
        assert isinstance(merged, type(obj)) and not merged.is_empty(), (
            f"{type(obj).__name__}.aggregate returned "
            f"{type(merged).__name__} (empty: {getattr(merged, 'is_empty', None)})"
            ": vLLM aggregates the workers' and the scheduler's stats with it")
        log.hit("api:KVConnectorStats.is_empty", f"{side} step {step}")
        log.hit("api:KVConnectorStats.reduce", ", ".join(sorted(figures))[:60])
        log.hit("api:KVConnectorStats.aggregate", type(obj).__name__)
        log.hit("api:KVConnectorBase_V1.build_kv_connector_stats",
                type(rebuilt).__name__)
    return checked


def check_prom_metrics(connector_cls: type[Any], vllm_config: Any, stats: Any,
                       log: CoverageLog) -> int:
    """``build_prom_metrics`` and ``observe`` as vLLM's ``KVConnectorProm`` runs them.

    Built with vLLM's metric classes (``KVConnectorProm.__init__``) bound to a
    private registry, then ``observe(data, engine_idx)`` on a non-empty ``stats``.
    Returns the samples exported; AssertionError if building or observing raised
    or nothing was exported.
    """
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorProm,
    )

    registry = CollectorRegistry()

    def bound(base: Any) -> type:
        def init(self: Any, *a: Any, **kw: Any) -> None:
            kw["registry"] = registry
            base.__init__(self, *a, **kw)
        return type(f"Private{base.__name__}", (base,), {"__init__": init})

    prom_cls = type("PrivateKVConnectorProm", (KVConnectorProm,), {
        "_gauge_cls": bound(Gauge), "_counter_cls": bound(Counter),
        "_histogram_cls": bound(Histogram)})
    src = _where("build_prom_metrics")
    try:
        prom = prom_cls(vllm_config, ["model_name", "engine"], {0: ["tiny", "0"]})
        prom.observe(stats_payload(stats), 0)
    except Exception as exc:  # noqa: BLE001 - any failure is the connector's
        raise AssertionError(
            f"{connector_cls.__name__}.build_prom_metrics / observe raised "
            f"{type(exc).__name__}: {exc} when vLLM's KVConnectorProm built its "
            f"metrics and observed a non-empty interval's stats ({src})") from exc
    if prom.prom_metrics is None:
        return 0
    samples = sum(len(m.samples) for m in registry.collect())
    assert samples > 0, (
        f"{connector_cls.__name__}.build_prom_metrics registered no metric that "
        "exports a sample after observing a non-empty interval")
    log.hit("api:KVConnectorBase_V1.build_prom_metrics", f"{samples} samples")
    return samples


def _assert_idle_interval(obj: Any, connector_cls: type[Any], side: str, step: int,
                          idle_steps: int, src: str) -> None:
    """An answer after every transfer ended adds nothing when aggregated with itself."""
    try:
        one = connector_cls.build_kv_connector_stats(data=stats_payload(obj))
        two = connector_cls.build_kv_connector_stats(data=stats_payload(obj))
    except Exception:  # noqa: BLE001 - the main checks report these
        return
    if one is None or two is None:
        return
    alone = one.reduce()
    twice = one.aggregate(two).reduce()
    grew = {k: v for k, v in twice.items() if alone.get(k) != v}
    assert not grew, (
        f"get_kv_connector_stats ({side} side) still reports {alone} in step "
        f"{step}, after every transfer ended and {idle_steps} idle steps; "
        f"aggregated with itself it becomes {grew}: the counters are never reset, "
        "so every interval counts old transfers again (vLLM treats each answer "
        f"as the last interval's and accumulates them, {src})")


def stats_payload(obj: Any) -> dict[str, Any]:
    """The dict vLLM sends to its logger: ``to_dict()`` (0.33) or ``.data`` (0.28).

    As ``Scheduler.make_stats`` sends it, deep-copied through pickle as the
    engine-core output is.
    """
    data = obj.to_dict() if hasattr(obj, "to_dict") else obj.data
    return pickle.loads(pickle.dumps(data))


def known_blocks(requests: Iterable[Any], block_size: int
                 ) -> dict[Any, tuple[tuple[int, ...], Any]]:
    """Every full block the run's requests hashed, as KV events name them.

    Maps the external hash (``maybe_convert_block_hash``) to (the block's token ids,
    the external hash of the block before it or None).
    """
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    out: dict[Any, tuple[tuple[int, ...], Any]] = {}
    for r in requests:
        parent = None
        tokens = list(r.all_token_ids)
        for i, h in enumerate(r.block_hashes):
            ext = maybe_convert_block_hash(h)
            out.setdefault(ext, (tuple(tokens[i * block_size:(i + 1) * block_size]),
                                 parent))
            parent = ext
    return out


def raw_block_hashes(requests: Iterable[Any]) -> dict[Any, Any]:
    """Raw ``BlockHash`` of every block the requests hashed -> its external form.

    Only where they differ (``maybe_convert_block_hash``: the low 64 bits as an int
    while ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, the default).
    """
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    out: dict[Any, Any] = {}
    for r in requests:
        for h in r.block_hashes:
            ext = maybe_convert_block_hash(h)
            if ext != h:
                out[bytes(h)] = ext
    return out


def raw_hash_message(h: Any, ext: Any, where: str) -> str:
    """The red for an event hash in vLLM's raw ``BlockHash`` form."""
    return (f"KV cache event BlockStored ({where}) names block hash {_short(h)}: "
            "vLLM's raw BlockHash bytes of a block this run computed, but vLLM "
            f"publishes the converted external hash ({ext!r}: "
            "vllm.v1.core.kv_cache_utils.maybe_convert_block_hash, the low 64 bits "
            "as an int while VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, vLLM's default; "
            "block_pool.py BlockStored): a consumer that matches vLLM's own events "
            "(a KV-aware router) never finds the connector's blocks. Publish "
            "maybe_convert_block_hash(block_hash) in block_hashes and "
            "parent_block_hash")


def assert_chain(ev: Any, blocks: dict[Any, tuple[tuple[int, ...], Any]],
                 where: str) -> None:
    """A ``BlockStored`` is a piece of vLLM's hash chain, hung on its parent.

    As vLLM publishes blocks (``block_pool.py`` ``cache_full_blocks`` 0.28;
    ``offloading/events.py``: "Events are self-contained (own parent)"):
    ``parent_block_hash`` is the block before the first (None exactly for a first
    block), and each listed block's parent is the one before it. Placeholder events
    (no tokens, ``block_size`` 0) are skipped. The AssertionError names the block,
    the parent seen and vLLM's.
    """
    if not ev.block_hashes:
        return
    first = ev.block_hashes[0]
    want = blocks[first][1]
    got = ev.parent_block_hash
    if got != want:
        if got is None:
            raise AssertionError(
                f"KV cache event BlockStored ({where}) names no parent for block "
                f"{_short(first)}, whose parent in vLLM's hash chain is "
                f"{_short(want)} (the block before it): the chain breaks there, and "
                "a consumer cannot hang the block on its prefix (it reads it as a "
                "request's first block). A connector that stores a prompt extending "
                "one it stored before must publish the first new block with "
                "parent_block_hash = the hash of the block before it")
        raise AssertionError(
            f"KV cache event BlockStored ({where}) names parent {_short(got)} for "
            f"block {_short(first)}; the block before it in vLLM's hash chain is "
            f"{_short(want)}")
    for prev, h in zip(ev.block_hashes, ev.block_hashes[1:], strict=False):
        assert blocks[h][1] == prev, (
            f"KV cache event BlockStored ({where}) lists block {_short(h)} right "
            f"after {_short(prev)}, but its parent in vLLM's hash chain is "
            f"{_short(blocks[h][1])}: one event's blocks must be consecutive blocks "
            "of one prefix")


def check_events(log: CoverageLog, requests: Iterable[Any], block_size: int,
                 served: dict[str, int]) -> dict[str, int]:
    """KV cache events name only blocks this run stored, and every block served.

    Rules (``vllm/distributed/kv_events.py``): every event in ``log.events`` is
    ``BlockStored``, ``BlockRemoved`` or ``AllBlocksCleared``; a ``BlockStored``
    names hashes this run computed in vLLM's published form
    (:func:`raw_hash_message`), with exactly their ``token_ids`` when given, chained
    (:func:`assert_chain`) to an announced parent, ``block_size`` B (0 for a
    placeholder); a ``BlockRemoved`` names only stored hashes; every block an
    external hit served (``served``: request id -> matched tokens) is announced and
    not removed. AssertionError on a broken rule.

    Returns:
        counts: ``stored`` (distinct hashes announced), ``removed``, ``events``.

    """
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
    )
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    reqs = list(requests)
    blocks = known_blocks(reqs, block_size)
    raw = raw_block_hashes(reqs)
    src = _where("take_events")
    live: set[Any] = set()
    ever: set[Any] = set()
    removed = n = 0
    announced_at: dict[Any, int] = {}
    parents: dict[Any, tuple[Any, str]] = {}  # parent -> (first child, where)
    for side, step, events in log.events:
        for ev in events:
            n += 1
            where = f"{side} side, step {step}"
            if isinstance(ev, BlockStored):
                for h in [*ev.block_hashes, ev.parent_block_hash]:
                    if h is not None and h not in blocks and h in raw:
                        raise AssertionError(raw_hash_message(h, raw[h], where))
                for h in ev.block_hashes:
                    assert h in blocks, (
                        f"KV cache event BlockStored ({where}) names block hash "
                        f"{_short(h)}, which no request of this run computed: a "
                        "consumer (KV-aware router) would route to KV that does "
                        f"not exist ({src})")
                if ev.token_ids or ev.block_size:  # a placeholder has no chain
                    assert_chain(ev, blocks, where)
                    if ev.parent_block_hash is not None:
                        parents.setdefault(ev.parent_block_hash,
                                           (ev.block_hashes[0], where))
                toks = tuple(t for h in ev.block_hashes for t in blocks[h][0])
                if ev.token_ids:
                    assert tuple(ev.token_ids) == toks, (
                        f"BlockStored ({where}) for {len(ev.block_hashes)} block(s) "
                        f"carries {len(ev.token_ids)} token ids that are not those "
                        f"blocks' tokens (first differing of {len(toks)})")
                    assert ev.block_size == block_size, (
                        f"BlockStored ({where}) says block_size {ev.block_size}, "
                        f"the engine's is {block_size}")
                for h in ev.block_hashes:
                    live.add(h)
                    ever.add(h)
                    announced_at.setdefault(h, step)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    assert h in ever, (
                        f"BlockRemoved ({where}) names {_short(h)}, never "
                        "announced as stored")
                    live.discard(h)
                    removed += 1
            elif isinstance(ev, AllBlocksCleared):
                live.clear()
            else:
                raise AssertionError(
                    f"take_events ({where}) yielded {type(ev).__name__}: vLLM "
                    "publishes only BlockStored / BlockRemoved / AllBlocksCleared "
                    f"in its KVEventBatch ({src})")
    for parent, (child, where) in parents.items():
        # in any order (vLLM's own offloading events are self-contained, "so key
        # order is free"), but announced: else no consumer can attach the child
        assert parent in ever, (
            f"KV cache event BlockStored ({where}) hangs block {_short(child)} on "
            f"parent {_short(parent)}, which no event of the run announced: a "
            "consumer cannot attach it to any prefix it knows (publish the "
            "prefix's blocks too)")
    by_id = {r.request_id: r for r in reqs}
    for rid, tokens in served.items():
        r = by_id.get(rid)
        if r is None or tokens <= 0:
            continue
        for h in r.block_hashes[:tokens // block_size]:
            ext = maybe_convert_block_hash(h)
            assert ext in ever, (
                f"request {rid} was served {tokens} tokens by an external hit, but "
                f"its block {_short(ext)} was never announced by a BlockStored "
                "event: consumers of the events never learn the connector holds it")
    if n:
        log.hit("api:KVConnectorBase_V1.take_events", f"{n} events checked")
    return {"stored": len(ever), "removed": removed, "events": n}


def _short(h: Any) -> str:
    if isinstance(h, bytes):
        return h[:6].hex() + "…"
    return str(h)
