"""Self-tests of the store checks: the POSIX reference passes, bad adapters fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from tvc.store import checks as sc
from tvc.store.gpu_direct import (
    GpuDirectStore,
    PosixStore,
    StoreError,
    StoreSpec,
    open_store,
)

pytestmark = pytest.mark.hw_any

CAP = (8 << 20) + 12345  # a capacity that is not a multiple of 4 KiB
DEV = "cpu"


def spec_for(tmp_path: Path, factory: str = "tvc.store.gpu_direct:open_posix_store",
             **over) -> StoreSpec:
    kw = dict(factory=factory, path=str(tmp_path / "scratch" / "store"),
              pool_bytes=CAP, options={}, scratch=str(tmp_path / "scratch"))
    kw.update(over)
    return StoreSpec(**kw)


@pytest.fixture
def good(tmp_path: Path):
    store = open_store(spec_for(tmp_path))
    yield store
    store.destroy()


class CorruptingStore(PosixStore):
    """Flips one bit in the middle of every write of more than one byte."""

    def write(self, offset, src):
        if src.numel() > 1:
            src = src.clone()
            src[src.numel() // 2] ^= 0x10
        super().write(offset, src)


class CapacityIgnoringStore(PosixStore):
    """Never checks the range: writes past the end grow the file."""

    def write(self, offset, src):
        view, _keep = self._host(src)
        done = 0
        while done < len(view):
            done += __import__("os").pwrite(self._fd, view[done:], offset + done)

    def read(self, offset, dst):
        import os

        view, _keep = self._host(dst)
        os.preadv(self._fd, [view], offset)


class WritesThenRaisesStore(PosixStore):
    """Writes what fits, then raises: the error comes after the damage."""

    def write(self, offset, src):
        fit = max(0, min(src.numel(), self.capacity - offset))
        if fit < src.numel():
            if fit:
                super().write(offset, src[:fit])
            raise StoreError("past capacity")
        super().write(offset, src)


class OffsetDroppingStore(PosixStore):
    """Ignores the offset's low 12 bits (a classic alignment bug)."""

    def write(self, offset, src):
        super().write(offset // 4096 * 4096, src)

    def read(self, offset, dst):
        super().read(offset // 4096 * 4096, dst)


class ForeignFileStore(PosixStore):
    """Claims to write a file outside the allowed area."""

    def files(self):
        return [self.file, Path("/var/tmp/not-scratch/pool.bin")]


def bad(cls, tmp_path: Path) -> GpuDirectStore:
    return cls(tmp_path / "scratch" / cls.__name__, CAP)


@pytest.mark.parametrize("offset,nbytes", [
    (0, 4096), (4096, 1 << 20), (1, 4095), (4095, 4097), (12345, (1 << 20) + 3),
    (CAP - 4096, 4096), (CAP - 1, 1), (CAP - 5000, 5000),
])
def test_reference_store_roundtrips_on_and_off_4k_boundaries(good, offset, nbytes):
    sc.check_roundtrip(good, offset, nbytes, seed=3, device=DEV)


def test_reference_store_passes_full_pool_capacity_and_concurrency(good):
    figs = sc.check_full_pool(good, seed=1, device=DEV, chunk_bytes=3 << 20)
    assert figs["bytes"] == CAP
    sc.check_capacity_enforced(good, seed=2, device=DEV)
    sc.check_concurrent_writers(good, seed=4, device=DEV, writers=4, span=1 << 20,
                                pieces=8)


def test_reference_store_is_shared_across_processes(good, tmp_path):
    res = sc.check_cross_process(good, spec_for(tmp_path), seed=5, device=DEV,
                                 nbytes=(1 << 20) + 7)
    assert len(set(res["worker_pids"])) == 2 and res["io_path"] == "posix"


def test_reference_store_stays_inside_scratch_and_cleans_up(tmp_path):
    spec = spec_for(tmp_path)
    store = open_store(spec)
    sc.check_writes_stay_inside(store, spec)
    removed = sc.check_destroy_removes(store)
    assert removed and not Path(removed[0]).exists()


def test_posix_store_reports_direct_io_honestly(good):
    d = good.describe()
    assert d["io_path"] == "posix" and isinstance(d["direct_io"], bool)


def test_corrupting_store_fails_the_roundtrip_check(tmp_path):
    store = bad(CorruptingStore, tmp_path)
    with pytest.raises(AssertionError, match=r"read-back of 8192 bytes written at "
                       r"offset 4096: 1 of 8192 bytes differ; first at pool offset "
                       r"8192 .*expected 0x[0-9a-f]{2}, saw 0x[0-9a-f]{2}"):
        sc.check_roundtrip(store, 4096, 8192, seed=1, device=DEV)
    store.destroy()


def test_corrupting_store_fails_the_full_pool_check(tmp_path):
    store = bad(CorruptingStore, tmp_path)
    with pytest.raises(AssertionError, match=r"full-pool read-back .*1 of \d+ bytes "
                       r"differ"):
        sc.check_full_pool(store, seed=1, device=DEV, chunk_bytes=1 << 20)
    store.destroy()


def test_corrupting_store_fails_the_concurrency_check(tmp_path):
    store = bad(CorruptingStore, tmp_path)
    with pytest.raises(AssertionError, match=r"range of writer 0 of 2 .* differ"):
        sc.check_concurrent_writers(store, seed=1, device=DEV, writers=2,
                                    span=1 << 20, pieces=4)
    store.destroy()


def test_capacity_ignoring_store_fails_the_capacity_check(tmp_path):
    store = bad(CapacityIgnoringStore, tmp_path)
    with pytest.raises(AssertionError, match=r"a write of 8192 bytes at offset "
                       rf"{CAP - 4096} reaches byte {CAP + 4096}, past the pool's "
                       rf"capacity of {CAP} bytes, but the store accepted it"):
        sc.check_capacity_enforced(store, seed=1, device=DEV)
    store.destroy()


def test_store_that_writes_before_refusing_fails_the_capacity_check(tmp_path):
    store = bad(WritesThenRaisesStore, tmp_path)
    with pytest.raises(AssertionError, match=r"the last bytes of the pool after "
                       r"refused past-capacity writes: \d+ of 8192 bytes differ.*"
                       r"A refused write must not change data"):
        sc.check_capacity_enforced(store, seed=1, device=DEV)
    store.destroy()


def test_offset_dropping_store_fails_unaligned_roundtrip(tmp_path):
    store = bad(OffsetDroppingStore, tmp_path)
    # reading back from the same wrong place looks fine in a single round trip...
    sc.check_roundtrip(store, 4095, 4097, seed=1, device=DEV)
    # ...the full-pool sweep sees the neighbouring chunk overwritten
    with pytest.raises(AssertionError, match=r"full-pool read-back \(chunk at 0, "
                       r"pool \d+ bytes\): 1 of 4097 bytes differ; first at pool "
                       r"offset 4096"):
        sc.check_full_pool(store, seed=1, device=DEV, chunk_bytes=4097)
    store.destroy()


def test_store_writing_outside_scratch_fails_the_containment_check(tmp_path):
    store = bad(ForeignFileStore, tmp_path)
    with pytest.raises(AssertionError, match=r"writes /var/tmp/not-scratch/pool.bin"
                       r", outside the suite's scratch directory"):
        sc.check_writes_stay_inside(store, spec_for(tmp_path))
    store.destroy()


def test_store_path_outside_scratch_is_refused_before_opening(tmp_path):
    spec = spec_for(tmp_path, path=str(tmp_path / "elsewhere"))
    with pytest.raises(StoreError, match=r"lies outside the suite's scratch "
                       r"directory .*\[store\] test_devices"):
        open_store(spec)
    assert not (tmp_path / "elsewhere").exists()
    ok = spec_for(tmp_path, path=str(tmp_path / "dev0" / "s"),
                  test_devices=(str(tmp_path / "dev0"),))
    open_store(ok).destroy()


def test_factory_errors_are_readable(tmp_path):
    with pytest.raises(StoreError, match=r"not 'module:function'"):
        open_store(spec_for(tmp_path, factory="nocolon"))
    with pytest.raises(StoreError, match=r"module no_such_mod does not import"):
        open_store(spec_for(tmp_path, factory="no_such_mod:f"))
    with pytest.raises(StoreError, match=r"returned slice, which lacks capacity"):
        open_store(spec_for(tmp_path, factory="builtins:slice"))
    with pytest.raises(StoreError, match=r"builtins:dict\(path=.*failed: TypeError"):
        open_store(spec_for(tmp_path, factory="builtins:dict"))


def _fake_kvikio(preferred: bool, gds: bool):
    from types import SimpleNamespace

    def drv_get(name):
        if name != "is_gds_available":
            raise KeyError(name)
        return gds

    return SimpleNamespace(
        __version__="26.10.00",
        defaults=SimpleNamespace(get=lambda k: SimpleNamespace(name="AUTO"),
                                 is_compat_mode_preferred=lambda: preferred),
        cufile_driver=SimpleNamespace(get=drv_get))


def test_kvikio_path_is_compat_when_kvikio_prefers_compat():
    from tvc.store.gpu_direct import kvikio_io_path

    path, facts = kvikio_io_path(_fake_kvikio(preferred=True, gds=False))
    assert path == "compat" and "kvikio compat mode" in facts["why"]
    assert facts["compat_mode_setting"] == "AUTO"


def test_kvikio_path_is_not_gds_without_the_nvidia_fs_driver(monkeypatch):
    from tvc.store import gpu_direct as st

    monkeypatch.setattr(st.Path, "exists", lambda self: False)
    path, facts = st.kvikio_io_path(_fake_kvikio(preferred=False, gds=True))
    assert path == "compat" and "without a usable nvidia-fs driver" in facts["why"]
    monkeypatch.setattr(st.Path, "exists", lambda self: True)
    path, _ = st.kvikio_io_path(_fake_kvikio(preferred=False, gds=True))
    assert path == "gds"


def test_a_store_claiming_direct_io_through_the_page_cache_is_red(tmp_path):
    from selftests.real_nvme.lying_stores import ClaimsDirectStore
    from tvc.store import bandwidth as bw

    store = bad(ClaimsDirectStore, tmp_path)
    try:
        with pytest.raises(AssertionError, match=(
                r"the store \(posix\) reports direct_io=True, but after writing "
                r"8,388,608 bytes through it and sync\(\), \d+ of 2048 pages sat in "
                r"the page cache \(mincore of \S+pool\.bin\), and \d+ after reading "
                r"them back from an evicted cache: its I/O goes through the page "
                r"cache")):
            sc.check_direct_io_claim(store, seed=6, device=DEV, nbytes=8 << 20)
        # its bandwidth figures are never labelled "direct"
        _t, label = bw.measure_store(store, "read", bw.MIB, DEV, total=4 * bw.MIB,
                                     reps=1)
        assert label == "cache dropped", label
    finally:
        store.destroy()


def test_an_o_direct_store_passes_the_direct_io_probe(good):
    facts = sc.check_direct_io_claim(good, seed=7, device=DEV, nbytes=4 << 20)
    if not good.direct_io:
        pytest.skip("this file system refuses O_DIRECT: the reference store says "
                    "direct_io=False and there is no claim to measure")
    assert facts["direct"] is True and facts["resident_after_write"] == 0, facts
