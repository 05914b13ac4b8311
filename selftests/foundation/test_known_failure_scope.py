"""Known failures belong to one connector class and name one symptom.

* a profile that names its own connector class inherits no ``[[known_failures]]``
  from ``extends`` (a subclass's own copy of the parent's defect is red), unless
  it lists them itself; one of the same class inherits them;
* a ``match`` is searched in the failure's message (and its causes'), never in
  the traceback's source listing: an unrelated failure raised at the same line
  is not the known defect, the known symptom still is.
"""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any

import pytest

from tvc.config import known_failures as kf
from tvc.config.profile import load

KNOWN = '''
[[known_failures]]
test = "suites/contract/test_scenarios.py::test_x*"
reason = "the child's own entry"
link = "https://example.org/1"
'''


def _child(tmp_path: Path, connector: str, own: str = "") -> Path:
    path = tmp_path / "child.toml"
    path.write_text(
        '[profile]\nname = "child"\nextends = "example"\n'
        + (f'[connector]\nname = "{connector}"\nmodule_path = "my_pkg.conn"\n'
           if connector else "")
        + f'[scratch]\ndir = "{tmp_path / "scratch"}"\n' + own)
    return path


def test_a_profile_of_another_connector_class_inherits_no_known_failures(
        tmp_path: Path) -> None:
    parent = load("example")
    assert parent["known_failures"], "premise: example lists known failures"
    child = load(str(_child(tmp_path, "MyExampleSubclass")))
    assert child["known_failures"] == [], child["known_failures"]


def test_its_own_entries_are_kept(tmp_path: Path) -> None:
    child = load(str(_child(tmp_path, "MyExampleSubclass", KNOWN)))
    assert [e["reason"] for e in child["known_failures"]] == ["the child's own entry"]


def test_the_same_connector_class_still_inherits_them(tmp_path: Path) -> None:
    parent = load("example")
    child = load(str(_child(tmp_path, "")))
    assert [e["test"] for e in child["known_failures"]] == [
        e["test"] for e in parent["known_failures"]]


class _Item:
    def __init__(self, entry: dict[str, Any]) -> None:
        self.stash = pytest.Stash()
        self.stash[kf.KNOWN_FAILURE] = entry


class _Report:
    """What check_symptom reads and changes of an xfailed test report."""

    def __init__(self, longreprtext: str) -> None:
        self.skipped = True
        self.outcome = "skipped"
        self.wasxfail = "known upstream defect"
        self.longreprtext = longreprtext
        self.longrepr = longreprtext
        self.sections: list[tuple[str, str]] = []


def _raise(message: str) -> None:
    raise AssertionError(message)  # the shared raise line: "raised FileNotFoundError"


def _judge(message: str, listing: str) -> str:
    entry = {"test": "t*", "match": "raised FileNotFoundError"}
    call = pytest.CallInfo.from_call(lambda: _raise(message), when="call")
    report = _Report(f"{listing}\nE   AssertionError: {message}")
    kf.check_symptom(_Item(entry), call, report)  # type: ignore[arg-type]
    return report.outcome


def test_match_in_the_source_listing_only_is_not_the_known_failure() -> None:
    listing = ('    raise AssertionError(message)  # ... "raised FileNotFoundError"')
    assert _judge("engine step 3 raised KeyError: 'req-7'", listing) == "failed"


def test_match_in_the_message_is_the_known_failure() -> None:
    assert _judge("engine step 3 raised FileNotFoundError: gone", "") == "skipped"


def test_match_in_a_cause_is_the_known_failure() -> None:
    entry = {"test": "t*", "match": "raised FileNotFoundError"}

    def chained() -> None:
        try:
            _raise("engine step 3 raised FileNotFoundError: gone")
        except AssertionError as exc:
            raise AssertionError("scenario store_fault: see above") from exc

    call = pytest.CallInfo.from_call(chained, when="call")
    report = _Report("")
    kf.check_symptom(_Item(entry), call, report)  # type: ignore[arg-type]
    assert report.outcome == "skipped"


class _FailedItem:
    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid
        self.stash = pytest.Stash()


class _Crash:
    def __init__(self, message: str) -> None:
        self.message = message


class _FailedReport:
    """What note_parent_defect reads and changes of a failed test report."""

    def __init__(self, message: str) -> None:
        self.failed = True
        self.longrepr = type("Repr", (), {"reprcrash": _Crash(message)})()
        self.sections: list[tuple[str, str]] = []


PREEMPTION = "suites/contract/test_scenarios.py::test_preemption_and_resume[tp1]"
NEGATIVE = "get_num_new_matched_tokens returned -16, a negative token count"


def _note(tmp_path: Path, connector: str, nodeid: str, message: str,
          vllm: str = "0.28.0") -> tuple[str | None, _FailedReport]:
    child = load(str(_child(tmp_path, connector)))
    call = pytest.CallInfo.from_call(lambda: _raise(message), when="call")
    report = _FailedReport(f"AssertionError: {message}")
    note = kf.note_parent_defect(_FailedItem(nodeid), call, report,  # type: ignore[arg-type]
                                 child, vllm_version=vllm)
    return note, report


