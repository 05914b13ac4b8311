"""level2 CPU torch.compile check against a broken C++ compiler (and the real one).

Inductor's CPU backend compiles generated C++ with ``$CXX`` (read when
``torch._inductor.config`` is imported). Each run gets its own scratch dir, so the
Inductor cache is empty and the code is really compiled. Both runs compile (about
10-15 s each on 2 cores), so they run side by side.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from selftests.conftest import SuiteRun, run_suite
from selftests.foundation import fakes

LEVEL2 = "suites/level2/test_torch_compile.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, SuiteRun]:
    base = tmp_path_factory.mktemp("level2")
    broken = fakes.write_script(base / "bin" / "broken-c++",
                                'echo "broken-c++: cannot compile anything" >&2\n'
                                "exit 1\n")
    real = shutil.which("g++") or shutil.which("c++")
    if real is None:
        pytest.skip("no C++ compiler (g++) on this box: Inductor's CPU backend needs "
                    "one; apt-get install g++")
    cases = {"broken": str(broken), "real": real}

    def one(case: str) -> SuiteRun:
        profile = fakes.minimal_profile(base / f"{case}.toml", base / f"scratch-{case}")
        return run_suite([LEVEL2, "--tvc-profile", str(profile), "-k", "cpu_matches"],
                         base / f"report-{case}",
                         env={"CXX": cases[case], "TORCHINDUCTOR_CACHE_DIR": None,
                              "TORCHINDUCTOR_FX_GRAPH_CACHE": None},
                         timeout_s=420)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(cases, pool.map(one, cases), strict=True))


def test_broken_cxx_fails_naming_inductor(runs) -> None:
    run = runs["broken"]
    t = run.test("test_torch_compile_cpu_matches_eager")
    assert t["outcome"] == "failed", run.tail()
    assert "torch.compile on cpu (Inductor + C++" in t["message"]
    assert "failed:" in t["message"]
    assert "broken-c++" in t["message"]  # torch names the compiler it could not use
    assert "compile_time_s_cpu" not in t["properties"]


def test_real_cxx_passes_and_records_compile_time(runs) -> None:
    """Positive control: the box's own compiler, same fresh cache, passes."""
    run = runs["real"]
    t = run.test("test_torch_compile_cpu_matches_eager")
    assert t["outcome"] == "passed", run.tail()
    assert t["properties"]["compile_time_s_cpu"] > 0
