"""Self-tests: the profile's ``module:function`` hooks resolve through pkgutil.

Three profile keys name a function as ``module:function`` (``[store] factory``,
``connector.worker_report``, ``connector.fault_injector``); each is resolved with
:func:`pkgutil.resolve_name` and each bad value gets one line naming the key, the
value and what is wrong (never a traceback).
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.hw_any


@pytest.mark.parametrize(("name", "message"), [
    ("nocolon", "[store] factory 'nocolon' is not 'module:function'"),
    ("json:", "[store] factory 'json:' is not 'module:function'"),
    ("json:1x", "[store] factory 'json:1x' is not 'module:function'"),
    ("no_such_mod_tvc:f", "[store] factory 'no_such_mod_tvc:f': module "
                          "no_such_mod_tvc does not import (ModuleNotFoundError: No "
                          "module named 'no_such_mod_tvc'); put it on PYTHONPATH"),
    ("json:no_such_fn", "[store] factory 'json:no_such_fn': json has no no_such_fn"),
])
def test_store_factory_errors_are_one_line(name: str, message: str) -> None:
    from tvc.store.gpu_direct import StoreError, load_factory

    with pytest.raises(StoreError) as info:
        load_factory(name)
    assert str(info.value) == message


def test_store_factory_resolves_a_dotted_module() -> None:
    import os.path

    from tvc.store.gpu_direct import load_factory

    assert load_factory("os.path:join") is os.path.join
    assert load_factory("json:decoder.JSONDecoder") is json.decoder.JSONDecoder


@pytest.mark.parametrize(("spec", "message"), [
    ("nocolon", "connector.worker_report = 'nocolon': expected \"module:function\" "
                "or \"standin\""),
    ("no_such_mod_tvc:f", "connector.worker_report = 'no_such_mod_tvc:f': cannot "
                          "import no_such_mod_tvc: No module named "
                          "'no_such_mod_tvc'"),
    ("json:no_such_fn", "connector.worker_report = 'json:no_such_fn': module json "
                        "has no function no_such_fn"),
    ("json:__doc__", "connector.worker_report = 'json:__doc__': module json has no "
                     "function __doc__"),
])
def test_worker_report_errors_are_one_line(spec: str, message: str) -> None:
    from tvc.contract.standins import WorkerReportError, load_worker_report

    with pytest.raises(WorkerReportError) as info:
        load_worker_report(spec, None, None, None)
    assert str(info.value) == message


@pytest.mark.parametrize(("spec", "start"), [
    ("no_such_mod_tvc:f", "connector.fault_injector = 'no_such_mod_tvc:f': "
                          "ModuleNotFoundError: No module named 'no_such_mod_tvc'"),
    ("json:no_such_fn", "connector.fault_injector = 'json:no_such_fn': "
                        "AttributeError: module 'json' has no attribute 'no_such_fn'"),
    ("json:dumps", "connector.fault_injector = 'json:dumps': TypeError: "),
])
def test_fault_injector_errors_are_one_line(spec: str, start: str) -> None:
    from tvc.contract.faults import FaultConfigError, fault_injector_for

    with pytest.raises(FaultConfigError) as info:
        fault_injector_for({"connector": {"fault_injector": spec}}, object())
    assert str(info.value).startswith(start) and "\n" not in str(info.value)


def test_fault_injector_hook_gets_the_rig() -> None:
    from tvc.contract.faults import fault_injector_for

    rig = object()
    got = fault_injector_for({"connector": {"fault_injector": "builtins:id"}}, rig)
    assert got == id(rig)
