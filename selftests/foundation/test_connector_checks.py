"""level1 connector checks against fake out-of-tree connectors.

A temp module ``tvc_fake_connector`` (on PYTHONPATH) holds connectors built against the
installed vLLM's ``KVConnectorBase_V1``: a complete one (positive control), one that
omits two abstract methods, and a class that is no connector. One tmp profile per case
selects them through ``connector.module_path`` exactly as an operator would. The five
suite runs each import vLLM (several seconds), so they run two at a time.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from selftests.conftest import SuiteRun, run_suite
from selftests.foundation import fakes

CONNECTOR_TESTS = "suites/level1/test_connector_resolves.py"
OMITTED = ("build_connector_meta", "wait_for_save")

FAKE_MODULE = f'''\
"""Fake out-of-tree KV connectors for the suite's self-tests."""
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

OMITTED = {set(OMITTED)!r}


def _method(name):
    def method(self, *args, **kwargs):
        raise NotImplementedError(name)
    method.__name__ = name
    return method


# Built from the installed vLLM's abstract methods, so the fake follows API changes.
_ABSTRACT = sorted(KVConnectorBase_V1.__abstractmethods__)
CompleteConnector = type("CompleteConnector", (KVConnectorBase_V1,),
                         {{"__module__": __name__,
                          **{{n: _method(n) for n in _ABSTRACT}}}})
IncompleteConnector = type("IncompleteConnector", (KVConnectorBase_V1,),
                           {{"__module__": __name__,
                            **{{n: _method(n) for n in _ABSTRACT
                               if n not in OMITTED}}}})


class NotAConnector:
    def __init__(self, vllm_config, role, kv_cache_config=None):
        pass
'''

CASES = {
    "complete": ("CompleteConnector", "tvc_fake_connector"),
    "incomplete": ("IncompleteConnector", "tvc_fake_connector"),
    "not_subclass": ("NotAConnector", "tvc_fake_connector"),
    "wrong_module": ("CompleteConnector", "tvc_no_such_module.connector"),
    "wrong_class": ("NoSuchConnectorV1", "tvc_fake_connector"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, SuiteRun]:
    base = tmp_path_factory.mktemp("connector")
    (base / "pkg").mkdir()
    (base / "pkg" / "tvc_fake_connector.py").write_text(FAKE_MODULE)
    env = {"PYTHONPATH": fakes.pythonpath(base / "pkg")}

    def one(case: str) -> SuiteRun:
        name, module = CASES[case]
        profile = fakes.minimal_profile(
            base / f"{case}.toml", base / f"scratch-{case}",
            connector={"name": name, "module_path": module, "extra_config": {}})
        return run_suite([CONNECTOR_TESTS, "--tvc-profile", str(profile),
                          "-k", "resolves_as or every_abstract"],
                         base / f"report-{case}", env=env)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(CASES, pool.map(one, CASES), strict=True))


def test_complete_out_of_tree_connector_passes(runs) -> None:
    run = runs["complete"]
    assert run.test("resolves_as_vllm")["outcome"] == "passed", run.tail()
    t = run.test("every_abstract_method")
    assert t["outcome"] == "passed", run.tail()
    assert run.test("resolves_as_vllm")["properties"]["connector_class"] == (
        "tvc_fake_connector.CompleteConnector")
    assert run.rc == 0


def test_missing_abstract_methods_fail_naming_them(runs) -> None:
    run = runs["incomplete"]
    assert run.test("resolves_as_vllm")["outcome"] == "passed", run.tail()
    t = run.test("every_abstract_method")
    assert t["outcome"] == "failed", run.tail()
    assert "tvc_fake_connector.IncompleteConnector leaves 2 abstract method(s)" in (
        t["message"])
    assert ", ".join(OMITTED) in t["message"]
    assert "implement them" in t["message"]


def test_not_a_connector_subclass_fails(runs) -> None:
    run = runs["not_subclass"]
    t = run.test("resolves_as_vllm")
    assert t["outcome"] == "failed", run.tail()
    assert "'NotAConnector' resolves to" in t["message"]
    assert "not a KVConnectorBase_V1 subclass" in t["message"]


def test_wrong_module_path_fails_naming_it(runs) -> None:
    run = runs["wrong_module"]
    for name in ("resolves_as_vllm", "every_abstract_method"):
        t = run.test(name)
        assert t["outcome"] == "failed", run.tail()
        assert "kv_connector_module_path 'tvc_no_such_module.connector' does not " \
               "import" in t["message"]
        assert "PYTHONPATH" in t["message"] and "connector.module_path" in t["message"]


def test_wrong_class_name_fails_naming_it(runs) -> None:
    run = runs["wrong_class"]
    t = run.test("resolves_as_vllm")
    assert t["outcome"] == "failed", run.tail()
    assert ("kv_connector 'NoSuchConnectorV1': no such class in module "
            "'tvc_fake_connector'") in t["message"]
    assert "correct connector.name" in t["message"]


def test_profile_modules_import_failure_names_the_hint(tmp_path: Path) -> None:
    """``[imports] modules`` (tutti_runtime for Tutti): a missing module fails."""
    profile = fakes.minimal_profile(
        tmp_path / "p.toml", tmp_path / "scratch",
        imports={"modules": ["tvc_runtime_not_built"],
                 "hint": "build the C++ core and put $TUTTI_BUILD_DIR on PYTHONPATH"})
    run = run_suite([CONNECTOR_TESTS, "--tvc-profile", str(profile), "-k",
                     "profile_modules_import"], tmp_path / "r")
    t = run.test("test_profile_modules_import[tvc_runtime_not_built]")
    assert t["outcome"] == "failed", run.tail()
    assert "`import tvc_runtime_not_built` failed" in t["message"]
    assert "Fix: build the C++ core" in t["message"]
