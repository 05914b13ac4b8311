"""How a suite run is scheduled and stopped: xdist grouping, variants, interrupts.

Used by :mod:`tvc.plugin.hooks`; nothing here is a test.

- GPU owners (:data:`GPU_OWNER_FIXTURES`, :data:`GPU_OWNER_TIERS`) run in one to three
  xdist lanes through :func:`make_scheduler` (docs/servers.md#gpu-lanes-under-xdist).
  xdist's own ``loadgroup`` renames items through ``item._nodeid``, which pytest
  >= 9.1 no longer reads.
- Device variants ``connector.worker_devices`` leaves out are deselected with one line
  (:func:`split_device_variants`).
- Interrupts: SIGTERM/SIGHUP stop a run like Ctrl-C, workers exit with a dead
  controller, late signals are held until the reports are written (docs/safety.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

GPU_OWNER_GROUP = "tvc-gpu-owners"
GPU_LANE_B = "tvc-gpu-owners-b"  # second GPU lane: tests that plan their own servers
GPU_LANE_C = "tvc-gpu-owners-c"  # third: tests that restart a server (a start chain)
# fixtures that start a process on the GPU or open the GPU-direct store:
# tvc/fixtures/{vllm,model,trace,daemon,store}.py
GPU_OWNER_FIXTURES = ("vllm_server", "vllm_server_factory", "served_model",
                      "trace_campaign", "storage_daemon", "store_spec", "gpu_store")
GPU_OWNER_TIERS = ("e2e", "trace", "real_nvme", "bandwidth")
DEVICE_PARAM = "device"  # the contract tier's worker-variant parameter
RIG_PARAM = "make_rig"  # the scenario rig fixture's device parameter
WATCH_INTERVAL_S = 0.5  # parent poll period: a dead controller is seen within 0.5 s
CHILD_GRACE_S = 1.5  # SIGTERM -> SIGKILL for a dead controller's grandchildren
EXIT_PARENT_GONE = 3


# ------------------------------------------------------------------ xdist grouping

def owns_gpu(item: pytest.Item) -> bool:
    """Whether ``item`` starts a GPU process or opens the GPU store (see module doc)."""
    names = set(getattr(item, "fixturenames", ()))
    if names.intersection(GPU_OWNER_FIXTURES):
        return True
    return any(item.get_closest_marker(t) is not None for t in GPU_OWNER_TIERS)


def gpu_lane(item: pytest.Item, lanes: int = 1) -> str:
    """The xdist group of a GPU owner: lane A, B or C.

    ``lanes >= 3``: a module with ``tvc_restarts_server = True`` runs in lane C (the
    longest start chain: it held lane B 104 of 148 s on the H200, 2026-12-04).
    ``lanes >= 2``: a module defining ``tvc_servers`` (tvc/fixtures/vllm.py) runs in
    lane B. Every other owner: lane A (:data:`GPU_OWNER_GROUP`).
    """
    module = getattr(item, "module", None)
    if lanes >= 3 and getattr(module, "tvc_restarts_server", False):
        return GPU_LANE_C
    if lanes >= 2 and callable(getattr(module, "tvc_servers", None)):
        return GPU_LANE_B
    return GPU_OWNER_GROUP


def group_gpu_owners(items: Iterable[pytest.Item], lanes: int = 1) -> int:
    """Mark every GPU owner with ``xdist_group(<its lane>)``; return how many."""
    n = 0
    for item in items:
        if owns_gpu(item):
            item.add_marker(pytest.mark.xdist_group(gpu_lane(item, lanes)))
            n += 1
    return n


def chains_first(items: list[pytest.Item], lanes: int) -> int:
    """Move the lane-C tests (:func:`gpu_lane`) to the front; return the count moved.

    xdist hands out the largest scopes first, else collection order: lane C waited
    behind the contract tier, its starts began 89 s into a 173 s H200 run (2026-12-05).
    """
    if lanes < 3:
        return 0
    chain = [i for i in items if owns_gpu(i) and gpu_lane(i, lanes) == GPU_LANE_C]
    if chain:
        moved = {id(i) for i in chain}
        items[:] = chain + [i for i in items if id(i) not in moved]
    return len(chain)


OWNERS_DIR = pytest.StashKey[Path]()  # controller: where workers list their owners
OWNERS_DIR_KEY = "tvc_owners_dir"  # workerinput: the same folder


def write_owner_ids(folder: Path, worker_id: str, items: Iterable[pytest.Item],
                    lanes: int = 1) -> Path:
    """Worker side: write ``folder/owners-<worker_id>.json`` (node id -> lane)."""
    ids = {i.nodeid: gpu_lane(i, lanes) for i in items if owns_gpu(i)}
    path = folder / f"owners-{worker_id}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(ids))
    tmp.replace(path)  # whole file or none, should the controller look early
    return path


def read_owner_ids(folder: Path) -> dict[str, str]:
    """Controller side: every worker's GPU-owner node ids and their lanes.

    A list (one lane) reads as every id in :data:`GPU_OWNER_GROUP`.
    """
    out: dict[str, str] = {}
    for path in sorted(folder.glob("owners-*.json")):
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            if isinstance(data, list):
                data = dict.fromkeys(data, GPU_OWNER_GROUP)
            out.update(data)
    return out


def hw_levels(items: Iterable[pytest.Item]) -> dict[str, str]:
    """Node id -> hardware level (``hw_gpu`` -> ``gpu``) of items that need one."""
    out = {}
    for item in items:
        level = next((m.name[3:] for m in item.iter_markers()
                      if m.name.startswith("hw_") and m.name != "hw_any"), "")
        if level:
            out[item.nodeid] = level
    return out


def write_hw_levels(folder: Path, worker_id: str, items: Iterable[pytest.Item]
                    ) -> Path:
    """Worker side: write ``folder/hw-<worker_id>.json`` (node id -> level); return it.

    Lets the controller tell a never-reached test this box would have skipped.
    """
    path = folder / f"hw-{worker_id}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(hw_levels(items)))
    tmp.replace(path)
    return path


def read_hw_levels(folder: Path) -> dict[str, str]:
    """Controller side: every worker's :func:`write_hw_levels`, merged."""
    out: dict[str, str] = {}
    for path in sorted(folder.glob("hw-*.json")):
        with contextlib.suppress(OSError, ValueError):
            out.update(json.loads(path.read_text()))
    return out


