"""real_nvme: the profile's GPU-direct store keeps every byte, GPU memory to GPU memory.

The store comes from the profile's ``[store]`` section (``tvc/store/gpu_direct.py``),
opened
on a pool of ``[store] pool_bytes`` bytes (GB scale) inside the suite's scratch area
or a profile-listed test device, after the storage daemon is up
(``tvc/procs/daemon.py``).
Patterns are built on the GPU, written from GPU memory, read back into GPU memory and
compared there bit-exactly (``tvc/store/checks.py``). The pool is removed at the
end.
"""

from __future__ import annotations

import pytest

from tvc.store import checks as sc
from tvc.store.gpu_direct import StoreSpec, open_store

pytestmark = [pytest.mark.real_nvme, pytest.mark.hw_nvme]

DEVICE = "cuda"
KIB = 1024
MIB = 1024 * KIB
CONCURRENT_WRITERS = 4  # threads, each owning a disjoint range
CONCURRENT_SPAN = 64 * MIB  # bytes per writer (4 x 64 MiB = 256 MiB)
CROSS_PROCESS_BYTES = 32 * MIB + 4096 + 17  # deliberately not 4 KiB-aligned at the end


def _record(record_property, store) -> None:
    for k, v in store.describe().items():
        record_property(f"store.{k}", v)


def test_store_pool_lies_inside_the_scratch_area(gpu_store, store_spec: StoreSpec,
                                                 record_property) -> None:
    _record(record_property, gpu_store)
    assert gpu_store.capacity == store_spec.pool_bytes, (
        f"store capacity: expected the profile's [store] pool_bytes = "
        f"{store_spec.pool_bytes}, saw {gpu_store.capacity}; the factory must open "
        "a pool of exactly the requested size")
    sc.check_writes_stay_inside(gpu_store, store_spec)


def test_full_pool_written_from_gpu_reads_back_bit_exactly(gpu_store,
                                                           record_property) -> None:
    figs = sc.check_full_pool(gpu_store, seed=11, device=DEVICE)
    gb = figs["bytes"] / 1e9
    record_property("pool_bytes", int(figs["bytes"]))
    record_property("pool_write_gbps", round(gb / figs["write_s"], 3))
    record_property("pool_read_gbps", round(gb / figs["read_s"], 3))
    record_property("io_path", gpu_store.io_path)


def test_store_direct_io_claim_holds(gpu_store, record_property) -> None:
    # a store that says it bypasses the page cache leaves no page of what it
    # wrote or read there (mincore): the claim is measured, not trusted
    facts = sc.check_direct_io_claim(gpu_store, seed=13, device=DEVICE)
    record_property("direct_io_claimed", facts["claimed"])
    record_property("direct_io_measured", facts["direct"])


CASES = [  # (offset, nbytes); a negative offset counts from the pool's end
    (0, 4 * KIB), (4 * KIB, 1 * MIB), (1, 4 * KIB - 1), (4 * KIB - 1, 4 * KIB + 1),
    (12345, MIB + 3), (3 * MIB + 512, 64 * MIB), (7, 1), (64 * KIB, 256 * KIB + 1),
    (-4 * KIB, 4 * KIB), (-1, 1), (-5000, 5000),
]


@pytest.mark.parametrize("offset,nbytes", CASES,
                         ids=[f"{o}+{n}" for o, n in CASES])
def test_ranges_on_and_off_4k_boundaries_roundtrip(gpu_store, offset, nbytes
                                                   ) -> None:
    if offset < 0:
        offset += gpu_store.capacity
    sc.check_roundtrip(gpu_store, offset, nbytes, seed=offset % 251, device=DEVICE)


def test_concurrent_writers_on_disjoint_ranges_keep_their_data(gpu_store) -> None:
    span = min(CONCURRENT_SPAN, gpu_store.capacity // CONCURRENT_WRITERS // MIB * MIB)
    sc.check_concurrent_writers(gpu_store, seed=21, device=DEVICE,
                                writers=CONCURRENT_WRITERS, span=span, pieces=8)


def test_write_past_capacity_fails_and_keeps_existing_data(gpu_store) -> None:
    sc.check_capacity_enforced(gpu_store, seed=31, device=DEVICE)


def test_data_written_by_one_process_is_read_by_another(gpu_store,
                                                        store_spec: StoreSpec,
                                                        record_property) -> None:
    res = sc.check_cross_process(gpu_store, store_spec, seed=41, device=DEVICE,
                                 nbytes=CROSS_PROCESS_BYTES)
    record_property("worker_pids", res["worker_pids"])
    record_property("worker_io_path", res["io_path"])


def test_store_removes_its_pool_when_destroyed(store_spec: StoreSpec) -> None:
    spec = store_spec.with_path(f"{store_spec.path.rstrip('/')}-cleanup",
                                pool_bytes=16 * MIB)
    store = open_store(spec)
    try:
        sc.check_writes_stay_inside(store, spec)
        sc.check_roundtrip(store, 4096, MIB, seed=51, device=DEVICE)
    except BaseException:
        store.destroy()
        raise
    removed = sc.check_destroy_removes(store)
    assert removed, ("the store named no regular file it wrote (files() was empty "
                     "or named devices only); the suite could not verify cleanup")
