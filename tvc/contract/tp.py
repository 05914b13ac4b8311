"""Worker harness at tensor parallelism N: one process per rank, vLLM's TP groups.

As in vLLM, each rank holds ``num_kv_heads // tensor_parallel_size`` (at least 1)
KV heads (``ModelConfig.get_num_kv_heads``) and runs the connector's worker side;
the per-rank outputs are merged by vLLM's ``KVOutputAggregator``
(``vllm/distributed/kv_transfer/kv_connector/utils.py``,
``Executor.init_kv_output_aggregator``). :class:`TPWorkerGroup` spawns the ranks
and serves steps like a :class:`tvc.contract.worker.ConnectorWorker`; each rank
writes its heads' share of one model-wide pattern (:func:`tp_pattern_values`);
:func:`run_tp` names the rank when ranks disagree about finished transfers.
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing as mp
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tvc.config.profile import Profile
from tvc.contract.builders import (
    DEFAULT_NUM_BLOCKS,
    make_kv_cache_config,
    make_scheduler,
    make_vllm_config,
)
from tvc.contract.distributed import free_init_method, vllm_distributed
from tvc.contract.driver import EngineDriver
from tvc.contract.layout import decide_model_runner, vllm_env
from tvc.contract.rig import SchedulerSideMixin
from tvc.contract.worker import ConnectorWorker, pattern_values, slots_for, token_view

__all__ = ["RANK_FAULTS", "TPHarnessError", "TPRankWorker", "TPRig",
           "TPWorkerGroup", "assert_ranks_agree_on_finished", "declared_pp_sizes",
           "declared_tp_sizes",
           "make_tp_rig", "rank_head_range", "run_tp", "tp_pattern_values"]

# Seconds a rank may take to start (spawn + import torch and vLLM + connector set-up;
# about 20 s on a 2-core box) and to answer one step.
RANK_START_TIMEOUT_S = 300.0
RANK_STEP_TIMEOUT_S = 120.0

# Harness-side rank-local faults (what a connector's worker would report on one
# rank): "load_error" adds the blocks the rank just loaded to its
# invalid_block_ids, as a connector reports them from get_block_ids_with_load_errors.
RANK_FAULTS = ("load_error",)


#: starts of one rank group; a start whose rendezvous port another process took
#: between :func:`free_init_method` and rank 0's bind is tried again on a new port
START_ATTEMPTS = 3


def port_taken(error: str) -> bool:
    """Whether a rank's start failed because its rendezvous port was taken.

    torch.distributed's TCPStore says ``EADDRINUSE`` / "address already in use"
    (DistNetworkError): a race on a busy box, not the connector's fault.
    """
    return "EADDRINUSE" in error or "address already in use" in error.lower()


class TPHarnessError(RuntimeError):
    """A rank process failed to start or to answer (not a connector verdict)."""


def declared_tp_sizes(profile: Profile) -> list[int]:
    """The profile's ``[vllm] tensor_parallel_sizes`` (default ``[1]``)."""
    return [int(x) for x in profile["vllm"].get("tensor_parallel_sizes", [1])]


def declared_pp_sizes(profile: Profile) -> list[int]:
    """The profile's ``[vllm] pipeline_parallel_sizes`` (default ``[1]``)."""
    return [int(x) for x in profile["vllm"].get("pipeline_parallel_sizes", [1])]


def rank_head_range(rank: int, tp_size: int, total_kv_heads: int) -> tuple[int, int]:
    """Global KV heads ``[first, first + count)`` held by ``rank``.

    With fewer KV heads than ranks each head is replicated
    (``ModelConfig.get_num_kv_heads``: ``max(1, H // tp)``). ValueError when
    ``total_kv_heads`` neither divides nor is divisible by ``tp_size`` (as vLLM).
    """
    if total_kv_heads % tp_size and tp_size % total_kv_heads:
        raise ValueError(f"{total_kv_heads} KV heads cannot be split over "
                         f"tensor_parallel_size {tp_size}")
    return rank * total_kv_heads // tp_size, max(1, total_kv_heads // tp_size)


