"""Self-tests of tvc/store/bandwidth.py: thresholds, statistics, labels, chart."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from tvc.store import bandwidth as bw
from tvc.store.gpu_direct import open_posix_store

pytestmark = pytest.mark.hw_any

OPERATORS = {"single_disk_gbps": 7.0, "numa_node_gbps": 28.0, "machine_gbps": 50.0}


@pytest.mark.parametrize("disks,gbps,tier", [
    (1, 7.0, "one disk"), (4, 28.0, "one NUMA node (4 disks)"),
    (8, 50.0, "the whole machine (8 disks)"), (2, 14.0, "2 disks (interpolated"),
    (6, 39.0, "6 disks (interpolated between one NUMA node"),
    (16, 50.0, "16 disks (at least the whole machine"),
])
def test_threshold_follows_the_operators_graded_points(disks, gbps, tier):
    got, phrase = bw.threshold_gbps(disks, OPERATORS)
    assert got == pytest.approx(gbps)
    assert phrase.startswith(tier)


def test_threshold_rejects_zero_disks():
    with pytest.raises(ValueError, match="num_disks must be >= 1, got 0"):
        bw.threshold_gbps(0, OPERATORS)


def test_summary_reports_median_min_max_in_gb_and_gib():
    s = bw.summarize(2 * bw.GIB, [1.0, 2.0, 4.0])
    assert s["median_gbps"] == pytest.approx(2 * bw.GIB / 2.0 / 1e9)
    assert s["min_gbps"] == pytest.approx(2 * bw.GIB / 4.0 / 1e9)
    assert s["max_gbps"] == pytest.approx(2 * bw.GIB / 1e9)
    assert s["median_gibps"] == pytest.approx(1.0)
    assert s["reps"] == 3
    with pytest.raises(ValueError):
        bw.summarize(1, [])


def test_compare_passes_at_threshold_and_explains_a_shortfall():
    assert bw.compare("read", 7.0, 7.0, "one disk", "direct", bw.MIB) == ""
    msg = bw.compare("write", 5.25, 28.0, "one NUMA node (4 disks)", "cached",
                     64 * bw.MIB)
    assert msg.startswith("store write throughput: expected >= 28.00 GB/s for one "
                          "NUMA node (4 disks), saw 5.25 GB/s (cached; best median "
                          "over I/O sizes, at 65536 KiB)")
    assert "num_disks" in msg


def test_tier_check_fails_below_threshold_with_the_message(monkeypatch):
    tier = importlib.import_module("suites.bandwidth.test_store_bandwidth")
    per = {s: {**bw.summarize(bw.GIB, [1.0, 1.1, 0.9]), "label": "direct"}
           for s in bw.IO_SIZES}
    bench = {"read": per, "threshold_gbps": 7.0, "tier": "one disk",
             "io_path": "compat", "chart": "x.png"}
    props: dict = {}
    with pytest.raises(pytest.fail.Exception, match=r"store read throughput: "
                       r"expected >= 7.00 GB/s for one disk, saw 1.07 GB/s"):
        tier._check_direction(bench, "read", lambda k, v: props.__setitem__(k, v))
    assert props["read_256KiB_median_gbps"] == pytest.approx(1.074, abs=1e-3)
    assert props["read_1MiB_page_cache"] == "direct"
    bench["threshold_gbps"] = 1.0
    tier._check_direction(bench, "read", lambda k, v: None)


def test_cache_labels():
    assert bw.cache_label(True, False) == "direct"
    assert bw.cache_label(False, True) == "cache dropped"
    assert bw.cache_label(False, False) == "cached"


def test_drop_page_cache_on_a_regular_file(tmp_path: Path):
    f = tmp_path / "f.bin"
    f.write_bytes(b"x" * 8192)
    assert bw.drop_page_cache([f, tmp_path / "missing", "/dev/null"])


def test_measure_store_on_cpu_with_the_posix_store(tmp_path: Path):
    store = open_posix_store(tmp_path / "s", 4 * bw.MIB)
    try:
        t, label = bw.measure_store(store, "write", bw.MIB, "cpu",
                                    total=4 * bw.MIB, reps=2)
        assert len(t) == 2 and min(t) > 0 and label == "direct"
        t, label = bw.measure_store(store, "read", 256 * bw.KIB, "cpu",
                                    total=4 * bw.MIB, reps=2)
        assert len(t) == 2 and label == "direct"
        with pytest.raises(ValueError, match="must be a multiple"):
            bw.measure_store(store, "read", 3 * bw.KIB, "cpu", total=4 * bw.MIB)
    finally:
        store.destroy()


def test_bar_chart_writes_a_png(tmp_path: Path):
    pytest.importorskip("matplotlib")
    per = {s: bw.summarize(bw.GIB, [1.0, 1.2]) for s in bw.IO_SIZES}
    res = {"write": per, "read": per, "threshold_gbps": 0.75,
           "refs": {"kvikio_read": 1.1, "pinned_h2d": 55.0}, "title": "t"}
    out = bw.bar_chart(res, tmp_path / "r" / "bandwidth.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bar_chart_without_matplotlib_returns_none(tmp_path: Path, monkeypatch):
    """The tier measures first; a missing ``plots`` extra must not error after it."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import -> ImportError
    per = {s: bw.summarize(bw.GIB, [1.0]) for s in bw.IO_SIZES}
    res = {"write": per, "read": per, "threshold_gbps": 0.75, "refs": {}}
    assert bw.bar_chart(res, tmp_path / "bandwidth.png") is None
    assert not (tmp_path / "bandwidth.png").exists()
