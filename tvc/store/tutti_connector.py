"""Tutti's ``TuttiConnectorV1``, with the suite's stand-in store registered first.

Point ``kv_connector_module_path`` here (profile ``tutti-public``): vLLM's
``KVConnectorFactory`` imports it in every process that builds a connector, so
:data:`tvc.store.tutti_standin.STANDIN_TYPE` is in Tutti's ``stores.registry`` before
the engine is built. The class is Tutti's own (``adapter.connector`` on ``PYTHONPATH``).
Tutti's ``stores.metadata.create_metadata_store`` knows only ``memory`` and
``tutti_nvme``; the stand-in gets ``MemoryMetadataStore`` (residency only, no bytes).
"""

from __future__ import annotations

from typing import Any

from tvc.store.tutti_standin import STANDIN_TYPE, StandInKVStore

#: the upstream module this shim needs (the contract tier names it when absent)
UPSTREAM_MODULE = "adapter.connector"

__all__ = ["register_standin_store"]  # and TuttiConnectorV1, by __getattr__


def register_standin_store() -> None:
    """Register :class:`StandInKVStore` with Tutti's store registries (idempotent).

    Raises:
        ModuleNotFoundError: Tutti's ``stores`` package is not on ``PYTHONPATH``.

    """
    from stores import metadata, registry

    if STANDIN_TYPE not in getattr(registry, "_STORE_TYPES", {}):
        registry.register_store_type(STANDIN_TYPE, StandInKVStore)
    create = metadata.create_metadata_store
    if getattr(create, "_tvc_standin", False):
        return

    def create_metadata_store(type_name: str, options: dict) -> Any:
        if type_name == STANDIN_TYPE:
            return metadata.MemoryMetadataStore(**options)
        return create(type_name, options)

    create_metadata_store._tvc_standin = True  # type: ignore[attr-defined]
    create_metadata_store.__doc__ = create.__doc__
    metadata.create_metadata_store = create_metadata_store


def __getattr__(name: str) -> Any:
    """``TuttiConnectorV1``: Tutti's class, imported on first use."""
    if name != "TuttiConnectorV1":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    register_standin_store()
    from adapter.connector import TuttiConnectorV1

    globals()["TuttiConnectorV1"] = TuttiConnectorV1
    return TuttiConnectorV1
