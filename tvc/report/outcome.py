"""A run's outcome in words: why it stopped, why it did not pass, its verdict.

Read from a ``summary.json`` or, for :func:`stop_reason`, from what pytest and its
plugins leave: ``session.shouldfail`` for ``--maxfail``/``-x`` (under xdist an
``Interrupted``, ``_pytest/main.py``, ``xdist/dsession.py``), pytest-timeout's
``session-timeout: S sec exceeded`` (``pytest_timeout.py``), dead xdist workers not
replaced (``--max-worker-restart``), ``pytest.exit``, SIGTERM/SIGHUP, Ctrl-C.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from tvc.core.run_store import FOREIGN_WRITER

# pytest's exit codes (_pytest.config.ExitCode) as the run's outcome word
OUTCOME_BY_EXIT = {0: "passed", 1: "failed", 2: "interrupted", 3: "internal_error",
                   4: "usage_error", 5: "no_tests"}
_MAXFAIL = re.compile(r"stopping after (\d+) failures?")
_SESSION_TIMEOUT = re.compile(r"session-timeout: ([\d.]+) sec")
_COLLECTION = re.compile(r"(\d+) errors? during collection")


def stop_reason(message: str = "", signal: str = "", interrupted: bool = False,
                exit_message: str = "", dead_workers: int = 0) -> dict[str, str]:
    """Why a run stopped before its last test, as a kind and a sentence.

    Args:
        message: pytest's ``session.shouldstop``/``shouldfail`` or the ``Interrupted``
            text (``stopping after 1 failures``, ``session-timeout: 60 sec
            exceeded``, ``[gw0] node received keyboard-interrupt``).
        signal: ``SIGTERM``/``SIGHUP`` when one stopped the run.
        interrupted: a KeyboardInterrupt ended the run (Ctrl-C unless ``message``
            or ``signal`` says otherwise).
        exit_message: the message of a ``pytest.exit()``.
        dead_workers: xdist workers that died in a run that left tests unrun.

    Returns:
        ``{"kind", "reason"}``, kind ``maxfail``, ``timeout``, ``watchdog``,
        ``signal``, ``exit``, ``collection`` or ``ctrl_c``; ``{}`` if not stopped.

    """
    if m := _MAXFAIL.search(message):
        n = int(m[1])
        return {"kind": "maxfail", "reason": f"stopped after {n} "
                f"failure{'s' if n != 1 else ''} (--maxfail={n}"
                f"{' or -x' if n == 1 else ''})"}
    if m := _SESSION_TIMEOUT.search(message):
        return {"kind": "timeout", "reason": "stopped by the session timeout "
                f"(--session-timeout={m[1]} s, pytest-timeout)"}
    if dead_workers:
        return {"kind": "watchdog", "reason": f"stopped after {dead_workers} xdist "
                "worker(s) died (killed by a watchdog such as pytest-timeout's "
                "thread method, or the OOM killer; the test each one ran is red)"}
    if signal:
        return {"kind": "signal", "reason": f"terminated by {signal}"}
    if exit_message:
        return {"kind": "exit", "reason": f"stopped by pytest.exit(): {exit_message}"}
    if m := _COLLECTION.search(message):  # pytest's Interrupted, no Ctrl-C
        n = int(m[1])
        return {"kind": "collection", "reason": f"stopped: {n} error"
                f"{'s' if n != 1 else ''} during collection (the ERROR lines name "
                "the file; a path option given with a space, --tvc-profile PATH, is "
                "read as a test path: give it with '=')"}
    if interrupted or "keyboard-interrupt" in message:
        return {"kind": "ctrl_c", "reason": "interrupted by Ctrl-C"}
    if message:
        return {"kind": "other", "reason": f"stopped: {message}"}
    return {}


def outcome_reason(summary: Mapping[str, Any]) -> str:
    """Why a run did not pass, in one line (``""`` for a run that passed).

    From ``run`` (older files: by ``exit_status``), ``counts`` and ``coverage``, e.g.
    ``stopped after 1 failure(s) (--maxfail=1 or -x); 12 test(s) never ran``.
    """
    run = summary.get("run") or {}
    c = summary.get("counts") or {}
    status = int(run.get("exit_status", 0) or 0)
    outcome = run.get("outcome") or OUTCOME_BY_EXIT.get(status, f"exit_{status}")
    stop = (run.get("stop") or {}).get("reason", "")
    if outcome == "passed" and not stop:
        return ""
    bad = int(c.get("failed", 0)) + int(c.get("error", 0))
    never = int(c.get("not_run", 0))
    never_s = f"; {never} test(s) never ran" if never else ""
    cov = summary.get("coverage") or {}
    if stop:
        return f"{stop}{never_s}"
    if outcome == "terminated":
        return f"terminated by {run.get('signal') or 'a signal'}{never_s}"
    if outcome == "interrupted":
        return f"interrupted by Ctrl-C{never_s}"
    if outcome == "failed" and not bad and cov.get("strict") and cov.get(
            "missing_overridden"):
        return ("coverage gate (--tvc-require coverage) failed: the connector "
                f"overrides {', '.join(cov['missing_overridden'])} but no test "
                "exercised it with a meaningful input")
    if outcome == "failed":
        return f"{bad} test(s) failed or errored" if bad else "pytest exit status 1"
    return {"internal_error": "pytest hit an internal error",
            "usage_error": "pytest was given bad arguments",
            "no_tests": "no test ran (nothing collected or all deselected)",
            }.get(outcome, f"pytest exit status {status}")


def verdict(s: Mapping[str, Any]) -> tuple[str, str]:
    """(word, one-line explanation) for the run as a whole.

    ``FAIL``: a test failed or errored, or the coverage gate failed; ``INCOMPLETE``:
    stopped otherwise or not runnable; ``NOTHING PASSED``; ``PASS``; ``NO DATA``
    without ``summary.json``.
    """
    c = s.get("counts") or {}
    if not s:
        return "NO DATA", "summary.json is missing"
    bad = c.get("failed", 0) + c.get("error", 0)
    run = s.get("run") or {}
    reason = outcome_reason(dict(s))
    stop = run.get("stop") or {}
    if bad and stop.get("kind") == "maxfail":
        return "FAIL", f"{bad} test(s) failed or errored; {reason}"
    stopped = bool(stop) or run.get("outcome") in ("interrupted", "terminated") or (
        run.get("exit_status") == 2)
    if stopped or (c.get("not_run") and not bad):
        head = f"{bad} test(s) failed or errored; " if bad else ""
        return "INCOMPLETE", (f"{head}{reason or 'the run stopped'} — nothing "
                              "after that point was checked")
    if bad:
        return "FAIL", f"{bad} test(s) failed or errored"
    if reason.startswith("coverage gate"):
        return "FAIL", reason
    status = run.get("exit_status", 0)
    if status not in (0, 5):
        return "INCOMPLETE", (f"{reason or f'exit {status}'}; nothing was "
                              "certified")
    foreign = sum(1 for t in s.get("tests") or () if t.get("outcome") == "skipped"
                  and FOREIGN_WRITER in str(t.get("message", "")))
    unfaulted = (f"; {foreign} store-fault test(s) skipped: another program wrote "
                 "in the store folder, so no store fault was injected"
                 if foreign else "")
    if not c.get("passed"):
        return "NOTHING PASSED", ("every test was skipped, deselected or a known "
                                  f"upstream defect (xfailed){unfaulted}")
    known = (f", {c['xfailed']} known upstream defect(s) (xfailed)"
             if c.get("xfailed") else "")
    return "PASS", (f"{c.get('passed', 0)} passed, {c.get('skipped', 0)} skipped"
                    f"{known}{unfaulted}")


def headline(s: Mapping[str, Any]) -> str:
    """The verdict word, with the run's scope when it was not complete.

    E.g. ``PASS (CPU scope: 89 [cuda] variants not run; certify on a GPU host)``
    (:func:`tvc.report.scope.scope`).
    """
    from tvc.report.scope import scope

    word, _ = verdict(s)
    sc = s.get("scope") or scope(s)
    if word in ("PASS", "NOTHING PASSED") and not sc.get("complete", True):
        return f"{word} ({sc['line']})"
    return word
