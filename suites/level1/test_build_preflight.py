"""level1: build preflight for boxes that build vLLM from source.

Runs when the profile sets ``[build] preflight = true``; each test is one pitfall from
the operators' build guide, with the fix in its message.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from packaging.version import Version

from tvc.env import toolchain

pytestmark = [pytest.mark.level1, pytest.mark.hw_any]


@pytest.fixture
def build(tvc_profile) -> dict:
    """The profile's ``[build]`` section; skips when preflight is off."""
    section = tvc_profile["build"]
    if not section["preflight"]:
        pytest.skip(f"profile {tvc_profile.name} does not build vLLM here "
                    "([build] preflight = false); set it to true on build boxes")
    return section


@pytest.fixture
def nvcc(build) -> str:
    """Path of ``$CUDA_HOME/bin/nvcc``; fails when CUDA_HOME is unset or wrong."""
    home = os.environ.get("CUDA_HOME")
    assert home, ("CUDA_HOME is not set: vLLM's build asserts on it. Fix: export "
                  "CUDA_HOME=/usr/local/cuda (the toolkit matching torch.version.cuda)")
    path = Path(home) / "bin" / "nvcc"
    assert path.is_file() and os.access(path, os.X_OK), (
        f"CUDA_HOME={home} holds no executable bin/nvcc. Fix: point CUDA_HOME at a "
        "CUDA toolkit root")
    return str(path)


@pytest.fixture
def host_cxx(build) -> str:
    """``$CUDAHOSTCXX``; fails when unset (nvcc would fall back to the system gcc)."""
    cxx = os.environ.get("CUDAHOSTCXX")
    assert cxx, (
        "CUDAHOSTCXX is not set: nvcc silently uses the system's (old) gcc as host "
        "compiler, ignores -std=c++20 and every .cu that pulls CUB/Thrust fails with "
        "'requires at least C++17' (CC/CXX do not reach nvcc). Fix: export "
        "CUDAHOSTCXX=$CXX")
    return cxx


def test_cuda_home_has_nvcc(nvcc, record_property) -> None:
    release = toolchain.nvcc_release(nvcc)
    record_property("nvcc_release", release)
    assert release, f"{nvcc} --version prints no CUDA release: a broken toolkit"


def test_nvcc_matches_torch_cuda(nvcc) -> None:
    import torch

    release = toolchain.nvcc_release(nvcc)
    torch_cuda = torch.version.cuda
    assert torch_cuda, (
        f"torch {torch.__version__} is a CPU build (torch.version.cuda is None): "
        "vLLM's CUDA build needs a CUDA torch. Fix: install vLLM's torch pin for CUDA")
    want = ".".join(torch_cuda.split(".")[:2])
    assert release == want, (
        f"nvcc at {nvcc} is CUDA {release} but torch was built with CUDA {want}. "
        f"Fix: point CUDA_HOME at a CUDA {want} toolkit")


def test_host_compiler_is_cxx_and_new_enough(build, host_cxx, record_property) -> None:
    cxx = os.environ.get("CXX")
    host_path, host_id = toolchain.compiler_identity(host_cxx)
    if cxx:
        cxx_path, cxx_id = toolchain.compiler_identity(cxx)
        assert (host_path, host_id) == (cxx_path, cxx_id), (
            f"CUDAHOSTCXX ({host_cxx} -> {host_path}, {host_id!r}) is not the compiler "
            f"CXX names ({cxx} -> {cxx_path}, {cxx_id!r}): host and device code would "
            "be built by different compilers. Fix: export CUDAHOSTCXX=$CXX")
    version = toolchain.gcc_version(host_cxx)
    assert version is not None, (
        f"cannot read a GCC version from CUDAHOSTCXX={host_cxx} ({host_id!r})")
    record_property("host_gcc", str(version))
    need = Version(build["min_gcc"])
    assert version >= need, (
        f"host compiler {host_cxx} is GCC {version}; building vLLM needs GCC >= {need} "
        "(torch's C++20 headers). Fix: install a newer GCC and export CC, CXX and "
        "CUDAHOSTCXX to it")


def test_nvcc_compiles_cub_with_cxx17(nvcc, host_cxx) -> None:
    ok, output = toolchain.probe_compile(nvcc, host_cxx)
    assert ok, (
        f"nvcc -ccbin {host_cxx} -std=c++17 cannot compile a file that includes CUB "
        f"(or ignored the standard flag): {output[-1200:]}\nFix: set CUDAHOSTCXX to a "
        "GCC >= 11.3 that nvcc supports")


@pytest.mark.parametrize("var", ["TMPDIR", "PIP_CACHE_DIR"])
def test_build_dirs_have_free_space(build, var, record_property) -> None:
    path = toolchain.build_dirs()[var]
    free = toolchain.free_gib(path)
    record_property(f"free_gib_{var}", round(free, 1))
    assert free >= build["min_free_gib"], (
        f"{var} ({path}) has {free:.1f} GiB free; a vLLM build needs "
        f"{build['min_free_gib']:.0f} GiB ([build] min_free_gib). Fix: point {var} "
        "(and RUSTUP_HOME, CARGO_HOME) at a big data disk")
