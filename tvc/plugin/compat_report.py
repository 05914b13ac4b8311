"""Report :class:`~tvc.contract.compat.HarnessIncompatible` as an error, not a failure.

An unsupported vLLM is the suite's limit, not the connector's fault. The contract
fixtures check the harness's vLLM APIs while setting a test up
(:func:`tvc.contract.compat.check_harness`), so pytest already reports an ERROR
there. Should a shim raise it while a test runs, this plugin turns that call-phase
report into an error of the test's set-up (the harness could not set up the vLLM
objects the test drives): pytest's summary, ``junit.xml`` (``<error>``) and
``summary.json`` (``outcome: error``) count it as an error, and no expected-failure
mark (``[[known_failures]]``) can hide it. Either way the test gets the property
``harness_incompatible`` with the message ("suite harness does not support vLLM
<version>: <API> (<what changed>)"), which the summary page lists.

Registered from the root ``conftest.py`` (``pytest_plugins``).
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

    Outermost wrapper (``tryfirst``), so it sees the report after pytest's
    expected-failure handling and undoes it for this exception.
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