def tp_pattern_values(kv: Any, layer_idx: int, positions: Any, tokens: Any,
                      rank: int, tp_size: int, total_kv_heads: int) -> Any:
    """Rank ``rank``'s heads' slice of the model-wide KV pattern.

    The union over ranks is the TP = 1 :func:`tvc.contract.worker.pattern_values`.
    ``kv`` is the rank's layer tensor; ``positions`` and ``tokens`` are long tensors
    ``(n,)``. Returns a tensor shaped like
    :func:`tvc.contract.worker.token_view` of ``kv`` for ``n`` tokens.
    """
    import torch

    first, count = rank_head_range(rank, tp_size, total_kv_heads)
    one = torch.zeros(1, dtype=torch.long, device=kv.device)
    like = token_view(kv, one, one)
    if kv.dim() == 4:  # (N, H, B, 2D) -> token view (n, H, 2D)
        full = torch.zeros((1, total_kv_heads, 1, kv.shape[3]), dtype=kv.dtype,
                           device=kv.device)
        head_dim = 1
    else:  # (2, N, B, H, D) -> token view (2, n, H, D)
        full = torch.zeros((2, 1, 1, total_kv_heads, kv.shape[4]), dtype=kv.dtype,
                           device=kv.device)
        head_dim = 2
    assert like.shape[head_dim] == count, (
        f"rank {rank}: KV cache has {like.shape[head_dim]} heads, expected {count} "
        f"({total_kv_heads} KV heads over TP {tp_size})")
    vals = pattern_values(full, layer_idx, positions, tokens)
    return vals.narrow(head_dim, first, count).contiguous()


class TPRankWorker(ConnectorWorker):
    """:class:`ConnectorWorker` of one TP rank (its heads' share of the pattern).

    Attributes:
        fault: a harness-side rank-local fault from :data:`RANK_FAULTS` or ''.
        injected_invalid: block ids this rank reported through ``fault``.

    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any, device: str, *,
                 rank: int, tp_size: int, fault: str = "") -> None:
        self.rank = rank
        self.tp_size = tp_size
        self.tp_rank = rank % tp_size
        self.pp_size = int(vllm_config.parallel_config.pipeline_parallel_size)
        self.total_kv_heads = vllm_config.model_config.get_total_num_kv_heads()
        self.fault = fault
        self.injected_invalid: set[int] = set()
        #: this rank's connector calls (tvc.contract.coverage), set by the rank
        #: process; the parent merges them into the rig's log
        self.coverage: Any = None
        # the rank process inherits the profile's [vllm] env (make_tp_rig)
        super().__init__(vllm_config, kv_cache_config, device,
                         decide_model_runner(vllm_config))

    def pattern(self, kv: Any, layer_idx: int, positions: Any, tokens: Any) -> Any:
        """The rank's share of the model-wide pattern (:func:`tp_pattern_values`)."""
        return tp_pattern_values(kv, layer_idx, positions, tokens, self.tp_rank,
                                 self.tp_size, self.total_kv_heads)

    def verify_range(self, req_id: str, start: int, end: int) -> str:
        """:meth:`ConnectorWorker.verify_range`, the message naming rank and heads."""
        msg = super().verify_range(req_id, start, end)
        if not msg:
            return ""
        return f"{self.where()}, {msg}"

    def where(self) -> str:
        """``rank r of N (KV heads i..j of H)``, plus the PP stage and its layers."""
        first, count = rank_head_range(self.tp_rank, self.tp_size,
                                       self.total_kv_heads)
        heads = f"KV heads {first}..{first + count - 1} of {self.total_kv_heads}"
        if self.pp_size == 1:
            return f"rank {self.rank} of {self.tp_size} ({heads})"
        return (f"rank {self.rank} of {self.tp_size * self.pp_size} (TP rank "
                f"{self.tp_rank}, {heads}; PP stage {self.rank // self.tp_size} of "
                f"{self.pp_size}, layers {', '.join(self.names)})")

    def stray_block(self, req_id: str) -> str:
        """:meth:`ConnectorWorker.stray_block`, the message naming the rank."""
        msg = super().stray_block(req_id)
        return f"{self.where()}: {msg}" if msg else ""

    def execute(self, so: Any, meta: Any) -> Any:
        """One step (see :meth:`ConnectorWorker.execute`), plus the rank fault."""
        cov = self.coverage
        if cov is not None:  # what the driver sets on the parent's log
            cov.step += 1
            cov.loading = any(nr.num_computed_tokens > 0
                              for nr in so.scheduled_new_reqs)
            cov.preempted = bool(getattr(so, "preempted_req_ids", None))
        before = dict(self.loaded)
        out = super().execute(so, meta)
        if self.fault == "load_error":
            for rid, start in self.loaded.items():
                if rid in before or start <= 0:
                    continue
                blocks, _, _ = slots_for(self.block_table[rid], 0, start,
                                         self.block_size)
                bad = {int(b) for b in blocks.unique()}
                self.injected_invalid |= bad
                out.invalid_block_ids = set(out.invalid_block_ids or ()) | bad
        return out


