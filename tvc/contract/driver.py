"""Engine driver: schedule, forward and ``update_from_output`` as the engine core runs.

One :class:`StepRecord` per step; the worker is the connector's real worker side or a
transfer-acknowledging stand-in.
"""

from __future__ import annotations

import linecache
import re
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tvc.contract import compat
from tvc.contract.builders import SAMPLED_TOKEN_ID
from tvc.contract.coverage import CoverageLog
from tvc.contract.invariants import (
    assert_match_within_prompt,
    assert_metadata_survives_serialization,
)
from tvc.contract.serialization import round_trip
from tvc.contract.standins import (
    BUILTIN_STANDIN,
    WorkerReportError,
    WorkerReportMissing,
    missing_report_message,
    publishes_worker_meta,
)
from tvc.contract.worker import JobAckWorker, unwrap_metadata
from tvc.core.watchdog import Stuck, deadline, frame_line

#: seconds one engine step (every connector call in it) may take before the
#: watchdog stops it, when the profile sets no ``connector.call_timeout_s``: far
#: above a CPU rig's steps (milliseconds) and a first CUDA call's set-up
DEFAULT_CALL_TIMEOUT_S = 120.0


# ---------------------------------------------------------------------------- driver
class EngineStepError(AssertionError):
    """An exception escaped an engine step (the message names step and stage)."""


# connector methods whose failures are load or save failures (vLLM's interface
# for those: get_block_ids_with_load_errors / failed receives; a save is absorbed)
LOAD_SAVE_METHODS = frozenset({
    "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
    "get_finished", "get_block_ids_with_load_errors"})
LOAD_SAVE_ADVICE = ("A connector must report a failed load through vLLM's interface "
                    "(get_block_ids_with_load_errors, failed receives) and absorb a "
                    "failed save, never raise")
_CALL = re.compile(r"connector\.(\w+)\(|\b(_connector_finished)\(")
# vLLM's own wrappers whose return value is a connector method's, unchanged
# (vllm/v1/core/sched/scheduler.py in 0.28 and 0.33: _free_request unpacks
# self._connector_finished(request), which returns connector.request_finished(...))
_WRAPPERS = {"_connector_finished": "request_finished"}


def connector_call(exc: BaseException) -> tuple[str, str]:
    """Which connector method an engine-step exception comes from, and what to do.

    Walks the traceback innermost out: a ``KVConnectorBase_V1`` method frame on a
    connector means the method raised; a vLLM line calling ``connector.<method>(``
    means vLLM failed on what it returned (e.g. ``request_finished``'s ``None``).

    Returns:
        ``(where, advice)``: ``where`` is ``""``, ``" inside Cls.method
        (file:line)"`` or ``" in vLLM's use of what connector.method() returned
        (file:line: source)"``; ``advice`` one sentence for that case.

    """
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorBase_V1,
        )
    except ImportError:
        return "", LOAD_SAVE_ADVICE
    api = {n for n in dir(KVConnectorBase_V1) if not n.startswith("_")}
    for frame, lineno in reversed(list(traceback.walk_tb(exc.__traceback__))):
        code = frame.f_code
        me = frame.f_locals.get("self")
        place = f"{code.co_filename}:{lineno}"
        if code.co_name in api and isinstance(me, KVConnectorBase_V1):
            method = code.co_name
            where = f" inside {type(me).__name__}.{method} ({place})"
            if method in LOAD_SAVE_METHODS:
                return where, LOAD_SAVE_ADVICE
            return where, (f"{method} must not raise: return what vLLM expects "
                           "(e.g. 0 matched tokens) and log the cause")
        line = linecache.getline(code.co_filename, lineno).strip()
        m = _CALL.search(line)
        method = m and (m.group(1) or _WRAPPERS.get(m.group(2) or "", ""))  # type: ignore[assignment]
        if method and method in api:
            return (f" in vLLM's use of what connector.{method}() returned "
                    f"({place}: {line})",
                    f"vLLM could not use what {method} returned: check it against "
                    f"KVConnectorBase_V1.{method}'s documented return type")
    return "", LOAD_SAVE_ADVICE


