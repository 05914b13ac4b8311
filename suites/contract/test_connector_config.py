"""contract (configuration): a bad kv_transfer_config fails at creation, named.

vLLM's factory creates the connector; the failure message names what is wrong.

Required keys come from the profile (``connector.required_extra_config_keys``; a
dotted key such as ``store.options.num_chunks`` names a nested table entry);
type and sign checks apply to the keys it lists in ``connector.size_keys`` (sizes
and counts the connector must validate, dotted likewise; vLLM's own
OffloadingConnector checks only the presence of ``cpu_bytes_to_use``, so its profile
lists none).
"""

from __future__ import annotations

import copy

import pytest

from tvc import contract as C
from tvc.config.profile import pop_extra_config_key

pytestmark = [pytest.mark.contract, pytest.mark.hw_any]


def _create(profile, scratch, ktc) -> str:
    """Create the scheduler-side connector through vLLM; return the error ('' = ok)."""
    try:
        rig = C.make_rig(profile, scratch, kv_transfer_config=ktc,
                        scheduler_only=True)
    except C.HarnessIncompatible:
        raise  # the suite cannot drive this vLLM: an error, not the answer
    except Exception as exc:  # noqa: BLE001 - any creation failure is the answer
        return f"{type(exc).__name__}: {exc}"
    rig.close()
    return ""


# the test's key parameter -> the connector section's list of keys it takes
KEY_LISTS = {
    "test_missing_required_key_fails_at_creation_naming_it":
        "required_extra_config_keys",
    "test_bad_size_value_fails_at_creation_naming_it": "size_keys",
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``key``: the keys the run's profile lists (``[None]``: none, a skip).

    Parametrization happens at collection, before any fixture: the profile comes
    from the plugin's run state (:func:`tvc.plugin.session.run_state`).
    """
    from tvc.plugin import session

    section_key = KEY_LISTS.get(metafunc.function.__name__)
    if section_key is not None:
        profile = session.run_state(metafunc.config).profile
        metafunc.parametrize("key", profile["connector"][section_key] or [None])


def _need(key, section_key: str) -> None:
    if key is None:
        pytest.skip(f"the profile lists no connector.{section_key}; nothing to "
                    "check")


def test_missing_required_key_fails_at_creation_naming_it(
        contract_profile, contract_scratch, key) -> None:
    _need(key, "required_extra_config_keys")
    ktc = copy.deepcopy(contract_profile.kv_transfer_config())
    pop_extra_config_key(ktc["kv_connector_extra_config"], key)  # dotted: nested
    err = _create(contract_profile, contract_scratch, ktc)
    assert err, (f"the connector was created without the required extra-config key "
                 f"{key!r}: it accepted a missing {key} instead of failing at "
                 "creation. Validate required keys in the connector's __init__")
    leaf = key.rsplit(".", 1)[-1]
    assert leaf in err, (f"creating the connector without {key!r} failed, but the "
                         f"message does not name the key: {err[:300]}")


@pytest.mark.parametrize("bad", ["not-a-number", -1], ids=["wrong_type", "negative"])
def test_bad_size_value_fails_at_creation_naming_it(
        contract_profile, contract_scratch, key, bad) -> None:
    _need(key, "size_keys")
    ktc = copy.deepcopy(contract_profile.kv_transfer_config())
    node = ktc["kv_connector_extra_config"]
    *parents, leaf = key.split(".")  # dotted: a nested table entry
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = bad
    err = _create(contract_profile, contract_scratch, ktc)
    assert err, (f"the connector was created with {key}={bad!r}: it accepted an "
                 "invalid size instead of failing at creation")
    assert leaf in err, (f"creating the connector with {key}={bad!r} failed, but "
                         f"the message does not name the key: {err[:300]}")


def test_wrong_class_name_fails_naming_it(contract_profile, contract_scratch) -> None:
    ktc = copy.deepcopy(contract_profile.kv_transfer_config())
    ktc["kv_connector"] = "TvcNoSuchConnectorClass"
    err = _create(contract_profile, contract_scratch, ktc)
    assert err and "TvcNoSuchConnectorClass" in err, (
        f"a wrong kv_connector class name gave {err[:300]!r}; expected a failure "
        "naming 'TvcNoSuchConnectorClass'")


def test_wrong_module_path_fails_naming_it(contract_profile, contract_scratch) -> None:
    ktc = copy.deepcopy(contract_profile.kv_transfer_config())
    ktc["kv_connector_module_path"] = "tvc_no_such_module.connector"
    err = _create(contract_profile, contract_scratch, ktc)
    assert err and "tvc_no_such_module" in err, (
        f"a wrong kv_connector_module_path gave {err[:300]!r}; expected a failure "
        "naming 'tvc_no_such_module'")
