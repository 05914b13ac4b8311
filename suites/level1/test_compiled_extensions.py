"""level1: every compiled extension vLLM ships loads (no undefined symbol).

Extensions link the CUDA driver, so they are imported only where a CUDA driver exists
(hardware level ``gpu``); elsewhere the test skips with that reason.
"""

from __future__ import annotations

import pytest

from tvc.env.vllm_install import (
    discover_extensions,
    explain_import_error,
    import_extensions,
    vllm_package_dir,
)

pytestmark = pytest.mark.level1


@pytest.fixture(scope="module")
def extension_names() -> list[str]:
    """Dotted names of vLLM's compiled extensions loadable by this interpreter."""
    return discover_extensions(vllm_package_dir())


@pytest.mark.hw_any
def test_vllm_ships_compiled_extensions(extension_names, record_property) -> None:
    record_property("compiled_extensions", ",".join(extension_names))
    assert any(n.split(".")[-1].startswith("_C") for n in extension_names), (
        f"vLLM at {vllm_package_dir()} ships no `_C*` extension for this Python "
        f"(found: {extension_names or 'none'}): a python-only install without "
        "precompiled binaries. Fix: reinstall vLLM with its compiled part")


@pytest.mark.hw_gpu
def test_compiled_extensions_load(extension_names, record_property) -> None:
    results = import_extensions(extension_names)
    failed = {n: e for n, e in results.items() if e}
    record_property("extensions_loaded", sum(1 for e in results.values() if not e))
    record_property("extensions_failed", len(failed))
    assert not failed, (
        f"{len(failed)} of {len(results)} compiled extensions fail to load:\n"
        + "\n".join(f"  {n}: {e[:300]} — {explain_import_error(e)}"
                    for n, e in failed.items()))