# ----------------------------------------------------------------- rank process
def _rank_main(rank: int, tp_size: int, backend: str, init_method: str,
               vllm_config: Any, kv_cache_config: Any, device: str, fault: str,
               conn: Any) -> None:
    """Body of one rank process: set up, then answer commands until 'stop'.

    Sets ``parallel_config.rank`` first, as ``WorkerBase.__init__`` does
    (``vllm/v1/worker/worker_base.py``, 0.28, 0.33); under PP the rank's KV cache
    config holds its stage's layers only (``generate_scheduler_kv_cache_config``).
    """
    try:
        pc = vllm_config.parallel_config
        pc.rank = rank
        pp = int(pc.pipeline_parallel_size)
        if pp > 1:
            kv_cache_config = make_kv_cache_config(vllm_config,
                                                   kv_cache_config.num_blocks)
        with vllm_distributed(tp_size * pp, rank, backend, init_method,
                              vllm_config=vllm_config, pipeline_parallel_size=pp):
            worker = TPRankWorker(vllm_config, kv_cache_config, device, rank=rank,
                                  tp_size=tp_size, fault=fault)
            from tvc.contract.coverage import CoverageLog
            from tvc.contract.rig import note_rig

            worker.coverage = CoverageLog()
            note_rig(worker.coverage, vllm_config, kv_cache_config, worker)
            conn.send(("ready", rank))
            _serve(worker, conn)
    except BaseException:  # noqa: BLE001 - every failure goes to the parent
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            conn.close()


def _serve(worker: TPRankWorker, conn: Any) -> None:
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            c = worker.connector
            if hasattr(c, "shutdown"):
                with contextlib.suppress(Exception):
                    c.shutdown()
            conn.send(("ok", None))
            return
        try:
            if cmd == "execute":
                n_err = len(worker.load_errors)
                out = worker.execute(*args)
                res: Any = (out, worker.load_errors[n_err:], dict(worker.loaded),
                            {r: list(b) for r, b in worker.block_table.items()})
            elif cmd == "zero":
                worker.zero()
                res = None
            elif cmd == "verify":
                res = worker.verify_range(*args)
            elif cmd == "stray":
                res = worker.stray_block(*args)
            elif cmd == "injected":
                res = sorted(worker.injected_invalid)
            elif cmd == "coverage":
                res = dict(worker.coverage.hits) if worker.coverage else {}
            else:
                raise ValueError(f"unknown rank command {cmd!r}")
        except BaseException:  # noqa: BLE001 - report, keep serving
            conn.send(("error", traceback.format_exc()))
            continue
        conn.send(("ok", res))


