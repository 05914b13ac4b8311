"""Report :class:`~tvc.contract.compat.HarnessIncompatible` as an error, not a failure.

An unsupported vLLM is the suite's limit, not the connector's fault. Usually caught
at set-up (:func:`tvc.contract.compat.check_harness`); raised in the call phase,
this plugin turns the report into a set-up error that no ``[[known_failures]]``
xfail can hide. The test gets the property ``harness_incompatible`` ("suite harness
does not support vLLM <version>: <API> (<what changed>)"). Registered from the root
``conftest.py`` (``pytest_plugins``).
"""

from __future__ import annotations

from typing import Any

import pytest

from tvc.contract.compat import HarnessIncompatible

PROPERTY = "harness_incompatible"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]
                              ) -> Any:
    """Make a report whose exception is ``HarnessIncompatible`` an error.

    Outermost wrapper (``tryfirst``): it undoes pytest's xfail handling for it.
    """
    rep = yield
    exc = call.excinfo
    if exc is None or not exc.errisinstance(HarnessIncompatible):
        return rep
    rep.outcome = "failed"
    if hasattr(rep, "wasxfail"):
        del rep.wasxfail
    if rep.when == "call":
        # pytest, its JUnit writer and tvc.plugin.report count only set-up and teardown
        # failures as errors
        rep.when = "setup"
    if not any(name == PROPERTY for name, _ in item.user_properties):
        item.user_properties.append((PROPERTY, str(exc.value)))
    rep.user_properties = list(item.user_properties)
    return rep