def stuck_message(what: str, running: str, seconds: float, frame: Any,
                  outer: bool) -> str:
    """The failure of a connector call (or engine step) that never returned.

    One paragraph: ``what`` was bounded (``engine step 5 (schedule ...)``), the
    call ``running`` then (or ''), where ``frame`` was stopped, why it must
    return, and the bound's profile key (``seconds``, s; ``outer``: the test's
    pytest-timeout ran out first).
    """
    limit = (f"the test's time limit (pytest-timeout, connector.test_timeout_s) "
             f"ran out {seconds:g} s into it" if outer else
             f"did not finish within {seconds:g} s (connector.call_timeout_s)")
    call = (f"{running} never returned" if running else
            "no connector call was running (vLLM's own code or the harness)")
    own = _connector_frame(frame)
    at = frame_line(own or frame)
    if own is not None and own is not frame:
        at += f" (inside {frame_line(frame)})"
    return (f"{what} {limit}: {call}; stopped at {at or 'an unknown place'}. vLLM "
            "calls every connector method on the engine core's one thread "
            "(EngineCore.step), so a call that loops or waits stops every request: "
            "a full store must refuse the save (absorb it: a miss later) or evict, "
            "never wait for space that only a later engine step can free; a lookup "
            "or load that cannot finish must answer 0 or report the load failed")


def connector_assert(exc: AssertionError) -> str:
    """Where an assert failed, when it failed in the connector's own code.

    Returns "the connector's own assert failed in Cls.method (file:line:
    source): message — ..." where the raising frame belongs to a
    ``KVConnectorBase_V1`` outside this suite, else '' (a check of this suite, or
    vLLM).
    """
    import os

    import tvc

    tb = exc.__traceback__
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    if last is None:
        return ""
    frame = last.tb_frame
    suite = os.path.dirname(os.path.abspath(tvc.__file__))
    if os.path.abspath(frame.f_code.co_filename).startswith(suite + os.sep):
        return ""
    own = _connector_frame(frame)
    if own is None:
        return ""
    me = own.f_locals.get("self")
    where = frame_line(frame).split(": ", 1)
    text = str(exc).strip()
    return (f"the connector's own assert failed in {type(me).__name__}."
            f"{own.f_code.co_name} ({where[0]}: {where[-1]})"
            + (f": {text}" if text else "") + " — an internal check of the "
            "connector's code, not a check of this suite: the connector met a "
            "state it did not expect at that call (see the line)")