def make_scheduler(config: pytest.Config, log: Any, by_file: bool = False,
                   spread: Collection[str] = ()) -> Any:
    """The xdist scheduler: GPU owners as one unit per lane, the rest balanced.

    A ``LoadGroupScheduling`` whose GPU-owner scopes are their lanes (:func:`gpu_lane`).
    ``by_file`` scopes the other tests by file (the self-tests keep a module on one
    worker), except the files in ``spread``. None without an :data:`OWNERS_DIR`.
    """
    found = config.stash.get(OWNERS_DIR, None)
    if found is None:
        return None
    folder: Path = found
    from xdist.scheduler import LoadGroupScheduling

    class GpuOwnerScheduling(LoadGroupScheduling):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(config, log)
            self._owners: dict[str, str] | None = None

        def schedule(self) -> None:
            self._owners = read_owner_ids(folder)  # every worker has collected
            super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            if self._owners is None:
                self._owners = read_owner_ids(folder)
            if nodeid in self._owners:
                return self._owners[nodeid]
            if by_file and nodeid.split("::", 1)[0] not in spread:
                return nodeid.split("::", 1)[0]
            return super()._split_scope(nodeid)

    return GpuOwnerScheduling()


LANES_KEY = "tvc_gpu_lanes"  # workerinput: the controller's gpu_lanes()


def gpu_lanes(config: pytest.Config) -> int:
    """``--tvc-gpu-lanes``, else 3 with >= 6 xdist workers, 2 with >= 3; workers ask."""
    given = getattr(config, "workerinput", {}).get(LANES_KEY)
    if given:
        return int(given)
    value = getattr(config.option, "tvc_gpu_lanes", None)
    if value:
        return int(value)
    workers = getattr(config.option, "numprocesses", None)
    try:
        n = int(workers) if workers is not None else 0
        return 3 if n >= 6 else 2 if n >= 3 else 1
    except (TypeError, ValueError):
        return 1