# ------------------------------------------------------------------- parent side
@dataclass
class TPWorkerGroup:
    """N rank processes driven as one worker (the executor's view).

    ``kv_cache_config`` is per rank; on ``cuda`` rank r uses ``cuda:r``; the
    ``scheduler_connector`` feeds ``KVOutputAggregator.from_connector`` (its
    ``get_finished_count``); ``backend`` defaults to ``nccl`` on CUDA, else ``gloo``.
    Raises TPHarnessError (with the rank's traceback) when a rank fails to start.

    Attributes:
        loaded: request id -> first computed token when first scheduled (rank 0;
            every rank must agree).
        rank_outputs: per step, the N per-rank ``KVConnectorOutput``.
        aggregated: per step, the merged ``KVConnectorOutput`` the scheduler saw.
        finished_by_rank: {"sending"|"recving": {rank: set of request ids}}.

    """

    vllm_config: Any
    kv_cache_config: Any
    device: str
    scheduler_connector: Any
    backend: str | None = None
    rank_faults: dict[int, str] = field(default_factory=dict)
    load_errors: list[str] = field(default_factory=list)
    loaded: dict[str, int] = field(default_factory=dict)
    block_table: dict[str, list[int]] = field(default_factory=dict)
    rank_outputs: list[list[Any]] = field(default_factory=list)
    aggregated: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        pc = self.vllm_config.parallel_config
        self.tp_size = int(pc.tensor_parallel_size)
        self.pp_size = int(pc.pipeline_parallel_size)
        # every worker of the engine (TP x PP) reports to the executor's
        # aggregator (MultiprocExecutor: KVOutputAggregator(world_size))
        self.world_size = self.tp_size * self.pp_size
        self.backend = self.backend or ("nccl" if self.device == "cuda" else "gloo")
        for r, f in self.rank_faults.items():
            if f not in RANK_FAULTS or not 0 <= r < self.world_size:
                raise ValueError(f"rank_faults: {r}: {f!r} (ranks 0.."
                                 f"{self.world_size - 1}, faults {RANK_FAULTS})")
        if self.scheduler_connector is not None:
            self.aggregator = KVOutputAggregator.from_connector(
                self.scheduler_connector, self.world_size)
        else:
            self.aggregator = KVOutputAggregator(self.world_size)
        self.finished_by_rank: dict[str, dict[int, set[str]]] = {
            "sending": {r: set() for r in range(self.world_size)},
            "recving": {r: set() for r in range(self.world_size)}}
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self._start(free_init_method())
                break
            except TPHarnessError as exc:
                self.close()
                self._conns, self._procs = [], []
                if not port_taken(str(exc)):
                    raise
                if attempt == START_ATTEMPTS:
                    raise TPHarnessError(
                        f"TP harness: the rendezvous port was taken by another "
                        f"process on each of {START_ATTEMPTS} starts (EADDRINUSE): "
                        "a busy box, not the connector; rerun the test\n"
                        f"{exc}") from exc
            except BaseException:
                self.close()
                raise

    def _start(self, init: str) -> None:
        """Spawn every rank, meeting at ``init``; wait until each has started."""
        ctx = mp.get_context("spawn")
        for r in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_rank_main, name=f"tvc-tp-rank{r}", daemon=True,
                args=(r, self.tp_size, self.backend, init, self.vllm_config,
                      self.kv_cache_config, self.device,
                      self.rank_faults.get(r, ""), child))
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        for r in range(self.world_size):
            self._recv(r, RANK_START_TIMEOUT_S, "start")

    # -- plumbing ----------------------------------------------------------------
    def _recv(self, rank: int, timeout_s: float, what: str) -> Any:
        conn, proc = self._conns[rank], self._procs[rank]
        if not conn.poll(timeout_s):
            state = "alive" if proc.is_alive() else f"exited {proc.exitcode}"
            raise TPHarnessError(
                f"TP harness: rank {rank} did not answer '{what}' within "
                f"{timeout_s:.0f} s (process {state})")
        try:
            kind, payload = conn.recv()
        except EOFError:
            proc.join(5)
            raise TPHarnessError(
                f"TP harness: rank {rank} exited (code {proc.exitcode}) during "
                f"'{what}' without a report") from None
        if kind == "error":
            raise TPHarnessError(f"TP harness: rank {rank} failed during '{what}':\n"
                                 f"{payload}")
        return payload

    def _all(self, cmd: str, *args: Any, timeout_s: float = RANK_STEP_TIMEOUT_S
             ) -> list[Any]:
        for conn in self._conns:
            conn.send((cmd, *args))
        return [self._recv(r, timeout_s, cmd) for r in range(self.world_size)]

    def close(self) -> None:
        """Stop every rank (shutdown its connector), killing any that hangs."""
        for r, conn in enumerate(self._conns):
            with contextlib.suppress(Exception):
                if self._procs[r].is_alive():
                    conn.send(("stop",))
                    conn.poll(30)
        for p in self._procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.close()
        self._conns, self._procs = [], []

    # -- worker interface (EngineDriver) ----------------------------------------
    def execute(self, so: Any, meta: Any) -> Any:
        """Run one step on every rank; return the merged ``KVConnectorOutput``.

        Inputs go to the ranks pickled (as ``MessageQueue`` broadcast does); outputs are
        merged by vLLM's ``KVOutputAggregator``.
        """
        from tvc.contract import compat

        results = self._all("execute", so, meta)
        outs = []
        for r, (out, errors, loaded, table) in enumerate(results):
            self.load_errors += errors
            for kind, got in (("sending", out.finished_sending),
                              ("recving", out.finished_recving)):
                self.finished_by_rank[kind][r] |= set(got or ())
            if r == 0:
                self.loaded.update(loaded)
                self.block_table = table
            else:
                for rid, start in loaded.items():
                    if self.loaded.get(rid, start) != start:
                        self.load_errors.append(
                            f"request {rid}: rank {r} started computing at token "
                            f"{start}, rank 0 at {self.loaded[rid]}")
            outs.append(out)
        self.rank_outputs.append(copy.deepcopy(outs))
        mros = [compat.model_runner_output([], [], out) for out in outs]
        merged = self.aggregator.aggregate(mros).kv_connector_output
        self.aggregated.append(merged)
        return merged

    def zero(self) -> None:
        """Zero every rank's KV caches."""
        self._all("zero")

    def verify_range(self, req_id: str, start: int, end: int) -> str:
        """Every rank's :meth:`TPRankWorker.verify_range`; the first failure or ''."""
        return next((m for m in self._all("verify", req_id, start, end) if m), "")

    def stray_block(self, req_id: str) -> str:
        """Every rank's :meth:`TPRankWorker.stray_block`; the first failure or ''."""
        return next((m for m in self._all("stray", req_id) if m), "")

    def merge_coverage(self, log: Any) -> None:
        """Add every rank's recorded connector calls to ``log`` (a CoverageLog)."""
        for r, hits in enumerate(self._all("coverage")):
            for key, notes in hits.items():
                log.hit(key, f"rank {r}: {notes[0]}" if notes else f"rank {r}")

    def injected_invalid(self) -> list[list[int]]:
        """Per rank, the block ids reported invalid by its harness-side fault."""
        return self._all("injected")


