"""The one line a run prints about the connector package's pairing with vLLM."""

from __future__ import annotations

import pytest

from tvc.config.profile import load
from tvc.env.pairings import pairing_line

pytestmark = pytest.mark.hw_any


def _installed(**versions: str):
    return lambda name: versions.get(name)


def test_lmcache_056_on_vllm_026_cannot_work_and_names_the_version_that_does():
    pkg = load("lmcache", env={})["package"]
    line = pairing_line(pkg, "0.26.0", "2.11.0+cu130", _installed(lmcache="0.5.6"))
    assert line.startswith("pairing: lmcache 0.5.6 with vLLM 0.26.0 (torch "
                           "2.11.0+cu130): cannot work: ")
    assert "misses one torch-2.13 symbol" in line
    assert line.endswith("known to work with vLLM 0.26.0: lmcache==0.5.3")


def test_known_pairing_untested_version_and_missing_package():
    pkg = load("lmcache", env={})["package"]
    ok = pairing_line(pkg, "0.26.0", "2.11.0", _installed(lmcache="0.5.3"))
    assert ok.startswith("pairing: lmcache 0.5.3 with vLLM 0.26.0 (torch 2.11.0): "
                         "known to work: ")
    odd = pairing_line(pkg, "0.28.0", "2.13.0+cpu", _installed(lmcache="0.5.2"))
    assert "not among the profile's pairings (untested)" in odd
    assert odd.endswith("known to work with vLLM 0.28.0: lmcache==0.5.6")
    none = pairing_line(pkg, "0.34.0", "2.15.0", _installed())
    assert none == ("pairing: lmcache is not installed (vLLM 0.34.0, torch 2.15.0); "
                    "no version is known to work with vLLM 0.34.0")


def test_a_platform_wheel_named_by_a_pairing_is_the_one_checked():
    pkg = load("mooncake-store", env={})["package"]
    line = pairing_line(pkg, "0.26.0", "2.11.0",
                        _installed(**{"mooncake-transfer-engine-cuda13": "0.3.14"}))
    assert line.startswith("pairing: mooncake-transfer-engine-cuda13 0.3.14 with "
                           "vLLM 0.26.0")


def test_a_profile_without_package_says_nothing():
    assert pairing_line(load("example", env={})["package"], "0.28.0", "2.13.0") == ""


def test_a_post_release_is_its_own_version():
    pkg = load("mooncake-store", env={})["package"]
    line = pairing_line(pkg, "0.28.0", "2.13.0+cpu", _installed(
        **{"mooncake-transfer-engine-non-cuda": "0.3.13.post1"}))
    assert ": known to work: " in line, line
    older = pairing_line(pkg, "0.28.0", "2.13.0+cpu", _installed(
        **{"mooncake-transfer-engine-non-cuda": "0.3.13"}))
    assert "not among the profile's pairings" in older, older