def _connector_frame(frame: Any) -> Any:
    """The innermost frame whose ``self`` is a ``KVConnectorBase_V1``, walking out."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorBase_V1,
        )
    except ImportError:
        return None
    f = frame
    while f is not None:
        if isinstance(f.f_locals.get("self"), KVConnectorBase_V1):
            return f
        f = f.f_back
    return None


class RigPlanError(RuntimeError):
    """A test planned a request the rig cannot run (a suite defect, named)."""


#: ``connector.worker_report`` of a connector whose residency only its real
#: worker can report (e.g. stores through CUDA IPC into its own server): no
#: stand-in can exist, so a box where that worker cannot run lacks hardware
REAL_WORKER_ONLY = "real-only"


class WorkerSide(Protocol):
    """What the driver needs of a worker side, real or stand-in.

    Implemented by :class:`~tvc.contract.worker.ConnectorWorker`,
    :class:`~tvc.contract.worker.JobAckWorker`,
    :class:`~tvc.contract.standins.HookWorker` and the harnesses of
    :mod:`tvc.contract.tp`.
    """

    def execute(self, so: Any, meta: Any) -> Any:
        """One model-runner step for scheduler output ``so`` and connector metadata.

        Returns the step's ``KVConnectorOutput`` (``finished_sending``,
        ``finished_recving``, ``invalid_block_ids``...), or None.
        """
        ...


class NoWorkerHere(RuntimeError):  # noqa: N818 - reads as the reason
    """No worker side runs for this rig (no device of ``worker_devices`` here)."""


def no_worker_message(reason: str) -> str:
    """The error for a rig where the connector's worker side cannot run.

    One paragraph naming ``reason`` (rig device and ``worker_devices``) and the
    two fixes; it never says the connector leaks or loses anything.
    """
    return (f"no worker ran: {reason} — connector.worker_devices lists no device "
            "this rig runs on, so the connector's worker side (its saves, loads "
            "and finished transfers) never ran and nothing about the connector "
            "was judged. Fix: set connector.worker_devices = [\"cpu\"] if the "
            "connector's worker runs on CPU, or supply connector.worker_report "
            "(module:function building a stand-in that reports for it)")


def worker_device(worker_devices: Sequence[str], cuda_here: bool) -> str:
    """The device of a rig that is not a device variant: where the worker runs.

    ``"cpu"`` when the worker runs on CPU (or nowhere here); ``"cuda"`` for a
    CUDA-only worker where ``cuda_here``.
    """
    if "cpu" in worker_devices or not (cuda_here and "cuda" in worker_devices):
        return "cpu"
    return "cuda"


def _delays_free(returned: Any) -> bool:
    """Whether a recorded ``request_finished`` return delayed freeing the blocks."""
    if not returned:
        return False
    ret = returned[1]
    return bool(isinstance(ret, tuple) and ret and ret[0])


@dataclass
class StepRecord:
    """What one engine step did, for the checks."""

    scheduled: dict[str, int]
    meta_type: str
    finished: list[str]
    #: each scheduled request's num_computed_tokens once the step ran, as vLLM's
    #: scheduler set it at schedule time (``_update_after_schedule``), kept even
    #: where ``update_from_output`` then rolled it back (a failed KV load)
    computed: dict[str, int] = field(default_factory=dict)


#: seconds a step waits, past the step limit, for a transfer in flight
#: (:meth:`EngineDriver.step_until_idle`, the explorer's load check)
STALL_POLL_S = 0.005
#: seconds of wall time a transfer may stay in flight past the step limit when
#: the profile sets no ``connector.transfer_timeout_s`` (its default)
DEFAULT_TRANSFER_TIMEOUT_S = 10.0


@dataclass
class EngineDriver:
    """Run the scheduler and a worker the way ``EngineCore.step`` does.

    A step longer than :attr:`call_timeout_s` (s, ``connector.call_timeout_s``)
    is stopped by :func:`tvc.core.watchdog.deadline`
    (:class:`~tvc.core.watchdog.Stuck` names step, stage, call and line). An
    exception inside a step (an ``AssertionError`` only from the connector's own
    code; never the rig's errors below) becomes :class:`EngineStepError` naming
    step and stage.

    Attributes:
        scheduler: vLLM's ``Scheduler`` (with ``.connector``).
        worker: :class:`ConnectorWorker`, :class:`JobAckWorker` or None (then
            chosen from the first metadata seen).
        serialize: send each step's metadata through :func:`round_trip` (as the
            multiprocess executor does).
        matched: request id -> every ``get_num_new_matched_tokens`` answer:
            (local computed tokens passed in, tokens returned, async flag).
        before_worker: ``callable(scheduler_output)`` run between ``schedule()``
            (the lookup) and the worker step (the load).
        match_steps: request id -> the step of each answer (parallel to
            :attr:`matched`).
        on_match: ``callable(request, local, matched, is_async)`` run on every
            answer after the built-in bounds.
        worker_report: ``connector.worker_report`` ("" or ``"standin"`` when no
            declared stand-in was built).
        on_no_worker: ``callable(message)`` called before raising
            :class:`NoWorkerHere` (a fixture turns it into a hardware skip).
        added: every request added, in order.
        coverage: what this driver exercised (:class:`CoverageLog`).
        scheduler_only: the test drives the scheduler side only: with no worker,
            the driver acknowledges ``finished_sending`` / ``finished_recving``
            one step later (no bytes moved); without it no worker is an error.
        worker_metas: every non-empty ``kv_connector_worker_meta`` the worker
            side returned, in step order.

    Raises:
        WorkerReportMissing: (from :meth:`step`) worker metadata publishes
            residency and neither a real worker nor a stand-in reports it
            (:mod:`tvc.contract.standins`).
        WorkerReportError: a declared stand-in failed.
        NoWorkerHere: no worker of any kind can run for this rig.

    """

    scheduler: Any
    worker: WorkerSide | None = None
    serialize: bool = True
    history: list[StepRecord] = field(default_factory=list)
    first_compute: dict[str, tuple[int, int]] = field(default_factory=dict)
    finished_returns: dict[str, Any] = field(default_factory=dict)
    matched: dict[str, list[tuple[int, int | None, bool]]] = field(
        default_factory=dict)
    finished_recving: set[str] = field(default_factory=set)
    #: requests that waited for remote KV (WAITING_FOR_REMOTE_KVS) after a step
    waited_remote: set[str] = field(default_factory=set)
    metas: list[Any] = field(default_factory=list)
    worker_metas: list[Any] = field(default_factory=list)
    max_steps: int = 200
    #: seconds without progress :meth:`step_until_idle` also waits before it
    #: calls the engine stalled (a receive on a background thread takes wall
    #: time): the profile's ``connector.transfer_timeout_s``
    min_stall_s: float = DEFAULT_TRANSFER_TIMEOUT_S
    before_worker: Any = None
    num_steps: int = 0
    match_steps: dict[str, list[int]] = field(default_factory=dict)
    on_match: Any = None
    worker_report: str = ""
    no_worker_reason: str = ""
    on_no_worker: Any = None
    coverage: CoverageLog = field(default_factory=CoverageLog)
    added: list[Any] = field(default_factory=list)
    scheduler_only: bool = False
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S
    async_loads_started: int = 0
    _acked: set[str] = field(default_factory=set)
    _async_poisoned: set[tuple[str, int]] = field(default_factory=set)
    _stage: str = ""

    def __post_init__(self) -> None:
        self.coverage.attach(self.connector, "scheduler")
        self.coverage.note_construction(self.scheduler)
        self._wrap_connector()

    @property
    def connector(self) -> Any:
        """The scheduler-side connector."""
        return self.scheduler.connector

    def add(self, *requests: Any) -> None:
        """Add requests to the scheduler (``EngineCore.add_request``).

        Raises:
            RigPlanError: a request needs more than the rig's ``max_model_len``.

        """
        limit = self.scheduler.vllm_config.model_config.max_model_len
        for r in requests:
            need = r.num_prompt_tokens + int(getattr(r, "max_tokens", 0) or 0)
            if need > limit:
                raise RigPlanError(
                    f"the test's plan is wrong, not the connector: request "
                    f"{r.request_id} has {r.num_prompt_tokens} prompt tokens + "
                    f"{r.max_tokens} output tokens, beyond the rig's max_model_len "
                    f"{limit}; vLLM would never finish it. Derive prompt lengths "
                    "from the rig's max_model_len")
            self.coverage.note_request(r)
            self.added.append(r)
            self.scheduler.add_request(r)

    def step(self) -> Any:
        """Run one engine step (schedule, worker, update_from_output).

        Returns the ``SchedulerOutput``.
        """
        self.num_steps += 1
        self.coverage.step = self.num_steps
        self._stage = "schedule (scheduler-side connector)"
        try:
            with deadline(self.call_timeout_s, self._stuck):
                so = self.scheduler.schedule()
                computed = {rid: self.scheduler.requests[rid].num_computed_tokens
                            for rid in so.num_scheduled_tokens
                            if rid in self.scheduler.requests}
                self.coverage.loading = self._load_pending()
                self.coverage.preempted = bool(getattr(so, "preempted_req_ids",
                                                       None))
                self.waited_remote |= {
                    rid for rid, r in self.scheduler.requests.items()
                    if r.status.name == "WAITING_FOR_REMOTE_KVS"}
                self._poison_async_loads()
                self._stage = "between lookup and load (scenario hook)"
                if self.before_worker is not None:
                    self.before_worker(so)
                self._stage = "worker step (worker-side connector)"
                mro = self._worker_step(so)
                self._stage = "update_from_output (scheduler-side connector)"
                self.scheduler.update_from_output(so, mro)
        except AssertionError as exc:
            own = "" if isinstance(exc, Stuck) else connector_assert(exc)
            if not own:
                raise  # a check's failure
            raise EngineStepError(
                f"engine step {self.num_steps} ({self._stage}): {own}") from exc
        except (WorkerReportMissing, WorkerReportError, NoWorkerHere):
            raise  # the rig's own set-up error
        except Exception as exc:
            where, advice = connector_call(exc)
            raise EngineStepError(
                f"engine step {self.num_steps} ({self._stage}) raised "
                f"{type(exc).__name__}: {exc}{where} — an exception escaped the "
                f"engine step. {advice}") from exc
        self.history.append(StepRecord(dict(so.num_scheduled_tokens),
                                       type(so.kv_connector_metadata).__name__,
                                       sorted(so.finished_req_ids), computed))
        return so

    def _stuck(self, seconds: float, frame: Any, outer: bool) -> str:
        """The watchdog's message for this step (see :func:`stuck_message`)."""
        return stuck_message(f"engine step {self.num_steps} ({self._stage})",
                             self.coverage.running_call(), seconds, frame, outer)

    def _poison_async_loads(self) -> None:
        """Poison ``[local, local + matched)`` of each asynchronous load as it starts.

        Once per admission (again after a preemption); synchronous loads are
        poisoned by the worker (:meth:`ConnectorWorker.expect_loads`).
        """
        poison = getattr(self.worker, "poison_blocks", None)
        if poison is None:
            return
        for rid, r in self.scheduler.requests.items():
            if r.status.name != "WAITING_FOR_REMOTE_KVS":
                continue
            key = (rid, r.num_preemptions)
            answers = [a for a in self.matched.get(rid, ()) if a[1]]
            if key in self._async_poisoned or not answers:
                continue
            self._async_poisoned.add(key)
            self.async_loads_started += 1
            local, n, _ = answers[-1]
            ids = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
            poison(ids, local, local + int(n or 0), rid)

    def _load_pending(self) -> bool:
        """Whether a request with an external hit has not computed yet (a load)."""
        for rid in self.scheduler.requests:
            if rid in self.first_compute:
                continue
            answers = [a for a in self.matched.get(rid, ()) if a[1]]
            if answers:
                return True
        return False

    def _worker_step(self, so: Any) -> Any:
        """The worker's half of a step: returns the ``ModelRunnerOutput``."""
        sched = self.scheduler
        meta = so.kv_connector_metadata
        if meta is not None:
            self.metas.append(meta)
        if meta is not None and self.serialize:
            assert_metadata_survives_serialization(meta)
            meta = round_trip(meta)
        if self.worker is None and meta is not None:
            self.worker = self._fallback_worker(meta)
        expect_loads = getattr(self.worker, "expect_loads", None)
        if expect_loads is not None:
            expect_loads(self._sync_loads(so))
        kv_out = self.worker.execute(so, meta) if (
            self.worker is not None and meta is not None) else None
        if self.worker is None and self.scheduler_only:
            kv_out = self._acknowledge(so)
        wmeta = getattr(kv_out, "kv_connector_worker_meta", None)
        if wmeta is not None and not _is_empty(wmeta):
            self.worker_metas.append(wmeta)
        if kv_out is not None and kv_out.finished_recving:
            self.finished_recving |= set(kv_out.finished_recving)
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            req = sched.requests[rid]
            if rid not in self.first_compute:
                # schedule() already advanced num_computed_tokens by n
                self.first_compute[rid] = (req.num_computed_tokens - n, n)
            req_ids.append(rid)
            done_prefill = req.num_computed_tokens >= req.num_tokens
            sampled.append([SAMPLED_TOKEN_ID] if done_prefill else [])
        return compat.model_runner_output(req_ids, sampled, kv_out)

    def _acknowledge(self, so: Any) -> Any:
        """What a worker reports for a scheduler-only rig: transfers end at once."""
        from vllm.v1.outputs import KVConnectorOutput
        from vllm.v1.request import RequestStatus

        sending = {rid for rid in so.finished_req_ids
                   if _delays_free(self.finished_returns.get(rid))}
        waiting = RequestStatus.WAITING_FOR_REMOTE_KVS
        recving = {rid for rid, r in self.scheduler.requests.items()
                   if r.status == waiting and rid not in self._acked}
        self._acked |= recving
        if not (sending or recving):
            return None
        out = KVConnectorOutput()
        out.finished_sending, out.finished_recving = sending, recving
        return out

    def _fallback_worker(self, meta: Any) -> Any:
        """The worker for a rig built without one, from the first metadata (or None).

        Raises :class:`WorkerReportMissing` or :class:`NoWorkerHere` where a worker
        report is needed and none can run here (``connector.worker_report``).
        """
        if JobAckWorker.applies_to(meta):
            return JobAckWorker(type(unwrap_metadata(meta)).__module__)
        real_only = self.worker_report == REAL_WORKER_ONLY
        if publishes_worker_meta(self.connector) and not real_only:
            why = self.no_worker_reason
            if self.worker_report == BUILTIN_STANDIN:
                why = (f"connector.worker_report = {BUILTIN_STANDIN!r} names the "
                       "built-in job-protocol stand-in, but this metadata "
                       f"({type(unwrap_metadata(meta)).__name__}) has no "
                       "load_jobs/store_jobs; " + why)
            raise WorkerReportMissing(missing_report_message(self.connector, why))
        if not self.scheduler_only or (real_only and publishes_worker_meta(
                self.connector)):  # its loads end only where its worker runs
            msg = no_worker_message(self.no_worker_reason)
            if self.on_no_worker is not None:
                self.on_no_worker(msg)
            raise NoWorkerHere(msg)
        return None

    def _sync_loads(self, so: Any) -> dict[str, tuple[int, int]]:
        """Request id -> ``(start, end)`` tokens of this step's synchronous loads."""
        out: dict[str, tuple[int, int]] = {}
        for nr in so.scheduled_new_reqs:
            answers = [a for a in self.matched.get(nr.req_id, ())
                       if a[1] is not None]
            if not answers:
                continue
            _local, n, is_async = answers[-1]
            if n and not is_async and nr.num_computed_tokens >= n:
                out[nr.req_id] = (nr.num_computed_tokens - int(n),
                                  nr.num_computed_tokens)
        return out

    def _wrap_connector(self) -> None:
        """Record the scheduler side's answers (``matched``, ``finished_returns``)."""
        c = self.connector
        if c is None or getattr(c, "_tvc_wrapped", False):
            return
        orig_match = c.get_num_new_matched_tokens

        def match(request: Any, num_computed_tokens: int) -> Any:
            ret = orig_match(request, num_computed_tokens)
            n, is_async = (ret if isinstance(ret, tuple) else (ret, False))
            self.matched.setdefault(request.request_id, []).append(
                (num_computed_tokens, n, bool(is_async)))
            self.match_steps.setdefault(request.request_id, []).append(
                self.num_steps)
            if n is not None:
                assert_match_within_prompt(request, num_computed_tokens, int(n),
                                           bool(is_async))
                if self.on_match is not None:
                    self.on_match(request, num_computed_tokens, int(n),
                                  bool(is_async))
            return ret

        c.get_num_new_matched_tokens = match
        for name in ("request_finished", "request_finished_all_groups"):
            orig = getattr(c, name, None)
            if orig is None:
                continue

            def wrapper(request: Any, block_ids: Any, _orig: Any = orig,
                        _name: str = name) -> Any:
                ret = _orig(request, block_ids)
                self.finished_returns[request.request_id] = (_name, ret)
                return ret

            setattr(c, name, wrapper)
        c._tvc_wrapped = True

    def busy(self) -> bool:
        """Whether vLLM's engine would step again: ``Scheduler.has_requests``.

        Requests left, finished ones not yet sent to the workers, or the
        connector's ``has_pending_push_work`` (store jobs that still hold blocks:
        vLLM 0.26.0 scheduler.py L2315-L2324, 0.28.0 L2494-L2509).
        """
        has_requests = getattr(self.scheduler, "has_requests", None)
        return bool(has_requests()) if has_requests else bool(
            self.scheduler.requests)

    def step_until_idle(self, step: Callable[[], object] | None = None) -> bool:
        """Step while vLLM's engine would (:meth:`busy`), or until nothing progressed.

        Stalled: ``max_steps`` steps in a row without a token computed, generated or
        a request leaving, and :attr:`min_stall_s` seconds since the last progress;
        at most ``20 * max_steps`` steps in all (a preemption loop). ``step``
        defaults to :meth:`step`.

        Returns:
            True when the engine went idle; False when it stalled.

        """
        step = step or self.step
        still = total = 0
        last: object = None
        since = time.monotonic()
        while self.busy():
            if total >= 20 * self.max_steps:
                return False
            if still >= self.max_steps:
                if time.monotonic() - since >= self.min_stall_s:
                    return False
                time.sleep(STALL_POLL_S)  # a transfer in flight: give it time
            step()
            total += 1
            now = sorted((rid, q.num_computed_tokens, q.num_output_tokens)
                         for rid, q in self.scheduler.requests.items())
            if now != last:
                still, since = 0, time.monotonic()
            else:
                still += 1
            last = now
        return True

    def why_finished_stay(self, left: Iterable[str]) -> str:
        """Why finished requests still hold their blocks, one sentence per cause.

        vLLM frees them at once unless ``request_finished`` returned
        ``delay_free_blocks=True`` (then at ``finished_sending``) or they finished
        while waiting for remote KV (then at ``finished_recving``:
        ``Scheduler.finish_requests``, ``_update_from_kv_xfer_finished``,
        vllm/v1/core/sched/scheduler.py, 0.26-0.33).
        """
        delayed = sorted(r for r in left if _delays_free(self.finished_returns.get(r)))
        waited = sorted(r for r in left if r not in delayed
                        and r in self.waited_remote
                        and r not in self.finished_recving)
        out = []
        if delayed:
            out.append(f"request_finished returned delay_free_blocks=True for "
                       f"{delayed} but the worker never reported them in "
                       "finished_sending")
        if waited:
            out.append(f"{waited} finished (aborted) while waiting for remote KV; "
                       "vLLM frees such a request's blocks only when get_finished "
                       "names it in finished_recving, which the worker never did: "
                       "report an aborted or cancelled receive in finished_recving "
                       "as soon as it stops")
        return "; ".join(out) or (
            "request_finished returned delay_free_blocks=True but the worker never "
            "reported the requests in finished_sending")

    def run_until_idle(self, extra_steps: int = 4) -> None:
        """Step until no request is left, then a few empty steps (async jobs).

        Raises:
            AssertionError: requests remain after ``max_steps`` steps.
            RigPlanError: a waiting request can never fit the pool.

        """
        if not self.step_until_idle():
            left = {r: str(q.status) for r, q in self.scheduler.requests.items()}
            if not left:
                raise AssertionError(
                    "has_pending_push_work() still answered True "
                    f"{self.max_steps} steps and {self.min_stall_s:g} s after the "
                    "last request left (connector.transfer_timeout_s): vLLM's "
                    "engine keeps stepping while it does (Scheduler.has_requests), "
                    "so it never goes idle. Answer False once every store job is "
                    "reported done (its blocks released)")
            if all(q.is_finished() for q in self.scheduler.requests.values()):
                pool = self.scheduler.kv_cache_manager.block_pool
                held = sum(1 for b in pool.blocks if b.ref_cnt)
                raise AssertionError(
                    f"finished requests {sorted(left)} never left the scheduler and "
                    f"{held} KV block(s) are still referenced after {self.max_steps} "
                    f"steps and {self.min_stall_s:g} s (connector."
                    f"transfer_timeout_s): {self.why_finished_stay(left)} "
                    "(leaked blocks)")
            too_big = self._beyond_pool()
            if too_big:
                raise RigPlanError(too_big)
            # vLLM asks again for a request it cannot admit: only answers that
            # matched something say the connector kept matching
            again = {r: n for r in left
                     if (n := sum(1 for a in self.matched.get(r, ()) if a[1])) > 2}
            if again:
                raise AssertionError(
                    f"requests still in the scheduler after {self.max_steps} steps "
                    f"without progress: {left}; vLLM asked the connector again "
                    "and again for them "
                    f"(get_num_new_matched_tokens answers: {again}): each load "
                    "failed or never landed and the connector kept matching the "
                    "same entries — a connector must stop matching an entry whose "
                    "load it reported failed")
            raise AssertionError(
                f"requests still in the scheduler after {self.max_steps} steps "
                f"and {self.min_stall_s:g} s without progress: {left} — a load or "
                "store never completed (the connector did not report it finished "
                f"within {self.min_stall_s:g} s, connector.transfer_timeout_s; "
                "vLLM sets no bound: raise it for a slower store)")
        for _ in range(extra_steps):
            self.step()

    def _beyond_pool(self) -> str:
        """Why waiting requests can never be admitted (the pool, not the connector).

        vLLM admits a request only when its whole prompt fits the free blocks
        (``SchedulerConfig.scheduler_reserve_full_isl``, default True in 0.28 and
        0.33; ``KVCacheManager.allocate_slots(full_sequence_must_fit=...)``); '' when
        every waiting request fits an empty pool.
        """
        mgr = self.scheduler.kv_cache_manager
        b = self.scheduler.vllm_config.cache_config.block_size
        usable = mgr.block_pool.num_gpu_blocks - 1  # block 0: vLLM's null block
        big = {rid: -(-r.num_tokens // b) for rid, r in self.scheduler.requests.items()
               if r.status.name in ("WAITING", "PREEMPTED")
               and -(-r.num_tokens // b) > usable}
        if not big:
            return ""
        return (f"the test's plan is wrong, not the connector: request(s) {big} "
                f"(blocks each needs for its tokens) waited {self.max_steps} steps "
                f"for a KV pool of {usable} usable blocks: vLLM admits a request "
                "only when its whole sequence fits the free blocks "
                "(scheduler_reserve_full_isl), so they never ran. Size the rig's "
                "pool (num_blocks) for the longest request")

    def run(self, *requests: Any) -> None:
        """Add ``requests`` and run to completion."""
        self.add(*requests)
        self.run_until_idle()


def _is_empty(worker_meta: Any) -> bool:
    """``KVConnectorWorkerMetadata.is_empty()`` where the class defines it."""
    is_empty = getattr(worker_meta, "is_empty", None)
    return bool(is_empty()) if callable(is_empty) else False


def zero_match_cause(driver: EngineDriver) -> str:
    """Why a replay of a stored prompt may have matched 0 tokens, from the run.

    Reads the ``kv_connector_worker_meta`` the worker side returned (vLLM's
    scheduler hands it to ``update_connector_output``,
    ``vllm/v1/core/sched/scheduler.py`` 0.26-0.33). Returns a sentence on unused
    worker metadata, or on a publishing connector whose worker reported nothing;
    "" otherwise.
    """
    if driver.worker_metas:
        kinds = sorted({type(m).__name__ for m in driver.worker_metas})
        return (f"the worker side returned {len(driver.worker_metas)} non-empty "
                f"worker metadata object(s) ({', '.join(kinds)}) from "
                "build_connector_worker_meta, and vLLM's scheduler handed each to "
                "the connector's update_connector_output, yet "
                "get_num_new_matched_tokens matched 0: the scheduler side did not "
                "publish what its workers reported as stored")
    if publishes_worker_meta(driver.connector):
        return (f"the connector publishes residency through worker metadata, but "
                f"its build_connector_worker_meta returned nothing non-empty in "
                f"{driver.num_steps} steps: its worker reported no save")
    return ""


def external_hit(driver: EngineDriver, request: Any) -> tuple[int, int, bool]:
    """What the connector answered vLLM for ``request`` (last definite answer).

    Returns ``(local computed tokens passed in, matched tokens, async flag)``;
    ``(0, 0, False)`` when never asked.
    """
    answers = [a for a in driver.matched.get(request.request_id, [])
               if a[1] is not None]
    if not answers:
        return 0, 0, False
    local, n, is_async = answers[-1]
    return local, int(n or 0), is_async
