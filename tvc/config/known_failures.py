r"""Known upstream defects of a target, run as strict xfails.

A profile's ``[[known_failures]]`` entries (``test`` node-id glob, ``reason``, ``link``,
optional ``vllm`` specifier and ``match`` symptom regex; docs/profiles.md) mark matching
tests ``pytest.mark.xfail(strict=True)``: they still run, an XPASS fails the run and
says to drop the entry, and with ``match`` only a failure showing that symptom is the
known defect. Entry points: :func:`apply`, :func:`check_symptom`.
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
    """The xfail reason for one entry: the defect, the link, and what to do on XPASS."""
    return (f"known upstream defect: {entry['reason']} ({entry['link']}); if this "
            "test passes, the defect is fixed: drop this [[known_failures]] entry "
            f"from {profile.source}")


def entries_for(profile: Profile, vllm_version: str | None = None
                ) -> list[Mapping[str, Any]]:
    """The profile's known-failure entries that apply to a vLLM version.

    ``vllm_version`` None = the installed one; an entry with a ``vllm`` specifier never
    applies when the version is unknown.
    """
    version = vllm_version if vllm_version is not None else installed_vllm_version()
    return [e for e in profile["known_failures"]
            if version_matches(version, e["vllm"])]


def unmatched(items: Iterable[pytest.Item], profile: Profile,
              vllm_version: str | None = None) -> list[str]:
    """``test`` globs of entries naming a collected test file but none of its tests.

    Such an entry is stale (test renamed or re-parametrized); entries whose file was not
    collected are not reported. ``items`` are taken before ``-k``/``-m`` deselection.
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

    ``Type: message`` of ``exc``, its ``__cause__`` / ``__context__`` chain and
    exception group members, one per line, outermost first, without tracebacks (source
    lines shared by every failure of a check are no symptom).
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

    Searched with ``regex`` under :data:`SYMPTOM_SEARCH_TIMEOUT_S`; a timeout or a
    pattern that does not compile counts as not found.
    """
    import regex

    try:
        return regex.search(pattern, text, timeout=SYMPTOM_SEARCH_TIMEOUT_S) is not None
    except (TimeoutError, regex.error):
        return False


def check_symptom(item: pytest.Item, call: pytest.CallInfo[Any],
                  report: pytest.TestReport) -> None:
    """Report a known failure's test as failed when its failure is another one.

    Only a call phase with an exception counts: ``report`` (just xfailed) becomes
    ``failed``, with a line naming the entry, when the entry's ``match`` is not in
    :func:`failure_message`.
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
    """Name the parent class's known defect a subclass's red shows (the note, or None).

    A profile extending another connector class's profile inherits none of its
    ``[[known_failures]]`` (:attr:`tvc.config.profile.Profile.parent_defects`). For a
    failed call phase of a test no own entry names, a parent entry matching by ``test``,
    ``vllm`` and ``match`` (in :func:`failure_message`) adds a note to ``report``.
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

    ``xfail`` catches exceptions in any phase; a known failure is a defect of the test
    body, so a setup/teardown error (no GPU in strict mode, a server that does not
    start) is set back to ``failed`` in ``report``.
    """
    if (call.when != "call" and call.excinfo is not None
            and item.stash.get(KNOWN_FAILURE, None) is not None
            and report.skipped and hasattr(report, "wasxfail")):
        report.outcome = "failed"
        del report.wasxfail


def apply(items: Iterable[pytest.Item], profile: Profile,
          vllm_version: str | None = None) -> list[tuple[str, str]]:
    """Mark every collected test a known failure names as a strict xfail.

    Returns ``(node id, test glob)`` for every mark added.
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
