"""How a suite run is scheduled and stopped: xdist grouping, variants, interrupts.

Used by :mod:`tvc.plugin`; nothing here is a test.

- **GPU owners on one xdist worker.** A test that starts a vLLM server, a storage
  daemon or opens the GPU store (one of :data:`GPU_OWNER_FIXTURES`, or a test of a
  tier in :data:`GPU_OWNER_TIERS`) gets ``xdist_group(GPU_OWNER_GROUP)``, and under
  xdist's default ``--dist load`` the suite's scheduler (:func:`make_scheduler`)
  sends all of them to one worker, one after another, instead of one
  server/daemon/store per worker on the same GPU. (xdist's own ``loadgroup`` cannot
  do it with pytest >= 9.1: it renames grouped items through ``item._nodeid``, which
  pytest no longer reads.) Each worker writes the node ids of the GPU owners it
  collected into a folder the controller gave it; the scheduler reads them once
  every worker has collected.
- **Device variants the connector cannot run.** The contract tier's worker tests are
  parametrised by ``device`` (``cpu``, ``cuda``); a device the profile's
  ``connector.worker_devices`` leaves out is deselected with one line, not skipped
  once per variant.
- **Interrupts.** An xdist worker watches its parent and exits (taking its own
  children) when the controller is gone (SIGKILL); Ctrl-C while the run is finishing
  is held back until the reports are written.
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
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import psutil
import pytest

GPU_OWNER_GROUP = "tvc-gpu-owners"
# fixtures that start a process on the GPU or open the GPU-direct store:
# fixtures/vllm.py, fixtures/model.py, fixtures/trace.py, fixtures/daemon.py,
# fixtures/store.py
GPU_OWNER_FIXTURES = ("vllm_server", "vllm_server_factory", "served_model",
                      "trace_campaign", "storage_daemon", "store_spec", "gpu_store")
GPU_OWNER_TIERS = ("e2e", "trace", "real_nvme", "bandwidth")
DEVICE_PARAM = "device"  # the contract tier's worker-variant parameter
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


def group_gpu_owners(items: Iterable[pytest.Item]) -> int:
    """Mark every GPU owner with ``xdist_group(GPU_OWNER_GROUP)``.

    Returns:
        the number of items marked.

    """
    n = 0
    for item in items:
        if owns_gpu(item):
            item.add_marker(pytest.mark.xdist_group(GPU_OWNER_GROUP))
            n += 1
    return n


OWNERS_DIR = pytest.StashKey[Path]()  # controller: where workers list their owners
OWNERS_DIR_KEY = "tvc_owners_dir"  # workerinput: the same folder


def write_owner_ids(folder: Path, worker_id: str, items: Iterable[pytest.Item]
                    ) -> Path:
    """Worker side: write the node ids of the GPU owners this worker collected.

    Returns:
        ``folder/owners-<worker_id>.json`` (a JSON list of node ids).

    """
    ids = [i.nodeid for i in items if owns_gpu(i)]
    path = folder / f"owners-{worker_id}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(ids))
    tmp.replace(path)  # whole file or none, should the controller look early
    return path


def read_owner_ids(folder: Path) -> set[str]:
    """Controller side: the union of every worker's GPU-owner node ids."""
    out: set[str] = set()
    for path in sorted(folder.glob("owners-*.json")):
        with contextlib.suppress(OSError, ValueError):
            out.update(json.loads(path.read_text()))
    return out


def make_scheduler(config: pytest.Config, log: Any, by_file: bool = False
                   ) -> Any:
    """The xdist scheduler: GPU owners as one unit on one worker, the rest balanced.

    A ``LoadGroupScheduling`` (xdist's load balancing over scopes) in which every
    GPU owner's scope is :data:`GPU_OWNER_GROUP`; any other test is its own scope,
    or with ``by_file`` its file's (the self-tests keep a module on one worker).

    Args:
        config: the controller's config (holds :data:`OWNERS_DIR`).
        log: xdist's scheduler log.
        by_file: scope the other tests by file.

    Returns:
        the scheduler, or None when the plugin set up no owners folder.

    """
    folder = config.stash.get(OWNERS_DIR, None)
    if folder is None:
        return None
    from xdist.scheduler import LoadGroupScheduling

    class GpuOwnerScheduling(LoadGroupScheduling):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(config, log)
            self._owners: set[str] | None = None

        def schedule(self) -> None:
            self._owners = read_owner_ids(folder)  # every worker has collected
            super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            if self._owners is None:
                self._owners = read_owner_ids(folder)
            if nodeid in self._owners:
                return GPU_OWNER_GROUP
            if by_file:
                return nodeid.split("::", 1)[0]
            return super()._split_scope(nodeid)

    return GpuOwnerScheduling()


