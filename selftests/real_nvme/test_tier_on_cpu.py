"""Run the real_nvme tier's test bodies on the CPU with the POSIX reference store.

The tier itself needs a GPU (hw_nvme); this proves its logic (ranges, cleanup,
cross-process worker, containment) on any box by swapping the device to ``cpu``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from tvc.store.gpu_direct import StoreSpec, open_store

pytestmark = pytest.mark.hw_any

tier = importlib.import_module("suites.real_nvme.test_store_roundtrip")


@pytest.fixture
def cpu_tier(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(tier, "DEVICE", "cpu")
    monkeypatch.setattr(tier, "CONCURRENT_SPAN", 1 << 20)
    monkeypatch.setattr(tier, "CROSS_PROCESS_BYTES", (1 << 20) + 17)
    spec = StoreSpec("tvc.store.gpu_direct:open_posix_store",
                     str(tmp_path / "s" / "store"),
                     80 << 20, {}, str(tmp_path / "s"))
    store = open_store(spec)
    props: dict = {}
    yield store, spec, lambda k, v: props.__setitem__(k, v), props
    store.destroy()


def test_tier_bodies_pass_with_the_reference_store(cpu_tier):
    store, spec, rec, props = cpu_tier
    tier.test_store_pool_lies_inside_the_scratch_area(store, spec, rec)
    tier.test_full_pool_written_from_gpu_reads_back_bit_exactly(store, rec)
    tier.test_store_direct_io_claim_holds(store, rec)
    for off, n in tier.CASES:
        tier.test_ranges_on_and_off_4k_boundaries_roundtrip(store, off, n)
    tier.test_concurrent_writers_on_disjoint_ranges_keep_their_data(store)
    tier.test_write_past_capacity_fails_and_keeps_existing_data(store)
    tier.test_data_written_by_one_process_is_read_by_another(store, spec, rec)
    tier.test_store_removes_its_pool_when_destroyed(spec)
    assert props["io_path"] == "posix" and props["pool_read_gbps"] > 0
    # the reference opens the pool with O_DIRECT where the file system allows
    assert props["direct_io_measured"] is props["direct_io_claimed"], props
    assert not Path(f"{spec.path}-cleanup").exists()


def test_tier_rejects_a_pool_of_the_wrong_size(cpu_tier):
    store, spec, rec, _ = cpu_tier
    wrong = StoreSpec(spec.factory, spec.path, spec.pool_bytes * 2, {}, spec.scratch)
    with pytest.raises(AssertionError, match=r"expected the profile's \[store\] "
                       r"pool_bytes = \d+, saw \d+"):
        tier.test_store_pool_lies_inside_the_scratch_area(store, wrong, rec)
