"""``tvc.store.tutti_connector`` registers the stand-in store with Tutti's registries.

Run against a stand-in of the two Tutti registry modules with the interface of
xPU-IO/Tutti 33a8fb8 (``stores/registry.py``: ``register_store_type``,
``create_store``, ``_STORE_TYPES``; ``stores/metadata.py``:
``create_metadata_store`` knowing ``memory`` and ``tutti_nvme``,
``MemoryMetadataStore(num_chunks, segment_bytes, **ignored)``) and of
``adapter.connector`` (a ``TuttiConnectorV1`` class), written here (no Tutti
code): the worker's ``create_store`` must build the stand-in, the scheduler's
``create_metadata_store`` Tutti's memory metadata store, other types unchanged.
"""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.hw_any]

REGISTRY = '''
_STORE_TYPES = {}
def register_store_type(name, cls):
    if name in _STORE_TYPES:
        raise ValueError(f"store type already registered: {name!r}")
    _STORE_TYPES[name] = cls
def create_store(type_name, options):
    return _STORE_TYPES[type_name](**options)
'''
METADATA = '''
class MemoryMetadataStore:
    def __init__(self, num_chunks, segment_bytes, **_ignored):
        if num_chunks <= 0:
            raise ValueError("num_chunks must be positive")
        self.num_chunks = num_chunks
def create_metadata_store(type_name, options):
    if type_name == "memory":
        return MemoryMetadataStore(**options)
    raise ValueError(f"store type {type_name!r} has no metadata-only client")
'''
CONNECTOR = "class TuttiConnectorV1:\n    pass\n"


@pytest.fixture
def fake_tutti(tmp_path, monkeypatch):
    for rel, text in (("stores/__init__.py", ""), ("stores/registry.py", REGISTRY),
                      ("stores/metadata.py", METADATA), ("adapter/__init__.py", ""),
                      ("adapter/connector.py", CONNECTOR)):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("stores", "stores.registry", "stores.metadata", "adapter",
                 "adapter.connector", "tvc.store.tutti_connector"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield tmp_path
    for name in ("stores", "stores.registry", "stores.metadata", "adapter",
                 "adapter.connector", "tvc.store.tutti_connector"):
        sys.modules.pop(name, None)  # the fakes never outlive the test


def test_shim_registers_the_stand_in_for_worker_and_scheduler(fake_tutti) -> None:
    from tvc.store.tutti_standin import STANDIN_TYPE, StandInKVStore

    shim = importlib.import_module("tvc.store.tutti_connector")
    from adapter.connector import TuttiConnectorV1
    from stores import metadata, registry

    assert shim.TuttiConnectorV1 is TuttiConnectorV1  # Tutti's class, unchanged
    store = registry.create_store(STANDIN_TYPE, {"num_chunks": 8,
                                                 "segment_bytes": 4096})
    assert isinstance(store, StandInKVStore) and store.capacity_chunks == 8
    meta = metadata.create_metadata_store(STANDIN_TYPE, {"num_chunks": 8,
                                                         "segment_bytes": 4096})
    assert isinstance(meta, metadata.MemoryMetadataStore)
    assert isinstance(metadata.create_metadata_store(
        "memory", {"num_chunks": 1, "segment_bytes": 1}), metadata.MemoryMetadataStore)
    with pytest.raises(ValueError, match="no metadata-only client"):
        metadata.create_metadata_store("other", {})
    shim.register_standin_store()  # idempotent: no "already registered"
    assert metadata.create_metadata_store.__name__ == "create_metadata_store"


def test_shim_without_tutti_names_the_missing_module(monkeypatch, tmp_path) -> None:
    monkeypatch.delitem(sys.modules, "tvc.store.tutti_connector", raising=False)
    for name in ("stores", "stores.registry", "stores.metadata", "adapter",
                 "adapter.connector"):
        monkeypatch.setitem(sys.modules, name, None)  # not importable
    shim = importlib.import_module("tvc.store.tutti_connector")
    assert shim.UPSTREAM_MODULE == "adapter.connector"
    with pytest.raises(ModuleNotFoundError):
        shim.TuttiConnectorV1  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'Other'"):
        shim.Other  # noqa: B018
