"""bandwidth: the store's write and read GB/s against the profile's graded thresholds.

One module-scoped measurement (``bench``) drives the profile's store
(``tvc/store/gpu_direct.py``) from GPU memory: for each I/O size in 256 KiB..64 MiB,
``REPETITIONS`` passes of 1 GiB written (with sync) and read (page cache dropped
first); median/min/max in GB/s and GiB/s (``tvc/store/bandwidth.py``). In the same run
it measures two reference lines: kvikio's own read/write of the same pool file and
pinned host <-> device copies (the PCIe ceiling). Figures go to the JUnit properties
and summary.json; the run folder gets ``bandwidth.png`` and ``bandwidth.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tvc.store import bandwidth as bw
from tvc.store.gpu_direct import StoreError, StoreSpec, create_pool

pytestmark = [pytest.mark.bandwidth, pytest.mark.hw_nvme]

DEVICE = "cuda"


def _run_dir(run_dir: Path | None, profile: Any) -> Path:
    # the run folder on the xdist controller and its workers alike
    return run_dir or profile.scratch / "bandwidth-report"


def _size_name(s: int) -> str:
    return f"{s // bw.KIB}KiB" if s < bw.MIB else f"{s // bw.MIB}MiB"


@pytest.fixture(scope="module")
def bench(gpu_store, store_spec: StoreSpec, tvc_profile, tvc_run_dir
          ) -> dict[str, Any]:

    store = gpu_store
    if store.capacity < bw.TOTAL_BYTES:
        pytest.fail(f"the bandwidth tier moves {bw.TOTAL_BYTES} bytes per "
                    f"measurement, but the store's pool has {store.capacity}; set "
                    "[store] pool_bytes >= 1073741824 in the profile", pytrace=False)
    prof = tvc_profile
    section = prof["bandwidth"]
    threshold, tier = bw.threshold_gbps(section["num_disks"], section)
    res: dict[str, Any] = {"write": {}, "read": {}, "labels": {}, "refs": {},
                           "ref_errors": {}, "threshold_gbps": threshold,
                           "tier": tier, "store": store.describe(),
                           "io_path": store.io_path,
                           # a direct_io claim the page cache contradicts is not
                           # taken: its figures are not labelled "direct"
                           "direct_io_verified": bw.verified_direct_io(store, DEVICE)}
    for direction in ("write", "read"):
        for size in bw.IO_SIZES:
            times, label = bw.measure_store(store, direction, size, DEVICE)
            res[direction][size] = {**bw.summarize(bw.TOTAL_BYTES, times),
                                    "label": label}
            res["labels"][f"{direction}_{_size_name(size)}"] = label
    files = [Path(p) for p in store.files() if Path(p).is_file()]
    ref_file = files[0] if files else prof.scratch / "bandwidth-ref" / "ref.bin"
    if not files:
        create_pool(ref_file, bw.TOTAL_BYTES)
    for direction in ("write", "read"):
        try:
            t = bw.measure_kvikio_file(ref_file, direction, DEVICE)
            res["refs"][f"kvikio_{direction}"] = bw.summarize(bw.TOTAL_BYTES, t)
        except (StoreError, RuntimeError, OSError) as exc:
            res["ref_errors"][f"kvikio_{direction}"] = str(exc)
    try:
        copies = bw.measure_pinned_copy()
        for name, t in copies.items():
            res["refs"][f"pinned_{name}"] = bw.summarize(bw.TOTAL_BYTES, t)
    except RuntimeError as exc:  # torch.cuda errors are RuntimeErrors
        res["ref_errors"]["pinned"] = str(exc)
    if not files:
        ref_file.unlink(missing_ok=True)
    run_dir = _run_dir(tvc_run_dir, prof)
    title = (f"{prof.name}: {store.describe().get('adapter', '?')} store, io_path "
             f"{store.io_path}, {tier}; {bw.TOTAL_BYTES // bw.GIB} GiB x "
             f"{bw.REPETITIONS} reps per bar")
    chart_refs = {k: v["median_gbps"] for k, v in res["refs"].items()}
    chart = bw.bar_chart({**res, "refs": chart_refs, "title": title},
                         run_dir / "bandwidth.png")
    res["chart"] = str(chart) if chart else ""  # "" = matplotlib not installed
    res["json"] = str(bw.write_json(res, run_dir / "bandwidth.json"))
    return res


def _check_direction(bench: dict[str, Any], direction: str, record_property
                     ) -> None:
    for size, s in bench[direction].items():
        n = _size_name(size)
        for k in ("median_gbps", "min_gbps", "max_gbps", "median_gibps",
                  "min_gibps", "max_gibps"):
            record_property(f"{direction}_{n}_{k}", round(s[k], 3))
        record_property(f"{direction}_{n}_page_cache", s["label"])
    size, b = bw.best(bench[direction])
    record_property(f"{direction}_best_median_gbps", round(b["median_gbps"], 3))
    record_property(f"{direction}_best_io_size", _size_name(size))
    record_property("threshold_gbps", round(bench["threshold_gbps"], 3))
    record_property("threshold_tier", bench["tier"])
    record_property("io_path", bench["io_path"])
    record_property("chart", bench["chart"])
    msg = bw.compare(direction, b["median_gbps"], bench["threshold_gbps"],
                     bench["tier"], b["label"], size)
    if msg:
        pytest.fail(msg, pytrace=False)


def test_store_write_throughput_meets_profile_threshold(bench, record_property
                                                        ) -> None:
    _check_direction(bench, "write", record_property)


def test_store_read_throughput_meets_profile_threshold(bench, record_property
                                                       ) -> None:
    _check_direction(bench, "read", record_property)


def test_store_io_path_is_gpu_direct_when_the_profile_requires_it(
        bench, record_property, tvc_profile) -> None:
    record_property("io_path", bench["io_path"])
    for k, v in bench["store"].items():
        record_property(f"store.{k}", v)
    if tvc_profile["bandwidth"]["require_gds"] and bench["io_path"] != "gds":
        why = bench["store"].get("why", "")
        pytest.fail(
            f"I/O path: the profile requires GPUDirect Storage ([bandwidth] "
            f"require_gds = true), the store used {bench['io_path']!r}"
            f"{f' ({why})' if why else ''}. Load the nvidia-fs driver and check "
            "cufile.json (allow_compat_mode), or set require_gds = false for a lab "
            "profile.", pytrace=False)


def test_store_throughput_relative_to_reference_lines(bench, record_property
                                                      ) -> None:
    refs, errors = bench["refs"], bench["ref_errors"]
    for name, s in refs.items():
        record_property(f"ref_{name}_median_gbps", round(s["median_gbps"], 3))
        record_property(f"ref_{name}_min_gbps", round(s["min_gbps"], 3))
        record_property(f"ref_{name}_max_gbps", round(s["max_gbps"], 3))
    pairs = {"write": ("kvikio_write", "pinned_d2h"),
             "read": ("kvikio_read", "pinned_h2d")}
    for direction, names in pairs.items():
        _size, b = bw.best(bench[direction])
        for ref in names:
            if ref in refs:
                frac = b["median_gbps"] / refs[ref]["median_gbps"]
                record_property(f"{direction}_fraction_of_{ref}", round(frac, 3))
    if errors:
        pytest.fail("reference lines could not be measured in this run: "
                    + "; ".join(f"{k}: {v}" for k, v in errors.items()),
                    pytrace=False)
