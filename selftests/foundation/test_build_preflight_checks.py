"""level1 build preflight against fake toolchains (``[build] preflight = true``).

Fake ``gcc`` and ``nvcc`` are shell scripts in temp dirs; each run sets CUDA_HOME,
CUDAHOSTCXX, CXX, TMPDIR and PIP_CACHE_DIR for the suite in a subprocess. Checks that
need a toolchain fixture (nvcc, host compiler) report a missing variable as a setup
error (JUnit ``<error>``); the others as failures.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from selftests.conftest import SuiteRun, run_suite
from selftests.foundation import fakes

PREFLIGHT = "suites/level1/test_build_preflight.py"
CXX17_ERROR = (
    "/usr/local/cuda/include/cub/util_cpp_dialect.cuh:70:2: error: #error CUB "
    "requires at least C++17. Define CUB_IGNORE_DEPRECATED_CPP_DIALECT to suppress "
    "this message.")
IGNORED_FLAG = ("cc1plus: warning: command-line option '-std=c++20' is valid for "
                "C++/ObjC++ but not for C; flag will be ignored")
FAILING = ("failed", "error")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, SuiteRun]:
    base = tmp_path_factory.mktemp("preflight")
    gcc12 = fakes.fake_gcc(base / "gcc12" / "g++", "12.2.0")
    gcc12_other = fakes.fake_gcc(base / "gcc12-other" / "g++", "12.2.0")
    gcc9 = fakes.fake_gcc(base / "gcc9" / "g++", "9.4.0")
    cuda_cxx17 = base / "cuda-cxx17"
    fakes.fake_nvcc(cuda_cxx17, "12.1", CXX17_ERROR, compile_rc=1)
    cuda_ignored = base / "cuda-ignored"
    fakes.fake_nvcc(cuda_ignored, "12.1", IGNORED_FLAG, compile_rc=0)
    cuda_good = base / "cuda-good"
    fakes.fake_nvcc(cuda_good, "12.1", "", compile_rc=0)
    (base / "cuda-empty" / "bin").mkdir(parents=True)
    build_tmp = base / "build-tmp"
    build_tmp.mkdir()

    def profile(name: str, min_free_gib: float) -> Path:
        return fakes.minimal_profile(
            base / f"{name}.toml", base / f"scratch-{name}",
            build={"preflight": True, "min_free_gib": min_free_gib, "min_gcc": "11.3"})

    dirs = {"TMPDIR": str(build_tmp), "PIP_CACHE_DIR": str(build_tmp / "pip")}
    cases: dict[str, tuple[list[str], dict[str, str | None]]] = {
        # nothing set; a huge free-space threshold
        "unset": ([PREFLIGHT, "--tvc-profile", str(profile("unset", 1e6))],
                  {"CUDA_HOME": None, "CUDAHOSTCXX": None, "CXX": None, **dirs}),
        # CUDA_HOME without bin/nvcc; CUDAHOSTCXX and CXX two different compilers
        "no_nvcc": ([PREFLIGHT, "--tvc-profile", str(profile("no_nvcc", 0)), "-k",
                     "cuda_home or host_compiler or free_space"],
                    {"CUDA_HOME": str(base / "cuda-empty"), "CUDAHOSTCXX": str(gcc12),
                     "CXX": str(gcc12_other), **dirs}),
        # nvcc 12.1 whose compiles fail like CUB's C++17 check; GCC 9.4 everywhere
        "old": ([PREFLIGHT, "--tvc-profile", str(profile("old", 0))],
                {"CUDA_HOME": str(cuda_cxx17), "CUDAHOSTCXX": str(gcc9),
                 "CXX": str(gcc9), **dirs}),
        # nvcc warns "flag will be ignored" (the silent host-compiler fallback)
        "ignored": ([PREFLIGHT, "--tvc-profile", str(profile("ignored", 0)), "-k",
                     "cub"],
                    {"CUDA_HOME": str(cuda_ignored), "CUDAHOSTCXX": str(gcc12),
                     "CXX": str(gcc12), **dirs}),
        # positive control: a toolchain that is right in every way but the CUDA torch
        "good": ([PREFLIGHT, "--tvc-profile", str(profile("good", 0)), "-k",
                  "not nvcc_matches_torch"],
                 {"CUDA_HOME": str(cuda_good), "CUDAHOSTCXX": str(gcc12),
                  "CXX": str(gcc12), **dirs}),
    }

    def one(case: str) -> SuiteRun:
        args, env = cases[case]
        return run_suite(args, base / f"report-{case}", env=env)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(cases, pool.map(one, cases), strict=True))


def _failing(run: SuiteRun, name: str) -> str:
    t = run.test(name)
    assert t["outcome"] in FAILING, f"{name}: {t}\n{run.tail()}"
    return t["message"]


def test_preflight_skips_unless_the_profile_asks(tmp_path: Path) -> None:
    run = run_suite([PREFLIGHT, "-k", "cuda_home"], tmp_path / "r")
    t = run.test("test_cuda_home_has_nvcc")
    assert t["outcome"] == "skipped"
    assert "[build] preflight = false" in t["message"]


def test_unset_cuda_home_fails(runs) -> None:
    run = runs["unset"]
    for name in ("test_cuda_home_has_nvcc", "test_nvcc_matches_torch_cuda",
                 "test_nvcc_compiles_cub_with_cxx17"):
        msg = _failing(run, name)
        assert "CUDA_HOME is not set: vLLM's build asserts on it" in msg
        assert "Fix: export CUDA_HOME=" in msg


def test_unset_cudahostcxx_fails(runs) -> None:
    msg = _failing(runs["unset"], "test_host_compiler_is_cxx_and_new_enough")
    assert "CUDAHOSTCXX is not set" in msg
    assert "requires at least C++17" in msg and "Fix: export CUDAHOSTCXX=$CXX" in msg


def test_too_little_free_space_names_the_variable(runs, tmp_path: Path) -> None:
    run = runs["unset"]
    msg = _failing(run, "test_build_dirs_have_free_space[TMPDIR]")
    assert "TMPDIR (" in msg and "build-tmp) has " in msg
    assert "a vLLM build needs 1000000 GiB ([build] min_free_gib)" in msg
    assert "Fix: point TMPDIR (and RUSTUP_HOME, CARGO_HOME) at a big data disk" in msg
    msg = _failing(run, "test_build_dirs_have_free_space[PIP_CACHE_DIR]")
    assert "PIP_CACHE_DIR (" in msg and "build-tmp/pip)" in msg
    props = run.test("[TMPDIR]")["properties"]
    assert props["free_gib_TMPDIR"] > 0


def test_cuda_home_without_nvcc_fails(runs) -> None:
    msg = _failing(runs["no_nvcc"], "test_cuda_home_has_nvcc")
    assert "cuda-empty holds no executable bin/nvcc" in msg
    assert "Fix: point CUDA_HOME at a CUDA toolkit root" in msg


def test_cudahostcxx_differs_from_cxx_fails(runs) -> None:
    msg = _failing(runs["no_nvcc"], "test_host_compiler_is_cxx_and_new_enough")
    assert "is not the compiler CXX names" in msg
    assert "gcc12/g++" in msg and "gcc12-other/g++" in msg
    assert "Fix: export CUDAHOSTCXX=$CXX" in msg
    assert runs["no_nvcc"].test("[TMPDIR]")["outcome"] == "passed"


def test_old_gcc_fails(runs) -> None:
    msg = _failing(runs["old"], "test_host_compiler_is_cxx_and_new_enough")
    assert "is GCC 9.4.0; building vLLM needs GCC >= 11.3" in msg
    assert "Fix: install a newer GCC" in msg


def test_probe_compile_failure_shows_nvccs_error(runs) -> None:
    run = runs["old"]
    assert run.test("test_cuda_home_has_nvcc")["outcome"] == "passed", run.tail()
    assert run.test("test_cuda_home_has_nvcc")["properties"]["nvcc_release"] == "12.1"
    msg = _failing(run, "test_nvcc_compiles_cub_with_cxx17")
    assert "cannot compile a file that includes CUB" in msg
    assert "CUB requires at least C++17" in msg
    assert "Fix: set CUDAHOSTCXX to a GCC >= 11.3" in msg


def test_nvcc_not_matching_torch_fails(runs) -> None:
    """The fake nvcc says CUDA 12.1: a CPU torch, or any other CUDA, must fail."""
    import torch

    msg = _failing(runs["old"], "test_nvcc_matches_torch_cuda")
    if torch.version.cuda is None:
        assert "is a CPU build (torch.version.cuda is None)" in msg
        assert "Fix: install vLLM's torch pin for CUDA" in msg
    else:
        want = ".".join(torch.version.cuda.split(".")[:2])
        if want == "12.1":
            pytest.skip("torch is built with CUDA 12.1, the fake nvcc's release")
        assert f"is CUDA 12.1 but torch was built with CUDA {want}" in msg
        assert f"Fix: point CUDA_HOME at a CUDA {want} toolkit" in msg


def test_ignored_standard_flag_fails_the_probe(runs) -> None:
    msg = _failing(runs["ignored"], "test_nvcc_compiles_cub_with_cxx17")
    assert "flag will be ignored" in msg
    assert "(or ignored the standard flag)" in msg


def test_good_toolchain_passes(runs) -> None:
    """Positive control: the same fakes, set up right, pass."""
    run = runs["good"]
    for name in ("test_cuda_home_has_nvcc", "test_host_compiler_is_cxx_and_new_enough",
                 "test_nvcc_compiles_cub_with_cxx17", "[TMPDIR]", "[PIP_CACHE_DIR]"):
        assert run.test(name)["outcome"] == "passed", f"{name}\n{run.tail()}"
    assert run.test("host_compiler")["properties"]["host_gcc"] == "12.2.0"
    assert run.rc == 0
