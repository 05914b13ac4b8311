"""Named checks on a GPU-direct store, one invariant each (used by the store tiers).

Every check raises ``AssertionError`` with what was expected, what was seen and what to
do; comparisons run where the data lives (on the GPU for ``device="cuda"``), bit-exact.
The pattern is position-dependent (:func:`pattern`), so a byte landing at the wrong
offset is caught as surely as a flipped one.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from tvc.store.gpu_direct import (
    GpuDirectStore,
    StoreSpec,
    outside_allowed,
    run_store_worker,
)

PATTERN_PIECE = 1 << 24  # elements per pattern piece (bounds the int64 temporary)
CHUNK_BYTES = 256 << 20  # bytes per transfer when sweeping a whole pool


def pattern(offset: int, nbytes: int, seed: int, device: str = "cpu") -> Any:
    """A deterministic byte pattern that depends on the absolute pool offset.

    Byte at pool offset ``p``: low 8 bits of a 32-bit multiplicative hash of ``p`` and
    ``seed`` (seeds differ almost everywhere). Built on ``device`` in ``PATTERN_PIECE``
    pieces; returns a 1-D ``torch.uint8`` tensor of ``nbytes``.
    """
    import torch

    out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for start in range(0, nbytes, PATTERN_PIECE):
        stop = min(nbytes, start + PATTERN_PIECE)
        x = torch.arange(offset + start, offset + stop, dtype=torch.int64,
                         device=device)
        x = (x * 2654435761 + (seed * 40503 + 0x5BD1E995)) & 0xFFFFFFFF
        x = x ^ (x >> 15)
        x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
        x = x ^ (x >> 12)
        out[start:stop] = (x & 0xFF).to(torch.uint8)
    return out


def first_mismatch(got: Any, want: Any, base: int) -> dict[str, Any]:
    """Compare two uint8 tensors on their device (``base``: pool offset of element 0).

    Returns:
        ``{"mismatches": int}`` plus, when any, ``first_mismatch``: ``{"offset",
        "expected", "seen"}`` (pool offset and byte values).

    """
    import torch

    if torch.equal(got, want):
        return {"mismatches": 0}
    diff = (got != want).nonzero()
    i = int(diff[0])
    return {"mismatches": int(diff.numel()),
            "first_mismatch": {"offset": base + i, "expected": int(want[i]),
                               "seen": int(got[i])}}


def _describe_mismatch(res: dict[str, Any], what: str, nbytes: int) -> str:
    fm = res["first_mismatch"]
    return (f"{what}: {res['mismatches']} of {nbytes} bytes differ; first at pool "
            f"offset {fm['offset']} (offset % 4096 = {fm['offset'] % 4096}): "
            f"expected 0x{fm['expected']:02x}, saw 0x{fm['seen']:02x}")


def assert_same(got: Any, want: Any, base: int, what: str, hint: str) -> None:
    """Assert two uint8 tensors are bit-identical, with a readable message."""
    res = first_mismatch(got, want, base)
    if res["mismatches"]:
        raise AssertionError(f"{_describe_mismatch(res, what, got.numel())}. {hint}")


def _blank(nbytes: int, device: str, seed: int) -> Any:
    """A destination pre-filled with another pattern (a no-op read cannot pass)."""
    return pattern(0, nbytes, seed ^ 0x5A5A, device)


def check_roundtrip(store: GpuDirectStore, offset: int, nbytes: int, seed: int,
                    device: str) -> None:
    """Write a pattern at ``offset`` and read it back bit-exactly.

    Raises:
        AssertionError: the bytes read differ from those written.

    """
    import torch

    want = pattern(offset, nbytes, seed, device)
    store.write(offset, want)
    got = _blank(nbytes, device, seed)
    store.read(offset, got)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    assert_same(got, want, offset, f"read-back of {nbytes} bytes written at offset "
                f"{offset}", "The store returned other bytes than it was given; "
                "check its offset arithmetic and alignment handling.")


#: bytes written to probe a store's page-cache claim (4 KiB aligned, far above
#: a stray page or the file system's metadata)
DIRECT_PROBE_BYTES = 16 << 20
#: resident share of the probe's pages above which writes went through the page
#: cache: a direct path leaves none; 1 % tolerates a page another reader touched
RESIDENT_LIMIT = 0.01


def measure_direct_io(store: GpuDirectStore, seed: int, device: str,
                      nbytes: int = DIRECT_PROBE_BYTES) -> dict[str, Any]:
    """Whether a store's writes and reads bypass the page cache, observed.

    The store's regular files (``files()``) are evicted
    (:func:`tvc.core.pagecache.drop_cached`), ``nbytes`` written at offset 0 and synced,
    residency read (``mincore``, :func:`tvc.core.pagecache.resident_pages`); evicted
    again, read back, residency read again. Page-cache I/O leaves pages resident;
    ``O_DIRECT`` and GDS leave none.

    Returns:
        ``claimed`` (``store.direct_io``), ``direct`` (True: nothing resident after
        write and read; False: resident; None: no regular file or no ``mincore``),
        ``written_pages``, ``resident_after_write``, ``resident_after_read`` and
        ``files``.

    Raises:
        AssertionError: the read-back differs.

    """
    import mmap

    import torch

    from tvc.core.pagecache import drop_cached, resident_pages

    files = [Path(p) for p in store.files() if Path(p).is_file()]
    nbytes = min(nbytes, store.capacity // 4096 * 4096)
    out: dict[str, Any] = {"claimed": bool(store.direct_io), "direct": None,
                           "written_pages": -(-nbytes // mmap.PAGESIZE),
                           "files": [str(p) for p in files]}

    def resident() -> int | None:
        counts = [resident_pages(p) for p in files]
        if not files or any(c is None for c in counts):
            return None
        return sum(c[0] for c in counts if c is not None)

    for p in files:
        drop_cached(p)
    before = resident()
    want = pattern(0, nbytes, seed, device)
    store.write(0, want)
    store.sync()
    after_write = resident()
    for p in files:
        drop_cached(p)
    got = _blank(nbytes, device, seed)
    store.read(0, got)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    after_read = resident()
    assert_same(got, want, 0, f"read-back of the {nbytes}-byte page-cache probe",
                "The store returned other bytes than it was given.")
    out.update(resident_before=before, resident_after_write=after_write,
               resident_after_read=after_read)
    if before is None or after_write is None or after_read is None:
        return out
    limit = RESIDENT_LIMIT * out["written_pages"]
    out["direct"] = (after_write - before <= limit) and after_read <= limit
    return out


def check_direct_io_claim(store: GpuDirectStore, seed: int, device: str,
                          nbytes: int = DIRECT_PROBE_BYTES) -> dict[str, Any]:
    """A store that says it bypasses the page cache does: measured, not trusted.

    Returns :func:`measure_direct_io`'s facts.

    Raises:
        AssertionError: ``direct_io`` is True but the probe's pages were cached after
            its write or read.

    """
    facts = measure_direct_io(store, seed, device, nbytes)
    if facts["claimed"] and facts["direct"] is False:
        adapter = store.describe().get("adapter", type(store).__name__)
        raise AssertionError(
            f"the store ({adapter}) reports direct_io=True, but after writing "
            f"{nbytes:,} bytes through it and sync(), "
            f"{facts['resident_after_write'] - facts['resident_before']} of "
            f"{facts['written_pages']} pages sat in the page cache (mincore of "
            f"{', '.join(facts['files'])}), and {facts['resident_after_read']} after "
            "reading them back from an evicted cache: its I/O goes through the "
            "page cache, so the GB/s it shows are the page cache's. Fix: open the "
            "pool with O_DIRECT (or GPUDirect Storage), or report direct_io=False "
            "(the bandwidth tier then labels its figures 'cached' / 'cache "
            "dropped', never 'direct')")
    return facts


def check_full_pool(store: GpuDirectStore, seed: int, device: str,
                    chunk_bytes: int = CHUNK_BYTES) -> dict[str, float]:
    """Fill the whole pool with the pattern, then read all of it back and compare.

    All chunks are written before any is read, so a write landing on an earlier chunk is
    caught. Returns ``{"write_s", "read_s", "bytes"}`` (wall seconds including sync).

    Raises:
        AssertionError: any chunk differs.

    """
    import torch

    cap = store.capacity
    t0 = time.perf_counter()
    for off in range(0, cap, chunk_bytes):
        store.write(off, pattern(off, min(chunk_bytes, cap - off), seed, device))
    store.sync()
    t1 = time.perf_counter()
    got = torch.empty(min(chunk_bytes, cap), dtype=torch.uint8, device=device)
    read_s = 0.0
    for off in range(0, cap, chunk_bytes):
        n = min(chunk_bytes, cap - off)
        view = got[:n]
        view.fill_(0xA5)
        r0 = time.perf_counter()
        store.read(off, view)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        read_s += time.perf_counter() - r0
        assert_same(view, pattern(off, n, seed, device), off,
                    f"full-pool read-back (chunk at {off}, pool {cap} bytes)",
                    "Data written across the pool did not come back intact.")
    return {"write_s": t1 - t0, "read_s": read_s, "bytes": float(cap)}


def check_capacity_enforced(store: GpuDirectStore, seed: int, device: str,
                            tail: int = 8192) -> None:
    """A write past capacity fails and leaves existing data intact.

    With the pattern in the last ``tail`` bytes: a write crossing the end, a write at
    ``capacity`` and a read crossing the end must each raise; the tail must read back.

    Raises:
        AssertionError: a past-the-end operation was accepted or changed data.

    """
    cap = store.capacity
    tail = min(tail, cap)
    base = cap - tail
    want = pattern(base, tail, seed, device)
    store.write(base, want)
    attempts = [("write", base + tail // 2, tail), ("write", cap, 4096),
                ("read", base, tail + 4096)]
    for op, off, n in attempts:
        buf = pattern(off, n, seed + 1, device)
        try:
            (store.write if op == "write" else store.read)(off, buf)
        except Exception:  # noqa: BLE001 - any clean error is the expected outcome
            continue
        raise AssertionError(
            f"a {op} of {n} bytes at offset {off} reaches byte {off + n}, past the "
            f"pool's capacity of {cap} bytes, but the store accepted it: expected "
            "an error. A store must refuse I/O beyond its capacity (it would "
            "overwrite a neighbour's data or grow the pool unbounded).")
    got = _blank(tail, device, seed)
    store.read(base, got)
    _sync(device)
    assert_same(got, want, base, "the last bytes of the pool after refused "
                "past-capacity writes", "A refused write must not change data: "
                "check the range test runs before any I/O is issued.")
    sizes = [Path(p).stat().st_size for p in store.files()
             if Path(p).is_file()]
    too_big = [s for s in sizes if s > cap + 1024 * 1024]
    if too_big:
        raise AssertionError(f"the pool file grew to {max(too_big)} bytes for a "
                             f"capacity of {cap}: past-capacity data was stored")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def check_concurrent_writers(store: GpuDirectStore, seed: int, device: str,
                             writers: int = 4, span: int = 64 << 20,
                             pieces: int = 8, base: int = 0) -> None:
    """Several threads write disjoint ranges at once; each range reads back intact.

    Writer ``i`` owns ``[base + i*span, base + (i+1)*span)``, written in ``pieces``
    interleaved pieces after a common barrier.

    Raises:
        AssertionError: a writer failed or a range came back altered.

    """
    assert span % pieces == 0
    assert base + writers * span <= store.capacity, "pool too small for the check"
    piece = span // pieces
    errors: list[str] = []
    gate = threading.Barrier(writers)

    def work(i: int) -> None:
        try:
            start = base + i * span
            data = pattern(start, span, seed + i, device)
            gate.wait()
            for k in range(pieces):
                store.write(start + k * piece, data[k * piece:(k + 1) * piece])
            _sync(device)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"writer {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise AssertionError("concurrent writers on disjoint ranges failed: "
                             + "; ".join(errors))
    for i in range(writers):
        start = base + i * span
        got = _blank(span, device, seed + i)
        store.read(start, got)
        _sync(device)
        assert_same(got, pattern(start, span, seed + i, device), start,
                    f"range of writer {i} of {writers} (disjoint, concurrent)",
                    "Concurrent writers clobbered each other's data; the store "
                    "must be safe for concurrent I/O on disjoint ranges.")


def check_cross_process(store: GpuDirectStore, spec: StoreSpec, seed: int,
                        device: str, nbytes: int = 32 << 20) -> dict[str, Any]:
    """Data written by this process is read by another, and the other way round.

    Uses the first ``2 * nbytes`` bytes: this process writes the first half for a worker
    to verify, the worker the second half. Returns ``{"worker_pids", "io_path"}``.

    Raises:
        AssertionError: either direction did not see the other's bytes.

    """
    a, b = 0, nbytes
    store.write(a, pattern(a, nbytes, seed, device))
    store.sync()
    res = run_store_worker(spec, "verify", a, nbytes, seed, device)
    if res.get("mismatches"):
        raise AssertionError(
            _describe_mismatch(res, f"another process (pid {res['pid']}) reading "
                               f"{nbytes} bytes this process wrote", nbytes)
            + ". Writes must be visible to other processes once sync() returns.")
    res2 = run_store_worker(spec, "write", b, nbytes, seed + 7, device)
    got = _blank(nbytes, device, seed + 7)
    store.read(b, got)
    _sync(device)
    assert_same(got, pattern(b, nbytes, seed + 7, device), b,
                f"this process reading {nbytes} bytes written by process "
                f"{res2['pid']}", "A second process's writes did not reach the "
                "pool, or this process reads stale data (a private cache?).")
    return {"worker_pids": [res["pid"], res2["pid"]], "io_path": res["io_path"]}


def check_writes_stay_inside(store: GpuDirectStore, spec: StoreSpec) -> None:
    """Every path the store writes lies in scratch or a profile-listed test device.

    Raises:
        AssertionError: a path outside, naming it.

    """
    bad = outside_allowed(store.files(), spec)
    if bad:
        raise AssertionError(
            f"the store writes {', '.join(bad)}, outside the suite's scratch "
            f"directory {spec.scratch} and the profile's [store] test_devices "
            f"{list(spec.test_devices)}: the suite may only write there. List the "
            "test device in the profile, or point the store at scratch.")


def check_destroy_removes(store: GpuDirectStore) -> list[str]:
    """``destroy()`` removes every file the store named; returns the removed paths.

    Raises:
        AssertionError: a regular file the store wrote is still there.

    """
    files = [Path(p) for p in store.files()]
    regular = [p for p in files if p.is_file()]
    store.destroy()
    left = [str(p) for p in regular if p.exists()]
    if left:
        raise AssertionError(f"after destroy() the store's files remain: "
                             f"{', '.join(left)}; the suite must remove what it wrote")
    return [str(p) for p in regular]