def dist_line(config: pytest.Config) -> str:
    """The header line about xdist distribution ('' when xdist does not distribute).

    The suite's scheduler takes ``load`` and ``loadgroup`` (xdist turns ``-n N`` into
    ``--dist load`` before any ``pytest_configure``).
    """
    dist = getattr(config.option, "dist", "no")
    if dist == "no" or not getattr(config.option, "tx", None):
        return ""
    if dist in ("load", "loadgroup"):
        lanes = gpu_lanes(config)
        names = ", ".join((GPU_OWNER_GROUP, GPU_LANE_B, GPU_LANE_C)[:lanes])
        return (f"xdist: --dist {dist}: tests that own a GPU server, daemon or store "
                f"run one after another in {lanes} GPU lane(s) ({names}); the "
                "others are load-balanced")
    return (f"xdist: --dist {dist} keeps its own order: GPU owners may run on several "
            "workers at once; use --dist load to keep them on one")


# -------------------------------------------------------------- device variants

def device_of(item: pytest.Item, param: str = DEVICE_PARAM) -> str | None:
    """The ``param`` device parameter of a contract-tier test, else None."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or item.get_closest_marker("contract") is None:
        return None
    value = callspec.params.get(param)
    return value if isinstance(value, str) else None


def split_device_variants(items: Sequence[pytest.Item],
                          worker_devices: Sequence[str], gpu_here: bool = False
                          ) -> tuple[list[pytest.Item], dict[str, list[pytest.Item]]]:
    """Split off the device variants the connector's worker side cannot run.

    ``worker_devices`` is ``connector.worker_devices``; ``gpu_here``: the box has a
    CUDA GPU. Returns (kept items, device -> deselected items); a ``make_rig`` ``[cpu]``
    variant goes only for a CUDA-only worker where a GPU is here, a ``[cuda]`` one
    wherever ``worker_devices`` lacks cuda (its fixture would skip it everywhere).
    """
    keep: list[pytest.Item] = []
    dropped: dict[str, list[pytest.Item]] = {}
    allowed = set(worker_devices)
    cuda_only = gpu_here and "cuda" in allowed and "cpu" not in allowed
    for item in items:
        dev = device_of(item)
        rig = device_of(item, RIG_PARAM)
        if dev is not None and dev not in allowed:
            dropped.setdefault(dev, []).append(item)
        elif (rig == "cpu" and cuda_only) or (rig == "cuda" and "cuda" not in
                                               allowed):
            dropped.setdefault(rig, []).append(item)
        else:
            keep.append(item)
    return keep, dropped


def variant_line(device: str, count: int, worker_devices: Sequence[str]) -> str:
    """``deselected 24 [cpu] worker variants: connector.worker_devices = ['cuda']``."""
    return (f"deselected {count} [{device}] worker variants: "
            f"connector.worker_devices = {list(worker_devices)!r}")


def tally(items: Iterable[pytest.Item], why: str,
          tiers: Sequence[str]) -> list[dict[str, Any]]:
    """Deselected items per tier: ``[{"tier", "count", "why"}]``."""
    c: Counter[str] = Counter()
    for item in items:
        tier = next((t for t in tiers if item.get_closest_marker(t) is not None),
                    "other")
        c[tier] += 1
    return [{"tier": t, "count": n, "why": why} for t, n in sorted(c.items())]


def merge_tallies(a: list[dict[str, Any]], b: list[dict[str, Any]]
                  ) -> list[dict[str, Any]]:
    """Add up two tallies (same tier and reason: counts add)."""
    c: Counter[tuple[str, str]] = Counter()
    for row in (*a, *b):
        c[row["tier"], row["why"]] += int(row["count"])
    return [{"tier": t, "count": n, "why": w} for (t, w), n in sorted(c.items())]


# ------------------------------------------------------------------- interrupts

def kill_descendants(grace_s: float = CHILD_GRACE_S) -> None:
    """SIGTERM every descendant of this process, SIGKILL what is left after grace."""
    import psutil  # here: this module is imported while Ctrl-C is not yet deferred

    try:
        kids = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for p in kids:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(kids, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()


def signal_children(signum: int) -> list[int]:
    """Send ``signum`` to this process's direct children (xdist workers); return pids.

    A SIGTERM sent to the controller alone (``kill PID``, CI) reaches no worker.
    """
    import psutil

    try:
        kids = psutil.Process().children()
    except psutil.Error:
        return []
    sent = []
    for p in kids:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signum)
            sent.append(p.pid)
    return sent


def watch_parent(parent_pid: int, interval_s: float = WATCH_INTERVAL_S
                 ) -> threading.Thread:
    """Exit this process (and children) once ``parent_pid`` is no longer its parent.

    A SIGKILLed xdist controller cannot stop its workers; Linux re-parents an orphan.
    Polls every ``interval_s`` s; returns the started daemon thread.
    """
    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent_pid:
                with contextlib.suppress(Exception):
                    sys.stderr.write(f"tvc: xdist controller {parent_pid} is gone; "
                                     f"worker {os.getpid()} exits\n")
                    kill_descendants()
                os._exit(EXIT_PARENT_GONE)

    t = threading.Thread(target=watch, name="tvc-parent-watch", daemon=True)
    t.start()
    return t


TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # CI runners, Kubernetes,
#   a closed terminal: stopped like Ctrl-C, reported as run.outcome "terminated"


class HoldInterrupts:
    """Hold Ctrl-C (SIGINT) back while the run writes its reports.

    The first two SIGINTs (and each SIGTERM/SIGHUP) are counted in ``count`` (the first
    SIGTERM/SIGHUP in ``signum``); the third SIGINT raises ``KeyboardInterrupt``. Main
    thread only. An xdist worker holds silently (``announce=False``): its late SIGINT
    is execnet's (``WorkerGateway._terminate_execution``, 5 s after the gateway
    closed).
    """

    LIMIT = 3

    def __init__(self, announce: bool = True,
                 signals: tuple[int, ...] = (signal.SIGINT, *TERMINATING_SIGNALS)
                 ) -> None:
        self.count = 0
        self.signum: int | None = None
        self.announce = announce
        self.signals = signals
        self._old: dict[int, Any] = {}
        self._armed = False

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if signum != signal.SIGINT and self.signum is None:
            self.signum = signum
        if self.count >= self.LIMIT:
            raise KeyboardInterrupt
        if self.count == 1 and self.announce:
            with contextlib.suppress(Exception):
                sys.stderr.write(f"\ntvc: {signal.Signals(signum).name} while "
                                 "finishing: writing the reports first (two more "
                                 "to abort)\n")

    def __enter__(self) -> HoldInterrupts:
        if threading.current_thread() is threading.main_thread():
            self._old = {sig: signal.signal(sig, self._handler)
                         for sig in self.signals}
            self._armed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._armed:
            for sig, old in self._old.items():
                signal.signal(sig, old)
            self._armed = False




_STOPPED_BY: list[int] = []  # signals that stopped this process's run, in order


def stopped_by() -> int | None:
    """The first SIGINT, SIGTERM or SIGHUP this process's run got, else None."""
    return _STOPPED_BY[0] if _STOPPED_BY else None