def assert_ranks_agree_on_finished(group: TPWorkerGroup) -> None:
    """Every request finished on one rank was reported by the expected ranks.

    ``KVOutputAggregator`` reports a finished transfer only once
    ``get_finished_count()`` (default: all) ranks did; otherwise blocks stay held.
    The AssertionError names the request, the direction and the silent ranks.
    """
    expected = group.aggregator._expected_finished_count  # noqa: SLF001 - vLLM's count
    for kind, by_rank in group.finished_by_rank.items():
        every = set().union(*by_rank.values())
        for rid in sorted(every):
            told = [r for r in range(group.world_size) if rid in by_rank[r]]
            if len(told) < expected:
                silent = [r for r in range(group.world_size) if r not in told]
                raise AssertionError(
                    f"request {rid}: finished_{kind} was reported by rank(s) {told} "
                    f"but never by rank(s) {silent} (vLLM waits for {expected} of "
                    f"{group.world_size} ranks): after KVOutputAggregator the "
                    f"scheduler never learns that the transfer finished, so the "
                    f"request's blocks stay held. Every rank's worker must report the "
                    f"requests it finished (or get_finished_count() must say how "
                    f"many ranks report)")


def run_tp(driver: EngineDriver, group: TPWorkerGroup, *requests: Any) -> None:
    """``driver.run(*requests)``; a hang caused by a silent rank names that rank.

    :func:`assert_ranks_agree_on_finished` runs after the driver, also when it failed.
    """
    try:
        driver.run(*requests)
    except AssertionError:
        assert_ranks_agree_on_finished(group)
        raise
    assert_ranks_agree_on_finished(group)


