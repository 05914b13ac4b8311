"""Store bandwidth: measurement, graded thresholds, reference lines and the chart.

Figures are decimal GB/s (1e9 B, the operators' unit) and GiB/s (2**30 B); each
measurement moves ``TOTAL_BYTES`` ``REPETITIONS`` times (median, min, max). Reads follow
an fsync and ``posix_fadvise(DONTNEED)``; writes include ``store.sync()``. Labels:
``direct`` (claimed and verified, :func:`verified_direct_io`), ``cache dropped`` or
``cached`` (may be page-cache speed). Thresholds (:func:`threshold_gbps`) are the
operators' graded points for 1, 4 (a NUMA node) and 8 disks, set in ``[bandwidth]``
(defaults in ``tvc.config.profile.SCHEMA["bandwidth"]``).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tvc.core.files import save_figure, write_file

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
GB = 1e9
IO_SIZES = (256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB)  # bytes per call
TOTAL_BYTES = 1 * GIB  # bytes moved per measurement (the operators' spec: >= 1 GiB)
REPETITIONS = 3  # repetitions per measurement
GRADE_POINTS = ((1, "single_disk_gbps"), (4, "numa_node_gbps"), (8, "machine_gbps"))


def summarize(nbytes: int, seconds: Sequence[float]) -> dict[str, Any]:
    """Median, min and max throughput of repetitions that each moved ``nbytes``.

    ``seconds`` per repetition (> 0).

    Returns:
        ``median_gbps``, ``min_gbps``, ``max_gbps`` (1e9 B/s), the same in ``*_gibps``
        (2**30 B/s), ``reps`` and ``bytes``.

    Raises:
        ValueError: no repetitions, or a non-positive time.

    """
    if not seconds or min(seconds) <= 0:
        raise ValueError(f"need positive repetition times, got {list(seconds)}")
    rates = [nbytes / s for s in seconds]
    med, lo, hi = statistics.median(rates), min(rates), max(rates)
    return {"median_gbps": med / GB, "min_gbps": lo / GB, "max_gbps": hi / GB,
            "median_gibps": med / GIB, "min_gibps": lo / GIB, "max_gibps": hi / GIB,
            "reps": len(seconds), "bytes": nbytes}


def threshold_gbps(num_disks: int, section: Mapping[str, Any]) -> tuple[float, str]:
    """The GB/s a store on ``num_disks`` disks should reach, and the tier phrase.

    Points (1, ``single_disk_gbps``), (4, ``numa_node_gbps``), (8, ``machine_gbps``) are
    interpolated linearly; beyond 8 the machine figure holds. The phrase is e.g. ``"one
    NUMA node (4 disks)"``.

    Raises:
        ValueError: ``num_disks`` < 1.

    """
    if num_disks < 1:
        raise ValueError(f"[bandwidth] num_disks must be >= 1, got {num_disks}")
    names = {1: "one disk", 4: "one NUMA node (4 disks)",
             8: "the whole machine (8 disks)"}
    pts = [(n, float(section[k])) for n, k in GRADE_POINTS]
    for n, v in pts:
        if num_disks == n:
            return v, names[n]
    if num_disks > pts[-1][0]:
        return pts[-1][1], f"{num_disks} disks (at least {names[8]})"
    for (n0, v0), (n1, v1) in zip(pts, pts[1:], strict=False):
        if n0 < num_disks < n1:
            v = v0 + (v1 - v0) * (num_disks - n0) / (n1 - n0)
            return v, (f"{num_disks} disks (interpolated between {names[n0]} and "
                       f"{names[n1]})")
    raise AssertionError("unreachable")


def compare(direction: str, measured_gbps: float, threshold: float, tier: str,
            label: str, io_size: int) -> str:
    """An empty string when ``measured_gbps`` meets ``threshold``, else the failure.

    ``measured_gbps`` is the best median over I/O sizes (GB/s), at ``io_size`` bytes;
    the failure says expected, seen and what to do.
    """
    if measured_gbps >= threshold:
        return ""
    return (f"store {direction} throughput: expected >= {threshold:.2f} GB/s for "
            f"{tier}, saw {measured_gbps:.2f} GB/s ({label}; best median over I/O "
            f"sizes, at {io_size // KIB} KiB). Check that the profile's "
            "[bandwidth] num_disks matches the disks the store really uses, that the "
            "I/O path is GPU-direct, and that no other load shares the disks.")


def drop_page_cache(paths: Iterable[Path | str]) -> bool:
    """Flush and drop regular files' page cache (others skipped); True if all were."""
    ok = True
    for p in paths:
        p = Path(p)
        if not p.is_file():
            continue
        try:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except (OSError, AttributeError):
            ok = False
    return ok