def note_stop(signum: int) -> None:
    """Record a stop seen elsewhere: an xdist worker ended by Ctrl-C.

    The controller may ignore SIGINT, as a shell's background job does.
    """
    _STOPPED_BY.append(signum)


class TerminateLikeInterrupt:
    """SIGTERM and SIGHUP stop the run the way Ctrl-C does; ``signum`` keeps which.

    While installed, either raises ``KeyboardInterrupt`` in the main thread, so fixtures
    tear down and reports are written; Ctrl-C does what Python's handler does and is
    recorded too (:func:`stopped_by`: an xdist worker lost to the stop is no red). A
    handler someone else set is left alone.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        _STOPPED_BY.append(signum)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    @staticmethod
    def _ctrl_c(signum: int, frame: FrameType | None) -> None:
        _STOPPED_BY.append(signum)
        signal.default_int_handler(signum, frame)

    def install(self) -> bool:
        """Install the handlers (main thread, default handlers only); True if any."""
        if threading.current_thread() is not threading.main_thread():
            return False
        _STOPPED_BY.clear()
        for sig in TERMINATING_SIGNALS:
            if signal.getsignal(sig) is signal.SIG_DFL:
                self._old[sig] = signal.signal(sig, self._handler)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._old[signal.SIGINT] = signal.signal(signal.SIGINT, self._ctrl_c)
        return bool(self._old)

    def restore(self) -> None:
        """Put the previous handlers back where ours are still installed.

        A handler installed after ours (an xdist worker's hold at its end) stays.
        """
        for sig, old in self._old.items():
            if signal.getsignal(sig) in (self._handler, self._ctrl_c):
                signal.signal(sig, old)
        self._old = {}


class QuietWorkerStart:
    """Ctrl-C during xdist's worker start reaches the controller, not the workers.

    While a worker spawns, SIGINT is blocked in the controller's main thread
    (``pthread_sigmask``, inherited by the child); a SIGINT on another thread is
    only recorded. After each spawn a held Ctrl-C goes to the previous handler;
    the worker unblocks in :func:`release_worker_sigint`.
    """

    def __init__(self, workers: int) -> None:
        self.left = workers
        self.blocked = False
        self.recorded = False
        self._old: Any = None

    def _record(self, signum: int, frame: Any) -> None:
        self.recorded = True

    def start(self) -> None:
        """Hold SIGINT for the first spawn (main thread only)."""
        if self.left > 0 and threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._record)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            self.blocked = True

    def spawned(self) -> None:
        """One worker is spawned: release after the last, or at once on a Ctrl-C."""
        self.left -= 1
        if self.blocked and (self.left <= 0 or self.recorded
                             or signal.SIGINT in signal.sigpending()):
            self.stop()

    def stop(self) -> None:
        """Put the previous handler back, unblock SIGINT, deliver a held Ctrl-C.

        Raises KeyboardInterrupt when one was held and the previous handler is
        the default one.
        """
        if not self.blocked:
            return
        self.blocked = False
        self.left = 0
        if signal.SIGINT in signal.sigpending():
            signal.sigtimedwait({signal.SIGINT}, 0)
            self.recorded = True
        handler, self._old = self._old, None
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        if self.recorded:
            self.recorded = False
            if callable(handler):
                handler(signal.SIGINT, None)
            elif handler == signal.SIG_DFL:
                raise KeyboardInterrupt


def release_worker_sigint() -> bool:
    """In a worker (:class:`QuietWorkerStart`): unblock SIGINT, drop one held.

    Returns True when SIGINT was blocked.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, ()):
        return False
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    finally:
        signal.signal(signal.SIGINT, old)
    return True


