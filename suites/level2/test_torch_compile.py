"""level2: torch.compile sanity — Inductor output equals eager.

``f(x) = sin((x + 1) * 2)`` on 1M float32 values, compiled with ``fullgraph=True``
and the FX graph cache off (so it really compiles). Tolerance: torch's float32 defaults
(rtol 1.3e-6, atol 1e-5), since fusion may reorder the arithmetic.
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.level2

N_ELEMENTS = 1 << 20  # 1M float32 values = 4 MiB


def _f(x):
    import torch

    return torch.sin((x + 1) * 2)


def _check_compiled_matches_eager(device: str, scratch, record_property, monkeypatch
                                  ) -> None:
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    cache = scratch / "inductor-cache"
    cache.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    torch._dynamo.reset()
    counters.clear()
    x = torch.linspace(-10.0, 10.0, N_ELEMENTS, dtype=torch.float32, device=device)
    compiled = torch.compile(_f, backend="inductor", fullgraph=True)
    t0 = time.perf_counter()
    try:
        with torch._inductor.config.patch(fx_graph_cache=False):
            got = compiled(x)
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as exc:  # Inductor/Triton/C++ compiler errors
        backend = "Triton" if device == "cuda" else "C++ (cpp_wrapper/OpenMP)"
        pytest.fail(f"torch.compile on {device} (Inductor + {backend}) failed: "
                    f"{type(exc).__name__}: {str(exc)[-1500:]}", pytrace=False)
    compile_s = time.perf_counter() - t0
    record_property(f"compile_time_s_{device}", round(compile_s, 3))
    assert counters["stats"]["unique_graphs"] >= 1, (
        "torch.compile produced no graph: Dynamo fell back to eager")
    torch.testing.assert_close(got, _f(x), msg=lambda m: (
        f"Inductor on {device} disagrees with eager for sin((x+1)*2): {m}"))


@pytest.mark.hw_gpu
def test_torch_compile_cuda_matches_eager(tvc_profile, record_property, monkeypatch
                                          ) -> None:
    _check_compiled_matches_eager("cuda", tvc_profile.scratch, record_property,
                                  monkeypatch)


@pytest.mark.hw_any
def test_torch_compile_cpu_matches_eager(tvc_profile, record_property, monkeypatch
                                         ) -> None:
    _check_compiled_matches_eager("cpu", tvc_profile.scratch, record_property,
                                  monkeypatch)