def cache_label(direct_io: bool, dropped: bool) -> str:
    """``direct``, ``cache dropped`` or ``cached`` (see the module docstring)."""
    if direct_io:
        return "direct"
    return "cache dropped" if dropped else "cached"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


_DIRECT: dict[int, bool] = {}  # id(store) -> its page-cache bypass, as measured


def verified_direct_io(store: Any, device: str) -> bool:
    """Whether the store both claims and is seen to bypass the page cache.

    Measured once per store (:func:`tvc.store.checks.measure_direct_io`); an
    unobservable claim is not taken.
    """
    if id(store) not in _DIRECT:
        from tvc.store.checks import measure_direct_io

        facts = (measure_direct_io(store, 7, device) if store.direct_io
                 else {"direct": False})
        _DIRECT[id(store)] = bool(store.direct_io and facts["direct"])
    return _DIRECT[id(store)]


def measure_store(store: Any, direction: str, io_size: int, device: str,
                  total: int = TOTAL_BYTES, reps: int = REPETITIONS
                  ) -> tuple[list[float], str]:
    """Time ``reps`` passes of ``total`` bytes through the store in ``io_size`` calls.

    Writes cover ``[0, total)`` and end with ``store.sync()``; reads follow a page-cache
    drop. ``total`` is a multiple of ``io_size`` (bytes); the store holds >= ``total``.

    Returns:
        (seconds per repetition, page-cache label: ``direct`` only where
        :func:`verified_direct_io` saw it).

    """
    import torch

    from tvc.store.checks import pattern

    if total % io_size or total > store.capacity:
        raise ValueError(f"total {total} must be a multiple of {io_size} and fit "
                         f"the pool ({store.capacity} bytes)")
    buf = (pattern(0, io_size, 3, device) if direction == "write"
           else torch.empty(io_size, dtype=torch.uint8, device=device))
    op = store.write if direction == "write" else store.read
    times, dropped = [], True
    for _ in range(reps):
        if direction == "read":
            dropped = drop_page_cache(store.files()) and dropped
        _sync(device)
        t0 = time.perf_counter()
        for off in range(0, total, io_size):
            op(off, buf)
        if direction == "write":
            store.sync()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times, cache_label(verified_direct_io(store, device), dropped)


def measure_kvikio_file(path: Path, direction: str, device: str,
                        total: int = TOTAL_BYTES, reps: int = REPETITIONS
                        ) -> list[float]:
    """Time kvikio's own ``CuFile`` pread/pwrite of ``total`` bytes of ``path``.

    One call per repetition, kvikio's default task size and pool (as kvikio's
    benchmark); cache dropped before reads. Returns seconds per repetition.

    Raises:
        tvc.store.gpu_direct.StoreError: kvikio does not import.

    """
    import torch

    from tvc.store.gpu_direct import import_kvikio

    kvikio = import_kvikio()
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    if direction == "write":
        buf.fill_(0x3C)
    times = []
    with kvikio.CuFile(str(path), "r+") as f:
        for _ in range(reps):
            if direction == "read":
                drop_page_cache([path])
            _sync(device)
            t0 = time.perf_counter()
            if direction == "write":
                got = f.pwrite(buf, total, 0).get()
                os.fsync(f.fileno())
            else:
                got = f.pread(buf, total, 0).get()
            _sync(device)
            times.append(time.perf_counter() - t0)
            if got != total:
                raise RuntimeError(f"kvikio {direction} moved {got} of {total} bytes")
    return times


