"""Model-based exploration of the contract tier: a hypothesis state machine.

Hypothesis draws event sequences (requests, steps, aborts, preemption, resets,
restarts, faults) over vLLM's real V1 scheduler and the connector and checks
:data:`INVARIANTS` after every step. Entry points: :class:`Explorer` (one
sequence on one rig), :func:`make_machine`, :func:`explore` (a family with a
seeded, bounded budget), :func:`replay_explorer` (a failure's replay script,
raised in :class:`ExplorationFailure`). Read docs/exploration.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import random
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tvc.config.depth import DEFAULT as DEFAULT_DEPTH
from tvc.config.depth import DEPTHS
from tvc.contract.builders import TINY_VOCAB_SIZE, make_request
from tvc.contract.driver import STALL_POLL_S, EngineStepError
from tvc.contract.freed import INVARIANTS as FREED_INVARIANTS
from tvc.contract.freed import RESUME_FIX, blame
from tvc.contract.invariants import assert_scheduler_empty_and_no_leaked_blocks
from tvc.contract.worker import SHORT_LOAD, ConnectorWorker
from tvc.core.seed import run_seed
from tvc.core.watchdog import Stuck

BLOCK_SIZE = 16  # B of every exploration rig (the scenarios' block size)
MAX_CHUNKS = 3  # longest prompt: MAX_CHUNKS chunks + a tail of up to B + 1 tokens
MAX_DECODE = 24  # output tokens at most (a few blocks of decode for preemption)
MAX_SEQS = 8  # max_num_seqs of the rig
# max_num_batched_tokens of the preemption family: 2 B + 8 (B + 8 mod B), so
# chunked prefills end off block boundaries (the scenarios' resumed prefill)
PREFILL_BUDGET = 2 * BLOCK_SIZE + 8
# steps a load may stay in flight (WAITING_FOR_REMOTE_KVS) beyond injected delays
# before the exploration calls it a load that never finishes
MAX_LOAD_STEPS = 40
# and it must also outlast connector.transfer_timeout_s (the driver's min_stall_s):
# a background copy takes time, not steps; vLLM sets no bound
# (Scheduler._try_promote_blocked_waiting_request). Past MAX_LOAD_STEPS each
# check sleeps driver.STALL_POLL_S
# sequences per family at the default depth (about 10 s per family on 2 CPUs)
DEFAULT_EXAMPLES = DEPTHS[DEFAULT_DEPTH].explore_examples
STEPS_PER_EXAMPLE = 20  # hypothesis stateful_step_count
# seconds hypothesis may spend shrinking a failure (its own default is 300);
# TVC_EXPLORE_SHRINK_S overrides
SHRINK_SECONDS = float(os.environ.get("TVC_EXPLORE_SHRINK_S", "90"))
FAULT_KINDS = ("lose", "tear", "corrupt", "fail_save", "delay", "fail")
PHASES = ("matched", "loading", "loaded", "saving")
ABORT_STATES = ("WAITING", "WAITING_FOR_REMOTE_KVS", "RUNNING", "PREEMPTED")
ABORT_STEPS = 3  # engine steps an abort may run to reach the state it targets

#: invariant -> connector method(s) at fault when it breaks
INVARIANTS = {
    "matched tokens within the prompt": "get_num_new_matched_tokens",
    "local + external = num_computed_tokens": (
        "get_num_new_matched_tokens / update_state_after_alloc"),
    "loaded KV bit-identical": "start_load_kv / wait_for_layer_load (worker load)",
    "failed load reported, only that request failed": (
        "get_block_ids_with_load_errors / get_finished"),
    "no hit across tenants or adapters": (
        "get_num_new_matched_tokens (store key ignores cache_salt / LoRA / "
        "prompt_embeds)"),
    "no hit nobody stored": "get_num_new_matched_tokens (store key or index)",
    "every load finishes": "get_finished (finished_recving never reported)",
    "vLLM resumes a finished load": (
        "none: vLLM's scheduler (Scheduler.schedule never resumed a request whose "
        "receive the connector reported finished)"),
    "no block or request leaks": (
        "request_finished / get_finished (finished_sending)"),
    "no exception escapes an engine step": "(named in the message)",
    "every connector call returns": "(named in the message: the call that never "
                                    "returned)",
    **FREED_INVARIANTS,
}


@dataclass(frozen=True)
class Family:
    """Which events a family of explorations draws.

    Attributes:
        name: test id.
        preemption: a KV pool too small for the batch, and a step budget of
            :data:`PREFILL_BUDGET` tokens (chunks end off block boundaries).
        tenants: requests carry ``cache_salt`` / a LoRA adapter / prompt_embeds.
        faults: store and load faults.
        one_token: prompts of a single token too (the others start at 2).

    """

    name: str
    preemption: bool = False
    tenants: bool = False
    faults: bool = False
    one_token: bool = False


FAMILIES = {f.name: f for f in (
    Family("core"), Family("one_token", one_token=True),
    Family("preemption", preemption=True),
    Family("tenants", tenants=True), Family("faults", faults=True))}
TENANTS = (None, "salt:tvc-tenant-a", "salt:tvc-tenant-b", "lora:tvc-adapter-a",
           "embeds:tvc-table-a", "embeds:tvc-table-b")
EMBED_DIM = 8  # hidden size of the prompt_embeds of an ``embeds:`` tenant


def _embedder(table: str) -> Callable[[Sequence[int]], Any]:
    """``tokens -> prompt_embeds [len, EMBED_DIM]`` (float32) of one embedding table.

    Deterministic per table; vLLM's block hash covers the embeddings
    (``vllm/v1/core/kv_cache_utils.py``, ``_gen_prompt_embeds_extra_hash_keys``)
    while the request's token ids are all 0 (``Request._all_token_ids``).
    """
    import hashlib

    import torch

    seed = int.from_bytes(hashlib.sha256(table.encode()).digest()[:4], "little")

    def embed(tokens: Sequence[int]) -> Any:
        g = torch.Generator().manual_seed(seed)
        basis = torch.randn(4, EMBED_DIM, generator=g)
        t = torch.tensor(list(tokens), dtype=torch.float32).unsqueeze(1)
        return torch.sin(t * basis[0] + basis[1]) * basis[2] + basis[3]

    return embed


class ExplorationFailure(AssertionError):
    """An invariant broke; the message names it, the method and a replay script.

    Attributes:
        invariant: a key of :data:`INVARIANTS`.
        method: the connector method at fault.
        script: Python lines replaying the event sequence.

    """

    def __init__(self, invariant: str, detail: str, script: str,
                 method: str = "") -> None:
        self.invariant = invariant
        self.method = method or INVARIANTS.get(invariant, "")
        self.script = script
        super().__init__(
            f"exploration: invariant '{invariant}' broken: {detail}\n"
            f"connector method at fault: {self.method}\n"
            f"replay (minimal event sequence; paste into python):\n{script}")


#: the invariants broken during the current :func:`explore` call, in order
_BROKEN: list[ExplorationFailure] = []


class KnownDefectReached(Exception):  # noqa: N818 - reads as an event
    """A failure matching a known defect the profile lists for this test.

    Stops the sequence (counted in :attr:`Stats.known`); others go on.
    """


@dataclass
class Stats:
    """What the explorations of one run reached (the premises of a green)."""

    examples: int = 0
    steps: int = 0
    requests: int = 0
    hits: int = 0
    loads: int = 0
    async_loads: int = 0
    shared_prefix: int = 0
    twins: int = 0
    tenant_requests: int = 0
    preemptions: int = 0
    #: preemptions of a request that had not computed its whole prompt yet
    preempted_prefills: int = 0
    #: requests preempted more than once
    preempted_again: int = 0
    resets: int = 0
    restarts: int = 0
    aborts: dict[str, int] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    failed_loads_reported: int = 0
    #: longest run of steps a request waited for remote KV after its receive
    #: had ended (vLLM's ``finished_recving_kv_req_ids``): vLLM resumes it only
    #: when its waiting-queue walk reaches it (not the connector's load time)
    max_resume_wait: int = 0
    #: hypothesis seeds the family ran (one per round: the run's seed + round)
    seeds: list[int] = field(default_factory=list)
    #: sequences drawn per round (``--tvc-explore-examples``)
    budget: int = 0
    #: later requests that counted as computed a block a reported failed load
    #: left in vLLM's prefix cache and nothing recomputed (vLLM's recovery gap
    #: under kv_load_failure_policy=recompute, not the connector's)
    unrecomputed_reads: int = 0
    seconds: float = 0.0
    #: known defect's reason -> sequences stopped by it
    known: dict[str, int] = field(default_factory=dict)
    #: known defect's reason -> the first failure (message and replay script)
    known_first: dict[str, str] = field(default_factory=dict)
    #: stand-in workers the sequences ran (``standin_label``; empty: the
    #: connector's real worker, or none), recorded as the test's ``worker``
    standins: list[str] = field(default_factory=list)
    #: store faults not made: another writer changed this file in the store
    #: folder (:class:`tvc.contract.faults.ForeignWriter`), or a recorded entry
    #: changed before it was damaged (left as it is)
    foreign: str = ""

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (for a test property)."""
        d = dataclasses.asdict(self)
        d["examples_per_s"] = round(self.examples / max(self.seconds, 1e-9), 2)
        d["seconds"] = round(self.seconds, 2)
        return d