def dist_line(config: pytest.Config) -> str:
    """The header line about xdist distribution ('' when xdist does not distribute).

    xdist turns ``-n N`` into ``--dist load`` in its ``pytest_cmdline_main``, before
    any ``pytest_configure``; the suite's scheduler takes ``load`` and ``loadgroup``.
    """
    dist = getattr(config.option, "dist", "no")
    if dist == "no" or not getattr(config.option, "tx", None):
        return ""
    if dist in ("load", "loadgroup"):
        return (f"xdist: --dist {dist}: tests that own a GPU server, daemon or store "
                f"run one after another on one worker ({GPU_OWNER_GROUP}); the "
                "others are load-balanced")
    return (f"xdist: --dist {dist} keeps its own order: GPU owners may run on several "
            "workers at once; use --dist load to keep them on one")


# -------------------------------------------------------------- device variants

def device_of(item: pytest.Item) -> str | None:
    """The ``device`` parameter of a contract-tier test, else None."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or item.get_closest_marker("contract") is None:
        return None
    value = callspec.params.get(DEVICE_PARAM)
    return value if isinstance(value, str) else None


def split_device_variants(items: Sequence[pytest.Item],
                          worker_devices: Sequence[str]
                          ) -> tuple[list[pytest.Item], dict[str, list[pytest.Item]]]:
    """Split off the device variants the connector's worker side cannot run.

    Args:
        items: the collected items.
        worker_devices: the profile's ``connector.worker_devices``.

    Returns:
        (kept items, device -> deselected items).

    """
    keep: list[pytest.Item] = []
    dropped: dict[str, list[pytest.Item]] = {}
    allowed = set(worker_devices)
    for item in items:
        dev = device_of(item)
        if dev is not None and dev not in allowed:
            dropped.setdefault(dev, []).append(item)
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


def watch_parent(parent_pid: int, interval_s: float = WATCH_INTERVAL_S
                 ) -> threading.Thread:
    """Exit this process (and its children) once ``parent_pid`` is no longer its parent.

    An xdist worker's parent is the controller. A SIGKILLed controller cannot tell
    its workers to stop, and a worker blocked on a test or a server would live on,
    holding the GPU. Linux re-parents an orphan (to init or a subreaper), so a
    changed ``os.getppid()`` means the controller is gone.

    Args:
        parent_pid: the controller's pid (``os.getppid()`` at start-up).
        interval_s: poll period in seconds.

    Returns:
        the (daemon) watcher thread, started.

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


class HoldInterrupts:
    """Hold Ctrl-C (SIGINT) back while the run writes its reports.

    A Ctrl-C during xdist's worker shutdown or pytest's report writing would
    otherwise abort that code with a long ``KeyboardInterrupt`` traceback and leave
    no reports. Inside the ``with`` block the first two SIGINTs are counted (one
    line says so); the third raises ``KeyboardInterrupt`` as before. Only the main
    thread can set signal handlers; elsewhere this does nothing.

    Attributes:
        count: SIGINTs received inside the block.

    """

    LIMIT = 3

    def __init__(self) -> None:
        self.count = 0
        self._old: Any = None
        self._armed = False

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.count >= self.LIMIT:
            raise KeyboardInterrupt
        if self.count == 1:
            with contextlib.suppress(Exception):
                sys.stderr.write("\ntvc: interrupted while finishing: writing the "
                                 "reports first (Ctrl-C twice more to abort)\n")

    def __enter__(self) -> HoldInterrupts:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
            self._armed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._armed:
            signal.signal(signal.SIGINT, self._old)
            self._armed = False


class DeferInterrupts:
    """Defer Ctrl-C during pytest's start-up (conftests, option parsing).

    A KeyboardInterrupt raised while pytest loads conftests or parses options
    escapes pytest with Python's full traceback and leaves no reports. The plugin
    installs this from ``pytest_load_initial_conftests`` until its
    ``pytest_configure``, which re-raises a deferred Ctrl-C once the run folder is
    open (pytest then reports the run as interrupted). :meth:`restore` also runs as a
    config clean-up, so an early exit (usage error) puts the handler back.

    Attributes:
        count: SIGINTs deferred.

    """

    def __init__(self) -> None:
        self.count = 0
        self._old: Any = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1

    def install(self) -> bool:
        """Install the handler (main thread, default handler only); True if done."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return False
        self._old = signal.signal(signal.SIGINT, self._handler)
        return True

    def restore(self) -> int:
        """Put the previous handler back; return the SIGINTs deferred meanwhile."""
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None
        return self.count
