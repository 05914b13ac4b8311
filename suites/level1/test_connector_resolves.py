"""level1: the profile's connector resolves as vLLM resolves it and is complete."""

from __future__ import annotations

import pytest

from tvc.env.vllm_install import resolve_connector, unimplemented_abstract_methods

pytestmark = [pytest.mark.level1, pytest.mark.hw_any]


def test_connector_resolves_as_vllm_resolves_it(vllm_module, tvc_profile,
                                                record_property) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    cfg = tvc_profile.kv_transfer_config()
    cls = resolve_connector(cfg)
    record_property("connector_class", f"{cls.__module__}.{cls.__qualname__}")
    assert isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1), (
        f"kv_connector {cfg['kv_connector']!r} resolves to {cls!r}, which is not a "
        "KVConnectorBase_V1 subclass: vLLM's V1 engine cannot drive it")


def test_connector_implements_every_abstract_method(vllm_module, tvc_profile) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    cls = resolve_connector(tvc_profile.kv_transfer_config())
    missing = unimplemented_abstract_methods(cls, KVConnectorBase_V1)
    assert not missing, (
        f"{cls.__module__}.{cls.__qualname__} leaves {len(missing)} abstract method(s) "
        f"of this vLLM's KVConnectorBase_V1 unimplemented: {', '.join(missing)}. "
        "vLLM cannot instantiate it; implement them (the base class API changed "
        "between vLLM versions)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize the import tests from the profile (``[None]``: none, a skip).

    ``module``: the profile's ``[imports] modules``; ``extension``: the
    connector's compiled extensions.

    At collection, before any fixture: the profile comes from the plugin's run
    state (:func:`tvc.plugin.session.run_state`); the extensions are read from
    the installed distributions' file lists, nothing imported
    (:func:`tvc.env.vllm_install.connector_extensions`).
    """
    from tvc.plugin import session

    name = metafunc.function.__name__
    if name == "test_profile_modules_import":
        profile = session.run_state(metafunc.config).profile
        metafunc.parametrize("module", profile["imports"]["modules"] or [None])
    if name == "test_connector_extensions_load":
        from tvc.env.vllm_install import connector_extensions

        found = connector_extensions(session.run_state(metafunc.config).profile)
        metafunc.parametrize(("extension", "origin"), list(found.items())
                             or [(None, "")], ids=list(found) or ["none"])


def test_profile_modules_import(module, tvc_profile) -> None:
    import importlib

    from tvc.env.vllm_install import explain_import_error

    if module is None:
        pytest.skip(f"profile {tvc_profile.name} declares no extra modules "
                    "([imports] modules)")
    hint = tvc_profile["imports"]["hint"]
    try:
        importlib.import_module(module)
    except ImportError as exc:
        why = explain_import_error(str(exc))
        pytest.fail(f"`import {module}` failed: {exc} — {why}"
                    + (f". Fix: {hint}" if hint else ""), pytrace=False)


def test_connector_extensions_load(extension, origin, tvc_profile, tvc_hw,
                                   tvc_missing_hardware, record_property) -> None:
    """Each compiled extension the connector loads imports in a fresh Python.

    A torch ABI mismatch (a wheel built for another torch) otherwise passes
    level1 and fails at the connector's first load; here it names the missing
    symbol and the torch the extension's distribution was built for.
    """
    from tvc.env.vllm_install import (
        cuda_library_missing,
        explain_extension_error,
        import_extensions,
    )

    if extension is None:
        pytest.skip(f"profile {tvc_profile.name} names no compiled extension "
                    "([imports] extensions) and the distributions of "
                    "connector.module_path and [imports] modules ship none: nothing "
                    "to load (a connector inside vLLM: vLLM's own extensions are "
                    "test_compiled_extensions_load's)")
    record_property("extension_distribution", origin or "not installed")
    error = import_extensions([extension])[extension]
    lib = cuda_library_missing(error)
    if lib:
        import torch

        if not (tvc_hw["levels"].get("gpu") and torch.version.cuda):
            tvc_missing_hardware(
                "gpu", f"{extension} ({origin}) is a CUDA extension: it links {lib}, "
                f"which this box lacks (torch {torch.__version__}, CUDA "
                f"{torch.version.cuda or 'none'}).")
    assert not error, explain_extension_error(extension, error) + (
        "" if origin else f" ({extension} is in no installed distribution: check "
        "[imports] extensions)")
