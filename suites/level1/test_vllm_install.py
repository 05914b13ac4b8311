"""level1: vLLM imports, is the expected (editable) install, and matches its pins."""

from __future__ import annotations

import importlib.metadata as md
import platform
import sys
from pathlib import Path

import pytest

from tvc.env.vllm_install import (
    modified_tracked_files,
    requires_python,
    torch_requirement,
    version_satisfies,
    vllm_package_dir,
)

pytestmark = [pytest.mark.level1, pytest.mark.hw_any]


@pytest.fixture
def source_tree(tvc_profile) -> Path:
    """The profile's ``vllm.source_tree``, resolved; skips when it names none."""
    tree = tvc_profile["vllm"]["source_tree"]
    if not tree:
        pytest.skip(
            f"profile {tvc_profile.name} names no vLLM source tree "
            "(vllm.source_tree); export TVC_VLLM_SOURCE=/path/to/vllm to check an "
            "editable install")
    path = Path(tree).expanduser().resolve()
    if not path.is_dir():
        pytest.fail(f"vllm.source_tree {tree} is not a directory: set "
                    "TVC_VLLM_SOURCE to the vLLM checkout", pytrace=False)
    return path


def test_vllm_imports(vllm_module, record_property) -> None:
    import torch

    record_property("vllm_version", vllm_module.__version__)
    record_property("vllm_file", vllm_module.__file__)
    record_property("torch_version", str(torch.__version__))  # plain str for xdist
    record_property("torch_cuda", str(torch.version.cuda))
    record_property("cuda_available", str(torch.cuda.is_available()))
    assert vllm_module.__version__ == md.version("vllm"), (
        f"vllm.__version__ {vllm_module.__version__} differs from the installed "
        f"distribution {md.version('vllm')}: two vLLMs are on sys.path "
        f"({vllm_module.__file__}); remove the stale one")


def test_vllm_is_the_configured_source_tree(source_tree, record_property) -> None:
    tree = source_tree
    pkg = vllm_package_dir()
    record_property("vllm_source_tree", str(tree))
    assert pkg.is_relative_to(tree), (
        f"vLLM is imported from {pkg}, not from the source tree {tree}: the editable "
        f"install is not live (a PyPI wheel or another checkout shadows it). Fix: "
        f"`pip uninstall vllm` until none is left, then `pip install -e {tree}` in "
        f"{sys.executable}'s environment")


def test_source_tree_has_no_modified_tracked_files(source_tree) -> None:
    tree = source_tree
    changed = modified_tracked_files(tree)
    assert not changed, (
        f"{len(changed)} tracked file(s) modified in {tree} (the integration promises "
        "zero changes to vLLM): " + "; ".join(changed[:10])
        + ". Fix: move the change into the connector or revert it (git stash)")


def test_torch_matches_vllm_pin(record_property) -> None:
    vllm_pkg = vllm_package_dir()  # fails clearly when vLLM is absent
    req = torch_requirement()
    if req is None:
        pytest.fail(f"vLLM at {vllm_pkg} declares no torch requirement in its "
                    "metadata: the install is incomplete", pytrace=False)
    try:
        have = md.version("torch")
    except md.PackageNotFoundError:
        pytest.fail(f"torch is not installed; vLLM needs {req}", pytrace=False)
    record_property("torch_pin", str(req.specifier))
    assert version_satisfies(req.specifier, have), (
        f"torch {have} is installed but vLLM {md.version('vllm')} pins torch"
        f"{req.specifier}: its compiled extensions will fail with undefined symbols. "
        f"Fix: pip install 'torch{req.specifier}' (or rebuild vLLM against torch "
        f"{have})")


def test_python_satisfies_vllm_requires_python() -> None:
    vllm_package_dir()
    spec = requires_python()
    have = platform.python_version()
    assert version_satisfies(spec, have), (
        f"Python {have} ({sys.executable}) does not satisfy vLLM's Requires-Python "
        f"{spec}. Fix: use a Python in that range for this environment")