def test_a_subclass_red_with_the_parents_symptom_names_the_parents_defect(
        tmp_path: Path) -> None:
    parent = load("example")
    entry = next(e for e in parent["known_failures"]
                 if e["test"].startswith(PREEMPTION.split("[")[0]))
    note, report = _note(tmp_path, "MyExampleSubclass", PREEMPTION, NEGATIVE)
    assert note is not None
    assert note.startswith("this is ExampleConnector's known defect"), note
    assert entry["link"] in note and str(parent.source) in note, note
    assert "MyExampleSubclass inherits ExampleConnector's code" in note, note
    message = report.longrepr.reprcrash.message
    assert message.startswith("[ExampleConnector's known defect, listed in "
                              "example.toml: fix it in your class"), message
    assert message.endswith(f"[{note}]"), message
    assert report.sections == [("parent's known defect", note)]


def test_another_fault_of_the_subclass_gets_no_such_note(tmp_path: Path) -> None:
    note, report = _note(tmp_path, "MyExampleSubclass", PREEMPTION,
                         "request req-3 never finished")
    assert note is None and report.sections == []


def test_the_parents_defect_outside_its_vllm_range_is_not_named(
        tmp_path: Path) -> None:
    note, _ = _note(tmp_path, "MyExampleSubclass", PREEMPTION, NEGATIVE,
                    vllm="0.20.0")
    assert note is None


def test_the_same_class_keeps_no_parent_defects(tmp_path: Path) -> None:
    assert load(str(_child(tmp_path, ""))).parent_defects == ()
    assert load("example").parent_defects == ()


def test_a_symptom_inside_an_exception_group_is_found() -> None:
    """hypothesis reports several distinct failures as an ExceptionGroup whose
    own message names none of them: the members' messages are searched."""
    group = builtins.ExceptionGroup("Hypothesis found 2 distinct failures.", [
        AssertionError("invariant 'x' broken"),
        RuntimeError("engine step 3 raised FileNotFoundError: gone")])
    text = kf.failure_message(group)
    assert "raised FileNotFoundError: gone" in text and "invariant 'x'" in text
    call = pytest.CallInfo.from_call(lambda: (_ for _ in ()).throw(group),
                                     when="call")
    report = _Report("")
    kf.check_symptom(_Item({"test": "t*", "match": "raised FileNotFoundError"}),
                     call, report)  # type: ignore[arg-type]
    assert report.outcome == "skipped"


def _connector_internal_check() -> None:
    raise AssertionError  # what an unrewritten `assert x == y` of a connector raises


def test_a_bare_assert_of_the_code_under_test_names_where_it_was_raised() -> None:
    from tvc.plugin.hooks import _name_bare_assert

    call = pytest.CallInfo.from_call(_connector_internal_check, when="call")
    report = _FailedReport("AssertionError")
    _name_bare_assert(call, report)  # type: ignore[arg-type]
    message = report.longrepr.reprcrash.message
    assert message.startswith("AssertionError: assertion failed in "), message
    assert f"{__file__}:" in message and "(_connector_internal_check)" in message
    assert "raise AssertionError" in message, message
    # an assertion with a message keeps it
    call = pytest.CallInfo.from_call(lambda: _raise("saw 3, expected 2"), when="call")
    report = _FailedReport("AssertionError: saw 3, expected 2")
    _name_bare_assert(call, report)  # type: ignore[arg-type]
    assert report.longrepr.reprcrash.message == "AssertionError: saw 3, expected 2"


def test_a_known_internal_check_of_vllm_names_its_cause(tmp_path) -> None:
    """vLLM's ``assert req_id in self.requests`` in ``_update_from_kv_xfer_finished``
    (a finished_sending after vLLM freed the request at finished_recving) is named
    as vLLM's check with the connector behaviour behind it."""
    from tvc.core.error_hints import describe_failure

    path = tmp_path / "vllm" / "v1" / "core" / "sched" / "scheduler.py"
    path.parent.mkdir(parents=True)
    path.write_text("def _update_from_kv_xfer_finished(self, req_id):\n"
                    "    assert req_id in self.requests\n")
    scope: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), scope)  # noqa: S102

    class Sched:
        requests: dict = {}

    with pytest.raises(AssertionError) as info:
        scope["_update_from_kv_xfer_finished"](Sched(), "req-1")
    text = describe_failure(info.value)
    assert "assert req_id in self.requests — an internal check of vLLM's code" in text
    assert "Known cause: get_finished named a request vLLM no longer tracks" in text
    with pytest.raises(AssertionError) as info:
        _connector_internal_check()
    assert "an internal check of the connector's code" in describe_failure(info.value)