_NAMESPACES = itertools.count(1)


def _tenant_kw(tenant: str | None) -> dict[str, Any]:
    """``make_request`` keywords of a tenant label (``salt:x`` / ``lora:x``)."""
    if not tenant:
        return {}
    kind, _, name = tenant.partition(":")
    if kind == "salt":
        return {"cache_salt": name}
    if kind == "embeds":
        return {"prompt_embeds": _embedder(name)}
    from vllm.lora.request import LoRARequest

    return {"lora_request": LoRARequest(name, 1, f"/nonexistent/{name}")}


class Explorer:
    """One event sequence on one rig: the calls a replay script makes.

    Every public method appends its call to :attr:`log`; a broken invariant
    raises :class:`ExplorationFailure` with the log as a script.

    Args:
        make_rig: ``**kw -> Rig`` (:func:`tvc.contract.make_rig` bound to the
            profile and scratch); called again on :meth:`restart`.
        chunk: tokens per stored unit (``connector.granularity`` at B).
        family: the :class:`Family`.
        policy: ``kv_load_failure_policy`` (``recompute`` / ``fail``).
        kv_transfer_config: the profile's dict; wrapped in
            :class:`tvc.contract.faults.FaultInjectingConnector` for ``family.faults``.
        injector_for: ``rig -> store fault injector or None``
            (:func:`tvc.contract.faults.fault_injector_for`).
        stats: shared counters.
        label: names the profile in the replay script.
        scratch: store paths inside it move to ``<scratch>/explore/<n>``: every
            sequence starts from an empty store of its own (a restart keeps it).
        known: ``(regex, reason)`` of the profile's ``[[known_failures]]`` for this
            test; a match raises :class:`KnownDefectReached` instead.
        lead_chunks: whole chunks prepended to every prompt of at least one chunk
            (:func:`lead_chunks_for`).

    """

    def __init__(self, make_rig: Callable[..., Any], chunk: int, family: Family,
                 policy: str = "recompute",
                 kv_transfer_config: dict[str, Any] | None = None,
                 injector_for: Callable[[Any], Any] | None = None,
                 stats: Stats | None = None, label: str = "example",
                 scratch: Path | None = None,
                 known: Sequence[tuple[str, str]] = (),
                 lead_chunks: int = 0) -> None:
        self.make_rig, self.chunk, self.family = make_rig, chunk, family
        self.lead = lead_chunks
        self.policy, self.stats = policy, stats or Stats()
        self.injector_for = injector_for
        self.ns = f"{run_seed()}-{next(_NAMESPACES)}"
        b = BLOCK_SIZE
        max_len = (MAX_CHUNKS + lead_chunks) * chunk + b + 1
        #: the longest prompt (a replay of a replay is cut to it): with its
        #: decode it fits the preemption family's pool, as vLLM's startup check
        #: makes max_model_len fit the KV cache
        self.max_len = max_len
        per_req = -(-(max_len + MAX_DECODE) // b)
        self.num_blocks = (per_req + 3 if family.preemption
                           else MAX_SEQS * (per_req + 1) * 2 + 8)
        self.ktc: dict[str, Any] | None = None
        if kv_transfer_config is not None:
            ktc = dict(kv_transfer_config, kv_load_failure_policy=policy)
            if scratch is not None:
                from tvc.core.run_store import isolate_store_paths

                ktc = isolate_store_paths(ktc, scratch,
                                          root=scratch / "explore" / self.ns)
            if family.faults:
                from tvc.contract.faults import wrap_kv_transfer_config

                ktc = wrap_kv_transfer_config(ktc, "fail_load", every=10**9)
            self.ktc = ktc
        self.log: list[str] = [
            f"ex = replay_explorer({label!r}, family={family.name!r}, "
            f"policy={policy!r})"]
        self.prompts: list[list[int]] = []
        self.prompt_tenant: list[str | None] = []
        self.reqs: dict[str, Any] = {}
        self.tenant: dict[str, str | None] = {}
        self.content: dict[str, list[int]] = {}
        self.max_computed: dict[str, int] = {}
        self.last_computed: dict[str, int] = {}  # at the last step's end
        self.preempted_prefill_ids: list[str] = []
        self.answers_seen: dict[str, int] = {}
        self.first_checked: set[str] = set()
        self.reported: set[str] = set()
        #: request id -> engine steps in which blocks of it were reported failed
        self.fail_cycles: dict[str, int] = {}
        self.wait_steps: dict[str, int] = {}
        self.wait_since: dict[str, float] = {}  # first wait step's monotonic time
        #: request id -> consecutive steps it has waited since its receive ended
        self.resume_wait: dict[str, int] = {}
        #: consecutive steps that scheduled nothing while such a request waited
        self.idle_steps = 0
        self._async_seen = 0
        self.armed: list[tuple[str, str]] = []
        self.delay_left = 0
        self.delay_total = 0
        self.held: tuple[set[str], set[str]] = (set(), set())
        self._fail_save: contextlib.ExitStack | None = None
        self.failed = False
        self.stopped = False
        self.known = list(known)
        self.rig: Any = None
        self.injector: Any = None
        self.store_mark: Any = None
        self._build()

    # ------------------------------------------------------------- rig
    def _build(self) -> None:
        kw: dict[str, Any] = dict(block_size=BLOCK_SIZE, num_blocks=self.num_blocks,
                                  max_num_seqs=MAX_SEQS)
        if self.family.preemption:
            kw["max_num_batched_tokens"] = PREFILL_BUDGET
        if self.ktc is not None:
            kw["kv_transfer_config"] = self.ktc
        self.rig = self.make_rig(**kw)
        # the drain's stall limit outlasts the per-request one, which names why
        # a load never finishes (a failed entry matched again, get_finished)
        self.load_wait_s = self.rig.driver.min_stall_s  # transfer_timeout_s
        self.rig.driver.min_stall_s = self.load_wait_s + 2.0
        self._async_seen = 0
        self._note_standin()
        _hold_distributed()
        if self.worker is not None:
            # vLLM's recompute policy keeps a failed load's blocks cached and
            # counts on the failed request recomputing them (ConnectorWorker.
            # heal_reported): an abort or preemption first is vLLM's gap
            self.worker.heal_reported = True
        d = self.rig.driver
        d.before_worker = self._between_lookup_and_load
        sched = self.rig.scheduler
        orig_update = sched.update_from_output

        def update(so: Any, mro: Any) -> Any:
            kv = getattr(mro, "kv_connector_output", None)
            bad = set(getattr(kv, "invalid_block_ids", None) or ())
            if bad:
                for rid in list(sched.requests):
                    with contextlib.suppress(Exception):
                        ids = sched.kv_cache_manager.get_block_ids(rid)[0]
                        if bad & set(ids):
                            self.reported.add(rid)
                            self.fail_cycles[rid] = self.fail_cycles.get(rid, 0) + 1
                            self.stats.failed_loads_reported += 1
            return orig_update(so, mro)

        sched.update_from_output = update
        if self.injector_for is not None and self.injector is None:
            self.injector = self.injector_for(self.rig)
            self.store_mark = self.injector.mark() if self.injector else None
        elif self.injector is not None and hasattr(self.injector, "connector"):
            # an injector on the connector object follows the new connector
            self.injector = self.injector_for(self.rig)  # type: ignore[misc]
        self._wrapped_worker: Any = None

    def _note_standin(self) -> None:
        """Add the rig's stand-in worker, if any, to ``stats.standins``."""
        label = getattr(self.rig.driver.worker, "standin_label", "")
        if label and label not in self.stats.standins:
            self.stats.standins.append(label)

    def close(self) -> None:
        """Release the rig (KV tensors, vLLM's distributed state, sockets)."""
        w = self.worker
        if w is not None:
            self.stats.unrecomputed_reads += len(w.unrecomputed_reads)
            w.unrecomputed_reads.clear()
        self._note_standin()
        if self._fail_save is not None:
            self._fail_save.close()
            self._fail_save = None
        self.rig.close()

    @property
    def worker(self) -> ConnectorWorker | None:
        """The connector's real worker side, or None (stand-in)."""
        w = self.rig.driver.worker
        return w if isinstance(w, ConnectorWorker) else None

    # ------------------------------------------------------------- events
    def add(self, chunks: int, tail: int, prefix_of: int | None = None,
            prefix_blocks: int | None = None, twin: bool = False,
            tenant: str | None = None, max_tokens: int = 2,
            replay_of: int | None = None) -> list[str]:
        """Add a request (two identical ones with ``twin``) to the scheduler.

        Args:
            chunks: whole chunks of the prompt (0 to :data:`MAX_CHUNKS`).
            tail: tokens after them (>= 1).
            prefix_of: index of an earlier prompt this one starts with.
            prefix_blocks: blocks of it shared (None: as much as fits).
            twin: two requests with this prompt before the next step.
            tenant: None, ``salt:<cache_salt>``, ``lora:<adapter>``, ``embeds:<table>``
                or ``same`` (with ``replay_of``: that prompt's tenant).
            replay_of: index of an earlier prompt repeated whole, then ``tail - 1``
                fresh tokens (``chunks`` and the prefix arguments are ignored).
            max_tokens: output tokens.

        Returns:
            the request ids added.

        """
        self.log.append(f"ex.add(chunks={chunks}, tail={tail}, "
                        f"prefix_of={prefix_of}, prefix_blocks={prefix_blocks}, "
                        f"twin={twin}, tenant={tenant!r}, max_tokens={max_tokens}, "
                        f"replay_of={replay_of})")
        return self._add(chunks, tail, prefix_of, prefix_blocks, twin, tenant,
                         max_tokens, replay_of)

    def _add(self, chunks: int, tail: int, prefix_of: int | None,
             prefix_blocks: int | None, twin: bool, tenant: str | None,
             max_tokens: int, replay_of: int | None) -> list[str]:
        idx = len(self.prompts)
        rng = random.Random(f"{self.ns}-{idx}")
        if replay_of is not None and self.prompts:
            src = self.prompts[replay_of % len(self.prompts)]
            toks = (list(src) + [rng.randrange(10, TINY_VOCAB_SIZE)
                                 for _ in range(tail - 1)])[:self.max_len]
            n = len(toks)
            self.stats.shared_prefix += 1
        else:
            n = (chunks + (self.lead if chunks else 0)) * self.chunk + tail
            if n < 2 and not self.family.one_token:
                n = 2
            toks = [rng.randrange(10, TINY_VOCAB_SIZE) for _ in range(n)]
        if replay_of is None and prefix_of is not None and self.prompts:
            src = self.prompts[prefix_of % len(self.prompts)]
            k = len(src) if prefix_blocks is None else prefix_blocks * BLOCK_SIZE
            k = min(k, len(src), n)
            toks[:k] = src[:k]
            self.stats.shared_prefix += 1
        if tenant == "same":
            tenant = (self.prompt_tenant[replay_of % len(self.prompts)]
                      if replay_of is not None and self.prompts else None)
        self.prompts.append(toks)
        self.prompt_tenant.append(tenant)
        ids = []
        for _ in range(2 if twin else 1):
            r = make_request(num_tokens=n, block_size=BLOCK_SIZE, shared_prefix=toks,
                             max_tokens=max_tokens, **_tenant_kw(tenant))
            self.reqs[r.request_id] = r
            self.tenant[r.request_id] = tenant
            # the prompt's own token ids (an embeddings-only request's are 0s)
            self.content[r.request_id] = list(toks)
            self.rig.driver.add(r)
            ids.append(r.request_id)
        self.stats.requests += len(ids)
        self.stats.twins += int(twin)
        self.stats.tenant_requests += len(ids) if tenant else 0
        return ids

    def crowd(self, replay_of: int | None = None) -> list[str]:
        """Two decoding requests ahead of the longest prefill, in a full pool.

        Two ``B - 1``-token prompts (:data:`MAX_DECODE` output tokens) prefill first;
        in the ``preemption`` pool their second blocks leave the longest prompt (or
        ``replay_of``) too few blocks, so vLLM preempts it midway
        (``Scheduler.schedule``) and resumes it on other blocks. Returns the request
        ids (the decoders, then the long one).
        """
        self.log.append(f"ex.crowd(replay_of={replay_of})")
        ids = [i for _ in range(2) for i in self._add(0, BLOCK_SIZE - 1, None, None,
                                                      False, None, MAX_DECODE,
                                                      None)]
        self._step()
        if replay_of is not None and self.prompts:
            return ids + self._add(0, 1, None, None, False, None, 8, replay_of)
        return ids + self._add(MAX_CHUNKS, BLOCK_SIZE + 1, None, None, False, None,
                               8, None)

    def warm(self, prompts: list[tuple[int, int]], tenant: str | None = None
             ) -> None:
        """Store prompts ``(chunks, tail)``: add them, drain, reset the prefix cache."""
        self.log.append(f"ex.warm({prompts!r}, tenant={tenant!r})")
        for chunks, tail in prompts:
            self._add(chunks, tail, None, None, False, tenant, 2, None)
        self._drain("after storing the warm-up prompts")
        if self.rig.scheduler.reset_prefix_cache():
            self.stats.resets += 1
            if self.worker is not None:
                self.worker.zero()

    def step(self, count: int = 1) -> None:
        """Run ``count`` engine steps, checking every invariant after each."""
        self.log.append(f"ex.step({count})")
        for _ in range(count):
            self._step()

    def abort(self, state: str, pick: int = 0) -> str | None:
        """Abort (``FINISHED_ABORTED``) a request in ``state`` (an ABORT_STATES name).

        Runs up to :data:`ABORT_STEPS` steps to reach ``state``; failing that, aborts
        a live request in another state (``pick`` chooses). Returns its id, or None
        when no request is live.
        """
        from vllm.v1.request import RequestStatus

        self.log.append(f"ex.abort({state!r}, pick={pick})")
        for tries in range(ABORT_STEPS + 1):
            live = {rid: r for rid, r in self.rig.scheduler.requests.items()
                    if not r.is_finished()}
            cands = sorted(rid for rid, r in live.items() if r.status.name == state)
            if cands or not live or tries == ABORT_STEPS:
                break
            self._step()  # step towards the state (e.g. WAITING -> RUNNING)
        cands = cands or sorted(live)  # none in that state: any live request
        if not cands:
            return None
        rid = cands[pick % len(cands)]
        seen = live[rid].status.name
        self.rig.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        self.stats.aborts[seen] = self.stats.aborts.get(seen, 0) + 1
        return rid

    def reset_prefix_cache(self) -> bool:
        """``Scheduler.reset_prefix_cache()``; on success zero the worker's KV.

        Returns whether vLLM reset it (it refuses while a request holds blocks).
        """
        self.log.append("ex.reset_prefix_cache()")
        ok = bool(self.rig.scheduler.reset_prefix_cache())
        if ok:
            self.stats.resets += 1
            if self.worker is not None:
                self.worker.zero()
        return ok

    def restart(self) -> None:
        """Drain and check for leaks; then a new scheduler, connector and worker.

        The same kv_transfer_config, so the same store.
        """
        self.log.append("ex.restart()")
        self._drain("before the restart")
        self.close()
        self._build()
        self.stats.restarts += 1

    def fault(self, kind: str, phase: str) -> None:
        """Arm a fault that fires when the connector reaches ``phase``.

        ``kind``: ``lose`` / ``tear`` / ``corrupt`` / ``fail_save`` / ``delay`` (3
        steps) / ``fail`` (:mod:`tvc.contract.faults` ``fail_load``); ``phase``:
        ``matched`` / ``loaded`` / ``loading`` / ``saving`` (docs/exploration.md,
        "Events"). A store injector with ``between_lookup_and_load = False`` fires
        when nothing is in flight instead (an eviction).
        """
        self.log.append(f"ex.fault({kind!r}, {phase!r})")
        if kind == "fail":
            self._arm_fail_load()
        else:
            self.armed.append((kind, phase))

    def finish(self) -> None:
        """Drain (run until idle) and check that nothing leaked."""
        self.log.append("ex.finish()")
        self._drain("at the end")

    def drain(self) -> None:
        """Run until no request is left, check that nothing leaked (mid-sequence)."""
        self.log.append("ex.drain()")
        self._drain("after draining")

    # ------------------------------------------------------------- faults
    def fault_kinds(self) -> list[str]:
        """The fault kinds this rig can make (store injector, worker, wrapper)."""
        kinds = ["delay", "fail"] if self.family.faults else []
        inj = self.injector
        if inj is not None and self.family.faults:
            kinds += [k for k in ("lose", "tear", "corrupt") if k in inj.kinds]
            if "fail_save" in inj.kinds and self.worker is not None:
                kinds.append("fail_save")
        return kinds

    def _arm_fail_load(self) -> None:
        conn = self.rig.scheduler.connector
        counter = getattr(conn, "_counter", None)
        if counter is None:
            return
        stats = self.stats

        class Once:
            armed = True
            decided: dict[Any, bool] = {}

            def hit(self, key: Any) -> bool:
                if key in self.decided:
                    return self.decided[key]
                self.decided[key] = self.armed
                if self.armed:
                    stats.faults["fail"] = stats.faults.get("fail", 0) + 1
                self.armed = False
                return self.decided[key]

        conn._counter = Once()

    def _phases_now(self, in_step: bool) -> set[str]:
        """Phases the connector is in at this moment (see :meth:`fault`)."""
        out: set[str] = set()
        d = self.rig.driver
        for rid, r in self.rig.scheduler.requests.items():
            answers = [a for a in d.matched.get(rid, ()) if a[1]]
            st = r.status.name
            if st == "WAITING_FOR_REMOTE_KVS":
                out.add("loading")
                if in_step:
                    out.add("matched")
            if st == "RUNNING" and answers:
                out.add("loaded")
            if r.num_computed_tokens > 0 and (st == "RUNNING" or r.is_finished()):
                out.add("saving")
        if in_step and any(d.matched.get(nr.req_id) and d.matched[nr.req_id][-1][1]
                           for nr in getattr(self, "_so_new", ())):
            out.add("matched")
        return out

    def _fire(self, in_step: bool) -> None:
        if not self.armed:
            return
        now = self._phases_now(in_step)
        inj = self.injector
        # an injector that cannot act between lookup and load (a store that is
        # an object of the connector) damages entries only while nothing is in
        # flight: an eviction before the next lookups
        quiet = not in_step and not self.rig.scheduler.requests
        keep = []
        for kind, phase in self.armed:
            store = kind in ("lose", "tear", "corrupt")
            late = store and inj is not None and not inj.between_lookup_and_load
            ready = quiet if late else phase in now
            if not ready or not self._apply(kind, in_step):
                keep.append((kind, phase))
        self.armed = keep

    def _apply(self, kind: str, in_step: bool) -> bool:
        """Make the fault now; False when it cannot act yet (stays armed)."""
        if kind == "delay":
            self.delay_left = 3
            self.delay_total += 3
        elif kind == "fail_save":
            w = self.worker
            if w is None or self.injector is None or not in_step:
                return False
            self._fail_save = contextlib.ExitStack()
            self._fail_save.enter_context(self.injector.failing_saves(w))
        else:
            inj = self.injector
            if inj is None or (in_step and not inj.between_lookup_and_load):
                return False
            from tvc.contract.faults import ForeignWriter

            try:
                entries = inj.entries_since(self.store_mark)
            except ForeignWriter as exc:
                self.stats.foreign = self.stats.foreign or str(exc)
                return False
            if not entries:
                return False
            getattr(inj, kind)(entries)
            refused = getattr(inj, "refused", ())
            if refused and not self.stats.foreign:
                self.stats.foreign = (f"store fault not injected: {refused[0]} "
                                      "changed after the connector wrote it "
                                      "(another writer?), so it was left as it is")
        self.stats.faults[kind] = self.stats.faults.get(kind, 0) + 1
        return True

    def _wrap_worker_for_delay(self) -> None:
        """Hold completions back while ``delay_left`` > 0 (a slow transfer)."""
        w = self.rig.driver.worker
        if w is None or w is self._wrapped_worker:
            return
        self._wrapped_worker = w
        if isinstance(w, ConnectorWorker):
            c = w.connector
            orig = c.get_finished

            def get_finished(ids: set[str]) -> Any:
                s, r = orig(ids)
                hs, hr = self.held
                hs |= set(s or ())
                hr |= set(r or ())
                if self.delay_left > 0:
                    return set(), set()
                self.held = (set(), set())
                return (hs or None), (hr or None)

            c.get_finished = get_finished
        elif hasattr(w, "pending") and hasattr(w, "execute"):
            orig_exec = w.execute

            def execute(so: Any, meta: Any) -> Any:
                if self.delay_left <= 0:
                    return orig_exec(so, meta)
                held, w.pending = w.pending, []
                try:
                    return orig_exec(so, meta)
                finally:
                    w.pending = held + w.pending

            w.execute = execute

    # ------------------------------------------------------------- stepping
    def _between_lookup_and_load(self, so: Any) -> None:
        """Driver hook after ``schedule()``: poison async loads' slots, fire faults."""
        self._so_new = list(so.scheduled_new_reqs)
        d = self.rig.driver
        self.stats.async_loads += d.async_loads_started - self._async_seen
        self._async_seen = d.async_loads_started
        if self.family.faults:
            self._wrap_worker_for_delay()
            self._fire(in_step=True)

    def _script(self) -> str:
        return "\n".join(["from tvc.contract.explore import replay_explorer",
                          *self.log])

    def fail(self, invariant: str, detail: str, method: str = "") -> None:
        """Raise :class:`ExplorationFailure` with this sequence's replay script."""
        self.failed = True
        self._count()
        exc = ExplorationFailure(invariant, detail, self._script(), method)
        import re

        for pattern, reason in self.known:
            if re.search(pattern, str(exc)):
                self.stopped = True
                self.stats.known[reason] = self.stats.known.get(reason, 0) + 1
                self.stats.known_first.setdefault(reason, str(exc))
                raise KnownDefectReached(reason) from exc
        _BROKEN.append(exc)
        raise exc

    def _step(self) -> None:
        try:
            self.rig.driver.step()
        except Stuck as exc:
            import re

            call = re.search(r": (\S+) \(\w+ side[^)]*\) never returned", str(exc))
            self.fail("every connector call returns", str(exc),
                      call.group(1) if call else "")
        except EngineStepError as exc:
            msg = str(exc)
            where = msg.split(" inside ", 1)[1].split(" (", 1)[0] if (
                " inside " in msg) else ""
            self.fail("no exception escapes an engine step", msg, where)
        except AssertionError as exc:
            msg = str(exc)
            if "get_num_new_matched_tokens" in msg:
                self.fail("matched tokens within the prompt", msg)
            from tvc.contract.driver import connector_call
            from tvc.core.error_hints import describe_failure

            where, _ = connector_call(exc)
            self.fail("no exception escapes an engine step",
                      f"engine step {self.rig.driver.num_steps}: "
                      f"{describe_failure(exc)}{where}",
                      where.split(" inside ", 1)[-1].split(" (", 1)[0]
                      if " inside " in where else "")
        finally:
            if self._fail_save is not None:
                self._fail_save.close()
                self._fail_save = None
        self.stats.steps += 1
        if self.delay_left > 0:
            self.delay_left -= 1
        self.check()
        if self.family.faults:
            self._fire(in_step=False)

    def _drain(self, when: str) -> None:
        d = self.rig.driver
        try:
            if not d.step_until_idle(self._step):
                left = {r: q.status.name
                        for r, q in self.rig.scheduler.requests.items()}
                if left and all(q.is_finished() for q in
                                self.rig.scheduler.requests.values()):
                    why = d.why_finished_stay(left)
                    self.fail("no block or request leaks",
                              f"{when}: finished requests {sorted(left)} never left "
                              f"the scheduler after {d.max_steps} steps: {why}",
                              "get_finished (an aborted receive never named in "
                              "finished_recving)" if "finished_sending" not in why
                              else "")
                self.fail("every load finishes",
                          f"{when}: requests still in the scheduler after "
                          f"{d.max_steps} steps without progress: {left}")
            for _ in range(4):
                self._step()
            assert_scheduler_empty_and_no_leaked_blocks(self.rig.scheduler)
        except ExplorationFailure:
            raise
        except AssertionError as exc:
            self.fail("no block or request leaks", f"{when}: {exc}")

    # ------------------------------------------------------------- invariants
    def check(self) -> None:
        """Every invariant, after a step (see the module doc)."""
        self._check_loads()
        self._check_answers()
        self._check_first_compute()
        self._check_errors_and_progress()
        self._count()

    def _count(self) -> None:
        """Track computed tokens and preemptions (also when a step failed).

        Tokens a step computed count even where vLLM then rolled the request back
        (a reported load failure): the worker wrote their KV, and a connector
        that saved it stored what was computed.
        """
        history = self.rig.driver.history
        ran = history[-1].computed if history else {}
        for rid, r in self.reqs.items():
            self.max_computed[rid] = max(self.max_computed.get(rid, 0),
                                         r.num_computed_tokens, ran.get(rid, 0))
            if r.num_preemptions and r.num_preemptions > (
                    self.max_computed.get(("p", rid), 0)):  # type: ignore[arg-type,call-overload]
                self.stats.preemptions += 1
                if self.last_computed.get(rid, 0) < r.num_prompt_tokens:
                    self.stats.preempted_prefills += 1
                    self.preempted_prefill_ids.append(rid)
                if r.num_preemptions == 2:
                    self.stats.preempted_again += 1
                self.max_computed[("p", rid)] = r.num_preemptions  # type: ignore
            self.last_computed[rid] = r.num_computed_tokens

    def _check_loads(self) -> None:
        w = self.worker
        if w is not None and w.freed_uses:
            self.fail("no write into a free block",
                      f"{len(w.freed_uses)} block(s): {w.freed_uses[0]}")
        if w is not None and w.load_errors:
            err = w.load_errors[0]
            invariant, method = blame(err) or ("loaded KV bit-identical", "")
            if SHORT_LOAD in err and invariant == "loaded KV bit-identical":
                method = ("get_num_new_matched_tokens (matched tokens its store does "
                          "not hold) or start_load_kv (a load stopping short)")
            ids = self._preempted_sharing(err)
            if ids and ("another block of its own table" in err
                        or "handed it to that request" in err):
                invariant = "no block table kept across a preemption"
                method = FREED_INVARIANTS[invariant]
                err += (f"; request(s) {', '.join(ids[:4])} of this sequence were "
                        "preempted midway through their prefill and resumed on "
                        "other block ids: a connector that keeps (or appends to) "
                        "the block table of before a preemption saves and loads "
                        f"through blocks the request no longer has. Fix: {RESUME_FIX}")
            self.fail(invariant, f"{len(w.load_errors)} request(s): {err}", method)

    def _preempted_sharing(self, err: str) -> list[str]:
        """Requests preempted midway whose prompt shares the failing load's tokens."""
        import re

        m = re.search(r"request (\S+): .*?token (\d+) ", err)
        if not m or m.group(1) not in self.content:
            return []
        toks, pos = self.content[m.group(1)], int(m.group(2))
        return [rid for rid in self.preempted_prefill_ids
                if self.content.get(rid, [])[:pos + 1] == toks[:pos + 1]]

    def _backing(self, rid: str, k: int) -> tuple[int, int]:
        """Longest prefix of ``rid``'s prompt computed before now, in tokens.

        Returns ``(same tenant and adapter, any tenant)``; ``rid`` itself counts (a
        preempted request may get its own tokens back from the store).
        """
        def common(a: Sequence[int], b: Sequence[int]) -> int:
            m = 0
            for x, y in zip(a[:k], b, strict=False):
                if x != y:
                    break
                m += 1
            return m

        toks = self.content[rid]
        seen = list(self.reqs[rid].all_token_ids)  # an embeds prompt's: 0s
        same = other = 0
        for eid, e in self.reqs.items():
            done = self.max_computed.get(eid, 0)
            if not done:
                continue
            m = common(toks, (self.content[eid] + list(e.output_token_ids))[:done])
            if self.tenant[eid] == self.tenant[rid]:
                same = max(same, m)
            # another tenant's tokens as the connector sees them (token ids,
            # 0s for prompt_embeds) back a hit across tenants
            other = max(other, m, common(seen, list(e.all_token_ids)[:done]))
        return same, other

    def _check_answers(self) -> None:
        d = self.rig.driver
        for rid, answers in d.matched.items():
            seen = self.answers_seen.get(rid, 0)
            if seen == len(answers) or rid not in self.reqs:
                continue
            self.answers_seen[rid] = len(answers)
            for local, n, _is_async in answers[seen:]:
                if not n:
                    continue
                self.stats.hits += 1
                total = local + int(n)
                same, other = self._backing(rid, total)
                if total <= same:
                    continue
                r = self.reqs[rid]
                if total <= other:
                    self.fail(
                        "no hit across tenants or adapters",
                        f"request {rid} (tenant {self.tenant[rid]!r}) matched {n} "
                        f"external tokens (local {local}): only requests of another "
                        f"tenant, adapter or embeddings computed its first {total} "
                        "tokens "
                        f"(the same tenant computed {same}). The connector ignores "
                        "cache_salt / the LoRA adapter / prompt_embeds (an "
                        "embeddings-only request's token ids are all 0) when keying "
                        "its store: key entries by vLLM's block hashes")
                if (self.tenant[rid] or "").startswith("embeds:"):
                    # its token ids are all 0: any embeddings prompt of this
                    # length, stored by anyone at any time, has the same ones
                    self.fail(
                        "no hit across tenants or adapters",
                        f"embeddings-only request {rid} ({r.num_prompt_tokens} "
                        f"tokens, tenant {self.tenant[rid]!r}) matched {n} external "
                        f"tokens (local {local}), but no request with these "
                        f"embeddings computed more than {same} of its first "
                        f"{total} tokens: its token ids are all 0, so a key of "
                        "token ids matches any embeddings prompt of that length. "
                        "The connector ignores prompt_embeds when keying its "
                        "store: key entries by vLLM's block hashes")
                self.fail(
                    "no hit nobody stored",
                    f"request {rid} ({r.num_prompt_tokens} tokens) matched {n} "
                    f"external tokens beyond local {local} (total {total}), but no "
                    f"request computed more than {other} of its first tokens "
                    "before this lookup: the connector claims KV nobody stored")

    def _check_first_compute(self) -> None:
        d = self.rig.driver
        for rid, (computed, _scheduled) in list(d.first_compute.items()):
            if rid in self.first_checked or rid not in self.reqs:
                continue
            self.first_checked.add(rid)
            r = self.reqs[rid]
            answers = [a for a in d.matched.get(rid, ()) if a[1] is not None]
            local, n = (answers[-1][0], int(answers[-1][1])) if answers else (0, 0)
            if n <= 0:
                continue
            want = min(local + n, r.num_prompt_tokens - 1)
            ok = computed == want or (rid in self.reported and computed <= want)
            if computed > want or not ok:
                self.fail(
                    "local + external = num_computed_tokens",
                    f"request {rid} ({r.num_prompt_tokens} tokens): vLLM's local hit "
                    f"{local} + the connector's match {n} = {local + n} (at most "
                    f"len - 1 = {r.num_prompt_tokens - 1} computed), but it first "
                    f"computed from token {computed}"
                    + ("" if rid in self.reported else
                       " and no load failure was reported for it"))
            if computed > local:
                self.stats.loads += 1

    def _check_errors_and_progress(self) -> None:
        """Failed requests were reported; loads end; vLLM resumes ended loads.

        Only the wait before ``finished_recving`` counts against
        :data:`MAX_LOAD_STEPS`; after it vLLM holds the request in
        ``Scheduler.finished_recving_kv_req_ids`` (0.26-0.33) until
        ``_try_promote_blocked_waiting_request``'s walk reaches it
        (``vllm/v1/core/sched/scheduler.py`` 0.28.0 L748-L777, L1047). An idle engine
        meanwhile is vLLM's scheduler deadlock ("vLLM resumes a finished load").
        """
        sched = self.rig.scheduler
        recv_done = getattr(sched, "finished_recving_kv_req_ids", ())
        history = self.rig.driver.history
        idle = not (history and history[-1].scheduled)
        ended = []
        poll = False
        for rid, r in self.reqs.items():
            if r.status.name == "FINISHED_ERROR" and rid not in self.reported:
                self.fail("failed load reported, only that request failed",
                          f"request {rid} ended FINISHED_ERROR although no load "
                          "failure was reported for it (get_block_ids_with_load_"
                          "errors named none of its blocks)")
            if r.status.name == "FINISHED_ERROR" and self.policy != "fail":
                self.fail("failed load reported, only that request failed",
                          f"request {rid} ended FINISHED_ERROR under "
                          "kv_load_failure_policy=recompute (it must be recomputed)")
            if r.status.name != "WAITING_FOR_REMOTE_KVS" or rid not in recv_done:
                self.resume_wait.pop(rid, None)
            if r.status.name == "WAITING_FOR_REMOTE_KVS" and rid in recv_done:
                # the receive ended: vLLM's scheduler resumes the request
                self.resume_wait[rid] = self.resume_wait.get(rid, 0) + 1
                self.stats.max_resume_wait = max(self.stats.max_resume_wait,
                                                 self.resume_wait[rid])
                ended.append(rid)
            elif r.status.name == "WAITING_FOR_REMOTE_KVS":
                self.wait_steps[rid] = self.wait_steps.get(rid, 0) + 1
                waited = time.monotonic() - self.wait_since.setdefault(
                    rid, time.monotonic())
                over = self.wait_steps[rid] > MAX_LOAD_STEPS + self.delay_total
                if over and waited < self.load_wait_s:
                    poll = True  # a copy in flight may need wall time
                elif over:
                    cycles = self.fail_cycles.get(rid, 0)
                    if cycles >= 2:
                        self.fail(
                            "every load finishes",
                            f"request {rid} has waited for remote KV "
                            f"{self.wait_steps[rid]} steps, through {cycles} loads "
                            "that each failed (reported through get_block_ids_with_"
                            "load_errors, the receive ended): every time vLLM "
                            "retried it the connector matched the same tokens again. "
                            "vLLM retries a failed asynchronous load by asking "
                            "get_num_new_matched_tokens again (scheduler.py "
                            "_update_waiting_for_remote_kv frees the blocks, the "
                            "request waits again): an entry whose load failed must "
                            "miss from then on, or the request never runs",
                            "get_num_new_matched_tokens (matches again an entry "
                            "whose load failed)")
                    self.fail("every load finishes",
                              f"request {rid} has waited for remote KV "
                              f"{self.wait_steps[rid]} steps and {waited:.1f} s: "
                              "the connector never reports its load finished "
                              "(finished_recving) — a failed or faulted transfer "
                              "must still end, reported through "
                              "get_block_ids_with_load_errors (the limit is "
                              f"connector.transfer_timeout_s, {self.load_wait_s:g} "
                              "s; vLLM sets no bound: raise it for a slower "
                              "store)")
        if poll:
            time.sleep(STALL_POLL_S)
        self.idle_steps = self.idle_steps + 1 if ended and idle else 0
        if self.idle_steps > MAX_LOAD_STEPS + self.delay_total:
            self._fail_stranded(ended)

    def _fail_stranded(self, ended: list[str]) -> None:
        """Fail "vLLM resumes a finished load": ``ended`` wait, the engine idles."""
        sched = self.rig.scheduler
        kvm = sched.kv_cache_manager

        def held(rid: str) -> int:
            try:
                return len(kvm.get_block_ids(rid)[0])
            except Exception:  # noqa: BLE001 - a request holding none
                return 0

        queue = [q for name in ("kv_holding_waiting", "skipped_waiting", "waiting")
                 for q in getattr(sched, name, ()) or ()]
        order = ", ".join(
            f"{q.request_id} ({q.status.name}, {q.num_tokens} tokens, holds "
            f"{held(q.request_id)} blocks)" for q in queue) or "(none)"
        self.fail(
            "vLLM resumes a finished load",
            f"the engine scheduled nothing for {self.idle_steps} steps while "
            f"{', '.join(ended)} waited for remote KV although the connector had "
            "reported its receive finished (finished_recving; vLLM holds it in "
            "Scheduler.finished_recving_kv_req_ids): vLLM's scheduler resumes such "
            "a request only when its waiting-queue walk reaches it "
            "(_try_promote_blocked_waiting_request), and the walk stops at the "
            "first request it cannot allocate. Waiting, in vLLM's queue order: "
            f"{order}; {kvm.block_pool.get_num_free_blocks()} blocks free, nothing "
            "runs, so no block is ever freed: a scheduler deadlock, not the "
            "connector's (vLLM 0.26-0.28 keep a finished asynchronous load in "
            "skipped_waiting behind a request holding no block; 0.33 drains "
            "kv_holding_waiting first)")


# ------------------------------------------------------------------ state machine
def make_machine(new_explorer: Callable[[str], Explorer], family: Family
                 ) -> type:
    """A hypothesis ``RuleBasedStateMachine`` over :class:`Explorer` events.

    ``new_explorer``: ``policy -> Explorer`` (a fresh rig per sequence); returns
    the machine class (run it with :func:`explore`).
    """
    from hypothesis import strategies as st
    from hypothesis.stateful import (
        RuleBasedStateMachine,
        initialize,
        precondition,
        rule,
    )

    tenants = st.sampled_from(TENANTS) if family.tenants else st.just(None)

    class ExplorationMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.ex: Explorer | None = None

        def _do(self, method: str, *args: Any) -> None:
            """Call ``self.ex.<method>(*args)`` unless the sequence stopped."""
            ex = self.ex
            if ex is None or ex.stopped:
                return
            with contextlib.suppress(KnownDefectReached):
                getattr(ex, method)(*args)

        @initialize(policy=st.sampled_from(["recompute", "fail"]) if family.faults
                    else st.just("recompute"),
                    warm=st.lists(st.tuples(st.integers(1, MAX_CHUNKS),
                                            st.integers(1, BLOCK_SIZE + 1)),
                                  max_size=3),
                    warm_tenant=tenants)
        def start(self, policy: str, warm: list[tuple[int, int]],
                  warm_tenant: str | None) -> None:
            """A fresh rig; ``warm`` prompts stored first (the prefix cache dropped)."""
            self.ex = new_explorer(policy)
            self.ex.stats.examples += 1
            if warm:
                self._do("warm", warm, warm_tenant)

        @rule(chunks=st.lists(st.integers(0, MAX_CHUNKS), min_size=1, max_size=3),
              tail=st.sampled_from([1, 2, BLOCK_SIZE // 2, BLOCK_SIZE - 1,
                                    BLOCK_SIZE, BLOCK_SIZE + 1]),
              prefix_of=st.none() | st.integers(0, 7),
              prefix_blocks=st.none() | st.integers(1, 6),
              twin=st.booleans(), tenant=tenants,
              max_tokens=st.sampled_from([1, 2, 8, MAX_DECODE]))
        def add(self, chunks: list[int], tail: int, prefix_of: int | None,
                prefix_blocks: int | None, twin: bool, tenant: str | None,
                max_tokens: int) -> None:
            """1 to 3 requests (``chunks[i]`` chunks + ``tail`` tokens) at once."""
            for c in chunks:
                if self.ex is not None and len(self.ex.rig.scheduler.requests) < \
                        2 * MAX_SEQS:
                    self._do("add", c, tail, prefix_of, prefix_blocks, twin,
                             tenant, max_tokens)

        # preconditions read only what the drawn choices decide (the family, the
        # rig made at start): a rule enabled by the engine's state (requests
        # running, faults armed) would change what hypothesis draws where
        # timing differs (asynchronous transfers on a GPU) and it would refuse
        # the sequence as "Inconsistent data generation"; such rules check the
        # state in their bodies and do nothing instead
        @precondition(lambda self: self.ex is not None)
        @rule(of=st.integers(0, 7), tail=st.sampled_from([1, 1, 2, BLOCK_SIZE]),
              twin=st.booleans(),
              tenant=(st.sampled_from(("same", "same", *TENANTS))
                      if family.tenants else st.just(None)),
              max_tokens=st.sampled_from([1, 2, 8, MAX_DECODE]),
              drain=st.booleans())
        def replay(self, of: int, tail: int, twin: bool, tenant: str | None,
                   max_tokens: int, drain: bool) -> None:
            """An earlier prompt again (``drain``: after dropping the prefix cache)."""
            if self.ex is None or not self.ex.prompts:
                return
            if drain:
                self._do("drain")
                self._do("reset_prefix_cache")
            self._do("add", 0, tail, None, None, twin, tenant, max_tokens, of)

        @precondition(lambda self: family.preemption and self.ex is not None)
        @rule(replay_of=st.none() | st.integers(0, 7))
        def crowd(self, replay_of: int | None) -> None:
            """Decoders ahead of a long prefill (does nothing while requests run)."""
            if self.ex is not None and not self.ex.rig.scheduler.requests:
                self._do("crowd", replay_of)

        @rule(count=st.integers(1, 3))
        def step(self, count: int) -> None:
            self._do("step", count)

        @rule(state=st.sampled_from(ABORT_STATES), pick=st.integers(0, 3))
        def abort(self, state: str, pick: int) -> None:
            self._do("abort", state, pick)

        @rule(what=st.sampled_from(["reset_prefix_cache", "restart"]))
        def maintenance(self, what: str) -> None:
            """Reset vLLM's prefix cache, or restart the connector (same store)."""
            self._do(what)

        @precondition(lambda self: family.faults and self.ex is not None)
        @rule(data=st.data(), phase=st.sampled_from(PHASES))
        def fault(self, data: Any, phase: str) -> None:
            assert self.ex is not None
            kinds = self.ex.fault_kinds()  # the rig's, fixed at start
            if kinds:
                kind = data.draw(st.sampled_from(kinds), label="kind")
                if len(self.ex.armed) < 2:  # at most two armed at once
                    self._do("fault", kind, phase)

        def teardown(self) -> None:
            ex = self.ex
            if ex is None:
                return
            # a Ctrl-C / SIGTERM (raised as KeyboardInterrupt) in a rule: stop,
            # never judge the half-run sequence (its failure would replace the
            # interrupt and hypothesis would replay it)
            stopping = isinstance(sys.exc_info()[1], KeyboardInterrupt)
            try:
                if not (ex.failed or ex.stopped or stopping):
                    with contextlib.suppress(KnownDefectReached):
                        ex.finish()
            finally:
                ex.close()

    ExplorationMachine.__name__ = f"ExplorationMachine_{family.name}"
    return ExplorationMachine


#: store and load faults every ``faults`` exploration makes first, each at the
#: phase where a connector must notice it (after a lookup matched, before the
#: load): a stored prompt, the fault armed, the prompt replayed
CANONICAL_FAULTS = ("lose", "tear", "corrupt", "fail")


def run_canonical(new_explorer: Callable[[str], Explorer], family: Family) -> int:
    """The fixed sequences a family explores before the drawn ones.

    They reach every run what a drawn sequence reaches on some seeds only:
    ``faults``: each :data:`CANONICAL_FAULTS` kind the rig can make at
    ``matched`` on ``warm([(2, 2)])`` replayed (a hit under every built-in hit
    rule; ExampleConnector misses ``len = k * B + 1``); ``preemption``:
    :func:`_stranded_load`, :meth:`Explorer.crowd`; ``one_token``:
    :func:`_one_token_prompt`; ``core``: :func:`_whole_prompt_hit` (at most
    ``len - 1`` matched), :func:`_extended_replay`.

    Returns:
        how many sequences ran.

    Raises:
        ExplorationFailure: an invariant broke (the sequence is its own minimal
            replay).

    """
    fixed: list[Callable[[Explorer], None]] = []
    if family.name == "core":
        fixed += [_whole_prompt_hit, _extended_replay]
    if family.one_token:
        fixed += [_one_token_prompt]
    if family.preemption:
        fixed += [_stranded_load, _preempted_prefill]
    for seq in fixed:
        ex = new_explorer("recompute")
        try:
            ex.stats.examples += 1
            with contextlib.suppress(KnownDefectReached):
                seq(ex)
        finally:
            ex.close()
    ran = len(fixed)
    if not family.faults:
        return ran
    for kind in CANONICAL_FAULTS:
        ex = new_explorer("recompute")
        try:
            if kind not in ex.fault_kinds():
                continue
            ex.stats.examples += 1
            ran += 1
            with contextlib.suppress(KnownDefectReached):
                ex.warm([(2, 2)])
                ex.fault(kind, "matched")
                ex.add(0, 1, replay_of=0)
                ex.finish()
        finally:
            ex.close()
    return ran


def _whole_prompt_hit(ex: Explorer) -> None:
    """A stored prompt of two whole chunks replayed exactly (at most len - 1)."""
    ex.warm([(1, ex.chunk)])
    ex.add(0, 1, replay_of=0, max_tokens=2)
    ex.finish()


def _extended_replay(ex: Explorer) -> None:
    """A stored prompt of one chunk and two tokens, replayed with chunk - 1 more.

    ExampleConnector looks the ``2 * chunk + 1``-token replay up under
    ``align(len - 1)`` tokens and loads the file of ``align(len)``.
    """
    ex.warm([(1, 2)])
    ex.add(0, ex.chunk, replay_of=0, max_tokens=2)
    ex.finish()


def _one_token_prompt(ex: Explorer) -> None:
    """A stored prompt shorter than a block, then a one-token prompt it starts.

    A lookup must match 0; ExampleConnector answers ``align(0) = -B``.
    """
    ex.warm([(0, BLOCK_SIZE // 2)])
    ex.add(0, 1, prefix_of=0, max_tokens=2)
    ex.finish()


def _preempted_prefill(ex: Explorer) -> None:
    """Two decoders ahead of a long prefill: preempted midway, resumed."""
    ex.crowd()
    ex.finish()


def _stranded_load(ex: Explorer) -> None:
    """An ended asynchronous load queued behind a request that holds no block.

    A connector that defers its lookup while chunks load (OffloadingConnector,
    ``offloading/scheduler.py`` ``_lookup``) leaves the longer prompt queued with
    no block; vLLM 0.26 / 0.28 then never resume the second load in the
    preemption pool (upstream: vllm-project/vllm#57841); 0.33 finishes it.
    """
    b = BLOCK_SIZE
    ex.warm([(2, b), (3, b)])
    ex.add(0, 1, replay_of=0, max_tokens=1)
    ex.add(3, b + 2, prefix_of=0, max_tokens=1)  # not k * B + 1: see example.toml
    ex.add(0, 1, replay_of=1, max_tokens=1)
    ex.finish()


#: new_explorer -> (family, examples, steps) -> its hypothesis test, built once
#: for the many seeds one factory explores (``selftests/contract/seed_sweep.py``)
_TESTS: weakref.WeakKeyDictionary[Callable[[str], Explorer],
                                  dict[tuple[str, int, int], Any]] = (
    weakref.WeakKeyDictionary())


def explore(new_explorer: Callable[[str], Explorer], family: Family, *,
            examples: int = DEFAULT_EXAMPLES, seed: int = 0,
            stats: Stats | None = None,
            steps: int = STEPS_PER_EXAMPLE, canonical: bool = True) -> Stats:
    """Run ``examples`` event sequences of ``family``; raise on the first failure.

    The fixed sequences (:func:`run_canonical`) run first when ``canonical``.
    Seeded by ``seed`` (the run's ``--tvc-seed``); no example database.
    ``examples`` is hypothesis's ``max_examples`` (>= 1), ``steps`` its
    ``stateful_step_count``; ``stats`` should be the object ``new_explorer``
    gives its explorers (a new one when None).

    Returns:
        the filled :class:`Stats` (``seconds``: wall time, s).

    Raises:
        ExplorationFailure: an invariant broke (the shrunk sequence's).

    """
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.stateful import run_state_machine_as_test

    stats = stats or Stats()
    s = settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                 database=None, derandomize=False, print_blob=False,
                 phases=[Phase.explicit, Phase.generate, Phase.shrink],
                 suppress_health_check=list(HealthCheck))
    try:
        from hypothesis.stateful import get_state_machine_test
    except ImportError:  # pragma: no cover - older hypothesis: fixed seed
        get_state_machine_test = None  # type: ignore[assignment]
    t0 = time.perf_counter()
    _BROKEN.clear()
    try:
        with _distributed_held():
            if canonical:
                run_canonical(new_explorer, family)
            if get_state_machine_test is not None:
                # one test per factory and budget: hypothesis parses this
                # module to build one (function_digest), ~0.2 s of CPU
                tests = _TESTS.setdefault(new_explorer, {})
                key = (family.name, examples, steps)
                if key not in tests:
                    tests[key] = get_state_machine_test(
                        make_machine(new_explorer, family), settings=s,
                        _min_steps=0, _flaky_state={"selecting_rule": False})
                test = hypothesis_seed(seed)(tests[key])
                try:
                    test()
                except BaseException as exc:
                    if _interrupted(exc):  # surface the interrupt itself
                        raise KeyboardInterrupt(str(exc)[:200]) from None
                    members = getattr(exc, "exceptions", None)
                    outcome = _test_outcome(exc)
                    if outcome is not None:  # e.g. strict mode's missing GPU
                        raise outcome from None
                    flaky = _flaky(exc)
                    if flaky and _BROKEN:
                        # a sequence broke an invariant and its replay did not:
                        # timing-dependent; the red is the invariant, unshrunk
                        first = _BROKEN[0]
                        first.add_note(
                            f"hypothesis could not replay this sequence the same "
                            f"way ({flaky}): the connector's behaviour depends on "
                            "timing, so the sequence was not shrunk")
                        raise first from None
                    if isinstance(members, tuple) and members:
                        # an exception group: hypothesis found several distinct
                        # failures; name each (the group's message names none)
                        parts = [f"{i}. {type(e).__name__}: {e}"
                                 for i, e in enumerate(members, 1)]
                        head = str(members[0]).split("\n", 1)[0]
                        raise AssertionError(
                            f"the exploration found {len(parts)} distinct "
                            f"failures; the first: {head}\n"
                            + "\n".join(parts)) from exc
                    raise
            else:  # pragma: no cover
                run_state_machine_as_test(make_machine(new_explorer, family),
                                          settings=settings(s, derandomize=True))
    finally:
        stats.seconds += time.perf_counter() - t0
    return stats


def _flaky(exc: BaseException) -> str:
    """The name of hypothesis's ``Flaky`` error ``exc`` is, or ''."""
    from hypothesis.errors import Flaky

    return type(exc).__name__ if isinstance(exc, Flaky) else ""


def _test_outcome(exc: BaseException) -> BaseException | None:
    """A pytest outcome (skip, fail) a sequence raised, else None.

    Hypothesis reports a ``pytest.fail`` (``tvc_missing_hardware`` under
    ``--tvc-require``) as a failing example: the test's outcome, not a broken
    invariant.
    """
    for e in (*getattr(exc, "exceptions", ()), exc):
        if not isinstance(e, Exception) and getattr(e, "exceptions", None) is None:
            return e
    return None


def _interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` is, wraps or follows a KeyboardInterrupt (Ctrl-C, SIGTERM)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, KeyboardInterrupt):
            return True
        todo.extend([c for c in (e.__cause__, e.__context__) if c is not None])
        todo.extend(getattr(e, "exceptions", ()))  # ExceptionGroup (Flaky...)
    return False


_HOLD: dict[str, bool] = {"active": False, "held": False}


@contextlib.contextmanager
def _distributed_held() -> Iterator[None]:
    """Keep vLLM's world-size-1 groups for the whole exploration.

    Saves a gloo rendezvous per sequence; also caps shrinking at
    :data:`SHRINK_SECONDS` (hypothesis's private ``MAX_SHRINKING_SECONDS``).
    """
    from tvc.contract import worker as W

    _HOLD.update(active=True, held=False)
    try:
        from hypothesis.internal.conjecture import engine
    except ImportError:  # pragma: no cover - private module moved: its default
        engine = None  # type: ignore[assignment]
    shrink_s = getattr(engine, "MAX_SHRINKING_SECONDS", None)
    if shrink_s is not None:
        engine.MAX_SHRINKING_SECONDS = SHRINK_SECONDS  # type: ignore[assignment]
    try:
        yield
    finally:
        if shrink_s is not None:
            engine.MAX_SHRINKING_SECONDS = shrink_s
        held = _HOLD["held"]
        _HOLD.update(active=False, held=False)
        if held and W._DIST["stack"] is not None:
            W._release_distributed()


def _hold_distributed() -> None:
    """Called after a rig is built: take one extra hold (once per exploration)."""
    from tvc.contract import worker as W

    if _HOLD["active"] and not _HOLD["held"] and W._DIST["stack"] is not None:
        W._DIST["users"] += 1
        _HOLD["held"] = True


def premises_missing(stats: Stats, family: Family) -> list[str]:
    """The premise events no sequence of ``stats`` has produced yet.

    A green from sequences that never hit or loaded proves nothing
    (docs/exploration.md lists the premises).
    """
    return [name for name, ok in (
        ("hit that loaded", stats.hits > 0 and stats.loads > 0),
        ("abort of a waiting request", stats.aborts.get("WAITING")),
        ("abort of a running request", stats.aborts.get("RUNNING")),
        ("shared prefix", stats.shared_prefix), ("twins", stats.twins),
        ("restart", stats.restarts),
        ("preemption", stats.preemptions > 0 or not family.preemption),
        ("preemption of a prefill midway",
         stats.preempted_prefills > 0 or not family.preemption),
        ("tenant request", stats.tenant_requests > 0 or not family.tenants),
        ("fault", stats.faults or not family.faults)) if not ok]


def selector(profile: Any) -> str:
    """What ``--tvc-profile`` takes to load ``profile`` again: a name or a path."""
    from tvc.config.profile import BUILTIN_DIR

    builtin = Path(profile.source).resolve() == (
        BUILTIN_DIR / f"{profile.name}.toml").resolve()
    return str(profile.name if builtin else profile.source)


def explorer_factory(profile: Any, scratch: Path, family: Family, *,
                     stats: Stats, known: Sequence[tuple[str, str]] = (),
                     label: str | None = None,
                     on_rig: Callable[[Any], None] | None = None,
                     rig_defaults: Mapping[str, Any] | None = None
                     ) -> Callable[[str], Explorer]:
    """``policy -> Explorer`` for one family of a profile.

    What the exploration test, :func:`replay_explorer` and
    ``selftests/contract/seed_sweep.py`` run: rigs from
    :func:`tvc.contract.make_rig` (the real worker where
    ``connector.worker_devices`` lists the device), the chunk at
    :data:`BLOCK_SIZE`, the store fault injector for family ``faults``.

    Args:
        profile: the loaded :class:`tvc.config.profile.Profile`.
        scratch: a suite-owned folder for the rigs.
        family: the :class:`Family`.
        stats: counters every explorer fills.
        known: ``(regex, reason)`` of the profile's known defects for the test.
        label: names the profile in replay scripts (default :func:`selector`).
        on_rig: called with every rig built.
        rig_defaults: :func:`tvc.contract.make_rig` keywords for every rig (the
            ``contract_rig_defaults`` fixture); default: CPU.

    """
    from tvc.contract import make_rig
    from tvc.contract.faults import fault_injector_for
    from tvc.contract.steps import chunk_tokens

    defaults = dict(rig_defaults or {})
    real = defaults.get("device", "cpu") in profile["connector"]["worker_devices"]
    chunk = chunk_tokens(profile, BLOCK_SIZE)
    name = label if label is not None else selector(profile)

    def rig(**kw: Any) -> Any:
        r = make_rig(profile, scratch, real_worker=real, **{**defaults, **kw})
        if on_rig is not None:
            on_rig(r)
        return r

    lead = lead_chunks_for(profile, chunk)

    def new_explorer(policy: str) -> Explorer:
        return Explorer(
            rig, chunk, family, policy, profile.kv_transfer_config(),
            (lambda r: fault_injector_for(profile, r)) if family.faults else None,
            stats=stats, label=name, scratch=profile.scratch, known=known,
            lead_chunks=lead)

    return new_explorer


def lead_chunks_for(profile: Any, chunk: int) -> int:
    """Whole chunks that bring the longest one-chunk prompt to the first hit.

    A hit rule with a threshold beyond one chunk + ``B + 1`` tokens would leave
    every drawn prompt unstored. Returns 0 where the first hit
    (:func:`tvc.contract.steps.first_hit_len`) is within that, or there is no
    rule; else the chunks to prepend.
    """
    from tvc.contract.steps import first_hit_len

    first = first_hit_len(profile, BLOCK_SIZE)
    longest = chunk + BLOCK_SIZE + 1
    return 0 if first is None else max(0, -(-(first - longest) // chunk))


def replay_explorer(profile: str, family: str = "core",
                    policy: str = "recompute") -> Explorer:
    """An :class:`Explorer` outside pytest, for a failure's replay script.

    ``profile``: a name or path (as ``--tvc-profile``); ``family``: a key of
    :data:`FAMILIES`; ``policy``: ``kv_load_failure_policy``.
    """
    import tempfile

    from tvc.config.profile import load

    scratch = Path(tempfile.mkdtemp(prefix="tvc-explore-"))
    return explorer_factory(load(profile), scratch, FAMILIES[family],
                            stats=Stats(), label=profile)(policy)