@dataclass
class TPRig(SchedulerSideMixin):
    """Config, scheduler, rank group and driver for one connector at TP = N."""

    vllm_config: Any
    kv_cache_config: Any
    scheduler: Any
    group: TPWorkerGroup
    driver: EngineDriver

    def close(self) -> None:
        """Take the ranks' coverage, stop them, shut the scheduler side down."""
        with contextlib.suppress(Exception):  # a rank that died: nothing to add
            if self.group._procs:  # noqa: SLF001 - still running
                self.group.merge_coverage(self.driver.coverage)
        self.group.close()
        c = self.scheduler.connector
        if c is not None and hasattr(c, "shutdown"):
            with contextlib.suppress(Exception):
                c.shutdown()


def make_tp_rig(profile: Profile, scratch: Path, *, tp_size: int = 2,
                pp_size: int = 1, device: str = "cpu", backend: str | None = None,
                num_blocks: int = DEFAULT_NUM_BLOCKS,
                rank_faults: dict[int, str] | None = None,
                **config_kw: Any) -> TPRig:
    """Build a :class:`TPRig`: TP config, scheduler, N x S rank processes, driver.

    Args:
        profile: the target profile.
        scratch: suite-owned directory.
        tp_size: N (``num_kv_heads`` must split over it).
        pp_size: pipeline stages S (the model's layers split over them).
        device: ``cpu`` (gloo) or ``cuda`` (NCCL, rank r on ``cuda:r``).
        backend: override of the torch.distributed backend.
        num_blocks: KV blocks per rank's pool.
        rank_faults: rank -> harness-side fault (:data:`RANK_FAULTS`).
        **config_kw: passed to :func:`tvc.contract.builders.make_vllm_config`.

    Returns:
        the rig; the caller must call :meth:`TPRig.close`.

    Raises:
        TPHarnessError: a rank failed to start.

    """
    with vllm_env(dict(profile["vllm"]["env"])):  # rank processes inherit it
        vc = make_vllm_config(profile, scratch=scratch, device=device,
                              tensor_parallel_size=tp_size,
                              pipeline_parallel_size=pp_size, **config_kw)
        kcc = make_kv_cache_config(vc, num_blocks)
        sched = make_scheduler(vc, kcc)
        group = TPWorkerGroup(vc, kcc, device, sched.connector, backend=backend,
                              rank_faults=dict(rank_faults or {}))
    return TPRig(vc, kcc, sched, group, EngineDriver(
        sched, worker=group,
        call_timeout_s=float(profile["connector"]["call_timeout_s"]),
        min_stall_s=float(profile["connector"]["transfer_timeout_s"])))


def note_tp_rig(rig: TPRig) -> Any:
    """Record on the rig's coverage log what its ranks exercised; return the log.

    Includes ``KVConnectorWorkerMetadata.aggregate`` where two or more ranks returned
    worker metadata in one step; the ranks' own calls are added by
    :meth:`TPRig.close`.
    """
    log = rig.driver.coverage
    log.note_config(rig.vllm_config)
    log.note_layers(rig.kv_cache_config)
    for outs in getattr(rig.group, "rank_outputs", ()):
        metas = [o for o in outs
                 if getattr(o, "kv_connector_worker_meta", None) is not None]
        if len(metas) >= 2:
            log.hit("api:KVConnectorWorkerMetadata.aggregate",
                    f"{len(metas)} ranks")
            break
    return log
