"""Every collected test carries its tier marker and one hardware-level marker.

The suite is collected in a subprocess with a tiny plugin that dumps each item's
markers; nothing runs. markers.ini is the source of the tier and hardware names.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from selftests.conftest import run_suite
from selftests.foundation import fakes
from tvc.config.profile import REPO_ROOT
from tvc.plugin.hooks import parse_require, read_markers

DUMP_PLUGIN = '''\
import json, os


def pytest_collection_finish(session):
    out = {i.nodeid: sorted({m.name for m in i.iter_markers()}) for i in session.items}
    with open(os.environ["TVC_DUMP_MARKERS"], "w") as f:
        json.dump(out, f)
'''


def _sections() -> tuple[set[str], set[str]]:
    import configparser

    cp = configparser.ConfigParser(interpolation=None)
    cp.read(REPO_ROOT / "tvc" / "data" / "markers.ini")
    return set(cp["tiers"]), set(cp["hardware"])


def test_every_test_has_its_tier_and_one_hardware_marker(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "tvc_dump_markers.py").write_text(DUMP_PLUGIN)
    out = tmp_path / "markers.json"
    env = {"TVC_DUMP_MARKERS": str(out),
           "PYTHONPATH": fakes.pythonpath(tmp_path / "pkg")}
    run = run_suite(["suites", "--collect-only", "-q", "-p", "tvc_dump_markers"],
                    tmp_path / "r", env=env)
    assert run.rc == 0, run.tail()
    items: dict[str, list[str]] = json.loads(out.read_text())
    tiers, hardware = _sections()
    assert len(items) > 10
    bad = {}
    for nodeid, marks in items.items():
        folder = Path(nodeid.split("::")[0]).parts[1]  # suites/<tier>/test_x.py
        got_tiers = [m for m in marks if m in tiers]
        got_hw = [m for m in marks if m in hardware]
        if got_tiers != [folder] or len(got_hw) != 1:
            bad[nodeid] = {"tiers": got_tiers, "hardware": got_hw, "folder": folder}
    assert not bad, (
        "each test needs exactly its folder's tier marker and one hw_* marker "
        f"(markers.ini): {json.dumps(bad, indent=1)[:3000]}")


def test_tier_folders_are_declared_tiers() -> None:
    tiers, _ = _sections()
    folders = {p.name for p in (REPO_ROOT / "suites").iterdir()
               if p.is_dir() and not p.name.startswith(("_", "."))}
    assert folders <= tiers, f"suites/ folders without a tier marker: {folders - tiers}"


def test_markers_file_declares_tiers_and_levels() -> None:
    names = read_markers()
    for required in ("level1", "level2", "contract", "real_nvme", "e2e", "bandwidth",
                     "trace", "hw_any", "hw_gpu", "hw_nvme"):
        assert names.get(required), required


def test_parse_require() -> None:
    assert parse_require(None) == set()
    assert parse_require(" gpu , ") == {"gpu"}
    assert parse_require("cuda,real_nvme") == {"gpu", "nvme"}
    assert parse_require("ALL") == {"gpu", "nvme"}
    assert parse_require("gpu2") == {"gpu", "gpu2"}  # two GPUs implies one
    for empty in ("", " , "):
        with pytest.raises(argparse.ArgumentTypeError, match="names no hardware"):
            parse_require(empty)
