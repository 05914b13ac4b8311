r"""Known upstream defects of a target, run as strict xfails.

A profile lists them as ``[[known_failures]]`` tables (validated by
:mod:`tvc.config.profile`)::

    [[known_failures]]
    test = "suites/e2e/test_external_prefix_hit.py::test_concurrent*"  # node-id glob
    reason = "ExampleConnector drops the hit under concurrent identical prompts"
    link = "https://github.com/vllm-project/vllm/issues/NNNNN"             # required
    vllm = "<0.29"                                     # optional PEP 440 specifier
    match = "returned -\\d+, a negative token count"    # optional: the symptom

Each collected test whose node id matches ``test`` (an exact node id, brackets
included, or an fnmatch glob), on a vLLM in ``vllm``, gets
``pytest.mark.xfail(strict=True)``: it still runs, its failure is reported as the
known defect with the link, and when it passes (the defect is fixed) the run fails
with XPASS(strict) and a message that tells the user to drop the entry, so stale
entries cannot hide a regression for long. With ``match``, only a failure whose text
(exception and message) contains that regex is the known defect; any other failure
of the test (a new fault of a connector that inherits the entry through
``extends``) is reported as a failure that names the entry.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pytest

from tvc.config.profile import (
    Profile,
    installed_vllm_version,
    known_failure_matches,
    version_matches,
)


def xfail_reason(entry: Mapping[str, Any], profile: Profile) -> str:
    """The xfail reason for one entry: the defect, the link, and what to do on XPASS.

    Returns:
        ``"known upstream defect: <reason> (<link>); if this test passes, the defect
        is fixed: drop this [[known_failures]] entry from <profile file>"``.

    """
    return (f"known upstream defect: {entry['reason']} ({entry['link']}); if this "
            "test passes, the defect is fixed: drop this [[known_failures]] entry "
            f"from {profile.source}")


def entries_for(profile: Profile, vllm_version: str | None = None
                ) -> list[Mapping[str, Any]]:
    """The profile's known failures that apply to a vLLM version.

    Args:
        profile: the loaded profile.
        vllm_version: e.g. ``"0.28.0"``; None = the installed vLLM. An entry with a
            ``vllm`` specifier never applies when the version is unknown.

    Returns:
        the applicable ``{test, reason, link, vllm}`` entries.

    """
    version = vllm_version if vllm_version is not None else installed_vllm_version()
    return [e for e in profile["known_failures"]
            if version_matches(version, e["vllm"])]


def unmatched(items: Iterable[pytest.Item], profile: Profile,
              vllm_version: str | None = None) -> list[str]:
    """Entries that name a collected test file but none of its tests.

    Such an entry is stale (the test was renamed or re-parametrized) and would
    silently stop covering its defect. Entries whose file was not collected at all
    (another tier, a ``-k``/path selection) are not reported.

    Args:
        items: the collected tests, before ``-k``/``-m`` deselection.
        profile: the loaded profile.
        vllm_version: as for :func:`entries_for`.

    Returns:
        the ``test`` globs of the stale entries.

    """
    ids = [i.nodeid for i in items]
    out = []
    for entry in entries_for(profile, vllm_version):
        file = entry["test"].split("::")[0]
        in_file = [n for n in ids if n.split("::")[0] == file]
        if in_file and not any(known_failure_matches(entry, n) for n in in_file):
            out.append(entry["test"])
    return out


# item -> the [[known_failures]] entry that named it
KNOWN_FAILURE = pytest.StashKey[Mapping[str, Any]]()
#: every entry that names the test (the first is :data:`KNOWN_FAILURE`)
KNOWN_FAILURES = pytest.StashKey[list[Mapping[str, Any]]]()
SYMPTOM_SEARCH_TIMEOUT_S = 1.0  # per failure text; patterns are probed at load


def failure_message(exc: BaseException) -> str:
    """The messages of a failure and of the exceptions it was raised from.

    ``Type: message`` of ``exc``, of every ``__cause__`` / ``__context__``
    below it and of an exception group's members, one per line, without
    tracebacks: a known failure's ``match``
    names a symptom, and the source lines a traceback lists (e.g. the raise
    statement that every failure of a check shares) are no symptom.

    Args:
        exc: the exception of the failed call phase.

    Returns:
        the messages, outermost first.

    """
    import traceback

    lines: list[str] = []
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        cur = todo.pop(0)
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        lines.extend(traceback.format_exception_only(type(cur), cur))
        # an exception group (hypothesis: several distinct failures) holds the
        # symptoms in its members
        todo.extend(getattr(cur, "exceptions", ()))
        nxt = cur.__cause__ or cur.__context__
        if nxt is not None:
            todo.append(nxt)
    return "".join(lines)


def has_symptom(pattern: str, text: str) -> bool:
    """Whether a known failure's ``match`` regex is in a failure's text.

    Searched with ``regex`` under :data:`SYMPTOM_SEARCH_TIMEOUT_S` (patterns are
    probed at load); a search that times out or a pattern that does not compile
    counts as not found.
    """
    import regex

    try:
        return regex.search(pattern, text, timeout=SYMPTOM_SEARCH_TIMEOUT_S) is not None
    except (TimeoutError, regex.error):
        return False


def check_symptom(item: pytest.Item, call: pytest.CallInfo[Any],
                  report: pytest.TestReport) -> None:
    """Report a known failure's test as failed when its failure is another one.

    Args:
        item: the test.
        call: the phase's call info; only the call phase with an exception counts.
        report: the report pytest's skipping plugin has just xfailed; changed in
            place to ``failed`` when the entry has a ``match`` regex that the
            failure's message (:func:`failure_message`: the exception's and its
            causes' messages, never the traceback's source listing) does not
            contain, with a line naming the entry appended.

    """
    entry = item.stash.get(KNOWN_FAILURE, None)
    pattern = entry.get("match", "") if entry is not None else ""
    # several entries may name one test (each a defect with its own symptom):
    # the failure is a known one when any of their symptoms is in it
    others = [e.get("match", "") for e in item.stash.get(KNOWN_FAILURES, [])]
    if pattern and all(others):
        pattern = "|".join(f"(?:{p})" for p in others) or pattern
    if not (pattern and call.when == "call" and call.excinfo is not None
            and report.skipped and hasattr(report, "wasxfail")):
        return
    if has_symptom(pattern, failure_message(call.excinfo.value)):
        return
    report.outcome = "failed"
    del report.wasxfail
    note = (f"not the known failure {entry['test']!r}: its "  # type: ignore[index]
            f"match {pattern!r} is not in this failure, so this is another fault "
            "(e.g. of a connector that inherits the entry through extends); fix it, "
            "or widen the entry's match if it is the same defect")
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:  # the one-line message (short summary, summary.json)
        crash.message = f"{crash.message} [{note}]"
        report.sections.append(("known failure", note))
    else:
        report.longrepr = f"{report.longreprtext}\n\n{note}"


def note_parent_defect(item: pytest.Item, call: pytest.CallInfo[Any],
                       report: pytest.TestReport, profile: Profile,
                       vllm_version: str | None = None) -> str | None:
    """Name the parent class's known defect a subclass's red shows.

    A profile that extends a profile of another connector class (an
    ExampleConnector subclass with ``extends = "example"``) inherits the parent's
    code but none of its ``[[known_failures]]``
    (:attr:`tvc.config.profile.Profile.parent_defects`): a red of the subclass
    with the parent entry's symptom stays red, and this adds what it is and the
    two ways out. Only a failed call phase of a test no entry of the profile
    names is considered; an entry matches by its ``test`` glob, its ``vllm``
    specifier and, when it has one, its ``match`` regex searched in
    :func:`failure_message` (entries without ``match`` match by test alone).

    Args:
        item: the test.
        call: the phase's call info.
        report: the failed report; its one-line message and sections get the note.
        profile: the run's profile.
        vllm_version: as for :func:`entries_for`.

    Returns:
        the note added, or None.

    """
    if not (profile.parent_defects and call.when == "call" and report.failed
            and call.excinfo is not None
            and item.stash.get(KNOWN_FAILURE, None) is None):
        return None
    version = vllm_version if vllm_version is not None else installed_vllm_version()
    text = failure_message(call.excinfo.value)
    for owner, source, entry in profile.parent_defects:
        if not (known_failure_matches(entry, item.nodeid)
                and version_matches(version, entry.get("vllm", ""))):
            continue
        pattern = entry.get("match", "")
        if pattern and not has_symptom(pattern, text):
            continue
        note = (f"this is {owner}'s known defect ({entry['reason']}; "
                f"{entry['link']}), listed in {source}: "
                f"{profile['connector']['name']} inherits {owner}'s code but not "
                "that profile's [[known_failures]]: fix it in your class, or copy "
                "the entry into your profile if you accept the defect")
        crash = getattr(report.longrepr, "reprcrash", None)
        if crash is not None:  # first, so that a message cut short still says it
            crash.message = (f"[{owner}'s known defect, listed in {source.name}: fix "
                             "it in your class or copy that entry] "
                             f"{crash.message} [{note}]")
        report.sections.append(("parent's known defect", note))
        return note
    return None


def keep_setup_errors(item: pytest.Item, call: pytest.CallInfo[Any],
                      report: pytest.TestReport) -> None:
    """Undo pytest's xfail of a known failure outside its call phase.

    ``pytest.mark.xfail`` turns an exception in ANY phase into "xfailed"; a known
    failure names a defect of the test body, so an error in setup or teardown (a
    missing GPU in strict mode, a server that does not start) must stay an error.

    Args:
        item: the test.
        call: the phase's call info (``call.when``, ``call.excinfo``).
        report: the report pytest's skipping plugin has just adjusted; changed in
            place back to ``failed`` (pytest shows it as an error) when it was
            xfailed in setup or teardown.

    """
    if (call.when != "call" and call.excinfo is not None
            and item.stash.get(KNOWN_FAILURE, None) is not None
            and report.skipped and hasattr(report, "wasxfail")):
        report.outcome = "failed"
        del report.wasxfail


def apply(items: Iterable[pytest.Item], profile: Profile,
          vllm_version: str | None = None) -> list[tuple[str, str]]:
    """Mark every collected test a known failure names as a strict xfail.

    Args:
        items: the collected tests (``pytest_collection_modifyitems``).
        profile: the loaded profile.
        vllm_version: as for :func:`entries_for`.

    Returns:
        ``(node id, test glob)`` for every mark added.

    """
    entries = entries_for(profile, vllm_version)
    marked: list[tuple[str, str]] = []
    if not entries:
        return marked
    for item in items:
        for entry in entries:
            if known_failure_matches(entry, item.nodeid):
                item.add_marker(pytest.mark.xfail(
                    strict=True, reason=xfail_reason(entry, profile)))
                item.stash[KNOWN_FAILURE] = entry
                item.stash[KNOWN_FAILURES] = [
                    e for e in entries if known_failure_matches(e, item.nodeid)]
                marked.append((item.nodeid, entry["test"]))
                break
    return marked