class DeferInterrupts:
    """Defer Ctrl-C, SIGTERM and SIGHUP during pytest's start-up.

    Installed from ``pytest_load_initial_conftests``; ``pytest_configure`` re-raises a
    deferred signal once the run folder is open. :meth:`restore` is also a config
    clean-up (an early usage error). ``count``: signals deferred; ``signum``: the
    first SIGTERM/SIGHUP, or None.
    """

    def __init__(self) -> None:
        self.count = 0
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if signum != signal.SIGINT and self.signum is None:
            self.signum = signum

    def install(self) -> bool:
        """Install the handlers (main thread, default handlers only); True if done."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return False
        self._old[signal.SIGINT] = signal.signal(signal.SIGINT, self._handler)
        for sig in TERMINATING_SIGNALS:
            if signal.getsignal(sig) is signal.SIG_DFL:
                self._old[sig] = signal.signal(sig, self._handler)
        return True

    def restore(self) -> int:
        """Put the previous handlers back; return the signals deferred meanwhile."""
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
        return self.count


def defer_while_plugins_load() -> DeferInterrupts | None:
    """Defer Ctrl-C from the moment pytest imports the plugin; the deferral, or None.

    Acts only under ``load_setuptools_entrypoints``; ``pytest_load_initial_conftests``
    hands it to the suite's run or, in anyone else's run, restores the handler and
    raises a deferred Ctrl-C at once.
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "load_setuptools_entrypoints":
            early = DeferInterrupts()
            return early if early.install() else None
        frame = frame.f_back
    return None