def measure_pinned_copy(total: int = TOTAL_BYTES, reps: int = REPETITIONS,
                        chunk: int = 256 * MIB) -> dict[str, list[float]]:
    """Pinned host <-> device copy times (the PCIe ceiling), ``total`` bytes each.

    Returns ``{"h2d": [s, ...], "d2h": [s, ...]}``.
    """
    import torch

    host = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    out: dict[str, list[float]] = {"h2d": [], "d2h": []}
    for name, (dst, src) in (("h2d", (dev, host)), ("d2h", (host, dev))):
        dst.copy_(src, non_blocking=True)  # warm-up
        torch.cuda.synchronize()
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(total // chunk):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            out[name].append(time.perf_counter() - t0)
    return out


def best(per_size: Mapping[int, Mapping[str, Any]]) -> tuple[int, dict[str, Any]]:
    """The I/O size with the highest median, and its summary."""
    size = max(per_size, key=lambda s: per_size[s]["median_gbps"])
    return size, dict(per_size[size])


def bar_chart(results: Mapping[str, Any], path: Path,
              savefig: Callable[..., Any] | None = None) -> Path | None:
    """Draw one PNG bar chart of the store's median GB/s per I/O size.

    Write/read bars with min-max whiskers; threshold and references as lines.
    ``results`` is ``{"write": {size: summary}, "read": {...}, "threshold_gbps", "refs":
    {name: GB/s}, "title"}``. Returns ``path``, or None without matplotlib (the
    ``plots`` extra).
    """
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(results["write"])
    fig, ax = plt.subplots(figsize=(9, 5))
    width = 0.38
    for k, (direction, color) in enumerate((("write", "tab:blue"),
                                            ("read", "tab:orange"))):
        med = [results[direction][s]["median_gbps"] for s in sizes]
        d = results[direction]
        lo = [m - d[s]["min_gbps"] for m, s in zip(med, sizes, strict=True)]
        hi = [d[s]["max_gbps"] - m for m, s in zip(med, sizes, strict=True)]
        xs = [i + (k - 0.5) * width for i in range(len(sizes))]
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, color=color,
               label=f"store {direction} (median, min-max)")
    styles = iter(("--", ":", "-.", (0, (5, 1)), (0, (1, 3))))
    ax.axhline(results["threshold_gbps"], color="red", linestyle="-",
               label=f"threshold {results['threshold_gbps']:.2f} GB/s")
    for name, gbps in results.get("refs", {}).items():
        if gbps:
            ax.axhline(gbps, color="gray", linestyle=next(styles),
                       label=f"{name} {gbps:.2f} GB/s")
    ax.set_xticks(range(len(sizes)))
    ax.set_xticklabels([f"{s // KIB} KiB" if s < MIB else f"{s // MIB} MiB"
                        for s in sizes])
    ax.set_xlabel("I/O size per call")
    # log scale: the PCIe reference line (~55 GB/s) would flatten disk-speed bars
    ax.set_yscale("log")
    ax.set_ylabel("GB/s (1e9 B/s), log scale")
    ax.set_title(results.get("title", "store bandwidth"), fontsize=10)
    ax.legend(fontsize=8, loc="upper left", framealpha=0.9)
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    if savefig is not None:
        savefig(path, dpi=110)
    else:
        save_figure(fig, path)
    plt.close(fig)
    return path


def write_json(results: Mapping[str, Any], path: Path) -> Path:
    """Write the measurement as JSON (I/O sizes as strings)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_file(path, json.dumps(results, indent=2, default=str) + "\n")
